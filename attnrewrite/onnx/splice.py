"""Replace a matched attention with one node that calls the pass's model-local function.

The replacement reads q, k (un-transposed), v, a key_keep tensor ([..., Nk, 1], 1.0 = attend)
derived from the mask's last query row, and the pass's constants. The nodes the attention used
become dead and are removed, together with initializers nothing else reads.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.onnx.constants import known_dims
from attnrewrite.onnx.detect import HeadLayout, HeadSource, OnnxSite, PackedHeads, Unsupported
from attnrewrite.onnx.grouped_query import GroupedQueryNodes
from attnrewrite.onnx.inputs import cache_contract
from attnrewrite.passes.lowering import DOMAIN, DOMAIN_VERSION, OnnxLowering
from attnrewrite.site import MASKED_BELOW, MaskEncoding, MaskTerm

INT64_MAX = np.iinfo(np.int64).max
_KEY_INDEX = (MaskEncoding.KEY_LENGTHS, MaskEncoding.KEY_RANGES)


class Splicer:
    """Splices replacements into one model, sharing what sites have in common (the key_keep of
    a mask all layers use, identical function bodies)."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.graph = model.graph
        self._key_keep_cache: dict[tuple, ir.Value] = {}
        # content -> initializer: sites with the same shapes and seed draw the same constants
        # (Linformer's [max_len, proj_dim] projections), which are stored once
        self._constants: dict[tuple, ir.Value] = {}
        self.bytes_added = 0  # of the initializers this splicer added
        # old output -> its replacement: a site's q, k or v may be an earlier site's output
        # (attention feeding attention), captured before that site was spliced
        self._successor: dict[int, ir.Value] = {}
        self.calls: dict[str, ir.Node] = {}  # site name -> its replacement node
        self._grouped_query: GroupedQueryNodes | None = None
        model.opset_imports[DOMAIN] = DOMAIN_VERSION

    def check(self, s: OnnxSite) -> None:
        """Raise Unsupported before anything is changed, if this site cannot be spliced."""
        if s.grouped_query is not None:
            return  # its q, k, v, rows and cache come from the operator's inputs (grouped_query.py)
        if s.packing is None and s.k is None and _untranspose_plan(s.k_transposed) is None:
            raise Unsupported("the rank of k^T is unknown, so k cannot be recovered")
        if s.site.mask.key_padding and any(t.rank is None for t in s.masks):
            raise Unsupported("the key padding mask's rank is unknown")
        if s.key_cache is not None and (s.q.shape is None or len(s.q.shape) < 3):
            raise Unsupported("the rank of q is unknown, so the new queries cannot be placed after the cached keys")
        if s.key_cache is not None and s.key_cache.node.op_type != "Concat":
            raise Unsupported(
                f"the KV cache is appended inside {s.key_cache.node.op_type} node {s.key_cache.node.name!r}, whose "
                f"present keys a parallel rewrite would have to write itself; rewrite it with --recurrent"
            )

    def splice(self, s: OnnxSite, lowering: OnnxLowering, own: frozenset[str] = frozenset()) -> str:
        """``own``: names of constants this site must not share with another (site_constants)."""
        anchor = s.output.producer()
        new_nodes: list[ir.Node] = []
        if s.grouped_query is not None:
            return self._splice_grouped_query(s, lowering, own)
        if s.packing is not None:
            q, k, v = self._unpack(s.packing, new_nodes)
            for role, value in zip("qkv", (q, k, v)):  # named, so the unpacked q, k, v can be found
                if any(value.producer() is node for node in new_nodes):  # not a graph input's name
                    value.name = f"{s.site.name}/{role}"
        else:
            q, v = self._current(s.q), self._current(s.v)
            k = self._current(s.k) if s.k is not None else self._untranspose(self._current(s.k_transposed), new_nodes)
            k, v = self._broadcast_to_queries(k, q, new_nodes), self._broadcast_to_queries(v, q, new_nodes)
        key_keep = self._key_keep(s, k, new_nodes) if s.site.mask.key_padding else self._keep_all_value()
        past = self._past_rows(q, k, new_nodes) if s.key_cache is not None else None
        constants = self.site_constants(s, lowering, own)
        op_type = self._add_functions(lowering)
        call = ir.Node(
            DOMAIN,
            op_type,
            [q if past is None else self._behind(past, q, len(s.q.shape), new_nodes), k, v, key_keep, *constants],
            name=f"{s.site.name}/{op_type}",
            num_outputs=1,
        )
        after: list[ir.Node] = []
        result = call.outputs[0]
        if past is not None:  # the new queries' rows
            result = self._node(after, "Slice", [result, past, self._const([INT64_MAX]), self._const([-2])])
        if s.packing is not None:
            result = self._merge_heads(result, after)
        result.type, result.shape = s.output.type, s.output.shape
        self.calls[s.site.name] = call
        self.graph.insert_before(anchor, [*new_nodes, call, *after])
        self._take_over(s.output, result)
        self._remove_dead(s.nodes)
        return f"{DOMAIN}.{op_type}"

    # -- inputs of the replacement ------------------------------------------------------------

    def _splice_grouped_query(self, s: OnnxSite, lowering: OnnxLowering, own: frozenset[str]) -> str:
        """A GroupQueryAttention in parallel: its cache written as the operator writes it (the
        model keeps returning present_key and present_value), then the method over every
        position up to the longest row's, each new query at its own position."""
        operator, plan, grouped = s.key_cache.node, s.grouped_query, self.grouped_query_nodes()
        new_nodes: list[ir.Node] = []
        rows = grouped.cache_rows(operator, new_nodes)
        q, k, v = grouped.heads(plan, self._current, new_nodes, rows)
        caches = [s.key_cache, s.value_cache]
        presents = [grouped.written(self._current(c.past), new, rows, new_nodes) for c, new in zip(caches, (k, v))]
        k, v = (
            self.repeated_heads(
                grouped.until_total(p, rows, new_nodes), plan.num_heads, plan.kv_heads, plan.head_size, new_nodes
            )
            for p in presents
        )
        constants = self.site_constants(s, lowering, own)
        op_type = self._add_functions(lowering)
        inputs = [grouped.placed(q, rows, new_nodes), k, v, grouped.key_keep(rows, new_nodes), *constants]
        call = ir.Node(DOMAIN, op_type, inputs, name=f"{s.site.name}/{op_type}", num_outputs=1)
        after: list[ir.Node] = []
        output = grouped.merged(grouped.taken(call.outputs[0], rows, after), plan, after)
        output.type, output.shape = s.output.type, s.output.shape
        self.calls[s.site.name] = call
        self.graph.insert_before(operator, [*new_nodes, call, *after])
        self._take_over(s.output, output)
        for cache, present in zip(caches, presents):
            if cache.present is not None:
                present.type, present.shape = cache.present.type, cache.present.shape
                self._take_over(cache.present, present)
            for value in (cache.past, present):
                _declare_cache_sizes(value, plan.kv_heads, plan.head_size)
        self._remove_dead(s.nodes)
        return f"{DOMAIN}.{op_type}"

    def grouped_query_nodes(self) -> GroupedQueryNodes:
        """The builder of a GroupQueryAttention's unpacking, rotation and cache, with the
        model's attention mask where it takes one (a recurrent rewrite counts positions there)."""
        if self._grouped_query is None:
            contract = cache_contract(self.graph)
            masks = contract.mask_inputs(self.graph) if contract is not None else []
            self._grouped_query = GroupedQueryNodes(self._node, self._const, masks[0] if masks else None)
        return self._grouped_query

    def repeated_heads(self, x: ir.Value, heads: int, kv_heads: int, head_dim: int, new_nodes) -> ir.Value:
        """Keys or values [B, Hkv, N, D] as [B, heads, N, D], query head h reading key/value
        head h // (heads / Hkv)."""
        if kv_heads == heads:
            return x
        grouped = self._node(new_nodes, "Unsqueeze", [x, self._const([2])])
        grouped = self._node(new_nodes, "Expand", [grouped, self._const([1, 1, heads // kv_heads, 1, 1])])
        return self._node(new_nodes, "Reshape", [grouped, self._const([0, heads, -1, head_dim])])

    def _past_rows(self, q: ir.Value, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[past]: the cached keys' count, the keys' rows before the new queries'."""
        keys, queries = (
            self._node(new_nodes, "Shape", [x], [ir.AttrInt64("start", -2), ir.AttrInt64("end", -1)]) for x in (k, q)
        )
        return self._node(new_nodes, "Sub", [keys, queries])

    def _behind(self, past: ir.Value, q: ir.Value, rank: int, new_nodes: list[ir.Node]) -> ir.Value:
        """q [..., N, D] behind ``past`` rows of zeros, each query at its position among the keys:
        a causal form over past and new keys then gives query i the keys up to past + i (the
        site's offset causal mask). The zero rows' outputs are dropped after the call."""
        # every pad listed: onnxruntime's transpose optimizer misreads Pad's axes input
        before, after = self._const([0] * (rank - 2)), self._const([0] * (rank + 1))
        pads = self._node(new_nodes, "Concat", [before, past, after], [ir.AttrInt64("axis", 0)])
        return self._node(new_nodes, "Pad", [q, pads])  # zeros of q's type

    def _untranspose(self, k_t: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        source, perm = _untranspose_plan(k_t)
        if perm == list(range(len(perm))):
            return source
        node = ir.Node("", "Transpose", [source], [ir.AttrInt64s("perm", perm)], name=f"{k_t.name}/untransposed")
        new_nodes.append(node)
        return node.outputs[0]

    def _broadcast_to_queries(self, value: ir.Value, q: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """k or v with q's leading dims, as the attention reads them: one key/value head
        broadcast by the MatMuls (multi-query attention) expanded, grouped heads (the Attention
        op's kv_num_heads < q_num_heads) repeated, query head h reading key/value head
        h // group. Every method then sees one key/value head per query head."""
        if not _broadcasts(value, q):
            return value

        def shape_of(x, **slice_bounds):
            return self._node(new_nodes, "Shape", [x], [ir.AttrInt64(k, b) for k, b in slice_bounds.items()])

        def concat(*parts):
            return self._node(new_nodes, "Concat", list(parts), [ir.AttrInt64("axis", 0)])

        rows = shape_of(value, start=-2)
        target = concat(shape_of(q, end=-2), rows)
        group = _head_group(value, q)
        if group is None:
            return self._node(new_nodes, "Expand", [value, target])
        # [.., Hkv, N, D] -> [.., Hkv, group, N, D] -> [.., Hkv * group, N, D]
        unsqueezed = self._node(new_nodes, "Unsqueeze", [value, self._const([-3])])
        grouped = self._node(
            new_nodes, "Expand", [unsqueezed, concat(shape_of(value, end=-2), self._const([group]), rows)]
        )
        return self._node(new_nodes, "Reshape", [grouped, target])

    def _key_keep(self, s: OnnxSite, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        # a key index (lengths, ranges) becomes a keep row as long as the site's keys
        key = tuple((id(t.value), t.encoding, id(k) if t.encoding in _KEY_INDEX else None) for t in s.masks)
        if key in self._key_keep_cache:
            return self._key_keep_cache[key]
        keep = None
        for term in s.masks:
            if term.batch_first:
                term_keep = self._contrib_keep(term, k, new_nodes)
            else:
                term_keep = self._last_row_keep(term, new_nodes)
            keep = term_keep if keep is None else self._node(new_nodes, "And", [keep, term_keep])
        as_float = self._node(new_nodes, "Cast", [keep], [ir.AttrInt64("to", ir.DataType.FLOAT)])
        rank = max(t.keep_rank for t in s.masks)
        perm = [*range(max(rank, 2) - 2), max(rank, 2) - 1, max(rank, 2) - 2]
        result = self._node(new_nodes, "Transpose", [as_float], [ir.AttrInt64s("perm", perm)])
        result.name = f"{s.site.name}/key_keep"
        self._key_keep_cache[key] = result
        return result

    def _last_row_keep(self, term: MaskTerm, new_nodes: list[ir.Node]) -> ir.Value:
        """Which keys the last query may attend to: for key padding every row says the same,
        and under a causal mask the last row sees every position."""
        mask = self._current(term.value)
        if term.rank >= 2:
            row = self._node(
                new_nodes,
                "Slice",
                [mask, self._const([-1]), self._const([INT64_MAX]), self._const([-2])],
            )
        else:
            row = self._node(new_nodes, "Unsqueeze", [mask, self._const([0])])
        if term.encoding is MaskEncoding.ADDITIVE:
            threshold = np.array(MASKED_BELOW, dtype=mask.dtype.numpy())
            return self._node(new_nodes, "Greater", [row, self._const(threshold)])
        if mask.dtype != ir.DataType.BOOL:
            row = self._node(new_nodes, "Cast", [row], [ir.AttrInt64("to", ir.DataType.BOOL)])
        if term.encoding is MaskEncoding.KEEP_WHERE_FALSE:
            return self._node(new_nodes, "Not", [row])
        return row

    def _contrib_keep(self, term: MaskTerm, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[batch, 1, 1, keys], True where onnxruntime's contrib attention lets the last query
        attend (masks.contrib_keep_matrix says the same in numpy)."""
        mask = self._current(term.value)
        if term.encoding in _KEY_INDEX:
            keep = self._index_keep(mask, term.encoding, k, new_nodes)
            return self._node(new_nodes, "Unsqueeze", [keep, self._const([1, 2])])
        if term.rank == 3:  # [batch, queries, keys]: the last query's row
            mask = self._node(
                new_nodes, "Slice", [mask, self._const([-1]), self._const([INT64_MAX]), self._const([-2])]
            )
        as_float = self._node(new_nodes, "Cast", [mask], [ir.AttrInt64("to", ir.DataType.FLOAT)])
        keep = self._node(new_nodes, "Greater", [as_float, self._const(np.array(0, np.float32))])
        return self._node(new_nodes, "Unsqueeze", [keep, self._const([1, 2] if term.rank == 2 else [1])])

    def _index_keep(self, index: ir.Value, form: MaskEncoding, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[batch, keys] from key lengths [batch] or end and start positions [2 * batch]."""
        index = self._node(new_nodes, "Cast", [index], [ir.AttrInt64("to", ir.DataType.INT64)])
        keys = self._node(new_nodes, "Shape", [k], [ir.AttrInt64("start", 2), ir.AttrInt64("end", 3)])
        zero, one = self._const(np.array(0, np.int64)), self._const(np.array(1, np.int64))
        positions = self._node(new_nodes, "Range", [zero, self._node(new_nodes, "Squeeze", [keys]), one])
        if form is MaskEncoding.KEY_LENGTHS:
            lengths = self._node(new_nodes, "Unsqueeze", [index, self._const([1])])
            return self._node(new_nodes, "Less", [positions, lengths])
        bounds = self._node(new_nodes, "Reshape", [index, self._const([2, -1, 1])])
        ends, starts = (self._node(new_nodes, "Gather", [bounds, i]) for i in (zero, one))
        after_start = self._node(new_nodes, "GreaterOrEqual", [positions, starts])
        return self._node(new_nodes, "And", [after_start, self._node(new_nodes, "Less", [positions, ends])])

    # -- unpacking a contrib operator's q, k, v ----------------------------------------------

    def _unpack(self, packing: PackedHeads, new_nodes: list[ir.Node]) -> list[ir.Value]:
        """q, k, v as [batch, heads, seq, head_dim], with the operator's bias added."""
        sources = packing.sources
        if packing.projection is not None:
            x, weights = (self._current(v) for v in packing.projection)
            projected = self._node(new_nodes, "MatMul", [x, weights])
            sources = [HeadSource(part) for part in self._split(projected, packing.sizes, -1, new_nodes)]
        heads = [self._split_heads(source, packing.num_heads, new_nodes) for source in sources]
        if packing.bias is None:
            return heads
        biases = self._split(self._current(packing.bias), packing.sizes, 0, new_nodes)
        per_head = self._const([packing.num_heads, 1, -1])  # broadcasts over batch and seq
        return [
            self._node(new_nodes, "Add", [h, self._node(new_nodes, "Reshape", [b, per_head])])
            for h, b in zip(heads, biases)
        ]

    def _split_heads(self, source: HeadSource, heads: int, new_nodes: list[ir.Node]) -> ir.Value:
        value = self._current(source.value)
        if source.layout is HeadLayout.HEADS:
            return value
        if source.layout is HeadLayout.PACKED:  # [batch, seq, heads, n, head_dim]
            value = self._node(
                new_nodes, "Gather", [value, self._const(np.array(source.index, np.int64))], [ir.AttrInt64("axis", 3)]
            )
        else:  # [batch, seq, heads * head_dim]
            value = self._node(new_nodes, "Reshape", [value, self._const([0, 0, heads, -1])])
        return self._node(new_nodes, "Transpose", [value], [ir.AttrInt64s("perm", [0, 2, 1, 3])])

    def _merge_heads(self, value: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[batch, heads, seq, head_dim] back to the operator's [batch, seq, heads * head_dim]."""
        merged = self._node(new_nodes, "Transpose", [value], [ir.AttrInt64s("perm", [0, 2, 1, 3])])
        return self._node(new_nodes, "Reshape", [merged, self._const([0, 0, -1])])

    def _split(self, value: ir.Value, sizes, axis: int, new_nodes: list[ir.Node]) -> list[ir.Value]:
        node = ir.Node(
            "", "Split", [value, self._const(list(sizes))], [ir.AttrInt64("axis", axis)], num_outputs=len(sizes)
        )
        new_nodes.append(node)
        return list(node.outputs)

    def _keep_all_value(self) -> ir.Value:
        return self._constant("attnrewrite/keep_all_keys", np.ones((1, 1), np.float32))

    # -- graph surgery ------------------------------------------------------------------------

    def _current(self, value: ir.Value) -> ir.Value:
        while id(value) in self._successor:
            value = self._successor[id(value)]
        return value

    def _take_over(self, old: ir.Value, new: ir.Value) -> None:
        self._successor[id(old)] = new
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{name}/replaced"
        new.name = name

    def _remove_dead(self, seeds: list[ir.Node]) -> None:
        work = list(seeds)
        while work:
            node = work.pop()
            if node.graph is not self.graph or any(o.uses() or o.is_graph_output() for o in node.outputs):
                continue
            inputs = [v for v in node.inputs if v is not None]
            self.graph.remove(node, safe=True)
            for value in inputs:
                if value.producer() is not None:
                    work.append(value.producer())
                elif value.is_initializer() and not value.uses() and not value.is_graph_input():
                    self.graph.initializers.pop(value.name, None)

    def _add_functions(self, lowering: OnnxLowering) -> str:
        """Add the lowering's functions; an identical body already present is reused, a
        different one under the same name is renamed (callers' references follow)."""
        renamed: dict[str, str] = {}
        for proto in lowering.functions:
            for opset in proto.opset_import:  # com.microsoft, where a step uses LinearAttention
                self.model.opset_imports.setdefault(opset.domain, opset.version)
            proto = _with_callees_renamed(proto, renamed)
            base, name, suffix = proto.name, proto.name, 2
            while (DOMAIN, name, "") in self.model.functions:
                if _same_body(self.model.functions[(DOMAIN, name, "")], proto):
                    break
                name, suffix = f"{base}_{suffix}", suffix + 1
            else:
                proto.name = name
                self.model.functions[(DOMAIN, name, "")] = ir.serde.deserialize_function(proto)
            renamed[base] = name
        return renamed[lowering.op_type]

    # -- small builders -----------------------------------------------------------------------

    def _node(self, new_nodes, op_type, inputs, attributes=()) -> ir.Value:
        node = ir.Node("", op_type, inputs, attributes, num_outputs=1)
        new_nodes.append(node)
        return node.outputs[0]

    def _const(self, array) -> ir.Value:
        array = np.asarray(array, dtype=np.int64) if isinstance(array, list) else array
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array))], num_outputs=1)
        self.graph.insert_before(self.graph.node(0), node) if self.graph.num_nodes() else self.graph.append(node)
        return node.outputs[0]

    def site_constants(self, s: OnnxSite, lowering: OnnxLowering, own: frozenset[str]) -> list[ir.Value]:
        """The lowering's constants as initializers, shared with other sites where equal, but for
        those in ``own`` (values that calibration will fit per site, though they start equal)."""
        return [
            self._initializer(f"{s.site.name}/{name}", array)
            if name in own
            else self._constant(f"{s.site.name}/{name}", array)
            for name, array in lowering.constants.items()
        ]

    def _constant(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer holding `array`: the one already added with the same content, if any."""
        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest())
        if key not in self._constants:
            self._constants[key] = self._initializer(name, array)
        return self._constants[key]

    def _initializer(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=unique_initializer_name(self.graph, name), const_value=ir.tensor(array))
        value.type = ir.TensorType(value.const_value.dtype)
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        self.bytes_added += array.nbytes
        return value


def _declare_cache_sizes(cache: ir.Value, kv_heads: int, head_size: int) -> None:
    """A [batch, kv_heads, length, head_size] cache declared with its fixed sizes: the builder
    leaves the head size symbolic ("kv_cache_dim") for the operator, gone now, to fix."""
    if cache.shape is not None and len(cache.shape) == 4:
        batch, _, length, _ = cache.shape
        cache.shape = ir.Shape([batch, kv_heads, length, head_size])


def _broadcasts(value: ir.Value, q: ir.Value) -> bool:
    """Whether value ([..., N, D]) may have other leading dims than q ([..., Nq, D]): unless
    they are provably the same, the attention's MatMuls may have broadcast it."""
    value_dims, q_dims = known_dims(value), known_dims(q)
    if value_dims is None or q_dims is None or len(value_dims) != len(q_dims):
        return True
    return any(v is None or v != d for v, d in zip(value_dims[:-2], q_dims[:-2]))


def _head_group(value: ir.Value, q: ir.Value) -> int | None:
    """Query heads per key/value head, when value has static heads (dim -3) > 1 that divide q's."""
    value_dims, q_dims = known_dims(value), known_dims(q)
    if value_dims is None or q_dims is None or len(value_dims) != len(q_dims) or len(q_dims) < 3:
        return None
    kv_heads, heads = value_dims[-3], q_dims[-3]
    if isinstance(kv_heads, int) and isinstance(heads, int) and 1 < kv_heads < heads and heads % kv_heads == 0:
        return heads // kv_heads
    return None


def _untranspose_plan(k_t: ir.Value) -> tuple[ir.Value, list[int]] | None:
    """(source, perm) with Transpose(source, perm) == k: composes with a Transpose producing
    k^T so that the common [0, 2, 3, 1] / [0, 2, 1, 3] pair cancels to one or zero nodes."""
    node = k_t.producer()
    if node is not None and node.op_type == "Transpose" and "perm" in node.attributes:
        perm = list(node.attributes["perm"].as_ints())
        swap = [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]
        return node.inputs[0], [perm[i] for i in swap]
    if k_t.shape is None:
        return None
    rank = len(k_t.shape)
    return k_t, [*range(rank - 2), rank - 1, rank - 2]


def _with_callees_renamed(proto: onnx.FunctionProto, renamed: dict[str, str]) -> onnx.FunctionProto:
    copy = onnx.FunctionProto()
    copy.CopyFrom(proto)
    for node in copy.node:
        if node.domain == DOMAIN and node.op_type in renamed:
            node.op_type = renamed[node.op_type]
    return copy


def _same_body(existing: ir.Function, proto: onnx.FunctionProto) -> bool:
    mine = ir.serde.serialize_function(existing)
    theirs = ir.serde.serialize_function(ir.serde.deserialize_function(proto))
    theirs.name = mine.name
    return mine.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


def unique_initializer_name(graph: ir.Graph, name: str) -> str:
    """``name``, or ``name_2``, ``name_3``, ... where an initializer already has it."""
    candidate, n = name, 2
    while candidate in graph.initializers:
        candidate, n = f"{name}_{n}", n + 1
    return candidate
