"""A site's KV cache: the Concat(past, new) its keys and values are read from, or the past
inputs of a fused attention operator; and the graph inputs that are caches."""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.constants import constant_scalar
from attnrewrite.onnx.detect.common import CachedTensor, OnnxSite, rank_of
from attnrewrite.site import CACHE_WALK_DEPTH, COPY_WALK_DEPTH, KvCache, Unsupported

# --- KV cache -------------------------------------------------------------------------------------
#
# A decoder exported for generation reads the keys and values of earlier steps as graph inputs
# ([batch, kv_heads, past, head_dim]) and appends this step's: Concat(past, new) on the sequence
# axis, also returned as a graph output for the next step. Between that Concat and the attention
# lie only layout ops: k's transpose (4-D, or 3-D between Reshapes), key/value heads repeated for
# grouped-query attention (Unsqueeze, Expand, Reshape; or Tile), a constant scale. Rotary
# embeddings are applied to the new keys before the Concat: the cache holds rotated keys.

_LAYOUT_OPS = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Cast", "Identity", "Mul", "Div"}


def caches_of(k: ir.Value, v: ir.Value) -> tuple[CachedTensor | None, CachedTensor | None]:
    """The caches the attention's keys (``k``: k^T or k) and values are read from: both or neither."""
    key, value = cached_tensor(k), cached_tensor(v)
    if (key is None) != (value is None):
        which, other = ("keys", "values") if key is not None else ("values", "keys")
        cache = (key or value).past.name
        raise Unsupported(f"the {which} include the KV cache {cache!r} but the {other} include none: not understood")
    return key, value


def set_caches(onnx_site: OnnxSite, key: CachedTensor | None, value: CachedTensor | None) -> None:
    onnx_site.key_cache, onnx_site.value_cache = key, value
    if key is None or value is None:
        return
    onnx_site.site.kv_cache = KvCache(
        past_key=key.past.name,
        past_value=value.past.name,
        present_key=key.output.name if key.output is not None else None,
        present_value=value.output.name if value.output is not None else None,
        kv_heads=key.kv_heads,
    )


def cached_tensor(value: ir.Value) -> CachedTensor | None:
    """The cache ``value`` is read from through layout ops; None where it reads none (Unsupported
    where it reads a graph input through something that is not a Concat(past, new))."""
    node = value.producer()
    for _ in range(CACHE_WALK_DEPTH):
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Concat":
            return _cache_concat(node)
        data = _layout_data_input(node)
        if data is None:
            break
        node = data.producer()
    _check_reads_no_cache(node)
    return None


def _layout_data_input(node: ir.Node) -> ir.Value | None:
    """The tensor a layout op moves (None for other ops, and for a product with a tensor)."""
    if node.op_type not in _LAYOUT_OPS:
        return None
    if node.op_type in ("Mul", "Div"):  # a constant scale, on either side of a Mul
        a, b = node.inputs
        if constant_scalar(b) is not None:
            return a
        return b if node.op_type == "Mul" and constant_scalar(a) is not None else None
    return node.inputs[0]


def _cache_concat(concat: ir.Node) -> CachedTensor | None:
    """Concat(past, new) on the sequence axis; None for a Concat that reads no cache input."""
    pasts = [(i, past) for i, v in enumerate(concat.inputs) if v is not None and (past := past_input(v)) is not None]
    if not pasts:
        return None
    (index, past), name = pasts[0], concat.name or "Concat"
    if len(concat.inputs) != 2 or len(pasts) != 1 or index != 0:
        joined = ", ".join(repr(v.name) for v in concat.inputs if v is not None)
        raise Unsupported(f"Concat {name!r} joins {joined}: the cache input {past.name!r} is not Concat(past, new)")
    axis, rank = concat.attributes["axis"].as_int(), rank_of(past)
    if rank is None or axis not in (rank - 2, -2):
        raise Unsupported(
            f"the cache input {past.name!r} is concatenated on axis {axis}, "
            "not the sequence axis of [batch, kv_heads, past, head_dim]"
        )
    present = concat.outputs[0]
    return CachedTensor(concat, past, concat.inputs[1], present, returned(present))


