"""FAVOR+: positive orthogonal random features (Choromanski et al., "Rethinking Attention with
Performers", ICLR 2021).

softmax(scale * q k^T) weighs key j for query i by SM(x_i, y_j) = exp(x_i . y_j) with
x = q * scale^(1/2) and y = k * scale^(1/2). For rows w_l of W ~ N(0, I_d),
E[exp(w.x - |x|^2/2) exp(w.y - |y|^2/2)] = exp(x.y), so phi(x) = exp(W x - |x|^2/2) / sqrt(m)
estimates SM without bias and with positive features only (no cancellation where SM is small,
unlike sin/cos features). The ``hyperbolic`` variant uses exp(+w.x) and exp(-w.x) halves.
Attention is then phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)): O(N * m * d).

W is drawn once, at rewrite time, from ``numpy.random.default_rng(seed)``: rows orthogonal in
blocks of d (QR of a Gaussian, Haar-distributed), row lengths chi(d)-distributed like a
Gaussian's (or fixed at sqrt(d): the regularized kernel). It is an initializer / a buffer and is
never redrawn.

Stabilizers (exp(w.x - |x|^2/2) overflows or underflows for large inputs): output row i is
num_i / den_i with num_i = sum_j (phi(x_i).phi(y_j)) v_j and den_i the same sum without v_j.
Dividing phi(x_i) by any constant of row i divides both sums by it, so it cancels: queries use
their own max over features (of the whole exponent w.x - |x|^2/2, so each row's largest feature
is exactly 1/sqrt(m): nothing overflows and never all of a row underflows; the ONNX body
leaves out the query's -|x|^2/2, one constant of the row, which that max takes out anyway). A
key constant cancels only if it is the same for every key in row i's sum; a per-key max would
reweigh the keys.
Bidirectional sites use one max over all kept keys and features of a head. Causal sites divide
each key by its own max (which reads nothing after it) and hand that max to the kernel as the
key's log scale; the kernel weighs key j in row i by exp(its max - r_i), r_i the running max over
keys 0..i (kernel.state.chunk_kernel_attention): exp(r_i) is one constant for row i, so it
cancels, and r_i never looks at the future. All of this runs in float32, whatever the model's
dtype.

``window=W`` (passes/window/): exact softmax over the query's own block of W
positions, the previous one, the next one (bidirectional, ``window_next``) and the first
``sinks`` positions, FAVOR+ over the rest, one normaliser. The exact part is in units of
e^(s_ij - m_i), m_i the row's max over its exact keys. FAVOR+ estimates e^(s_ij) itself, and its
stabilisers divide query i's features by e^(a_i) (a_i its row max) and key j's by e^(b_j) (the
head max, or its own max when causal): constants per row and per key, which a learned per-head
weight could not absorb. So the kernel gets a_i and b_j as log scales and weighs
phi_i.phi_j e^(a_i + b_j - m_i): the kernel part estimates e^(s_ij - m_i) exactly as the local
part computes it (without bias, in expectation over W), the hybrid with linear_log_weight = 0 is
an unbiased-per-term estimate of softmax attention, and a fitted linear_log_weight is a plain
per-head factor on top. (Causal: the far part's chunk states are re-referenced by the
two-level rescaled prefix of the causal kernel above; nothing reads a later key.)
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
from onnxscript import OnnxFunction, script

from attnrewrite.passes import hooks
from attnrewrite.passes.kernel import delta
from attnrewrite.passes.kernel.delta_onnx import delta_rule_lowering
from attnrewrite.passes.kernel.feature_map import (
    CausalTerms,
    FeatureMap,
    OnnxTerms,
    entry_functions,
    kernel_attention_function,
    rescaled_kernel_attention_function,
)
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE, RESCALED_EPS
from attnrewrite.passes.kernel.parallel import linear_attention
from attnrewrite.passes.kernel.random_features import default_features, draw_projection
from attnrewrite.passes.kernel.recurrence import KernelRecurrence
from attnrewrite.passes.kernel.state import chunk_kernel_attention
from attnrewrite.passes.layout import key_mask_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import AtLeast, MethodOptions, option
from attnrewrite.passes.window import settings as window_settings
from attnrewrite.passes.window.lowering import windowed_kernel
from attnrewrite.passes.window.settings import KernelScales, KernelUnit, Window
from attnrewrite.passes.window.torch_form import module_windowed_attention
from attnrewrite.site import AttentionSite

NAME = "favor"
WINDOWED_WEIGHTS = "favor with a window gives no attention weights"
VARIANTS = ("positive", "hyperbolic")
NORMS = ("chi", "fixed")
# The kernel part's unit: phi_q.phi_k e^(a_i + b_j) estimates e^(s_ij) (the module docstring)
UNIT = KernelUnit.LOG_SCALED
EPS = RESCALED_EPS  # stabilised denominators: kernel.numerics says why
LOWEST = LOWEST_LOG_SCALE


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    features: int | None = option(None, "m random features; None: round(d ln d) for head_dim d", valid=AtLeast(1))
    seed: int = option(0, "numpy default_rng seed W is drawn from", valid=AtLeast(0))
    variant: str = option(
        "positive", '"positive": exp(w.x); "hyperbolic": exp(+w.x), exp(-w.x) halves', choices=VARIANTS
    )
    orthogonal: bool = option(True, "rows orthogonal in blocks of d; False: independent rows")
    norms: str = option("chi", 'row lengths: "chi" (as a Gaussian\'s) or "fixed" at sqrt(d)', choices=NORMS)
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    window: int = window_settings.window_option("FAVOR+")
    window_next: bool = window_settings.window_next_option()
    sinks: int = window_settings.sinks_option()
    sparse: int = window_settings.sparse_option()
    update: str = delta.update_option()


def attention_weights_unavailable(options: Options) -> str | None:
    if delta.uses_delta(options):
        return delta.NO_WEIGHTS
    return WINDOWED_WEIGHTS if options.window else None


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by a kernel feature map"
    if site.head_dim is None:
        return "the head dimension is unknown, and W [features, head_dim] is drawn at rewrite time"
    if not site.scale > 0:
        return f"FAVOR+ folds scale^(1/2) into q and k and needs a positive scale, not {site.scale}"
    return window_settings.sparse_refusal(site, options) or delta.refusal(site, options)


nothing_to_fit = hooks.nothing_unfittable


exact_part = window_settings.exact_part


# --- random features -------------------------------------------------------------------------


def projection_for(site: AttentionSite, options: Options) -> np.ndarray:
    features = options.features or default_features(site.head_dim)
    return draw_projection(site.head_dim, features, options.seed, options.orthogonal, options.norms)


def feature_count(projection: np.ndarray, variant: str) -> int:
    """Features per token: m, or 2m for the hyperbolic variant's two halves."""
    return projection.shape[0] * (2 if variant == "hyperbolic" else 1)


