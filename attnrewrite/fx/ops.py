"""The op vocabulary of attention in torch.fx graphs: one recognizer per role, every spelling.

A role (matmul, transpose of the last two axes, scalar scale, cast, ...) is written many ways.
Graphs from ``symbolic_trace`` hold Python callables (``operator.matmul``, ``F.softmax``) and
method calls (``x.softmax(-1)``); graphs from ``torch.export`` hold aten overloads
(``aten.matmul.default``, ``aten._softmax.default``). Each recognizer accepts all spellings
and returns the operands in one form, so the matchers never look at a target themselves.
Recognizers return None for "not this role".
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

aten = torch.ops.aten


def aten_overloads(*names: str) -> frozenset:
    """aten overloads by name, skipping those this torch build lacks."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return frozenset(found)


def _call(node: Node, functions: frozenset | set, methods: frozenset | set = frozenset()) -> bool:
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call, given positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def describe(node: Node) -> str:
    """A short name of what a node computes, for skip reasons."""
    if node.op == "call_function":
        target = getattr(node.target, "__name__", str(node.target))
        return f"{target} ({node.name})"
    if node.op == "call_method":
        return f".{node.target}() ({node.name})"
    if node.op == "call_module":
        return f"module {node.target} ({node.name})"
    return f"{node.op} {node.name}"


# --- softmax -------------------------------------------------------------------------------


@dataclasses.dataclass
class SoftmaxCall:
    input: Node
    dim: int | None  # None: not given (legacy implicit dim)


_SOFTMAX_FUNCTIONS = frozenset({F.softmax, torch.softmax, torch.special.softmax}) | aten_overloads(
    "softmax.int", "_softmax.default", "_safe_softmax.default"
)


def softmax_call(node: Node, module_of) -> SoftmaxCall | None:
    if node.op == "call_module":
        module = module_of(node)
        if isinstance(module, nn.Softmax) and node.args:
            return SoftmaxCall(node.args[0], module.dim)
        return None
    if not _call(node, _SOFTMAX_FUNCTIONS, {"softmax"}):
        return None
    dim = arg(node, 1, "dim")
    return SoftmaxCall(node.args[0], dim if isinstance(dim, int) else None)


# --- matmul, transpose ------------------------------------------------------------------------

_MATMUL_FUNCTIONS = frozenset({operator.matmul, torch.matmul, torch.bmm}) | aten_overloads(
    "matmul.default", "bmm.default"
)
_MATMUL_METHODS = frozenset({"matmul", "bmm", "__matmul__"})


def matmul_operands(node: Node) -> tuple[Node, Node] | None:
    if _call(node, _MATMUL_FUNCTIONS, _MATMUL_METHODS) and len(node.args) >= 2:
        a, b = node.args[0], node.args[1]
        if isinstance(a, Node) and isinstance(b, Node):
            return a, b
    return None


_BADDBMM_FUNCTIONS = frozenset({torch.baddbmm}) | aten_overloads("baddbmm.default")


def baddbmm_operands(node: Node) -> tuple[Node, Node, Node] | None:
    """input + batch1 @ batch2 (beta = alpha = 1): nn.MultiheadAttention's masked logits."""
    if not _call(node, _BADDBMM_FUNCTIONS, {"baddbmm"}):
        return None
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    bias, a, b = node.args[:3]
    return bias, a, b


_TRANSPOSE_FUNCTIONS = frozenset({torch.transpose, torch.swapaxes, torch.swapdims}) | aten_overloads("transpose.int")
_TRANSPOSE_METHODS = frozenset({"transpose", "swapaxes", "swapdims"})
_PERMUTE_FUNCTIONS = frozenset({torch.permute}) | aten_overloads("permute.default")


def last_two_swapped_input(node: Node, rank_of) -> Node | None:
    """x when node is x with its last two axes swapped (transpose, permute, .mT)."""
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return node.args[0]
    if _call(node, _TRANSPOSE_FUNCTIONS, _TRANSPOSE_METHODS) and len(node.args) >= 3:
        x, d0, d1 = node.args[:3]
        if not (isinstance(d0, int) and isinstance(d1, int)):
            return None
        if {d0, d1} == {-1, -2}:
            return x
        rank = rank_of(x)
        if rank is not None and {d0 % rank, d1 % rank} == {rank - 2, rank - 1}:
            return x
        return None
    if _call(node, _PERMUTE_FUNCTIONS, {"permute"}):
        x, *dims = node.args
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = list(dims[0])
        if "dims" in node.kwargs:
            dims = list(node.kwargs["dims"])
        if not dims or not all(isinstance(d, int) for d in dims):
            return None
        rank = len(dims)
        dims = [d % rank for d in dims]
        if rank >= 2 and dims == [*range(rank - 2), rank - 1, rank - 2]:
            return x
    return None


