"""Hedgehog attention (Zhang et al., "The Hedgehog & the Porcupine", ICLR 2024): kernel attention
with a feature map that is fitted to mimic softmax.

phi(x) = [softmax(W x' + b), softmax(-(W x' + b))] over the feature axis (2d positive features),
x' = x * scale^(1/2), with a per-head W [d, d] (identity before fitting) and b [d] (zeros), one
per head when the layout [batch, heads, seq, head_dim] is known, else one shared by all heads.
Attention is phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)) (passes/kernel/): O(N * d^2). Softmax
features keep the weights positive and, once fitted, spiky and monotone in q.k like exp; before
fitting (W = I) the method is a rough stand-in for softmax, fitting is what makes it good.

Why scale^(1/2) on both q and k: the logits are scale * q.k = x'_q . x'_k, so x' are the vectors
whose dot product is the attention's own logit, and splitting the scale evenly keeps q and k on one
footing (one W serves both, as in Hedgehog). With W = I the feature softmaxes then start at the
attention's temperature rather than at that of raw q and k (whose norms grow with sqrt(d)); any
other constant factor would be something W has to learn first.

``window=W`` (passes/window/): exact softmax over the query's own block of W
positions, the previous one, the next one (bidirectional, ``window_next``) and the first
``sinks`` positions, Hedgehog over the rest, one normaliser. The exact part is in units of
e^(s_ij - m_i) (m_i: the row's max over its exact keys); normalised features are in no such
units, as their product carries no per-query or per-key magnitude. So key j of query i weighs
    w_h e^(a_h.x'_i + t(c_h.y'_j) - beta_h m_i) phi(x_i).phi(y_j),   t(u) = 16 tanh(u / 16)
with per head: w_h = exp(``linear_log_weight``) (1 at first), ``query_log_scale`` a_h and
``key_log_scale`` c_h ([heads, d, 1], zeros at first), ``local_max_weight`` beta_h (1/2 at
first); t bounds the keys' log scales (KEY_LOG_SCALE_BOUND says why). bench/window_units.py, one
MiniLM layer fitted alone, held-out attention-output MSE: without the log scales and beta_h
(w_h phi.phi in no unit) 0.0022 (layer 0) and 0.0072 (layer 5), with them 0.0015 and 0.0046.
beta_h started at 1 fits layer 0 worst (0.0031) and layer 5 best (0.0044); at 1/2 it fits layer 0
best and layer 5 within 6%.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from onnxscript import script

from attnrewrite.passes import hooks
from attnrewrite.passes.kernel import delta
from attnrewrite.passes.kernel.delta_onnx import delta_rule_lowering
from attnrewrite.passes.kernel.feature_map import (
    CausalTerms,
    FeatureMap,
    OnnxTerms,
    entry_functions,
    kernel_attention_function,
)
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.recurrence import KernelRecurrence
from attnrewrite.passes.layout import fitted_heads, key_mask_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import AtLeast, MethodOptions, option
from attnrewrite.passes.window import settings as window_settings
from attnrewrite.passes.window.lowering import windowed_kernel
from attnrewrite.passes.window.reference import feature_map_attention_weights, windowed_attention_weights
from attnrewrite.passes.window.settings import KernelScales, KernelUnit, Window
from attnrewrite.passes.window.torch_form import feature_map_attention, windowed_kernel_attention
from attnrewrite.site import AttentionSite

NAME = "hedgehog"
INITIAL_LOCAL_MAX_WEIGHT = 0.5  # beta_h before fitting (the module docstring says why)
# Bidirectional keys share one stabiliser per head (their max log scale), so a key far below it
# would underflow to 0 in float32 even where it is a query's heaviest far key: the keys' log
# scales are kept within +-KEY_LOG_SCALE_BOUND (b tanh(c.y' / b)), every key within e^-32 of it.
KEY_LOG_SCALE_BOUND = 16.0
WINDOW_VALUES = ("linear_log_weight", "query_log_scale", "key_log_scale", "local_max_weight")
# The window's kernel part: fitted log scales, moved by e^(-beta_h m_i) (the module docstring says why)
WINDOW_UNIT = KernelUnit.MAX_WEIGHTED


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    window: int = window_settings.window_option("Hedgehog")
    window_next: bool = window_settings.window_next_option()
    sinks: int = window_settings.sinks_option()
    sparse: int = window_settings.sparse_option()
    seed: int = option(
        0, "unused: the feature map starts at the identity; accepted for a uniform interface", valid=AtLeast(0)
    )
    update: str = delta.update_option()


def attention_weights_unavailable(options: Options) -> str | None:
    # the module's attention_weights covers every other option
    return window_settings.sparse_weights_unavailable(options) or (
        delta.NO_WEIGHTS if delta.uses_delta(options) else None
    )


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by a kernel feature map"
    if not site.scale > 0:
        return f"Hedgehog folds scale^(1/2) into q and k and needs a positive scale, not {site.scale}"
    if site.head_dim is None:
        return "the head dimension is unknown, and the feature map W [d, d] is sized at rewrite time"
    return window_settings.sparse_refusal(site, options) or delta.refusal(site, options)


nothing_to_fit = hooks.nothing_unfittable


exact_part = window_settings.exact_part


# --- torch -----------------------------------------------------------------------------------


class HedgehogAttention(Module):
    def __init__(
        self,
        values: dict,
        scale: float,
        causal: bool,
        chunk: int,
        window: Window | None,
        learnable: bool,
        update: str = delta.ADDITIVE,
    ):
        super().__init__()
        self.update = update
        for name in ("weight", "bias"):
            value = torch.from_numpy(values[name])
            if learnable:
                self.register_parameter(name, torch.nn.Parameter(value))
            else:
                self.register_buffer(name, value)
        if window is not None:  # the window's values are parameters either way, as in the other methods
            for name in WINDOW_VALUES:
                self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(values[name])))
        else:
            self.linear_log_weight = None  # read by feature_map_attention
        self.scale = scale
        self.root_scale = math.sqrt(scale)
        self.causal = causal
        self.chunk = chunk
        self.window = window

    def features(self, x):
        """[softmax(z), softmax(-z)], z = W (x scale^(1/2)) + b, in float32."""
        z = (x.float() * self.root_scale) @ self.weight.float().transpose(-2, -1) + self.bias.float()
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)

    def forward(self, q, k, v, key_keep=None):
        if self.window is None:
            phi_q, phi_k = self.features(q), self.features(k)
            return feature_map_attention(self, phi_q, phi_k, q, k, v, key_keep).to(v.dtype)
        phi_q, phi_k, terms = self.windowed_terms(q, k, key_keep)
        if not self.causal:  # one log scale per head: the keys' own go into their features
            key_log_scale = terms["scales"].key_log_scale
            head_max = key_log_scale.amax(dim=-2, keepdim=True)
            phi_k = phi_k * torch.exp(key_log_scale - head_max)
            terms["scales"] = terms["scales"]._replace(key_log_scale=head_max)
        return windowed_kernel_attention(phi_q, phi_k, q, k, v, self.window, **terms).to(v.dtype)

    def log_scales(self, q, k, keep):
        """a_h.x'_i per query and c_h.y'_j per key, bounded ([..., N, 1]); padded keys get the
        lowest log scale, so that they never raise a maximum."""
        query_log_scale = (q.float() * self.root_scale) @ self.query_log_scale
        key_log_scale = (k.float() * self.root_scale) @ self.key_log_scale
        key_log_scale = KEY_LOG_SCALE_BOUND * torch.tanh(key_log_scale / KEY_LOG_SCALE_BOUND)
        if keep is not None:
            key_log_scale = torch.where(keep > 0, key_log_scale, LOWEST_LOG_SCALE)
        return query_log_scale, key_log_scale

    def windowed_terms(self, q, k, key_keep):
        """phi_q, phi_k (zero on padded keys) and the keyword arguments of the window hybrid
        (windowed_kernel_attention, after the window), the per-key log scales included."""
        keep = None if key_keep is None else key_keep.float()
        phi_k = self.features(k)
        query_log_scale, key_log_scale = self.log_scales(q, k, keep)
        scales = KernelScales(self.linear_log_weight, query_log_scale, key_log_scale, self.local_max_weight)
        terms = dict(scale=self.scale, causal=self.causal, key_keep=keep, scales=scales, eps=WINDOW_UNIT.eps)
        return self.features(q), phi_k if keep is None else phi_k * keep, terms

    def attention_weights(self, q, k, key_keep=None):
        """The normalised weights [..., Nq, Nk] this module gives each key, N x N: for the
        attention-weight (cross-entropy) loss Hedgehog is fitted with, never for inference."""
        if self.window is None:
            return feature_map_attention_weights(self, self.features(q), self.features(k), q, k, key_keep)
        phi_q, phi_k, terms = self.windowed_terms(q, k, key_keep)
        return windowed_attention_weights(phi_q, phi_k, q.float(), k.float(), self.window, **terms)

    def extra_repr(self) -> str:
        heads, d, _ = self.weight.shape
        said = f"heads={heads}, head_dim={d}, causal={self.causal}, chunk={self.chunk}, update={self.update}"
        return said + window_settings.window_repr(self.window)


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> HedgehogAttention:
    """``learnable``: W and b are nn.Parameters (else buffers); linear_log_weight always is one."""
    values = HedgehogFeatureMap(options).fitted_values(site)
    window = Window.of(options, site)
    return HedgehogAttention(values, site.scale, site.mask.causal, options.chunk, window, learnable, options.update)


# --- ONNX ------------------------------------------------------------------------------------


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (weight, bias, linear_log_weight) as numpy arrays."""
    if delta.uses_delta(options):
        return delta_rule_lowering(HedgehogFeatureMap(options), site, opset_version, weights)
    op = standard_opset(opset_version)
    HedgehogFeatures = _features_function(op, math.sqrt(site.scale))
    window = Window.of(options, site)

    if window is not None:
        window_inputs, kernel = windowed_kernel(window, site, opset_version, WINDOW_UNIT)
        HedgehogLogScale, HedgehogKeyLogScale = _log_scale_functions(op, math.sqrt(site.scale))
        kept_keys = key_mask_function(opset_version, site.mask.key_padding)

        @script(ATTNREWRITE, default_opset=op)
        def HedgehogHeadKeys(phi_k, key_log_scale, keep):
            # bidirectional: one log scale per head, the keys' own folded into their features;
            # a key that is not kept has the lowest, so its features are 0 with no product by keep
            head_max = op.ReduceMax(key_log_scale, op.Constant(value_ints=[-2]), keepdims=1)
            return phi_k * op.Exp(key_log_scale - head_max), head_max

        @script(ATTNREWRITE, default_opset=op)
        def HedgehogCausalKeys(phi_k, key_log_scale, keep):
            # the far sums read phi_k as it is: zero on padded keys (no product without key padding)
            return kept_keys(phi_k, keep), op.Identity(key_log_scale)

        keys_fn = HedgehogCausalKeys if site.mask.causal else HedgehogHeadKeys

        @script(ATTNREWRITE, default_opset=op)
        def WindowedHedgehog(
            q, k, v, key_keep, weight, bias, linear_log_weight, query_log_scale, key_log_scale, local_max_weight
        ):
            q_in, k_in, keep_in = window_inputs(q, k, key_keep)
            keep = op.Cast(keep_in, to=FLOAT)
            phi_k, far_key_log_scale = keys_fn(
                HedgehogFeatures(k_in, weight, bias), HedgehogKeyLogScale(k_in, key_log_scale, keep), keep
            )
            out = kernel(
                HedgehogFeatures(q_in, weight, bias),
                phi_k,
                HedgehogLogScale(q_in, query_log_scale),
                far_key_log_scale,
                q_in,
                k_in,
                v,
                keep,
                linear_log_weight,
                local_max_weight,
            )
            return op.CastLike(out, v)

        functions = entry_functions(WindowedHedgehog, "CausalWindowedHedgehog" if site.mask.causal else None)
    else:
        kernel = kernel_attention_function(opset_version, site.mask.causal, options.chunk)

        @script(ATTNREWRITE, default_opset=op)
        def Hedgehog(q, k, v, key_keep, weight, bias):
            return kernel(HedgehogFeatures(q, weight, bias), HedgehogFeatures(k, weight, bias) * key_keep, v)

        functions = entry_functions(Hedgehog, "CausalHedgehog" if site.mask.causal else None)
    return OnnxLowering(functions, HedgehogFeatureMap(options).constants(site, weights))


