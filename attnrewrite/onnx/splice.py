"""Replace a matched attention with one node that calls the pass's model-local function, in
parallel over every position.

The replacement reads q, k (un-transposed), v, a key_keep tensor ([..., Nk, 1], 1.0 = attend)
derived from the mask's last query row (key_keep.py), and the pass's constants. A contrib
operator's q, k and v are unpacked first (contrib_heads.py), a GroupQueryAttention's built from
its inputs (grouped_query.py), or the operator kept where it runs the replacement itself (a
lowering's group_query_window). The nodes the attention used become dead and are removed,
together with initializers nothing else reads (graph_edit.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.onnx.constants import known_dims
from attnrewrite.onnx.contrib_heads import merged_heads, unpacked_heads
from attnrewrite.onnx.detect import OnnxSite, Unsupported
from attnrewrite.onnx.graph_edit import INT64_MAX, GraphEditor
from attnrewrite.onnx.grouped_query import GroupedQueryNodes, splice_in_parallel, windowed_in_place
from attnrewrite.onnx.key_keep import KeyKeeps
from attnrewrite.onnx.replacement import Replacements
from attnrewrite.passes.lowering import OnnxLowering


class Splicer:
    """Splices replacements into one model, sharing what sites have in common (the key_keep of
    a mask all layers use, identical function bodies and constants)."""

    def __init__(self, model: ir.Model):
        self.replacements = Replacements(model)
        self.edit, self.calls = self.replacements.edit, self.replacements.calls  # calls: site name -> its node
        self.key_keeps = KeyKeeps(self.edit)
        self.grouped_query = GroupedQueryNodes(self.edit, None)  # in parallel its rows come from the operator

    @property
    def bytes_added(self) -> int:
        """Of the initializers this splicer added."""
        return self.replacements.initializers.bytes_added

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
        """``own``: names of constants this site must not share with another (Initializers.for_site).
        Returns the replacement's qualified op type."""
        if s.grouped_query is not None and lowering.group_query_window is not None:
            return windowed_in_place(s, lowering.group_query_window)
        if s.grouped_query is not None:
            return splice_in_parallel(self.replacements, self.grouped_query, s, lowering, own)
        edit, anchor = self.edit, s.output.producer()
        new_nodes: list[ir.Node] = []
        q, k, v = self._heads(s, new_nodes)
        key_keep = self.key_keeps.of(s, k, new_nodes) if s.site.mask.key_padding else self._keep_all()
        past = _past_rows(edit, q, k, new_nodes) if s.key_cache is not None else None
        queries = q if past is None else _behind(edit, past, q, len(s.q.shape), new_nodes)
        call = self.replacements.call(s, lowering, [queries, k, v, key_keep], own)
        after: list[ir.Node] = []
        result = call.outputs[0]
        if past is not None:  # the new queries' rows
            result = edit.node(after, "Slice", [result, past, edit.const([INT64_MAX]), edit.const([-2])])
        if s.packing is not None:
            result = merged_heads(edit, result, after)
        replaced = self.replacements.insert(s, anchor, [*new_nodes, call, *after], result)
        edit.remove_dead(s.nodes)
        return replaced

    def _heads(self, s: OnnxSite, new_nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value, ir.Value]:
        """q, k (un-transposed) and v, with one key/value head per query head."""
        edit = self.edit
        if s.packing is not None:
            q, k, v = unpacked_heads(edit, s.packing, new_nodes)
            for role, value in zip("qkv", (q, k, v)):  # named, so the unpacked q, k, v can be found
                if any(value.producer() is node for node in new_nodes):  # not a graph input's name
                    value.name = f"{s.site.name}/{role}"
            return q, k, v
        q, v = edit.current(s.q), edit.current(s.v)
        k = edit.current(s.k) if s.k is not None else _untransposed(edit.current(s.k_transposed), new_nodes)
        return q, _broadcast_to_queries(edit, k, q, new_nodes), _broadcast_to_queries(edit, v, q, new_nodes)

    def _keep_all(self) -> ir.Value:
        return self.replacements.initializers.shared("attnrewrite/keep_all_keys", np.ones((1, 1), np.float32))


def _past_rows(edit: GraphEditor, q: ir.Value, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """[past]: the cached keys' count, the keys' rows before the new queries'."""
    keys, queries = (
        edit.node(new_nodes, "Shape", [x], [ir.AttrInt64("start", -2), ir.AttrInt64("end", -1)]) for x in (k, q)
    )
    return edit.node(new_nodes, "Sub", [keys, queries])


def _behind(edit: GraphEditor, past: ir.Value, q: ir.Value, rank: int, new_nodes: list[ir.Node]) -> ir.Value:
    """q [..., N, D] behind ``past`` rows of zeros, each query at its position among the keys:
    a causal form over past and new keys then gives query i the keys up to past + i (the
    site's offset causal mask). The zero rows' outputs are dropped after the call."""
    # every pad listed: onnxruntime's transpose optimizer misreads Pad's axes input
    before, after = edit.const([0] * (rank - 2)), edit.const([0] * (rank + 1))
    pads = edit.node(new_nodes, "Concat", [before, past, after], [ir.AttrInt64("axis", 0)])
    return edit.node(new_nodes, "Pad", [q, pads])  # zeros of q's type


def _untransposed(k_t: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    source, perm = _untranspose_plan(k_t)
    if perm == list(range(len(perm))):
        return source
    node = ir.Node("", "Transpose", [source], [ir.AttrInt64s("perm", perm)], name=f"{k_t.name}/untransposed")
    new_nodes.append(node)
    return node.outputs[0]


def _broadcast_to_queries(edit: GraphEditor, value: ir.Value, q: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """k or v with q's leading dims, as the attention reads them: one key/value head
    broadcast by the MatMuls (multi-query attention) expanded, grouped heads (the Attention
    op's kv_num_heads < q_num_heads) repeated, query head h reading key/value head
    h // group. Every method then sees one key/value head per query head."""
    if not _broadcasts(value, q):
        return value

    def shape_of(x, **slice_bounds):
        return edit.node(new_nodes, "Shape", [x], [ir.AttrInt64(k, b) for k, b in slice_bounds.items()])

    def concat(*parts):
        return edit.node(new_nodes, "Concat", list(parts), [ir.AttrInt64("axis", 0)])

    rows = shape_of(value, start=-2)
    target = concat(shape_of(q, end=-2), rows)
    group = _head_group(value, q)
    if group is None:
        return edit.node(new_nodes, "Expand", [value, target])
    # [.., Hkv, N, D] -> [.., Hkv, group, N, D] -> [.., Hkv * group, N, D]
    unsqueezed = edit.node(new_nodes, "Unsqueeze", [value, edit.const([-3])])
    grouped = edit.node(new_nodes, "Expand", [unsqueezed, concat(shape_of(value, end=-2), edit.const([group]), rows)])
    return edit.node(new_nodes, "Reshape", [grouped, target])


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
