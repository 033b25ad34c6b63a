"""Per-feature sums over keys, shared by AFT (aft.py) and Efficient Attention (efficient.py).

Both weigh key t' in feature c by exp(x[t', c]) and normalise over keys per feature, which no
q.k kernel expresses: the sums are elementwise in the feature, [..., N, F], never [F, Dv].

- Stabiliser: x - m with m the per-feature max over the kept keys of the call, so every weight
  is <= 1 and the largest is 1; it cancels exactly between a numerator and its denominator. In a
  causal form m also reads later keys: only its rounding depends on them, and a row loses its
  sums (to 0, never NaN) only where a later key exceeds every earlier one of that feature by
  more than ~87 (e^-87 underflows float32), which no scaled key of a trained model comes near.
- Causal prefix sums without a CumSum along positions (quadratic on onnxruntime's CUDA:
  kernel/chunks.py): inside chunks a product with a lower-triangular [chunk, chunk] block,
  across chunks kernel.chunks' ExclusivePrefixSum (a bounded two-level hierarchy). Memory O(N * F).
"""

from __future__ import annotations

import math

from onnxscript import script

from attnrewrite.passes.kernel.chunks import exclusive_prefix_sum_function
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.layout import fitted_heads
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, standard_opset
from attnrewrite.passes.optional_torch import torch

LOWEST = LOWEST_LOG_SCALE  # a padded key's logit
# The lowest reference m: above LOWEST, so a padded key's weight exp(LOWEST - m) is 0 even where
# every key is padded (m would be LOWEST, and the weight 1).
NO_KEY = LOWEST / 2
TINY = 1e-30  # a denominator's floor: 0 only where every key is padded (0 / TINY = 0)


# --- torch -----------------------------------------------------------------------------------


def masked_logits(logits, keep):
    """logits [..., N, F] with padded keys (keep [..., N, 1] == 0) at LOWEST; keep None: all kept."""
    return logits if keep is None else torch.where(keep > 0, logits, LOWEST)


def reference(masked, past=None):
    """m [..., 1, F]: the per-feature max over the kept keys' logits (and ``past``, a state's
    reference [..., 1, F]), never below NO_KEY."""
    m = masked.amax(dim=-2, keepdim=True).clamp_min(NO_KEY)
    return m if past is None else torch.maximum(past, m)


def key_weights(masked):
    """exp(masked - m): 0 on padded keys, <= 1 on kept ones, the largest 1."""
    return torch.exp(masked - reference(masked))


def causal_feature_sums(x, chunk: int):
    """Inclusive prefix sums of x [..., N, F] along positions, chunked as the ONNX function."""
    lead, n, f = x.shape[:-2], x.shape[-2], x.shape[-1]
    c = max(min(chunk, n), 1)
    chunks = -(-n // c)
    x4 = torch.nn.functional.pad(x.reshape(-1, n, f), (0, 0, 0, chunks * c - n)).reshape(-1, chunks, c, f)
    within = torch.ones(c, c, dtype=x.dtype, device=x.device).tril() @ x4
    totals = x4.sum(dim=2)  # [G, chunks, F]
    before = torch.cumsum(torch.nn.functional.pad(totals, (0, 0, 1, 0))[:, :-1], dim=1)  # over chunks only
    sums = (within + before.unsqueeze(2)).reshape(-1, chunks * c, f)[:, :n]
    return sums.reshape(*lead, n, f)


# --- ONNX ------------------------------------------------------------------------------------


@built_once
def masked_logits_function(opset_version: int, key_padding: bool):
    """MaskedLogits(logits, key_keep) as masked_logits; AllLogits (no select) without key padding."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def MaskedLogits(logits, key_keep):
        return op.Where(key_keep > op.Constant(value_float=0.0), logits, op.Constant(value_float=LOWEST))

    @script(ATTNREWRITE, default_opset=op)
    def AllLogits(logits, key_keep):
        return op.Identity(logits)

    return MaskedLogits if key_padding else AllLogits


@built_once
def reference_function(opset_version: int):
    """Reference(masked): reference() without a past."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def Reference(masked):
        return op.Max(op.ReduceMax(masked, op.Constant(value_ints=[-2]), keepdims=1), op.Constant(value_float=NO_KEY))

    return Reference


@built_once
def causal_feature_sums_function(opset_version: int, chunk: int):
    """CausalFeatureSums(x): causal_feature_sums of x [..., N, F] (float32), no CumSum."""
    op = standard_opset(opset_version)
    prefix_sum = exclusive_prefix_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalFeatureSums(x):
        n = op.Shape(x, start=-2, end=-1)
        f = op.Shape(x, start=-1)
        zero, one, minus_one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[-1])
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        c = op.Max(op.Min(op.Constant(value_ints=[chunk]), n), one)
        chunks = op.Div(n + c - one, c)
        flat = op.Reshape(x, op.Concat(minus_one, n, f, axis=0))
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        x4 = op.Reshape(op.Pad(flat, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        lower = op.Trilu(op.Expand(op.Constant(value_float=1.0), op.Concat(c, c, axis=0)), upper=0)
        within = op.MatMul(lower, x4)
        before = prefix_sum(op.ReduceSum(x4, op.Constant(value_ints=[2]), keepdims=0))  # [G, chunks, F]
        sums = op.Reshape(
            within + op.Unsqueeze(before, op.Constant(value_ints=[2])), op.Concat(minus_one, chunks * c, f, axis=0)
        )
        return op.Reshape(op.Slice(sums, zero, n, one), op.Shape(x))

    return CausalFeatureSums


def head_value_shape(site) -> tuple[int, int, int]:
    """[heads, 1, head_dim] for a fitted per-head, per-feature value (1 where unknown): it
    broadcasts against q and k [..., heads, N, head_dim] and [G, N, head_dim] alike."""
    return fitted_heads(site), 1, site.head_dim or 1


def site_scale(site) -> float | None:
    """The logits' scale: the site's, else 1/sqrt(head_dim) (a torch graph without one); None
    where neither is known."""
    if site.scale is not None:
        return float(site.scale)
    return 1 / math.sqrt(site.head_dim) if site.head_dim else None
