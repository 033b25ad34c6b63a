"""Replace a matched attention with one node that calls the pass's model-local function.

The replacement reads q, k (un-transposed), v, a key_keep tensor ([..., Nk, 1], 1.0 = attend)
derived from the mask's last query row, and the pass's constants. The nodes the attention used
become dead and are removed, together with initializers nothing else reads.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.onnx.detect import MASKED_BELOW, MaskForm, MaskTerm, OnnxSite, Unsupported
from passes._onnx import DOMAIN, DOMAIN_VERSION, OnnxLowering

INT64_MAX = np.iinfo(np.int64).max


class Splicer:
    """Splices replacements into one model, sharing what sites have in common (the key_keep of
    a mask all layers use, identical function bodies)."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.graph = model.graph
        self._key_keep_cache: dict[tuple, ir.Value] = {}
        self._keep_all: ir.Value | None = None
        # old output -> its replacement: a site's q, k or v may be an earlier site's output
        # (attention feeding attention), captured before that site was spliced
        self._successor: dict[int, ir.Value] = {}
        model.opset_imports[DOMAIN] = DOMAIN_VERSION

    def check(self, s: OnnxSite) -> None:
        """Raise Unsupported before anything is changed, if this site cannot be spliced."""
        if s.k is None and _untranspose_plan(s.k_transposed) is None:
            raise Unsupported("the rank of k^T is unknown, so k cannot be recovered")
        if s.site.mask.key_padding and any(t.rank is None for t in s.masks):
            raise Unsupported("the key padding mask's rank is unknown")

    def splice(self, s: OnnxSite, lowering: OnnxLowering) -> str:
        anchor = s.output.producer()
        new_nodes: list[ir.Node] = []
        q, v = self._current(s.q), self._current(s.v)
        k = self._current(s.k) if s.k is not None else self._untranspose(self._current(s.k_transposed), new_nodes)
        key_keep = self._key_keep(s, new_nodes) if s.site.mask.key_padding else self._keep_all_value()
        constants = [self._initializer(f"{s.site.name}/{name}", array) for name, array in lowering.constants.items()]
        op_type = self._add_functions(lowering)
        call = ir.Node(
            DOMAIN,
            op_type,
            [q, k, v, key_keep, *constants],
            name=f"{s.site.name}/{op_type}",
            num_outputs=1,
        )
        result = call.outputs[0]
        result.type, result.shape = s.output.type, s.output.shape
        self.graph.insert_before(anchor, [*new_nodes, call])
        self._take_over(s.output, result)
        self._remove_dead(s.nodes)
        return f"{DOMAIN}.{op_type}"

    # -- inputs of the replacement ------------------------------------------------------------

    def _untranspose(self, k_t: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
        source, perm = _untranspose_plan(k_t)
        if perm == list(range(len(perm))):
            return source
        node = ir.Node("", "Transpose", [source], [ir.AttrInt64s("perm", perm)], name=f"{k_t.name}/untransposed")
        new_nodes.append(node)
        return node.outputs[0]

    def _key_keep(self, s: OnnxSite, new_nodes: list[ir.Node]) -> ir.Value:
        key = tuple((id(t.value), t.form) for t in s.masks)
        if key in self._key_keep_cache:
            return self._key_keep_cache[key]
        keep = None
        for term in s.masks:
            term_keep = self._last_row_keep(term, new_nodes)
            keep = term_keep if keep is None else self._node(new_nodes, "And", [keep, term_keep])
        as_float = self._node(new_nodes, "Cast", [keep], [ir.AttrInt64("to", ir.DataType.FLOAT)])
        rank = max(t.rank for t in s.masks)
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
        if term.form is MaskForm.ADDITIVE:
            threshold = np.array(MASKED_BELOW, dtype=mask.dtype.numpy())
            return self._node(new_nodes, "Greater", [row, self._const(threshold)])
        if mask.dtype != ir.DataType.BOOL:
            row = self._node(new_nodes, "Cast", [row], [ir.AttrInt64("to", ir.DataType.BOOL)])
        if term.form is MaskForm.KEEP_WHERE_FALSE:
            return self._node(new_nodes, "Not", [row])
        return row

    def _keep_all_value(self) -> ir.Value:
        if self._keep_all is None:
            self._keep_all = self._initializer("attnrewrite/keep_all_keys", np.ones((1, 1), np.float32))
        return self._keep_all

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

    def _initializer(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=_unique_name(self.graph, name), const_value=ir.tensor(array))
        value.type = ir.TensorType(value.const_value.dtype)
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value


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


def _unique_name(graph: ir.Graph, name: str) -> str:
    candidate, n = name, 2
    while candidate in graph.initializers:
        candidate, n = f"{name}_{n}", n + 1
    return candidate
