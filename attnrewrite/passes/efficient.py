"""Efficient Attention (Shen et al., WACV 2021): softmax_row(Q) (softmax_col(K)^T V).

Each query is a softmax over its own features, each key feature a softmax over the sequence,
and the product is reassociated: the keys and values fold into a [d, Dv] context first, so time
and memory are O(N * d * Dv). A query's weights over keys, sum_c softmax(q)_c softmax_col(k)_jc,
sum to one by construction: no normaliser beyond the two softmaxes.

Its own method rather than a feature map of ``linear``: linear's normaliser is one sum over
features and keys (phi(q) . sum_j phi(k_j)), while here every feature is normalised over the
keys on its own, before the product; a user asking for it by name gets it by name.

Temperatures: softmax(t * q) over features and softmax over keys of t * k (``query_scale`` and
``key_scale``, per head and feature, [heads, 1, head_dim]; calibration fits them), starting at
t = ZERO_SHOT_TEMPERATURE * scale * sqrt(head_dim): 2 at the usual scale 1/sqrt(head_dim). On
all-MiniLM-L6 (held-out, zero-shot, bench/fidelity.py) t = scale kept a mean embedding cosine of
0.39, t = 1 (the paper's raw features) 0.48, 2: 0.61, 3: 0.56, 4: 0.46: the site's scale alone
leaves both softmaxes nearly flat, while past 2 they pick too few features and keys.

Key padding: padded keys leave the key softmax (their logits are the lowest float). Causal:
query i's key softmax runs over keys <= i, a per-feature running normaliser Z_i (a causal prefix
sum, feature_sums.py: stabilised by the per-feature max over the kept keys, which cancels), and
out_i = sum_c (softmax(q_i)_c / Z_ic) sum_{j<=i} exp(k_jc - m_c) v_j: kernel.parallel's causal linear
attention with phi_q = softmax(q) / Z, phi_k = exp(k - m), whose normaliser is then
sum_c softmax(q_i)_c = 1 (its eps TINY, not 1e-6) and absorbs the rounding (and any feature whose sums underflowed).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from onnxscript import script

from attnrewrite.passes import feature_sums, hooks
from attnrewrite.passes.feature_sums import TINY
from attnrewrite.passes.kernel.parallel import causal_linear_attention_functions
from attnrewrite.passes.kernel.state import chunk_kernel_attention
from attnrewrite.passes.layout import flatten_heads_function, sequence_sum_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, standard_opset, with_callees
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.site import AttentionSite

NAME = "efficient"
# calibration has values to fit, no length is exact, no attention weights (passes/hooks.py)
nothing_to_fit, exact_part, attention_weights_unavailable = hooks.none_apply(NAME)
ZERO_SHOT_TEMPERATURE = 2.0  # times the site's scale * sqrt(head_dim); see the module docstring
NO_WINDOW = (
    "each key feature is normalised over the whole sequence on its own, with no per-key weight "
    "to share a normaliser with the window's softmax"
)
NO_RECURRENCE = (
    "Efficient Attention's causal form is a recurrence too (sum exp(k - m) v^T [d, Dv] and the "
    "per-feature normalisers and maxima), but it has no recurrent lowering yet"
)


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by Efficient Attention's two softmaxes"
    if feature_sums.site_scale(site) is None:
        return "the logits' scale is unknown, and Efficient Attention's temperatures start from it"
    return None


def initial_temperature(site: AttentionSite) -> float:
    """ZERO_SHOT_TEMPERATURE relative to the usual scale 1/sqrt(head_dim) (as it is where the head
    dim is unknown)."""
    usual = feature_sums.site_scale(site) * math.sqrt(site.head_dim) if site.head_dim else 1.0
    return ZERO_SHOT_TEMPERATURE * usual


def initial_values(site: AttentionSite) -> dict[str, np.ndarray]:
    """query_scale and key_scale, both initial_temperature at first."""
    temperature = np.full(feature_sums.head_value_shape(site), initial_temperature(site), np.float32)
    return {"query_scale": temperature, "key_scale": temperature.copy()}


# --- torch -----------------------------------------------------------------------------------


class EfficientAttention(Module):
    """forward(q, k, v, key_keep=None) -> [..., N, Dv]; query_scale and key_scale are named as
    the lowering's constants (parameters when learnable, else buffers)."""

    def __init__(self, causal: bool, chunk: int, values: dict[str, np.ndarray], learnable: bool = False):
        super().__init__()
        self.causal, self.chunk = causal, chunk
        for name, value in values.items():
            tensor = torch.from_numpy(value)
            if learnable:
                self.register_parameter(name, torch.nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)

    def forward(self, q, k, v, key_keep=None):
        phi_q = torch.softmax(q.float() * self.query_scale, dim=-1)
        keep = None if key_keep is None else key_keep.float()
        masked = feature_sums.masked_logits(k.float() * self.key_scale, keep)
        w = feature_sums.key_weights(masked)
        if self.causal:
            running = feature_sums.causal_feature_sums(w, self.chunk).clamp_min(TINY)
            out = chunk_kernel_attention(phi_q / running, w, v.float(), chunk=self.chunk, eps=TINY)[0]
        else:
            key_softmax = w / w.sum(dim=-2, keepdim=True).clamp_min(TINY)
            out = phi_q @ (key_softmax.transpose(-2, -1) @ v.float())
        return out.to(v.dtype)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, chunk={self.chunk}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> EfficientAttention:
    """``learnable``: query_scale and key_scale are parameters."""
    return EfficientAttention(site.mask.causal, options.chunk, initial_values(site), learnable)


