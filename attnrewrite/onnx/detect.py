"""Find softmax attention in an ONNX graph and reduce each match to an AttentionSite.

Detection anchors at Softmax, walks back through scale / mask / Cast nodes to the logits
MatMul (q @ k^T), and forward through NaN guards, Cast and Dropout to the MatMul with V.
The standard ``Attention`` operator (opset 23) and onnxruntime's fused ``com.microsoft``
Attention / MultiHeadAttention are accepted as already-fused sites (the latter with a plan for
unpacking their q, k, v). Each site's KV cache is found too, a Concat(past, new) before the
attention or the past inputs of a fused operator; a contrib operator with a cache is listed with
it and refused. Mask kinds are not decided here: masks.py probes them numerically.
"""

from __future__ import annotations

import dataclasses
import enum

import onnx_ir as ir

from attnrewrite.onnx.constants import constant_scalar, known_dims
from attnrewrite.passes._onnx import DOMAIN as REPLACEMENT_DOMAIN
from attnrewrite.site import UPSTREAM_WALK_DEPTH, AttentionSite, KvCache, MaskKind

# An additive term at or below this is "masked out": exp(-1000) underflows to 0 in fp32.
MASKED_BELOW = -1e3


class MaskForm(str, enum.Enum):
    ADDITIVE = "additive"  # logits + m; m is 0 (keep) or <= MASKED_BELOW
    KEEP_WHERE_TRUE = "keep_where_true"  # Where(cond, logits, fill) or a bool attn_mask
    KEEP_WHERE_FALSE = "keep_where_false"  # Where(cond, fill, logits): masked_fill
    # onnxruntime's fused attention (com.microsoft): a raw mask attends where it is > 0; a 1-D
    # mask_index is one of two index forms, told apart when the mask is evaluated (masks.py)
    KEEP_WHERE_POSITIVE = "keep_where_positive"
    KEY_LENGTHS = "key_lengths"  # [batch]: keys before length[b] attend (right padding)
    KEY_RANGES = "key_ranges"  # [2 * batch]: ends, then starts: start[b] <= key < end[b]


@dataclasses.dataclass
class MaskTerm:
    value: ir.Value
    form: MaskForm
    rank: int | None = None  # learned when the mask is evaluated (masks.py)
    # the contrib ops' layout: [batch, keys], [batch, queries, keys], [batch, 1, queries, keys]
    # or a 1-D index, batch first and no head axis; otherwise aligned with the logits' last axes
    batch_first: bool = False

    @property
    def key_only(self) -> bool:
        """A key padding mask by the operator's definition, whatever its values."""
        return self.batch_first and self.rank is not None and self.rank <= 2

    @property
    def keep_rank(self) -> int | None:
        """The rank of the keep tensor the splice builds from this term."""
        return 4 if self.batch_first else self.rank


@dataclasses.dataclass
class OnnxSite:
    """An AttentionSite plus the graph values a replacement node reads and writes."""

    site: AttentionSite
    q: ir.Value
    k_transposed: ir.Value | None  # the logits MatMul's right operand, [..., Dh, Nk]
    k: ir.Value | None  # [..., Nk, Dh], when the graph has it (fused Attention)
    v: ir.Value
    output: ir.Value
    masks: list[MaskTerm]
    nodes: list[ir.Node]
    causal_by_attribute: bool = False
    # (queries, keys) when shape inference knows them: a model exported at a fixed sequence
    # length keeps its masks at that length whatever length the mask probe asks for
    static_lengths: tuple[int | None, int | None] = (None, None)
    # a fused contrib operator holds q, k, v packed (q, k, v above are then its inputs, not
    # [batch, heads, seq, head_dim] tensors): the splice unpacks them with this plan
    packing: PackedHeads | None = None
    static_batch: int | None = None  # tells a 1-D mask index's forms apart when the batch is fixed
    # where the keys and values include a KV cache (site.kv_cache says it frontend-free)
    key_cache: CachedTensor | None = None
    value_cache: CachedTensor | None = None


class Unsupported(Exception):
    """The subgraph looks like attention but cannot be proven to be one we can replace."""


def find_onnx_sites(graph: ir.Graph) -> list[OnnxSite]:
    sites = []
    layer = 0  # attention layers in graph order, counting those an earlier run replaced
    for node in graph:
        if node.domain == REPLACEMENT_DOMAIN:
            # keeps layer numbers (and so --layers) stable when a model is rewritten in steps
            layer += 1
            continue
        if node.domain == CONTRIB_DOMAIN and node.op_type in CONTRIB_ATTENTION:
            sites.append(_match_contrib_attention(node, index=layer))
            layer += 1
            continue
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Softmax":
            sites.append(_match_softmax(node, index=layer))
            layer += 1
        elif node.op_type == "Attention":
            sites.append(_match_fused_attention(node, index=layer))
            layer += 1
    return sites


# --- Softmax-anchored attention -----------------------------------------------------------------