# --- torch -----------------------------------------------------------------------------------


def log_features(x, projection, hyperbolic: bool = False):
    """log phi(x) + log sqrt(m): w.x - |x|^2/2 per feature, before any stabilizer."""
    wx = x @ projection.transpose(0, 1)
    if hyperbolic:
        wx = torch.cat([wx, -wx], dim=-1)
    return wx - x.square().sum(dim=-1, keepdim=True) / 2


def query_features(log_phi, norm: float):
    # Row max: a constant of the query row, it cancels between numerator and denominator.
    return torch.exp(log_phi - log_phi.amax(dim=-1, keepdim=True)) * norm


def kept_head_max(log_phi, key_keep):
    """The max over a head's kept keys and features ([..., 1, 1]; LOWEST if none is kept)."""
    kept = log_phi if key_keep is None else torch.where(key_keep > 0, log_phi, LOWEST)
    return kept.amax(dim=(-2, -1), keepdim=True)


def key_features(log_phi, key_keep, norm: float):
    """Bidirectional: one max over the head's kept keys and features, shared by every key."""
    head_max = kept_head_max(log_phi, key_keep)
    # Kept entries are <= head_max already; the clamp only keeps padded keys' exp finite.
    phi = torch.exp(torch.clamp_max(log_phi - head_max, 0.0)) * norm
    return phi if key_keep is None else phi * key_keep


