"""The identity-attention bound of ``attnrewrite bench``: the same model with every rewritten
attention replaced by its values v.

It is spliced like a real replacement (same sites, same q/k/v plumbing), so it costs what the rest
of the model costs, q, k and v projections included: every replacement needs those. What it does
not keep is q's and k's head transposes: onnxruntime runs nodes nobody reads (it does not remove
dead code), and a replacement whose body its transpose optimizer can push the head transposes
through (hydra) does not pay for them, so with them the bound sat above hydra (by ~1% of a
BERT-base layer: 8 ms of 750 at N = 2048, one thread). Fresh processes still differ by several
percent, so a single measurement can put a replacement at or just below the bound: compare
within the spread, as the crossover does.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.graph_edit import GraphEditor
from attnrewrite.onnx.rewrite import analyze
from attnrewrite.onnx.splice import Splicer
from attnrewrite.passes.lowering import DOMAIN, MIN_OPSET, OnnxLowering


def identity_attention(model: ir.Model, site_names: list[str]) -> ir.Model:
    """The model with each named attention site replaced by its values v."""
    if onnx_io.default_opset(model) < MIN_OPSET:  # as rewrite_model does, so the graphs match
        model = onnx_io.upgrade_opset(model)
    model = onnx_io.infer_shapes(model)
    wanted = set(site_names)
    sites = [s for s in analyze(model) if s.site.name in wanted]
    splicer = Splicer(model)
    lowering = identity_lowering(onnx_io.default_opset(model))
    for s in sites:
        splicer.check(s)
        splicer.splice(s, lowering)
    _read_values_directly(model)
    return model


# Nodes that only move data: a replacement's choice of layout can make them unnecessary.
_LAYOUT_ONLY = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _read_values_directly(model: ir.Model) -> None:
    """Each identity call becomes Identity(v); the layout nodes that then feed nothing (q's and
    k's head split and transpose) go, their projections stay (see the module docstring)."""
    edit = GraphEditor(model.graph)
    for call in [n for n in edit.graph if n.domain == DOMAIN and n.op_type == IDENTITY_FUNCTION]:
        q, k, v, *rest = call.inputs
        identity = ir.Node("", "Identity", [v], name=call.name, num_outputs=1)
        edit.graph.insert_before(call, identity)
        old, new = call.outputs[0], identity.outputs[0]
        new.type, new.shape = old.type, old.shape
        edit.take_over(old, new)
        edit.graph.remove(call, safe=True)
        _remove_dead_layout_nodes(edit.graph, [q.producer(), k.producer()])
        for value in rest:  # the keep-all key_keep the splicer added, if nothing else reads it
            if value is not None:
                edit.drop_if_unread(value)
    for key in [key for key, f in model.functions.items() if f.name == IDENTITY_FUNCTION]:
        del model.functions[key]


def _remove_dead_layout_nodes(graph: ir.Graph, seeds: list[ir.Node | None]) -> None:
    """Unlike GraphEditor.remove_dead, only layout nodes go, and the initializers they read stay."""
    work = [node for node in seeds if node is not None]
    while work:
        node = work.pop()
        if node.graph is not graph or node.op_type not in _LAYOUT_ONLY or node.domain not in ("", "ai.onnx"):
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        producers = [v.producer() for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        work += producers


IDENTITY_FUNCTION = "IdentityAttention"


def identity_lowering(opset: int) -> OnnxLowering:
    """A replacement with the interface of every pass's (q, k, v, key_keep) that returns v."""
    body = onnx.helper.make_node("Identity", ["v"], ["out"])
    function = onnx.helper.make_function(
        DOMAIN,
        IDENTITY_FUNCTION,
        ["q", "k", "v", "key_keep"],
        ["out"],
        [body],
        [onnx.helper.make_opsetid("", opset)],
    )
    return OnnxLowering([function])
