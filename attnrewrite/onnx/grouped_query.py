"""Standard-op nodes that do what a GroupQueryAttention does before and after its attention
(detect/gqa.py's GroupedQueryPlan): split its packed input into q, k and v heads, rotate them
as its ``do_rotary`` does, and merge the attention's heads back into features.

The operator rotates each token at its position among its row's real tokens (it counts them
from ``seqlens_k``); here the position is the attention mask's running count of real tokens
minus one, which is the same for every padding the mask can describe: onnxruntime-genai's
right padding, left padding, and decoding steps.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.onnx.detect import GroupedQueryPlan
from attnrewrite.onnx.splice import INT64_MAX


class GroupedQueryNodes:
    """Builds the nodes into lists the caller inserts; ``node`` and ``const`` are the
    splicer's builders, ``mask`` the attention mask [batch, past + new]."""

    def __init__(self, node, const, mask: ir.Value):
        self._node, self._const, self._mask = node, const, mask
        self._tables: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}  # by (cos, sin) tables

    def heads(self, plan: GroupedQueryPlan, current, nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value, ir.Value]:
        """q [B, heads, N, D] and k, v [B, kv_heads, N, D], rotated where the operator rotates;
        ``current``: the splicer's map from a value to what replaced it."""
        size, heads, kv_heads = plan.head_size, plan.num_heads, plan.kv_heads
        if plan.key is None:
            packed = current(plan.query)
            bounds = [0, heads * size, (heads + kv_heads) * size, (heads + 2 * kv_heads) * size]
            q, k, v = (self._columns(packed, start, stop, nodes) for start, stop in zip(bounds, bounds[1:]))
        else:
            q, k, v = (current(x) for x in (plan.query, plan.key, plan.value))
        q, k, v = (self._split_heads(x, n, size, nodes) for x, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
        if plan.rotary is not None:
            cos, sin = self._rotary_tables(plan, q, nodes)
            q, k = (self._rotated(x, cos, sin, plan, nodes) for x in (q, k))
        return q, k, v

    def merged(self, attention: ir.Value, plan: GroupedQueryPlan, nodes: list[ir.Node]) -> ir.Value:
        """[B, heads, N, D] -> [B, N, heads * D], the operator's output layout."""
        moved = self._node(nodes, "Transpose", [attention], [ir.AttrInt64s("perm", [0, 2, 1, 3])])
        return self._node(nodes, "Reshape", [moved, self._const([0, 0, plan.num_heads * plan.head_size])])

    def _columns(self, x: ir.Value, start: int, stop: int, nodes: list[ir.Node], axis: int = -1) -> ir.Value:
        return self._node(nodes, "Slice", [x, self._const([start]), self._const([stop]), self._const([axis])])

    def _split_heads(self, x: ir.Value, heads: int, size: int, nodes: list[ir.Node]) -> ir.Value:
        split = self._node(nodes, "Reshape", [x, self._const([0, 0, heads, size])])
        return self._node(nodes, "Transpose", [split], [ir.AttrInt64s("perm", [0, 2, 1, 3])])

    def _rotary_tables(self, plan: GroupedQueryPlan, q: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value]:
        """cos and sin at the new tokens' positions, [B, 1, N, rotary_dim / 2]; built once per
        pair of caches (the builder's layers share theirs)."""
        cos_cache, sin_cache = plan.rotary
        key = (id(cos_cache), id(sin_cache))
        if key not in self._tables:
            mask = self._node(nodes, "Cast", [self._mask], [ir.AttrInt64("to", ir.DataType.INT64)])
            counted = self._node(nodes, "CumSum", [mask, self._const(np.array(1, np.int64))])
            new_count = self._node(nodes, "Shape", [q], [ir.AttrInt64("start", 2), ir.AttrInt64("end", 3)])
            new = self._node(
                nodes,
                "Slice",
                [counted, self._node(nodes, "Neg", [new_count]), self._const([INT64_MAX]), self._const([1])],
            )
            before = self._node(nodes, "Sub", [new, self._const(np.array(1, np.int64))])
            positions = self._node(nodes, "Max", [before, self._const(np.array(0, np.int64))])  # padding: 0
            self._tables[key] = tuple(
                self._node(nodes, "Unsqueeze", [self._node(nodes, "Gather", [table, positions]), self._const([1])])
                for table in (cos_cache, sin_cache)
            )
        return self._tables[key]

    def _rotated(self, x: ir.Value, cos: ir.Value, sin: ir.Value, plan: GroupedQueryPlan, nodes) -> ir.Value:
        """x rotated on its first rotary_dim features: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos
        + x1 sin), or the same on pairs (x0, x1), (x2, x3)... when interleaved."""
        dim, half = plan.rotary_dim, plan.rotary_dim // 2
        rotary = self._columns(x, 0, dim, nodes) if dim < plan.head_size else x
        if plan.interleaved:
            pairs = self._node(nodes, "Reshape", [rotary, self._const([0, 0, 0, half, 2])])
            first, second = (
                self._node(nodes, "Squeeze", [self._columns(pairs, i, i + 1, nodes), self._const([-1])]) for i in (0, 1)
            )
        else:
            first, second = self._columns(rotary, 0, half, nodes), self._columns(rotary, half, dim, nodes)
        mul = lambda a, b: self._node(nodes, "Mul", [a, b])  # noqa: E731
        out_first = self._node(nodes, "Sub", [mul(first, cos), mul(second, sin)])
        out_second = self._node(nodes, "Add", [mul(second, cos), mul(first, sin)])
        if plan.interleaved:
            stacked = [self._node(nodes, "Unsqueeze", [o, self._const([-1])]) for o in (out_first, out_second)]
            pairs = self._node(nodes, "Concat", stacked, [ir.AttrInt64("axis", -1)])
            rotated = self._node(nodes, "Reshape", [pairs, self._const([0, 0, 0, dim])])
        else:
            rotated = self._node(nodes, "Concat", [out_first, out_second], [ir.AttrInt64("axis", -1)])
        if dim == plan.head_size:
            return rotated
        rest = self._columns(x, dim, plan.head_size, nodes)
        return self._node(nodes, "Concat", [rotated, rest], [ir.AttrInt64("axis", -1)])
