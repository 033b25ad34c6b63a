"""The longest sequence a model accepts, read from its graph.

A model with learned positions holds P of them and cuts its table (or a buffer of P position
ids) to the input's length; past P the cut comes up short and the model fails at run time,
wherever the short piece meets a full-length one. The exporters spell the cut two ways: a Slice
of a constant whose end is computed from an input's shape (TorchScript: ``position_ids[:, :seq]``)
and a Gather from a constant table with indices from a Range (``arange(seq)``); a decoder
exported for generation gathers its table with a ``position_ids`` input. In a model with a KV
cache, generated inputs put some positions in the past (inputs.CacheContract): fewer are left
for the new tokens.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from attnrewrite.onnx.constants import constant_array
from attnrewrite.onnx.inputs import cache_contract

# Ops between a Range and the Gather it indexes that keep its values.
_KEEPS_INDICES = {"Unsqueeze", "Cast", "Expand", "Reshape", "Identity"}


@dataclasses.dataclass(frozen=True)
class PositionLimit:
    positions: int  # the longest sequence of new tokens generated inputs may have
    node: str  # the Slice or Gather that cuts the table
    past: int = 0  # positions generated inputs put in a KV cache before the new tokens

    def describe(self) -> str:
        table = self.positions + self.past
        said = f"the model has {table} positions ({self.node!r} cuts a {table}-long constant to the sequence)"
        return said + (f", {self.past} of them taken by the generated KV cache" if self.past else "")


def position_limit(graph: ir.Graph, from_empty_cache: bool = False) -> PositionLimit | None:
    """The smallest such limit in the main graph, or None when none is found; the positions a
    generated KV cache takes are not free, but where the inputs start ``from_empty_cache``."""
    limits = [limit for node in graph if (limit := _slice_limit(node) or _gather_limit(node)) is not None]
    limit = min(limits, key=lambda limit: limit.positions, default=None)
    contract = cache_contract(graph) if limit is not None else None
    if contract is None or from_empty_cache:
        return limit
    return dataclasses.replace(limit, positions=limit.positions - contract.past, past=contract.past)


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
    if shape is None or len(shape) != 2 or axis != 0 or not _counts_positions(node.inputs[1]):
        return None
    return PositionLimit(shape[0], node.name or node.op_type)


def _counts_positions(value: ir.Value | None, depth: int = 4) -> bool:
    """Indices from a Range, or from a graph input named for positions (``position_ids``)."""
    if value is not None and value.is_graph_input():
        return "position" in value.name.lower()
    producer = value.producer() if value is not None else None
    if producer is None or depth == 0:
        return False
    if producer.op_type == "Range":
        return True
    return producer.op_type in _KEEPS_INDICES and _counts_positions(producer.inputs[0], depth - 1)


def _constant_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of an initializer or Constant, without reading its data."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None:
        return None
    dims = tuple(tensor.shape)
    return dims if all(isinstance(d, int) for d in dims) else None
