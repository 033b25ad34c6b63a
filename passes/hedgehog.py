"""Hedgehog attention (Zhang et al., "The Hedgehog & the Porcupine", ICLR 2024): kernel attention
with a feature map that is fitted to mimic softmax.

phi(x) = [softmax(W x' + b), softmax(-(W x' + b))] over the feature axis (2d positive features),
x' = x * scale^(1/2), with a per-head W [d, d] (identity before fitting) and b [d] (zeros), one
per head when the layout [batch, heads, seq, head_dim] is known, else one shared by all heads.
Attention is phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)) (kernels.py): O(N * d^2). Softmax
features keep the weights positive and, once fitted, spiky and monotone in q.k like exp; before
fitting (W = I) the method is a rough stand-in for softmax, fitting is what makes it good.

Why scale^(1/2) on both q and k: the logits are scale * q.k = x'_q . x'_k, so x' are the vectors
whose dot product is the attention's own logit, and splitting the scale evenly keeps q and k on one
footing (one W serves both, as in Hedgehog). With W = I the feature softmaxes then start at the
attention's temperature rather than at that of raw q and k (whose norms grow with sqrt(d)); any
other constant factor would be something W has to learn first.

``window=W`` (kernels.windowed_kernel_attention): exact softmax over the query's own block of W
positions, the previous one, the next one (bidirectional, ``window_next``) and the first
``sinks`` positions, Hedgehog over the rest, one normaliser; a per-head ``linear_log_weight``
weighs the kernel part.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from onnxscript import script

from attnrewrite.site import AttentionSite
from passes import kernels
from passes._options import option
from passes._onnx import ATTNREWRITE, FLOAT, OnnxLowering, standard_opset
from passes._torch import Module, torch

NAME = "hedgehog"


@dataclasses.dataclass
class Options:
    chunk: int = option(64, "causal prefix-sum block length", valid=">= 1")
    window: int = option(
        0, "exact softmax over blocks of this many positions, Hedgehog beyond (0: off)", valid=">= 0"
    )
    window_next: bool = kernels.window_next_option()
    sinks: int = kernels.sinks_option()
    seed: int = option(0, "unused: the feature map starts at the identity; accepted for a uniform interface")

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"hedgehog chunk must be >= 1, got {self.chunk}")
        kernels.check_window_options(NAME, self.window, self.sinks)


def attention_weights_unavailable(options: Options) -> str | None:
    return None  # the module's attention_weights covers every option, window included


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by a kernel feature map"
    if not site.scale > 0:
        return f"Hedgehog folds scale^(1/2) into q and k and needs a positive scale, not {site.scale}"
    if site.head_dim is None:
        return "the head dimension is unknown, and the feature map W [d, d] is sized at rewrite time"
    return None


def initial_values(site: AttentionSite, options: Options) -> dict[str, np.ndarray]:
    """The fittable values before fitting, by their state_dict names (W = I, b = 0)."""
    heads, d = kernels.fitted_heads(site), site.head_dim
    values = {
        "weight": np.tile(np.eye(d, dtype=np.float32), (heads, 1, 1)),
        "bias": np.zeros((heads, 1, d), np.float32),
    }
    if options.window:
        values["linear_log_weight"] = kernels.initial_linear_log_weight(site)
    return values


# --- torch -----------------------------------------------------------------------------------


class HedgehogAttention(Module):
    def __init__(
        self, values: dict, scale: float, causal: bool, chunk: int, window: int, window_next: bool, sinks: int,
        learnable: bool,
    ):
        super().__init__()
        for name in ("weight", "bias"):
            value = torch.from_numpy(values[name])
            if learnable:
                self.register_parameter(name, torch.nn.Parameter(value))
            else:
                self.register_buffer(name, value)
        self.linear_log_weight = None
        if window:
            self.linear_log_weight = torch.nn.Parameter(torch.from_numpy(values["linear_log_weight"]))
        self.scale = scale
        self.root_scale = math.sqrt(scale)
        self.causal = causal
        self.chunk = chunk
        self.window, self.window_next, self.sinks = window, window_next, sinks

    def features(self, x):
        """[softmax(z), softmax(-z)], z = W (x scale^(1/2)) + b, in float32."""
        z = (x.float() * self.root_scale) @ self.weight.float().transpose(-2, -1) + self.bias.float()
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)

    def forward(self, q, k, v, key_keep=None):
        phi_q, phi_k = self.features(q), self.features(k)
        return kernels.feature_map_attention(self, phi_q, phi_k, q, k, v, key_keep).to(v.dtype)

    def attention_weights(self, q, k, key_keep=None):
        """The normalised weights [..., Nq, Nk] this module gives each key, N x N: for the
        attention-weight (cross-entropy) loss Hedgehog is fitted with, never for inference."""
        return kernels.feature_map_attention_weights(self, self.features(q), self.features(k), q, k, key_keep)

    def extra_repr(self) -> str:
        heads, d, _ = self.weight.shape
        return f"heads={heads}, head_dim={d}, causal={self.causal}, chunk={self.chunk}{kernels.window_repr(self)}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> HedgehogAttention:
    """``learnable``: W and b are nn.Parameters (else buffers); linear_log_weight always is one."""
    values = initial_values(site, options)
    return HedgehogAttention(
        values, site.scale, site.mask.causal, options.chunk, options.window, options.window_next, options.sinks,
        learnable,
    )



# --- ONNX ------------------------------------------------------------------------------------


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (weight, bias, linear_log_weight) as numpy arrays."""
    op = standard_opset(opset_version)
    root_scale = math.sqrt(site.scale)
    flatten = kernels.flatten_heads_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def HedgehogFeatures(x, weight, bias):
        scaled = op.Cast(x, to=FLOAT) * op.Constant(value_float=root_scale)
        z = op.MatMul(scaled, op.Transpose(weight, perm=[0, 2, 1])) + bias
        return op.Concat(op.Softmax(z, axis=-1), op.Softmax(op.Neg(z), axis=-1), axis=-1)

    if options.window:
        *callees, kernel = kernels.windowed_kernel_attention_functions(
            opset_version, options.window, site.scale, site.mask.causal, window_next=options.window_next,
            sinks=options.sinks,
        )

        @script(ATTNREWRITE, default_opset=op)
        def WindowedHedgehog(q, k, v, key_keep, weight, bias, linear_log_weight):
            phi_q = HedgehogFeatures(q, weight, bias)
            phi_k = HedgehogFeatures(k, weight, bias) * key_keep
            return op.CastLike(kernel(phi_q, phi_k, q, k, v, key_keep, linear_log_weight), v)

        entry = WindowedHedgehog.to_function_proto()
        entry.name = "CausalWindowedHedgehog" if site.mask.causal else "WindowedHedgehog"
        functions = [HedgehogFeatures, *callees, kernel]
    else:
        if site.mask.causal:
            *callees, kernel = kernels.causal_linear_attention_functions(opset_version, options.chunk)
        else:
            *callees, kernel = kernels.linear_attention_functions(opset_version)

        @script(ATTNREWRITE, default_opset=op)
        def Hedgehog(q, k, v, key_keep, weight, bias):
            phi_q = HedgehogFeatures(q, weight, bias)
            phi_k = HedgehogFeatures(k, weight, bias) * key_keep
            out = kernel(flatten(phi_q), flatten(phi_k), flatten(v))
            out_shape = op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)
            return op.CastLike(op.Reshape(out, out_shape), v)

        entry = Hedgehog.to_function_proto()
        entry.name = "CausalHedgehog" if site.mask.causal else "Hedgehog"
        functions = [HedgehogFeatures, flatten, *callees, kernel]
    lowering = OnnxLowering([*(f.to_function_proto() for f in functions), entry], initial_values(site, options))
    return lowering.with_weights(weights)
