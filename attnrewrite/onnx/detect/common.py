"""What the detectors share: the site a detector hands the splice (OnnxSite, with its masks,
its KV cache and, for a fused contrib operator, how its heads are packed) and the shape helpers
they read the graph's shapes with. The mask vocabulary (MaskTerm, MaskEncoding, MASKED_BELOW)
and the refusal (Unsupported) are both frontends', in attnrewrite.site."""

from __future__ import annotations

import dataclasses
import enum

import onnx_ir as ir

from attnrewrite.onnx.constants import known_dims
from attnrewrite.site import PROJECTION_WALK_DEPTH, AttentionSite, MaskKind, MaskTerm


@dataclasses.dataclass(kw_only=True)
class OnnxSite:
    """An AttentionSite plus the graph values a replacement node reads and writes. A site refused
    before its q and v were found (a softmax whose scores are not q @ k^T) has them None."""

    site: AttentionSite
    q: ir.Value | None
    k_transposed: ir.Value | None = None  # the logits MatMul's right operand, [..., Dh, Nk]
    k: ir.Value | None = None  # [..., Nk, Dh], when the graph has it (fused Attention)
    v: ir.Value | None
    output: ir.Value  # what the replacement's output takes over
    nodes: list[ir.Node]  # what the splice removes
    masks: list[MaskTerm] = dataclasses.field(default_factory=list)
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
    # a GroupQueryAttention (gqa.py): its q, k, v packed, rotated and cached inside the operator
    grouped_query: GroupedQueryPlan | None = None


def refused(onnx_site: OnnxSite, reason: str) -> OnnxSite:
    """Where a detector's Unsupported is caught: the site is left alone with the reason, its
    mask unknown (it was never looked at)."""
    onnx_site.site.skip_reason = reason
    onnx_site.site.mask = MaskKind.UNKNOWN
    return onnx_site


# the KV cache a site reads its keys or values from (kv_cache.py finds it)
@dataclasses.dataclass
class CachedTensor:
    """A site's keys or values: the past (a graph input) followed by this step's, as computed by
    ``node`` (a Concat on the sequence axis, or a fused attention operator that appends)."""

    node: ir.Node
    past: ir.Value  # the graph input, [batch, kv_heads, past, head_dim]
    # this step's keys or values, [batch, kv_heads, new, head_dim]; None inside a
    # GroupQueryAttention, where the splice computes them (OnnxSite.grouped_query)
    new: ir.Value | None
    present: ir.Value | None  # past then new, [batch, kv_heads, past + new, head_dim]
    output: ir.Value | None  # the graph output that returns ``present``, if the model returns it

    @property
    def kv_heads(self) -> int | None:
        values = (v for v in (self.past, self.new) if v is not None)
        return next((d for d in (static_dims(v, 1)[0] for v in values) if d is not None), None)


# how onnxruntime's fused contrib operators hold q, k and v (contrib.py reads it from them)
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


# how a GroupQueryAttention holds q, k and v (gqa.py reads it from the operator)
@dataclasses.dataclass(frozen=True)
class GroupedQueryPlan:
    """How a GroupQueryAttention (gqa.py) holds q, k and v: the splice unpacks them with it."""

    num_heads: int
    kv_heads: int
    head_size: int
    query: ir.Value  # packed qkv when ``key`` is None
    key: ir.Value | None
    value: ir.Value | None
    rotary: tuple[ir.Value, ir.Value] | None  # (cos_cache, sin_cache) when do_rotary=1
    rotary_dim: int | None  # the leading features rotated: twice the tables' width
    interleaved: bool  # rotary pairs (x0, x1), (x2, x3)... rather than halves


# --- shapes ----------------------------------------------------------------------------------


