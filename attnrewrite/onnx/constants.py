"""Reading small compile-time constants (scales, mask fill values, sizes) out of an ONNX graph.

One mechanism folds both plain constants and shape arithmetic. Exporters compute a scale or a
Reshape target from Shape(x) (the legacy exporter: Sqrt(1 / Sqrt(Cast(Slice(Shape(q), -1)))),
or 1 / sqrt(Cast(Gather(Shape(x), 2)) / heads) for nn.MultiheadAttention). A shape is folded as
an object array whose dims are an int (static), a str (a symbolic dim: the same name is the same
size) or None (unknown); arithmetic on a dim that is not static is unknown, indexing and
concatenation keep it. Reading a static dim out of such an array is a constant.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

Dim = int | str | None


def _cast(node: ir.Node, a):
    if _has_unknown(a) or "to" not in node.attributes:
        return a
    return a.astype(ir.DataType(node.attributes["to"].as_int()).numpy())


def _div(a, b):
    # ONNX integer Div truncates; numpy's true divide would make 30 / 4 = 7.5 a "size"
    if np.issubdtype(np.asarray(a).dtype, np.integer) and np.issubdtype(np.asarray(b).dtype, np.integer):
        return np.trunc(np.true_divide(a, b)).astype(np.result_type(a, b))
    return np.divide(a, b)


# Ops whose output is constant when their inputs are (element-wise: an unknown element makes
# only its own result unknown).
_FOLDABLE = {
    "Identity": lambda a: a,
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Neg": np.negative,
    "Mul": np.multiply,
    "Div": _div,
    "Add": np.add,
    "Sub": np.subtract,
    "Mod": np.mod,
}


_MAX_ELEMENTS = 4096
# What folding a graph that could not run raises (indices out of range, shapes that do not fit)
_INVALID = (IndexError, ValueError, TypeError, ZeroDivisionError)


def constant_array(value: ir.Value | None, depth: int = 16) -> np.ndarray | None:
    """The value's array if it is a constant (initializer, Constant, or a fold of those)."""
    array = _fold(value, depth)
    return None if array is None or _has_unknown(array) else array


def constant_scalar(value: ir.Value | None) -> float | None:
    array = constant_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))


def known_dims(value: ir.Value | None, depth: int = 16) -> list[Dim] | None:
    """The value's dims as far as they can be known: shape inference's, and where it has no
    static size, what the Reshape or Transpose that made the value says. None: rank unknown."""
    if value is None:
        return None
    dims = None if value.shape is None else [_dim(d) for d in value.shape]
    node = value.producer()
    if depth == 0 or node is None or (dims is not None and all(isinstance(d, int) for d in dims)):
        return dims
    if node.domain not in ("", "ai.onnx"):
        return dims
    try:
        return _merge(dims, _derived_dims(node, depth - 1))
    except _INVALID:  # a graph whose shapes do not fit its ops: nothing more is known
        return dims


# Element-wise ops: the output is the inputs broadcast together.
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Neg", "Cast", "Identity", "Where"}


def _derived_dims(node: ir.Node, depth: int) -> list[Dim] | None:
    """What the op that made a value says about its dims (the ops exporters build q, k, v with:
    head splits, rotary embeddings' slices, concatenations and element-wise products)."""
    op = node.op_type
    if op == "Reshape":
        return _reshape_target(node, depth)
    if op == "Transpose" and "perm" in node.attributes:
        source = known_dims(node.inputs[0], depth)
        return None if source is None else [source[p] for p in node.attributes["perm"].as_ints()]
    if op in _BROADCASTING:
        inputs = [known_dims(v, depth) for v in node.inputs if v is not None]
        return None if any(d is None for d in inputs) else _broadcast(inputs)
    if op == "Slice":  # the sliced axes change, the others are the data's
        source, axes = known_dims(node.inputs[0], depth), _fold(node.inputs[3], depth) if len(node.inputs) > 3 else None
        if source is None or axes is None or _has_unknown(axes):
            return None
        sliced = {int(a) % len(source) for a in axes.reshape(-1)}
        return [None if i in sliced else d for i, d in enumerate(source)]
    if op == "Concat":
        inputs = [known_dims(v, depth) for v in node.inputs]
        if any(d is None for d in inputs) or len({len(d) for d in inputs}) != 1:
            return None
        axis = node.attributes["axis"].as_int() % len(inputs[0])
        dims = [_merge_dim(*column) for column in zip(*inputs)]
        sizes = [d[axis] for d in inputs]
        dims[axis] = sum(sizes) if all(isinstance(d, int) for d in sizes) else (sizes[0] if len(sizes) == 1 else None)
        return dims
    return None


def _broadcast(inputs: list[list[Dim]]) -> list[Dim]:
    rank = max(len(d) for d in inputs)
    padded = [[1] * (rank - len(d)) + list(d) for d in inputs]
    return [_broadcast_dim(column) for column in zip(*padded)]


def _broadcast_dim(column) -> Dim:
    """A 1 yields to any other size; a static size > 1 is the result (the others are it or 1)."""
    others = [d for d in column if d != 1]
    if not others:
        return 1
    static = [d for d in others if isinstance(d, int)]
    if static:
        return static[0]
    return others[0] if None not in others and len(set(others)) == 1 else None


