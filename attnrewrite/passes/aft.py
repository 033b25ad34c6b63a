"""AFT, the Attention Free Transformer (Zhai et al., 2021), from a site's q, k and v.

Per feature c, Y[t, c] = sigmoid(Q[t, c]) * sum_t' exp(K[t', c] + w[t, t']) V[t', c] /
sum_t' exp(K[t', c] + w[t, t']): keys are weighed by their own features, never by q.k, so the
values need the keys' width. O(N * d) time and memory.

- ``variant=simple``: no w; one weighted mean of the values per feature (causal: of the values
  so far, a prefix sum; feature_sums.py says how it is chunked and stabilised).
- ``variant=local``: w[t, t'] = position_bias[t - t'] for |t - t'| < span, 0 beyond (the paper's
  AFT-local, with w a function of the offset as in AFT-conv, so one parameter serves every
  length), per head. The band is a product over blocks of ``span`` positions with the block
  before and after ([span, 3 * span] per block; causal: before only), exp(w) - 1 added to the
  simple sums, so memory stays O(N * d) and w = 0 is AFT-simple exactly.

Zero-shot: AFT computes another function than the softmax it replaces, so the values are chosen
to keep it near: Q = gate_scale * q + gate_bias (1 and 0: the paper's sigmoid(q) gate) and
K = key_scale * k with key_scale the site's logit scale, which keeps exp(K) as flat as the
model's own logits are. On all-MiniLM-L6 (held-out mean embedding cosine, bench/fidelity.py):
key_scale = scale 0.589, sqrt(scale) 0.586, 0 (a plain mean of v) 0.584, 1 (raw keys) 0.542;
the key weights matter little next to the gate, sigmoid(q) (about 0.5 where q is small), which
scales every output down until calibration fits it (bench/FIDELITY.md "AFT and Efficient
Attention").
Calibration (passes/fit.py) fits all of them, per head and feature ([heads, 1, head_dim]), and
``position_bias`` ([heads, 2 * span - 1], 0 at first; offset o = t - t' at index o + span - 1,
the later keys' half unused by causal sites). Fitted values are the lowering's initializers,
named as the module's state_dict entries.

Key padding: padded keys leave every sum (their logits are the lowest float). Causal AFT-simple
also has a recurrent form for decoders (below, and passes/recurrent.py): a state of
numerator, denominator and their per-feature max, [B, H, d] each.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnxscript import script

from attnrewrite.passes import feature_sums, hooks, recurrent
from attnrewrite.passes.feature_sums import TINY
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.layout import sequence_sum_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    FLOAT,
    OnnxLowering,
    built_once,
    standard_opset,
    weighted,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.passes.recurrent import RecurrentLowering
from attnrewrite.site import AttentionSite

NAME = "aft"
# calibration has values to fit, no length is exact, no attention weights (passes/hooks.py)
nothing_to_fit, exact_part, attention_weights_unavailable = hooks.none_apply(NAME)
VARIANTS = ("simple", "local")
NO_WINDOW = (
    "AFT weighs keys by exp(k) per feature, not by q.k: there is no softmax to keep exact "
    "(variant=local is its own local part)"
)


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    variant: str = option(
        "simple", "simple: no position bias; local: a fitted bias w[t - t'] within span", choices=VARIANTS
    )
    span: int = option(16, "variant=local: keys with |t - t'| < span get the bias w[t - t']", valid=AtLeast(1))
    chunk: int = option(64, "causal prefix-sum block length", valid=AtLeast(1))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))

    @property
    def local(self) -> bool:
        return self.variant == "local"


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by AFT's per-feature key weights"
    if site.head_dim is not None and site.value_dim is not None and site.head_dim != site.value_dim:
        return (
            f"AFT weighs each value feature by its key feature: key dim {site.head_dim} != value dim {site.value_dim}"
        )
    if feature_sums.site_scale(site) is None:
        return "the logits' scale is unknown, and AFT's keys start from it"
    return None


def initial_values(site: AttentionSite, options: Options) -> dict[str, np.ndarray]:
    """The fittable values before calibration: sigmoid(q) gate, keys at the site's scale, w = 0."""
    shape = feature_sums.head_value_shape(site)
    values = {
        "key_scale": np.full(shape, feature_sums.site_scale(site), np.float32),
        "gate_scale": np.ones(shape, np.float32),
        "gate_bias": np.zeros(shape, np.float32),
    }
    if options.local:
        values["position_bias"] = np.zeros((shape[0], 2 * options.span - 1), np.float32)
    return values


