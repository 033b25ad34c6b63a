"""Exact softmax on chosen heads, inside the replacement node (``--heads``).

Some heads resist linearization and most do not, so a site may keep some heads exact
(``exact_heads``, sorted head indices). Its replacement then splits the heads: the others,
the approximate heads, go through the method built for a site of H - e heads; the exact ones
through softmax attention with the site's mask (padded keys left out; on a causal site, later
keys too); the two outputs are put back in head order. One wrapper serves every method, in both
lowerings, as the method's own module and function are the inner part.

The method runs only on the approximate heads: its per-head values (fitted or drawn for all H
heads) are sliced along their head axis, which is found by comparing the values the method
makes for H and for H - e heads; values without one (shared by every head) pass unchanged.
Slicing keeps each approximate head's math as it was where the method treats heads
independently (every method but hydra, whose cosine kernel normalises over all heads together).

Keys and values reach the replacement with one head per query head (the splice repeats
grouped heads; the torch module does it itself), so each head's slice is gathered alike.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import numpy as np
from onnxscript import script

from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    DOMAIN,
    FLOAT,
    FunctionNodes,
    OnnxLowering,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.site import AttentionSite

HEAD_AXIS = 1  # of q, k, v and the output: [batch, heads, seq, head_dim]
NEEDS_HEAD_LAYOUT = "exact heads need the layout [batch, heads, seq, head_dim], and this site's heads are not known"
RECURRENT = "exact heads cannot be recurrent: an exact head would need its KV cache"
# what the wrapper's index constants are called (after the method's own)
INDEX_CONSTANTS = ("approximate_heads", "exact_heads", "head_order")
_LOWEST_LOGIT = -3.0e38  # a hidden key's logit: exp() of it is 0 beside any visible key's


def refusal(site: AttentionSite, exact: list[int] | None) -> str | None:
    """Why ``site`` cannot keep heads ``exact`` exact inside its replacement; None when it can
    (or when no head is to be exact). Every head exact is a refusal too: the site stays softmax."""
    if not exact:
        return None
    if site.rank != 4 or site.num_heads is None:
        return NEEDS_HEAD_LAYOUT
    if len(set(exact)) == site.num_heads:
        return f"every head kept exact ({site.num_heads} of {site.num_heads}): the attention is left as it was"
    return None


def out_of_range(site: AttentionSite, exact: list[int]) -> list[int]:
    """The heads of ``exact`` that ``site`` does not have (its heads known)."""
    return [h for h in exact if not 0 <= h < site.num_heads]


def approximate_site(site: AttentionSite, exact: list[int]) -> AttentionSite:
    """The site the method is built for: the same attention over its approximate heads only."""
    return dataclasses.replace(site, num_heads=site.num_heads - len(set(exact)))


def split(site: AttentionSite, exact: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(approximate heads, exact heads, order): concatenating the approximate heads' outputs and
    the exact ones' and taking ``order`` along the head axis puts every head back in place."""
    exact = sorted(set(exact))
    approximate = [h for h in range(site.num_heads) if h not in exact]
    order = np.argsort(approximate + exact).tolist()
    return approximate, exact, order


def attention_scale(site: AttentionSite) -> float:
    """The factor of q k^T: the site's, or 1/sqrt(head_dim) where it folded none."""
    return site.scale if site.scale is not None else 1.0 / math.sqrt(site.head_dim)


# --- slicing the method's values ------------------------------------------------------------


def head_axes(
    method: types.ModuleType, site: AttentionSite, options: Any, exact: list[int], opset_version: int | None = None
) -> dict[str, int | None]:
    """Each value the method may hold for ``site`` (its modules' state, plain and learnable, and
    with ``opset_version`` its lowering's constants, which are named alike): the axis that holds
    one entry per head, or None where the value is shared by every head. Found by building the
    method for H and for H - e heads."""
    sub = approximate_site(site, exact)
    full, fewer = (
        _value_shapes(method, site, options, opset_version),
        _value_shapes(method, sub, options, opset_version),
    )
    return {name: _head_axis(name, shape, fewer[name], site.num_heads, sub.num_heads) for name, shape in full.items()}


def _value_shapes(method: types.ModuleType, site: AttentionSite, options: Any, opset_version: int | None):
    shapes = {}
    for learnable in (False, True):
        try:
            module = method.torch_module(site, options, learnable=learnable)
        except ValueError:  # nothing to fit (lsh): no learnable module
            continue
        shapes.update({name: tuple(t.shape) for name, t in module.state_dict().items()})
    if opset_version is not None:
        constants = method.onnx_lowering(site, options, opset_version).constants
        shapes.update({name: tuple(array.shape) for name, array in constants.items()})
    return shapes