def _match_softmax(softmax: ir.Node, index: int) -> OnnxSite:
    site = AttentionSite(name=softmax.name or f"Softmax_{index}", layer=index)
    logits = softmax.inputs[0]
    placeholder = OnnxSite(site, logits, None, None, logits, softmax.outputs[0], [], [softmax])
    try:
        _check_softmax_axis(softmax)
        walk = _LogitsWalk()
        matmul = walk.back_to_matmul(logits)
        q, q_scale = _strip_scalar_scale(matmul.inputs[0], walk.nodes)
        k_t, k_scale = _strip_scalar_scale(matmul.inputs[1], walk.nodes)
        v, output, forward_nodes = _forward_to_value_matmul(softmax)
        for operand in (q, k_t, v):  # a vector operand makes a matrix-vector product (a valid graph)
            if _rank(operand) is not None and _rank(operand) < 2:
                raise Unsupported(
                    f"q @ k^T or p @ v has a rank-{_rank(operand)} operand {operand.name!r}: not attention"
                )
        caches = _caches_of(k_t, v)
    except Unsupported as reason:
        site.skip_reason = str(reason)
        site.mask = MaskKind.UNKNOWN
        return placeholder

    site.scale = walk.scale * q_scale * k_scale
    _describe_shapes(site, q, v, softmax.inputs[0])
    nodes = [*walk.nodes, matmul, softmax, *forward_nodes]
    site.provenance = {"nodes": [n.name for n in nodes]}
    lengths = _static_dims(softmax.inputs[0], -2, -1)
    site.query_length = lengths[0]
    onnx_site = OnnxSite(site, q, k_t, None, v, output, walk.masks, nodes, static_lengths=lengths)
    _set_caches(onnx_site, *caches)
    return onnx_site


def _check_softmax_axis(softmax: ir.Node) -> None:
    attr = softmax.attributes.get("axis")
    # Before opset 13 the default axis is 1 (and the input is flattened from it): the key
    # axis only for a rank-2 input.
    axis = attr.as_int() if attr is not None else -1 if _default_opset(softmax) >= 13 else 1
    rank = _rank(softmax.inputs[0])
    if axis == -1 or (rank is not None and axis == rank - 1):
        return
    where = f"axis {axis}" + ("" if rank is None else f" of a rank-{rank} tensor")
    raise Unsupported(f"softmax over {where}, not the key axis (the last)")


def _default_opset(node: ir.Node) -> int:
    if node.version is not None:
        return node.version
    imports = node.graph.opset_imports if node.graph is not None else {}
    return imports.get("", imports.get("ai.onnx", 13))


class _LogitsWalk:
    """Walks from the softmax input back to the q @ k^T MatMul, folding scales, collecting masks."""

    def __init__(self):
        self.scale = 1.0
        self.masks: list[MaskTerm] = []
        self.nodes: list[ir.Node] = []

    def back_to_matmul(self, value: ir.Value) -> ir.Node:
        for _ in range(16):
            node = value.producer()
            if node is None:
                raise Unsupported("the softmax input is not computed from a MatMul of q and k")
            if node.domain not in ("", "ai.onnx"):
                raise Unsupported(f"unexpected {node.domain}.{node.op_type} between q @ k^T and softmax")
            if node.op_type == "MatMul":
                return node
            self.nodes.append(node)
            value = self._step(node)
        raise Unsupported("too many nodes between q @ k^T and softmax")

    def _step(self, node: ir.Node) -> ir.Value:
        op = node.op_type
        if op in ("Cast", "Identity"):
            return node.inputs[0]
        if op in ("Mul", "Div"):
            for i, other in ((0, 1), (1, 0)):
                c = constant_scalar(node.inputs[other])
                if c is not None and not (op == "Div" and other == 0):
                    self.scale *= c if op == "Mul" else 1.0 / c
                    return node.inputs[i]
            raise Unsupported(f"logits scaled by a non-constant tensor ({node.name})")
        if op == "Add":
            return self._additive_mask(node)
        if op == "Where":
            return self._where_mask(node)
        if not _reaches_dot_product(node):
            raise Unsupported(
                "the attention scores are not a dot product q @ k^T (additive attention?): "
                f"no MatMul of two activations computes {op} {node.name!r}"
            )
        raise Unsupported(f"{op} node {node.name!r} between q @ k^T and softmax is not understood")

    def _additive_mask(self, node: ir.Node) -> ir.Value:
        a, b = node.inputs
        logits_side = _which_leads_to_matmul(a, b)
        if logits_side is None:
            raise Unsupported(f"cannot tell the logits from the mask in {node.name!r}")
        mask = b if logits_side is a else a
        self.masks.append(MaskTerm(mask, MaskForm.ADDITIVE))
        return logits_side

    def _where_mask(self, node: ir.Node) -> ir.Value:
        cond, x, y = node.inputs
        for logits, fill, form in ((x, y, MaskForm.KEEP_WHERE_TRUE), (y, x, MaskForm.KEEP_WHERE_FALSE)):
            fill_value = constant_scalar(fill)
            if fill_value is not None and fill_value <= MASKED_BELOW:
                self.masks.append(MaskTerm(cond, form))
                return logits
        raise Unsupported(f"Where {node.name!r} on the logits does not fill with a masking constant")


def _is_weight(value: ir.Value) -> bool:
    """A constant operand (initializer or Constant): a projection, not queries or keys."""
    node = value.producer()
    return value.const_value is not None or (node is not None and node.op_type == "Constant")


