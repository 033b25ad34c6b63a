"""Attention masks: how a mask enters the logits, what kind it is, and the key_keep it implies.

A mask enters the logits as a ``site.MaskTerm`` in one of ``site.MaskEncoding``'s encodings (the
ONNX frontend's vocabulary too). Its kind is decided by running the nodes that build it on
made-up inputs (docs/ARCHITECTURE.md, "Frontends"):

- built from constants and sizes only: run it and compare with "nothing masked" and with a
  causal triangle, at the graph's own sizes (or at two made-up sequence lengths when the graph
  has no shapes);
- built from an input tensor: the input must have no query axis ([batch, keys] or
  [batch, 1, 1, keys], so no value of it can express more than a per-key mask), and the mask
  must behave like key padding (plus, maybe, a causal triangle) on two probes, "all keys kept"
  and "the last keys of each row padded", for a 1 = keep or a 0 = keep convention.

Anything else is an additive bias (MaskKind.BIAS) that no linear method can express: the
classification raises ``site.Unsupported`` with the reason. At run time ``key_keep_from_mask``
turns the mask tensor of the graph into the pass modules' ``key_keep`` [..., Nk, 1]: the last
query row sees every key a causal triangle allows, so it holds exactly the padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node

from attnrewrite.fx import evaluate, ops
from attnrewrite.fx.facts import GraphFacts
from attnrewrite.site import (
    ATTENTION_BIAS,
    MASK_PROBE_BATCH,
    MASK_PROBE_LENGTHS,
    MASK_VARIES_WITH_LENGTH,
    MASKED_BELOW,
    MaskEncoding,
    MaskTerm,
    Unsupported,
)


@dataclasses.dataclass
class MaskClass:
    """What a mask provably is (one that is neither is refused: Unsupported)."""

    causal: bool = False
    key_padding: bool = False


# --- run time -----------------------------------------------------------------------------------


def key_keep_from_mask(mask: torch.Tensor, encoding: str) -> torch.Tensor:
    """float [..., Nk, 1]: 1.0 for keys the mask lets the last query attend to, else 0.0."""
    if mask.dim() < 2:
        mask = mask.reshape(1, -1)
    last_row = mask[..., -1:, :]
    encoding = MaskEncoding(encoding).for_dtype(boolean=last_row.dtype == torch.bool)
    if encoding is MaskEncoding.KEEP_WHERE_TRUE:
        keep = last_row.bool()
    elif encoding is MaskEncoding.KEEP_WHERE_FALSE:
        keep = ~last_row.bool()
    else:
        keep = last_row > MASKED_BELOW
    return keep.transpose(-1, -2).to(torch.float32)


def dropped(value: torch.Tensor, encoding: MaskEncoding) -> torch.Tensor:
    """Boolean "this logit is removed" for a probed mask value; Unsupported when it is no mask."""
    encoding = encoding.for_dtype(boolean=value.dtype == torch.bool)
    if encoding is MaskEncoding.KEEP_WHERE_TRUE:
        return ~value.bool()
    if encoding is MaskEncoding.KEEP_WHERE_FALSE:
        return value.bool()
    if value.dtype == torch.bool or not value.dtype.is_floating_point:
        raise Unsupported("an integer or boolean tensor is added to the logits")
    drop = value <= MASKED_BELOW
    if not bool(((value == 0) | drop).all()):
        raise Unsupported(ATTENTION_BIAS)
    return drop


# --- classification -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Inputs:
    data: list[Node]  # inputs whose values the mask reads
    shape_only: list[Node]  # nodes whose shape (not values) the mask reads


def _mask_inputs(facts: GraphFacts, mask: Node) -> _Inputs:
    data: list[Node] = []
    shape_only: list[Node] = []

    def values_read(node: Node) -> list[Node]:
        """The nodes whose values ``node`` reads; inputs and shape reads are recorded."""
        if node.op == "placeholder":
            data.append(node)
            return []
        source = ops.shape_only_source(node)
        if source is not None:
            shape_only.append(source)
            return [n for n in node.all_input_nodes if n is not source]
        return node.all_input_nodes

    read_for_values = set(evaluate.walk(mask, values_read))
    # a node also read for its values is computed (or probed), not made up
    return _Inputs(data, [n for n in dict.fromkeys(shape_only) if n not in read_for_values])


def _causal_pattern(drop: torch.Tensor) -> bool | None:
    """True: a causal triangle in every leading slice; False: nothing dropped; None: other."""
    if not bool(drop.any()):
        return False
    nq, nk = drop.shape[-2:]
    if nq != nk:
        return None
    triangle = torch.ones(nq, nk, dtype=torch.bool).triu(1)
    return True if bool((drop == triangle).all()) else None


def _made_up(facts: GraphFacts, node: Node, length: int, rank: int) -> torch.Tensor:
    """A zero tensor shaped like node: unknown sizes are ``length``, an unknown rank ``rank``."""
    shape = facts.shape(node) or (None,) * rank
    dtype = facts.dtype(node) or facts.default_dtype or torch.float32
    return torch.zeros([length if d is None else d for d in shape], dtype=dtype)


def _key_axis_input_shape(facts: GraphFacts, node: Node, length: int) -> tuple[int, ...]:
    """Shape of a data input of the mask; it must have no query axis (else Unsupported)."""
    shape = facts.shape(node)
    if shape is None:
        return (MASK_PROBE_BATCH, length)
    shape = tuple(length if d is None else d for d in shape)
    inner = [d for d in shape[1:-1] if d != 1]
    if not shape or inner:
        raise Unsupported(f"mask input {node.name!r} of shape {list(shape)} is not a [batch, keys] key mask")
    return shape


def _padding_pattern(shape: tuple[int, ...]) -> torch.Tensor:
    """keep[b, j]: row b keeps all but its last (b % (Nk-1)) + 1 keys (at least one kept)."""
    batch = shape[0] if len(shape) > 1 else 1
    keys = shape[-1]
    if keys < 2:
        raise ValueError("needs at least two keys")
    padded = torch.tensor([b % (keys - 1) + 1 for b in range(batch)])
    keep = torch.arange(keys)[None, :] < (keys - padded)[:, None]
    return keep.reshape(shape)


def _matches_padding(static: torch.Tensor, keep: torch.Tensor, probed: torch.Tensor) -> bool:
    """Whether probed == static OR "key padded in this batch row", batch-major on the first axis.

    ``static`` is the drop pattern with every key kept (nothing or a causal triangle, the same in
    every leading slice), ``keep`` the probe input, ``probed`` the drop pattern it produced.
    """
    keys = keep.shape[-1]
    keep = keep.reshape(-1, keys)
    batch = keep.shape[0]
    if probed.dim() < 2 or probed.shape[-1] != keys:
        return False
    if probed.dim() == 2:
        if batch != 1:
            return False
        probed = probed[None, None]
    elif probed.shape[0] % batch:
        return False
    probed = probed.reshape(batch, -1, *probed.shape[-2:])
    pattern = static.reshape(-1, *static.shape[-2:])[0] if static.dim() >= 2 else static.reshape(1, -1)
    expected = pattern[None, None] | ~keep[:, None, None, :]
    try:
        return bool((probed == expected.expand_as(probed)).all())
    except RuntimeError:
        return False


def classify(facts: GraphFacts, term: MaskTerm) -> MaskClass:
    """Decide what a mask is by probing the nodes that build it (once per mask and encoding:
    models share one mask among all their layers); Unsupported when it is neither causal nor
    key padding."""
    key = ("mask", term.value, term.encoding)
    if key not in facts.memo:
        try:
            facts.memo[key] = _classify(facts, term)
        except Unsupported as reason:
            facts.memo[key] = reason
    if isinstance(facts.memo[key], Unsupported):
        raise Unsupported(str(facts.memo[key]))
    return facts.memo[key]


class _Unevaluated(Unsupported):
    """The probe could not run at this rank of a size-only input: another rank may run."""


def _classify(facts: GraphFacts, term: MaskTerm) -> MaskClass:
    inputs = _mask_inputs(facts, term.value)
    needs_lengths = any(facts.shape(n) is None or None in facts.shape(n) for n in inputs.shape_only + inputs.data)
    lengths = MASK_PROBE_LENGTHS if needs_lengths else (None,)
    # a tensor read only for its sizes may have an unknown rank: all its sizes are the probe
    # length, so any rank its size reads accept will do
    ranks = (4, 3, 2, 1) if any(facts.shape(n) is None for n in inputs.shape_only) else (0,)
    verdicts = []
    for length in lengths:
        for rank in ranks:
            try:
                verdict = _classify_at(facts, term, inputs, length or MASK_PROBE_LENGTHS[0], rank)
                break
            except _Unevaluated as reason:
                if rank == ranks[-1]:
                    raise Unsupported(str(reason)) from None
        verdicts.append((verdict.causal, verdict.key_padding))
    if len(set(verdicts)) > 1:
        raise Unsupported(MASK_VARIES_WITH_LENGTH)
    causal, key_padding = verdicts[0]
    return MaskClass(causal, key_padding)


def _classify_at(facts: GraphFacts, term: MaskTerm, inputs: _Inputs, length: int, rank: int) -> MaskClass:
    env: dict[Node, Any] = {node: _made_up(facts, node, length, rank) for node in inputs.shape_only}
    shapes = {node: _key_axis_input_shape(facts, node, length) for node in inputs.data}

    def probe(keep_value: bool, padded: bool, dtype: torch.dtype):
        for node, shape in shapes.items():
            keep = _padding_pattern(shape) if padded else torch.ones(shape, dtype=torch.bool)
            env[node] = (keep if keep_value else ~keep).to(dtype)
        with torch.no_grad():
            return dropped(evaluate.run_slice(facts.gm, term.value, env), term.encoding)

    if not shapes:
        try:
            static = probe(True, False, torch.bool)
        except Unsupported:  # it runs, and is no mask
            raise
        except Exception as error:  # noqa: BLE001 - any failure means "not understood"
            raise _Unevaluated(f"the mask could not be evaluated ({type(error).__name__}: {error})") from None
        causal = _causal_pattern(static)
        if causal is None:
            raise Unsupported("a constant mask that is neither empty nor a causal triangle")
        return MaskClass(causal=causal)

    known = {facts.dtype(n) for n in shapes}
    dtypes = [known.pop()] if len(known) == 1 and None not in known else [torch.bool, torch.int64, torch.float32]
    keep = _padding_pattern(next(iter(shapes.values())))
    for dtype in dtypes:
        for keep_value in (True, False):
            try:
                static = probe(keep_value, False, dtype)
                padded = probe(keep_value, True, dtype)
            except Exception:  # noqa: BLE001 - this convention does not fit (or is no mask): try the next
                continue
            causal = _causal_pattern(static)
            if causal is not None and _matches_padding(static, keep, padded):
                return MaskClass(causal=causal, key_padding=True)
    names = ", ".join(repr(n.name) for n in shapes)
    raise Unsupported(f"the mask built from input {names} is not a key-padding (or causal) mask")
