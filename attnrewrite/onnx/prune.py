"""Nodes nothing reads, taken out of the model's own functions before it is written.

A method's function body can compute a value only some of its callers use (a branch's Constant,
a Concat its other form reads). onnxruntime inlines functions, turns their Constants into
initializers and drops the unread ones with a warning per initializer, on every load: pruning
here keeps loading silent. Nothing read is removed, so every output stays bit-identical.
"""

from __future__ import annotations

import onnx_ir as ir


def prune_unread_nodes(model: ir.Model) -> int:
    """Remove, from every function of ``model`` and the If/Loop bodies inside them, each node
    none of whose outputs a later node or the body's outputs read; the number removed."""
    return sum(_prune(function) for function in model.functions.values())


def _prune(body: ir.Function | ir.Graph) -> int:
    """One pass from the last node back: a node's readers come after it, so by the time it is
    reached every reader that will go has gone (subgraphs first, which read outer values)."""
    outputs = frozenset(body.outputs)
    removed = 0
    for node in reversed(body):
        if not any(output in outputs or output.uses() for output in node.outputs):
            body.remove(node, safe=True)
            removed += 1
            continue
        for subgraph in _subgraphs(node):
            removed += _prune(subgraph)
    return removed


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    graphs = []
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.GRAPH:
            graphs.append(attribute.as_graph())
        elif attribute.type == ir.AttributeType.GRAPHS:
            graphs.extend(attribute.as_graphs())
    return graphs