def _reaches_dot_product(node: ir.Node) -> bool:
    """Whether some MatMul of two activations feeds `node` (UPSTREAM_WALK_DEPTH nodes deep at
    most): the scores of additive attention (v^T tanh(W q + U k)) have none."""
    frontier, seen = [node], set()
    for _ in range(UPSTREAM_WALK_DEPTH):
        following = []
        for current in frontier:
            if id(current) in seen:
                continue
            seen.add(id(current))
            operands = [v for v in current.inputs if v is not None]
            if current.op_type in ("MatMul", "Einsum") and not any(_is_weight(v) for v in operands):
                return True
            following.extend(v.producer() for v in operands if v.producer() is not None)
        if not following:
            return False
        frontier = following
    return True  # deeper than the walk goes: do not claim there is none


def _which_leads_to_matmul(a: ir.Value, b: ir.Value) -> ir.Value | None:
    """The operand of an Add that is the logits path (reaches a MatMul through scale/mask ops)."""
    hits = [v for v in (a, b) if _reaches_matmul(v, depth=UPSTREAM_WALK_DEPTH)]
    return hits[0] if len(hits) == 1 else None


def _reaches_matmul(value: ir.Value, depth: int) -> bool:
    node = value.producer()
    if node is None or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type in ("Cast", "Identity", "Mul", "Div", "Add", "Where"):
        data_inputs = node.inputs[1:] if node.op_type == "Where" else node.inputs
        return any(v is not None and _reaches_matmul(v, depth - 1) for v in data_inputs)
    return False


def _strip_scalar_scale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """Fold Mul/Div by scalar constants on an operand of the logits MatMul (dynamo splits
    1/sqrt(d) as sqrt on q and on k^T)."""
    scale = 1.0
    while (node := value.producer()) is not None and node.op_type in ("Mul", "Div"):
        c = constant_scalar(node.inputs[1])
        if c is not None:
            scale *= c if node.op_type == "Mul" else 1.0 / c
            nodes.append(node)
            value = node.inputs[0]
            continue
        c = constant_scalar(node.inputs[0])
        if c is not None and node.op_type == "Mul":
            scale *= c
            nodes.append(node)
            value = node.inputs[1]
            continue
        if any(_is_scalar(v) for v in node.inputs):
            # a scale computed at run time: taking the scaled tensor for q or k would silently
            # change what every method that reads q and k (or the scale) computes
            raise Unsupported(f"q or k^T is scaled by a scalar that is not a compile-time constant ({node.name!r})")
        break
    return value, scale


def _is_scalar(value: ir.Value) -> bool:
    return value.shape is not None and all(d == 1 for d in value.shape)


def _forward_to_value_matmul(softmax: ir.Node) -> tuple[ir.Value, ir.Value, list[ir.Node]]:
    """Follow the probabilities to the MatMul with V; they must not be used anywhere else."""
    probs = softmax.outputs[0]
    nodes: list[ir.Node] = []
    for _ in range(8):
        _check_not_graph_output(probs)
        users = {use.node for use in probs.uses()}
        guard = _nan_guard(probs, users)
        if guard is not None:
            nodes.extend(users)
            probs = guard.outputs[0]
            continue
        if len(users) != 1:
            names = ", ".join(sorted(f"{u.op_type} {u.name!r}" for u in users)) or "nothing"
            raise Unsupported(f"attention probabilities are used by {names}, not only by the V MatMul")
        (user,) = users
        if user.op_type == "MatMul" and user.inputs[0] is probs and user.inputs[1] is not probs:
            return user.inputs[1], user.outputs[0], [*nodes, user]
        if user.op_type in ("Cast", "Identity") or (user.op_type == "Dropout" and not _dropout_mask_used(user)):
            nodes.append(user)
            probs = user.outputs[0]
            continue
        raise Unsupported(f"attention probabilities flow into {user.op_type} {user.name!r}, not a MatMul with V")
    raise Unsupported("too many nodes between softmax and the V MatMul")


def _check_not_graph_output(probs: ir.Value) -> None:
    if probs.is_graph_output():
        raise Unsupported(f"attention probabilities are a graph output ({probs.name!r})")


def _nan_guard(probs: ir.Value, users: set[ir.Node]) -> ir.Node | None:
    """The dynamo exporter's Where(IsNaN(p), 0, p): returns the Where when `users` is exactly it."""
    if len(users) != 2:
        return None
    by_op = {u.op_type: u for u in users}
    is_nan, where = by_op.get("IsNaN"), by_op.get("Where")
    if is_nan is None or where is None:
        return None
    cond, fill, data = where.inputs
    if cond is not is_nan.outputs[0] or data is not probs or constant_scalar(fill) != 0.0:
        return None
    if len(is_nan.outputs[0].uses()) != 1:
        return None
    return where


def _dropout_mask_used(dropout: ir.Node) -> bool:
    return len(dropout.outputs) > 1 and bool(dropout.outputs[1].uses())


# --- KV cache -------------------------------------------------------------------------------------
#
# A decoder exported for generation reads the keys and values of earlier steps as graph inputs
# ([batch, kv_heads, past, head_dim]) and appends this step's: Concat(past, new) on the sequence
# axis, also returned as a graph output for the next step. Between that Concat and the attention
# lie only layout ops: k's transpose (4-D, or 3-D between Reshapes), key/value heads repeated for
# grouped-query attention (Unsqueeze, Expand, Reshape; or Tile), a constant scale. Rotary
# embeddings are applied to the new keys before the Concat: the cache holds rotated keys.

