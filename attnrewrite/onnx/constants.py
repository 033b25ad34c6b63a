"""Reading small compile-time constants (scales, mask fill values) out of an ONNX graph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

# Ops whose output is constant when their inputs are; enough for how exporters spell a scale
# (Div(x, Sqrt(Constant)), Mul(x, Cast(Constant)), Reciprocal(...)).
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


def constant_array(value: ir.Value | None, depth: int = 4) -> np.ndarray | None:
    """The value's array if it is a constant (initializer, Constant, or a fold of those)."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        # Scales and fill values are tiny; never pull a weight into memory to look at it.
        return tensor.numpy() if tensor.size <= _MAX_ELEMENTS else None
    node = value.producer()
    if depth == 0 or node is None or node.domain not in ("", "ai.onnx"):
        return None
    fold = _FOLDABLE.get(node.op_type)
    if fold is None:
        return None
    args = [constant_array(v, depth - 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    return np.asarray(fold(*args))


def constant_scalar(value: ir.Value | None) -> float | None:
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))
