"""Hydra attention (Bolya et al., 2022): as many heads as features, with a cosine kernel.

q and k are L2-normalized over all features (every head of a token together when the layout
[batch, heads, seq, head_dim] is known, else per head), the keys and values are folded into one
global feature vector kv = sum_t k_t * v_t, and out_t = q_t * kv: O(N * D) time and memory.
Causal sites use a cumulative sum over positions instead of the global sum; the ONNX body takes
it with no CumSum along N (onnxruntime's CUDA CumSum is quadratic in its axis): a CumSum inside
chunks of CAUSAL_CHUNK positions, kernel.chunks.ExclusivePrefixSum over the chunks. The logits' scale
drops out of a cosine kernel.

The ONNX body computes in float32, except for float16 sites (the GPU case) with a known
head_dim: there q and k are normalised, and k_hat * v and the output formed, in float16, on
values scaled by a power of two so that nothing overflows (_half_precision_unit says for
which inputs); the norms' sum over heads and the sum over positions stay float32.
"""

from __future__ import annotations

import dataclasses
import math

import onnx
from onnxscript import script

from attnrewrite.passes import hooks
from attnrewrite.passes.kernel.chunks import exclusive_prefix_sum_function
from attnrewrite.passes.kernel.query_key_maps import (
    map_queries_and_keys,
    query_key_map_values,
    with_learned_entry,
    with_query_key_maps,
)
from attnrewrite.passes.layout import key_mask_function, sequence_sum_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset, with_callees
from attnrewrite.passes.optional_torch import Module
from attnrewrite.passes.options import UNUSED_SEED, Above, AtLeast, MethodOptions, option
from attnrewrite.site import AttentionSite

NAME = "hydra"
# calibration has values to fit, no length is exact, no attention weights (passes/hooks.py)
nothing_to_fit, exact_part, attention_weights_unavailable = hooks.none_apply(NAME)
# Positions per CumSum in the causal ONNX body: a bounded axis (a running sum on CPU; on CUDA
# each output reads at most this many inputs), the chunks' totals summed by MatMuls.
CAUSAL_CHUNK = 64
# Why ``window`` (exact softmax nearby, kernel beyond, one normaliser) is refused.
NO_WINDOW = (
    "its cosine kernel folds all keys into one feature vector, with no per-key weights "
    "to share a normaliser with the window's softmax"
)
NO_RECURRENCE = (
    "Hydra's causal form is a recurrence too (its state would be sum k_hat * v, [B, H, D]), "
    "but it has no recurrent lowering yet"
)


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    eps: float = option(1e-6, "added to the L2 norms so that an all-zero vector normalizes to zero", valid=Above(0))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by Hydra's cosine kernel"
    if site.head_dim is not None and site.value_dim is not None and site.head_dim != site.value_dim:
        return f"Hydra multiplies keys and values feature-wise: key dim {site.head_dim} != value dim {site.value_dim}"
    return None


def feature_axes(site: AttentionSite) -> list[int]:
    """Axes q and k are normalized over: heads and head_dim together when the layout is known."""
    return [1, 3] if site.rank == 4 and site.num_heads is not None else [-1]


class HydraAttention(Module):
    def __init__(self, causal: bool, feature_axes: list[int], eps: float):
        super().__init__()
        self.causal = causal
        self.feature_axes = tuple(feature_axes)
        self.eps = eps

    def normalize(self, x):
        return x / (x.square().sum(self.feature_axes, keepdim=True).sqrt() + self.eps)

    def forward(self, q, k, v, key_keep=None):
        q, k = map_queries_and_keys(self, q, k)
        q, k = self.normalize(q.float()), self.normalize(k.float())
        if key_keep is not None:
            k = k * key_keep
        kv = k * v.float()
        kv = kv.cumsum(-2) if self.causal else kv.sum(-2, keepdim=True)
        return (q * kv).to(v.dtype)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, feature_axes={self.feature_axes}, eps={self.eps}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> HydraAttention:
    """``learnable``: with identity query/key maps as parameters (kernel.query_key_maps)."""
    return with_query_key_maps(HydraAttention(site.mask.causal, feature_axes(site), options.eps), site, learnable)


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a learnable module's state (query_map, key_map), as numpy arrays."""
    functions = with_learned_entry(_plain_functions(site, options, opset_version), weights, opset_version)
    return OnnxLowering(functions, query_key_map_values(weights))