# --- ONNX ------------------------------------------------------------------------------------


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (query_scale, key_scale)."""
    op = standard_opset(opset_version)
    masked_logits = feature_sums.masked_logits_function(opset_version, site.mask.key_padding)
    reference = feature_sums.reference_function(opset_version)
    flatten = flatten_heads_function(opset_version)
    sequence_sum = sequence_sum_function(opset_version)
    running_sums = feature_sums.causal_feature_sums_function(opset_version, options.chunk)
    causal_kernel = causal_linear_attention_functions(opset_version, options.chunk, TINY)[-1]

    @script(ATTNREWRITE, default_opset=op)
    def KeyWeights(k, key_keep, key_scale):
        """exp(key_scale * k - its per-feature max over kept keys), 0 on padded keys."""
        masked = masked_logits(op.Cast(k, to=FLOAT) * key_scale, key_keep)
        return op.Exp(masked - reference(masked))

    @script(ATTNREWRITE, default_opset=op)
    def WithHeadsOf(out, q, v):
        """[G, N, Dv] -> q's leading axes + [N, Dv], in v's dtype."""
        return op.CastLike(op.Reshape(out, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)), v)

    @script(ATTNREWRITE, default_opset=op)
    def EfficientAttention(q, k, v, key_keep, query_scale, key_scale):
        phi_q = op.Softmax(op.Cast(q, to=FLOAT) * query_scale, axis=-1)
        w = KeyWeights(k, key_keep, key_scale)
        key_softmax = w / op.Max(sequence_sum(w), op.Constant(value_float=TINY))
        context = op.MatMul(op.Transpose(flatten(key_softmax), perm=[0, 2, 1]), flatten(v))  # [G, d, Dv]
        return WithHeadsOf(op.MatMul(flatten(phi_q), context), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def CausalEfficientAttention(q, k, v, key_keep, query_scale, key_scale):
        phi_q = op.Softmax(op.Cast(q, to=FLOAT) * query_scale, axis=-1)
        w = KeyWeights(k, key_keep, key_scale)
        running = op.Max(running_sums(w), op.Constant(value_float=TINY))  # Z_i per feature
        return WithHeadsOf(causal_kernel(flatten(phi_q / running), flatten(w), flatten(v)), q, v)

    entry = CausalEfficientAttention if site.mask.causal else EfficientAttention
    functions = [f.to_function_proto() for f in with_callees(entry)]
    return OnnxLowering(functions, initial_values(site)).with_weights(weights)