def past_input(value: ir.Value) -> ir.Value | None:
    """The graph input ``value`` is, through Identity, Cast and one-input Concats (the legacy
    exporter's copy of a cache tensor); None for anything computed."""
    for _ in range(COPY_WALK_DEPTH):
        if value.is_graph_input():
            return value if not value.is_initializer() and rank_of(value) == 4 else None
        node = value.producer()
        if node is None or node.op_type not in ("Identity", "Cast", "Concat") or len(node.inputs) != 1:
            return None
        value = node.inputs[0]
    return None


def cache_inputs(graph: ir.Graph) -> dict[str, int]:
    """The graph inputs that are KV caches, each with its sequence (past) axis: those a
    Concat(past, new) appends to (through Identity, Cast, one-input Concats) and the past inputs
    of fused attention operators (com.microsoft Attention packs keys and values in one
    [2, batch, heads, past, head_dim] input)."""
    found = {}
    for value in graph.inputs:
        if value.is_initializer():
            continue
        for node, index in _uses_through_copies(value):
            axis = _past_axis(node, index, rank_of(value))
            if axis is not None:
                found[value.name] = axis
                break
    return found


def _uses_through_copies(value: ir.Value) -> list[tuple[ir.Node, int]]:
    uses, frontier = [], [value]
    for _ in range(COPY_WALK_DEPTH):
        following = []
        for v in frontier:
            for use in v.uses():
                node = use.node
                if node.op_type in ("Identity", "Cast") or (node.op_type == "Concat" and len(node.inputs) == 1):
                    following.append(node.outputs[0])
                else:
                    uses.append((node, use.idx))
        frontier = following
    return uses


# (domain, op) -> the inputs that are caches; com.microsoft's are named in its ContribOperators.md
FUSED_PAST_SLOTS = {
    ("", "Attention"): (4, 5),
    ("com.microsoft", "MultiHeadAttention"): (6, 7),
    ("com.microsoft", "GroupQueryAttention"): (3, 4),
    ("com.microsoft", "Attention"): (4,),
}


def _past_axis(node: ir.Node, index: int, rank: int | None) -> int | None:
    """The sequence axis of input ``index`` of ``node`` (of rank ``rank``) if it is a cache."""
    if node.op_type == "Concat" and node.domain in ("", "ai.onnx"):
        axis = node.attributes["axis"].as_int() if "axis" in node.attributes else None
        return 2 if index == 0 and len(node.inputs) == 2 and rank == 4 and axis in (2, -2) else None
    domain = "" if node.domain == "ai.onnx" else node.domain
    if index not in FUSED_PAST_SLOTS.get((domain, node.op_type), ()):
        return None
    return 3 if (domain, node.op_type) == ("com.microsoft", "Attention") else 2  # [2, batch, heads, past, head_dim]


def returned(present: ir.Value) -> ir.Value | None:
    """The graph output returning ``present``: itself, or an Identity of it."""
    if present.is_graph_output():
        return present
    copies = [u.node.outputs[0] for u in present.uses() if u.node.op_type == "Identity"]
    return next((copy for copy in copies if copy.is_graph_output()), None)


def _check_reads_no_cache(node: ir.Node | None) -> None:
    """Where the layout walk stops at a scatter into a graph input, the cache is a fixed-size
    buffer written in place (a static cache: ScatterND, ScatterElements, TensorScatter), which
    is not understood."""
    if node is None or node.op_type not in _CACHE_WRITES:
        return
    past = past_input(node.inputs[0])
    if past is not None:
        raise Unsupported(
            f"the keys or values are written into the graph input {past.name!r} by {node.op_type} {node.name!r}: "
            "a fixed-size KV cache updated in place, not Concat(past, new), is not understood"
        )


_CACHE_WRITES = {"ScatterND", "ScatterElements", "TensorScatter"}