def _plain_functions(site: AttentionSite, options: Options, opset_version: int) -> list[onnx.FunctionProto]:
    op = standard_opset(opset_version)
    eps = options.eps
    over_heads = feature_axes(site) == [1, 3]
    keys = key_mask_function(opset_version, site.mask.key_padding)
    unit = _half_precision_unit(site)  # None: the float32 body

    @script(ATTNREWRITE, default_opset=op)
    def RowSquareSum(x):
        return op.ReduceSumSquare(x, op.Constant(value_ints=[-1]), keepdims=1)

    @script(ATTNREWRITE, default_opset=op)
    def HalfRowSquareSum(x):
        # ReduceSum(x * x): CUDA's row reduction; its ReduceSumSquare is a cuDNN call on a
        # scratch copy of x * x. (float32 keeps ReduceSumSquare, one pass on the CPU.)
        return op.ReduceSum(x * x, op.Constant(value_ints=[-1]), keepdims=1)

    row_square_sum = RowSquareSum if unit is None else HalfRowSquareSum

    @script(ATTNREWRITE, default_opset=op)
    def HeadSquaredNorm(x):
        # per head over head_dim, then over heads, in float32: two contiguous reductions (one
        # over axes [1, 3] is strided, and cuDNN's slow path on CUDA)
        per_head = op.Cast(row_square_sum(x), to=FLOAT)
        return op.ReduceSum(per_head, op.Constant(value_ints=[1]), keepdims=1)

    @script(ATTNREWRITE, default_opset=op)
    def SquaredNorm(x):
        return op.Cast(row_square_sum(x), to=FLOAT)

    squared_norm = HeadSquaredNorm if over_heads else SquaredNorm

    @script(ATTNREWRITE, default_opset=op)
    def HydraNormalize(x):
        return x / (op.Sqrt(squared_norm(x)) + op.Constant(value_float=eps))

    fold = _prefix_feature_sum_function(op, opset_version) if site.mask.causal else sequence_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def Hydra(q, k, v, key_keep):
        k_hat = keys(HydraNormalize(op.Cast(k, to=FLOAT)), key_keep)
        kv = fold(k_hat * op.Cast(v, to=FLOAT))
        return op.CastLike(HydraNormalize(op.Cast(q, to=FLOAT)) * kv, v)

    normalize, entry = HydraNormalize, Hydra
    if unit is not None:

        @script(ATTNREWRITE, default_opset=op)
        def HalfHydraNormalize(x):
            # x / unit first: the squares and per-head sums are then at most a mean square
            scaled = x * op.CastLike(op.Constant(value_float=1 / unit), x)
            norm = op.Sqrt(squared_norm(scaled)) + op.Constant(value_float=eps / unit)
            return scaled / op.CastLike(norm, x)

        @script(ATTNREWRITE, default_opset=op)
        def HalfHydra(q, k, v, key_keep):
            # q_hat * kv as (q_hat * unit) * (kv / unit): q_hat * unit has RMS 1, and kv / unit
            # overflows only where a query of typical entries would overflow the output anyway
            k_hat = keys(HalfHydraNormalize(k), op.CastLike(key_keep, k))
            kv = fold(op.Cast(k_hat * v, to=FLOAT)) * op.Constant(value_float=1 / unit)
            q_hat = HalfHydraNormalize(q) * op.CastLike(op.Constant(value_float=unit), q)
            return q_hat * op.CastLike(kv, v)

        normalize, entry = HalfHydraNormalize, HalfHydra
    proto = entry.to_function_proto()
    proto.name = "CausalHydra" if site.mask.causal else "Hydra"
    callees = [keys, row_square_sum, squared_norm, normalize, *with_callees(fold)]
    return [*(f.to_function_proto() for f in callees), proto]


@built_once
def _prefix_feature_sum_function(op, opset_version: int):
    """PrefixFeatureSum(x): the causal fold, with every CumSum axis bounded by CAUSAL_CHUNK."""
    prefix_sum = exclusive_prefix_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixFeatureSum(x):
        """The sums over positions <= each one (axis -2): within chunks a CumSum, across them
        ExclusivePrefixSum of the chunks' totals."""
        zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        n, features = op.Shape(x, start=-2, end=-1), op.Shape(x, start=-1)
        c = op.Constant(value_ints=[CAUSAL_CHUNK])
        chunks = op.Div(n + c - one, c)
        rows = op.Reshape(x, op.Concat(op.Constant(value_ints=[-1]), n, features, axis=0))  # [G, N, D]
        padded = op.Pad(rows, op.Concat(zero, chunks * c - n, axis=0), op.Constant(value_float=0.0), one)
        within = op.CumSum(op.Reshape(padded, op.Concat(zero, chunks, c, features, axis=0)), op.Constant(value_int=2))
        totals = op.Gather(within, op.Constant(value_int=CAUSAL_CHUNK - 1), axis=2)  # [G, chunks, D]
        sums = within + op.Unsqueeze(prefix_sum(totals), op.Constant(value_ints=[2]))
        flat = op.Reshape(sums, op.Concat(zero, op.Constant(value_ints=[-1]), features, axis=0))
        return op.Reshape(op.Slice(flat, zero, n, one), op.Shape(x))

    return PrefixFeatureSum


def _half_precision_unit(site: AttentionSite) -> float | None:
    """The float16 body's unit: the power of two (exact in float16) nearest sqrt(F), F the
    features normalized together, so that the squares of x / unit sum to about x's mean
    square. They and their per-head sums stay finite for vectors of RMS up to 256 (per head;
    256 * sqrt(heads) when heads are normalized together, the sum over heads being float32)
    and round coarsely (subnormal squares) only for vectors of RMS below ~0.2. None (the
    float32 body) for other dtypes, or when head_dim is unknown at rewrite time."""
    if site.dtype != "float16" or site.head_dim is None:
        return None
    features = site.head_dim * (site.num_heads if feature_axes(site) == [1, 3] else 1)
    return 2.0 ** round(math.log2(features) / 2)
