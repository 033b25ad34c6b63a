"""Streaming attention (StreamingLLM's cache, Xiao et al., 2023): exact softmax over the first
``sinks`` real keys and the last ``recent`` real keys up to each query, the others dropped. Nothing
to fit, nothing approximated inside the kept keys: the honest baseline a recurrent state is
weighed against at equal bytes (a KV cache of sinks + recent tokens).

"Real" keys are those key_keep keeps: ranks count them alone, so a left-padded row attends as its
unpadded twin. The set is written as two disjoint kinds of key (``sink``: among the first
``sinks`` real keys; ``later``: every other real key) and one count, the later keys up to each
position: query i takes every sink before it and the later keys whose count to i is below
``recent``. The last ``recent`` later keys are the later keys among the last ``recent`` real keys
(while there are at most sinks + recent real keys both are all of them), so this is the method's
definition.

The parallel form is the N x N masked softmax (the original's cost). The recurrent form (causal
sites, passes/recurrent.py) keeps per layer the last ``recent`` later keys (``recent_keys``,
``recent_values``, ``recent_keep``; first, so genai's ``recurrent_state`` holds the recent keys)
and the sinks (``sink_keys``, ``sink_values``, ``sink_keep``), once per key/value head, in order,
oldest first; every tensor is batch-first and of fixed size, and the filled sinks (the sum of
sink_keep) are all the count it needs: while the sinks are not full every real key so far is one.
A call attends over [sinks, recent, new keys] with the same function as the parallel form, then
selects the state after with one-hot products (exact: every other term is a zero)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnxscript import script

from attnrewrite.passes import hooks, recurrent
from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.feature_sums import TINY, site_scale
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.layout import expand_to_query_heads, flatten_heads_function, key_keep_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset, with_callees
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.passes.recurrent import RecurrentLowering, StateTensor
from attnrewrite.site import AttentionSite

NAME = "streaming"
NO_WINDOW = "it is a window of exact keys itself: recent and sinks say which"
attention_weights_unavailable = hooks.no_attention_weights(NAME)
SINK_PARTS = ("sink_keys", "sink_values", "sink_keep")
RECENT_PARTS = ("recent_keys", "recent_values", "recent_keep")


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    # 124 + 4 sinks: a cache of 128 keys, the exact reach of a window=64 kernel hybrid (2W)
    recent: int = option(124, "the last this many real keys up to each query are kept exactly", valid=AtLeast(1))
    sinks: int = option(4, "the first this many real keys are kept exactly for every query", valid=AtLeast(0))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by keeping or dropping keys"
    if not site.mask.causal:
        return "the most recent keys are a decoder's cache: a bidirectional site has no last keys to keep"
    if site_scale(site) is None:
        return "the logits' scale is unknown"
    return None


def nothing_to_fit(options: Options) -> str:
    return "streaming has nothing to fit (the keys it keeps are attended to exactly)"


def exact_part(options: Options, causal: bool = False) -> ExactPart:
    """Every query attends exactly to every key while there are at most sinks + recent of them."""
    kept = options.sinks + options.recent
    return ExactPart(kept, kept, f"recent={options.recent}, sinks={options.sinks}")


# --- torch -----------------------------------------------------------------------------------


def key_kinds(keep, sinks_before, sinks: int):
    """(sink, later) flags [..., N, 1] of new keys whose keep flags are ``keep``, after
    ``sinks_before`` sinks ([..., 1, 1]); the rank of a real key counts the real keys before it."""
    rank = sinks_before + torch.cumsum(keep, dim=-2) - keep
    sink = keep * (rank < sinks).float()
    return sink, keep - sink, rank


def streaming_attention(q, keys, values, sink, later, scale: float, recent: int):
    """Softmax attention of q [..., N, D] over keys [..., P + N, D], the last N of them q's own
    positions (causal), each taking the sinks before it and the later keys whose count to it is
    below ``recent``; float32, 0 for a query without a key."""
    n, total = q.shape[-2], keys.shape[-2]
    count = torch.cumsum(later, dim=-2)  # later keys up to each position
    own = count[..., total - n :, :]  # [..., N, 1]: up to each query
    recent_enough = (own - count.transpose(-2, -1)) < recent
    chosen = (sink.transpose(-2, -1) > 0) | ((later.transpose(-2, -1) > 0) & recent_enough)
    causal = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    allowed = chosen & causal
    logits = torch.where(allowed, (q.float() @ keys.float().transpose(-2, -1)) * scale, LOWEST_LOG_SCALE)
    weights = torch.where(allowed, torch.exp(logits - logits.amax(-1, keepdim=True)), 0.0)
    return (weights @ values.float()) / weights.sum(-1, keepdim=True).clamp_min(TINY)


class StreamingAttention(Module):
    """forward(q, k, v, key_keep=None) -> [..., N, Dv]: the parallel causal form."""

    def __init__(self, scale: float, options: Options):
        super().__init__()
        self.scale, self.sinks, self.recent = scale, options.sinks, options.recent

    def forward(self, q, k, v, key_keep=None):
        shape = (*k.shape[:-1], 1)
        keep = torch.ones(shape, device=k.device) if key_keep is None else key_keep.float().expand(shape)
        sink, later, _ = key_kinds(keep, 0.0, self.sinks)
        out = streaming_attention(q, k, v, sink, later, self.scale, self.recent)
        return out.to(v.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, recent={self.recent}, sinks={self.sinks}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> StreamingAttention:
    """``learnable`` changes nothing: there are no values to fit."""
    return StreamingAttention(site_scale(site), options)


# --- ONNX ------------------------------------------------------------------------------------


@built_once
def attention_function(opset_version: int, recent: int):
    """StreamingSoftmax(q, keys, values, sink, later, scale) on [G, ., .] float32, as
    streaming_attention."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def StreamingSoftmax(q, keys, values, sink, later, scale):
        rows = op.Constant(value_ints=[-2])
        n, total = op.Shape(q, start=-2, end=-1), op.Shape(keys, start=-2, end=-1)
        count = op.CumSum(later, op.Constant(value_int=-2))
        own = op.Slice(count, total - n, total, rows)
        recent_enough = op.Less(own - op.Transpose(count, perm=[0, 2, 1]), op.Constant(value_float=float(recent)))
        zero = op.Constant(value_float=0.0)
        chosen = op.Or(
            op.Transpose(sink, perm=[0, 2, 1]) > zero,
            op.And(op.Transpose(later, perm=[0, 2, 1]) > zero, recent_enough),
        )
        start, step = op.Constant(value_int=0), op.Constant(value_int=1)
        query_position = op.Unsqueeze(op.Range(start, op.Squeeze(n), step), op.Constant(value_ints=[1])) + (total - n)
        causal = op.LessOrEqual(op.Range(start, op.Squeeze(total), step), query_position)
        allowed = op.And(chosen, causal)
        logits = op.MatMul(q, op.Transpose(keys, perm=[0, 2, 1])) * scale
        logits = op.Where(allowed, logits, op.Constant(value_float=LOWEST_LOG_SCALE))
        shifted = op.Exp(logits - op.ReduceMax(logits, op.Constant(value_ints=[-1]), keepdims=1))
        weights = op.Where(allowed, shifted, zero)
        total_weight = op.ReduceSum(weights, op.Constant(value_ints=[-1]), keepdims=1)
        return op.MatMul(weights, values) / op.Max(total_weight, op.Constant(value_float=TINY))

    return StreamingSoftmax


