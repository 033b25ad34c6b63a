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

import dataclasses
from collections.abc import Callable, Collection
from typing import TypeVar

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.constants import known_dims
from attnrewrite.onnx.detect import cache_inputs, declared_cache_sizes
from attnrewrite.onnx.state_layout import STATE_NAMES
from attnrewrite.site import KV_PROBE_PAST

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
    ``end_padding``: positions padded at the end of the padded rows (see padding_pattern).
    A model with a KV cache gets ``seq`` new positions after ``KV_PROBE_PAST`` cached ones (see
    CacheContract); a recurrent model's states (recurrent_state_inputs) are zero, their start."""
    rng = np.random.default_rng(seed)
    contract = cache_contract(graph)
    states = recurrent_state_inputs(graph)
    bound: dict[str, int] = {}
    feeds = {}
    for value in graph.inputs:
        if value.is_initializer():
            continue
        shape = [_bind(value, axis, bound, batch, seq, contract) for axis in range(len(value.shape or []))]
        if value.name in states:
            feeds[value.name] = np.zeros(shape, value.dtype.numpy())
        else:
            feeds[value.name] = _fill(value, shape, rng, value.name in padding_marked_by_one, end_padding)
    if contract is not None:
        contract.conform(graph, feeds, padding_marked_by_one)
    return {name: array for name, array in feeds.items() if names is None or name in names}


@dataclasses.dataclass(frozen=True)
class CacheContract:
    """What a model that generates with a KV cache expects of its inputs: cache inputs holding
    ``past`` positions (their ``past_axes``), an attention mask over past and new positions (dims
    ``total_dims``), position ids counting on from the past (inputs named for positions).
    Found from the graph: the cache inputs are those its attention appends to
    (detect.cache_inputs); a length is the new tokens' where token ids (an input indexing an
    embedding table) have it, the past's where a cache input has it, and past + new for any other
    length of an integer input (the mask) or one named after the past length."""

    past_axes: dict[str, int]
    past_dims: frozenset[str]
    total_dims: frozenset[str]
    past: int = KV_PROBE_PAST
    # sizes a cache's declaration leaves symbolic but its operator fixes (GroupQueryAttention's
    # head size): cache input -> {axis: size}
    fixed: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)

    def zeros(self, value: ir.Value, batch: int) -> np.ndarray:
        """An empty cache (past length 0) for ``batch`` rows."""
        fixed = self.fixed.get(value.name, {})
        shape = [
            d if isinstance(d, int) else fixed.get(axis, batch if axis == 0 else 0)
            for axis, d in enumerate(value.shape)
        ]
        return np.zeros(shape, value.dtype.numpy())

    def conform(self, graph: ir.Graph, feeds: dict[str, np.ndarray], padding_marked_by_one: Collection[str]) -> None:
        """Masks padded on the left only (the padding is in the past, as in batched generation),
        position ids counting the real tokens before each new one."""
        masks = [v for v in self.mask_inputs(graph) if v.name in feeds]
        for value in masks:
            keep = left_padding_pattern(list(feeds[value.name].shape), self.past)
            marked = value.name in padding_marked_by_one
            feeds[value.name] = (1 - keep if marked else keep).astype(feeds[value.name].dtype)
        mask = feeds[masks[0].name] if masks else None
        for value in self.position_inputs(graph):
            if value.name in feeds:
                array = feeds[value.name]
                feeds[value.name] = self._positions(array.shape, mask).astype(array.dtype)

    def mask_inputs(self, graph: ir.Graph) -> list[ir.Value]:
        """The integer inputs over past and new positions: attention masks."""
        return [v for v in graph.inputs if _is_integer(v) and v.shape and _symbol(v.shape[-1]) in self.total_dims]

    @staticmethod
    def position_inputs(graph: ir.Graph) -> list[ir.Value]:
        """The integer inputs named for positions (``position_ids``), over the new positions."""
        return [v for v in graph.inputs if _is_integer(v) and "position" in v.name.lower()]

    def _positions(self, shape: tuple[int, ...], mask: np.ndarray | None) -> np.ndarray:
        new = shape[-1]
        if mask is None or mask.ndim != 2 or mask.shape[0] != shape[0]:
            return np.broadcast_to(np.arange(self.past, self.past + new), shape)
        return positions_of(mask)[:, -new:]


def positions_of(mask: np.ndarray) -> np.ndarray:
    """As transformers' generate(): a token's position counts the real tokens before it; pads get 1."""
    positions = np.cumsum(mask, axis=-1) - 1
    return np.where(mask == 0, 1, positions)


def prefill_filled(graph: ir.Graph) -> frozenset[str]:
    """The inputs of a decoder (a KV-cache model or its recurrent rewrite) that a prefill from
    nothing fills itself (with_prefill_inputs): the caches or states and the position ids. Data
    for a decoder is its tokens and their mask, as a tokenizer gives them."""
    carried, positions = prefill_parts(graph)
    return frozenset({*carried, *positions})


def prefill_parts(graph: ir.Graph) -> tuple[set[str], set[str]]:
    """(the caches and states, the position ids) of a decoder; nothing for another model."""
    contract = cache_contract(graph)
    carried = {*(contract.past_axes if contract is not None else ()), *recurrent_state_inputs(graph)}
    if not carried:
        return set(), set()
    return carried, {v.name for v in CacheContract.position_inputs(graph)} - carried


