"""``--recurrent``: a decoder's KV caches become the fixed-size states of its attention's
recurrence (passes/recurrent.py).

Per KV-cache site, one node calls the method's recurrent lowering (its Recurrence) with q,
this step's NEW keys and values (after rotary; each key/value head repeated for the query heads
it serves, as the model's own repeat does), the new tokens' key_keep (the attention mask's last N
columns) and the layer's state, and returns the attention's output and the state after it. The
graph interface changes with it: the ``past_key_values.{i}.key/value`` inputs and
``present.{i}.key/value`` outputs give way to onnxruntime-genai's ``past_key_values.{i}.
recurrent_state`` and ``conv_state`` and their ``present.{i}.*``, the batch symbolic and every
other size fixed (state_layout.py); a site left alone keeps its cache pair (a hybrid). A
GroupQueryAttention's q, k and v are built from its inputs first (grouped_query.py). Whatever
read the past length from a cache input (Shape nodes: the model's own position and mask
arithmetic) reads it from what the model still takes: state_layout.PAST_LENGTH. An all-zero state is the
initial one.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.constants import known_dims
from attnrewrite.onnx.detect import CachedTensor, OnnxSite
from attnrewrite.onnx.graph_edit import INT64_MAX
from attnrewrite.onnx.grouped_query import GroupedQueryNodes, repeated_heads
from attnrewrite.onnx.inputs import cache_contract, embedding_rows
from attnrewrite.onnx.replacement import Replacements
from attnrewrite.onnx.state_layout import Packing, layout
from attnrewrite.passes.recurrent import RecurrentLowering

_DTYPES = {"float32": ir.DataType.FLOAT, "int64": ir.DataType.INT64}


@dataclasses.dataclass(frozen=True)
class Interface:
    """What the recurrent model reads its new tokens' count and padding from."""

    mask: ir.Value  # [batch, past + new]: 1 = a token
    input_ids: ir.Value  # [batch, new]


def interface_refusal(graph: ir.Graph, sites: list[OnnxSite]) -> tuple[Interface | None, str | None]:
    """(the interface, None), or (None, why the KV-cache sites in ``sites`` (those to become
    recurrent) cannot: the reason in words), checked before anything changes."""
    contract = cache_contract(graph)
    masks = contract.mask_inputs(graph) if contract is not None else []
    ids = [v for v in graph.inputs if v.shape is not None and len(v.shape) == 2 and embedding_rows(v) is not None]
    if not masks or not ids:
        missing = "an attention mask over past and new tokens" if not masks else "token ids (input_ids)"
        return None, f"--recurrent needs {missing} among the model's inputs: the past length and padding come from them"
    for s in sites:
        reason = _site_refusal(s) or _past_readers_refusal(s)
        if reason:
            return None, reason
    return Interface(masks[0], ids[0]), None


def _site_refusal(s: OnnxSite) -> str | None:
    """Why the site's shapes cannot fix its state's sizes, naming the site (the reason refuses
    every site of the model)."""
    site = s.site
    if site.rank != 4 or _query_heads(s) is None:
        needed = "q as [batch, heads, seq, head_dim] with a known number of heads"
    elif site.head_dim is None or site.value_dim is None:
        needed = "the head dims known (the state's sizes are fixed)"
    elif _kv_dims(s) is None:
        return f"--recurrent needs the KV cache {s.key_cache.past.name!r}'s heads and head dim fixed"
    else:
        return None
    return f"--recurrent needs {needed}, which the shapes at {site.name!r} do not say"


def _past_readers_refusal(s: OnnxSite) -> str | None:
    for cache in (s.key_cache, s.value_cache):
        for node in _past_readers(cache.past):
            if node is not cache.node and node.op_type != "Shape":
                return (
                    f"the KV cache {cache.past.name!r} is also read by {node.op_type} node {node.name!r}, which a "
                    f"recurrent model, keeping no past keys, cannot feed"
                )
    return None


def _past_readers(past: ir.Value) -> list[ir.Node]:
    """The nodes reading a cache input, through copies (Identity, Cast, a one-input Concat)."""
    readers, frontier = [], [past]
    while frontier:
        for use in frontier.pop().uses():
            node = use.node
            if node.op_type in ("Identity", "Cast") or (node.op_type == "Concat" and len(node.inputs) == 1):
                frontier.append(node.outputs[0])
            else:
                readers.append(node)
    return readers


