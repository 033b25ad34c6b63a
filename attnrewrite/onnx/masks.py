"""Classify attention masks by evaluating them, not by reading their shape.

Exporters build the same key-padding or causal mask from very different subgraphs (expanded
[B, 1, N, N] tensors, sliced triangle buffers, vmap'd index comparisons). Instead of matching
each spelling, the subgraph that computes a mask is cut out, run on generated inputs (padded
integer inputs, two sequence lengths) and the result compared with a key-only broadcast and a
causal triangle. Anything else, or an additive term that is not 0 / a large negative, is a bias.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from attnrewrite.onnx import bfloat16
from attnrewrite.onnx.detect import OnnxSite, find_onnx_sites
from attnrewrite.onnx.inputs import first_that_runs, generate_inputs
from attnrewrite.site import (
    ATTENTION_BIAS,
    KV_PROBE_PAST,
    MASK_PROBE_BATCH,
    MASK_PROBE_LENGTHS,
    MASK_VARIES_WITH_LENGTH,
    MASKED_BELOW,
    AttentionSite,
    MaskEncoding,
    MaskKind,
    MaskTerm,
    Unsupported,
)

MAX_INLINED_BYTES = 64 * 2**20  # masks read small buffers; never copy a weight into a probe


def probe_lengths(seq: int | None = None) -> tuple[int, int]:
    """The two input lengths the probe starts from: MASK_PROBE_LENGTHS, or the user's ``seq`` and
    half as much again (different lengths, so a mask that is causal only at one is caught)."""
    return MASK_PROBE_LENGTHS if seq is None else (seq, max(seq + 1, seq * 3 // 2))


def classify_masks(model: ir.Model, sites: list[OnnxSite], seq: int | None = None) -> tuple[int, ...] | None:
    """Set ``site.mask`` (or ``site.skip_reason``) for every site that has mask terms.

    The probe starts at ``probe_lengths(seq)``; where the mask's subgraph does not run at a
    length (a convolutional front end needs more samples) it doubles the length until it does,
    then tries the lengths the graph's constants hold (inputs.searched_lengths). A model that
    runs at one length only is probed at that one. Returns the lengths the probe ran at, None
    when there was nothing to probe."""
    pending = [s for s in sites if s.site.skip_reason is None and s.masks]
    if not pending:
        return None
    values = list({id(t.value): t.value for s in pending for t in s.masks}.values())
    try:
        probe = _MaskProbe(model, values)
        runs = _probe_runs(probe, seq, model.graph)
    except Exception as error:  # a mask we cannot run is a mask we do not understand
        if len(pending) > 1:  # ... but it must not hide the masks of the other sites
            lengths = [classify_masks(model, [s], seq) for s in pending]
            return next((found for found in lengths if found is not None), None)
        for s in pending:
            s.site.skip_reason = _not_evaluated(s, error)
            s.site.mask = MaskKind.UNKNOWN
        return None
    for s in pending:
        try:
            kinds = {_classify_site(s, arrays, length) for length, arrays in runs}
        except Unsupported as reason:
            s.site.skip_reason = str(reason)
            s.site.mask = MaskKind.BIAS
            continue
        if len(kinds) != 1:
            kinds = _key_padding_seen_at_one_length(kinds)
        if len(kinds) != 1:
            s.site.skip_reason = MASK_VARIES_WITH_LENGTH
            s.site.mask = MaskKind.UNKNOWN
            continue
        s.site.mask = kinds.pop()
    lengths = tuple(length for length, _ in runs)
    if lengths != probe_lengths(seq):
        for s in pending:
            s.site.provenance["mask_probe_lengths"] = {"asked": list(probe_lengths(seq)), "ran": list(lengths)}
    return lengths


def _probe_runs(probe: _MaskProbe, seq: int | None, graph: ir.Graph) -> list[tuple[int, dict[int, np.ndarray]]]:
    """(length, mask arrays) from each of probe_lengths(seq), at the first length from it that
    runs, each length once; the error of the first start when none runs."""
    runs, errors = {}, []
    for start in probe_lengths(seq):
        try:
            length, arrays = first_that_runs(probe.run, start, graph)
        except Exception as error:
            errors.append(error)
            continue
        runs.setdefault(length, arrays)
    if not runs:
        raise errors[0]
    return list(runs.items())


def _not_evaluated(s: OnnxSite, error: Exception) -> str:
    if s.site.kv_cache is not None:  # inputs.CacheContract made inputs the cache takes: say so in words
        return (
            "could not evaluate the attention mask of a KV-cache site on inputs that follow its cache "
            f"(a past of {KV_PROBE_PAST} positions in {s.site.kv_cache.past_key!r}, the attention mask over "
            "past and new positions): the model's cache contract is not understood"
        )
    return f"could not evaluate the attention mask to classify it ({_first_line(error)})"


def probe_note(sites: list[AttentionSite]) -> str | None:
    """One line when the mask probe had to run on longer inputs than it was asked to."""
    moved = [s.provenance["mask_probe_lengths"] for s in sites if "mask_probe_lengths" in s.provenance]
    if not moved:
        return None
    failed = [n for n in moved[0]["asked"] if n not in moved[0]["ran"]]
    failed, ran = (" and ".join(map(str, lengths)) for lengths in (failed, moved[0]["ran"]))
    return f"mask probe: the mask subgraph does not run on inputs of length {failed}; probed at {ran}"


def _key_padding_seen_at_one_length(kinds: set[MaskKind]) -> set[MaskKind]:
    """Padding a few samples of an audio model's input removes a frame at one length and none
    at another: a key padding mask that kept every key at one probe length is one all the same
    (the rewrite reads which keys are kept from the mask when it runs)."""
    for padded in (MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING):
        unpadded = {MaskKind.KEY_PADDING: MaskKind.NONE, MaskKind.CAUSAL_KEY_PADDING: MaskKind.CAUSAL}[padded]
        if kinds == {padded, unpadded}:
            return {padded}
    return kinds


def _classify_site(s: OnnxSite, arrays: dict[int, np.ndarray], seq: int) -> MaskKind:
    keys = s.static_lengths[1] or seq  # what a contrib mask index counts positions in
    keep = None
    for term in s.masks:
        array = arrays[id(term.value)]
        term.rank = array.ndim
        term_keep = _term_keep(array, term, s, keys)
        if keep is not None and not _broadcastable(keep.shape, term_keep.shape):
            # the logits could not take both terms either: a graph that cannot run
            raise Unsupported(
                f"mask terms of shapes {list(keep.shape)} and {list(term_keep.shape)} do not broadcast together"
            )
        keep = term_keep if keep is None else np.logical_and(keep, term_keep)
    queries, keys = _attention_lengths(s, keep, seq)
    kind = classify_keep_matrix(keep, queries, keys, past=_past_length(s))
    if any(t.key_only for t in s.masks):  # key padding by definition, whether the probe padded or not
        kind = {MaskKind.NONE: MaskKind.KEY_PADDING, MaskKind.CAUSAL: MaskKind.CAUSAL_KEY_PADDING}.get(kind, kind)
    if s.causal_by_attribute:  # fused Attention(is_causal=1) with an extra mask
        kind = {MaskKind.NONE: MaskKind.CAUSAL, MaskKind.KEY_PADDING: MaskKind.CAUSAL_KEY_PADDING}.get(kind, kind)
    return kind


def _attention_lengths(s: OnnxSite, keep: np.ndarray, seq: int) -> tuple[int, int]:
    """(queries, keys) of the logits in a probe run on ``seq``-long inputs. Static lengths are
    known; a dynamic one is ``seq`` unless the mask spans another length: a convolutional front
    end (audio) makes fewer frames than it reads samples, and a mask that broadcasts to the
    logits with an axis longer than 1 has the logits' length there. With a KV cache the keys
    are the past ones and the ``seq`` new ones, the queries only the new ones."""
    static_queries, static_keys = s.static_lengths
    rows, columns = (1,) * max(0, 2 - keep.ndim) + keep.shape[-2:]
    past = _past_length(s)
    keys = static_keys or (columns if columns > 1 else seq + past)
    queries = static_queries or (rows if rows > 1 else keys - past)
    return queries, keys


def _past_length(s: OnnxSite) -> int:
    """The cached positions before the new ones in probe inputs (inputs.CacheContract)."""
    return KV_PROBE_PAST if s.site.kv_cache is not None else 0


def _broadcastable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x == y or 1 in (x, y) for x, y in zip(reversed(a), reversed(b)))


def _term_keep(array: np.ndarray, term: MaskTerm, s: OnnxSite, keys: int) -> np.ndarray:
    if term.batch_first:
        return contrib_keep_matrix(array, term, s.static_batch or MASK_PROBE_BATCH, keys)
    return keep_matrix(array, term.encoding)


def keep_matrix(array: np.ndarray, encoding: MaskEncoding) -> np.ndarray:
    """True where a key is attended to."""
    if encoding is MaskEncoding.ADDITIVE:
        if not np.all((array == 0) | (array <= MASKED_BELOW)):
            raise Unsupported(ATTENTION_BIAS)
        return array == 0
    keep = array.astype(bool)
    return keep if encoding is MaskEncoding.KEEP_WHERE_TRUE else ~keep


def contrib_keep_matrix(array: np.ndarray, term: MaskTerm, batch: int, keys: int) -> np.ndarray:
    """[batch, 1, queries or 1, keys], True where onnxruntime's contrib attention attends: a raw
    mask attends where > 0; a 1-D mask_index holds key lengths ([batch], right padding) or end
    then start positions ([2 * batch], left padding), which sets the term's encoding."""
    if array.ndim == 1:
        positions = np.arange(keys)
        if array.size == batch:
            term.encoding = MaskEncoding.KEY_LENGTHS
            keep = positions < array[:, None]
        elif array.size == 2 * batch:
            term.encoding = MaskEncoding.KEY_RANGES
            ends, starts = array.reshape(2, batch, 1)
            keep = (positions >= starts) & (positions < ends)
        else:
            raise Unsupported(
                f"a 1-D mask index of {array.size} values for batch {batch} is neither key lengths [batch] "
                "nor end and start positions [2 * batch] (packed sequences, [3 * batch + 2], are not supported)"
            )
        return keep[:, None, None, :]
    keep = array > 0
    if array.ndim == 2:  # [batch, keys]
        return keep[:, None, None, :]
    if array.ndim == 3:  # [batch, queries, keys]
        return keep[:, None]
    if array.ndim == 4:  # no CPU kernel to check a reading of its max_sequence_length slicing against
        raise Unsupported("a 4-D mask_index ([batch, 1, max_sequence_length, max_sequence_length]) is not supported")
    raise Unsupported(f"a rank-{array.ndim} attention mask is not one onnxruntime defines")