@built_once
def kinds_function(opset_version: int, sinks: int):
    """KeyKinds(keep, sinks_before) -> (sink, later, rank), as key_kinds."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeyKinds(keep, sinks_before):
        rank = sinks_before + op.CumSum(keep, op.Constant(value_int=-2), exclusive=1)
        sink = keep * op.Cast(op.Less(rank, op.Constant(value_float=float(sinks))), to=FLOAT)
        return sink, keep - sink, rank

    return KeyKinds


_ONE = onnx.helper.make_tensor("one", FLOAT, [1], [1.0])


@built_once
def _parallel_entry(opset_version: int, sinks: int, recent: int, key_padding: bool):
    op = standard_opset(opset_version)
    flatten, key_keep_3d = flatten_heads_function(opset_version), key_keep_function(opset_version)
    kinds, attend = kinds_function(opset_version, sinks), attention_function(opset_version, recent)

    @script(ATTNREWRITE, default_opset=op)
    def WithHeadsOf(out, q, v):
        """[G, N, Dv] -> q's leading axes + [N, Dv], in v's dtype."""
        return op.CastLike(op.Reshape(out, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)), v)

    @script(ATTNREWRITE, default_opset=op)
    def CausalStreamingKept(q, k, v, key_keep, scale):
        sink, later, rank = kinds(key_keep_3d(key_keep, k), op.Constant(value_float=0.0))
        return WithHeadsOf(attend(flatten(q), flatten(k), flatten(v), sink, later, scale), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def CausalStreaming(q, k, v, key_keep, scale):
        # every key kept: key_keep is not read
        keys = flatten(k)
        keep = op.ConstantOfShape(op.Concat(op.Shape(keys, end=-1), op.Constant(value_ints=[1]), axis=0), value=_ONE)
        sink, later, rank = kinds(keep, op.Constant(value_float=0.0))
        return WithHeadsOf(attend(flatten(q), keys, flatten(v), sink, later, scale), q, v)

    return CausalStreamingKept if key_padding else CausalStreaming


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights`` has nothing to replace (no fitted values). Without sinks it is a
    GroupQueryAttention's own local window of ``recent`` keys (onnxruntime 1.32 counts the query's
    own key in it: tests/test_streaming_gqa.py measures it against this definition)."""
    entry = _parallel_entry(opset_version, options.sinks, options.recent, site.mask.key_padding)
    functions = [f.to_function_proto() for f in with_callees(entry)]
    constants = {"scale": np.array(site_scale(site), dtype=np.float32)}
    return OnnxLowering(functions, constants, group_query_window=None if options.sinks else options.recent)


