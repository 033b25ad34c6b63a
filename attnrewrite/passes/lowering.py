"""What the ONNX lowerings share: the opset objects their onnxscript bodies are written against."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript import OnnxFunction
from onnxscript.values import Opset

DOMAIN = "attnrewrite"
DOMAIN_VERSION = 1
MICROSOFT = "com.microsoft"  # onnxruntime's contrib operators: only where the runtime is known to run them
ATTNREWRITE = Opset(DOMAIN, DOMAIN_VERSION)
MIN_OPSET = 18  # bodies pass reduction axes as inputs (ReduceMax, ReduceSumSquare: opset 18)

FLOAT = onnx.TensorProto.FLOAT
BOOL = onnx.TensorProto.BOOL
TO_THE_END = 2147483647  # a Slice end past any axis
NODE_BUILT = "node_built"  # on a script function: the FunctionProtos it calls by name (written node by node)


def standard_opset(version: int) -> Opset:
    """The default-domain opset a function body must use to sit in a model importing `version`."""
    return Opset("", max(version, MIN_OPSET))


def built_once(factory):
    """``factory``, a maker of script functions from hashable arguments, run once per distinct
    arguments (their types too: 1 and 1.0 make different constants). Translating an onnxscript
    body parses its source, a few milliseconds a function, and every site of a model asks for
    the same bodies: on tests/test_window.py translating was 78 s of a 186 s profiled run. The functions are shared
    and never changed; a list comes back as a copy, the caller's to extend."""
    made_once = functools.lru_cache(maxsize=1024, typed=True)(factory)

    @functools.wraps(factory)
    def make(*args, **kwargs):
        made = made_once(*args, **kwargs)
        return list(made) if isinstance(made, list) else made

    return make


def rank_constant(value: float, rank: int) -> onnx.TensorProto:
    """``value`` as a float32 [1] * rank tensor, for op.Constant(value=...) against a tensor of
    that rank: onnxruntime's CPU kernels broadcast a scalar over a [..., 1] tensor one element at
    a time, tens of times slower than a constant of the same rank."""
    return onnx.numpy_helper.from_array(np.full((1,) * rank, value, np.float32))


def make_function(name: str, inputs: list[str], outputs: list[str], nodes, opset_version: int) -> onnx.FunctionProto:
    """A function of our domain written node by node (what a script function cannot express:
    an unrolled loop, a wrapper around a function chosen at rewrite time), importing the same
    opsets as the onnxscript bodies."""
    opsets = [
        onnx.helper.make_opsetid("", max(opset_version, MIN_OPSET)),
        onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION),
    ]
    if any(node.domain == MICROSOFT for node in nodes_with_branches(nodes)):
        opsets.append(onnx.helper.make_opsetid(MICROSOFT, 1))
    return onnx.helper.make_function(DOMAIN, name, inputs, outputs, nodes, opsets)


def nodes_with_branches(nodes):
    """``nodes`` and those of their If branches, at any depth."""
    for node in nodes:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from nodes_with_branches(attribute.g.node)


def with_callees(*functions: OnnxFunction) -> list[OnnxFunction]:
    """``functions`` and every function they call, directly or not, each once and after all it
    calls: the order OnnxLowering.functions takes (an entry calling all the others comes last).
    Read from the bodies, so a lowering lists exactly the functions its entry reaches."""
    reach: dict[str, dict[str, OnnxFunction]] = {}  # each function's callees, read once

    def reached(function: OnnxFunction) -> dict[str, OnnxFunction]:
        if function.name not in reach:
            callees = {}
            for node in ir.traversal.RecursiveGraphIterator(function.function_ir.graph):
                callee = node.meta.get("callee")
                if isinstance(callee, OnnxFunction) and callee.name not in callees:
                    callees[callee.name] = callee
                    callees.update(reached(callee))
            reach[function.name] = callees
        return reach[function.name]

    found: dict[str, OnnxFunction] = {}
    for function in functions:
        found.update(reached(function))
        found[function.name] = function
    # A function reaches more functions than any function it calls: callees sort first.
    return sorted(found.values(), key=lambda function: len(reached(function)))


def unique_functions(functions: list) -> list:
    """Each function once (by name; a name is one body here), callees before callers kept."""
    seen = {}
    for function in functions:
        seen.setdefault(function.name, function)
    return list(seen.values())


@dataclasses.dataclass
class OnnxLowering:
    """One replacement node: call `function` with (q, k, v[, key_keep], *constants).

    ``functions`` holds the entry function last and every function it calls before it.
    ``constants`` are stored as initializers (random features, projections): fixed at rewrite
    time, never redrawn at inference.
    """

    functions: list[onnx.FunctionProto]
    constants: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # the replacement as a GroupQueryAttention computes it itself with this local_window_size
    # (softmax over the last that many keys up to each query, its own included): at such a site
    # the splice keeps the operator and sets it instead of calling ``functions``; None: it cannot
    group_query_window: int | None = dataclasses.field(default=None, kw_only=True)

    @property
    def op_type(self) -> str:
        return self.functions[-1].name

    def with_weights(self, weights: dict[str, np.ndarray] | None) -> OnnxLowering:
        """The constants that ``weights`` (a fitted module's state) names, replaced by its
        values (weighted)."""
        self.constants = weighted(self.constants, weights)
        return self


def weighted(constants: dict[str, np.ndarray], weights: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """``constants`` with the values that ``weights`` (a fitted module's state) names instead of
    their own: the module's state_dict names are the constants' names. Order and dtypes are the
    constants'."""
    constants = dict(constants)
    for name, value in (weights or {}).items():
        if name in constants:
            value = np.asarray(value, dtype=constants[name].dtype)
            if value.shape != constants[name].shape:
                raise ValueError(
                    f"weight {name!r} has shape {list(value.shape)}, the lowering's {list(constants[name].shape)}"
                )
            constants[name] = value
    return constants


class FunctionNodes:
    """The nodes of a function written node by node (make_function), for bodies whose inputs
    depend on options: each call adds one node and returns its output name(s)."""

    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix  # of every name it makes: a branch's names are unique in its function
        self.outputs: dict[str, str] = {}  # output() names -> the values' names
        self._made: set[str] = set()  # the values its nodes make

    def __call__(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attributes):
        names = [f"{self.prefix}n{len(self.nodes)}_{i}" for i in range(outputs)]
        self._made.update(names)
        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), names, domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def call(self, function: OnnxFunction, *inputs: str, outputs: int = 1):
        """A call of one of our functions."""
        return self(function.name, *inputs, outputs=outputs, domain=DOMAIN)

    def ints(self, *values: int) -> str:
        return self("Constant", value_ints=list(values))

    def output(self, name: str, value: str) -> None:
        """``value`` under the function output's ``name``. A branch returns a value it made as
        it is (an Identity there is one more node run each time), others under its own name."""
        if self.prefix and value in self._made and value not in self.outputs.values():
            self.outputs[name] = value
            return
        self.outputs[name] = self.prefix + name
        self.nodes.append(onnx.helper.make_node("Identity", [value], [self.prefix + name]))

    def graph(self, name: str, outputs: list[str], inputs: tuple = ()) -> onnx.GraphProto:
        """The nodes as an If branch returning the values output() named ``outputs``, in order;
        with ``inputs`` ((name, element type, shape or None), as make_tensor_value_info takes
        them) a Loop's body."""
        values = [onnx.helper.make_value_info(self.outputs[o], onnx.TypeProto()) for o in outputs]
        taken = [onnx.helper.make_tensor_value_info(*value) for value in inputs]
        return onnx.helper.make_graph(self.nodes, name, taken, values)