def _query_heads(s: OnnxSite) -> int | None:
    if s.grouped_query is not None:
        return s.grouped_query.num_heads
    dims = known_dims(s.q)
    heads = dims[1] if dims is not None and len(dims) == 4 else None
    return heads if isinstance(heads, int) else s.site.num_heads


def _kv_dims(s: OnnxSite) -> tuple[int, int] | None:
    """(kv heads, head dim) of the site's cache: the operator's, or the cache input's."""
    if s.grouped_query is not None:
        return s.grouped_query.kv_heads, s.grouped_query.head_size
    return _static_dims(s.key_cache.past)


def _static_dims(past: ir.Value) -> tuple[int, int] | None:
    """(kv heads, head dim) of a cache input declared [batch, kv_heads, past, head_dim]."""
    dims = past.shape
    if dims is None or len(dims) != 4 or not all(isinstance(d, int) for d in (dims[1], dims[3])):
        return None
    return dims[1], dims[3]


class RecurrentSplicer:
    """Splices recurrent replacements into one model; ``finish`` then changes its interface."""

    def __init__(self, model: ir.Model, interface: Interface, contrib_ops: bool = False):
        """``contrib_ops``: a GroupQueryAttention's rotation stays onnxruntime's
        RotaryEmbedding (the model already runs its contrib operators)."""
        self.replacements = Replacements(model)
        self.edit, self.calls = self.replacements.edit, self.replacements.calls  # calls: site name -> its node
        self.graph, self.interface = model.graph, interface
        # positions counted in the interface's mask (a recurrent model keeps no cache rows)
        self.grouped_query = GroupedQueryNodes(self.edit, interface.mask, rotary_operator=contrib_ops)
        self._new_key_keep: ir.Value | None = None
        self._past_length_value: ir.Value | None = None
        self.state_inputs: list[str] = []
        self.parts: list[str] = []  # where each state part lives (Layout.describe)
        self._caches: list[CachedTensor] = []
        self._cache_dims: dict[str, tuple[int, int]] = {}  # cache input -> (kv heads, head dim)

    @property
    def bytes_added(self) -> int:
        """Of the initializers this splicer added."""
        return self.replacements.initializers.bytes_added

    def check(self, s: OnnxSite) -> None:
        """Nothing more to check: this splice takes k and v from the caches' new tokens and
        key_keep from the attention mask, not the site's k^T and mask as the parallel one does;
        interface_refusal checked what it needs, for every site, before anything changed."""

    def splice(self, s: OnnxSite, lowering: RecurrentLowering, own: frozenset[str] = frozenset()) -> str:
        """``own``: as Splicer.splice's. Returns the replacement's qualified op type."""
        edit, anchor = self.edit, s.output.producer()
        new_nodes: list[ir.Node] = []
        heads, (kv_heads, head_dim) = _query_heads(s), _kv_dims(s)
        if s.grouped_query is not None:
            q, k, v = self.grouped_query.heads(s.grouped_query, new_nodes)
        else:
            q, k, v = (edit.current(x) for x in (s.q, s.key_cache.new, s.value_cache.new))
        if lowering.key_value_groups == 1:
            k, v = (repeated_heads(edit, x, heads, kv_heads, head_dim, new_nodes) for x in (k, v))
        elif lowering.key_value_groups * kv_heads != heads:
            raise AttnRewriteError(
                f"{s.site.name}: the replacement takes {heads // lowering.key_value_groups} key/value heads, "
                f"the KV cache has {kv_heads}"
            )
        packing, packed, state = self._state(s, lowering.state, heads, kv_heads, new_nodes)
        inputs = [q, k, v, self._key_keep_of_new_tokens(q, new_nodes), *state]
        call = self.replacements.call(s, lowering, inputs, own, num_outputs=1 + len(state))
        after: list[ir.Node] = []
        output = call.outputs[0]
        if s.grouped_query is not None:
            output = self.grouped_query.merged(output, s.grouped_query, after)
        layer = _layer_number(s)
        for tensor, value in packing.pack(packed, list(call.outputs[1:]), after).items():
            value.name = f"present.{layer}.{tensor}"
            value.type, value.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(packing.layout.shapes[tensor])
            self.graph.outputs.append(value)
        replaced = self.replacements.insert(s, anchor, [*new_nodes, call, *after], output)
        edit.remove_dead(s.nodes)
        self._caches += [s.key_cache, s.value_cache]
        for cache in (s.key_cache, s.value_cache):
            self._cache_dims[cache.past.name] = (kv_heads, head_dim)
        return replaced

    def _key_keep_of_new_tokens(self, q: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[B, 1, N, 1] float, 1.0 where a new token is real: the mask's last N columns."""
        if self._new_key_keep is None:
            new = self.edit.node(new_nodes, "Neg", [self._dim(q, 2, new_nodes)])
            last = self.edit.node(
                new_nodes, "Slice", [self.interface.mask, new, self.edit.const([INT64_MAX]), self.edit.const([1])]
            )
            as_float = self.edit.node(new_nodes, "Cast", [last], [ir.AttrInt64("to", ir.DataType.FLOAT)])
            self._new_key_keep = self.edit.node(new_nodes, "Unsqueeze", [as_float, self.edit.const([1, 3])])
            self._new_key_keep.name = "attnrewrite/new_key_keep"
        return self._new_key_keep

    def _state(self, s: OnnxSite, description, heads: int, kv_heads: int, new_nodes: list[ir.Node]):
        """(the packing, the layer's packed state inputs (added to the graph), the parts
        unpacked from them)."""
        sizes = {"B": self.interface.mask.shape[0], "H": heads, "Hkv": kv_heads}
        sizes |= {"D": s.site.head_dim, "Dv": s.site.value_dim}
        model_dtype = s.key_cache.past.dtype
        dtypes = [_DTYPES.get(t.dtype, model_dtype) for t in description]
        packing = Packing(layout(description, sizes), dtypes, self.edit)
        self.parts = packing.layout.describe()
        packed = {}
        for tensor, shape in packing.layout.shapes.items():
            value = ir.Value(
                name=f"past_key_values.{_layer_number(s)}.{tensor}",
                type=ir.TensorType(ir.DataType.FLOAT),
                shape=ir.Shape(shape),
            )
            self.graph.inputs.append(value)
            self.state_inputs.append(value.name)
            packed[tensor] = value
        return packing, packed, packing.unpack(packed, self._past_length(new_nodes), new_nodes)

    def _past_length(self, new_nodes: list[ir.Node]) -> ir.Value:
        """The positions consumed before this call, padding included (PAST_LENGTH), a scalar."""
        if self._past_length_value is None:
            mask, ids = self.interface.mask, self.interface.input_ids
            past = self.edit.node(new_nodes, "Sub", [self._dim(mask, 1, new_nodes), self._dim(ids, 1, new_nodes)])
            self._past_length_value = self.edit.node(new_nodes, "Squeeze", [past, self.edit.const([0])])
        return self._past_length_value

    def finish(self) -> None:
        """The KV caches leave the interface; what read their shapes reads them from the mask
        (the past length: PAST_LENGTH)."""
        for cache in self._caches:
            if cache.output is not None and cache.output in self.graph.outputs:
                self.graph.outputs.remove(cache.output)
            if cache.present is None:  # a fused operator that returns no present
                continue
            for node in [use.node for use in cache.present.uses() if use.node.op_type == "Shape"]:
                self._read_shape(node, functools.partial(self._cache_shape, cache, False))
            for node in _shape_readers_through_layout(cache.present):
                self._read_shape(node, functools.partial(self._shape_of_dims, known_dims(node.inputs[0])))
        self.edit.remove_dead([c.node for c in self._caches])
        for cache in self._caches:
            for node in _past_readers(cache.past):
                if node.op_type == "Shape":
                    self._read_shape(node, functools.partial(self._cache_shape, cache, True))
            self.edit.remove_dead([use.node for use in cache.past.uses()])  # copies nothing reads now
            if cache.past.uses():
                raise AttnRewriteError(
                    f"--recurrent: the KV cache {cache.past.name!r} is still read by "
                    f"{', '.join(sorted({u.node.op_type for u in cache.past.uses()}))} after the rewrite, "
                    f"which a model keeping no past keys cannot feed"
                )
            self.graph.inputs.remove(cache.past)

    def _read_shape(self, shape_node: ir.Node, full_shape) -> None:
        """``shape_node`` (Shape of the cache input, of past and new keys or of a layout of
        them, maybe sliced) replaced by the same slice of ``full_shape(nodes)``, the shape its
        input would have had (None where unknown: the node stays, and the rewrite fails)."""
        attributes = shape_node.attributes
        start = attributes["start"].as_int() if "start" in attributes else 0
        end = attributes["end"].as_int() if "end" in attributes else INT64_MAX
        nodes: list[ir.Node] = []
        full = full_shape(nodes)
        if full is None:
            return
        sliced = self.edit.node(nodes, "Slice", [full, self.edit.const([start]), self.edit.const([end])])
        self.graph.insert_before(shape_node, nodes)
        shape_node.outputs[0].replace_all_uses_with(sliced)
        source = shape_node.inputs[0].producer()
        self.graph.remove(shape_node, safe=True)
        if source is not None:
            self.edit.remove_dead([source])

    def _cache_shape(self, cache: CachedTensor, past: bool, nodes: list[ir.Node]) -> ir.Value:
        """[batch, kv_heads, length, head_dim] of the cache input (length: PAST_LENGTH) or of
        past and new keys (the mask's length)."""
        mask, ids = self.interface.mask, self.interface.input_ids
        kv_heads, head_dim = self._cache_dims[cache.past.name]
        total = self._dim(mask, 1, nodes)
        length = self.edit.node(nodes, "Sub", [total, self._dim(ids, 1, nodes)]) if past else total
        shape = [self._dim(mask, 0, nodes), self.edit.const([kv_heads]), length, self.edit.const([head_dim])]
        return self.edit.node(nodes, "Concat", shape, [ir.AttrInt64("axis", 0)])

    def _shape_of_dims(self, dims, nodes: list[ir.Node]) -> ir.Value | None:
        """The shape of a layout of past and new keys (GQA's repeated heads), from its inferred
        dims: fixed sizes, and the attention mask's batch and length by their symbols."""
        mask = self.interface.mask
        by_symbol = {str(mask.shape[0]): 0, str(mask.shape[1]): 1}
        if dims is None or not all(isinstance(d, int) or str(d) in by_symbol for d in dims):
            return None
        parts = [
            self.edit.const([d]) if isinstance(d, int) else self._dim(mask, by_symbol[str(d)], nodes) for d in dims
        ]
        return self.edit.node(nodes, "Concat", parts, [ir.AttrInt64("axis", 0)])

    def _dim(self, x: ir.Value, axis: int, nodes: list[ir.Node]) -> ir.Value:
        """[x.shape[axis]]."""
        return self.edit.node(nodes, "Shape", [x], [ir.AttrInt64("start", axis), ir.AttrInt64("end", axis + 1)])


def _shape_readers_through_layout(present: ir.Value) -> list[ir.Node]:
    """Shape nodes reading a layout of ``present`` (its heads repeated, transposed), which
    outlive the attention they were computed for."""
    readers, frontier = [], [present]
    while frontier:
        for use in frontier.pop().uses():
            if use.node.op_type in ("Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Identity"):
                frontier.append(use.node.outputs[0])
            elif use.node.op_type == "Shape" and use.node.inputs[0] is not present:
                readers.append(use.node)
    return readers


def _layer_number(s: OnnxSite) -> int | str:
    """i of the cache input ``past_key_values.{i}.key`` (the site's layer index otherwise)."""
    found = re.fullmatch(r"past_key_values\.(\w+)\.key", s.key_cache.past.name)
    return found.group(1) if found else s.site.layer


def record_note(state_inputs: list[str], parts: list[str], kept_caches: list[str]) -> str:
    """``kept_caches``: the KV caches of the sites left alone, which the model still carries
    beside the states (a hybrid, as onnxruntime-genai runs them)."""
    note = (
        f"recurrent: the KV caches became fixed-size states in onnxruntime-genai's layout, inputs "
        f"{', '.join(state_inputs)} (start from zeros; outputs present.*); each layer's parts: {'; '.join(parts)}"
    )
    if kept_caches:
        note += f"; the sites left alone keep their KV caches ({', '.join(kept_caches)})"
    return note
