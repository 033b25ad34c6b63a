"""The float16 models of ``attnrewrite bench --fp16``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.passes.lowering import DOMAIN


def to_fp16(model: ir.Model) -> ir.Model:
    """float16 weights, activations, inputs and outputs, in place. What an attnrewrite node
    reads besides q, k and v (key_keep, random features, projections) stays float32: the
    bodies compute in float32 (sums and normalisers overflow in fp16) and cast back to v's type.
    Written here rather than with onnxruntime's float16 tool, which mis-orders and duplicates
    the casts it inserts around function nodes."""
    graph = model.graph
    keep = _float32_only(graph)
    values = [*graph.inputs, *graph.initializers.values(), *(o for node in graph for o in node.outputs)]
    for value in values:
        if value.dtype != ir.DataType.FLOAT or value in keep:
            continue
        value.dtype = ir.DataType.FLOAT16
        if value.const_value is not None:
            value.const_value = ir.tensor(_as_fp16(value.const_value.numpy()), name=value.name)
    for node in graph:
        if node.outputs[0] not in keep:
            _node_to_fp16(node)
    return model


def _float32_only(graph: ir.Graph) -> set[ir.Value]:
    """The attnrewrite nodes' extra inputs and the float values they are computed from (up to
    the Cast that makes them float)."""
    frontier = [v for node in graph if node.domain == DOMAIN for v in node.inputs[3:] if v is not None]
    keep: set[ir.Value] = set()
    while frontier:
        value = frontier.pop()
        if value in keep or value.dtype not in (ir.DataType.FLOAT, None):  # spliced values are untyped
            continue
        keep.add(value)
        producer = value.producer()
        if producer is not None and producer.op_type != "Cast":
            frontier.extend(v for v in producer.inputs if v is not None)
    return keep


def _as_fp16(array: np.ndarray) -> np.ndarray:
    """Saturating: a mask fill of float32's minimum becomes float16's, not -inf (which turns a
    fully masked row into NaN)."""
    limit = np.finfo(np.float16).max
    return np.clip(array, -limit, limit).astype(np.float16)


def _node_to_fp16(node: ir.Node) -> None:
    """Attributes that create float32 tensors: Cast targets and constants."""
    if node.domain not in ("", "ai.onnx"):
        return
    if node.op_type == "Cast" and node.attributes["to"].as_int() == ir.DataType.FLOAT:
        node.attributes["to"] = ir.AttrInt64("to", ir.DataType.FLOAT16)
    elif node.op_type in ("Constant", "ConstantOfShape"):
        name = "value" if "value" in node.attributes else "value_float"
        if name not in node.attributes:
            return
        if name == "value_float":
            array = _as_fp16(np.array(node.attributes.pop(name).as_float(), dtype=np.float32))
        else:
            array = node.attributes[name].as_tensor().numpy()
            if array.dtype != np.float32:
                return
            array = _as_fp16(array)
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
