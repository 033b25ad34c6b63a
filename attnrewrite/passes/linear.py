"""Linear attention with the elu+1 feature map (Katharopoulos et al., 2020).

softmax(q k^T) is replaced by the kernel phi(q) phi(k)^T with phi(x) = elu(x) + 1, evaluated in
the reassociated order phi(Q) (phi(K)^T V): O(N) in sequence length. The logits' scale is not
applied: elu+1 is the kernel the method defines, not an estimate of exp(scale * q.k).

``window=W`` (passes/window/): exact softmax over the query's own block of W positions, the
previous one, the next one (bidirectional, ``window_next``) and the first ``sinks`` positions,
elu+1 over the rest, one normaliser; a per-head ``linear_log_weight`` (an nn.Parameter, 0 at
first) weighs the kernel part.

Causal linear attention is a recurrence (``recurrence``, passes/kernel/recurrence.py): its state
is sum phi(k) v^T and sum phi(k), with the window's last keys where it has one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
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
from attnrewrite.passes.kernel.query_key_maps import (
    map_queries_and_keys,
    query_key_map_values,
    with_learned_entry,
    with_query_key_maps,
)
from attnrewrite.passes.kernel.recurrence import KernelRecurrence
from attnrewrite.passes.layout import key_mask_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.passes.window import settings as window_settings
from attnrewrite.passes.window.lowering import windowed_kernel
from attnrewrite.passes.window.reference import feature_map_attention_weights
from attnrewrite.passes.window.settings import KernelUnit, Window
from attnrewrite.passes.window.torch_form import feature_map_attention
from attnrewrite.site import AttentionSite

NAME = "linear"


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))
    window: int = window_settings.window_option("linear")
    window_next: bool = window_settings.window_next_option()
    sinks: int = window_settings.sinks_option()
    sparse: int = window_settings.sparse_option()
    update: str = delta.update_option()


def attention_weights_unavailable(options: Options) -> str | None:
    # the module's attention_weights covers every other option
    return window_settings.sparse_weights_unavailable(options) or (
        delta.NO_WEIGHTS if delta.uses_delta(options) else None
    )


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by a kernel feature map"
    return window_settings.sparse_refusal(site, options) or delta.refusal(site, options)


nothing_to_fit = hooks.nothing_unfittable


exact_part = window_settings.exact_part


def elu_plus_one(x):
    return torch.nn.functional.elu(x.float()) + 1


class LinearAttention(Module):
    def __init__(
        self,
        causal: bool,
        chunk: int,
        scale: float = 1.0,
        window: Window | None = None,
        linear_log_weight=None,
        update: str = delta.ADDITIVE,
    ):
        super().__init__()
        self.causal = causal
        self.chunk = chunk
        self.update = update
        self.scale = scale  # of the window's exact softmax only
        self.window = window
        self.linear_log_weight = None
        if window is not None:
            self.linear_log_weight = torch.nn.Parameter(torch.from_numpy(linear_log_weight))

    def forward(self, q, k, v, key_keep=None):
        q, k = map_queries_and_keys(self, q, k)  # learnable modules' maps (window too)
        return feature_map_attention(self, elu_plus_one(q), elu_plus_one(k), q, k, v, key_keep).to(v.dtype)

    def attention_weights(self, q, k, key_keep=None):
        """The normalized weights [..., Nq, Nk] this module gives each key, N x N: for the
        fitter's attention-weight cross-entropy, never for inference."""
        q, k = map_queries_and_keys(self, q, k)
        return feature_map_attention_weights(self, elu_plus_one(q), elu_plus_one(k), q, k, key_keep)

    def extra_repr(self) -> str:
        said = f"causal={self.causal}, chunk={self.chunk}, update={self.update}"
        return said + window_settings.window_repr(self.window)


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> LinearAttention:
    """``learnable``: with identity query/key maps as parameters (query_key_maps.with_query_key_maps);
    the window's linear_log_weight is an nn.Parameter either way."""
    window, values = Window.of(options, site), LinearFeatureMap(options).fitted_values(site)
    log_weight = values.get("linear_log_weight")
    module = LinearAttention(site.mask.causal, options.chunk, site.scale, window, log_weight, options.update)
    return with_query_key_maps(module, site, learnable)


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (linear_log_weight; query_map and key_map of a
    learnable module, which select the Learned<Entry> function that applies them)."""
    if delta.uses_delta(options):
        return delta_rule_lowering(LinearFeatureMap(options), site, opset_version, weights)
    window = Window.of(options, site)
    if window is not None:
        functions = _windowed_functions(site, window, opset_version)
    else:
        functions = _plain_functions(site, options, opset_version)
    functions = with_learned_entry(functions, weights, opset_version)
    return OnnxLowering(functions, LinearFeatureMap(options).constants(site, weights))


def _plain_functions(site: AttentionSite, options: Options, opset_version: int) -> list[onnx.FunctionProto]:
    op = standard_opset(opset_version)
    phi = features_function(opset_version)
    kernel = kernel_attention_function(opset_version, site.mask.causal, options.chunk)
    keys = key_mask_function(opset_version, site.mask.key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def LinearAttention(q, k, v, key_keep):
        return kernel(phi(q), keys(phi(k), key_keep), v)

    return entry_functions(LinearAttention, "CausalLinearAttention" if site.mask.causal else None)


def _windowed_functions(site: AttentionSite, window: Window, opset_version: int) -> list[onnx.FunctionProto]:
    op = standard_opset(opset_version)
    phi = features_function(opset_version)
    window_inputs, kernel = windowed_kernel(window, site, opset_version, KernelUnit.SHARED)
    # bidirectional: a key that is not kept weighs 0 through its [v, 1] row, so phi_k needs no
    # product by keep; causal: only with key padding (the far sums read phi_k as it is)
    keys = key_mask_function(opset_version, site.mask.causal and site.mask.key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedLinearAttention(q, k, v, key_keep, linear_log_weight):
        q_in, k_in, keep = window_inputs(q, k, key_keep)
        return op.CastLike(kernel(phi(q_in), keys(phi(k_in), keep), q_in, k_in, v, keep, linear_log_weight), v)

    return entry_functions(WindowedLinearAttention, "CausalWindowedLinearAttention" if site.mask.causal else None)


@built_once
def features_function(opset_version: int):
    """LinearFeatures(x): elu(x) + 1 in float32, as elu_plus_one."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def LinearFeatures(x):
        return op.Elu(op.Cast(x, to=FLOAT)) + op.Constant(value_float=1.0)

    return LinearFeatures