def head_split_input(node: Node) -> Node | None:
    """x when node is a rank-4 x with axes 1 and 2 swapped: [B, N, H, D] -> [B, H, N, D]."""
    if _call(node, _TRANSPOSE_FUNCTIONS, _TRANSPOSE_METHODS) and len(node.args) >= 3:
        if {node.args[1], node.args[2]} in ({1, 2}, {-3, -2}):
            return node.args[0]
        return None
    if _call(node, _PERMUTE_FUNCTIONS, {"permute"}):
        x, *dims = node.args
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = list(dims[0])
        if [d % 4 if isinstance(d, int) else d for d in dims] == [0, 2, 1, 3]:
            return x
    return None


# --- scale, add, masks --------------------------------------------------------------------------

_MUL_FUNCTIONS = frozenset({operator.mul, torch.mul, torch.multiply}) | aten_overloads("mul.Tensor", "mul.Scalar")
_MUL_METHODS = frozenset({"mul", "__mul__", "__rmul__", "multiply"})
_DIV_FUNCTIONS = frozenset({operator.truediv, torch.div, torch.true_divide, torch.divide}) | aten_overloads(
    "div.Tensor", "div.Scalar"
)
_DIV_METHODS = frozenset({"div", "__truediv__", "true_divide", "divide"})


def scaled_operands(node: Node) -> tuple[str, Any, Any] | None:
    """("mul", a, b) for a * b, ("div", a, b) for a / b; the caller decides which is a scalar."""
    if _call(node, _MUL_FUNCTIONS, _MUL_METHODS) and len(node.args) >= 2:
        return "mul", node.args[0], node.args[1]
    if _call(node, _DIV_FUNCTIONS, _DIV_METHODS) and len(node.args) >= 2:
        if node.kwargs.get("rounding_mode") is not None:
            return None
        return "div", node.args[0], node.args[1]
    return None


_ADD_FUNCTIONS = frozenset({operator.add, torch.add}) | aten_overloads("add.Tensor")
_ADD_METHODS = frozenset({"add", "__add__", "__radd__"})


def add_operands(node: Node) -> tuple[Any, Any] | None:
    if _call(node, _ADD_FUNCTIONS, _ADD_METHODS) and len(node.args) >= 2:
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            return None
        return node.args[0], node.args[1]
    return None


_MASKED_FILL_FUNCTIONS = frozenset({torch.masked_fill}) | aten_overloads("masked_fill.Scalar", "masked_fill.Tensor")


def masked_fill_operands(node: Node) -> tuple[Node, Node, Any] | None:
    """(x, condition, value) of x.masked_fill(condition, value)."""
    if _call(node, _MASKED_FILL_FUNCTIONS, {"masked_fill"}):
        return node.args[0], arg(node, 1, "mask"), arg(node, 2, "value")
    return None


_WHERE_FUNCTIONS = frozenset({torch.where}) | aten_overloads(
    "where.self", "where.ScalarOther", "where.ScalarSelf", "where.Scalar"
)


def where_operands(node: Node) -> tuple[Node, Any, Any] | None:
    """(condition, if_true, if_false); x.where(c, y) is where(c, x, y)."""
    if _call(node, _WHERE_FUNCTIONS) and len(node.args) == 3:
        return node.args[0], node.args[1], node.args[2]
    if node.op == "call_method" and node.target == "where" and len(node.args) == 3:
        return node.args[1], node.args[0], node.args[2]
    return None


_NAN_TO_NUM = frozenset({torch.nan_to_num}) | aten_overloads("nan_to_num.default")


def nan_to_num_input(node: Node) -> Node | None:
    if _call(node, _NAN_TO_NUM, {"nan_to_num"}) and arg(node, 1, "nan", 0.0) in (0, 0.0, None):
        return node.args[0]
    return None


# --- value-preserving ops: casts, copies, dropout ------------------------------------------------

_CAST_METHODS = frozenset({"float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone"})
_CAST_FUNCTIONS = frozenset({torch.clone}) | aten_overloads(
    "_to_copy.default",
    "to.dtype",
    "to.dtype_layout",
    "to.device",
    "to.other",
    "clone.default",
    "contiguous.default",
    "alias.default",
    "type_as.default",
)


