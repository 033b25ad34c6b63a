"""Hydra attention (Bolya et al., 2022): as many heads as features, with a cosine kernel.

q and k are L2-normalized over all features (every head of a token together when the layout
[batch, heads, seq, head_dim] is known, else per head), the keys and values are folded into one
global feature vector kv = sum_t k_t * v_t, and out_t = q_t * kv: O(N * D) time and memory.
Causal sites use a cumulative sum over positions instead of the global sum. The logits' scale
drops out of a cosine kernel.
"""

from __future__ import annotations

import dataclasses

from onnxscript import script

from attnrewrite.site import AttentionSite
from passes import kernels
from passes._options import UNUSED_SEED, option
from passes._onnx import ATTNREWRITE, FLOAT, OnnxLowering, standard_opset
from passes._torch import Module

NAME = "hydra"
# Why ``window`` (exact softmax nearby, kernel beyond, one normaliser) is refused.
NO_WINDOW = (
    "its cosine kernel folds all keys into one feature vector, with no per-key weights "
    "to share a normaliser with the window's softmax"
)


@dataclasses.dataclass
class Options:
    eps: float = option(1e-6, "added to the L2 norms so that an all-zero vector normalizes to zero")
    seed: int = option(0, UNUSED_SEED)


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
        q, k = kernels.map_queries_and_keys(self, q, k)
        q, k = self.normalize(q.float()), self.normalize(k.float())
        if key_keep is not None:
            k = k * key_keep
        kv = k * v.float()
        kv = kv.cumsum(-2) if self.causal else kv.sum(-2, keepdim=True)
        return (q * kv).to(v.dtype)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, feature_axes={self.feature_axes}, eps={self.eps}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> HydraAttention:
    """``learnable``: with identity query/key maps as parameters (kernels.add_query_key_maps)."""
    module = HydraAttention(site.mask.causal, feature_axes(site), options.eps)
    if learnable:
        kernels.add_query_key_maps(module, site)
    return module



def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a learnable module's state (query_map, key_map), as numpy arrays."""
    lowering = _plain_lowering(site, options, opset_version)
    if weights is None:
        return lowering
    return kernels.with_query_key_maps(lowering, weights, opset_version)


def _plain_lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    op = standard_opset(opset_version)
    axes = feature_axes(site)
    eps = options.eps

    @script(ATTNREWRITE, default_opset=op)
    def HydraNormalize(x):
        norm = op.Sqrt(op.ReduceSumSquare(x, op.Constant(value_ints=axes), keepdims=1))
        return x / (norm + op.Constant(value_float=eps))

    @script(ATTNREWRITE, default_opset=op)
    def GlobalFeatureSum(x):
        return op.ReduceSum(x, op.Constant(value_ints=[-2]), keepdims=1)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixFeatureSum(x):
        return op.CumSum(x, op.Constant(value_int=-2))

    fold = PrefixFeatureSum if site.mask.causal else GlobalFeatureSum

    @script(ATTNREWRITE, default_opset=op)
    def Hydra(q, k, v, key_keep):
        k_hat = HydraNormalize(op.Cast(k, to=FLOAT)) * key_keep
        kv = fold(k_hat * op.Cast(v, to=FLOAT))
        return op.CastLike(HydraNormalize(op.Cast(q, to=FLOAT)) * kv, v)

    entry = Hydra.to_function_proto()
    if site.mask.causal:
        entry.name = "CausalHydra"
    return OnnxLowering([HydraNormalize.to_function_proto(), fold.to_function_proto(), entry])