def causal_key_features(log_phi, key_keep, norm: float):
    """Causal: each key over its own max, plus that max as the key's log scale for the kernel."""
    row_max = log_phi.amax(dim=-1, keepdim=True)
    phi = torch.exp(log_phi - row_max) * norm
    if key_keep is None:
        return phi, row_max
    # A padded key leaves the sums and must not raise the running max either.
    return phi * key_keep, torch.where(key_keep > 0, row_max, LOWEST)


class FavorAttention(Module):
    def __init__(
        self,
        projection,
        scale: float,
        causal: bool,
        chunk: int,
        variant: str,
        window: Window | None = None,
        linear_log_weight=None,
        learnable: bool = False,
        update: str = delta.ADDITIVE,
    ):
        super().__init__()
        self.update = update
        if learnable:  # calibration fits W, starting from the seeded draw
            self.projection = torch.nn.Parameter(projection)
        else:
            self.register_buffer("projection", projection)  # fixed at rewrite time, saved with it
        self.scale = scale
        self.root_scale = math.sqrt(scale)
        self.causal = causal
        self.chunk = chunk
        self.variant = variant
        self.norm = 1 / math.sqrt(feature_count(projection, variant))
        self.window = window
        self.linear_log_weight = None
        if window is not None:
            self.linear_log_weight = torch.nn.Parameter(torch.from_numpy(linear_log_weight))

    def log_features(self, q, k):
        """log_features of the queries and the keys, in float32 (even if the module was
        .half()-ed), scale^(1/2) on each side so that x.y are the original logits."""
        w, hyperbolic = self.projection.float(), self.variant == "hyperbolic"
        return tuple(log_features(x.float() * self.root_scale, w, hyperbolic) for x in (q, k))

    def forward(self, q, k, v, key_keep=None):
        keep = None if key_keep is None else key_keep.float()
        log_q, log_k = self.log_features(q, k)
        phi_q = query_features(log_q, self.norm)
        if self.window is not None:
            return self.windowed(phi_q, log_q, log_k, q, k, v, keep).to(v.dtype)
        if self.causal:
            phi_k, log_scale = causal_key_features(log_k, keep, self.norm)
            if self.update == delta.DELTA:  # normalised keys: their log scales drop out
                return delta.chunk_delta_attention(phi_q, phi_k, v, chunk=self.chunk)[0].to(v.dtype)
            out = chunk_kernel_attention(phi_q, phi_k, v.float(), log_scale, chunk=self.chunk, eps=EPS)[0]
        else:
            phi_k = key_features(log_k, keep, self.norm)
            out = linear_attention(phi_q, phi_k, v.float(), EPS)
        return out.to(v.dtype)

    def windowed(self, phi_q, log_q, log_k, q, k, v, keep):
        """The hybrid, with the stabilisers' log scales (the module docstring says why)."""
        if self.causal:
            phi_k, key_log_scale = causal_key_features(log_k, keep, self.norm)
        else:
            phi_k, key_log_scale = key_features(log_k, keep, self.norm), kept_head_max(log_k, keep)
        scales = KernelScales(self.linear_log_weight, log_q.amax(dim=-1, keepdim=True), key_log_scale)
        return module_windowed_attention(self, phi_q, phi_k, q, k, v, keep, scales, EPS)

    def attention_weights(self, q, k, key_keep=None):
        """The normalized weights [..., Nq, Nk] the features give each key, N x N: for the
        fitter's attention-weight cross-entropy, never for inference. phi(x_i).phi(y_j) =
        exp(a_i + b_j) phi'(x_i).phi'(y_j) with a_i, b_j each row's max log feature, so the
        product is taken in log space and nothing over- or underflows."""
        if self.window is not None or self.update == delta.DELTA:
            raise ValueError(WINDOWED_WEIGHTS if self.window is not None else delta.NO_WEIGHTS)
        log_q, log_k = self.log_features(q, k)
        q_max, k_max = log_q.amax(-1, keepdim=True), log_k.amax(-1, keepdim=True)
        product = torch.exp(log_q - q_max) @ torch.exp(log_k - k_max).transpose(-2, -1)
        log_scores = torch.log(product.clamp_min(1e-30)) + q_max + k_max.transpose(-2, -1)
        hidden = torch.zeros_like(log_scores, dtype=torch.bool)
        if key_keep is not None:
            hidden = hidden | (key_keep.transpose(-2, -1) == 0)
        if self.causal:
            hidden = hidden | torch.ones_like(hidden).triu(1)
        return torch.softmax(log_scores.masked_fill(hidden, LOWEST), dim=-1)

    def extra_repr(self) -> str:
        m, d = self.projection.shape
        return (
            f"features={m}, head_dim={d}, variant={self.variant}, causal={self.causal}, "
            f"chunk={self.chunk}, update={self.update}{window_settings.window_repr(self.window)}"
        )


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> FavorAttention:
    """``learnable``: the projection W is a parameter (calibration fits it), else a buffer."""
    values = FavorFeatureMap(options).fitted_values(site)
    projection, log_weight = torch.from_numpy(values["projection"]), values.get("linear_log_weight")
    return FavorAttention(
        projection,
        site.scale,
        site.mask.causal,
        options.chunk,
        options.variant,
        Window.of(options, site),
        log_weight,
        learnable,
        options.update,
    )