def classify_keep_matrix(keep: np.ndarray, queries: int, keys: int, past: int = 0) -> MaskKind:
    """``queries`` x ``keys``: the logits' last two dims in the probe run; ``past``: how many of
    the keys are cached ones before the queries' (causal: query i sees keys up to past + i)."""
    keep = keep.reshape((1,) * max(0, 2 - keep.ndim) + keep.shape)
    rows, columns = keep.shape[-2:]
    if columns != keys or rows not in (1, queries):
        raise Unsupported(f"mask of shape {list(keep.shape)} does not line up with {queries} queries x {keys} keys")
    slices = keep.reshape(-1, rows, columns)
    last_row = slices[:, -1:, :]
    if np.array_equal(np.broadcast_to(last_row, slices.shape), slices):
        return MaskKind.NONE if slices.all() else MaskKind.KEY_PADDING
    if keys != queries + past:  # a causal triangle: as many keys as queries, after the cached ones
        raise Unsupported(f"the mask varies over {queries} queries x {keys} keys and is not a key padding mask")
    triangle = np.tril(np.ones((queries, keys), dtype=bool), k=past)
    if np.array_equal(slices, np.broadcast_to(triangle, slices.shape)):
        return MaskKind.CAUSAL
    if np.array_equal(slices, triangle & last_row):
        return MaskKind.CAUSAL_KEY_PADDING
    raise Unsupported("the mask is neither key padding nor causal (e.g. a sliding window or a mask on queries)")