@built_once
def _features_function(op, root_scale: float):
    """HedgehogFeatures(x, weight, bias), as HedgehogAttention.features."""

    @script(ATTNREWRITE, default_opset=op)
    def HedgehogFeatures(x, weight, bias):
        scaled = op.Cast(x, to=FLOAT) * op.Constant(value_float=root_scale)
        z = op.MatMul(scaled, op.Transpose(weight, perm=[0, 2, 1])) + bias
        return op.Concat(op.Softmax(z, axis=-1), op.Softmax(op.Neg(z), axis=-1), axis=-1)

    return HedgehogFeatures


@built_once
def _log_scale_functions(op, root_scale: float):
    """(HedgehogLogScale, HedgehogKeyLogScale), as HedgehogAttention.log_scales."""

    @script(ATTNREWRITE, default_opset=op)
    def HedgehogLogScale(x, log_scale):
        return op.MatMul(op.Cast(x, to=FLOAT) * op.Constant(value_float=root_scale), log_scale)

    @script(ATTNREWRITE, default_opset=op)
    def HedgehogKeyLogScale(k, key_log_scale, keep):
        # bounded (KEY_LOG_SCALE_BOUND); padded keys: the lowest, so they never raise a maximum
        bound = op.Constant(value_float=KEY_LOG_SCALE_BOUND)
        bounded = op.Tanh(HedgehogLogScale(k, key_log_scale) / bound) * bound
        kept = op.Greater(keep, op.Constant(value_float=0.0))
        return op.Where(kept, bounded, op.Constant(value_float=LOWEST_LOG_SCALE))

    return HedgehogLogScale, HedgehogKeyLogScale