# --- ONNX ------------------------------------------------------------------------------------


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state (projection, linear_log_weight) as numpy arrays."""
    feature_map = FavorFeatureMap(options)
    if delta.uses_delta(options):
        return delta_rule_lowering(feature_map, site, opset_version, weights)
    terms = feature_map.onnx_phi(site, opset_version)
    window = Window.of(options, site)
    if window is not None:
        entry = _windowed_favor_function(window, site, opset_version, terms.both)
    elif site.mask.causal:
        entry = _causal_favor_function(opset_version, options.chunk, site.mask.key_padding, terms.both)
    else:
        entry = _favor_function(opset_version, site.mask.key_padding, terms.both)
    name = "CausalWindowedFavor" if window is not None and site.mask.causal else None
    return OnnxLowering(entry_functions(entry, name), feature_map.constants(site, weights))


@built_once
def _projection_functions(op, variant: str):
    """(project, HalfSquare): w.x per feature (PositiveProjection, or HyperbolicProjection's
    +w.x and -w.x halves) and |x|^2/2, the two parts of log_features."""

    @script(ATTNREWRITE, default_opset=op)
    def PositiveProjection(x, projection):
        return op.MatMul(x, op.Transpose(projection, perm=[1, 0]))

    @script(ATTNREWRITE, default_opset=op)
    def HyperbolicProjection(x, projection):
        wx = op.MatMul(x, op.Transpose(projection, perm=[1, 0]))
        return op.Concat(wx, op.Neg(wx), axis=-1)

    @script(ATTNREWRITE, default_opset=op)
    def HalfSquare(x):
        # |x|^2 as a last-axis ReduceSum of x * x: ReduceSumSquare (and any reduction CUDA
        # cannot treat as rows of a matrix) goes through cuDNN with a scratch copy of x * x
        return op.ReduceSum(x * x, op.Constant(value_ints=[-1]), keepdims=1) * op.Constant(value_float=0.5)

    return (HyperbolicProjection if variant == "hyperbolic" else PositiveProjection), HalfSquare


class OnnxPhi(typing.NamedTuple):
    """Favor's one ONNX phi (FavorFeatureMap.onnx_phi): ``queries`` (q, projection) -> (phi_q,
    query log scale); ``both`` (q, k, keep, projection) -> (phi_q, phi_k, query log scale, key
    log scale), phi_k not yet zeroed on padded keys."""

    queries: OnnxFunction
    both: OnnxFunction


@built_once
def _phi_functions(opset_version: int, variant: str, norm: float, root_scale: float, causal: bool) -> OnnxPhi:
    """As torch's log_features, query_features, key_features and causal_key_features, in float32
    of x = q * scale^(1/2) and y = k * scale^(1/2). log phi = w.x - |x|^2/2 and each stabiliser
    is one value per row, so each feature is w.x less one value per row, one subtraction: no
    [.., F] tensor of log features and no product by norm. Queries: over their row max, norm in
    their features. Keys: causal, each over its own max (nothing after it), norm in its features,
    the lowest log scale if it is not kept; bidirectional, over their head's max (kept_head_max)
    with norm in their log scale, and a key that is not kept over its own max, so that it stays
    finite without a clamp."""
    op = standard_opset(opset_version)
    project, half_square = _projection_functions(op, variant)
    log_norm, last = math.log(norm), [-1]

    @script(ATTNREWRITE, default_opset=op)
    def Scaled(x):
        # scale^(1/2) on each side, so that x.y are the original logits
        return op.Cast(x, to=FLOAT) * op.Constant(value_float=root_scale)

    @script(ATTNREWRITE, default_opset=op)
    def FavorQueryTerms(q, projection):
        x = Scaled(q)
        wx = project(x, op.Cast(projection, to=FLOAT))
        row_max = op.ReduceMax(wx, op.Constant(value_ints=last), keepdims=1)
        return op.Exp(wx - (row_max - op.Constant(value_float=log_norm))), row_max - half_square(x)

    @script(ATTNREWRITE, default_opset=op)
    def FavorTerms(q, k, keep, projection):
        phi_q, query_log_scale = FavorQueryTerms(q, projection)
        y = Scaled(k)
        wy, half_y = project(y, op.Cast(projection, to=FLOAT)), half_square(y)
        wy_max = op.ReduceMax(wy, op.Constant(value_ints=last), keepdims=1)
        kept = op.Greater(keep, op.Constant(value_float=0.0))
        kept_max = op.Where(kept, wy_max - half_y, op.Constant(value_float=LOWEST))
        head_max = op.ReduceMax(kept_max, op.Constant(value_ints=[-2]), keepdims=1)
        # never below the row's max of w.x, so that no feature exceeds 1 and nothing needs a clamp
        phi_k = op.Exp(wy - op.Where(kept, half_y + head_max, wy_max))
        return phi_q, phi_k, query_log_scale, head_max + op.Constant(value_float=log_norm)

    @script(ATTNREWRITE, default_opset=op)
    def FavorCausalTerms(q, k, keep, projection):
        phi_q, query_log_scale = FavorQueryTerms(q, projection)
        y = Scaled(k)
        wy = project(y, op.Cast(projection, to=FLOAT))
        row_max = op.ReduceMax(wy, op.Constant(value_ints=last), keepdims=1)
        phi_k = op.Exp(wy - (row_max - op.Constant(value_float=log_norm)))
        kept = op.Greater(keep, op.Constant(value_float=0.0))
        key_log_scale = op.Where(kept, row_max - half_square(y), op.Constant(value_float=LOWEST))
        return phi_q, phi_k, query_log_scale, key_log_scale

    return OnnxPhi(FavorQueryTerms, FavorCausalTerms if causal else FavorTerms)


@built_once
def _favor_function(opset_version: int, key_padding: bool, terms):
    """Favor(q, k, v, key_keep, projection): bidirectional FAVOR+ (kernel.parallel.linear_attention);
    the keys' shared stabiliser and norm, one constant, cancel, so their log scale is not read."""
    op = standard_opset(opset_version)
    kernel = kernel_attention_function(opset_version, False, 1, EPS)
    keys = key_mask_function(opset_version, key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def Favor(q, k, v, key_keep, projection):
        keep = op.Cast(key_keep, to=FLOAT)
        phi_q, phi_k, query_log_scale, key_log_scale = terms(q, k, keep, projection)
        return kernel(phi_q, keys(phi_k, keep), v)

    return Favor


@built_once
def _causal_favor_function(opset_version: int, chunk: int, key_padding: bool, terms):
    """CausalFavor(q, k, v, key_keep, projection): causal FAVOR+, each key at its own scale
    (kernel.state.chunk_kernel_attention)."""
    op = standard_opset(opset_version)
    kernel = rescaled_kernel_attention_function(opset_version, chunk, EPS)
    keys = key_mask_function(opset_version, key_padding)

    @script(ATTNREWRITE, default_opset=op)
    def CausalFavor(q, k, v, key_keep, projection):
        keep = op.Cast(key_keep, to=FLOAT)
        phi_q, phi_k, query_log_scale, key_log_scale = terms(q, k, keep, projection)
        return kernel(phi_q, keys(phi_k, keep), key_log_scale, v)

    return CausalFavor


def _windowed_favor_function(window: Window, site: AttentionSite, opset_version: int, terms):
    """WindowedFavor(q, k, v, key_keep, projection, linear_log_weight): the window hybrid with
    the stabilisers' log scales (the module docstring says why). A key that is not kept weighs 0
    through its values or, causal, its lowest log scale, so phi_k needs no product by keep."""
    op = standard_opset(opset_version)
    window_inputs, kernel = windowed_kernel(window, site, opset_version, UNIT)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedFavor(q, k, v, key_keep, projection, linear_log_weight):
        q_in, k_in, keep_in = window_inputs(q, k, key_keep)
        keep = op.Cast(keep_in, to=FLOAT)
        phi_q, phi_k, query_log_scale, key_log_scale = terms(q_in, k_in, keep, projection)
        out = kernel(phi_q, phi_k, query_log_scale, key_log_scale, q_in, k_in, v, keep, linear_log_weight)
        return op.CastLike(out, v)

    return WindowedFavor


# --- the recurrent form (passes/kernel/recurrence.py) ---------------------------------------------


class FavorFeatureMap(FeatureMap):
    """Causal FAVOR+: each query over its row max and each key over its own max
    (causal_key_features), the maxima as their log scales; window or not, its unit is UNIT."""

    entry = "Favor"
    unit = UNIT

    def feature_count(self, site: AttentionSite) -> int:
        return feature_count(projection_for(site, self.options), self.options.variant)

    def torch_terms(self, module: FavorAttention, q, k, keep) -> CausalTerms:
        log_q, log_k = module.log_features(q, k)
        phi_k, key_log_scale = causal_key_features(log_k, keep, module.norm)
        query_log_scale = log_q.amax(dim=-1, keepdim=True)
        return CausalTerms(query_features(log_q, module.norm), phi_k, query_log_scale, key_log_scale)

    def onnx_phi(self, site: AttentionSite, opset_version: int) -> OnnxPhi:
        """Favor's one ONNX phi at ``site``, which every form calls (_phi_functions)."""
        norm = 1 / math.sqrt(self.feature_count(site))
        return _phi_functions(opset_version, self.options.variant, norm, math.sqrt(site.scale), site.mask.causal)

    def onnx_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """FavorCausalKeptTerms(q, k, keep, projection) -> (phi_q, phi_k, query log scale, key
        log scale), as torch_terms: onnx_phi's, padded keys' phi_k zero."""
        op = standard_opset(opset_version)
        terms, keys = self.onnx_phi(site, opset_version).both, key_mask_function(opset_version, True)

        @script(ATTNREWRITE, default_opset=op)
        def FavorCausalKeptTerms(q, k, keep, projection):
            phi_q, phi_k, query_log_scale, key_log_scale = terms(q, k, keep, projection)
            return phi_q, keys(phi_k, keep), query_log_scale, key_log_scale

        return OnnxTerms(FavorCausalKeptTerms, ("projection",))

    def onnx_query_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """FavorQueryTerms(q, projection) -> (phi_q, query log scale): onnx_phi's."""
        return OnnxTerms(self.onnx_phi(site, opset_version).queries, ("projection",))

    def fitted_values(self, site: AttentionSite) -> dict[str, np.ndarray]:
        """The seeded projection (a parameter only of a learnable module) and the window's weight."""
        values = {"projection": projection_for(site, self.options)}
        if self.options.window:
            values["linear_log_weight"] = window_settings.initial_linear_log_weight(site)
        return values


def recurrence(options: Options) -> KernelRecurrence:
    """Causal FAVOR+ is a recurrence over its features' sums, relative to the max of the
    absorbed keys' log scales (carried in the state)."""
    return KernelRecurrence(FavorFeatureMap(options))