def inputs_marking_padding(model: ir.Model) -> set[str]:
    """Mask inputs whose 1/True means padding (torch's ``key_padding_mask``), not keep (an
    ``attention_mask``), found by evaluating each site's mask with the input all 1 and all 0:
    all 1 keeps no key at all, all 0 keeps some. Inputs that show neither are left out."""
    sites = [s for s in find_onnx_sites(model.graph) if s.site.skip_reason is None and s.masks]
    marked = set()
    for s in sites:
        try:
            marked |= _padding_marked_by_one(model, s)
        except Exception:  # a mask we cannot run: its inputs keep the default pattern
            continue
    return marked


def _padding_marked_by_one(model: ir.Model, s: OnnxSite) -> set[str]:
    values = [t.value for t in s.masks]
    session, names, as_float32 = _probe_session(model, values)

    def feeds_at(length: int) -> dict[str, np.ndarray]:
        feeds = _probe_feeds(model.graph, names, length, as_float32)
        session.run(None, feeds)
        return feeds

    # at the first length the mask's subgraph runs at (a model exported at one length)
    length, feeds = first_that_runs(feeds_at, MASK_PROBE_LENGTHS[0], model.graph)
    keys = s.static_lengths[1] or length + _past_length(s)
    marked = set()
    for name, default in feeds.items():
        if np.issubdtype(default.dtype, np.floating):
            continue

        def keeps_any(fill: int) -> bool:
            outputs = session.run(None, {**feeds, name: np.full_like(default, fill)})
            keeps = [_term_keep(out, t, s, keys) for out, t in zip(outputs, s.masks)]
            return bool(functools.reduce(np.logical_and, keeps).any())  # a causal term keeps some alone

        if not keeps_any(1) and keeps_any(0):
            marked.add(name)
    return marked


