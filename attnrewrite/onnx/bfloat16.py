"""bfloat16 where onnxruntime's Python API and CPU kernels stop short.

numpy has no bfloat16 (ml_dtypes adds one, which onnxruntime's ``run`` does not accept, and it
cannot hand a bfloat16 output back as numpy), and the CPU execution provider has no bfloat16
arithmetic. So: ``run`` passes bfloat16 arrays as OrtValues and copies bfloat16 outputs out
bit for bit; ``as_float32`` turns a small probe graph (a mask's subgraph, evaluated only to
classify the mask) from bfloat16 into float32, which every kernel has and which holds every
bfloat16 value exactly.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

BFLOAT16 = onnx.TensorProto.BFLOAT16
FLOAT = onnx.TensorProto.FLOAT


def run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``session.run(None, feeds)``, also for bfloat16 inputs and outputs."""
    if not any(_is_bf16(a) for a in feeds.values()) and not any(
        o.type == "tensor(bfloat16)" for o in session.get_outputs()
    ):
        return session.run(None, feeds)
    values = {name: _ort_value(array) for name, array in feeds.items()}
    return [_to_numpy(value) for value in session.run_with_ort_values(None, values)]


def _is_bf16(array) -> bool:
    return isinstance(array, np.ndarray) and array.dtype == ml_dtypes.bfloat16


def _ort_value(array: np.ndarray) -> ort.OrtValue:
    if _is_bf16(array):
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array).view(np.uint16), BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def _to_numpy(value: ort.OrtValue) -> np.ndarray:
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    shape = value.shape()
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, ml_dtypes.bfloat16)
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())  # a CPU tensor's buffer
    return np.frombuffer(raw, np.uint16).copy().view(ml_dtypes.bfloat16).reshape(shape)


def as_float32(model: onnx.ModelProto) -> bool:
    """Rewrite every bfloat16 type, tensor and Cast target of the main graph to float32 in
    place; True when there was any. For probes only: values stay exact, arithmetic is done in
    the wider type."""
    graph = model.graph
    changed = False
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type == BFLOAT16:
            info.type.tensor_type.elem_type = FLOAT
            changed = True
    for i, tensor in enumerate(graph.initializer):
        if tensor.data_type == BFLOAT16:
            graph.initializer[i].CopyFrom(_float_tensor(tensor))
            changed = True
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.type == onnx.AttributeProto.INT and attr.i == BFLOAT16:
                attr.i = FLOAT
                changed = True
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BFLOAT16:
                attr.t.CopyFrom(_float_tensor(attr.t))
                changed = True
    return changed


def _float_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
