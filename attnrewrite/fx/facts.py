"""What is statically known about the values of a GraphModule: shapes, dtypes, scalars, liveness.

Graphs from torch.export (and symbolic traces run through ShapeProp) carry shapes in node.meta.
Plain symbolic traces carry none; for them the shapes that attention needs are inferred from
the graph itself: ``x.view(B, N, 4, 8).transpose(1, 2)`` is rank 4 with 4 heads of size 8 even
when B and N are unknown. A dimension that cannot be known is None; a shape of unknown rank is
None.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from attnrewrite.fx import evaluate, ops

Shape = tuple  # of int | None

_SCALAR_OPS = {
    operator.mul: operator.mul,
    operator.truediv: operator.truediv,
    operator.floordiv: operator.floordiv,
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.pow: operator.pow,
    math.pow: math.pow,
}
_SCALAR_UNARY = {operator.neg: operator.neg, math.sqrt: math.sqrt, torch.sym_sqrt: math.sqrt}
_CAST_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_SYM_SIZE = ops.aten_overloads("sym_size.int")


def _static_int(dim: Any) -> int | None:
    if isinstance(dim, bool):
        return None
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt):
        return dim.node.maybe_as_int()
    return None


def _broadcast(shapes: list[Shape]) -> Shape | None:
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(-rank, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis}
        known = {d for d in sizes if d not in (None, 1)}
        if len(known) == 1:
            out.append(known.pop())
        elif not known and None not in sizes:
            out.append(1)
        else:
            out.append(None)
    return tuple(out)


def live_nodes(gm: GraphModule, not_roots: set[Node] = frozenset()) -> set[Node]:
    """Nodes whose value reaches the output or a side effect (export's metadata asserts excluded:
    they keep nothing alive, and they live only as long as what they check; ``not_roots`` are
    impure nodes to treat as pure)."""
    graph = gm.graph
    roots = [
        n
        for n in graph.nodes
        if n.op == "output"
        or (n.op != "placeholder" and n not in not_roots and not ops.is_bookkeeping(n) and n.is_impure())
    ]
    live: set[Node] = set()
    while roots:
        node = roots.pop()
        if node not in live:
            live.add(node)
            roots.extend(node.all_input_nodes)
    live.update(n for n in graph.nodes if n.op == "placeholder")
    live.update(n for n in graph.nodes if ops.is_bookkeeping(n) and all(i in live for i in n.all_input_nodes))
    return live


class GraphFacts:
    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.live = live_nodes(gm)
        self._shapes: dict[Node, Shape | None] = {}
        self._constants: dict[Node, Any] = {}
        self.memo: dict[Any, Any] = {}  # results of costly analyses (mask probes), by key
        first = next(iter(gm.parameters()), None)
        self.default_dtype = first.dtype if first is not None else None

    # --- modules ---

    def module_of(self, node: Node) -> nn.Module | None:
        return self.modules.get(node.target) if node.op == "call_module" else None

    def module_path(self, node: Node) -> str | None:
        """Qualified name of the module whose forward produced node, when recorded (for a
        module call: the module that calls it)."""
        stack = node.meta.get("nn_module_stack") or {}
        paths = [entry[0] for entry in stack.values() if isinstance(entry[0], str)]
        if node.op == "call_module":
            paths = [p for p in paths if p != node.target] or [node.target.rpartition(".")[0]]
        return paths[-1] if paths and paths[-1] else None

    def users(self, node: Node) -> list[Node]:
        """Consumers of node's values: live, neither export's metadata asserts nor reads of
        its shape alone (full_like(p, 0) in export's NaN guard reads p's shape)."""
        return [
            u
            for u in node.users
            if u in self.live and not ops.is_bookkeeping(u) and ops.shape_only_source(u) is not node
        ]

    # --- shapes and dtypes ---

    def shape(self, node: Any) -> Shape | None:
        if not isinstance(node, Node):
            return None
        if node not in self._shapes:
            if not self._shapes:  # first use: all nodes in graph order, so no deep recursion
                for earlier in self.gm.graph.nodes:
                    self._shapes[earlier] = self._meta_shape(earlier) or self._infer_shape(earlier)
            if node not in self._shapes:  # a node added since
                self._shapes[node] = self._meta_shape(node) or self._infer_shape(node)
        return self._shapes[node]

    def rank(self, node: Any) -> int | None:
        shape = self.shape(node)
        return None if shape is None else len(shape)

    def dtype(self, node: Node) -> torch.dtype | None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dtype
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "dtype"):
            return meta.dtype
        if node.op == "call_method" and node.target in _CAST_DTYPES:
            return _CAST_DTYPES[node.target]
        return None

    @staticmethod
    def _meta_shape(node: Node) -> Shape | None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return tuple(_static_int(d) for d in val.shape)
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            return tuple(int(d) for d in meta.shape)
        return None

    def _sizes(self, values) -> Shape | None:
        if len(values) == 1 and isinstance(values[0], (list, tuple)):
            values = values[0]
        dims = []
        for value in values:
            dim = self.scalar(value)
            dims.append(dim if isinstance(dim, int) and dim >= 0 else None)
        return tuple(dims)

    def _infer_shape(self, node: Node) -> Shape | None:
        """Shapes from the graph alone, for the ops that build attention inputs."""
        if node.op == "call_module":
            return self._module_shape(node)
        if node.op not in ("call_function", "call_method"):
            return None
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        args = node.args
        x = args[0] if args else None
        if name in ("view", "reshape", "_unsafe_view") and len(args) >= 2:
            return self._sizes(args[1:])
        if name in ("expand",) and len(args) >= 2:
            sizes, source = self._sizes(args[1:]), self.shape(x)
            if source is not None and len(source) == len(sizes):
                sizes = tuple(s if s is not None else d for s, d in zip(sizes, source))
            return sizes
        source = self.shape(x)
        if name in ("transpose", "swapaxes", "swapdims") and source is not None and len(args) >= 3:
            dims = list(source)
            a, b = args[1] % len(dims), args[2] % len(dims)
            dims[a], dims[b] = dims[b], dims[a]
            return tuple(dims)
        if name == "permute" and source is not None:
            order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            if len(order) == len(source):
                return tuple(source[d % len(source)] for d in order)
            return None
        if name == "unsqueeze" and source is not None and isinstance(args[1], int):
            dims = list(source)
            dims.insert(args[1] % (len(dims) + 1), 1)
            return tuple(dims)
        if ops.matmul_operands(node):
            a, b = (self.shape(n) for n in ops.matmul_operands(node))
            if a is None or b is None or len(a) < 2 or len(b) < 2:
                return None
            batch = _broadcast([a[:-2], b[:-2]]) if len(a) > 2 or len(b) > 2 else ()
            return (*batch, a[-2], b[-1])
        if name == "getitem" and isinstance(x, Node):
            return self._split_piece_shape(x, args[1])
        tensors = [a for a in (*args, *node.kwargs.values()) if isinstance(a, Node) and not self.is_scalar(a)]
        if name in _ELEMENTWISE and tensors:
            shapes = [self.shape(t) for t in tensors]
            if any(s is None for s in shapes):
                return None
            return _broadcast(shapes)
        return None

    def _module_shape(self, node: Node) -> Shape | None:
        module = self.module_of(node)
        source = self.shape(node.args[0]) if node.args else None
        if source is None:
            return None
        if isinstance(module, nn.Linear):
            return (*source[:-1], module.out_features)
        if isinstance(module, (nn.Dropout, nn.Softmax, nn.LayerNorm, nn.Identity, nn.GELU, nn.ReLU)):
            return source
        return None

    def _split_piece_shape(self, pieces: Node, index: Any) -> Shape | None:
        name = pieces.target if pieces.op == "call_method" else getattr(pieces.target, "__name__", "")
        if name not in ("split", "chunk") or not isinstance(index, int):
            return None
        source = self.shape(pieces.args[0])
        if source is None:
            return None
        dim = ops.arg(pieces, 2, "dim", 0)
        size = self.scalar(ops.arg(pieces, 1, "split_size_or_sections" if name == "split" else "chunks"))
        dims = list(source)
        if not isinstance(dim, int):
            return None
        axis = dim % len(dims)
        if name == "split":
            dims[axis] = size if isinstance(size, int) else None
        else:
            whole = dims[axis]
            dims[axis] = (
                whole // size if isinstance(whole, int) and isinstance(size, int) and whole % size == 0 else None
            )
        return tuple(dims)

    # --- scalars ---

    def is_scalar(self, value: Any) -> bool:
        return self.scalar(value) is not None or (isinstance(value, Node) and self._is_shape_arithmetic(value))

    def _is_shape_arithmetic(self, node: Node) -> bool:
        """A Python number computed from tensor sizes: x.size(1), x.shape[0] * 2, ..."""
        if node.op == "call_method":
            return node.target in ("size", "dim", "numel")
        if node.op != "call_function":
            return False
        if node.target is getattr:
            return node.args[1] in ("shape", "ndim")
        if node.target in _SYM_SIZE:
            return True
        if node.target is operator.getitem:
            return isinstance(node.args[0], Node) and self._is_shape_arithmetic(node.args[0])
        if node.target in _SCALAR_OPS or node.target in _SCALAR_UNARY:
            return all(not isinstance(a, Node) or self._is_shape_arithmetic(a) for a in node.args)
        return False

    def scalar(self, value: Any) -> int | float | None:
        """The number a value stands for: a literal, a static size, arithmetic on those,
        or a one-element constant tensor; None when not statically known."""
        if isinstance(value, bool):
            return None
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            return value.node.maybe_as_int() if isinstance(value, torch.SymInt) else None
        if not isinstance(value, Node):
            return None
        if value not in self._constants:
            self._constants[value] = None
            self._constants[value] = self._scalar_of_node(value)
        return self._constants[value]

    def _scalar_of_node(self, node: Node) -> int | float | None:
        val = node.meta.get("val")
        if isinstance(val, (int, float, torch.SymInt)) and not isinstance(val, bool):
            return _static_int(val) if not isinstance(val, float) else val
        if node.op == "call_method" and node.target == "size" and len(node.args) >= 2:
            return self._dim(node.args[0], node.args[1])
        if node.op == "call_function":
            if node.target in _SYM_SIZE:
                return self._dim(node.args[0], node.args[1])
            if node.target is operator.getitem and isinstance(node.args[0], Node):
                seq = node.args[0]
                source = ops.shape_only_source(seq)
                is_full_shape = (seq.op == "call_function" and seq.target is getattr and seq.args[1] == "shape") or (
                    seq.op == "call_method" and seq.target == "size" and len(seq.args) == 1
                )
                if source is not None and is_full_shape and isinstance(node.args[1], int):
                    return self._dim(source, node.args[1])
                return None
            if node.target in _SCALAR_OPS and len(node.args) == 2:
                a, b = (self.scalar(x) for x in node.args)
                if a is None or b is None:
                    return None
                try:
                    return _SCALAR_OPS[node.target](a, b)
                except (ArithmeticError, ValueError):
                    return None
            if node.target in _SCALAR_UNARY and len(node.args) == 1:
                a = self.scalar(node.args[0])
                return None if a is None else _SCALAR_UNARY[node.target](a)
        value = evaluate.constant_value(self.gm, node)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype is not torch.bool:
            return value.item()
        return None

    def _dim(self, tensor: Any, axis: Any) -> int | None:
        shape = self.shape(tensor)
        if shape is None or not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
            return None
        return shape[axis]


_ELEMENTWISE = frozenset(
    {
        "add",
        "__add__",
        "__radd__",
        "sub",
        "__sub__",
        "mul",
        "__mul__",
        "__rmul__",
        "truediv",
        "__truediv__",
        "div",
        "masked_fill",
        "where",
        "softmax",
        "dropout",
        "float",
        "half",
        "to",
        "type",
        "type_as",
        "contiguous",
        "clone",
        "neg",
        "exp",
        "_softmax",
        "_safe_softmax",
        "elu",
    }
)