class _MaskProbe:
    """The subgraph computing the mask values, as its own onnxruntime session, run on inputs
    generated at a given length."""

    def __init__(self, model: ir.Model, values: list[ir.Value]):
        self.graph, self.values = model.graph, values
        self.session, self.names, self.as_float32 = _probe_session(model, values)

    def run(self, seq: int) -> dict[int, np.ndarray]:
        # a quarter padded: an audio front end pools hundreds of samples into one frame, and
        # padding must remove a frame to show (text probes at MASK_PROBE_LENGTHS pad 2 as before)
        feeds = _probe_feeds(self.graph, self.names, seq, self.as_float32, end_padding=max(2, seq // 4))
        outputs = self.session.run(None, feeds)
        for out in outputs:
            if out.size == 0 or (out.ndim >= 2 and out.shape[-2:] == (1, 1)):
                # a front end that shrinks its input (audio convolutions) made no frame, or one:
                # a mask over one key says nothing about its kind
                raise ValueError(f"the mask has shape {list(out.shape)} on inputs of length {seq}")
        return {id(v): out for v, out in zip(self.values, outputs)}


def _probe_session(model: ir.Model, values: list[ir.Value]) -> tuple[ort.InferenceSession, list[str], bool]:
    """A session computing ``values`` from the graph inputs they read (their names), and
    whether bfloat16 inputs must be fed as float32."""
    graph = model.graph
    inputs = _graph_inputs_reaching(values)
    names = [v.name for v in inputs]
    sub = ir.convenience.extract(graph, inputs=inputs, outputs=values)
    probe = ir.serde.serialize_model(
        ir.Model(sub, ir_version=model.ir_version, functions=list(model.functions.values()))
    )
    _inline_external_data(probe, sub)
    # the CPU provider has no bfloat16 arithmetic (a bf16 model's mask is (1 - m) * min in bf16)
    as_float32 = bfloat16.as_float32(probe)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a probe that fails says why in its exception; no log lines
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, names, as_float32


def _probe_feeds(
    graph: ir.Graph, names: list[str], seq: int, as_float32: bool, end_padding: int = 2
) -> dict[str, np.ndarray]:
    feeds = generate_inputs(graph, batch=MASK_PROBE_BATCH, seq=seq, names=names, end_padding=end_padding)
    if as_float32:
        feeds = {
            name: a.astype(np.float32) if a.dtype == bfloat16.ml_dtypes.bfloat16 else a for name, a in feeds.items()
        }
    return feeds


def _inline_external_data(probe: onnx.ModelProto, graph) -> None:
    """A session built from bytes cannot resolve external data (a causal triangle buffer saved
    beside a big model): the probe carries the bytes of the few small tensors a mask reads."""
    for proto in probe.graph.initializer:
        if proto.data_location != onnx.TensorProto.EXTERNAL:
            continue
        tensor = graph.initializers[proto.name].const_value
        if tensor.nbytes > MAX_INLINED_BYTES:
            raise ValueError(f"the mask reads {proto.name!r}, {tensor.nbytes} bytes of external data")
        proto.raw_data = tensor.tobytes()
        proto.data_location = onnx.TensorProto.DEFAULT
        del proto.external_data[:]


def _graph_inputs_reaching(values: list[ir.Value]) -> list[ir.Value]:
    found, seen, stack = {}, set(), list(values)
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value.is_graph_input() and not value.is_initializer():
            found[id(value)] = value
        node = value.producer()
        if node is not None:
            stack.extend(node.inputs)
    return list(found.values())


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
