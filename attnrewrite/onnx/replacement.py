"""What every splice of one model composes (splice.py in parallel, grouped_query.py for a
GroupQueryAttention, recurrent.py for a recurrence): the graph editor, the model's functions and
initializers, and the node that calls the method's function in each site's place."""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.detect import OnnxSite
from attnrewrite.onnx.graph_edit import FunctionRegistry, GraphEditor, Initializers
from attnrewrite.passes.lowering import DOMAIN, DOMAIN_VERSION, OnnxLowering


class Replacements:
    """The replacements spliced into ``model`` so far; ``calls``: site name -> its call node."""

    def __init__(self, model: ir.Model):
        self.edit = GraphEditor(model.graph)
        self.functions = FunctionRegistry(model)
        self.initializers = Initializers(model.graph)
        self.calls: dict[str, ir.Node] = {}
        model.opset_imports[DOMAIN] = DOMAIN_VERSION

    def call(
        self, s: OnnxSite, lowering: OnnxLowering, inputs: list[ir.Value], own: frozenset[str], num_outputs: int = 1
    ) -> ir.Node:
        """The node calling the lowering's function on ``inputs`` and the lowering's constants
        (``own``: the names of those this site must not share with another, Initializers.for_site)."""
        constants = self.initializers.for_site(s.site.name, lowering.constants, own)
        op_type = self.functions.add(lowering)
        call = ir.Node(DOMAIN, op_type, [*inputs, *constants], name=f"{s.site.name}/{op_type}", num_outputs=num_outputs)
        self.calls[s.site.name] = call
        return call

    def insert(self, s: OnnxSite, before: ir.Node, nodes: list[ir.Node], output: ir.Value) -> str:
        """``nodes`` placed before ``before``, ``output`` in the place of the site's output (its
        type, shape, consumers and name); returns the replacement's qualified op type."""
        output.type, output.shape = s.output.type, s.output.shape
        self.edit.graph.insert_before(before, nodes)
        self.edit.take_over(s.output, output)
        return f"{DOMAIN}.{self.calls[s.site.name].op_type}"
