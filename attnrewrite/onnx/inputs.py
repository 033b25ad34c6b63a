"""Inputs generated from a model's signature: for probing masks, validating and checking outputs.

Symbolic dims are bound by name, so inputs that share a dim ("batch", "sequence") agree. Token
ids span the vocabulary: the rows of the embedding table the ids index, also when the table is
computed in the graph (int8 weights dequantized by Cast and Mul). Integer and bool inputs that
are not token ids get a padding pattern (the first batch row unpadded, the others padded at the
start and end), so masks built from them show what they do with padding; an input whose 1/True
marks padding (torch's key_padding_mask; masks.py finds which) gets the same pattern inverted,
never a fully masked row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from attnrewrite.onnx import io as onnx_io

# A convolutional front end rejects short inputs (wav2vec2's feature encoder needs 400
# samples for one frame): generated inputs then grow by doubling, up to this length, until
# the model takes them. Long enough for audio encoders, short enough that a model failing
# for another reason is not run on inputs that exhaust memory.
MAX_SEARCHED_LENGTH = 4096

T = TypeVar("T")


def generate_inputs(
    graph: ir.Graph,
    batch: int = 2,
    seq: int = 16,
    seed: int = 0,
    names: list[str] | None = None,
    padding_marked_by_one: Collection[str] = (),
    end_padding: int = 2,
) -> dict[str, np.ndarray]:
    """``padding_marked_by_one``: the names of mask inputs whose 1/True means padding;
    ``end_padding``: positions padded at the end of the padded rows (see padding_pattern)."""
    rng = np.random.default_rng(seed)
    bound: dict[str, int] = {}
    feeds = {}
    for value in graph.inputs:
        if value.is_initializer() or (names is not None and value.name not in names):
            continue
        shape = [_bind(dim, axis, bound, batch, seq) for axis, dim in enumerate(value.shape or [])]
        feeds[value.name] = _fill(value, shape, rng, value.name in padding_marked_by_one, end_padding)
    return feeds


def _bind(dim, axis: int, bound: dict[str, int], batch: int, seq: int) -> int:
    if isinstance(dim, int):
        return dim
    key = str(dim) if dim is not None and str(dim) not in ("", "None") else f"?{axis}"
    if key not in bound:
        bound[key] = batch if axis == 0 else seq
    return bound[key]


def _fill(
    value: ir.Value, shape: list[int], rng: np.random.Generator, padding_marked_by_one: bool, end_padding: int
) -> np.ndarray:
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    vocab = embedding_rows(value)
    if vocab is not None and np.issubdtype(dtype, np.integer):
        return rng.integers(0, vocab, size=shape).astype(dtype)
    pattern = padding_pattern(shape, end_padding)
    return (1 - pattern if padding_marked_by_one else pattern).astype(dtype)


def padding_pattern(shape: list[int], end: int = 2) -> np.ndarray:
    """1 = a real position, 0 = padding, along the last axis; row 0 of the batch unpadded, the
    others padded at the first position and the last ``end``."""
    pattern = np.ones(shape, dtype=np.int64)
    if len(shape) >= 2 and shape[0] > 1 and shape[-1] > end + 1:
        pattern[1:, ..., -end:] = 0
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
                rows = _table_rows(node.inputs[0])
                if rows is not None:
                    return rows
            elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten") and id(node) not in seen:
                seen.add(id(node))
                frontier.append(node.outputs[0])
    return None


def _table_rows(table: ir.Value) -> int | None:
    """The first dim of a constant table: declared or inferred, else, for a table the graph
    computes from constants only (int8 weights times a scale), read from that subgraph. None
    for a table that depends on a graph input."""
    if table.const_value is not None:
        return table.const_value.shape[0] if len(table.const_value.shape) >= 1 else None
    if not _computed_from_constants(table):
        return None
    if table.shape is not None and table.shape.rank() >= 1 and isinstance(table.shape[0], int):
        return table.shape[0]
    try:
        return _computed_table_rows(table)
    except Exception:  # a table we cannot follow: the ids get the padding pattern
        return None


def _computed_table_rows(table: ir.Value) -> int | None:
    """ONNX shape inference on the subgraph computing the table; where it cannot follow (a
    shape it cannot propagate), onnxruntime computes the table itself."""
    model = model_around(ir.convenience.extract(table.producer().graph, inputs=[], outputs=[table]))
    inferred = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model), data_prop=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    if dims and dims[0].HasField("dim_value"):
        return dims[0].dim_value
    with onnx_io.saved_copy(model) as path:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        array = session.run(None, {})[0]
    return array.shape[0] if array.ndim >= 1 else None


def _computed_from_constants(value: ir.Value) -> bool:
    seen, stack = set(), [value]
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen or v.const_value is not None:
            continue
        seen.add(id(v))
        node = v.producer()
        if node is None:  # a graph input
            return False
        stack.extend(node.inputs)
    return True


def model_around(graph: ir.Graph) -> ir.Model:
    """A model for a bare graph, at the oldest IR version its opsets allow (one onnxruntime loads)."""
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in graph.opset_imports.items()]
    return ir.Model(graph, ir_version=onnx.helper.find_min_ir_version_for(opsets))


def searched_lengths(seq: int) -> list[int]:
    """seq, 2 seq, 4 seq, ... up to MAX_SEARCHED_LENGTH (seq itself always)."""
    lengths = [seq]
    while lengths[-1] * 2 <= MAX_SEARCHED_LENGTH:
        lengths.append(lengths[-1] * 2)
    return lengths


def first_that_runs(run: Callable[[int], T], seq: int) -> tuple[int, T]:
    """(length, run(length)) for the first of searched_lengths(seq) at which ``run`` does not
    raise; when none does, the error at ``seq`` (what the user asked for) is raised."""
    first_error = None
    for length in searched_lengths(seq):
        try:
            return length, run(length)
        except Exception as error:
            if first_error is None:
                first_error = error
    raise first_error


def sequence_length(graph: ir.Graph, feeds: dict[str, np.ndarray]) -> int | None:
    """The length given inputs have along their first symbolic axis after the batch axis (the
    length generate_inputs would bind ``seq`` to), or None when no input has one."""
    for value in graph.inputs:
        if value.name not in feeds or value.shape is None:
            continue
        for axis, dim in enumerate(value.shape):
            if axis > 0 and not isinstance(dim, int) and axis < feeds[value.name].ndim:
                return int(feeds[value.name].shape[axis])
    return None
