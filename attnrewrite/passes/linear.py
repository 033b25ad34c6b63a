"""Linear attention with the elu+1 feature map (Katharopoulos et al., 2020).

softmax(q k^T) is replaced by the kernel phi(q) phi(k)^T with phi(x) = elu(x) + 1, evaluated in
the reassociated order phi(Q) (phi(K)^T V): O(N) in sequence length. The logits' scale is not
applied: elu+1 is the kernel the method defines, not an estimate of exp(scale * q.k).

``window=W`` (kernels.windowed_kernel_attention): exact softmax over the query's own block of W
positions, the previous one, the next one (bidirectional, ``window_next``) and the first
``sinks`` positions, elu+1 over the rest, one normaliser; a per-head ``linear_log_weight`` (an
nn.Parameter, 0 at first) weighs the kernel part.
"""

from __future__ import annotations

import dataclasses

from onnxscript import script

from attnrewrite.passes import kernels
from attnrewrite.passes._onnx import ATTNREWRITE, FLOAT, OnnxLowering, standard_opset, with_callees
from attnrewrite.passes._options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.passes._torch import Module, torch
from attnrewrite.site import AttentionSite

NAME = "linear"


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))
    window: int = option(
        0, "exact softmax over blocks of this many positions, linear beyond (0: off)", valid=AtLeast(0)
    )
    window_next: bool = kernels.window_next_option()
    sinks: int = kernels.sinks_option()


def attention_weights_unavailable(options: Options) -> str | None:
    return None  # the module's attention_weights covers every option, window included


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by a kernel feature map"
    return None


def exact_part(options: Options, causal: bool = False) -> kernels.ExactPart | None:
    """Softmax attention itself on short sequences only with a window (kernels.window_exact_part)."""
    return kernels.window_exact_part(options.window, options.window_next, options.sinks, causal)


def elu_plus_one(x):
    return torch.nn.functional.elu(x.float()) + 1


class LinearAttention(Module):
    def __init__(
        self,
        causal: bool,
        chunk: int,
        scale: float = 1.0,
        window: int = 0,
        window_next: bool = False,
        sinks: int = 0,
        linear_log_weight=None,
    ):
        super().__init__()
        self.causal = causal
        self.chunk = chunk
        self.scale = scale  # of the window's exact softmax only
        self.window, self.window_next, self.sinks = window, window_next, sinks
        self.linear_log_weight = None
        if window:
            self.linear_log_weight = torch.nn.Parameter(torch.from_numpy(linear_log_weight))

    def forward(self, q, k, v, key_keep=None):
        q, k = kernels.map_queries_and_keys(self, q, k)  # learnable modules' maps (window too)
        return kernels.feature_map_attention(self, elu_plus_one(q), elu_plus_one(k), q, k, v, key_keep).to(v.dtype)

    def attention_weights(self, q, k, key_keep=None):
        """The normalized weights [..., Nq, Nk] this module gives each key, N x N: for the
        fitter's attention-weight cross-entropy, never for inference."""
        q, k = kernels.map_queries_and_keys(self, q, k)
        return kernels.feature_map_attention_weights(self, elu_plus_one(q), elu_plus_one(k), q, k, key_keep)

    def extra_repr(self) -> str:
        window = kernels.window_repr(self)
        return f"causal={self.causal}, chunk={self.chunk}{window}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> LinearAttention:
    """``learnable``: with identity query/key maps as parameters (kernels.add_query_key_maps);
    the window's linear_log_weight is an nn.Parameter either way."""
    if not options.window:
        module = LinearAttention(site.mask.causal, options.chunk)
    else:
        log_weight = kernels.initial_linear_log_weight(site)
        module = LinearAttention(
            site.mask.causal,
            options.chunk,
            site.scale,
            options.window,
            options.window_next,
            options.sinks,
            log_weight,
        )
    if learnable:
        kernels.add_query_key_maps(module, site)
    return module


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (linear_log_weight; query_map and key_map of a
    learnable module, which select the Learned<Entry> function that applies them)."""
    if options.window:
        lowering = _windowed_lowering(site, options, opset_version).with_weights(weights)
    else:
        lowering = _plain_lowering(site, options, opset_version)
    if weights is None or kernels.QUERY_KEY_MAPS[0] not in weights:
        return lowering
    return kernels.with_query_key_maps(lowering, weights, opset_version)


def _plain_lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    op = standard_opset(opset_version)
    if site.mask.causal:
        *callees, kernel = kernels.causal_linear_attention_functions(opset_version, options.chunk)
    else:
        *callees, kernel = kernels.linear_attention_functions(opset_version)
    flatten = kernels.flatten_heads_function(opset_version)
    keys = kernels.key_mask_function(opset_version, site.mask.key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def LinearAttention(q, k, v, key_keep):
        one = op.Constant(value_float=1.0)
        phi_q = op.Elu(op.Cast(q, to=FLOAT)) + one
        phi_k = keys(op.Elu(op.Cast(k, to=FLOAT)) + one, key_keep)
        out = kernel(flatten(phi_q), flatten(phi_k), flatten(v))
        out_shape = op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)
        return op.CastLike(op.Reshape(out, out_shape), v)

    fn = LinearAttention.to_function_proto()
    if site.mask.causal:
        fn.name = "CausalLinearAttention"
    functions = [keys, flatten, *callees, kernel]
    return OnnxLowering([*(f.to_function_proto() for f in functions), fn])


def _windowed_lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    op = standard_opset(opset_version)
    kernel = kernels.windowed_kernel_attention_functions(
        opset_version,
        options.window,
        site.scale,
        site.mask.causal,
        window_next=options.window_next,
        sinks=options.sinks,
    )[-1]

    window_inputs = kernels.window_inputs_function(opset_version, options.window, site.mask.causal)
    # bidirectional: a key that is not kept weighs 0 through its [v, 1] row, so phi_k needs no
    # product by keep; causal: only with key padding (the far sums read phi_k as it is)
    keys = kernels.key_mask_function(opset_version, site.mask.causal and site.mask.key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedLinearAttention(q, k, v, key_keep, linear_log_weight):
        q_in, k_in, keep = window_inputs(q, k, key_keep)
        one = op.Constant(value_float=1.0)
        phi_q = op.Elu(op.Cast(q_in, to=FLOAT)) + one
        phi_k = keys(op.Elu(op.Cast(k_in, to=FLOAT)) + one, keep)
        return op.CastLike(kernel(phi_q, phi_k, q_in, k_in, v, keep, linear_log_weight), v)

    fn = WindowedLinearAttention.to_function_proto()
    if site.mask.causal:
        fn.name = "CausalWindowedLinearAttention"
    functions = [f.to_function_proto() for f in with_callees(WindowedLinearAttention)[:-1]]
    constants = {"linear_log_weight": kernels.initial_linear_log_weight(site)}
    return OnnxLowering([*functions, fn], constants)


def causal_terms_function(site: AttentionSite, options: Options, opset_version: int):
    """(function, its constants): what the causal form reads of q [..., N, d], k [..., N', d]
    and keep [..., N', 1] (passes/recurrent.py): LinearCausalTerms(q, k, keep) -> (phi_q,
    phi_k), padded keys' features zero."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def LinearCausalTerms(q, k, keep):
        one = op.Constant(value_float=1.0)
        return op.Elu(op.Cast(q, to=FLOAT)) + one, (op.Elu(op.Cast(k, to=FLOAT)) + one) * keep

    return LinearCausalTerms, ()