def with_prefill_inputs(graph: ir.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` completed for a prefill from nothing, where they leave an input of
    prefill_filled out: the KV caches empty (past length 0), the states zero (their start), the
    position ids counting each row's real tokens (the attention mask's ones)."""
    carried, positions = prefill_parts(graph)
    filled = (carried | positions) - set(feeds)
    if not filled:
        return feeds
    contract, states = cache_contract(graph), recurrent_state_inputs(graph)
    tokens = next(iter(feeds.values()))
    batch, length = tokens.shape[0], tokens.shape[-1]
    mask = feeds.get("attention_mask")
    completed = dict(feeds)
    for value in graph.inputs:
        if value.name not in filled:
            continue
        dtype = value.dtype.numpy()
        if value.name in positions:
            counted = positions_of(mask) if mask is not None else np.broadcast_to(np.arange(length), (batch, length))
            completed[value.name] = np.ascontiguousarray(counted, dtype)
        elif value.name in states:  # a state's only symbolic axis is the batch
            completed[value.name] = np.zeros([batch if axis == 0 else d for axis, d in enumerate(value.shape)], dtype)
        else:
            completed[value.name] = contract.zeros(value, batch)
    return completed


def recurrent_state_inputs(graph: ir.Graph) -> set[str]:
    """The inputs carrying a recurrent state (attnrewrite.onnx.recurrent), by their
    onnxruntime-genai names: ``past_key_values.{i}.recurrent_state`` and ``.conv_state``."""
    return {
        value.name
        for value in graph.inputs
        if not value.is_initializer() and value.name.startswith("past_key_values.") and value.name.endswith(STATE_NAMES)
    }


def cache_contract(graph: ir.Graph) -> CacheContract | None:
    """The graph's KV-cache contract, None for a model without a cache."""
    past_axes = cache_inputs(graph)
    if not past_axes:
        return None
    inputs = {v.name: v for v in graph.inputs}
    past_dims = {_symbol(inputs[name].shape[axis]) for name, axis in past_axes.items() if inputs[name].shape}
    past_dims.discard(None)
    new_dims = {
        _symbol(v.shape[1])
        for v in graph.inputs
        if _is_integer(v) and v.shape is not None and len(v.shape) == 2 and embedding_rows(v) is not None
    }
    total = set()
    for value in graph.inputs:
        if value.name in past_axes or value.shape is None:
            continue
        for axis, dim in enumerate(value.shape):
            name = _symbol(dim)
            if axis == 0 or name is None or name in past_dims or name in new_dims:
                continue
            if _is_integer(value) or any(p in name for p in past_dims):
                total.add(name)
    fixed = declared_cache_sizes(graph)
    # a GroupQueryAttention takes a past only with one row or one new token: probe with prompts
    past = 0 if fixed else KV_PROBE_PAST
    return CacheContract(past_axes, frozenset(past_dims), frozenset(total), past, fixed)


def _symbol(dim) -> str | None:
    return None if isinstance(dim, int) or dim is None or str(dim) in ("", "None") else str(dim)


def _is_integer(value: ir.Value) -> bool:
    return value.dtype is not None and (
        value.dtype == ir.DataType.BOOL or np.issubdtype(value.dtype.numpy(), np.integer)
    )


def _bind(
    value: ir.Value, axis: int, bound: dict[str, int], batch: int, seq: int, contract: CacheContract | None
) -> int:
    dim = value.shape[axis]
    if isinstance(dim, int):
        return dim
    if contract is not None and contract.past_axes.get(value.name) == axis:
        return contract.past
    if contract is not None and axis in contract.fixed.get(value.name, {}):
        return contract.fixed[value.name][axis]
    key = _symbol(dim) or f"?{axis}"
    if key not in bound:
        bound[key] = batch if axis == 0 else seq
        if contract is not None and key in contract.past_dims:
            bound[key] = contract.past
        elif contract is not None and key in contract.total_dims:
            bound[key] = contract.past + seq
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


def left_padding_pattern(shape: list[int], past: int) -> np.ndarray:
    """1 = a real position, 0 = padding, along the last axis: row 0 unpadded, the others padded
    at their first min(2, past) positions (within the past, so every new token is real)."""
    pattern = np.ones(shape, dtype=np.int64)
    if len(shape) >= 2 and shape[0] > 1:
        pattern[1:, ..., : min(2, past)] = 0
    return pattern


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


def searched_lengths(seq: int, graph: ir.Graph | None = None) -> list[int]:
    """seq, 2 seq, 4 seq, ... up to MAX_SEARCHED_LENGTH (seq itself always), then the sizes the
    graph's Reshapes hold (constant_lengths)."""
    lengths = [seq]
    while lengths[-1] * 2 <= MAX_SEARCHED_LENGTH:
        lengths.append(lengths[-1] * 2)
    return lengths + [n for n in (constant_lengths(graph) if graph is not None else []) if n not in lengths]


def constant_lengths(graph: ir.Graph) -> list[int]:
    """The static sizes of the graph's Reshape outputs, in graph order: where an exporter baked
    the traced sequence length into a Reshape target (the legacy exporter's nn.MultiheadAttention),
    the model runs at that length only, and it is among these."""
    found = []
    for node in graph:
        if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
            for dim in known_dims(node.outputs[0]) or []:
                if isinstance(dim, int) and 1 < dim <= MAX_SEARCHED_LENGTH and dim not in found:
                    found.append(dim)
    return found


def first_that_runs(run: Callable[[int], T], seq: int, graph: ir.Graph | None = None) -> tuple[int, T]:
    """(length, run(length)) for the first of searched_lengths(seq, graph) at which ``run`` does
    not raise; when none does, the error at ``seq`` (what the user asked for) is raised."""
    first_error = None
    for length in searched_lengths(seq, graph):
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
