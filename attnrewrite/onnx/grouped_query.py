"""Standard-op nodes that do what a GroupQueryAttention does before and after its attention
(detect/gqa.py's GroupedQueryPlan): split its packed input into q, k and v heads, rotate them
as its ``do_rotary`` does, write its KV cache (a parallel rewrite keeps the cache), and merge
the attention's heads back into features; ``splice_in_parallel`` replaces the operator with a
parallel call over its cache (recurrent.py builds its recurrent call with the same nodes), and
``windowed_in_place`` keeps it where its own local window is the replacement.

The operator rotates each token at its row in its cache (from ``seqlens_k``). A recurrent
rewrite, which keeps no cache, takes the position from the attention mask's running count of
real tokens minus one: the same for every real token under onnxruntime-genai's right padding
and in decoding steps, and right under left padding too. A parallel rewrite keeps the cache and
the operator's rows (CacheRows), so its cache is the operator's, pads included.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from attnrewrite.onnx.detect import CachedTensor, GroupedQueryPlan, OnnxSite
from attnrewrite.onnx.graph_edit import GraphEditor
from attnrewrite.onnx.replacement import Replacements
from attnrewrite.passes.lowering import MICROSOFT, TO_THE_END, OnnxLowering


class CacheRows(NamedTuple):
    """Where a call's new tokens sit among each row's positions, by the operator's rule: a first
    prompt (total_sequence_length equal to the new tokens) fills every row from 0; a later call
    appends row b's at seqlens_k[b] + 1 - new, after its real tokens (genai's right padding
    leaves a shorter row's pads to be overwritten)."""

    start: ir.Value  # [B, 1, 1, 1]: the row's first new position
    end: ir.Value  # [B, 1, 1, 1]: the row's tokens, past and new (seqlens_k + 1)
    total: ir.Value  # [1]: total_sequence_length, the longest row's
    new: ir.Value  # [1]: the new tokens