def band_layout(span: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(index, valid), each [span, blocks * span]: for query i of a block and key j of the
    blocks before, at (and after, bidirectional) it, the offset t - t' = span + i - j as an index
    into position_bias, and whether |t - t'| < span (and t' <= t, causal)."""
    blocks = 2 if causal else 3
    offset = span + np.arange(span)[:, None] - np.arange(blocks * span)[None, :]
    valid = (np.abs(offset) < span) & ((offset >= 0) | (not causal))
    return np.clip(offset + span - 1, 0, 2 * span - 2).astype(np.int64), valid


# --- torch -----------------------------------------------------------------------------------


def band_matrix(position_bias, span: int, causal: bool):
    """exp(w) - 1 on the band, 0 off it: [heads, 1, span, blocks * span]."""
    index, valid = (torch.from_numpy(a).to(position_bias.device) for a in band_layout(span, causal))
    return torch.where(valid, torch.exp(position_bias[:, index]) - 1, 0.0).unsqueeze(1)


def band_sums(x, band, span: int, causal: bool):
    """sum over keys t' within the band of band[t, t'] * x[t'], for x [..., N, F]."""
    lead, n, f = x.shape[:-2], x.shape[-2], x.shape[-1]
    chunks = -(-n // span)
    x4 = torch.nn.functional.pad(x, (0, 0, 0, chunks * span - n)).reshape(*lead, chunks, span, f)
    before = torch.nn.functional.pad(x4, (0, 0, 0, 0, 1, 0))[..., :-1, :, :]
    after = torch.nn.functional.pad(x4, (0, 0, 0, 0, 0, 1))[..., 1:, :, :]
    neighbours = torch.cat([before, x4] if causal else [before, x4, after], dim=-2)
    return (band @ neighbours).reshape(*lead, chunks * span, f)[..., :n, :]


class AftAttention(Module):
    """forward(q, k, v, key_keep=None) -> [..., N, d]; its values are named as the lowering's
    constants (parameters when learnable, else buffers)."""

    def __init__(self, causal: bool, options: Options, values: dict[str, np.ndarray], learnable: bool = False):
        super().__init__()
        self.causal, self.chunk, self.span = causal, options.chunk, options.span
        for name, value in values.items():
            tensor = torch.from_numpy(value)
            if learnable or name == "position_bias":
                self.register_parameter(name, torch.nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)

    @property
    def local(self) -> bool:
        return hasattr(self, "position_bias")

    def gate(self, q):
        return torch.sigmoid(q.float() * self.gate_scale + self.gate_bias)

    def masked_logits(self, k, key_keep):
        keep = None if key_keep is None else key_keep.float()
        return feature_sums.masked_logits(k.float() * self.key_scale, keep)

    def forward(self, q, k, v, key_keep=None):
        masked = self.masked_logits(k, key_keep)
        w = feature_sums.key_weights(masked)
        wv = w * v.float()
        if self.causal:
            numerator, denominator = (feature_sums.causal_feature_sums(x, self.chunk) for x in (wv, w))
        else:
            numerator, denominator = wv.sum(dim=-2, keepdim=True), w.sum(dim=-2, keepdim=True)
        if self.local:
            band = band_matrix(self.position_bias, self.span, self.causal)
            numerator = numerator + band_sums(wv, band, self.span, self.causal)
            denominator = denominator + band_sums(w, band, self.span, self.causal)
        return (self.gate(q) * numerator / denominator.clamp_min(TINY)).to(v.dtype)

    def extra_repr(self) -> str:
        local = f", span={self.span}" if self.local else ""
        return f"causal={self.causal}, chunk={self.chunk}{local}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> AftAttention:
    """``learnable``: the gate and key values are parameters too (position_bias always is)."""
    return AftAttention(site.mask.causal, options, initial_values(site, options), learnable)


# --- ONNX ------------------------------------------------------------------------------------


@built_once
def gate_function(opset_version: int):
    """Gate(q, gate_scale, gate_bias): sigmoid(gate_scale * q + gate_bias), float32."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def Gate(q, gate_scale, gate_bias):
        return op.Sigmoid(op.Cast(q, to=FLOAT) * gate_scale + gate_bias)

    return Gate


@built_once
def _band_functions(op, span: int, causal: bool):
    """(BandMatrix(position_bias), BandSums(x, band)) as band_matrix and band_sums."""
    index, valid = band_layout(span, causal)
    index_tensor = onnx.numpy_helper.from_array(index, "index")
    valid_tensor = onnx.numpy_helper.from_array(valid, "valid")

    @script(ATTNREWRITE, default_opset=op)
    def BandMatrix(position_bias):
        bias = op.Gather(position_bias, op.Constant(value=index_tensor), axis=1)  # [heads, span, blocks * span]
        band = op.Where(
            op.Constant(value=valid_tensor), op.Exp(bias) - op.Constant(value_float=1.0), op.Constant(value_float=0.0)
        )
        return op.Unsqueeze(band, op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def SpanBlocks(x, band):
        """[..., N, F] -> [..., N/span, span, F], zero-padded at the end."""
        n, f = op.Shape(x, start=-2, end=-1), op.Shape(x, start=-1)
        s = op.Shape(band, start=-2, end=-1)
        zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        chunks = op.Div(n + s - one, s)
        padded = op.Pad(
            x, op.Concat(zero, chunks * s - n, axis=0), op.Constant(value_float=0.0), op.Constant(value_ints=[-2])
        )
        return op.Reshape(padded, op.Concat(op.Shape(x, end=-2), chunks, s, f, axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def MovedBlocks(x4, pads, start):
        """Each block's neighbour along the blocks axis (pads [1, 0], start 0: the one before;
        [0, 1], 1: the one after), zeros where there is none."""
        blocks_axis = op.Constant(value_ints=[-3])
        chunks = op.Shape(x4, start=-3, end=-2)
        return op.Slice(op.Pad(x4, pads, op.Constant(value_float=0.0), blocks_axis), start, chunks + start, blocks_axis)

    @script(ATTNREWRITE, default_opset=op)
    def BandProduct(band, neighbours, x):
        """band [.., span, k * span] times each block's neighbours, back to x's [..., N, F]."""
        flat = op.Concat(op.Shape(x, end=-2), op.Constant(value_ints=[-1]), op.Shape(x, start=-1), axis=0)
        out = op.Reshape(op.MatMul(band, neighbours), flat)
        return op.Slice(out, op.Constant(value_ints=[0]), op.Shape(x, start=-2, end=-1), op.Constant(value_ints=[-2]))

    @script(ATTNREWRITE, default_opset=op)
    def BandSums(x, band):
        x4 = SpanBlocks(x, band)
        zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        before = MovedBlocks(x4, op.Constant(value_ints=[1, 0]), zero)
        after = MovedBlocks(x4, op.Constant(value_ints=[0, 1]), one)
        return BandProduct(band, op.Concat(before, x4, after, axis=-2), x)

    @script(ATTNREWRITE, default_opset=op)
    def CausalBandSums(x, band):
        x4 = SpanBlocks(x, band)
        before = MovedBlocks(x4, op.Constant(value_ints=[1, 0]), op.Constant(value_ints=[0]))
        return BandProduct(band, op.Concat(before, x4, axis=-2), x)

    return BandMatrix, CausalBandSums if causal else BandSums


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state, replacing the initial values of the same names."""
    op = standard_opset(opset_version)
    causal = site.mask.causal
    masked_logits = feature_sums.masked_logits_function(opset_version, site.mask.key_padding)
    gate = gate_function(opset_version)
    reference = feature_sums.reference_function(opset_version)
    if causal:
        key_sums = feature_sums.causal_feature_sums_function(opset_version, options.chunk)
    else:
        key_sums = sequence_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeyWeights(k, v, key_keep, key_scale):
        """(w, w * v): exp(K - its per-feature max over kept keys), 0 on padded keys."""
        masked = masked_logits(op.Cast(k, to=FLOAT) * key_scale, key_keep)
        w = op.Exp(masked - reference(masked))
        return w, w * op.Cast(v, to=FLOAT)

    @script(ATTNREWRITE, default_opset=op)
    def AftSimple(q, k, v, key_keep, key_scale, gate_scale, gate_bias):
        w, wv = KeyWeights(k, v, key_keep, key_scale)
        tiny = op.Constant(value_float=TINY)
        return op.CastLike(gate(q, gate_scale, gate_bias) * key_sums(wv) / op.Max(key_sums(w), tiny), v)

    band_matrix_fn, band_sums_fn = _band_functions(op, options.span, causal)

    @script(ATTNREWRITE, default_opset=op)
    def AftLocal(q, k, v, key_keep, key_scale, gate_scale, gate_bias, position_bias):
        w, wv = KeyWeights(k, v, key_keep, key_scale)
        band = band_matrix_fn(position_bias)
        numerator = key_sums(wv) + band_sums_fn(wv, band)
        denominator = key_sums(w) + band_sums_fn(w, band)
        tiny = op.Constant(value_float=TINY)
        return op.CastLike(gate(q, gate_scale, gate_bias) * numerator / op.Max(denominator, tiny), v)

    entry = AftLocal if options.local else AftSimple
    functions = [f.to_function_proto() for f in with_callees(entry)]
    if causal:
        functions[-1].name = "Causal" + functions[-1].name
    return OnnxLowering(functions, initial_values(site, options)).with_weights(weights)


# --- the recurrent form (passes/recurrent.py) -----------------------------------------------------
# Causal AFT-simple is a recurrence per feature: ``numerator`` sum exp(K - m) V, ``denominator``
# sum exp(K - m) and ``key_max`` m, their per-feature reference (the max of the absorbed keys'
# logits), [B, H, D] each.

LOCAL_REFUSAL = (
    "AFT-local's position bias reaches span - 1 keys back, which a recurrent form would have to keep "
    "as well; only variant=simple is a recurrence here"
)


def recurrence(options: Options) -> recurrent.Recurrence | str:
    """Causal AFT-simple's recurrence, or why variant=local has none."""
    return LOCAL_REFUSAL if options.local else _Recurrence(options)


@dataclasses.dataclass(frozen=True)
class _Recurrence(recurrent.Recurrence):
    options: Options

    def state(self, site: AttentionSite) -> list[recurrent.StateTensor]:
        return _state(site)

    def torch_module(self, site: AttentionSite, parallel) -> RecurrentAft:
        return RecurrentAft(parallel, _state(site))

    def onnx_lowering(
        self, site: AttentionSite, opset_version: int, weights: dict | None = None, contrib_ops: bool = False
    ) -> recurrent.RecurrentLowering:
        return _recurrent_lowering(site, self.options, opset_version, weights)


def _state(site: AttentionSite) -> list[recurrent.StateTensor]:
    lead, state = recurrent.leading_axes(site), recurrent.StateTensor
    return [
        state("numerator", (*lead, "D"), "float32", 0.0, "sum of exp(K - key_max) V over absorbed keys"),
        state("denominator", (*lead, "D"), "float32", 0.0, "sum of exp(K - key_max) over absorbed keys"),
        state("key_max", (*lead, "D"), "float32", LOWEST_LOG_SCALE, "per-feature max of absorbed K: their reference"),
    ]


class RecurrentAft(Module):
    """forward(q, k, v, key_keep, numerator, denominator, key_max) -> (out, numerator,
    denominator, key_max): causal AFT-simple continued from the state. The reference is the max
    over the state's and the new keys' logits (an all-zero state is the empty one: nothing
    absorbed where the denominator is 0), so from the empty state it is the parallel form's."""

    def __init__(self, parallel, description: list[recurrent.StateTensor]):
        super().__init__()
        self.parallel = parallel  # aft.AftAttention: its values, fitted or not
        self.description = description

    def forward(self, q, k, v, key_keep, numerator, denominator, key_max):
        masked = self.parallel.masked_logits(k, key_keep)
        past = torch.where(denominator > 0, key_max, LOWEST_LOG_SCALE).unsqueeze(-2)
        reference = feature_sums.reference(masked, past)
        held, w = torch.exp(past - reference), torch.exp(masked - reference)
        chunk = self.parallel.chunk
        numerator = feature_sums.causal_feature_sums(w * v.float(), chunk) + held * numerator.unsqueeze(-2)
        denominator = feature_sums.causal_feature_sums(w, chunk) + held * denominator.unsqueeze(-2)
        out = self.parallel.gate(q) * numerator / denominator.clamp_min(feature_sums.TINY)
        return out.to(v.dtype), numerator[..., -1, :], denominator[..., -1, :], reference.squeeze(-2)

    def initial_state(self, q, v) -> tuple:
        """The empty state for queries shaped like q."""
        shape = (*q.shape[:-2], q.shape[-1])
        return tuple(torch.full(shape, t.initial, dtype=torch.float32, device=q.device) for t in self.description)

    def extra_repr(self) -> str:
        return f"method=aft, state={[t.name for t in self.description]}"


def _recurrent_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None
) -> RecurrentLowering:
    """RecurrentAft as ONNX: (q, k, v, key_keep, numerator, denominator, key_max, key_scale,
    gate_scale, gate_bias) -> (out, *state after), the constants the parallel lowering's."""
    op = standard_opset(opset_version)
    constants = weighted(initial_values(site, options), weights)
    masked_logits = feature_sums.masked_logits_function(opset_version, key_padding=True)
    prefix_sums = feature_sums.causal_feature_sums_function(opset_version, options.chunk)
    gate = gate_function(opset_version)
    reference_of = feature_sums.reference_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentAft(q, k, v, key_keep, numerator, denominator, key_max, key_scale, gate_scale, gate_bias):
        rows = op.Constant(value_ints=[-2])
        masked = masked_logits(op.Cast(k, to=FLOAT) * key_scale, key_keep)
        absorbed = op.Where(
            denominator > op.Constant(value_float=0.0), key_max, op.Constant(value_float=LOWEST_LOG_SCALE)
        )
        past = op.Unsqueeze(absorbed, rows)
        reference = op.Max(past, reference_of(masked))
        held = op.Exp(past - reference)
        w = op.Exp(masked - reference)
        numerator_out = prefix_sums(w * op.Cast(v, to=FLOAT)) + held * op.Unsqueeze(numerator, rows)
        denominator_out = prefix_sums(w) + held * op.Unsqueeze(denominator, rows)
        ratio = numerator_out / op.Max(denominator_out, op.Constant(value_float=feature_sums.TINY))
        last = op.Constant(value_int=-1)
        return (
            op.CastLike(gate(q, gate_scale, gate_bias) * ratio, v),
            op.Gather(numerator_out, last, axis=-2),
            op.Gather(denominator_out, last, axis=-2),
            op.Squeeze(reference, rows),
        )

    functions = [f.to_function_proto() for f in with_callees(RecurrentAft)]
    return RecurrentLowering(functions, constants, _state(site))
