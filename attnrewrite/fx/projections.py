"""The projections around a replaced attention in a GraphModule: the node whose weight makes its
q, k and v (one node for a packed qkv projection) and the one its output goes into, as the
ONNX frontend finds them (onnx/projections.py). Fine-tuning (fx/finetune.py) puts peft's LoRA on
them.

A projection is an ``nn.Linear`` called as a module (symbolic_trace keeps leaf modules) or a
weighted call on a parameter (ops.weighted_call: F.linear and aten.linear, addmm or mm as
torch.export writes nn.Linear and GPT-2's Conv1D). Upstream from q, k and v the walk crosses
whatever lies between (head reshapes, rotary embeddings, grouped heads' expand) to the nearest
one; downstream from the output, layout alone. Size and shape reads are never followed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.fx import GraphModule, Node

from attnrewrite.fx import ops
from attnrewrite.passes.finetune import Quantized, Unadaptable
from attnrewrite.passes.layout import expand_to_query_heads

UPSTREAM_DEPTH = 16  # nodes between a projection and the attention's q, k or v, at most
DOWNSTREAM_DEPTH = 6
_LIKE_METHODS = frozenset({"expand_as", "type_as", "view_as", "reshape_as"})
_LAYOUT_METHODS = frozenset({"view", "reshape", "transpose", "permute", "contiguous", "flatten", "float", "to"})
_LAYOUT_FUNCTIONS = frozenset({torch.reshape, torch.transpose, torch.permute, torch.flatten}) | ops.aten_overloads(
    "view.default",
    "_unsafe_view.default",
    "reshape.default",
    "transpose.int",
    "permute.default",
    "clone.default",
    "contiguous.default",
    "_to_copy.default",
    "to.dtype",
)


@dataclasses.dataclass(frozen=True)
class Projection:
    """``node`` computes x W^T + b: a call of the ``nn.Linear`` ``module``, or ``call`` (weighted
    call) on the parameter ``weight`` (the tensor the graph reads)."""

    node: Node
    weight: torch.Tensor
    module: nn.Linear | None = None
    call: ops.WeightedCall | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out) of the projection."""
        rows, columns = self.weight.shape
        return (rows, columns) if self.call is not None and self.call.weight_last else (columns, rows)

    @property
    def name(self) -> str:
        return str(self.node.target) if self.module is not None else self.node.name


@dataclasses.dataclass(frozen=True)
class SiteProjections:
    inputs: tuple[Projection, ...]
    output: Projection | None

    @property
    def all(self) -> tuple[Projection, ...]:
        return (*self.inputs, *(() if self.output is None else (self.output,)))


def site_projections(gm: GraphModule, call: Node, replacements: set[Node]) -> SiteProjections:
    """The projections of the replacement ``call`` (a call_module on q, k, v, ...); Unadaptable
    with the reason where q, k or v comes from none. ``replacements``: every site's call (an
    earlier site's output is not walked through)."""
    found: dict[Node, Projection] = {}
    for role, value in zip("qkv", call.args[:3]):
        projection = _upstream(gm, value, replacements)
        if projection is None:
            raise Unadaptable(f"no nn.Linear or weighted call on a parameter makes its {role}")
        found.setdefault(projection.node, projection)
    return SiteProjections(tuple(found.values()), _downstream(gm, call))


def _upstream(gm: GraphModule, value: Node, replacements: set[Node]) -> Projection | None:
    frontier, seen = [value], set()
    for _ in range(UPSTREAM_DEPTH):
        following = []
        for node in frontier:
            if node in seen or node in replacements or node.op in ("placeholder", "get_attr"):
                continue
            seen.add(node)
            if ops.shape_only_source(node) is not None:
                continue
            projection = _projection(gm, node)
            if projection is not None:
                return projection
            following += _activations(node)
        frontier = following
    return None


def _downstream(gm: GraphModule, call: Node) -> Projection | None:
    frontier = [call]
    for _ in range(DOWNSTREAM_DEPTH):
        following = []
        for node in frontier:
            for user in node.users:
                projection = _projection(gm, user)
                if projection is not None and _activation(projection) is node:
                    return projection
                if _is_layout(user) and user.args and user.args[0] is node:
                    following.append(user)
        frontier = following
    return None


def _projection(gm: GraphModule, node: Node) -> Projection | None:
    """``node`` as a projection, or None; Quantized if it is a quantized one."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module).__module__.startswith("torch.ao.nn.quantized"):
            raise Quantized(f"the projection {node.target!r} is quantized ({type(module).__name__})")
        if isinstance(module, nn.Linear) and len(node.args) == 1 and not node.kwargs:
            return Projection(node, module.weight, module=module)
        return None
    call = ops.weighted_call(node)
    if call is None or not isinstance(call.input, Node) or call.input.op == "get_attr":
        return None
    weight = _parameter(gm, call.weight)
    bias = call.bias is None or _parameter(gm, call.bias) is not None
    if weight is None or weight.dim() != 2 or not bias:
        return None
    return Projection(node, weight, call=call)


def _activations(node: Node) -> list[Node]:
    """The inputs of ``node`` that carry activations: only the first where the others give
    just a shape or a dtype (the splice's expand_to_query_heads(k, q), x.type_as(y), ...)."""
    if (node.op == "call_function" and node.target is expand_to_query_heads) or (
        node.op == "call_method" and node.target in _LIKE_METHODS
    ):
        return [node.args[0]]
    return node.all_input_nodes


def _activation(projection: Projection) -> Node:
    return projection.node.args[0] if projection.call is None else projection.call.input


def _parameter(gm: GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    tensor = _attribute(gm, node.target)
    return tensor if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() else None


def _attribute(gm: GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def _is_layout(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _LAYOUT_METHODS
    return node.op == "call_function" and node.target in _LAYOUT_FUNCTIONS
