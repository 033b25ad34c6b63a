"""Inputs generated from a model's signature: for probing masks, validating and checking outputs.

Symbolic dims are bound by name, so inputs that share a dim ("batch", "sequence") agree. Token
ids stay inside the vocabulary found from the embedding table the ids index. Integer and bool
inputs that are not token ids get a padding pattern (the first batch row unpadded, the others
padded at the start and end), so masks built from them show what they do with padding.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def generate_inputs(
    graph: ir.Graph, batch: int = 2, seq: int = 16, seed: int = 0, names: list[str] | None = None
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bound: dict[str, int] = {}
    feeds = {}
    for value in graph.inputs:
        if value.is_initializer() or (names is not None and value.name not in names):
            continue
        shape = [_bind(dim, axis, bound, batch, seq) for axis, dim in enumerate(value.shape or [])]
        feeds[value.name] = _fill(value, shape, rng)
    return feeds


def _bind(dim, axis: int, bound: dict[str, int], batch: int, seq: int) -> int:
    if isinstance(dim, int):
        return dim
    key = str(dim) if dim is not None and str(dim) not in ("", "None") else f"?{axis}"
    if key not in bound:
        bound[key] = batch if axis == 0 else seq
    return bound[key]


def _fill(value: ir.Value, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    vocab = embedding_rows(value)
    if vocab is not None and np.issubdtype(dtype, np.integer):
        return rng.integers(0, vocab, size=shape).astype(dtype)
    return padding_pattern(shape).astype(dtype)


def padding_pattern(shape: list[int]) -> np.ndarray:
    """1 = a real position, 0 = padding, along the last axis; row 0 of the batch unpadded."""
    pattern = np.ones(shape, dtype=np.int64)
    if len(shape) >= 2 and shape[0] > 1 and shape[-1] > 3:
        pattern[1:, ..., -2:] = 0
        pattern[1:, ..., :1] = 0
    return pattern


def embedding_rows(value: ir.Value) -> int | None:
    """Rows of the table a Gather indexes with this value (directly or through Cast/Reshape)."""
    frontier, seen = [value], set()
    while frontier:
        v = frontier.pop()
        for use in v.uses():
            node = use.node
            if node.op_type == "Gather" and use.idx == 1:
                table = node.inputs[0]
                if table.const_value is not None and table.shape is not None and isinstance(table.shape[0], int):
                    return table.shape[0]
            elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten") and id(node) not in seen:
                seen.add(id(node))
                frontier.append(node.outputs[0])
    return None