def cast_input(node: Node) -> Node | None:
    """x when node is x converted to another dtype or copied (values unchanged up to rounding)."""
    if _call(node, _CAST_FUNCTIONS, _CAST_METHODS) and node.args and isinstance(node.args[0], Node):
        return node.args[0]
    return None


_DROPOUT_FUNCTIONS = frozenset({F.dropout, torch.dropout}) | aten_overloads("dropout.default")


@dataclasses.dataclass
class DropoutCall:
    input: Node
    p: float | None  # None: p of a module, read at run time


def dropout_call(node: Node, module_of) -> DropoutCall | None:
    if node.op == "call_module":
        module = module_of(node)
        if isinstance(module, nn.Dropout) and node.args:
            return DropoutCall(node.args[0], module.p)
        return None
    if _call(node, _DROPOUT_FUNCTIONS):
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "training", arg(node, 2, "train", True))
        return DropoutCall(node.args[0], p if training else 0.0)
    return None


# --- weighted projections (fine-tuning's adapters go on these) ----------------------------------


@dataclasses.dataclass
class WeightedCall:
    """A projection of ``input`` by the tensor ``weight``: x W^T + b with W [out, in] (F.linear),
    or, ``weight_last``, x W + b with W [in, out] (addmm, mm, matmul: GPT-2's Conv1D)."""

    input: Node
    weight: Node
    bias: Node | None
    weight_last: bool


_LINEAR_FUNCTIONS = frozenset({F.linear, torch._C._nn.linear}) | aten_overloads("linear.default")
_ADDMM_FUNCTIONS = frozenset({torch.addmm}) | aten_overloads("addmm.default")
_MM_FUNCTIONS = frozenset({torch.mm}) | aten_overloads("mm.default")


def weighted_call(node: Node) -> WeightedCall | None:
    if _call(node, _LINEAR_FUNCTIONS):
        return WeightedCall(arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias"), False)
    if _call(node, _ADDMM_FUNCTIONS) and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        bias, x, weight = node.args[:3]
        return WeightedCall(x, weight, bias, True)
    if _call(node, _MM_FUNCTIONS, {"mm"}):
        return WeightedCall(node.args[0], node.args[1], None, True)
    operands = matmul_operands(node)
    return None if operands is None else WeightedCall(*operands, None, True)


# --- decomposed matmul (run_decompositions): view(bmm(view(expand(a)), view(expand(b)))) ---------

_VIEW_FUNCTIONS = aten_overloads("view.default", "_unsafe_view.default", "reshape.default")
_EXPAND_FUNCTIONS = aten_overloads("expand.default")
_COPY_FUNCTIONS = aten_overloads("clone.default", "contiguous.default")
_BMM_FUNCTIONS = aten_overloads("bmm.default")


def is_view(node: Node) -> bool:
    return _call(node, _VIEW_FUNCTIONS)


def is_expand(node: Node) -> bool:
    return _call(node, _EXPAND_FUNCTIONS)


def is_copy(node: Node) -> bool:
    return _call(node, _COPY_FUNCTIONS)


def is_bmm(node: Node) -> bool:
    return _call(node, _BMM_FUNCTIONS)


# --- bookkeeping ---------------------------------------------------------------------------------

_BOOKKEEPING = aten_overloads("_assert_tensor_metadata.default", "_assert_scalar.default")


def is_bookkeeping(node: Node) -> bool:
    """Checks torch.export inserts; they read a tensor but compute nothing from it."""
    return node.op == "call_function" and node.target in _BOOKKEEPING


# --- shape-only uses (mask classification: the value of such an input does not matter) ----------

_SHAPE_ONLY_FUNCTIONS = frozenset(
    {torch.ones_like, torch.zeros_like, torch.full_like, torch.empty_like}
) | aten_overloads(
    "sym_size.int",
    "sym_numel.default",
    "ones_like.default",
    "zeros_like.default",
    "full_like.default",
    "empty_like.default",
    "new_ones.default",
    "new_zeros.default",
    "new_full.default",
    "new_empty.default",
)
_SHAPE_ONLY_METHODS = frozenset({"size", "dim", "new_ones", "new_zeros", "new_full", "new_empty", "numel"})
_SHAPE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim"})


def shape_only_source(node: Node) -> Node | None:
    """The tensor whose shape/dtype (never its values) node reads, e.g. x in x.size(1)."""
    if node.op == "call_function" and node.target is getattr and node.args[1] in _SHAPE_ATTRIBUTES:
        return node.args[0]
    if _call(node, _SHAPE_ONLY_FUNCTIONS, _SHAPE_ONLY_METHODS) and isinstance(node.args[0], Node):
        return node.args[0]
    return None
