"""The projections around a replaced attention: the MatMul (or Gemm) whose weight makes its q, k
and v (one node for a packed qkv projection) and the one its output goes into. Fine-tuning
(onnx/finetune.py) puts its low-rank adapters on these and merges them into their weights.

Upstream from q, k and v the walk crosses whatever a model puts between a projection and the
attention (reshapes and transposes into heads, a bias, a rotary embedding, grouped heads'
repeat) and takes the nearest MatMul whose second input is a weight: an initializer, or a
Transpose of one. A MatMul that reads two activations (q k^T of an earlier site, rotary's
frequencies times positions) is not a projection and is walked through. Downstream from the
output it crosses only layout (transposes, reshapes, casts) to the first such MatMul.
A projection whose weight is stored quantized (MatMulNBits, or a MatMul of a DequantizeLinear
weight) is a QuantizedProjection: its adapter stays beside it. A MatMul that quantizes its
activations too (MatMulInteger, QLinearMatMul, ...) is refused.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from attnrewrite.passes.finetune import Quantized, Unadaptable

PROJECTIONS = ("MatMul", "Gemm")
INTEGER_ACTIVATIONS = {"MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
LAYOUT = {"Transpose", "Reshape", "Cast", "Identity", "Flatten", "Squeeze", "Unsqueeze", "CastLike"}
UPSTREAM_DEPTH = 16  # nodes between a projection and the attention's q, k or v, at most
# ops whose other inputs are sizes, axes or indices: only their first input carries activations
FIRST_INPUT_ONLY = LAYOUT | {"Expand", "Slice", "Tile", "Gather", "Pad", "Split", "GatherElements", "Resize"}
SHAPES = {"Shape", "Size", "ConstantOfShape", "Range", "NonZero"}  # their outputs are never activations
DOWNSTREAM_DEPTH = 6


@dataclasses.dataclass(frozen=True)
class Projection:
    """A MatMul or Gemm ``node`` computing x W_eff, W_eff [in, out]: its weight initializer
    ``weight`` as stored, and whether W_eff is its transpose (Gemm's transB, or a Transpose
    node in front of the MatMul)."""

    node: ir.Node
    weight: ir.Value
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out) of W_eff."""
        rows, columns = self.weight.const_value.shape
        return (columns, rows) if self.transposed else (rows, columns)


@dataclasses.dataclass(frozen=True)
class QuantizedProjection:
    """A projection ``node`` computing x W_eff, W_eff [in, out] = ``shape``, whose weight is
    stored quantized: merging a low-rank change into it would round the change away, so its
    adapter stays beside it."""

    node: ir.Node
    shape: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SiteProjections:
    """The distinct projections making a site's q, k and v (one when they are packed) and the
    one its output goes into (None: none was found)."""

    inputs: tuple[Projection | QuantizedProjection, ...]
    output: Projection | QuantizedProjection | None

    @property
    def all(self) -> tuple[Projection | QuantizedProjection, ...]:
        return (*self.inputs, *(() if self.output is None else (self.output,)))


def site_projections(call: ir.Node) -> SiteProjections:
    """The projections of the replacement node ``call`` (inputs q, k, v, ...); Unadaptable with
    the reason where q, k or v comes from none."""
    found: dict[int, Projection | QuantizedProjection] = {}
    for role, value in zip("qkv", call.inputs[:3]):
        projection = _upstream(value)
        if projection is None:
            raise Unadaptable(f"no projection with a weight makes its {role}")
        found.setdefault(id(projection.node), projection)
    return SiteProjections(tuple(found.values()), _downstream(call.outputs[0]))


def _upstream(value: ir.Value) -> Projection | QuantizedProjection | None:
    """The nearest projection upstream of ``value`` (breadth first over the activations)."""
    frontier, seen = [value], set()
    for _ in range(UPSTREAM_DEPTH):
        following = []
        for current in frontier:
            node = current.producer()
            if node is None or id(node) in seen or node.domain == "attnrewrite" or node.op_type in SHAPES:
                continue
            seen.add(id(node))
            projection = projection_of(node)
            if projection is not None:
                return projection
            following += [v for v in _activations(node) if v is not None and not _is_constant(v)]
        frontier = following
    return None


def _activations(node: ir.Node) -> list:
    """The inputs of ``node`` that carry activations (not sizes, axes, indices or conditions)."""
    if node.op_type in FIRST_INPUT_ONLY:
        return list(node.inputs[:1])
    if node.op_type == "Where":
        return list(node.inputs[1:])
    return list(node.inputs)


def _downstream(value: ir.Value) -> Projection | QuantizedProjection | None:
    """The first projection ``value`` reaches through layout alone."""
    frontier = [value]
    for _ in range(DOWNSTREAM_DEPTH):
        following = []
        for current in frontier:
            for use in current.uses():
                node = use.node
                projection = projection_of(node) if use.idx == 0 else None
                if projection is not None:
                    return projection
                if node.op_type in LAYOUT:
                    following += list(node.outputs)
        frontier = following
    return None


def projection_of(node: ir.Node) -> Projection | QuantizedProjection | None:
    """``node`` as a projection of its first input, or None; Quantized if it quantizes its
    activations too."""
    if node.op_type in INTEGER_ACTIVATIONS:
        raise Quantized(
            f"the projection {node.name!r} quantizes its activations ({node.op_type}), and adapters "
            "beside integer MatMuls are not supported yet"
        )
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        return QuantizedProjection(node, (_attribute(node, "K"), _attribute(node, "N")))
    if node.op_type not in PROJECTIONS or len(node.inputs) < 2 or _is_constant(node.inputs[0]):
        return None
    if node.op_type == "Gemm" and _attribute(node, "transA"):
        return None
    weight, transposed = node.inputs[1], bool(node.op_type == "Gemm" and _attribute(node, "transB"))
    stored = _dequantized_weight(weight)
    if stored is not None:
        rows, columns = stored.shape
        shape = (columns, rows) if transposed else (rows, columns)
        return QuantizedProjection(node, shape)
    producer = weight.producer()
    if producer is not None and producer.op_type == "Transpose" and _attribute(producer, "perm", [1, 0]) == [1, 0]:
        if len(producer.outputs[0].uses()) != 1:  # merging must not change the other readers of the transpose
            return None
        weight, transposed = producer.inputs[0], not transposed
    if not weight.is_initializer() or weight.const_value is None or len(weight.const_value.shape) != 2:
        return None
    return Projection(node, weight, transposed)


def _dequantized_weight(value: ir.Value):
    """The quantized initializer [rows, columns] a DequantizeLinear makes ``value`` of, or None."""
    producer = value.producer()
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    stored = producer.inputs[0]
    if not stored.is_initializer() or stored.const_value is None or len(stored.const_value.shape) != 2:
        return None
    return stored.const_value


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.is_initializer() or (producer is not None and producer.op_type == "Constant")


def _attribute(node: ir.Node, name: str, default=0):
    attribute = node.attributes.get(name)
    if attribute is None:
        return default
    value = attribute.value
    return list(value) if isinstance(value, (list, tuple)) else value
