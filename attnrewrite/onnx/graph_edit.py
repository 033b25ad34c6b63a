"""Editing one ONNX graph in place, as the splices (splice.py, grouped_query.py, recurrent.py)
and the benchmark's identity bound do it.

``GraphEditor`` builds standard-op nodes and constants, hands a value's consumers to its
replacement (remembering it, so that a value captured before the replacement still finds it)
and removes the nodes nothing reads any more, with the initializers only they read.
``Initializers`` adds initializers, storing equal contents once where they may be shared;
``FunctionRegistry`` adds a lowering's model-local functions, each body once.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.passes.lowering import DOMAIN, OnnxLowering, nodes_with_branches

INT64_MAX = np.iinfo(np.int64).max  # a Slice end: to the end of the axis


class GraphEditor:
    """Edits ``graph``: the nodes it builds go into lists the caller inserts where they belong;
    constants go to the top of the graph at once."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        # old output -> its replacement: a site's q, k or v may be an earlier site's output
        # (attention feeding attention), captured before that site was spliced
        self._successor: dict[int, ir.Value] = {}

    def node(self, new_nodes: list[ir.Node], op_type: str, inputs, attributes=()) -> ir.Value:
        """The output of a new one-output standard-op node, appended to ``new_nodes``."""
        node = ir.Node("", op_type, inputs, attributes, num_outputs=1)
        new_nodes.append(node)
        return node.outputs[0]

    def const(self, array) -> ir.Value:
        """A Constant node's output (a list is int64), placed first in the graph."""
        array = np.asarray(array, dtype=np.int64) if isinstance(array, list) else array
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array))], num_outputs=1)
        self.graph.insert_before(self.graph.node(0), node) if self.graph.num_nodes() else self.graph.append(node)
        return node.outputs[0]

    def current(self, value: ir.Value) -> ir.Value:
        """``value``, or what replaced it (take_over), through every later replacement."""
        while id(value) in self._successor:
            value = self._successor[id(value)]
        return value

    def take_over(self, old: ir.Value, new: ir.Value) -> None:
        """``new`` takes ``old``'s consumers, graph outputs included, and its name."""
        self._successor[id(old)] = new
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{name}/replaced"
        new.name = name

    def remove_dead(self, seeds: list[ir.Node]) -> None:
        """The seeds nothing reads, then their producers nothing reads any more, upstream; and the
        initializers only they read."""
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
                else:
                    self.drop_if_unread(value)

    def drop_if_unread(self, value: ir.Value) -> None:
        """An initializer that nothing reads (and that is no graph input) leaves the graph."""
        if value.is_initializer() and not value.uses() and not value.is_graph_input():
            self.graph.initializers.pop(value.name, None)


class Initializers:
    """Adds initializers to ``graph`` and counts their bytes."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        # content -> initializer: sites with the same shapes and seed draw the same constants
        # (Linformer's [max_len, proj_dim] projections), which are stored once
        self._by_content: dict[tuple, ir.Value] = {}
        self.bytes_added = 0

    def shared(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer holding ``array``: the one already added with the same content, if any."""
        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest())
        if key not in self._by_content:
            self._by_content[key] = self.added(name, array)
        return self._by_content[key]

    def added(self, name: str, array: np.ndarray) -> ir.Value:
        """A new initializer holding ``array``, named ``name`` or, where that is taken, ``name_2``..."""
        value = ir.Value(name=unique_initializer_name(self.graph, name), const_value=ir.tensor(array))
        value.type = ir.TensorType(value.const_value.dtype)
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        self.bytes_added += array.nbytes
        return value

    def for_site(self, site: str, arrays: dict[str, np.ndarray], own: frozenset[str]) -> list[ir.Value]:
        """``arrays`` as initializers named ``site/name``, shared with other sites where equal, but
        for those in ``own`` (values that calibration will fit per site, though they start equal)."""
        return [
            self.added(f"{site}/{name}", array) if name in own else self.shared(f"{site}/{name}", array)
            for name, array in arrays.items()
        ]


class FunctionRegistry:
    """The model-local functions of ``model`` in domain attnrewrite, added by lowering."""

    def __init__(self, model: ir.Model):
        self.model = model

    def add(self, lowering: OnnxLowering) -> str:
        """Add the lowering's functions and return the name its entry has in the model: an
        identical body already present is reused, a different one under the same name is
        renamed (callers' references follow)."""
        functions = self.model.functions
        renamed: dict[str, str] = {}
        for proto in lowering.functions:
            for opset in proto.opset_import:  # com.microsoft, where a step uses LinearAttention
                self.model.opset_imports.setdefault(opset.domain, opset.version)
            proto = _with_callees_renamed(proto, renamed)
            base, name, suffix = proto.name, proto.name, 2
            while (DOMAIN, name, "") in functions:
                if _same_body(functions[(DOMAIN, name, "")], proto):
                    break
                name, suffix = f"{base}_{suffix}", suffix + 1
            else:
                proto.name = name
                functions[(DOMAIN, name, "")] = ir.serde.deserialize_function(proto)
            renamed[base] = name
        return renamed[lowering.op_type]


def _with_callees_renamed(proto: onnx.FunctionProto, renamed: dict[str, str]) -> onnx.FunctionProto:
    copy = onnx.FunctionProto()
    copy.CopyFrom(proto)
    for node in nodes_with_branches(copy.node):  # calls inside If branches and Loop bodies too
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