_LAYOUT_OPS = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Cast", "Identity", "Mul", "Div"}
_CACHE_WALK_DEPTH = 10


@dataclasses.dataclass
class CachedTensor:
    """A site's keys or values: the past (a graph input) followed by this step's, as computed by
    ``node`` (a Concat on the sequence axis, or a fused attention operator that appends)."""

    node: ir.Node
    past: ir.Value  # the graph input, [batch, kv_heads, past, head_dim]
    new: ir.Value  # this step's keys or values, [batch, kv_heads, new, head_dim]
    present: ir.Value | None  # past then new, [batch, kv_heads, past + new, head_dim]
    output: ir.Value | None  # the graph output that returns ``present``, if the model returns it

    @property
    def kv_heads(self) -> int | None:
        return next((d for d in (_static_dims(v, 1)[0] for v in (self.past, self.new)) if d is not None), None)


def _caches_of(k: ir.Value, v: ir.Value) -> tuple[CachedTensor | None, CachedTensor | None]:
    """The caches the attention's keys (``k``: k^T or k) and values are read from: both or neither."""
    key, value = cached_tensor(k), cached_tensor(v)
    if (key is None) != (value is None):
        which, other = ("keys", "values") if key is not None else ("values", "keys")
        cache = (key or value).past.name
        raise Unsupported(f"the {which} include the KV cache {cache!r} but the {other} include none: not understood")
    return key, value


def _set_caches(onnx_site: OnnxSite, key: CachedTensor | None, value: CachedTensor | None) -> None:
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
    for _ in range(_CACHE_WALK_DEPTH):
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
    axis, rank = concat.attributes["axis"].as_int(), _rank(past)
    if rank is None or axis not in (rank - 2, -2):
        raise Unsupported(
            f"the cache input {past.name!r} is concatenated on axis {axis}, "
            "not the sequence axis of [batch, kv_heads, past, head_dim]"
        )
    present = concat.outputs[0]
    return CachedTensor(concat, past, concat.inputs[1], present, _returned(present))


def past_input(value: ir.Value) -> ir.Value | None:
    """The graph input ``value`` is, through Identity, Cast and one-input Concats (the legacy
    exporter's copy of a cache tensor); None for anything computed."""
    for _ in range(4):
        if value.is_graph_input():
            return value if not value.is_initializer() and _rank(value) == 4 else None
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
            axis = _past_axis(node, index, _rank(value))
            if axis is not None:
                found[value.name] = axis
                break
    return found