# --- the recurrent form (passes/kernel/recurrence.py) ---------------------------------------------


class LinearFeatureMap(FeatureMap):
    """elu + 1, of q and k as they are (or as a learnable module's maps give them)."""

    entry = "LinearAttention"
    unit = KernelUnit.SHARED

    def feature_count(self, site: AttentionSite) -> int | str:
        return "F" if site.head_dim is None else site.head_dim

    def torch_terms(self, module: LinearAttention, q, k, keep) -> CausalTerms:
        return CausalTerms(elu_plus_one(q), elu_plus_one(k) * keep)

    def onnx_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """LinearCausalTerms(q, k, keep) -> (phi_q, phi_k), padded keys' features zero."""
        op = standard_opset(opset_version)
        phi = features_function(opset_version)

        @script(ATTNREWRITE, default_opset=op)
        def LinearCausalTerms(q, k, keep):
            return phi(q), phi(k) * keep

        return OnnxTerms(LinearCausalTerms)

    def onnx_query_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        return OnnxTerms(features_function(opset_version))

    def fitted_values(self, site: AttentionSite) -> dict[str, np.ndarray]:
        """The window's weight; a learnable module's query and key maps (query_key_maps) too,
        which join the constants only once fitted, with the Learned<Entry> that applies them."""
        return {"linear_log_weight": window_settings.initial_linear_log_weight(site)} if self.options.window else {}

    def constants(self, site: AttentionSite, weights: dict | None = None) -> dict:
        return {**super().constants(site, weights), **query_key_map_values(weights)}


def recurrence(options: Options) -> KernelRecurrence:
    return KernelRecurrence(LinearFeatureMap(options))