# --- the recurrent form (passes/recurrent.py) -----------------------------------------------------


def recurrence(options: Options) -> recurrent.Recurrence:
    return _Recurrence(options)


@dataclasses.dataclass(frozen=True)
class _Recurrence(recurrent.Recurrence):
    options: Options

    def state(self, site: AttentionSite) -> list[StateTensor]:
        return _state(site, self.options)

    def torch_module(self, site: AttentionSite, parallel) -> RecurrentStreaming:
        return RecurrentStreaming(parallel, _state(site, self.options))

    def onnx_lowering(
        self, site: AttentionSite, opset_version: int, weights: dict | None = None, contrib_ops: bool = False
    ) -> RecurrentLowering:
        return _recurrent_lowering(site, self.options, opset_version)


def _state(site: AttentionSite, options: Options) -> list[StateTensor]:
    """The sinks (none when sinks=0) and the recent keys, once per key/value head."""
    kv, s, r = recurrent.key_value_axes(site), options.sinks, options.recent
    sinks = [
        StateTensor("sink_keys", (*kv, s, "D"), "model", 0.0, f"the first {s} real keys"),
        StateTensor("sink_values", (*kv, s, "Dv"), "model", 0.0, "their values"),
        StateTensor("sink_keep", (*kv, s, 1), "float32", 0.0, "1.0 where those keys are filled"),
    ]
    recent = [
        StateTensor(
            "recent_keys", (*kv, r, "D"), "model", 0.0, f"the last {r} real keys after the sinks, oldest first"
        ),
        StateTensor("recent_values", (*kv, r, "Dv"), "model", 0.0, "their values"),
        StateTensor("recent_keep", (*kv, r, 1), "float32", 0.0, "1.0 where those keys are filled"),
    ]
    return [*recent, *(sinks if s else [])]  # recent first: recurrent_state (onnx/state_layout.py)


def selected_recent(flags, recent: int):
    """[..., recent, P]: one-hot rows choosing the last ``recent`` flagged of P positions, oldest
    first, right-aligned (a row with no key is 0)."""
    count = torch.cumsum(flags, dim=-2)
    from_end = count[..., -1:, :] - count  # flagged keys after each position
    slot = recent - 1 - from_end  # [..., P, 1]
    slots = torch.arange(recent, device=flags.device, dtype=flags.dtype)
    return ((slot == slots) & (flags > 0)).float().transpose(-2, -1)


