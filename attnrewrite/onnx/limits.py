"""The longest sequence a model accepts, read from its graph.

A model with learned positions holds P of them and cuts its table (or a buffer of P position
ids) to the input's length; past P the cut comes up short and the model fails at run time,
wherever the short piece meets a full-length one. The exporters spell the cut two ways: a Slice
of a constant whose end is computed from an input's shape (TorchScript: ``position_ids[:, :seq]``)
and a Gather from a constant table with indices from a Range (``arange(seq)``).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from attnrewrite.onnx.constants import constant_array

# Ops between a Range and the Gather it indexes that keep its values.
_KEEPS_INDICES = {"Unsqueeze", "Cast", "Expand", "Reshape", "Identity"}


@dataclasses.dataclass(frozen=True)
class PositionLimit:
    positions: int
    node: str  # the Slice or Gather that cuts the table

    def describe(self) -> str:
        return f"the model has {self.positions} positions ({self.node!r} cuts a {self.positions}-long constant to the sequence)"


def position_limit(graph: ir.Graph) -> PositionLimit | None:
    """The smallest such limit in the main graph, or None when none is found."""
    limits = [limit for node in graph if (limit := _slice_limit(node) or _gather_limit(node)) is not None]
    return min(limits, key=lambda limit: limit.positions, default=None)


def _slice_limit(node: ir.Node) -> PositionLimit | None:
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
        return None
    shape = _constant_shape(node.inputs[0])
    starts = constant_array(node.inputs[1])
    if shape is None or starts is None or starts.size != 1 or constant_array(node.inputs[2]) is not None:
        return None  # not a constant cut at one axis by a length known only at run time
    axes = constant_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    axis = int(axes.reshape(-1)[0]) if axes is not None else 0
    start = int(starts.reshape(-1)[0])
    if not -len(shape) <= axis < len(shape) or start < 0:
        return None
    return PositionLimit(shape[axis] - start, node.name or node.op_type)


def _gather_limit(node: ir.Node) -> PositionLimit | None:
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    shape = _constant_shape(node.inputs[0])
    if shape is None or len(shape) != 2 or axis != 0 or not _from_range(node.inputs[1]):
        return None
    return PositionLimit(shape[0], node.name or node.op_type)


def _from_range(value: ir.Value | None, depth: int = 4) -> bool:
    producer = value.producer() if value is not None else None
    if producer is None or depth == 0:
        return False
    if producer.op_type == "Range":
        return True
    return producer.op_type in _KEEPS_INDICES and _from_range(producer.inputs[0], depth - 1)


def _constant_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of an initializer or Constant, without reading its data."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None:
        return None
    dims = tuple(tensor.shape)
    return dims if all(isinstance(d, int) for d in dims) else None
