"""Reading small compile-time constants (scales, mask fill values) out of an ONNX graph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

# Ops whose output is constant when their inputs are; enough for how exporters spell a scale
# (Div(x, Sqrt(Constant)), Mul(x, Cast(Constant)), Reciprocal(...)) and for the legacy exporter's
# scaled_dot_product_attention without a scale: Sqrt(1 / Sqrt(Cast(Slice(Shape(q), -1)))).
_FOLDABLE = {
    "Identity": lambda a: a,
    "Cast": lambda a: a,  # dtype is irrelevant for reading a scalar
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Neg": np.negative,
    "Mul": np.multiply,
    "Div": np.divide,
}


_MAX_ELEMENTS = 4096


def constant_array(value: ir.Value | None, depth: int = 8) -> np.ndarray | None:
    """The value's array if it is a constant (initializer, Constant, or a fold of those)."""
    array = _fold(value, depth)
    return None if array is None or _has_unknown(array) else array


def _fold(value: ir.Value | None, depth: int) -> np.ndarray | None:
    """Like constant_array, but a Shape may come back as an object array with None for its
    symbolic dims: slicing out a static dim (the head size) is still a constant."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        # Scales and fill values are tiny; never pull a weight into memory to look at it.
        return tensor.numpy() if tensor.size <= _MAX_ELEMENTS else None
    node = value.producer()
    if depth == 0 or node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        return _partial_shape(node)
    fold = _FOLDABLE.get(node.op_type)
    if fold is None and node.op_type not in _INDEXING:
        return None
    args = [None if v is None else _fold(v, depth - 1) for v in node.inputs]
    if any(a is None for a, v in zip(args, node.inputs) if v is not None):
        return None
    if fold is None:
        return _known(np.asarray(_INDEXING[node.op_type](node, *args)))
    if any(_has_unknown(a) for a in args if a is not None):
        return None
    return np.asarray(fold(*[_known(a) for a in args]))


def _partial_shape(shape_node: ir.Node) -> np.ndarray | None:
    shape = shape_node.inputs[0].shape
    if shape is None:
        return None
    start = shape_node.attributes["start"].as_int() if "start" in shape_node.attributes else 0
    end = shape_node.attributes["end"].as_int() if "end" in shape_node.attributes else None
    dims = [d if isinstance(d, int) else None for d in list(shape)[start:end]]
    return _known(np.array(dims, dtype=object))


def _has_unknown(array: np.ndarray) -> bool:
    return array.dtype == object and any(d is None for d in array.reshape(-1))


def _known(array: np.ndarray) -> np.ndarray:
    """An object array becomes int64 once every element is known."""
    return array if _has_unknown(array) or array.dtype != object else array.astype(np.int64)


def _slice(node: ir.Node, data, starts, ends, axes=None, steps=None) -> np.ndarray:
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * data.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[int(axis)] = slice(int(start), int(end), int(step))
    return data[tuple(index)]


def _gather(node: ir.Node, data, indices) -> np.ndarray:
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    return np.take(data, indices, axis=axis)


# Shape arithmetic: read the one element of a static shape that a scale is computed from.
_INDEXING = {"Slice": _slice, "Gather": _gather}


def constant_scalar(value: ir.Value | None) -> float | None:
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))
