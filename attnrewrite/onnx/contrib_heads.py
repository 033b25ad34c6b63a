"""q, k and v of an onnxruntime contrib attention operator (detect/contrib.py's PackedHeads:
projected inside the operator, packed kv or qkv, or separate) as [batch, heads, seq, head_dim]
with the operator's bias added, and the replacement's output merged back into the operator's
[batch, seq, heads * head_dim]."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.onnx.detect import HeadLayout, HeadSource, PackedHeads
from attnrewrite.onnx.graph_edit import GraphEditor


def unpacked_heads(edit: GraphEditor, packing: PackedHeads, new_nodes: list[ir.Node]) -> list[ir.Value]:
    """q, k, v as [batch, heads, seq, head_dim], with the operator's bias added."""
    sources = packing.sources
    if packing.projection is not None:
        x, weights = (edit.current(v) for v in packing.projection)
        projected = edit.node(new_nodes, "MatMul", [x, weights])
        sources = [HeadSource(part) for part in _split(edit, projected, packing.sizes, -1, new_nodes)]
    heads = [_split_heads(edit, source, packing.num_heads, new_nodes) for source in sources]
    if packing.bias is None:
        return heads
    biases = _split(edit, edit.current(packing.bias), packing.sizes, 0, new_nodes)
    per_head = edit.const([packing.num_heads, 1, -1])  # broadcasts over batch and seq
    return [
        edit.node(new_nodes, "Add", [h, edit.node(new_nodes, "Reshape", [b, per_head])]) for h, b in zip(heads, biases)
    ]


def merged_heads(edit: GraphEditor, value: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """[batch, heads, seq, head_dim] back to the operator's [batch, seq, heads * head_dim]."""
    merged = edit.node(new_nodes, "Transpose", [value], [ir.AttrInt64s("perm", [0, 2, 1, 3])])
    return edit.node(new_nodes, "Reshape", [merged, edit.const([0, 0, -1])])


def _split_heads(edit: GraphEditor, source: HeadSource, heads: int, new_nodes: list[ir.Node]) -> ir.Value:
    value = edit.current(source.value)
    if source.layout is HeadLayout.HEADS:
        return value
    if source.layout is HeadLayout.PACKED:  # [batch, seq, heads, n, head_dim]
        index = edit.const(np.array(source.index, np.int64))
        value = edit.node(new_nodes, "Gather", [value, index], [ir.AttrInt64("axis", 3)])
    else:  # [batch, seq, heads * head_dim]
        value = edit.node(new_nodes, "Reshape", [value, edit.const([0, 0, heads, -1])])
    return edit.node(new_nodes, "Transpose", [value], [ir.AttrInt64s("perm", [0, 2, 1, 3])])


def _split(edit: GraphEditor, value: ir.Value, sizes, axis: int, new_nodes: list[ir.Node]) -> list[ir.Value]:
    node = ir.Node("", "Split", [value, edit.const(list(sizes))], [ir.AttrInt64("axis", axis)], num_outputs=len(sizes))
    new_nodes.append(node)
    return list(node.outputs)