def rank_of(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def static_dim(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def static_dims(value: ir.Value, *axes: int) -> tuple[int | None, ...]:
    if value.shape is None:
        return (None,) * len(axes)
    rank = len(value.shape)
    return tuple(static_dim(value.shape[axis]) if -rank <= axis < rank else None for axis in axes)


def describe_shapes(site: AttentionSite, q: ir.Value, v: ir.Value, logits: ir.Value | None) -> None:
    q_dims, v_dims = known_dims(q), known_dims(v)
    site.rank = len(q_dims) if q_dims else rank_of(logits)
    if q_dims:
        site.head_dim = static_dim(q_dims[-1])
        if site.rank == 4:
            site.num_heads = _heads_of_split_layout(q)
    if v_dims:
        site.value_dim = static_dim(v_dims[-1])
    if q.dtype is not None:
        site.dtype = q.dtype.numpy().name  # "float32", as AttentionSite spells dtypes


def _heads_of_split_layout(q: ir.Value) -> int | None:
    """Heads, when q is [batch, heads, seq, head_dim] by one of the usual head splits:
    - a Transpose(perm=[0, 2, 1, 3]) of [batch, seq, heads, head_dim];
    - a Reshape of [batch * heads, seq, head_dim] to [batch, heads, seq, head_dim] (what
      nn.MultiheadAttention does before scaled_dot_product_attention): the reshape keeps seq
      and head_dim, so it only splits the leading axis, heads inner.
    Possibly rotated (transformers' rotary embedding), scaled or reshaped to the dims it had
    (Falcon's legacy export) after. Any other producer could put batch elsewhere, so heads stay
    unknown."""
    node = q.producer()
    while node is not None and (node.op_type in ("Add", "Mul", "Div", "Cast") or _same_dims_reshape(node)):
        if node.op_type == "Add":
            unrotated = _rotated_from(node)
            node = unrotated.producer() if unrotated is not None else None
        else:
            node = node.inputs[0].producer()
    if node is None or node.op_type not in ("Transpose", "Reshape"):
        return None
    dims = known_dims(node.outputs[0])
    if dims is None or len(dims) != 4:
        return None
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        return static_dim(dims[1]) if perm is not None and list(perm.as_ints()) == [0, 2, 1, 3] else None
    source = known_dims(node.inputs[0])
    if source is None or len(source) != 3 or None in (source[1], source[2]):
        return None
    return static_dim(dims[1]) if [source[1], source[2]] == dims[2:] else None


def _same_dims_reshape(node: ir.Node) -> bool:
    """A Reshape whose output has its input's dims, every one known: it moves nothing."""
    if node.op_type != "Reshape":
        return False
    dims = known_dims(node.inputs[0])
    return dims is not None and None not in dims and dims == known_dims(node.outputs[0])


def _rotated_from(add: ir.Node) -> ir.Value | None:
    """x, when ``add`` is x * cos + rotate_half(x) * sin, rotate_half(x) being
    Concat(Neg(Slice(x)), Slice(x)): the rotary embedding turns each head's features in place,
    so x has the heads where the rotated value has them."""
    products = [v.producer() for v in add.inputs]
    if len(products) != 2 or any(p is None or p.op_type != "Mul" for p in products):
        return None
    for plain, turned in (products, products[::-1]):
        halves = [v.producer() for v in turned.inputs]
        concat = next((h for h in halves if h is not None and h.op_type == "Concat"), None)
        if concat is None or len(concat.inputs) != 2:
            continue
        negated = concat.inputs[0].producer()
        slices = [negated.inputs[0].producer() if negated is not None and negated.op_type == "Neg" else None]
        slices.append(concat.inputs[1].producer())
        if any(s is None or s.op_type != "Slice" for s in slices):
            continue
        sources = {s.inputs[0] for s in slices}
        if len(sources) == 1 and (x := sources.pop()) in plain.inputs:
            return x
    return None


def projected_features(value: ir.Value) -> int | None:
    """The last dim, from the shape or, where shape inference stopped (at a contrib op), from
    the constant weights of the MatMul (and bias Add) that produced it, or the N of a
    MatMulNBits (a quantized projection)."""
    last = static_dims(value, -1)[0]
    if last is not None:
        return last
    node = value.producer()
    for _ in range(PROJECTION_WALK_DEPTH):
        if node is not None and node.op_type == "MatMulNBits" and "N" in node.attributes:
            return node.attributes["N"].as_int()
        if node is None or node.op_type not in ("MatMul", "Add"):
            return None
        constants = [v for v in node.inputs if v is not None and is_constant(v)]
        if (
            node.op_type == "MatMul"
            and len(constants) == 1
            and constants[0] is node.inputs[1]
            and rank_of(constants[0]) == 2
        ):
            return static_dims(constants[0], -1)[0]
        others = [v for v in node.inputs if v is not None and v not in constants]
        node = others[0].producer() if len(others) == 1 else None
    return None


def is_constant(value: ir.Value) -> bool:
    """An initializer or Constant output, judged without reading it (it may be a big weight)."""
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")