class RecurrentStreaming(Module):
    """forward(q, k, v, key_keep, *state) -> (out, *state after), the state as _state lists it;
    from the empty state, the parallel causal form."""

    def __init__(self, parallel: StreamingAttention, description: list[StateTensor]):
        super().__init__()
        self.parallel = parallel
        self.description = description

    def forward(self, q, k, v, key_keep, *state):
        p = self.parallel
        keep = key_keep.float().expand(*k.shape[:-1], 1)
        recent_keys, recent_values, recent_keep, *sinks = state
        sink_keys, sink_values, sink_keep = sinks or (x[..., :0, :] for x in state)  # sinks=0: none
        sink, later, rank = key_kinds(keep, sink_keep.sum(-2, keepdim=True), p.sinks)
        keys, values = (torch.cat(x, dim=-2) for x in ((sink_keys, recent_keys, k), (sink_values, recent_values, v)))
        sink_flags = torch.cat([sink_keep, torch.zeros_like(recent_keep), sink], dim=-2)
        later_flags = torch.cat([torch.zeros_like(sink_keep), recent_keep, later], dim=-2)
        grouped = (expand_to_query_heads(x, q) for x in (keys, values, sink_flags, later_flags))
        out = streaming_attention(q, *grouped, p.scale, p.recent).to(v.dtype)
        kept_later = torch.cat([recent_keep, later], dim=-2)
        choose = selected_recent(kept_later, p.recent)
        after = [
            (choose @ torch.cat([recent_keys, k], dim=-2).float()).to(k.dtype),
            (choose @ torch.cat([recent_values, v], dim=-2).float()).to(v.dtype),
            choose.sum(-1, keepdim=True),
        ]
        if p.sinks:
            slots = torch.arange(p.sinks, device=k.device, dtype=rank.dtype)
            fill = ((rank == slots) & (sink > 0)).float().transpose(-2, -1)  # [..., sinks, N]
            after += [
                sink_keys + (fill @ k.float()).to(k.dtype),
                sink_values + (fill @ v.float()).to(v.dtype),
                sink_keep + fill.sum(-1, keepdim=True),
            ]
        return (out, *after)

    def extra_repr(self) -> str:
        return f"method=streaming, state={[t.name for t in self.description]}"