def _merge_dim(*column: Dim) -> Dim:
    """Dims that must be equal (Concat's other axes): the best known of them."""
    return max(column, key=lambda d: 2 if isinstance(d, int) else 1 if isinstance(d, str) else 0)


def _dim(d) -> Dim:
    if isinstance(d, int):
        return d
    return getattr(d, "value", None) or None


def _merge(inferred: list[Dim] | None, derived: list[Dim] | None) -> list[Dim] | None:
    """Per dim, a static size wins over a symbol, a symbol over nothing."""
    if derived is None or (inferred is not None and len(inferred) != len(derived)):
        return inferred
    if inferred is None:
        return derived
    return [_merge_dim(a, b) for a, b in zip(inferred, derived)]


def _reshape_target(node: ir.Node, depth: int) -> list[Dim] | None:
    target = _fold(node.inputs[1], depth)
    if target is None or target.ndim != 1:
        return None
    allow_zero = "allowzero" in node.attributes and node.attributes["allowzero"].as_int() == 1
    source = known_dims(node.inputs[0], depth)
    dims: list[Dim] = []
    for i, d in enumerate(target.tolist()):
        if isinstance(d, (int, np.integer)) and d == 0 and not allow_zero:
            dims.append(source[i] if source is not None and i < len(source) else None)
        else:
            dims.append(int(d) if isinstance(d, (int, np.integer)) else d)
    if dims.count(-1) == 1:
        dims[dims.index(-1)] = _inferred_dim(source, [d for d in dims if d != -1])
    return dims


def _inferred_dim(source: list[Dim] | None, others: list[Dim]) -> int | None:
    """A Reshape's -1: the source's size over the other target dims, once the dims the two
    share (the same static size or the same symbol) cancel: [B, N, 32] -> [B, N, -1, 8] is 4."""
    if source is None:
        return None
    left, divisors = list(source), []
    for d in others:
        if d is not None and d in left:
            left.remove(d)
        else:
            divisors.append(d)
    if not all(isinstance(d, int) for d in [*left, *divisors]):
        return None
    size, divisor = int(np.prod(left)), int(np.prod(divisors))
    return size // divisor if divisor > 0 and size % divisor == 0 else None


def _fold(value: ir.Value | None, depth: int) -> np.ndarray | None:
    """Like constant_array, but shape arithmetic may come back as an object array with a str or
    None for its non-static dims: slicing out a static dim (the head size) is still a constant."""
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
        return _partial_shape(node, depth)
    fold = _FOLDABLE.get(node.op_type)
    if fold is None and node.op_type not in _INDEXING:
        return None
    args = [None if v is None else _fold(v, depth - 1) for v in node.inputs]
    if any(a is None for a, v in zip(args, node.inputs) if v is not None):
        return None
    try:
        if fold is None:
            return _known(_object_if_symbolic(_INDEXING[node.op_type](node, *args)))
        return _elementwise(fold, args)
    except _INVALID:  # e.g. a Gather past the end of a shape: not a constant this graph computes
        return None


def _partial_shape(shape_node: ir.Node, depth: int) -> np.ndarray | None:
    dims = known_dims(shape_node.inputs[0], depth)
    if dims is None:
        return None
    start = shape_node.attributes["start"].as_int() if "start" in shape_node.attributes else 0
    end = shape_node.attributes["end"].as_int() if "end" in shape_node.attributes else None
    return _known(np.array(dims[start:end], dtype=object))


def _elementwise(fold, args: list[np.ndarray]) -> np.ndarray:
    if not any(_has_unknown(a) for a in args):
        return np.asarray(fold(*[_known(a) for a in args]))

    def one(*elements):
        if not all(_is_number(e) for e in elements):
            return None
        return fold(*[np.asarray(e) for e in elements]).item()

    return _known(np.asarray(np.frompyfunc(one, len(args), 1)(*args), dtype=object))


def _object_if_symbolic(result) -> np.ndarray:
    """numpy makes a str taken out of an object array a str array: keep it a dim."""
    array = np.asarray(result)
    return np.array(result, dtype=object) if array.dtype.kind in "US" else array


def _is_number(element) -> bool:
    return isinstance(element, (int, float, np.integer, np.floating)) and not isinstance(element, bool)


def _has_unknown(array: np.ndarray) -> bool:
    return array.dtype == object and not all(_is_number(d) for d in array.reshape(-1))


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


def _axes(node: ir.Node, axes) -> list[int]:
    """Unsqueeze/Squeeze axes: an input since opset 13, an attribute before."""
    if axes is not None:
        return [int(a) for a in np.asarray(axes).reshape(-1)]
    return list(node.attributes["axes"].as_ints()) if "axes" in node.attributes else []


def _unsqueeze(node: ir.Node, data, axes=None) -> np.ndarray:
    rank = data.ndim + len(_axes(node, axes))
    return np.expand_dims(data, tuple(sorted(a % rank for a in _axes(node, axes))))


def _squeeze(node: ir.Node, data, axes=None) -> np.ndarray:
    axes = _axes(node, axes)
    return np.squeeze(data, tuple(a % data.ndim for a in axes)) if axes else np.squeeze(data)


def _concat(node: ir.Node, *pieces) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=object) for p in pieces], axis=node.attributes["axis"].as_int())


# Shape arithmetic that moves elements without computing them: a symbolic dim passes through.
_INDEXING = {
    "Slice": _slice,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": _concat,
    "Cast": _cast,
}
