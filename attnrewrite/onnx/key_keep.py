"""A site's mask as the replacement's key_keep: [..., Nk, 1] float, 1.0 where the last query
may attend (key padding says the same on every row, and under a causal mask the last row sees
every position). A contrib operator's batch-first masks and key indices (lengths, ranges) are
read by onnxruntime's rule (masks.contrib_keep_matrix says the same in numpy)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.onnx.detect import OnnxSite
from attnrewrite.onnx.graph_edit import INT64_MAX, GraphEditor
from attnrewrite.site import MASKED_BELOW, MaskEncoding, MaskTerm

_KEY_INDEX = (MaskEncoding.KEY_LENGTHS, MaskEncoding.KEY_RANGES)


class KeyKeeps:
    """Builds each site's key_keep with ``edit``, once per set of mask terms (the mask every
    layer reads gives every layer the same key_keep)."""

    def __init__(self, edit: GraphEditor):
        self.edit = edit
        self._built: dict[tuple, ir.Value] = {}

    def of(self, s: OnnxSite, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """The key_keep of the site's mask terms; ``k``: the site's keys (a key index becomes a
        keep row as long as they are)."""
        key = tuple((id(t.value), t.encoding, id(k) if t.encoding in _KEY_INDEX else None) for t in s.masks)
        if key in self._built:
            return self._built[key]
        node = self.edit.node
        keep = None
        for term in s.masks:
            if term.batch_first:
                term_keep = self._contrib_keep(term, k, new_nodes)
            else:
                term_keep = self._last_row_keep(term, new_nodes)
            keep = term_keep if keep is None else node(new_nodes, "And", [keep, term_keep])
        as_float = node(new_nodes, "Cast", [keep], [ir.AttrInt64("to", ir.DataType.FLOAT)])
        rank = max(t.keep_rank for t in s.masks)
        perm = [*range(max(rank, 2) - 2), max(rank, 2) - 1, max(rank, 2) - 2]
        result = node(new_nodes, "Transpose", [as_float], [ir.AttrInt64s("perm", perm)])
        result.name = f"{s.site.name}/key_keep"
        self._built[key] = result
        return result

    def _last_row_keep(self, term: MaskTerm, new_nodes: list[ir.Node]) -> ir.Value:
        """Which keys the last query may attend to."""
        node, const = self.edit.node, self.edit.const
        mask = self.edit.current(term.value)
        if term.rank >= 2:
            row = node(new_nodes, "Slice", [mask, const([-1]), const([INT64_MAX]), const([-2])])
        else:
            row = node(new_nodes, "Unsqueeze", [mask, const([0])])
        if term.encoding is MaskEncoding.ADDITIVE:
            threshold = np.array(MASKED_BELOW, dtype=mask.dtype.numpy())
            return node(new_nodes, "Greater", [row, const(threshold)])
        if mask.dtype != ir.DataType.BOOL:
            row = node(new_nodes, "Cast", [row], [ir.AttrInt64("to", ir.DataType.BOOL)])
        if term.encoding is MaskEncoding.KEEP_WHERE_FALSE:
            return node(new_nodes, "Not", [row])
        return row

    def _contrib_keep(self, term: MaskTerm, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[batch, 1, 1, keys], True where onnxruntime's contrib attention lets the last query attend."""
        node, const = self.edit.node, self.edit.const
        mask = self.edit.current(term.value)
        if term.encoding in _KEY_INDEX:
            keep = self._index_keep(mask, term.encoding, k, new_nodes)
            return node(new_nodes, "Unsqueeze", [keep, const([1, 2])])
        if term.rank == 3:  # [batch, queries, keys]: the last query's row
            mask = node(new_nodes, "Slice", [mask, const([-1]), const([INT64_MAX]), const([-2])])
        as_float = node(new_nodes, "Cast", [mask], [ir.AttrInt64("to", ir.DataType.FLOAT)])
        keep = node(new_nodes, "Greater", [as_float, const(np.array(0, np.float32))])
        return node(new_nodes, "Unsqueeze", [keep, const([1, 2] if term.rank == 2 else [1])])

    def _index_keep(self, index: ir.Value, encoding: MaskEncoding, k: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        """[batch, keys] from key lengths [batch] or end and start positions [2 * batch]."""
        node, const = self.edit.node, self.edit.const
        index = node(new_nodes, "Cast", [index], [ir.AttrInt64("to", ir.DataType.INT64)])
        keys = node(new_nodes, "Shape", [k], [ir.AttrInt64("start", 2), ir.AttrInt64("end", 3)])
        zero, one = const(np.array(0, np.int64)), const(np.array(1, np.int64))
        positions = node(new_nodes, "Range", [zero, node(new_nodes, "Squeeze", [keys]), one])
        if encoding is MaskEncoding.KEY_LENGTHS:
            lengths = node(new_nodes, "Unsqueeze", [index, const([1])])
            return node(new_nodes, "Less", [positions, lengths])
        bounds = node(new_nodes, "Reshape", [index, const([2, -1, 1])])
        ends, starts = (node(new_nodes, "Gather", [bounds, i]) for i in (zero, one))
        after_start = node(new_nodes, "GreaterOrEqual", [positions, starts])
        return node(new_nodes, "And", [after_start, node(new_nodes, "Less", [positions, ends])])