@built_once
def _grouped_function(opset_version: int, groups: int):
    """QueryHeads(x): [Gkv, P, F] -> [Gkv * groups, P, F], each key/value head repeated for the
    query heads that read it (query head h reads key/value head h // groups)."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def QueryHeads(x):
        repeated = op.Expand(op.Unsqueeze(x, op.Constant(value_ints=[1])), op.Constant(value_ints=[1, groups, 1, 1]))
        return op.Reshape(repeated, op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=-2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def SameHeads(x):
        return op.Identity(x)

    return QueryHeads if groups > 1 else SameHeads


@built_once
def _selection_functions(opset_version: int, sinks: int, recent: int):
    """(SelectedRecent(flags), SinkFill(rank, sink)) as selected_recent and the sink fill."""
    op = standard_opset(opset_version)
    recent_slots = onnx.numpy_helper.from_array(np.arange(recent, dtype=np.float32), "recent_slots")
    sink_slots = onnx.numpy_helper.from_array(np.arange(sinks, dtype=np.float32), "sink_slots")

    @script(ATTNREWRITE, default_opset=op)
    def SelectedRecent(flags):
        count = op.CumSum(flags, op.Constant(value_int=-2))
        last = op.Slice(
            count, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62]), op.Constant(value_ints=[-2])
        )
        slot = op.Constant(value_float=float(recent - 1)) - (last - count)
        hit = op.And(op.Equal(slot, op.Constant(value=recent_slots)), flags > op.Constant(value_float=0.0))
        return op.Transpose(op.Cast(hit, to=FLOAT), perm=[0, 2, 1])

    @script(ATTNREWRITE, default_opset=op)
    def SinkFill(rank, sink):
        hit = op.And(op.Equal(rank, op.Constant(value=sink_slots)), sink > op.Constant(value_float=0.0))
        return op.Transpose(op.Cast(hit, to=FLOAT), perm=[0, 2, 1])

    return SelectedRecent, SinkFill


@built_once
def _recurrent_entries(opset_version: int, sinks: int, recent: int, groups: int):
    """RecurrentStreaming's entry: with sinks, (q, k, v, key_keep, recent_keys, recent_values,
    recent_keep, sink_keys, sink_values, sink_keep, scale); without, the recent parts only."""
    op = standard_opset(opset_version)
    flatten, key_keep_3d = flatten_heads_function(opset_version), key_keep_function(opset_version)
    kinds, attend = kinds_function(opset_version, sinks), attention_function(opset_version, recent)
    heads = _grouped_function(opset_version, groups)
    select_recent, sink_fill = _selection_functions(opset_version, sinks, recent)

    @script(ATTNREWRITE, default_opset=op)
    def StateRows(x, keys):
        """A state part [..., P, F] as [G, P, F] float32, G that of ``keys`` (a -1 would be
        ambiguous for an empty part)."""
        shape = op.Concat(op.Shape(keys, end=1), op.Shape(x, start=-2), axis=0)
        return op.Reshape(op.Cast(x, to=FLOAT), shape, allowzero=1)  # an empty part's 0 is a size

    @script(ATTNREWRITE, default_opset=op)
    def StateLike(x, like):
        """[G, P, F] float32 -> ``like``'s shape and dtype."""
        return op.CastLike(op.Reshape(x, op.Shape(like), allowzero=1), like)

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentStreamingSinks(
        q, k, v, key_keep, recent_keys, recent_values, recent_keep, sink_keys, sink_values, sink_keep, scale
    ):
        rows = op.Constant(value_ints=[-2])
        keys, vals, keep = flatten(k), flatten(v), key_keep_3d(key_keep, k)
        sk, sv, skeep = StateRows(sink_keys, keys), StateRows(sink_values, keys), StateRows(sink_keep, keys)
        rk, rv, rkeep = StateRows(recent_keys, keys), StateRows(recent_values, keys), StateRows(recent_keep, keys)
        sink, later, rank = kinds(keep, op.ReduceSum(skeep, rows, keepdims=1))
        all_keys = op.Concat(sk, rk, keys, axis=-2)
        all_values = op.Concat(sv, rv, vals, axis=-2)
        sink_flags = op.Concat(skeep, rkeep * op.Constant(value_float=0.0), sink, axis=-2)
        later_flags = op.Concat(skeep * op.Constant(value_float=0.0), rkeep, later, axis=-2)
        out = attend(flatten(q), heads(all_keys), heads(all_values), heads(sink_flags), heads(later_flags), scale)
        shaped = op.CastLike(op.Reshape(out, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)), v)
        choose = select_recent(op.Concat(rkeep, later, axis=-2))
        fill = sink_fill(rank, sink)
        return (
            shaped,
            StateLike(op.MatMul(choose, op.Concat(rk, keys, axis=-2)), recent_keys),
            StateLike(op.MatMul(choose, op.Concat(rv, vals, axis=-2)), recent_values),
            StateLike(op.ReduceSum(choose, op.Constant(value_ints=[-1]), keepdims=1), recent_keep),
            StateLike(sk + op.MatMul(fill, keys), sink_keys),
            StateLike(sv + op.MatMul(fill, vals), sink_values),
            StateLike(skeep + op.ReduceSum(fill, op.Constant(value_ints=[-1]), keepdims=1), sink_keep),
        )

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentStreaming(q, k, v, key_keep, recent_keys, recent_values, recent_keep, scale):
        zero, rows = op.Constant(value_ints=[0]), op.Constant(value_ints=[-2])
        sink_keys = op.Slice(recent_keys, zero, zero, rows)  # no sinks: empty ones
        sink_values = op.Slice(recent_values, zero, zero, rows)
        sink_keep = op.Slice(recent_keep, zero, zero, rows)
        out, rk, rv, rkeep, sk, sv, skeep = RecurrentStreamingSinks(
            q, k, v, key_keep, recent_keys, recent_values, recent_keep, sink_keys, sink_values, sink_keep, scale
        )
        return out, rk, rv, rkeep

    return RecurrentStreamingSinks if sinks else RecurrentStreaming


def _recurrent_lowering(site: AttentionSite, options: Options, opset_version: int) -> RecurrentLowering:
    groups = recurrent.key_value_groups(site)
    entry = _recurrent_entries(opset_version, options.sinks, options.recent, groups)
    functions = [f.to_function_proto() for f in with_callees(entry)]
    constants = {"scale": np.array(site_scale(site), dtype=np.float32)}
    return RecurrentLowering(functions, constants, _state(site, options), key_value_groups=groups)