def _uses_through_copies(value: ir.Value) -> list[tuple[ir.Node, int]]:
    uses, frontier = [], [value]
    for _ in range(4):
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
_FUSED_PAST_SLOTS = {
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
    if index not in _FUSED_PAST_SLOTS.get((domain, node.op_type), ()):
        return None
    return 3 if (domain, node.op_type) == ("com.microsoft", "Attention") else 2  # [2, batch, heads, past, head_dim]


def _returned(present: ir.Value) -> ir.Value | None:
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


# --- fused Attention (opset 23) -----------------------------------------------------------------


def _match_fused_attention(node: ir.Node, index: int) -> OnnxSite:
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    q, k, v, attn_mask, past_key, past_value = inputs[:6]
    onnx_site = _fused_site(node, index, q, k, v)
    site = onnx_site.site
    try:
        caches = _fused_caches(node, k, v, past_key, past_value)
    except Unsupported as reason:
        return _refused(onnx_site, str(reason))
    reason = _fused_attention_limits(node, q, cached=caches[0] is not None)
    if reason:
        return _refused(onnx_site, reason)
    attrs = node.attributes
    onnx_site.causal_by_attribute = bool(attrs["is_causal"].as_int()) if "is_causal" in attrs else False
    if attn_mask is not None:
        form = MaskForm.KEEP_WHERE_TRUE if attn_mask.dtype == ir.DataType.BOOL else MaskForm.ADDITIVE
        onnx_site.masks.append(MaskTerm(attn_mask, form))
    _describe_shapes(site, q, v, None)
    site.num_heads = _static(q.shape[1])  # the operator defines 4-D inputs as [B, H, N, D]
    onnx_site.static_lengths = (_static_dims(q, -2)[0], _static_dims(k, -2)[0])
    site.query_length = onnx_site.static_lengths[0]
    _set_scale(site, node, zero_is_default=False)
    _set_caches(onnx_site, *caches)
    return onnx_site


def _fused_caches(node: ir.Node, k, v, past_key, past_value) -> tuple[CachedTensor | None, CachedTensor | None]:
    """Attention (opset 23) appends k and v to past_key and past_value (graph inputs) and
    returns them as present_key and present_value (outputs 1 and 2); its causal mask is then
    aligned to the last key (query i sees keys up to past + i), as a Concat(past, new) decoder's.
    Without past inputs its k and v may still hold a cache: the dynamo exporter at opset 23
    writes scaled_dot_product_attention over Concat(past, new) as one."""
    if past_key is None and past_value is None:
        return _caches_of(k, v)
    if past_key is None or past_value is None:
        raise Unsupported("Attention with only one of past_key and past_value is not understood")
    caches = []
    for past, new, slot in ((past_key, k, 1), (past_value, v, 2)):
        if past_input(past) is None:
            raise Unsupported(f"Attention's past cache {past.name!r} is computed in the graph, not a graph input")
        present = node.outputs[slot] if len(node.outputs) > slot else None
        output = _returned(present) if present is not None else None
        caches.append(CachedTensor(node, past_input(past), new, present, output))
    return caches[0], caches[1]


def _fused_site(node: ir.Node, index: int, q: ir.Value, k: ir.Value | None, v: ir.Value) -> OnnxSite:
    """A site for one fused attention node: the node is all the splice removes."""
    site = AttentionSite(name=node.name or f"{node.op_type}_{index}", layer=index)
    site.provenance = {"nodes": [node.name]}
    return OnnxSite(site, q, None, k, v, node.outputs[0], [], [node], causal_by_attribute=False)


def _refused(onnx_site: OnnxSite, reason: str) -> OnnxSite:
    onnx_site.site.skip_reason = reason
    onnx_site.site.mask = MaskKind.UNKNOWN
    return onnx_site


def _set_scale(site: AttentionSite, node: ir.Node, zero_is_default: bool) -> None:
    """The ``scale`` attribute, else the operators' default 1/sqrt(head_dim) (onnxruntime's
    contrib ops write 0 for the default)."""
    attr = node.attributes.get("scale")
    if attr is not None and not (zero_is_default and attr.as_float() == 0.0):
        site.scale = attr.as_float()
    elif site.head_dim is not None:
        site.scale = site.head_dim**-0.5
    else:
        site.skip_reason = f"{node.op_type} without a scale attribute and with an unknown head size"


def _fused_attention_limits(node, q, cached: bool) -> str | None:
    attrs = node.attributes
    qk = node.outputs[3] if len(node.outputs) > 3 else None
    if qk is not None and (qk.uses() or qk.is_graph_output()):
        return "Attention's qk output (the attention scores) is used"
    presents = [out for out in node.outputs[1:3] if out is not None and (out.uses() or out.is_graph_output())]
    if presents and not cached:
        return "Attention's present key/value outputs are used without a past cache"
    if "softcap" in attrs and attrs["softcap"].as_float() != 0.0:
        return "Attention with softcap is not expressible by linear methods"
    if _rank(q) != 4:
        return "Attention with 3-D inputs (heads packed into features) is not supported; 4-D expected"
    if q.shape is not None and node.inputs[1].shape is not None:
        qh, kh = q.shape[1], node.inputs[1].shape[1]
        # grouped key/value heads are repeated by the splice; that needs both counts
        if not (isinstance(qh, int) and isinstance(kh, int) and qh % kh == 0):
            return (
                f"grouped-query Attention ({qh} query heads, {kh} key heads): "
                "the head counts must be static, the key heads dividing the query heads"
            )
    return None


# --- onnxruntime's fused attention (com.microsoft) ---------------------------------------------
#
# onnxruntime's transformer optimizer (and Olive) fuse a BERT's attention into one contrib
# operator that also projects (Attention: input @ packed weights + bias) or takes q, k, v with
# heads packed into features (MultiHeadAttention). The site records how they are packed; the
# splice unpacks them around the replacement. Inputs are named as in onnxruntime's
# docs/ContribOperators.md.

CONTRIB_DOMAIN = "com.microsoft"
CONTRIB_ATTENTION = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


class HeadLayout(str, enum.Enum):
    FEATURES = "[batch, seq, heads * head_dim]"
    PACKED = "[batch, seq, heads, n, head_dim]"  # packed kv (n = 2) or qkv (n = 3): take `index`
    HEADS = "[batch, heads, seq, head_dim]"


@dataclasses.dataclass
class HeadSource:
    value: ir.Value | None  # None: a slice of the Attention operator's projection
    layout: HeadLayout = HeadLayout.FEATURES
    index: int = 0


@dataclasses.dataclass
class PackedHeads:
    """How a contrib operator holds q, k and v: the splice builds each as [batch, heads, seq,
    head_dim] from its source (adding its slice of ``bias``), and merges the replacement's
    output back to [batch, seq, heads * head_dim]."""

    num_heads: int
    sources: tuple[HeadSource, HeadSource, HeadSource]
    sizes: tuple[int | None, int | None, int | None]  # hidden sizes of q, k, v (heads * head_dim)
    projection: tuple[ir.Value, ir.Value] | None = None  # (input, weights): q | k | v = input @ weights
    bias: ir.Value | None = None  # [q, k, v hidden sizes]


def _match_contrib_attention(node: ir.Node, index: int) -> OnnxSite:
    inputs = [*node.inputs, *[None] * (10 - len(node.inputs))]
    onnx_site = _fused_site(node, index, inputs[0], inputs[1], inputs[2])
    site = onnx_site.site
    site.kv_cache = _contrib_cache(node)  # listed with the site, which is refused for it below
    try:
        _check_no_cache_inside(node)
        _check_contrib_limits(node)
        if node.op_type == "Attention":
            packing, masks = _attention_packing(node, inputs)
        else:
            packing, masks = _multi_head_packing(node, inputs)
        _check_no_cache_before(onnx_site, packing)
    except Unsupported as reason:
        return _refused(onnx_site, str(reason))
    attrs = node.attributes
    onnx_site.packing, onnx_site.masks = packing, masks
    onnx_site.static_batch = _static_dims(inputs[0], 0)[0]
    onnx_site.static_lengths = _contrib_lengths(packing)
    site.query_length = onnx_site.static_lengths[0]
    onnx_site.causal_by_attribute = bool(attrs["unidirectional"].as_int()) if "unidirectional" in attrs else False
    heads = packing.num_heads
    q_size, _, v_size = packing.sizes
    site.rank, site.num_heads = 4, heads
    site.head_dim = q_size // heads if q_size is not None else None
    site.value_dim = v_size // heads if v_size is not None else None
    dtype = next((v.dtype for v in (inputs[0], inputs[1]) if v is not None and v.dtype is not None), None)
    if dtype is not None:
        site.dtype = dtype.numpy().name
    _set_scale(site, node, zero_is_default=True)
    fill = attrs["mask_filter_value"].as_float() if "mask_filter_value" in attrs else -10000.0
    if fill > MASKED_BELOW and (any(t.batch_first for t in masks) or onnx_site.causal_by_attribute):
        return _refused(
            onnx_site,
            f"{node.op_type} masks with mask_filter_value={fill:g}, which leaves masked keys a weight: a bias, not a mask",
        )
    return onnx_site


def _contrib_cache(node: ir.Node) -> KvCache | None:
    """The cache a contrib operator appends to inside itself: past key and value inputs (one
    packed ``past`` [2, batch, heads, past, head_dim] for Attention), present outputs 1 and 2
    (one packed ``present`` for Attention)."""
    slots = _FUSED_PAST_SLOTS[("com.microsoft", node.op_type)]
    if not any(_has_input(node, i) for i in slots):
        return None
    (key, value), (present_key, present_value) = (slots * 2, (1, 1)) if len(slots) == 1 else (slots, (1, 2))

    def name(i: int) -> str:
        return node.inputs[i].name if _has_input(node, i) else ""

    def returned(i: int) -> str | None:
        out = node.outputs[i] if i < len(node.outputs) else None
        return out.name if out is not None and out.is_graph_output() else None

    heads = node.attributes.get("kv_num_heads") or node.attributes.get("num_heads")
    return KvCache(
        name(key), name(value), returned(present_key), returned(present_value), heads.as_int() if heads else None
    )


def _contrib_lengths(packing: PackedHeads) -> tuple[int | None, int | None]:
    """(queries, keys) when the shapes say them."""
    if packing.projection is not None:  # Attention: self-attention over its input
        n = _static_dims(packing.projection[0], 1)[0]
        return n, n
    q, k = packing.sources[:2]
    return _static_dims(q.value, 1)[0], _static_dims(k.value, 2 if k.layout is HeadLayout.HEADS else 1)[0]


# Where a fused decoder attention's cache lives, the splice would have to unpack the operator
# around a recurrence (packed heads, the cache appended inside): it does not, and says so with
# what the user can do instead.
FUSED_DECODER_ADVICE = (
    "attnrewrite rewrites it neither in parallel nor with --recurrent; rewrite the decoder as exported, before "
    "onnxruntime's fusion (--recurrent takes KV caches appended by Concat or by opset-23 Attention)"
)


def fused_cache_inside(op: str, inputs: list[str]) -> str:
    """Why a contrib operator that appends to its own KV cache is left alone."""
    return f"{CONTRIB_DOMAIN}.{op} keeps its KV cache inside the operator ({', '.join(inputs)}): {FUSED_DECODER_ADVICE}"


def fused_cache_before(op: str, past: str) -> str:
    """Why a contrib operator whose keys are a Concat(past, new) made outside it is left alone."""
    return (
        f"{CONTRIB_DOMAIN}.{op} attends over the KV cache {past!r} (a Concat of past and new keys before it) "
        f"with q, k and v packed: {FUSED_DECODER_ADVICE}"
    )


# the inputs through which each contrib operator holds a cache; GroupQueryAttention always does
# (seqlens_k and total_sequence_length are required: it runs against the cache it appends to)
_CACHE_INPUTS = {"Attention": (4, 6), "MultiHeadAttention": (6, 7, 8, 9), "GroupQueryAttention": (3, 4, 5, 6)}


def _check_no_cache_inside(node: ir.Node) -> None:
    names = [_input_name(node, i) for i in _CACHE_INPUTS[node.op_type] if _has_input(node, i)]
    if names or node.op_type == "GroupQueryAttention":
        raise Unsupported(fused_cache_inside(node.op_type, names))


def _check_no_cache_before(onnx_site: OnnxSite, packing: PackedHeads) -> None:
    """MultiHeadAttention given past and new keys and values as inputs (onnxscript's fusion of
    scaled_dot_product_attention over Concat(past, new)): a KV-cache site, listed as one."""
    keys, values = (source.value for source in packing.sources[1:])
    if keys is None or values is None:  # Attention projects its keys from its input
        return
    key, value = _caches_of(keys, values)
    if key is not None:
        _set_caches(onnx_site, key, value)
        raise Unsupported(fused_cache_before(onnx_site.nodes[0].op_type, key.past.name))


def _check_contrib_limits(node: ir.Node) -> None:
    op, attrs = node.op_type, node.attributes
    used = [
        f"output {i}"
        for i, out in enumerate(node.outputs)
        if i > 0 and out is not None and (out.uses() or out.is_graph_output())
    ]
    if used:
        raise Unsupported(f"{op}'s present key/value or qk outputs are used ({', '.join(used)})")
    if "do_rotary" in attrs and attrs["do_rotary"].as_int():
        raise Unsupported(f"{op} applies rotary embeddings inside the operator (do_rotary=1)")
    if "num_heads" not in attrs or attrs["num_heads"].as_int() <= 0:
        raise Unsupported(f"{op} without a positive num_heads")


_CONTRIB_INPUT_NAMES = {
    "Attention": ("input", "weights", "bias", "mask_index", "past", "attention_bias", "past_sequence_length"),
    "GroupQueryAttention": ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"),
    "MultiHeadAttention": (
        "query",
        "key",
        "value",
        "bias",
        "key_padding_mask",
        "attention_bias",
        "past_key",
        "past_value",
        "past_sequence_length",
        "cache_indirection",
    ),
}


def _input_name(node: ir.Node, i: int) -> str:
    return _CONTRIB_INPUT_NAMES[node.op_type][i]


def _has_input(node: ir.Node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i] is not None


def _attention_packing(node: ir.Node, inputs: list) -> tuple[PackedHeads, list[MaskTerm]]:
    """Attention: q | k | v = input @ weights (+ bias), split by qkv_hidden_sizes."""
    x, weights, bias, mask_index, _, attention_bias = inputs[:6]
    heads = node.attributes["num_heads"].as_int()
    total = _static_dims(weights, -1)[0] if _rank(weights) == 2 else None
    if total is None:
        raise Unsupported("Attention weights of unknown shape: q, k and v cannot be split from them")
    attr = node.attributes.get("qkv_hidden_sizes")
    sizes = tuple(attr.as_ints()) if attr is not None else (total // 3,) * 3
    if len(sizes) != 3 or sum(sizes) != total or sizes[0] != sizes[1]:
        raise Unsupported(
            f"Attention's hidden sizes {list(sizes)} do not split weights of {total} columns into q, k, v"
        )
    _check_divisible(sizes, heads)
    sources = (HeadSource(None), HeadSource(None), HeadSource(None))
    packing = PackedHeads(heads, sources, sizes, projection=(x, weights), bias=bias)
    return packing, _contrib_masks(mask_index, attention_bias, x)


def _multi_head_packing(node: ir.Node, inputs: list) -> tuple[PackedHeads, list[MaskTerm]]:
    """MultiHeadAttention: q, k, v separate ([batch, seq, hidden]; k and v may be split into
    heads already), k and v packed ([batch, seq, heads, 2, head_dim]) or all three packed."""
    query, key, value, bias, key_padding_mask, attention_bias = inputs[:6]
    heads = node.attributes["num_heads"].as_int()
    if key is None:
        if value is not None or _rank(query) not in (5, None):
            raise Unsupported(
                "MultiHeadAttention without a key input needs packed qkv [batch, seq, heads, 3, head_dim]"
            )
        sources = tuple(HeadSource(query, HeadLayout.PACKED, i) for i in range(3))
        size = _packed_hidden(query, heads)
        sizes = (size, size, size)
    elif value is None:
        if _rank(key) not in (5, None):
            raise Unsupported(
                "MultiHeadAttention without a value input needs packed kv [batch, seq, heads, 2, head_dim]"
            )
        sources = (HeadSource(query), HeadSource(key, HeadLayout.PACKED, 0), HeadSource(key, HeadLayout.PACKED, 1))
        size = _packed_hidden(key, heads)
        sizes = (_hidden_features(query) or size, size, size)
    else:
        k_layout, v_layout = _key_value_layout(key), _key_value_layout(value)
        if bias is not None and HeadLayout.HEADS in (k_layout, v_layout):
            raise Unsupported("MultiHeadAttention with a bias and key/value already split into heads is not supported")
        sources = (HeadSource(query), HeadSource(key, k_layout), HeadSource(value, v_layout))
        sizes = (_hidden_features(query), *(_hidden_features(x, heads) for x in (key, value)))
    if bias is not None and None in sizes:
        raise Unsupported(
            "MultiHeadAttention with a bias and q, k, v of unknown hidden sizes: the bias cannot be split"
        )
    _check_divisible(sizes, heads)
    return PackedHeads(heads, sources, sizes, bias=bias), _contrib_masks(key_padding_mask, attention_bias, query)


def _key_value_layout(value: ir.Value) -> HeadLayout:
    rank = _rank(value)
    if rank == 4:
        return HeadLayout.HEADS
    if rank == 3 or _projected_features(value) is not None:
        return HeadLayout.FEATURES  # a projection's output: heads still packed into features
    raise Unsupported(
        f"cannot tell whether {value.name!r} is [batch, seq, hidden] or [batch, heads, seq, head_dim] (unknown rank)"
    )


def _contrib_masks(mask: ir.Value | None, attention_bias: ir.Value | None, batch_of: ir.Value) -> list[MaskTerm]:
    terms = []
    if mask is not None:
        _check_index_declaration(mask, batch_of)
        terms.append(MaskTerm(mask, MaskForm.KEEP_WHERE_POSITIVE, batch_first=True))
    if attention_bias is not None:  # [batch or 1, heads or 1, queries, keys]: a mask if its values say so
        terms.append(MaskTerm(attention_bias, MaskForm.ADDITIVE))
    return terms


def _check_index_declaration(mask: ir.Value, batch_of: ir.Value) -> None:
    """A 1-D mask index is key lengths [batch] or end and start positions [2 * batch]; the
    probe tells them apart by its size. A graph input is probed with generated values of its
    declared size, so that size must say which it is."""
    if not mask.is_graph_input() or _rank(mask) != 1 or batch_of.shape is None or _rank(batch_of) is None:
        return
    size, batch = mask.shape[0], batch_of.shape[0]
    same_symbol = str(size) == str(batch) and str(size) not in ("None", "")
    if not same_symbol and not (isinstance(size, int) and isinstance(batch, int)):
        raise Unsupported(
            f"the 1-D mask index {mask.name!r} is declared [{size}] for a batch of {batch}: "
            "cannot tell key lengths [batch] from end and start positions [2 * batch]"
        )


def _check_divisible(sizes, heads: int) -> None:
    for name, size in zip("qkv", sizes):
        if size is not None and size % heads:
            raise Unsupported(f"{name} hidden size {size} is not a multiple of num_heads={heads}")


def _packed_hidden(packed: ir.Value, heads: int) -> int | None:
    head_dim = _static_dims(packed, -1)[0]
    return heads * head_dim if head_dim is not None else None


def _hidden_features(value: ir.Value, heads: int | None = None) -> int | None:
    """heads * head_dim of a [batch, seq, hidden] or (given heads) [batch, heads, seq, head_dim] input."""
    if _rank(value) == 4:
        head_dim = _static_dims(value, -1)[0]
        return heads * head_dim if heads and head_dim is not None else None
    return _projected_features(value)


def _projected_features(value: ir.Value) -> int | None:
    """The last dim, from the shape or, where shape inference stopped (at a contrib op), from
    the constant weights of the MatMul (and bias Add) that produced it."""
    last = _static_dims(value, -1)[0]
    if last is not None:
        return last
    node = value.producer()
    for _ in range(4):
        if node is None or node.op_type not in ("MatMul", "Add"):
            return None
        constants = [v for v in node.inputs if v is not None and _is_constant(v)]
        if (
            node.op_type == "MatMul"
            and len(constants) == 1
            and constants[0] is node.inputs[1]
            and _rank(constants[0]) == 2
        ):
            return _static_dims(constants[0], -1)[0]
        others = [v for v in node.inputs if v is not None and v not in constants]
        node = others[0].producer() if len(others) == 1 else None
    return None


def _is_constant(value: ir.Value) -> bool:
    """An initializer or Constant output, judged without reading it (it may be a big weight)."""
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


# --- shapes ----------------------------------------------------------------------------------


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _static_dims(value: ir.Value, *axes: int) -> tuple[int | None, ...]:
    if value.shape is None:
        return (None,) * len(axes)
    rank = len(value.shape)
    return tuple(_static(value.shape[axis]) if -rank <= axis < rank else None for axis in axes)


def _describe_shapes(site: AttentionSite, q: ir.Value, v: ir.Value, logits: ir.Value | None) -> None:
    q_dims, v_dims = known_dims(q), known_dims(v)
    site.rank = len(q_dims) if q_dims else _rank(logits)
    if q_dims:
        site.head_dim = _static(q_dims[-1])
        if site.rank == 4:
            site.num_heads = _heads_of_split_layout(q)
    if v_dims:
        site.value_dim = _static(v_dims[-1])
    if q.dtype is not None:
        site.dtype = q.dtype.numpy().name  # "float32", as AttentionSite spells dtypes


def _heads_of_split_layout(q: ir.Value) -> int | None:
    """Heads, when q is [batch, heads, seq, head_dim] by one of the usual head splits:
    - a Transpose(perm=[0, 2, 1, 3]) of [batch, seq, heads, head_dim];
    - a Reshape of [batch * heads, seq, head_dim] to [batch, heads, seq, head_dim] (what
      nn.MultiheadAttention does before scaled_dot_product_attention): the reshape keeps seq
      and head_dim, so it only splits the leading axis, heads inner.
    Possibly scaled after. Any other producer could put batch elsewhere, so heads stay unknown."""
    node = q.producer()
    while node is not None and node.op_type in ("Mul", "Div", "Cast"):
        node = node.inputs[0].producer()
    if node is None or node.op_type not in ("Transpose", "Reshape"):
        return None
    dims = known_dims(node.outputs[0])
    if dims is None or len(dims) != 4:
        return None
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        return _static(dims[1]) if perm is not None and list(perm.as_ints()) == [0, 2, 1, 3] else None
    source = known_dims(node.inputs[0])
    if source is None or len(source) != 3 or None in (source[1], source[2]):
        return None
    return _static(dims[1]) if [source[1], source[2]] == dims[2:] else None


def mark_unsupported_masks(sites: list[OnnxSite]) -> None:
    """Fill the mask kind of sites without masks; others are classified by masks.py."""
    for s in sites:
        if s.site.skip_reason is None and not s.masks:
            s.site.mask = MaskKind.CAUSAL if s.causal_by_attribute else MaskKind.NONE