# --- the recurrent form (passes/kernel/recurrence.py) ---------------------------------------------


class HedgehogFeatureMap(FeatureMap):
    """[softmax(z), softmax(-z)] (HedgehogAttention.features); with a window, in log scaled
    units (WINDOW_UNIT): the state carries their max log scale too."""

    entry = "Hedgehog"

    @property
    def unit(self) -> KernelUnit:
        return WINDOW_UNIT if self.options.window else KernelUnit.SHARED

    def feature_count(self, site: AttentionSite) -> int | str:
        return "F" if site.head_dim is None else 2 * site.head_dim  # softmax(z), softmax(-z)

    def torch_terms(self, module: HedgehogAttention, q, k, keep) -> CausalTerms:
        """The features (padded keys' zero), and with a window the log scales and local_max_weight."""
        phi_q, phi_k = module.features(q), module.features(k) * keep
        if module.window is None:
            return CausalTerms(phi_q, phi_k)
        query_log_scale, key_log_scale = module.log_scales(q, k, keep)
        return CausalTerms(phi_q, phi_k, query_log_scale, key_log_scale, module.local_max_weight)

    def onnx_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """HedgehogCausalTerms(q, k, keep, weight, bias) -> (phi_q, phi_k), with a window
        HedgehogWindowedTerms(..., query_log_scale, key_log_scale) -> (phi_q, phi_k, query log
        scale, key log scale), as torch_terms."""
        op = standard_opset(opset_version)
        HedgehogFeatures = _features_function(op, math.sqrt(site.scale))

        @script(ATTNREWRITE, default_opset=op)
        def HedgehogCausalTerms(q, k, keep, weight, bias):
            return HedgehogFeatures(q, weight, bias), HedgehogFeatures(k, weight, bias) * keep

        if not self.options.window:
            return OnnxTerms(HedgehogCausalTerms, ("weight", "bias"))
        HedgehogLogScale, HedgehogKeyLogScale = _log_scale_functions(op, math.sqrt(site.scale))

        @script(ATTNREWRITE, default_opset=op)
        def HedgehogWindowedTerms(q, k, keep, weight, bias, query_log_scale, key_log_scale):
            phi_q, phi_k = HedgehogCausalTerms(q, k, keep, weight, bias)
            return phi_q, phi_k, HedgehogLogScale(q, query_log_scale), HedgehogKeyLogScale(k, key_log_scale, keep)

        return OnnxTerms(HedgehogWindowedTerms, ("weight", "bias", "query_log_scale", "key_log_scale"))

    def onnx_query_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """HedgehogFeatures(q, weight, bias), with a window HedgehogQueryTerms(q, weight, bias,
        query_log_scale) -> (phi_q, query log scale)."""
        op = standard_opset(opset_version)
        HedgehogFeatures = _features_function(op, math.sqrt(site.scale))
        if not self.options.window:
            return OnnxTerms(HedgehogFeatures, ("weight", "bias"))
        HedgehogLogScale = _log_scale_functions(op, math.sqrt(site.scale))[0]

        @script(ATTNREWRITE, default_opset=op)
        def HedgehogQueryTerms(q, weight, bias, query_log_scale):
            return HedgehogFeatures(q, weight, bias), HedgehogLogScale(q, query_log_scale)

        return OnnxTerms(HedgehogQueryTerms, ("weight", "bias", "query_log_scale"))

    def fitted_values(self, site: AttentionSite) -> dict[str, np.ndarray]:
        """W = I and b = 0, and the window's weight, log scales and local max weight."""
        heads, d = fitted_heads(site), site.head_dim
        values = {
            "weight": np.tile(np.eye(d, dtype=np.float32), (heads, 1, 1)),
            "bias": np.zeros((heads, 1, d), np.float32),
        }
        if self.options.window:
            values["linear_log_weight"] = window_settings.initial_linear_log_weight(site)
            values["query_log_scale"] = np.zeros((heads, d, 1), np.float32)
            values["key_log_scale"] = np.zeros((heads, d, 1), np.float32)
            values["local_max_weight"] = np.full((heads, 1, 1), INITIAL_LOCAL_MAX_WEIGHT, np.float32)
        return values


def recurrence(options: Options) -> KernelRecurrence:
    """Causal Hedgehog is a recurrence over its features' sums."""
    return KernelRecurrence(HedgehogFeatureMap(options))
