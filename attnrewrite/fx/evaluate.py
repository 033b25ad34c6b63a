"""Running a slice of a GraphModule: the nodes one value depends on, with chosen inputs.

Used to read constants (a scale built as ``torch.tensor(-inf)``) and to probe masks: the
nodes that build a mask are run on made-up inputs and the result is compared with a causal
triangle or a key-padding pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg


def walk(start: Node, inputs: Callable[[Node], Iterable[Node]] = lambda node: node.all_input_nodes) -> Iterator[Node]:
    """start and every node reached from it through ``inputs`` (default: all its input nodes),
    each once, depth first. ``inputs(node)`` is called after ``node`` is yielded and before the
    next one is, so the caller may stop early or record what it saw on the way."""
    seen: set[Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(inputs(node))


def ancestors(target: Node, stop=lambda node: False) -> list[Node]:
    """target and every node it depends on, in graph order; ``stop`` nodes are not entered."""
    seen = set(walk(target, lambda node: () if stop(node) else node.all_input_nodes))
    order = {node: i for i, node in enumerate(target.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def fetch_attr(gm: GraphModule, qualified_name: str) -> Any:
    value: Any = gm
    for part in qualified_name.split("."):
        value = getattr(value, part)
    return value


def run_slice(gm: GraphModule, target: Node, inputs: dict[Node, Any]) -> Any:
    """Value of ``target`` given values for some nodes (placeholders at least)."""
    env: dict[Node, Any] = dict(inputs)
    nodes = ancestors(target, stop=lambda n: n in inputs)
    # an in-place op in the slice must not write into the model's own buffers
    copy_attributes = any(_in_place(n) for n in nodes)
    for node in nodes:
        if node in env:
            continue
        if node.op == "placeholder":
            raise LookupError(f"input {node.name!r} has no value")
        args = map_arg(node.args, env.__getitem__)
        kwargs = map_arg(node.kwargs, env.__getitem__)
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            env[node] = value.detach().clone() if copy_attributes and isinstance(value, torch.Tensor) else value
        elif node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        elif node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        elif node.op == "call_module":
            env[node] = gm.get_submodule(node.target)(*args, **kwargs)
        else:
            raise LookupError(f"cannot evaluate {node.op} {node.name!r}")
    return env[target]


def _in_place(node: Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.endswith("_")
    return False


def constant_value(gm: GraphModule, target: Node, max_nodes: int = 32) -> torch.Tensor | None:
    """The value of a small computation that reads no input and no trainable parameter."""
    for count, node in enumerate(walk(target), start=1):
        if count > max_nodes or node.op in ("placeholder", "call_module", "output"):
            return None
        if node.op == "get_attr" and isinstance(fetch_attr(gm, node.target), torch.nn.Parameter):
            return None
    try:
        with torch.no_grad():
            return run_slice(gm, target, {})
    except Exception:  # noqa: BLE001 - a value we cannot compute is simply not a known constant
        return None