class GroupedQueryNodes:
    """Builds the nodes with ``edit`` into lists the caller inserts; ``mask``: the attention
    mask [batch, past + new] a recurrent rewrite counts positions in (None in parallel: there the
    operator's own rows say where a token is)."""

    def __init__(self, edit: GraphEditor, mask: ir.Value | None, rotary_operator: bool = False):
        self.edit, self._mask, self._rotary_operator = edit, mask, rotary_operator
        self._tables: dict[tuple[int, int, int], tuple[ir.Value, ir.Value]] = {}  # by (cos, sin, positions)
        self._counted: ir.Value | None = None
        self._rows: dict[tuple[int, int], CacheRows] = {}  # by (seqlens_k, total_sequence_length)
        self._ranges: dict[int, ir.Value] = {}  # _positions, by length

    def heads(
        self, plan: GroupedQueryPlan, nodes: list[ir.Node], rows: CacheRows | None = None
    ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """q [B, heads, N, D] and k, v [B, kv_heads, N, D], rotated where the operator rotates.
        Each token is rotated at its position among its row's real tokens, or, given the ``rows``
        the operator writes, at its row there (the two differ only at the pads of a right-padded
        prompt)."""
        size, heads, kv_heads = plan.head_size, plan.num_heads, plan.kv_heads
        current = self.edit.current
        if plan.key is None:
            packed = current(plan.query)
            bounds = [0, heads * size, (heads + kv_heads) * size, (heads + 2 * kv_heads) * size]
            q, k, v = (self._columns(packed, start, stop, nodes) for start, stop in zip(bounds, bounds[1:]))
        else:
            q, k, v = (current(x) for x in (plan.query, plan.key, plan.value))
        if plan.rotary is not None and self._rotary_operator:  # on [B, N, heads * D], before the split
            positions = self._token_positions(rows, q, 1, nodes)
            q, k = (self._rotated_by_operator(x, n, positions, plan, nodes) for x, n in ((q, heads), (k, kv_heads)))
        q, k, v = (self._split_heads(x, n, size, nodes) for x, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
        if plan.rotary is not None and not self._rotary_operator:
            cos, sin = self._rotary_tables(plan, self._token_positions(rows, q, 2, nodes), nodes)
            q, k = (self._rotated(x, cos, sin, plan, nodes) for x in (q, k))
        return q, k, v

    def _token_positions(self, rows: CacheRows | None, x: ir.Value, token_axis: int, nodes) -> ir.Value:
        """[B, N] int64: each new token's position, at its row of the operator's cache where
        ``rows`` are given, else among its row's real tokens (``x``'s ``token_axis`` counts the
        new tokens)."""
        if rows is not None:
            return self._written_positions(rows, nodes)
        return self._real_positions(x, token_axis, nodes)

    def cache_rows(self, operator: ir.Node, nodes: list[ir.Node]) -> CacheRows:
        """The operator's CacheRows, from its query, seqlens_k and total_sequence_length inputs;
        built once for the operators that share those (every layer of a builder model)."""
        key = (id(operator.inputs[5]), id(operator.inputs[6]))
        if key not in self._rows:
            self._rows[key] = self._cache_rows(operator, nodes)
        return self._rows[key]

    def _cache_rows(self, operator: ir.Node, nodes: list[ir.Node]) -> CacheRows:
        seqlens, total = (self._cast_int64(operator.inputs[i], nodes) for i in (5, 6))
        one = self.edit.const(np.array(1, np.int64))
        end = self.edit.node(
            nodes, "Reshape", [self.edit.node(nodes, "Add", [seqlens, one]), self.edit.const([-1, 1, 1, 1])]
        )
        total = self.edit.node(nodes, "Reshape", [total, self.edit.const([1])])
        new = self.edit.node(nodes, "Shape", [operator.inputs[0]], [ir.AttrInt64("start", 1), ir.AttrInt64("end", 2)])
        first_prompt = self.edit.node(nodes, "Equal", [total, new])
        appended = self.edit.node(nodes, "Sub", [end, new])
        start = self.edit.node(nodes, "Where", [first_prompt, self.edit.const(np.array(0, np.int64)), appended])
        return CacheRows(start, end, total, new)

    def written(self, past: ir.Value, new: ir.Value, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """The cache after the operator's write, [B, Hkv, max(past, total), D]: row b's first
        ``start`` positions from ``past``, then its N new ones (a prompt's pads too), zeros after."""
        past_length = self.edit.node(nodes, "Shape", [past], [ir.AttrInt64("start", 2), ir.AttrInt64("end", 3)])
        length = self.edit.node(nodes, "Max", [past_length, rows.total])
        grown = self.edit.node(nodes, "Sub", [length, past_length])
        pads = self.edit.node(
            nodes,
            "Concat",
            [self.edit.const([0, 0, 0, 0, 0, 0]), grown, self.edit.const([0])],
            [ir.AttrInt64("axis", 0)],
        )
        padded = self.edit.node(nodes, "Pad", [past, pads])  # every pad listed, as splice.py pads queries
        position = self._positions(length, nodes)
        from_new = self._rows_of(new, self.edit.node(nodes, "Sub", [position, rows.start]), rows.new, length, nodes)
        zero = self.edit.node(nodes, "CastLike", [self.edit.const(np.array(0.0, np.float32)), past])
        after_new = self.edit.node(nodes, "Add", [rows.start, rows.new])
        kept = self.edit.node(nodes, "Where", [self.edit.node(nodes, "Less", [position, after_new]), from_new, zero])
        return self.edit.node(nodes, "Where", [self.edit.node(nodes, "Less", [position, rows.start]), padded, kept])

    def until_total(self, cache: ir.Value, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """The cache's positions up to the longest row's: every key a query can take."""
        return self.edit.node(nodes, "Slice", [cache, self.edit.const([0]), rows.total, self.edit.const([2])])

    def key_keep(self, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """[B, 1, total, 1] float: 1.0 at a row's tokens, past and new."""
        kept = self.edit.node(nodes, "Less", [self._positions(rows.total, nodes), rows.end])
        return self.edit.node(nodes, "Cast", [kept], [ir.AttrInt64("to", ir.DataType.FLOAT)])

    def placed(self, q: ir.Value, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """q [B, H, N, D] as [B, H, total, D] with query i of row b at start + i: a causal
        attention over the cache then gives it the keys up to its own position. The other
        positions repeat a neighbouring query; their outputs are not taken."""
        position = self._positions(rows.total, nodes)
        return self._rows_of(q, self.edit.node(nodes, "Sub", [position, rows.start]), rows.new, rows.total, nodes)

    def taken(self, attention: ir.Value, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """The new queries' rows [B, H, N, Dv] of an attention over every position."""
        position = self._positions(rows.new, nodes)
        index = self.edit.node(nodes, "Add", [position, rows.start])
        shape = self._shape_with_rows(attention, rows.new, nodes)
        expanded = self.edit.node(nodes, "Expand", [index, shape])
        return self.edit.node(nodes, "GatherElements", [attention, expanded], [ir.AttrInt64("axis", 2)])

    def _rows_of(self, x: ir.Value, index: ir.Value, count: ir.Value, length: ir.Value, nodes) -> ir.Value:
        """[B, H, length, D]: row ``index`` (clamped to x's ``count`` rows) of x at each position."""
        last = self.edit.node(nodes, "Sub", [count, self.edit.const([1])])
        clamped = self.edit.node(nodes, "Min", [self.edit.node(nodes, "Max", [index, self.edit.const([0])]), last])
        expanded = self.edit.node(nodes, "Expand", [clamped, self._shape_with_rows(x, length, nodes)])
        return self.edit.node(nodes, "GatherElements", [x, expanded], [ir.AttrInt64("axis", 2)])

    def _positions(self, length: ir.Value, nodes: list[ir.Node]) -> ir.Value:
        """[1, 1, length, 1]: 0 .. length - 1, once per length."""
        if id(length) not in self._ranges:
            scalar = self.edit.node(nodes, "Squeeze", [length, self.edit.const([0])])
            counted = self.edit.node(
                nodes, "Range", [self.edit.const(np.array(0, np.int64)), scalar, self.edit.const(np.array(1, np.int64))]
            )
            self._ranges[id(length)] = self.edit.node(nodes, "Reshape", [counted, self.edit.const([1, 1, -1, 1])])
        return self._ranges[id(length)]

    def _shape_with_rows(self, x: ir.Value, rows: ir.Value, nodes: list[ir.Node]) -> ir.Value:
        """x's shape with ``rows`` on its sequence axis (2)."""
        parts = [
            self.edit.node(nodes, "Shape", [x], [ir.AttrInt64("end", 2)]),
            rows,
            self.edit.node(nodes, "Shape", [x], [ir.AttrInt64("start", 3)]),
        ]
        return self.edit.node(nodes, "Concat", parts, [ir.AttrInt64("axis", 0)])

    def _cast_int64(self, x: ir.Value, nodes: list[ir.Node]) -> ir.Value:
        return self.edit.node(nodes, "Cast", [x], [ir.AttrInt64("to", ir.DataType.INT64)])

    def merged(self, attention: ir.Value, plan: GroupedQueryPlan, nodes: list[ir.Node]) -> ir.Value:
        """[B, heads, N, D] -> [B, N, heads * D], the operator's output layout."""
        moved = self.edit.node(nodes, "Transpose", [attention], [ir.AttrInt64s("perm", [0, 2, 1, 3])])
        return self.edit.node(nodes, "Reshape", [moved, self.edit.const([0, 0, plan.num_heads * plan.head_size])])

    def _columns(self, x: ir.Value, start: int, stop: int, nodes: list[ir.Node], axis: int = -1) -> ir.Value:
        return self.edit.node(
            nodes, "Slice", [x, self.edit.const([start]), self.edit.const([stop]), self.edit.const([axis])]
        )

    def _split_heads(self, x: ir.Value, heads: int, size: int, nodes: list[ir.Node]) -> ir.Value:
        split = self.edit.node(nodes, "Reshape", [x, self.edit.const([0, 0, heads, size])])
        return self.edit.node(nodes, "Transpose", [split], [ir.AttrInt64s("perm", [0, 2, 1, 3])])

    def _real_positions(self, x: ir.Value, token_axis: int, nodes: list[ir.Node]) -> ir.Value:
        """[B, N]: each new token's position among its row's real tokens (the attention mask's
        running count, minus one), built once per model."""
        assert self._mask is not None, "a recurrent rewrite takes an attention mask (interface_refusal)"
        if self._counted is None:
            mask = self.edit.node(nodes, "Cast", [self._mask], [ir.AttrInt64("to", ir.DataType.INT64)])
            counted = self.edit.node(nodes, "CumSum", [mask, self.edit.const(np.array(1, np.int64))])
            new_count = self.edit.node(
                nodes, "Shape", [x], [ir.AttrInt64("start", token_axis), ir.AttrInt64("end", token_axis + 1)]
            )
            new = self.edit.node(
                nodes,
                "Slice",
                [
                    counted,
                    self.edit.node(nodes, "Neg", [new_count]),
                    self.edit.const([TO_THE_END]),
                    self.edit.const([1]),
                ],
            )
            before = self.edit.node(nodes, "Sub", [new, self.edit.const(np.array(1, np.int64))])
            self._counted = self.edit.node(nodes, "Max", [before, self.edit.const(np.array(0, np.int64))])  # padding: 0
        return self._counted

    def _written_positions(self, rows: CacheRows, nodes: list[ir.Node]) -> ir.Value:
        """[B, N]: each new token's row in the operator's cache, start .. start + N - 1."""
        start = self.edit.node(nodes, "Reshape", [rows.start, self.edit.const([-1, 1])])
        return self.edit.node(
            nodes,
            "Add",
            [start, self.edit.node(nodes, "Reshape", [self._positions(rows.new, nodes), self.edit.const([1, -1])])],
        )

    def _rotary_tables(
        self, plan: GroupedQueryPlan, positions: ir.Value, nodes: list[ir.Node]
    ) -> tuple[ir.Value, ir.Value]:
        """cos and sin at ``positions`` [B, N], [B, 1, N, rotary_dim / 2]; built once per pair
        of caches and positions (the builder's layers share theirs)."""
        cos_cache, sin_cache = plan.rotary
        key = (id(cos_cache), id(sin_cache), id(positions))
        if key not in self._tables:
            self._tables[key] = tuple(
                self.edit.node(
                    nodes, "Unsqueeze", [self.edit.node(nodes, "Gather", [table, positions]), self.edit.const([1])]
                )
                for table in (cos_cache, sin_cache)
            )
        return self._tables[key]

    def _rotated_by_operator(self, x: ir.Value, heads: int, positions: ir.Value, plan: GroupedQueryPlan, nodes):
        """x [B, N, heads * D] rotated by com.microsoft.RotaryEmbedding: one node where the
        standard ops take a dozen per tensor, on the operator's own tables."""
        cos_cache, sin_cache = plan.rotary
        attributes = [
            ir.AttrInt64("interleaved", int(plan.interleaved)),
            ir.AttrInt64("num_heads", heads),
            ir.AttrInt64("rotary_embedding_dim", plan.rotary_dim),
        ]
        node = ir.Node(MICROSOFT, "RotaryEmbedding", [x, positions, cos_cache, sin_cache], attributes, num_outputs=1)
        nodes.append(node)
        return node.outputs[0]

    def _rotated(self, x: ir.Value, cos: ir.Value, sin: ir.Value, plan: GroupedQueryPlan, nodes) -> ir.Value:
        """x rotated on its first rotary_dim features: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos
        + x1 sin), or the same on pairs (x0, x1), (x2, x3)... when interleaved."""
        dim, half = plan.rotary_dim, plan.rotary_dim // 2
        rotary = self._columns(x, 0, dim, nodes) if dim < plan.head_size else x
        if plan.interleaved:
            pairs = self.edit.node(nodes, "Reshape", [rotary, self.edit.const([0, 0, 0, half, 2])])
            first, second = (
                self.edit.node(nodes, "Squeeze", [self._columns(pairs, i, i + 1, nodes), self.edit.const([-1])])
                for i in (0, 1)
            )
        else:
            first, second = self._columns(rotary, 0, half, nodes), self._columns(rotary, half, dim, nodes)
        mul = lambda a, b: self.edit.node(nodes, "Mul", [a, b])  # noqa: E731
        out_first = self.edit.node(nodes, "Sub", [mul(first, cos), mul(second, sin)])
        out_second = self.edit.node(nodes, "Add", [mul(second, cos), mul(first, sin)])
        if plan.interleaved:
            stacked = [self.edit.node(nodes, "Unsqueeze", [o, self.edit.const([-1])]) for o in (out_first, out_second)]
            pairs = self.edit.node(nodes, "Concat", stacked, [ir.AttrInt64("axis", -1)])
            rotated = self.edit.node(nodes, "Reshape", [pairs, self.edit.const([0, 0, 0, dim])])
        else:
            rotated = self.edit.node(nodes, "Concat", [out_first, out_second], [ir.AttrInt64("axis", -1)])
        if dim == plan.head_size:
            return rotated
        rest = self._columns(x, dim, plan.head_size, nodes)
        return self.edit.node(nodes, "Concat", [rotated, rest], [ir.AttrInt64("axis", -1)])


def repeated_heads(edit: GraphEditor, x: ir.Value, heads: int, kv_heads: int, head_dim: int, nodes) -> ir.Value:
    """Keys or values [B, Hkv, N, D] as [B, heads, N, D], query head h reading key/value
    head h // (heads / Hkv)."""
    if kv_heads == heads:
        return x
    grouped = edit.node(nodes, "Unsqueeze", [x, edit.const([2])])
    grouped = edit.node(nodes, "Expand", [grouped, edit.const([1, 1, heads // kv_heads, 1, 1])])
    return edit.node(nodes, "Reshape", [grouped, edit.const([0, heads, -1, head_dim])])


def splice_in_parallel(
    replacements: Replacements, grouped: GroupedQueryNodes, s: OnnxSite, lowering: OnnxLowering, own: frozenset[str]
) -> str:
    """A GroupQueryAttention replaced by a parallel call: its cache written as the operator
    writes it (the model keeps returning present_key and present_value), then the method over
    every position up to the longest row's, each new query at its own position. Returns the
    replacement's qualified op type."""
    edit, operator, plan = replacements.edit, s.key_cache.node, s.grouped_query
    new_nodes: list[ir.Node] = []
    rows = grouped.cache_rows(operator, new_nodes)
    q, k, v = grouped.heads(plan, new_nodes, rows)
    caches = [s.key_cache, s.value_cache]
    presents = [grouped.written(edit.current(c.past), new, rows, new_nodes) for c, new in zip(caches, (k, v))]
    k, v = (
        repeated_heads(
            edit, grouped.until_total(p, rows, new_nodes), plan.num_heads, plan.kv_heads, plan.head_size, new_nodes
        )
        for p in presents
    )
    inputs = [grouped.placed(q, rows, new_nodes), k, v, grouped.key_keep(rows, new_nodes)]
    call = replacements.call(s, lowering, inputs, own)
    after: list[ir.Node] = []
    output = grouped.merged(grouped.taken(call.outputs[0], rows, after), plan, after)
    replaced = replacements.insert(s, operator, [*new_nodes, call, *after], output)
    for cache, present in zip(caches, presents):
        _take_over_present(edit, cache, present, plan)
    edit.remove_dead(s.nodes)
    return replaced


def windowed_in_place(s: OnnxSite, window: int) -> str:
    """The GroupQueryAttention kept, attending to the last ``window`` keys up to each query with
    its own local_window_size: its cache, rows and rotary stay the operator's. The operator's
    ``sliding_window_cache`` (onnxruntime 1.32: past and present hold only the window) would
    change the model's cache inputs; a parallel rewrite keeps them. Returns the operator's
    qualified op type."""
    operator = s.key_cache.node
    operator.attributes["local_window_size"] = ir.AttrInt64("local_window_size", window)
    return f"{operator.domain}.{operator.op_type}"


def _take_over_present(edit: GraphEditor, cache: CachedTensor, present: ir.Value, plan: GroupedQueryPlan) -> None:
    """The cache the splice writes in the place of the operator's present output."""
    if cache.present is not None:
        present.type, present.shape = cache.present.type, cache.present.shape
        edit.take_over(cache.present, present)
    for value in (cache.past, present):
        _declare_cache_sizes(value, plan.kv_heads, plan.head_size)


def _declare_cache_sizes(cache: ir.Value, kv_heads: int, head_size: int) -> None:
    """A [batch, kv_heads, length, head_size] cache declared with its fixed sizes: the builder
    leaves the head size symbolic ("kv_cache_dim") for the operator, gone now, to fix."""
    if cache.shape is not None and len(cache.shape) == 4:
        batch, _, length, _ = cache.shape
        cache.shape = ir.Shape([batch, kv_heads, length, head_size])