def _head_axis(name: str, shape: tuple, fewer: tuple, heads: int, sub_heads: int) -> int | None:
    if shape == fewer:
        return None
    differ = [axis for axis, (a, b) in enumerate(zip(shape, fewer)) if a != b]
    if len(shape) != len(fewer) or len(differ) != 1 or (shape[differ[0]], fewer[differ[0]]) != (heads, sub_heads):
        raise ValueError(
            f"the method's value {name!r} ({list(shape)} for {heads} heads, {list(fewer)} for {sub_heads}) "
            "has no head axis to slice"
        )
    return differ[0]


def sliced_values(values: dict[str, Any], axes: dict[str, int | None], heads: list[int]) -> dict[str, Any]:
    """``values`` (numpy arrays or tensors) with their head axes cut down to ``heads``."""
    if any(name not in axes for name in values):
        missing = sorted(name for name in values if name not in axes)
        raise ValueError(f"the method's values {missing} are not its module's: their head axes are unknown")
    return {name: value if axes[name] is None else _take(value, heads, axes[name]) for name, value in values.items()}


def _take(value, heads: list[int], axis: int):
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(np.take(value, heads, axis=axis))
    return value.index_select(axis, torch.tensor(heads, device=value.device)).contiguous()


# --- torch ----------------------------------------------------------------------------------


class ExactHeadsAttention(Module):
    """forward(q, k, v, key_keep): heads ``exact`` by softmax attention, the others by
    ``approximate`` (the method's module for them alone); q, k, v [batch, heads, seq, dim]."""

    def __init__(self, approximate, site: AttentionSite, exact: list[int]):
        super().__init__()
        self.approximate = approximate
        approximate_heads, exact_heads, order = split(site, exact)
        self.register_buffer("approximate_heads", torch.tensor(approximate_heads), persistent=False)
        self.register_buffer("exact_heads", torch.tensor(exact_heads), persistent=False)
        self.register_buffer("head_order", torch.tensor(order), persistent=False)
        self.scale, self.causal = attention_scale(site), site.mask.causal

    def forward(self, q, k, v, key_keep=None):
        from attnrewrite.passes.fit import exact_attention
        from attnrewrite.passes.layout import expand_to_query_heads

        k, v = expand_to_query_heads(k, q), expand_to_query_heads(v, q)

        def heads(x, index):
            return x.index_select(HEAD_AXIS, index)

        def keep(index):  # a key mask with one row per head is sliced too; a shared one broadcasts
            if key_keep is None or key_keep.dim() < 4 or key_keep.shape[HEAD_AXIS] == 1:
                return key_keep
            return heads(key_keep, index)

        a, e = self.approximate_heads, self.exact_heads
        approximated = self.approximate(heads(q, a), heads(k, a), heads(v, a), keep(a))
        exact_keep = None if keep(e) is None else keep(e).float()
        exact = exact_attention(heads(q, e), heads(k, e), heads(v, e), self.scale, exact_keep, self.causal)
        return torch.cat([approximated, exact.to(approximated.dtype)], dim=HEAD_AXIS).index_select(
            HEAD_AXIS, self.head_order
        )

    def extra_repr(self) -> str:
        return f"exact_heads={self.exact_heads.tolist()}"


def torch_module(method: types.ModuleType, site: AttentionSite, options: Any, exact: list[int], full=None):
    """The method's module for ``site`` (``full``, fitted or not; by default a new one) with heads
    ``exact`` exact: the method built for the other heads, holding ``full``'s values sliced."""
    full = method.torch_module(site, options) if full is None else full
    state = full.state_dict()
    sliced = sliced_values(state, head_axes(method, site, options, exact), split(site, exact)[0])
    sub = approximate_site(site, exact)
    approximate = method.torch_module(sub, options)
    if set(approximate.state_dict()) != set(sliced):  # fitted maps exist only on a learnable module
        approximate = method.torch_module(sub, options, learnable=True)
    approximate.load_state_dict(sliced)
    return ExactHeadsAttention(approximate, site, exact)


# --- ONNX -----------------------------------------------------------------------------------


def onnx_lowering(
    method: types.ModuleType,
    site: AttentionSite,
    options: Any,
    opset_version: int,
    exact: list[int],
    weights: dict | None = None,
) -> OnnxLowering:
    """The method's lowering for ``site`` (with ``weights``, its values for all heads) with heads
    ``exact`` exact: ``ExactHeads(q, k, v, key_keep, *the method's constants sliced,
    approximate_heads, exact_heads, head_order)``. The index constants are inputs, not part of
    the body, so that sites with the same method share one function."""
    full = method.onnx_lowering(site, options, opset_version, weights=weights)
    approximate_heads, exact_heads, order = split(site, exact)
    sliced = sliced_values(full.constants, head_axes(method, site, options, exact, opset_version), approximate_heads)
    inner = method.onnx_lowering(approximate_site(site, exact), options, opset_version, weights=sliced or None)
    op = standard_opset(opset_version)
    hidden_keys = _hidden_keys_function(op, site.mask.causal)
    softmax = _exact_softmax_function(op, attention_scale(site), hidden_keys).to_function_proto()
    softmax.name = f"{'Causal' if site.mask.causal else ''}ExactHeadsSoftmax"  # distinct bodies, distinct names
    helpers = [f.to_function_proto() for f in with_callees(_heads_of_keep_function(op), hidden_keys)]
    entry = _entry_function(inner, softmax.name, opset_version)
    indices = {
        name: np.asarray(value, np.int64)
        for name, value in zip(INDEX_CONSTANTS, (approximate_heads, exact_heads, order))
    }
    return OnnxLowering([*inner.functions, *helpers, softmax, entry], {**inner.constants, **indices})


def _entry_function(inner: OnnxLowering, softmax: str, opset_version: int):
    """ExactHeads<Entry>: gather the approximate heads for the method's entry and the exact ones
    for softmax, concatenate, and gather by the inverse permutation."""
    constants = list(inner.constants)
    body = FunctionNodes()

    def heads(index: str) -> list[str]:
        """q, k, v and key_keep of the heads ``index`` names."""
        return [
            *(body("Gather", role, index, axis=HEAD_AXIS) for role in "qkv"),
            body("ExactHeadsKeep", "key_keep", index, domain=DOMAIN),
        ]

    approximate, exact, order = INDEX_CONSTANTS
    approximated = body(inner.op_type, *heads(approximate), *constants, domain=DOMAIN)
    exactly = body("CastLike", body(softmax, *heads(exact), domain=DOMAIN), approximated)
    by_kind = body("Concat", approximated, exactly, axis=HEAD_AXIS)
    body.output("out", body("Gather", by_kind, order, axis=HEAD_AXIS))
    inputs = ["q", "k", "v", "key_keep", *constants, *INDEX_CONSTANTS]
    return make_function(f"ExactHeads{inner.op_type}", inputs, ["out"], body.nodes, opset_version)


@built_once
def _heads_of_keep_function(op):
    """ExactHeadsKeep(key_keep, heads): key_keep ([..., Nk, 1], of any rank) as [B, h, Nk, 1]
    for the heads ``heads``: a mask shared by the heads (head axis 1) is the same for all."""
    int64_max = np.iinfo(np.int64).max

    @script(ATTNREWRITE, default_opset=op)
    def ExactHeadsKeep(key_keep, heads):
        padded = op.Concat(op.Constant(value_ints=[1, 1, 1, 1]), op.Shape(key_keep), axis=0)
        rank4 = op.Slice(padded, op.Constant(value_ints=[-4]), op.Constant(value_ints=[int64_max]))
        keep = op.Reshape(op.Cast(key_keep, to=FLOAT), rank4)
        last = op.Shape(keep, start=1, end=2) - op.Constant(value_ints=[1])
        return op.Gather(keep, op.Min(heads, last), axis=1)

    return ExactHeadsKeep


@built_once
def _hidden_keys_function(op, causal: bool):
    """(logits, keep) -> where a query may not look, broadcastable to [B, h, Nq, Nk]: padded keys
    (ExactHeadsPadded) and on a causal site the keys after the query too (ExactHeadsPaddedOrLater;
    the last query sees every key)."""

    @script(ATTNREWRITE, default_opset=op)
    def ExactHeadsPadded(logits, keep):
        return op.Equal(op.Transpose(keep, perm=[0, 1, 3, 2]), op.Constant(value_float=0.0))

    if not causal:
        return ExactHeadsPadded

    @script(ATTNREWRITE, default_opset=op)
    def ExactHeadsPaddedOrLater(logits, keep):
        queries = op.Squeeze(op.Shape(logits, start=-2, end=-1))
        keys = op.Squeeze(op.Shape(logits, start=-1))
        one, zero_index = op.Constant(value_int=1), op.Constant(value_int=0)
        rows = op.Range(zero_index, queries, one) + (keys - queries)  # the last query sees every key
        later = op.Greater(
            op.Unsqueeze(op.Range(zero_index, keys, one), op.Constant(value_ints=[0])),
            op.Unsqueeze(rows, op.Constant(value_ints=[1])),
        )
        return op.Or(ExactHeadsPadded(logits, keep), later)

    return ExactHeadsPaddedOrLater


@built_once
def _exact_softmax_function(op, scale: float, hidden_keys):
    """ExactHeadsSoftmax(q, k, v, keep): softmax(scale q k^T, hidden keys left out) v in float32."""

    @script(ATTNREWRITE, default_opset=op)
    def ExactHeadsSoftmax(q, k, v, keep):
        logits = op.MatMul(
            op.Cast(q, to=FLOAT) * op.Constant(value_float=scale), op.Transpose(op.Cast(k, to=FLOAT), perm=[0, 1, 3, 2])
        )
        shown = op.Where(hidden_keys(logits, keep), op.Constant(value_float=_LOWEST_LOGIT), logits)
        return op.MatMul(op.Softmax(shown, axis=-1), op.Cast(v, to=FLOAT))

    return ExactHeadsSoftmax
