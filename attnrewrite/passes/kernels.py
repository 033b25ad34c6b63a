"""Kernelized attention out = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)), in both lowerings.

Feature maps are computed by each pass; these pieces only contract them. The causal form is a
chunked prefix sum: within a chunk a masked (chunk x chunk) product, across chunks an exclusive
prefix sum of per-chunk key-value states, so memory stays O(N*F + N/chunk * F*Dv) instead of
the O(N*F*Dv) of a per-position prefix sum. The ONNX bodies take no CumSum along an axis that
grows with N (onnxruntime's CUDA CumSum sums each output's whole prefix: O(L^2) along an axis
of length L): prefix sums and the rescaled carry go through bounded-depth hierarchies of
triangular products (ExclusivePrefixSum, rescaled_prefix_functions). The torch forms (what the
FX frontend and calibration run) keep torch.cumsum, a running sum, and nest the rescaled carry
two levels deep as the ONNX form does (_rescaled_prefix_sum): neither is quadratic in N.

The window hybrid (``window=W`` of linear, favor, hedgehog) is here too, once per lowering:
exact softmax over each query's block of W positions, the previous block, the next one
(bidirectional, ``window_next``) and the first ``sinks`` positions, the kernel over the other
keys, one shared normaliser (windowed_kernel_attention). Its blocks decide which keys are
exact, so both lowerings lay them out alike; windowed_attention_weights writes the same thing
as an N x N matrix, for fitting losses and tests.

A bidirectional window keeps no state per block and copies no block: one state for the whole
sequence, [S, z] = sum_j phi_k_j [v_j, 1]^T (keys that are not kept: [v_j, 1] = 0), and the
kernel terms of each query's exact keys (local, and the sinks it takes) taken back out inside
the exact part's weights, one product with their values:
    sums_i = sum_exact (e^(s_ij - shift_i) - b_i phi_q_i.phi_k_j) [v_j, 1] + b_i phi_q_i.[S, z]
(shift_i the row's max exact logit plus the part of the two units' log ratio that scales the
exact part, b_i the kernel part's share; the last column is the denominator). The local keys are
laid out in pairs of blocks, a reshape of the rows (q and k are padded into them before the
feature maps, window_inputs_function), and each block's neighbour outside its pair, one gather
of whole blocks (see the comment above _pair_structure). What is left after the subtraction
keeps the rounding of the whole sum, so row i's output moves by up to about
    eps32 * sum_{j exact} K_ij |v_j| / D_i
beyond a per-block state's (K_ij the kernel weight in the output's units, D_i the row's
normaliser): small where a kernel is in the exact part's units (fitted hedgehog, favor: on
MiniLM's q, k, v at N = 256..4096 every form is within 2e-6 of the float64 definition,
bench/window_rounding.md), large only where unit-free local kernel terms outweigh the exact part
and a row has almost no far key (N near 3W). A block without any far block gives exactly 0 far
part (b_i = 0). Superblock states (exact, no cancellation) cost a [W, 3P] masked kernel-score
block per query block for superblocks of P positions: several times the work, for no rounding
gain measurable on MiniLM. The torch form (calibration's forward and backward) lays the exact part
out alike but, up to STATE_BLOCKS blocks, sums the far part from per-block states instead: at a
few hundred positions that is the faster form, and nothing cancels.

A causal window's exact part takes the same pairs of blocks and one gather (in a pair's lower
triangle, each block's own keys up to the query and, for the pair's first block, the block before
it; the comment above _causal_paired_window_functions). Its far part
(blocks <= c-2) keeps no state per block: it is a chunked causal kernel over
chunks of P blocks (P W ~ WINDOW_FAR_CHUNK positions, whatever W), with the keys one block behind
the queries, so that every earlier key chunk is wholly far (one exclusive prefix of per-chunk
states) and inside a chunk a block-strictly-lower mask on the kernel scores takes exactly the
far keys (the comment above _chunked_far_sums_functions; the torch form, _FarChunks, lays its
chunks out alike). No local key enters the far sums, so nothing cancels: they round as sums of
far terms.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxscript import OnnxFunction, script

from attnrewrite.passes._onnx import (
    ATTNREWRITE,
    DOMAIN,
    FLOAT,
    OnnxLowering,
    make_function,
    rank_constant,
    standard_opset,
    with_callees,
)
from attnrewrite.passes._options import AtLeast, option
from attnrewrite.passes._torch import torch

DENOMINATOR_EPS = 1e-6  # keeps rows whose keys are all masked finite (0 instead of 0/0)
# The same guard for denominators in units of exp(-stabilisers) (favor; hedgehog's window), which
# can be legitimately tiny, so DENOMINATOR_EPS would bias them; 1e-30 is still a normal float32,
# and a denominator near it has underflowed anyway.
RESCALED_EPS = 1e-30
# Positions per chunk of a causal window's far part (_chunked_far_sums_functions), rounded to whole
# blocks of the window: at window=32 pairs of blocks, measured faster on CPU than chunks of 4
# (bench/ab_attention.py, hedgehog: the prefix of fewer states saves less than the [4W, 4W]
# masked scores cost).
WINDOW_FAR_CHUNK = 64
PREFIX_GROUP = 16  # rows per group at each level of the hierarchical prefix sums and maxima
# "No key yet" in running maxima of log scales: finite, so differences of two stay NaN-free
# (-inf - -inf is NaN) while exp of any difference with a real scale is still 0.
LOWEST_LOG_SCALE = -3.0e38
EXP_FLOOR = 80.0  # e^-80 is a normal float32; see _local_softmax_sums
# The least exponent shift of a window row (ONNX): where no exact key is kept, e^(lowest log
# scale - shift) is still 0 instead of e^0.
NO_EXACT_KEY_SHIFT = -1.0e30
# What a window's exact logit gets for a key it does not take (not kept, or outside the pair's
# structure): two of them add up to the lowest log scale, still finite, so no row max is -inf.
MASKED_LOGIT_BIAS = LOWEST_LOG_SCALE / 2

BOOL = onnx.TensorProto.BOOL


# --- torch -----------------------------------------------------------------------------------


def linear_attention(phi_q, phi_k, v, eps: float = DENOMINATOR_EPS):
    kv = phi_k.transpose(-2, -1) @ v  # [..., F, Dv]: the reassociated product, never N x N
    numerator = phi_q @ kv
    denominator = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
    return numerator / (denominator + eps)


def causal_linear_attention(phi_q, phi_k, v, chunk: int, eps: float = DENOMINATOR_EPS):
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = _ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    k4t = k4.transpose(-2, -1)
    state = _exclusive_cumsum(k4t @ v4)  # keys of earlier chunks only
    key_sum = _exclusive_cumsum(k4.sum(dim=2, keepdim=True))
    scores = torch.tril(q4 @ k4t)
    numerator = q4 @ state + scores @ v4
    denominator = (q4 * key_sum).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    return layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)


def causal_rescaled_linear_attention(phi_q, phi_k, key_log_scale, v, chunk: int, eps: float = DENOMINATOR_EPS):
    """Causal kernel attention whose key j has features phi_k[j] * exp(key_log_scale[j]).

    exp(key_log_scale) may lie far outside the float range (FAVOR+ stabilizes each key by its own
    max), so no key is ever multiplied by it. Query i weighs key j <= i by
    exp(key_log_scale[j] - r[i]) <= 1, with r[i] the running max of key_log_scale over keys
    0..i: the dropped factor exp(r[i]) is one constant for every term of row i's numerator and
    denominator, so it cancels exactly, and r[i] reads no key after i. Across chunks the carried
    state is re-referenced from one chunk's running max to the next by _rescaled_prefix_sum
    (no CumSum can rescale): two levels of factors <= 1, as the ONNX RescaledPrefixSum, so
    compute stays near linear in N and memory that of causal_linear_attention.
    Masked keys: phi_k rows 0 and key_log_scale LOWEST_LOG_SCALE (they must not raise r).
    """
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = _ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]  # [G, chunks, chunk]
    seen = _running_max(s)  # inside each chunk, a [G, chunks, chunk, chunk] masked max
    upto = _chunk_running_max(seen[..., -1], layout.groups)  # through the end of each chunk
    before = _shift_right(upto, LOWEST_LOG_SCALE)  # through the end of the chunk before
    ref = torch.maximum(seen, before.unsqueeze(-1))  # r[i]
    # Inside a chunk: (q_i . k_j) exp(s_j - r_i), j <= i; above the diagonal the clamp only keeps
    # exp finite before tril drops those entries.
    decay = torch.exp(torch.clamp_max(s.unsqueeze(-2) - ref.unsqueeze(-1), 0.0))
    scores = torch.tril((q4 @ k4.transpose(-2, -1)) * decay)
    # Each chunk's keys relative to its own end-of-chunk max, then moved to each later chunk's
    # starting max: exp(upto[c'] - before[c]) <= 1 for c' < c.
    k_rel = k4 * torch.exp(s - upto.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4  # [G, chunks, F, Dv]
    state = _rescaled_prefix_sum(kv.flatten(2), upto, before, layout.groups).reshape(kv.shape)
    key_sum = _rescaled_prefix_sum(k_rel.sum(dim=2), upto, before, layout.groups)  # [G, chunks, F]
    into = torch.exp(before.unsqueeze(-1) - ref).unsqueeze(-1)  # from before[c] to r[i], <= 1
    numerator = into * (q4 @ state) + scores @ v4
    denominator = into * (q4 * key_sum.unsqueeze(2)).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    return layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)


def windowed_kernel_attention(
    phi_q,
    phi_k,
    q,
    k,
    v,
    *,
    scale: float,
    window: int,
    causal: bool,
    window_next: bool,
    sinks: int,
    key_keep=None,
    linear_log_weight=None,
    query_log_scale=None,
    key_log_scale=None,
    local_max_weight=None,
    eps: float = DENOMINATOR_EPS,
    far_chunk: int = WINDOW_FAR_CHUNK,
):
    """Exact softmax over nearby keys and sink keys plus kernel attention over the rest, one
    normaliser.

    Queries go in blocks of ``window`` (laid out by _ChunkLayout: aligned to the end of the
    sequence, causal ones to its start, so that a causal output never depends on what follows
    it); block c's exact keys are
    - its local keys: blocks c-1, c and, when bidirectional and ``window_next``, c+1 (causal:
      c-1 and the causal part of c; a causal site never sees later keys, whatever window_next);
    - the sinks: sequence positions 0..sinks-1, for every query (attention sinks such as
      [CLS]), unless the sink is already a local key of the block (no key counts twice) or,
      causal, comes after the query. Positions, not the first kept keys: under left padding
      the sinks are padding, masked like any padded key.
    The kernel covers every other key: blocks <= c-2 and >= c+2 (>= c+1 without window_next;
    causal: <= c-2), never a sink. Row i is
        (sum_exact e^(s_ij - m_i) v_j + w_h sum_far phi_i.phi_j v_j) / (the same without v_j)
    with s_ij = scale * q_i.k_j, m_i the max over row i's exact keys and w_h =
    exp(linear_log_weight) ([heads, 1, 1], broadcast like phi_q's leading axes).

    Where phi_q_i.phi_k_j * exp(query_log_scale_i + key_log_scale_j) estimates e^(s_ij) itself
    (FAVOR+'s stabilised features, see favor.py), the log scales say so and the kernel part is
    moved to the exact part's units e^(s_ij - m_i): w_h = 1 is then the unbiased hybrid.
    ``key_log_scale``: one per head ([..., 1, 1]) for bidirectional sites, one per key
    ([..., N, 1], the lowest log scale for padding) for causal ones. ``local_max_weight``
    (beta_h, [heads, 1, 1]; default 1) moves the kernel part by e^(-beta_h m_i) instead, for
    fitted features that carry part of the row's scale themselves (hedgehog.py). The two parts
    are scaled by exp(-max(t, 0)) and exp(min(t, 0)) with t their log ratio, so neither
    overflows.

    ``key_keep`` masks the exact part; phi_k must already be zero on padded keys. Memory is
    O(N * (3 * window + sinks) + N * F) and the far states: one [F, Dv + 1] bidirectional (in
    pairs of blocks, see the module docstring for its rounding; one per block up to
    STATE_BLOCKS blocks), one per chunk of about
    ``far_chunk`` positions causal (_FarChunks, as the ONNX form; a matter of speed only);
    nothing is N x N. All in float32.
    """
    lead, n = q.shape[:-2], q.shape[-2]
    q, k, v, phi_q, phi_k = q.float(), k.float(), v.float(), phi_q.float(), phi_k.float()
    if linear_log_weight is not None:
        phi_q = phi_q * torch.exp(linear_log_weight.float())  # w_h scales the kernel part only
    keep = torch.ones_like(k[..., :1]) if key_keep is None else key_keep.float().expand(*k.shape[:-1], 1)
    units = _Units(query_log_scale, key_log_scale, local_max_weight)
    if causal:  # window_next changes nothing: a causal site never sees later keys
        out = _windowed_causal(
            phi_q, phi_k, q, k, v, keep, units, scale=scale, window=window, sinks=sinks, far_chunk=far_chunk, eps=eps
        )
    else:
        out = _windowed_bidirectional(
            phi_q, phi_k, q, k, v, keep, units, scale=scale, window=window, following=window_next, sinks=sinks, eps=eps
        )
    return out.reshape(*lead, n, v.shape[-1])


class _Units(typing.NamedTuple):
    """windowed_kernel_attention's log scales: how the kernel part's unit relates to the exact part's."""

    query_log_scale: typing.Any
    key_log_scale: typing.Any
    local_max_weight: typing.Any


def _windowed_bidirectional(phi_q, phi_k, q, k, v, keep, units: _Units, *, scale, window, following, sinks, eps):
    """windowed_kernel_attention, bidirectional: in pairs of blocks (_bidirectional_window)."""
    lead, n = q.shape[:-2], q.shape[-2]
    pairs = _Pairs(n, window)
    if units.key_log_scale is None:
        ratio_of = torch.zeros_like  # both parts in one unit already
    else:
        offset = pairs.rows(flatten_heads(units.query_log_scale.float())) + flatten_heads(units.key_log_scale.float())
        weight = 1.0
        if units.local_max_weight is not None:  # [heads, 1, 1] -> one per query row
            weight = pairs.rows(flatten_heads(units.local_max_weight.float().expand(*lead, n, 1)))
        ratio_of = lambda row_max: offset - weight * row_max  # noqa: E731
    flat = (flatten_heads(x) for x in (q * scale, k, v, keep, phi_q, _without_sinks(phi_k, sinks, 0.0)))
    sums = pairs.real_rows(_bidirectional_window(pairs, *flat, ratio_of, following=following, sinks=sinks))
    return sums[..., :-1] / (sums[..., -1:] + eps)


def _windowed_causal(phi_q, phi_k, q, k, v, keep, units: _Units, *, scale, window, sinks, far_chunk, eps):
    """windowed_kernel_attention, causal: the exact part over concatenated local blocks, the
    far part (blocks <= c-2) by chunks of blocks (_FarChunks)."""
    query_log_scale, key_log_scale, local_max_weight = units
    lead, n = q.shape[:-2], q.shape[-2]
    layout = _ChunkLayout(n, window, aligned_to_start=True)
    local_num, local_den, local_max = _local_softmax_sums(
        layout.blocks(q), *_causal_exact_keys(layout, k, v, keep, sinks), scale
    )
    # The kernel never sees a sink: zero features, and (per-key log scales) the lowest log
    # scale, so that no sink raises a running max.
    chunks = _FarChunks(layout, far_chunk, q.device)
    far_rows = flatten_heads(phi_q), flatten_heads(_without_sinks(phi_k, sinks, 0.0)), flatten_heads(v)
    if key_log_scale is None:
        far_sums = _far_sums(chunks, *far_rows)
    else:
        far_key_log_scale = _without_sinks(flatten_heads(key_log_scale.float()), sinks, LOWEST_LOG_SCALE)
        far_sums, far_log_scale = _rescaled_far_sums(chunks, *far_rows, far_key_log_scale)
    far_num, far_den = far_sums[..., :-1], far_sums[..., -1:]
    if key_log_scale is not None:
        # log of (kernel part's unit / exact part's unit), per query row
        if local_max_weight is not None:  # [heads, 1, 1] -> one per query row, blocked
            local_max = local_max * layout.blocks(local_max_weight.float().expand(*lead, n, 1))
        ratio = layout.blocks(query_log_scale) + far_log_scale - local_max
        local_factor = torch.exp(-torch.clamp_min(ratio, 0.0))
        far_factor = torch.exp(torch.clamp_max(ratio, 0.0))
        local_num, local_den = local_num * local_factor, local_den * local_factor
        far_num, far_den = far_num * far_factor, far_den * far_factor
    out = (local_num + far_num) / (local_den + far_den + eps)
    return layout.unblock(out)


def feature_map_attention(module, phi_q, phi_k, q, k, v, key_keep=None):
    """Attention with the feature maps phi_q, phi_k of a module that has ``causal``, ``chunk``,
    ``window``, ``window_next``, ``sinks``, ``scale`` and ``linear_log_weight`` (linear,
    hedgehog): the window hybrid when it has a window, else the plain or causal chunked kernel.
    Padded keys leave numerator and denominator (their phi_k rows are zeroed here)."""
    if key_keep is not None:
        phi_k = phi_k * key_keep
    if module.window:
        return windowed_kernel_attention(
            phi_q,
            phi_k,
            q,
            k,
            v,
            scale=module.scale,
            window=module.window,
            causal=module.causal,
            window_next=module.window_next,
            sinks=module.sinks,
            key_keep=key_keep,
            linear_log_weight=module.linear_log_weight,
        )
    if module.causal:
        return causal_linear_attention(phi_q, phi_k, v.float(), module.chunk)
    return linear_attention(phi_q, phi_k, v.float())


def feature_map_attention_weights(module, phi_q, phi_k, q, k, key_keep=None):
    """The normalised weights [..., Nq, Nk] feature_map_attention gives each key. N x N: for
    the fitter's attention-weight cross-entropy, never for inference."""
    if key_keep is not None:
        phi_k = phi_k * key_keep
    if not module.window:
        return kernel_attention_weights(phi_q, phi_k, module.causal)
    return windowed_attention_weights(
        phi_q,
        phi_k,
        q.float(),
        k.float(),
        scale=module.scale,
        window=module.window,
        causal=module.causal,
        window_next=module.window_next,
        sinks=module.sinks,
        key_keep=key_keep,
        linear_log_weight=module.linear_log_weight,
    )


def kernel_attention_weights(phi_q, phi_k, causal: bool, eps: float = DENOMINATOR_EPS):
    """The normalised weights [..., Nq, Nk] kernel attention gives each key (phi_k zero on
    padded keys). N x N: for attention-weight losses when fitting, never for inference."""
    scores = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        scores = torch.tril(scores)
    return scores / (scores.sum(-1, keepdim=True) + eps)


def windowed_attention_weights(
    phi_q,
    phi_k,
    q,
    k,
    *,
    scale: float,
    window: int,
    causal: bool,
    window_next: bool,
    sinks: int,
    key_keep=None,
    linear_log_weight=None,
    query_log_scale=None,
    key_log_scale=None,
    local_max_weight=None,
    eps: float = DENOMINATOR_EPS,
):
    """The normalised weights [..., Nq, Nk] of windowed_kernel_attention, written as the N x N
    matrix of its definition (same exact keys, same units), in the inputs' dtype: for
    attention-weight losses when fitting, and as the reference the blocked form is tested
    against; never for inference."""
    n = q.shape[-2]
    position = torch.arange(n, device=q.device)
    block = (position + _ChunkLayout(n, window, aligned_to_start=causal).pad) // window
    offset = block.unsqueeze(0) - block.unsqueeze(1)  # key's block - query's block
    following = window_next and not causal
    local = (offset >= -1) & (offset <= int(following))
    exact = local | (position < sinks)  # the sinks: for every query
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if key_keep is not None:
        visible = visible & (key_keep.transpose(-2, -1) > 0)
    if causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    far = ~exact & visible
    exact = exact & visible
    logits = scale * q @ k.transpose(-2, -1)
    row_max = torch.where(exact, logits, LOWEST_LOG_SCALE).amax(-1, keepdim=True)
    exact_weights = torch.where(exact, torch.exp(torch.clamp_max(logits - row_max, 0.0)), 0.0)
    kernel = phi_q @ phi_k.transpose(-2, -1)
    if linear_log_weight is not None:
        kernel = kernel * torch.exp(linear_log_weight)
    if key_log_scale is not None:
        # the kernel part in the exact part's units; both scaled <= 1 as in the blocked form
        unit = row_max if local_max_weight is None else row_max * local_max_weight
        kernel_log_scale = query_log_scale + key_log_scale.transpose(-2, -1)
        # The larger of the two parts' units, before any difference is taken: a row without an
        # exact key has unit LOWEST_LOG_SCALE, and (x - LOWEST) - (y - LOWEST) is not x - y.
        far_max = torch.where(far, kernel_log_scale, LOWEST_LOG_SCALE).amax(-1, keepdim=True)
        top = torch.maximum(unit, far_max)
        exact_weights = exact_weights * torch.exp(unit - top)
        kernel = kernel * torch.exp(torch.clamp_max(kernel_log_scale - top, 0.0))
    weights = exact_weights + torch.where(far, kernel, 0.0)
    return weights / (weights.sum(-1, keepdim=True) + eps)


def _causal_exact_keys(layout, k, v, keep, sinks: int):
    """Every causal query block's exact keys [G, chunks, 2 * window + sinks, *]: its local blocks
    (_previous_and_own_blocks), then the sink columns; their values likewise; and which of them
    each query takes ([G, chunks, window, keys]): kept ones, causally visible, a sink only
    outside the block's local keys and not after the query."""

    def exact(x):
        sink = [_sink_rows(x, sinks, layout.chunks)] if sinks else []
        return torch.cat([*_previous_and_own_blocks(layout.blocks(x)), *sink], dim=2)

    taken = _local_causal_mask(layout.chunk, k.device)
    if sinks:
        sink = _causal_sink_mask(layout, sinks, k.device)
        taken = torch.cat([taken.expand(layout.chunks, -1, -1), sink], dim=-1)
    return exact(k), exact(v), (exact(keep).transpose(-2, -1) > 0) & taken


def _local_softmax_sums(q4, k_x, v_x, allowed, scale: float):
    """Block c's queries over its exact keys (_causal_exact_keys): the unnormalised numerator and
    denominator of their softmax relative to the row max m_i, and m_i (the lowest log scale
    where no exact key is kept; its weights are then all zero, never NaN). Logits more than
    EXP_FLOOR below m_i weigh e^-EXP_FLOOR (< 1e-34 of the max's 1) instead of less: exp of
    an argument so low that its result is subnormal or 0 takes several times longer."""
    scores = torch.where(allowed, (q4 * scale) @ k_x.transpose(-2, -1), LOWEST_LOG_SCALE)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(torch.clamp_min(scores - row_max, -EXP_FLOOR)) * allowed
    return weights @ v_x, weights.sum(-1, keepdim=True), row_max


def _previous_and_own_blocks(x4) -> list:
    """[G, chunks, window, F] -> block c-1's rows and c's, each [G, chunks, window, F]."""
    return [_shift_right(x4, 0.0), x4]


def _local_causal_mask(window: int, device):
    """[window, 2 * window]: all of the previous block, own block up to the query itself."""
    return torch.ones(window, 2 * window, dtype=torch.bool, device=device).tril(window)


def _without_sinks(x, sinks: int, fill: float, start: int = 0):
    """x [..., N, F] with the rows of positions 0..sinks-1 set to ``fill`` (x itself without
    sinks); row 0 is position ``start``."""
    if not sinks:
        return x
    sink = torch.arange(x.shape[-2], device=x.device).unsqueeze(-1) + start < sinks
    return torch.where(sink, fill, x)


def _sink_rows(x, sinks: int, chunks: int):
    """[..., N, F] -> [G, chunks, sinks, F]: rows 0..sinks-1 (zero beyond N) for every block.
    Padded at the end before the slice, so its size never depends on N (see _ChunkLayout)."""
    rows = torch.nn.functional.pad(flatten_heads(x), (0, 0, 0, sinks))[:, :sinks]
    return rows.unsqueeze(1).expand(-1, chunks, -1, -1)


def _causal_sink_mask(layout, sinks: int, device):
    """[chunks, window, sinks]: True where block c's query takes sink s as an extra exact key: s
    lies outside the block's local keys (blocks c-1 and c) and not after the query. Positions
    are the padded layout's (sink s at s + pad)."""
    at = torch.arange(sinks, device=device) + layout.pad
    offset = at // layout.chunk - torch.arange(layout.chunks, device=device).unsqueeze(-1)
    outside = ((offset < -1) | (offset > 0)).unsqueeze(1)
    query_at = torch.arange(layout.chunks * layout.chunk, device=device).reshape(layout.chunks, layout.chunk, 1)
    return outside & (at <= query_at)


def _earlier_blocks_sum(x):
    """Per block c (dim 1), the sum of x over blocks <= c-2 (a causal window's far blocks)."""
    return _shift_right(torch.cumsum(x, dim=1), 0.0, steps=2)


class _FarChunks:
    """A causal window's far part by chunks of P = round(far_chunk / W) blocks, as the ONNX
    FarSums lays it out (the comment above _chunked_far_sums_functions): rows [G, N, *] ->
    [G, chunks', P W, *], query chunk k holding blocks kP .. kP + P - 1 of the window's layout,
    key chunk k the rows one block earlier (blocks kP - 1 .. kP + P - 2), so that every key
    chunk before k is far for all of query chunk k, and inside key chunk k query block kP + a
    takes key block kP - 1 + b where b < a (``earlier_blocks``, [P, P]). chunks' =
    ceil(N / (P W)) + 2 (written so that torch.export proves its guards, see _prefix_groups)
    leaves the keys room to move a block and is never 1 for some N (a guard, see _ChunkLayout);
    where it exceeds the ONNX form's (chunks + P) // P, the extra chunk holds padding only."""

    def __init__(self, layout: _ChunkLayout, far_chunk: int, device):
        self.layout, self.window = layout, layout.chunk
        self.per_chunk = max(1, round(far_chunk / layout.chunk))
        self.size = self.per_chunk * layout.chunk
        self.count = (layout.n + 3 * self.size - 1) // self.size
        self.groups = _prefix_groups(layout.n, self.size)
        self.earlier_blocks = torch.ones(self.per_chunk, self.per_chunk, device=device).tril(-1)

    def queries(self, x, fill: float = 0.0):
        return self._in_chunks(x, fill, self.layout.pad)

    def keys(self, x, fill: float = 0.0):
        return self._in_chunks(x, fill, self.layout.pad + self.window)

    def _in_chunks(self, x, fill: float, front):
        rows = self.count * self.size - front - x.shape[-2]  # x's own length (see _Pairs.rows)
        x = torch.nn.functional.pad(x, (0, 0, front, rows), value=fill)
        return x.reshape(x.shape[0], self.count, self.size, x.shape[-1])

    def in_blocks(self, x):
        """[G, chunks', P W, *] -> [G, chunks', P, W, *]."""
        return x.unflatten(2, (self.per_chunk, self.window))

    def per_block(self, x, fill: float = 0.0):
        """One value per block of the window's layout [G, chunks] -> [G, chunks', P]."""
        x = torch.nn.functional.pad(x, (0, self.count * self.per_chunk - self.layout.chunks), value=fill)
        return x.reshape(x.shape[0], self.count, self.per_chunk)

    def blocks(self, sums):
        """[G, chunks', P W, X] -> the window's blocks [G, chunks, W, X]: a gather, not a slice
        (see _ChunkLayout)."""
        in_blocks = sums.reshape(sums.shape[0], self.count * self.per_chunk, self.window, sums.shape[-1])
        return in_blocks.index_select(1, torch.arange(self.layout.chunks, device=sums.device))

    def within(self, q_c, k_c, vo_c, weight):
        """sum over key j of key chunk k of weight[a, b] phi_q_i.phi_k_j [v_j, 1], a and b the
        blocks of query i and key j in the chunk; weight [..., P, P] is zero unless b < a."""
        if self.per_chunk == 1:  # every key of key chunk k is local to query chunk k
            return 0.0
        if self.per_chunk == 2:  # only query block 1 takes keys here, key block 0's: [W, W] products
            later_q, earlier_k = self.in_blocks(q_c)[:, :, 1], self.in_blocks(k_c)[:, :, 0]
            scores = (later_q @ earlier_k.transpose(-2, -1)) * weight[..., 1:, :1]
            return torch.nn.functional.pad(scores @ self.in_blocks(vo_c)[:, :, 0], (0, 0, self.window, 0))
        scores = self.in_blocks((q_c @ k_c.transpose(-2, -1)).unflatten(-1, (self.per_chunk, self.window)))
        weighted = scores * weight[..., :, None, :, None]  # [G, chunks', P, W, P, W]
        return weighted.flatten(4, 5).flatten(2, 3) @ vo_c


def _values_and_ones(v):
    """[v, 1]: the denominator as one more value column."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _far_sums(chunks: _FarChunks, pq, pk, v):
    """[G, chunks, W, Dv + 1]: the kernel's numerator and denominator over each query block's
    far keys, from rows [G, N, *] (phi_q weighted, phi_k zero on the sinks), as the ONNX
    FarSums: the exclusive prefix of per-chunk states, and the far keys inside the chunk."""
    q_c, k_c, vo_c = chunks.queries(pq), chunks.keys(pk), chunks.keys(_values_and_ones(v))
    state = _exclusive_cumsum(k_c.transpose(-2, -1) @ vo_c)  # [G, chunks', F, Dv + 1]
    return chunks.blocks(q_c @ state + chunks.within(q_c, k_c, vo_c, chunks.earlier_blocks))


def _rescaled_far_sums(chunks: _FarChunks, pq, pk, v, s):
    """_far_sums when key j's features are pk_j * exp(s_j) (s [G, N, 1], the lowest log scale on
    the sinks and padding), in units of R_c, the max of s over block c's far keys (the lowest
    log scale if none), so that no factor exceeds 1 and R_c reads no key after the block;
    returns R_c too, as [G, chunks, 1, 1]. The references are the ONNX RescaledFarSums': chunk
    states relative to their own max U_k, carried to B_k (the max over the key chunks before)
    by _rescaled_prefix_sum, then to R_c >= B_k. Each key is first moved to its block's max M_b
    (<= U_k, and <= R_c where the block is far) on its features: a key whose features are huge
    and whose log scale is tiny keeps its product, where e^(s_j - U_k) alone could underflow."""
    lowest, least = LOWEST_LOG_SCALE, NO_EXACT_KEY_SHIFT
    block_max = chunks.layout.blocks(s, lowest)[..., 0].amax(dim=-1)  # [G, chunks]
    reach = _shift_right(_chunk_running_max(block_max, chunks.layout.groups), lowest, steps=2)  # R_c
    r_c = chunks.per_block(torch.clamp_min(reach, least))  # [G, chunks', P]
    s_b = chunks.in_blocks(chunks.keys(s, lowest))  # [G, chunks', P, W, 1]
    key_block_max = torch.clamp_min(s_b.amax(dim=(-2, -1)), least)  # M_b [G, chunks', P]
    chunk_max = key_block_max.amax(dim=-1)  # U_k
    before = _shift_right(_chunk_running_max(chunk_max, chunks.groups), lowest)  # B_k
    q_c, k_c, vo_c = chunks.queries(pq), chunks.keys(pk), chunks.keys(_values_and_ones(v))
    k_rel = chunks.in_blocks(k_c) * torch.exp(s_b - key_block_max[..., None, None])  # [G, chunks', P, W, F]
    to_chunk = torch.exp(key_block_max - chunk_max.unsqueeze(-1))[..., None, None]  # M_b to U_k
    kv = (k_rel * to_chunk).flatten(2, 3).transpose(-2, -1) @ vo_c
    state = _rescaled_prefix_sum(kv.flatten(2), chunk_max, before, chunks.groups).reshape(kv.shape)
    into = torch.exp(torch.clamp_max(before.unsqueeze(-1) - r_c, 0.0))  # B_k to R_c, per query block
    carried = (chunks.in_blocks(q_c @ state) * into[..., None, None]).flatten(2, 3)
    block_to_query = torch.exp(torch.clamp_max(key_block_max.unsqueeze(-2) - r_c.unsqueeze(-1), 0.0))  # [.., a, b]
    within = chunks.within(q_c, k_rel.flatten(2, 3), vo_c, block_to_query * chunks.earlier_blocks)
    return chunks.blocks(carried + within), reach[..., None, None]


# Up to this many blocks (N <= 62 W) the torch bidirectional window sums its far part from
# per-block states (_far_block_sums) rather than taking the local kernel terms back out of one
# state: no [2W, 2W] kernel scores and nothing cancels. Forward and backward of hedgehog
# [1, 12, N, 32] at W = 32 on the CPU, 1 thread (a shared machine, +-15%), block states / one
# state: 7.8 / 11.4 ms at N = 256, 27.6 / 42.2 at 1024, 70.7 / 83.2 at 2048, 131 / 168 at 4096;
# the states' [blocks, blocks] product grows as blocks^2, so the limit stays where it is small.
# Calibration's passages (N <= 512) are well inside.
STATE_BLOCKS = 64


class _Pairs:
    """_ChunkLayout's blocks in pairs, as the ONNX bidirectional window lays them out (see the
    comment above _pair_structure): rows [G, pairs * 2W, F], seen as [G, pairs, 2W, F] pairs,
    [G, pairs, 2, W, F] blocks, or each block's neighbour outside its pair."""

    def __init__(self, n, window: int):
        self.layout = _ChunkLayout(n, window)
        self.n, self.window = n, window
        # BlockCount // 2 + 1 (the last block is padding) as one floor division, so that
        # torch.export sees the rows divisible by it (as _ChunkLayout)
        self.count = (n + 4 * window - 1) // (2 * window)
        self.size = 2 * window * self.count

    def rows(self, x, fill: float = 0.0):
        # x's own length: the keys' may be another symbol of the same size
        return torch.nn.functional.pad(
            x, (0, 0, self.layout.pad, self.size - self.layout.pad - x.shape[-2]), value=fill
        )

    def pairs(self, rows):
        return rows.reshape(rows.shape[0], -1, 2 * self.window, rows.shape[-1])

    def blocks(self, rows):
        return rows.reshape(rows.shape[0], -1, 2, self.window, rows.shape[-1])

    def neighbours(self, rows):
        """[G, pairs, 2, W, F]: for pair p, blocks 2p-1 and 2p+2 (wrapped: padding blocks)."""
        block_rows = rows.reshape(rows.shape[0], -1, self.window, rows.shape[-1])
        first = torch.arange(0, 2 * self.count, 2, device=rows.device).unsqueeze(-1)
        index = (first + torch.tensor([-1, 2], device=rows.device)) % (2 * self.count)
        return block_rows.index_select(1, index.flatten()).reshape(rows.shape[0], -1, 2, self.window, rows.shape[-1])

    def unpaired(self, x):
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def row_blocks(self, device):
        """[rows, 1]: the layout block of each row."""
        return (torch.arange(self.size, device=device) // self.window).unsqueeze(-1)

    def real_rows(self, rows):
        return rows.index_select(1, torch.arange(self.n, device=rows.device) + self.layout.pad)


def _bidirectional_window(pairs: _Pairs, q, k, v, keep, phi_q, phi_k, ratio_of, *, following: bool, sinks: int):
    """[G, rows, Dv + 1]: the bidirectional window's numerator and denominator (the ONNX
    PairedWindow's sums: see the comment above _pair_structure), from [G, N, *] inputs (q scaled,
    phi_q weighted, phi_k zero on the sinks and padded keys) and ``ratio_of``, the log ratio of the
    kernel part's unit to the exact part's as a function of the rows' max exact logit. Over at
    most STATE_BLOCKS blocks the far part comes from per-block states instead (_far_block_sums).

    A padded key's logit is the lowest log scale (it never raises a max) and its [v, 1] row is
    zero (it adds nothing), so that no [.., 2W, 2W] mask is built or applied for it."""
    in_pair, across = (
        None if x.all() else torch.from_numpy(x).to(q.device) for x in _pair_structure(pairs.window, following)
    )
    v = _values_and_ones(v) * keep
    if sinks:
        sink_keys, sink_values, sink_keep = (_sink_rows(x, sinks, 1)[:, 0] for x in (k, v, keep))
    key_bias = pairs.rows(torch.where(keep > 0, 0.0, LOWEST_LOG_SCALE), fill=LOWEST_LOG_SCALE)
    q, k, v, phi_q, phi_k = (pairs.rows(x) for x in (q, k, v, phi_q, phi_k))
    # (structure: None where every key is taken, the queries' view, the keys' view): each pair
    # against itself, each block against its neighbour outside the pair
    local_parts = (in_pair, pairs.pairs, pairs.pairs), (across, pairs.blocks, pairs.neighbours)
    logits = []
    for structure, own, other in local_parts:
        scores = own(q) @ other(k).transpose(-2, -1) + other(key_bias).transpose(-2, -1)
        logits.append(scores if structure is None else torch.where(structure, scores, LOWEST_LOG_SCALE))
    row_max = torch.maximum(*(pairs.unpaired(x.amax(-1, keepdim=True)) for x in logits))
    if sinks:
        sink_taken = (sink_keep.transpose(-2, -1) > 0) & _paired_sink_mask(pairs, sinks, following, q.device)
        sink_logits = torch.where(sink_taken, q @ sink_keys.transpose(-2, -1), LOWEST_LOG_SCALE)
        row_max = torch.maximum(row_max, sink_logits.amax(-1, keepdim=True))
    ratio = ratio_of(row_max)
    # a symbolic length (torch.export at a free N) takes the form that holds at every length: a
    # test on it would be a guard
    if isinstance(pairs.count, int) and 2 * pairs.count <= STATE_BLOCKS:
        # Both parts' sums as they are, then each scaled by its share (e^-max(ratio, 0) and
        # e^min(ratio, 0)): one factor per row instead of a shift in every exact weight.
        local = sum(
            pairs.unpaired(_exact_weights(scores, own(row_max), structure) @ other(v))
            for (structure, own, other), scores in zip(local_parts, logits)
        )
        if sinks:
            local = local + _exact_weights(sink_logits, row_max, sink_taken) @ sink_values
        far = _far_block_sums(pairs, phi_q, phi_k, v, following)
        return local * torch.exp(-torch.clamp_min(ratio, 0.0)) + far * torch.exp(torch.clamp_max(ratio, 0.0))
    # one state for the whole sequence, the local kernel terms taken back out (the ONNX form's sums)
    block = pairs.row_blocks(q.device)
    has_far = (block >= 3) | (block + (2 if following else 1) < pairs.layout.chunks)
    far_weight = torch.exp(torch.clamp_max(ratio, 0.0)) * has_far
    shift = torch.clamp_min(ratio, 0.0)  # e^-max(ratio, 0) on the exact part, in its exponent
    sums = far_weight * (phi_q @ (phi_k.transpose(-2, -1) @ v))
    for (structure, own, other), scores in zip(local_parts, logits):
        kernel = own(phi_q) @ other(phi_k).transpose(-2, -1)
        if structure is not None:
            kernel = torch.where(structure, kernel, 0.0)
        exact = _exact_weights(scores, own(row_max), structure, own(shift))
        sums = sums + pairs.unpaired((exact - own(far_weight) * kernel) @ other(v))
    if sinks:
        sums = sums + _exact_weights(sink_logits, row_max, sink_taken, shift) @ sink_values
    return sums


def _far_block_sums(pairs: _Pairs, phi_q, phi_k, v, following: bool):
    """[G, rows, Dv + 1]: each row's kernel sums over its block's far blocks (c' <= c - 2 and
    c' >= c + 2, c + 1 without ``following``), from the blocks' states phi_k^T [v, 1] summed by
    one [blocks, blocks] product: quadratic in the blocks, hence only for few of them."""
    g, w = phi_q.shape[0], pairs.window
    states = phi_k.reshape(g, -1, w, phi_k.shape[-1]).transpose(-2, -1) @ v.reshape(g, -1, w, v.shape[-1])
    block = torch.arange(states.shape[1], device=v.device)
    offset = block - block.unsqueeze(-1)  # key's block - query's
    far = ((offset <= -2) | (offset >= (2 if following else 1))).to(states.dtype)
    far_states = (far @ states.flatten(2)).reshape(states.shape)
    return (phi_q.reshape(g, -1, w, phi_q.shape[-1]) @ far_states).reshape(g, -1, v.shape[-1])


def _exact_weights(scores, row_max, taken=None, shift=None):
    """e^(scores - row_max - shift) where ``taken`` (default: everywhere), else 0. As in
    _local_softmax_sums, no weight below e^-EXP_FLOOR of the max's: a subnormal exp takes several
    times longer (a masked key's weight is e^-EXP_FLOOR too, and its zero value row takes it out)."""
    exponent = torch.clamp_min(scores - row_max, -EXP_FLOOR)
    weights = torch.exp(exponent if shift is None else exponent - shift)
    return weights if taken is None else torch.where(taken, weights, 0.0)


def _paired_sink_mask(pairs: _Pairs, sinks: int, following: bool, device):
    """[rows, sinks]: True where a row's block takes sink s as an extra exact key."""
    offset = (torch.arange(sinks, device=device) + pairs.layout.pad) // pairs.window - pairs.row_blocks(device)
    return (offset < -1) | (offset > int(following))


class _ChunkLayout:
    """[..., N, F] <-> [G, chunks, chunk, F], written so torch.export adds no guard on N >= 1.

    Rows are padded at the front, never at the end: causal outputs do not depend on zero keys
    before them, and the real rows are then the last N, taken with a gather rather than a slice
    (slicing [:N] off the padded length needs N <= chunks * chunk, which the symbolic solver
    cannot prove, so it guards on the example's N). The padding is a whole chunk more than
    needed: with chunks = ceil(N / chunk) + 1 >= 2 written as one floor division, no size is
    ever 1 or 0 for some N and not others (each would be a guard), and the reshape's
    divisibility check is exact. The causal ONNX functions pad at the end: the same sums with
    chunk boundaries elsewhere, so the two lowerings differ by rounding only. The windowed ONNX
    function pads as here, since there the blocks decide which keys are exact. (A window >= N
    thus costs two blocks of W: exact attention, with W x 2W logits per block.)

    ``aligned_to_start`` (the causal window's layout): one whole chunk in front and the rest at
    the end, so position p lies in block p // chunk + 1 whatever N is. Blocks decide which keys
    are exact, and a causal output must not depend on how many positions follow it: aligned to
    the end, appending a token would move every block boundary, and a decoder stepping token by
    token (passes/recurrent.py) could not reproduce the outputs. Padding at the end is hidden
    from every real query by the causal mask.
    """

    def __init__(self, n, chunk: int, aligned_to_start: bool = False):
        self.n, self.chunk = n, chunk
        self.chunks = (n + 2 * chunk - 1) // chunk
        self.pad = chunk if aligned_to_start else self.chunks * chunk - n  # in [chunk, 2 * chunk - 1]
        self.tail = self.chunks * chunk - chunk - n if aligned_to_start else 0  # in [0, chunk - 1]
        self.groups = _prefix_groups(n, chunk)  # of the chunks, for prefixes over them

    def blocks(self, x, fill: float = 0.0):
        x = torch.nn.functional.pad(flatten_heads(x), (0, 0, self.pad, self.tail), value=fill)
        return x.reshape(x.shape[0], self.chunks, self.chunk, x.shape[-1])

    def unblock(self, x4):
        rows = x4.reshape(x4.shape[0], self.chunks * self.chunk, x4.shape[-1])
        return rows.index_select(1, torch.arange(self.n, device=x4.device) + self.pad)


def _exclusive_cumsum(x):
    """Prefix sums over chunks (dim 1) that leave out the chunk itself."""
    return torch.cumsum(_shift_right(x, 0.0), dim=1)


def _shift_right(x, fill: float, steps: int = 1):
    """x moved ``steps`` chunks later along dim 1, fill first: a pad, then dropping the last
    ``steps`` of chunks + steps (never a slice that is empty or of size 1 for some N, see
    _ChunkLayout)."""
    pads = [0, 0] * (x.dim() - 2) + [steps, 0]
    return torch.nn.functional.pad(x, pads, value=fill)[:, :-steps]


def _running_max(x):
    """Running max over the last axis as a lower-triangular masked max ([..., L] -> [..., L, L]),
    as the ONNX RunningMax: torch.cummax has no ONNX conversion."""
    size = x.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    return torch.where(lower, x.unsqueeze(-2), LOWEST_LOG_SCALE).amax(dim=-1)


# Along a chunk axis that grows with N, running maxima and rescaled prefix sums go two levels deep
# (groups of PREFIX_GROUP rows, then the groups), as the ONNX ChunkRunningMax and RescaledPrefixSum:
# no (chunks x chunks) matrix, so compute stays near linear in N.


def _prefix_groups(n, span: int):
    """Groups of PREFIX_GROUP rows for the chunks of ``span`` positions of n (at most
    n / span + 3 of them: _ChunkLayout, _FarChunks): ceil(n / (PREFIX_GROUP span)) + 1, at least
    one more group than they fill, so that the count is never 1 for some N and not others (a
    guard, see _ChunkLayout). Written as a ceiling of n itself: torch.export proves its guards
    (as it does _ChunkLayout's), not those of the groups of a floor division's result."""
    return (n + 2 * PREFIX_GROUP * span - 1) // (PREFIX_GROUP * span)


def _in_groups(x, fill: float, groups):
    """[G, L, *] -> [G, groups, PREFIX_GROUP, *], fill after the last row (_prefix_groups)."""
    pads = [0, 0] * (x.dim() - 2) + [0, groups * PREFIX_GROUP - x.shape[1]]
    return torch.nn.functional.pad(x, pads, value=fill).reshape(x.shape[0], groups, PREFIX_GROUP, *x.shape[2:])


def _out_of_groups(x4, rows):
    """_in_groups undone: the first ``rows`` rows, a gather rather than a slice (see _ChunkLayout)."""
    flat = x4.reshape(x4.shape[0], x4.shape[1] * PREFIX_GROUP, *x4.shape[3:])
    return flat.index_select(1, torch.arange(rows, device=x4.device))


def _chunk_running_max(x, groups):
    """[G, L] -> the max of x over rows <= each row: inside each group, then the groups before."""
    within = _running_max(_in_groups(x, LOWEST_LOG_SCALE, groups))  # [G, groups, PREFIX_GROUP]
    earlier_groups = _shift_right(_running_max(within[..., -1]), LOWEST_LOG_SCALE)
    return _out_of_groups(torch.maximum(within, earlier_groups.unsqueeze(-1)), x.shape[1])


def _rescaled_prefix_sum(x, m, r, groups):
    """Per row c of x [G, L, X] (row c' standing for x[c'] exp(m[c']), m [G, L]), the sum over
    c' < c of x[c'] exp(m[c'] - r[c]), to references r [G, L] >= every m[c'] summed into their
    row, so that no factor exceeds 1: inside a group each pair's factor, across groups each
    group's total moved to its own max U, carried to the max B of the groups before, then to
    r[c] >= B."""
    x4, m3, r3 = _in_groups(x, 0.0, groups), _in_groups(m, LOWEST_LOG_SCALE, groups), _in_groups(r, 0.0, groups)
    pairs = m3.unsqueeze(2) - r3.unsqueeze(3)  # [G, groups, row c, row c']
    within = torch.tril(torch.exp(torch.clamp_max(pairs, 0.0)), diagonal=-1) @ x4
    group_max = m3.amax(dim=-1)  # U [G, groups]
    totals = (torch.exp(m3 - group_max.unsqueeze(-1)).unsqueeze(2) @ x4).squeeze(2)  # [G, groups, X]
    before = _shift_right(_running_max(group_max), LOWEST_LOG_SCALE)  # B
    moves = group_max.unsqueeze(1) - before.unsqueeze(2)
    across = torch.tril(torch.exp(torch.clamp_max(moves, 0.0)), diagonal=-1) @ totals
    into = torch.exp(torch.clamp_max(before.unsqueeze(-1) - r3, 0.0)).unsqueeze(-1)  # from B to r[c]
    # in place: the one value as large as x4 that is not x4 itself
    return _out_of_groups(within.addcmul_(into, across.unsqueeze(2)), x.shape[1])


# --- the causal forms continued from a state (passes/recurrent.py) --------------------------------
# A decoder feeds the positions of a sequence in pieces: each call takes the N new positions and
# what the earlier ones left behind, and returns the new outputs and the state after them. The
# sums are the parallel forms' over the whole sequence, grouped differently: rounding only.


class KernelState(typing.NamedTuple):
    """The keys a causal kernel has absorbed: sum phi_k v^T [..., F, Dv] and sum phi_k [..., F],
    float32; with per-key log scales (``log_scale`` [...], FAVOR+ and the rescaled windows),
    both relative to exp(log_scale), the max of the absorbed keys' log scales
    (LOWEST_LOG_SCALE before any key), so no factor exceeds 1."""

    kv: typing.Any
    key_sum: typing.Any
    log_scale: typing.Any = None


def absorb_keys(state: KernelState, phi_k, v, key_log_scale=None) -> KernelState:
    """``state`` with the keys phi_k [..., N, F] (zero where padded) and values v added;
    ``key_log_scale`` [..., N, 1] (LOWEST_LOG_SCALE where padded) when the state has one."""
    phi_k, v = phi_k.float(), v.float()
    if state.log_scale is None:
        return KernelState(state.kv + phi_k.transpose(-2, -1) @ v, state.key_sum + phi_k.sum(-2))
    log_scale = torch.maximum(state.log_scale, key_log_scale.amax(dim=(-2, -1)))
    held = torch.exp(state.log_scale - log_scale)  # <= 1: the old reference below the new one
    k_rel = phi_k * torch.exp(key_log_scale - log_scale[..., None, None])
    kv = state.kv * held[..., None, None] + k_rel.transpose(-2, -1) @ v
    return KernelState(kv, state.key_sum * held[..., None] + k_rel.sum(-2), log_scale)


def causal_linear_attention_from_state(phi_q, phi_k, v, state: KernelState, chunk: int, eps: float = DENOMINATOR_EPS):
    """causal_linear_attention of N new positions after the keys in ``state``: (out, state
    with the new keys)."""
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = _ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    k4t = k4.transpose(-2, -1)
    earlier = _exclusive_cumsum(k4t @ v4) + flatten_heads(state.kv).unsqueeze(1)
    key_sum = _exclusive_cumsum(k4.sum(dim=2, keepdim=True)) + state.key_sum.reshape(-1, 1, 1, q4.shape[-1])
    scores = torch.tril(q4 @ k4t)
    numerator = q4 @ earlier + scores @ v4
    denominator = (q4 * key_sum).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    out = layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)
    return out, absorb_keys(state, phi_k, v)


def causal_rescaled_linear_attention_from_state(
    phi_q, phi_k, key_log_scale, v, state: KernelState, chunk: int, eps: float = DENOMINATOR_EPS
):
    """causal_rescaled_linear_attention of N new positions after the keys in ``state``: (out,
    state with the new keys). Row i's reference r_i is the running max over every key up to i,
    the state's included (its log_scale), exactly as in the parallel form."""
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = _ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]
    absorbed = state.log_scale.reshape(-1, 1)  # [G, 1]
    seen = _running_max(s)
    upto = torch.maximum(_running_max(seen[..., -1]), absorbed)
    before = torch.maximum(_shift_right(upto, LOWEST_LOG_SCALE), absorbed)
    ref = torch.maximum(seen, before.unsqueeze(-1))
    decay = torch.exp(torch.clamp_max(s.unsqueeze(-2) - ref.unsqueeze(-1), 0.0))
    scores = torch.tril((q4 @ k4.transpose(-2, -1)) * decay)
    k_rel = k4 * torch.exp(s - upto.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4
    carry = torch.tril(torch.exp(torch.clamp_max(upto.unsqueeze(1) - before.unsqueeze(2), 0.0)), diagonal=-1)
    held = torch.exp(absorbed - before).unsqueeze(-1)  # the state moved to each chunk's start, <= 1
    earlier = carry @ kv.flatten(2) + held * flatten_heads(state.kv).flatten(1).unsqueeze(1)
    key_sum = carry @ k_rel.sum(dim=2) + held * state.key_sum.reshape(-1, 1, q4.shape[-1])
    into = torch.exp(before.unsqueeze(-1) - ref).unsqueeze(-1)
    numerator = into * (q4 @ earlier.reshape(kv.shape)) + scores @ v4
    denominator = into * (q4 * key_sum.unsqueeze(2)).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    out = layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)
    return out, absorb_keys(state, phi_k, v, key_log_scale)


def far_key_features(phi_k, key_log_scale, start: int, sinks: int):
    """What the window's kernel part reads of keys at positions start, start + 1, ...: phi_k
    zero and the log scale (if any) LOWEST_LOG_SCALE on the sinks, which are exact keys only."""
    far_phi_k = _without_sinks(phi_k.float(), sinks, 0.0, start)
    if key_log_scale is None:
        return far_phi_k, None
    return far_phi_k, _without_sinks(key_log_scale.float(), sinks, LOWEST_LOG_SCALE, start)


class SinkKeys(typing.NamedTuple):
    """The sinks (positions 0..sinks-1) as a decoder keeps them: keys, values and keep [..., sinks, *]."""

    k: typing.Any
    v: typing.Any
    keep: typing.Any


def windowed_kernel_attention_from_state(
    phi_q,
    far_phi_k,
    q,
    k,
    v,
    keep,
    *,
    start: int,
    sink_keys: SinkKeys,
    far: KernelState,
    scale: float,
    window: int,
    linear_log_weight=None,
    query_log_scale=None,
    far_key_log_scale=None,
    local_max_weight=None,
    eps: float = DENOMINATOR_EPS,
):
    """The causal windowed_kernel_attention of the last N' rows of the keys k, v, keep [..., N, *]
    (positions start .. start + N - 1; far_phi_k and far_key_log_scale from far_key_features),
    whose queries phi_q, q, query_log_scale are [..., N', *]. ``far``: every key before
    ``start`` that is no sink; they lie in blocks before every query's previous one (the caller
    keeps the 2 * window - 1 positions before the queries among k), so they are all kernel part.
    Blocks are aligned to sequence positions, as the parallel causal form's."""
    lead, n_keys, n = k.shape[:-2], k.shape[-2], q.shape[-2]
    q, k, v, phi_q = q.float(), k.float(), v.float(), phi_q.float()
    if linear_log_weight is not None:
        phi_q = phi_q * torch.exp(linear_log_weight.float())
    layout = _PositionedLayout(start, n_keys, window)

    def query_blocks(x):  # queries are the last rows: none for the rows before them
        return layout.blocks(torch.nn.functional.pad(x.float().expand(*lead, n, x.shape[-1]), (0, 0, n_keys - n, 0)))

    keep = keep.float().expand(*k.shape[:-1], 1)
    local_num, local_den, local_max = _local_softmax_sums(
        query_blocks(q), *_positioned_exact_keys(layout, start, k, v, keep, sink_keys), scale
    )
    pq4, v4, pk4 = query_blocks(phi_q), layout.blocks(v), layout.blocks(far_phi_k)
    if far_key_log_scale is None:
        far_kv = _earlier_blocks_sum(pk4.transpose(-2, -1) @ v4) + flatten_heads(far.kv).unsqueeze(1)
        far_key_sum = _earlier_blocks_sum(pk4.sum(dim=2)) + far.key_sum.reshape(-1, 1, pk4.shape[-1])
    else:
        s = layout.blocks(far_key_log_scale, LOWEST_LOG_SCALE)[..., 0]
        far_kv, far_key_sum, far_log_scale = _rescaled_earlier_states_after(pk4, s, v4, far)
    far_num = pq4 @ far_kv
    far_den = (pq4 * far_key_sum.unsqueeze(2)).sum(-1, keepdim=True)
    if far_key_log_scale is not None:
        if local_max_weight is not None:
            local_max = local_max * query_blocks(local_max_weight)
        ratio = query_blocks(query_log_scale) + far_log_scale - local_max
        local_factor, far_factor = torch.exp(-torch.clamp_min(ratio, 0.0)), torch.exp(torch.clamp_max(ratio, 0.0))
        local_num, local_den = local_num * local_factor, local_den * local_factor
        far_num, far_den = far_num * far_factor, far_den * far_factor
    out = layout.unblock((local_num + far_num) / (local_den + far_den + eps))[:, n_keys - n :]
    return out.reshape(*lead, n, v.shape[-1])


def _positioned_exact_keys(layout, start: int, k, v, keep, sink_keys: SinkKeys):
    """_causal_exact_keys of a _PositionedLayout: the previous and own block up to the query,
    then the sinks from ``sink_keys``, taken by a query of a later block than their next one and
    not before them."""
    taken = _local_causal_mask(layout.chunk, k.device)

    def exact(x, sink):
        local = torch.cat(_previous_and_own_blocks(layout.blocks(x)), dim=2)
        if sink is None:
            return local
        return torch.cat([local, flatten_heads(sink.float()).unsqueeze(1).expand(-1, layout.chunks, -1, -1)], dim=2)

    sinks = sink_keys.k.shape[-2] if sink_keys is not None else 0
    if not sinks:
        return exact(k, None), exact(v, None), (exact(keep, None).transpose(-2, -1) > 0) & taken
    first = start - layout.pad  # the sequence position of the layout's first row
    query_at = first + torch.arange(layout.chunks * layout.chunk, device=k.device).reshape(layout.chunks, -1, 1)
    sink_at = torch.arange(sinks, device=k.device)
    query_block = torch.div(query_at[:, :1], layout.chunk, rounding_mode="floor")
    outside = torch.div(sink_at, layout.chunk, rounding_mode="floor") < query_block - 1
    taken = torch.cat([taken.expand(layout.chunks, -1, -1), outside & (sink_at <= query_at)], dim=-1)
    sink_keep = sink_keys.keep.float().expand(*sink_keys.k.shape[:-1], 1)
    allowed = (exact(keep, sink_keep).transpose(-2, -1) > 0) & taken
    return exact(k, sink_keys.k), exact(v, sink_keys.v), allowed


def _rescaled_earlier_states_after(pk4, s, v4, far: KernelState):
    """Causal kernel states over blocks <= c-2 when key j's features are pk_j * exp(s_j), and the
    keys of ``far`` before the first block: referenced to R_c, the max of s over those keys (the
    state's log scale included), with a (blocks x blocks) carry (a decoder's few new blocks), so
    no factor exceeds 1 and R_c reads no key after the block. Returns (state, key sum, R_c as
    [G, chunks, 1, 1])."""
    absorbed = far.log_scale.reshape(-1, 1)
    block_max = s.amax(dim=-1)
    reach = torch.maximum(_shift_right(_running_max(block_max), LOWEST_LOG_SCALE, steps=2), absorbed)
    k_rel = pk4 * torch.exp(s - block_max.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4
    carry = torch.tril(torch.exp(torch.clamp_max(block_max.unsqueeze(1) - reach.unsqueeze(2), 0.0)), diagonal=-2)
    held = torch.exp(absorbed - reach).unsqueeze(-1)
    state = carry @ kv.flatten(2) + held * flatten_heads(far.kv).flatten(1).unsqueeze(1)
    key_sum = carry @ k_rel.sum(dim=2) + held * far.key_sum.reshape(-1, 1, pk4.shape[-1])
    return state.reshape(kv.shape), key_sum, reach[..., None, None]


class _PositionedLayout(_ChunkLayout):
    """_ChunkLayout's blocks for the rows of positions start .. start + N - 1 of a longer
    sequence: aligned to the sequence's positions as the causal window's layout is (position p
    in block p // chunk, counted from the first block), padded only as far as that needs."""

    def __init__(self, start: int, n: int, chunk: int):
        self.n, self.chunk = n, chunk
        self.pad = start % chunk
        self.chunks = (self.pad + n + chunk - 1) // chunk
        self.tail = self.chunks * chunk - self.pad - n


def expand_to_query_heads(x, q):
    """k or v ([..., Nk, D]) with q's leading dims, as attention reads them: grouped heads
    repeated (SDPA's enable_gqa, transformers' repeat_kv: query head h reads key/value head
    h // group), any other size-1 dim broadcast (multi-query attention's MatMul)."""
    if x.shape[:-2] == q.shape[:-2]:
        return x
    if x.dim() == q.dim() >= 3 and 1 < x.shape[-3] < q.shape[-3] and q.shape[-3] % x.shape[-3] == 0:
        x = x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3)
    return x.expand(*q.shape[:-2], *x.shape[-2:])


def future_keys(rows, n_keys: int):
    """[R, Nk] True where key j comes after query row rows[r] (hidden under a causal mask)."""
    return torch.arange(n_keys, device=rows.device) > rows[:, None]


def flatten_heads(x):
    """[..., N, F] -> [G, N, F]: the ONNX kernels below are written for rank 3."""
    return x.reshape(-1, *x.shape[-2:])


def fitted_heads(site) -> int:
    """Heads a per-head fitted value has: site.num_heads when q is known to be [batch, heads,
    seq, head_dim] (so [heads, ...] broadcasts against it), else 1 (shared by every head)."""
    return site.num_heads if site.rank == 4 and site.num_heads is not None else 1


@dataclasses.dataclass(frozen=True)
class ExactPart:
    """Where a replacement is softmax attention itself, so that a fidelity check can look past it.

    ``exact_up_to``: on sequences this long or shorter, every query attends exactly to every key
    (the replacement is the original). ``reach``: the most keys one query attends to exactly;
    on longer sequences every query's output is approximated. ``said``: what sets them
    (``window=32``)."""

    exact_up_to: int
    reach: int
    said: str


def window_exact_part(window: int, window_next: bool, sinks: int, causal: bool) -> ExactPart | None:
    """A windowed method's exact part (windowed_kernel_attention), None without a window.
    Bidirectional blocks are aligned to the end: with ``window_next`` a query sees every key
    while there are at most 2 blocks (its own, the previous, the next: 3W keys, plus the sinks);
    without, only while there is one (or every key is a sink). Causal blocks are aligned to the
    start: the last query's kernel part is the keys before its previous block, exact while they
    are all sinks."""
    if not window:
        return None
    said = f"window={window}"
    if causal:
        return ExactPart(window * (2 + sinks // window), 2 * window + sinks, said)
    blocks = 2 if window_next else 1
    return ExactPart(max(blocks * window, sinks), (blocks + 1) * window + sinks, said)


def window_next_option():
    """The ``window_next`` field of a windowed method's Options."""
    return option(
        True,
        "with window, bidirectional sites: the next block's keys are exact too "
        "(causal sites never see later keys, so there it changes nothing)",
    )


def sinks_option():
    """The ``sinks`` field of a windowed method's Options."""
    return option(
        1,
        "with window: the first S key positions are exact for every query (attention sinks such as [CLS]); 0: none",
        valid=AtLeast(0),
    )


def window_repr(module) -> str:
    """The window's part of a windowed method's extra_repr ("" without a window)."""
    if not module.window:
        return ""
    return f", window={module.window}, window_next={module.window_next}, sinks={module.sinks}"


def initial_linear_log_weight(site) -> np.ndarray:
    """The window's per-head log mixing weight [heads, 1, 1] before fitting: 0, weight 1."""
    return np.zeros((fitted_heads(site), 1, 1), np.float32)


# --- learnable query and key maps (linear, hydra) --------------------------------------------
# Calibration fits a per-head linear map of q and k in front of a fixed feature map. The maps
# exist only in learnable modules (identity at first, so the output is unchanged), and their
# ONNX form wraps the plain entry function, so uncalibrated graphs are the ones they always were.

QUERY_KEY_MAPS = ("query_map", "key_map")


def query_key_map_shape(site) -> tuple[int, int, int]:
    """[heads, d, d] when q is [batch, heads, N, d], else [1, d, d] (one map for every head)."""
    if site.head_dim is None:
        raise ValueError("the head dimension is unknown, so no query/key map can be fitted")
    return fitted_heads(site), site.head_dim, site.head_dim


def add_query_key_maps(module, site) -> None:
    """Register identity maps as the module's trainable ``query_map`` and ``key_map``."""
    heads, d, _ = query_key_map_shape(site)
    for name in QUERY_KEY_MAPS:
        module.register_parameter(name, torch.nn.Parameter(torch.eye(d).repeat(heads, 1, 1)))


def map_queries_and_keys(module, q, k):
    """(q W_q, k W_k) in float32 when the module has maps, else q and k as they are."""
    if getattr(module, "query_map", None) is None:
        return q, k
    return q.float() @ module.query_map.float(), k.float() @ module.key_map.float()


def with_query_key_maps(lowering: OnnxLowering, weights: dict, opset_version: int) -> OnnxLowering:
    """The lowering behind an entry ``Learned<Entry>(q, k, v, key_keep, *constants, query_map,
    key_map)`` that maps q and k (in float32, as map_queries_and_keys) and calls the entry."""
    inner = lowering.functions[-1]
    constants = list(inner.input[4:])
    nodes = [
        helper.make_node("Cast", ["q"], ["q_float"], to=FLOAT),
        helper.make_node("MatMul", ["q_float", "query_map"], ["q_mapped"]),
        helper.make_node("Cast", ["k"], ["k_float"], to=FLOAT),
        helper.make_node("MatMul", ["k_float", "key_map"], ["k_mapped"]),
        helper.make_node(inner.name, ["q_mapped", "k_mapped", "v", "key_keep", *constants], ["out"], domain=DOMAIN),
    ]
    entry = make_function(
        f"Learned{inner.name}",
        ["q", "k", "v", "key_keep", *constants, *QUERY_KEY_MAPS],
        ["out"],
        nodes,
        opset_version,
    )
    maps = {name: np.asarray(weights[name], dtype=np.float32) for name in QUERY_KEY_MAPS}
    return OnnxLowering([*lowering.functions, entry], {**lowering.constants, **maps})


# --- ONNX ------------------------------------------------------------------------------------


def flatten_heads_function(opset_version: int):
    """FlattenHeads(x): [..., N, F] -> [G, N, F] float32, the rank the kernels are written for.
    Every pass flattens with this one body, so passes sharing a model share one function."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def FlattenHeads(x):
        """[..., N, F] -> [G, N, F] float32."""
        shape = op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=-2), axis=0)
        return op.Reshape(op.Cast(x, to=FLOAT), shape)

    return FlattenHeads


def key_keep_function(opset_version: int):
    """KeyKeep(key_keep, k): the splice's key_keep expanded and flattened as FlattenHeads(k)."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeyKeep(key_keep, k):
        """key_keep (broadcastable to [..., N, 1]) -> [G, N, 1]."""
        full = op.Expand(key_keep, op.Concat(op.Shape(k, end=-1), op.Constant(value_ints=[1]), axis=0))
        rows, one = op.Constant(value_ints=[-1]), op.Constant(value_ints=[1])
        return op.Reshape(full, op.Concat(rows, op.Shape(k, start=-2, end=-1), one, axis=0))

    return KeyKeep


def key_mask_function(opset_version: int, key_padding: bool):
    """KeptKeys(features, key_keep): the keys' features zeroed on padding, or, for a site
    without key padding (key_keep all ones), AllKeys: the features as they are, not a
    full-size multiplication by ones."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeptKeys(features, key_keep):
        return features * key_keep

    @script(ATTNREWRITE, default_opset=op)
    def AllKeys(features, key_keep):
        return op.Identity(features)

    return KeptKeys if key_padding else AllKeys


_ONE_FLOAT = helper.make_tensor("one", FLOAT, [1], [1.0])


def sequence_sum_function(opset_version: int):
    """SequenceSum(x): [..., N, F] -> [..., 1, F], the sum over positions as a product with a
    row of ones: GEMM speed whatever the layout (a reduction over a middle axis is strided on
    CPU and not a plain row or column sum for onnxruntime's CUDA reductions)."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def SequenceSum(x):
        size = op.Concat(op.Constant(value_ints=[1]), op.Shape(x, start=-2, end=-1), axis=0)
        return op.MatMul(op.CastLike(op.ConstantOfShape(size, value=_ONE_FLOAT), x), x)

    return SequenceSum


def linear_attention_functions(opset_version: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of linear_attention: the function it calls, then itself last."""
    op = standard_opset(opset_version)
    sequence_sum = sequence_sum_function(opset_version)
    eps_rows = rank_constant(eps, 3)

    @script(ATTNREWRITE, default_opset=op)
    def KernelAttention(phi_q, phi_k, v):
        kv = op.MatMul(op.Transpose(phi_k, perm=[0, 2, 1]), v)
        numerator = op.MatMul(phi_q, kv)
        key_sum = op.Transpose(sequence_sum(phi_k), perm=[0, 2, 1])  # [G, F, 1]
        denominator = op.MatMul(phi_q, key_sum)
        return numerator / (denominator + op.Constant(value=eps_rows))

    return [sequence_sum, KernelAttention]


def causal_linear_attention_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of causal_linear_attention: the functions it calls, then itself last. The
    chunks' states are summed by ExclusivePrefixSum (no CumSum along the chunks)."""
    op = standard_opset(opset_version)
    sequence_sum = sequence_sum_function(opset_version)
    prefix_sum = exclusive_prefix_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalKernelAttention(phi_q, phi_k, v):
        # phi_q, phi_k [G, N, F], v [G, N, Dv]; G = batch * heads, flattened by the caller.
        n = op.Shape(v, start=1, end=2)
        f = op.Shape(phi_q, start=2)
        dv = op.Shape(v, start=2)
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        c = op.Max(op.Min(op.Constant(value_ints=[chunk]), n), op.Constant(value_ints=[1]))
        zero = op.Constant(value_ints=[0])
        minus_one = op.Constant(value_ints=[-1])
        chunks = op.Div(n + c - op.Constant(value_ints=[1]), c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        q4 = op.Reshape(op.Pad(phi_q, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        k4 = op.Reshape(op.Pad(phi_k, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        v4 = op.Reshape(op.Pad(v, pads), op.Concat(minus_one, chunks, c, dv, axis=0))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        kv = op.MatMul(k4t, v4)
        state = op.Reshape(prefix_sum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))), op.Shape(kv))
        key_sum = prefix_sum(op.Reshape(sequence_sum(k4), op.Concat(zero, chunks, f, axis=0)))  # [G, chunks, F]
        scores = op.Trilu(op.MatMul(q4, k4t), upper=0)
        numerator = op.MatMul(q4, state) + op.MatMul(scores, v4)
        earlier = op.MatMul(q4, op.Unsqueeze(key_sum, op.Constant(value_ints=[3])))
        denominator = earlier + op.ReduceSum(scores, op.Constant(value_ints=[3]), keepdims=1)
        out = op.Reshape(
            numerator / (denominator + op.Constant(value_float=eps)),
            op.Concat(minus_one, chunks * c, dv, axis=0),
        )
        return op.Slice(out, zero, n, op.Constant(value_ints=[1]))

    return with_callees(CausalKernelAttention)


def running_max_functions(opset_version: int):
    """RunningMax(x, lower) over the last axis and LowerTriangle(size), the mask it takes."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def RunningMax(x, lower):
        # ONNX has no CumMax: max over a lower-triangular mask of the last axis ([..., L] x [L, L]).
        lowest = op.Constant(value_float=LOWEST_LOG_SCALE)
        masked = op.Where(lower, op.Unsqueeze(x, op.Constant(value_ints=[-2])), lowest)
        return op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=0)

    @script(ATTNREWRITE, default_opset=op)
    def LowerTriangle(size):
        ones = op.Expand(op.Constant(value_float=1.0), op.Concat(size, size, axis=0))
        return op.Cast(op.Trilu(ones, upper=0), to=BOOL)

    return RunningMax, LowerTriangle


def causal_rescaled_linear_attention_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of causal_rescaled_linear_attention: the functions it calls, then itself last.
    The carry across chunks is RescaledPrefixSum's, two levels deep instead of one (chunks x
    chunks) matrix, so compute stays near linear in N."""
    op = standard_opset(opset_version)
    RunningMax, LowerTriangle = running_max_functions(opset_version)
    ChunkRunningMax, RescaledPrefixSum = rescaled_prefix_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledKernelAttention(phi_q, phi_k, key_log_scale, v):
        # phi_q, phi_k [G, N, F], key_log_scale [G, N, 1], v [G, N, Dv].
        n = op.Shape(v, start=1, end=2)
        f = op.Shape(phi_q, start=2)
        dv = op.Shape(v, start=2)
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        c = op.Max(op.Min(op.Constant(value_ints=[chunk]), n), op.Constant(value_ints=[1]))
        zero = op.Constant(value_ints=[0])
        one = op.Constant(value_ints=[1])
        minus_one = op.Constant(value_ints=[-1])
        lowest = op.Constant(value_float=LOWEST_LOG_SCALE)
        no_more = op.Constant(value_float=0.0)
        chunks = op.Div(n + c - one, c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        q4 = op.Reshape(op.Pad(phi_q, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        k4 = op.Reshape(op.Pad(phi_k, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        v4 = op.Reshape(op.Pad(v, pads), op.Concat(minus_one, chunks, c, dv, axis=0))
        s = op.Reshape(op.Pad(key_log_scale, pads, lowest), op.Concat(minus_one, chunks, c, axis=0))
        seen = RunningMax(s, LowerTriangle(c))
        upto = ChunkRunningMax(op.Gather(seen, op.Constant(value_int=-1), axis=2))
        before = op.Pad(op.Slice(upto, zero, minus_one, one), op.Constant(value_ints=[0, 1, 0, 0]), lowest)
        ref = op.Max(seen, op.Unsqueeze(before, minus_one))
        pairs = op.Unsqueeze(s, op.Constant(value_ints=[-2])) - op.Unsqueeze(ref, minus_one)
        decay = op.Exp(op.Min(pairs, no_more))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        scores = op.Trilu(op.MatMul(q4, k4t) * decay, upper=0)
        k_rel = k4 * op.Unsqueeze(op.Exp(s - op.Unsqueeze(upto, minus_one)), minus_one)
        kv = op.MatMul(op.Transpose(k_rel, perm=[0, 1, 3, 2]), v4)
        flat_kv = op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))
        state = op.Reshape(RescaledPrefixSum(flat_kv, upto, before), op.Shape(kv))
        key_sum = RescaledPrefixSum(op.ReduceSum(k_rel, op.Constant(value_ints=[2]), keepdims=0), upto, before)
        into = op.Unsqueeze(op.Exp(op.Unsqueeze(before, minus_one) - ref), minus_one)
        last_axis = op.Constant(value_ints=[3])
        numerator = into * op.MatMul(q4, state) + op.MatMul(scores, v4)
        denominator = into * op.ReduceSum(
            q4 * op.Unsqueeze(key_sum, op.Constant(value_ints=[2])), last_axis, keepdims=1
        ) + op.ReduceSum(scores, last_axis, keepdims=1)
        out = op.Reshape(
            numerator / (denominator + op.Constant(value_float=eps)),
            op.Concat(minus_one, chunks * c, dv, axis=0),
        )
        return op.Slice(out, zero, n, one)

    return with_callees(CausalRescaledKernelAttention)


def windowed_kernel_attention_functions(
    opset_version: int,
    window: int,
    scale: float,
    causal: bool,
    *,
    window_next: bool,
    sinks: int,
    rescaled: bool = False,
    max_weighted: bool = False,
    eps: float = DENOMINATOR_EPS,
    far_chunk: int = WINDOW_FAR_CHUNK,
):
    """ONNX form of windowed_kernel_attention: the functions it calls, then itself last.

    The entry reads (phi_q, phi_k, q, k, v, key_keep, linear_log_weight), q, k and key_keep as
    window_inputs_function gives them and phi_q, phi_k taken of those q and k (causal: [..., N, *],
    key_keep broadcastable to [..., N, 1]), v [..., N, Dv] as it is, with ``rescaled`` also
    (query_log_scale, key_log_scale) after phi_k and, ``max_weighted``, local_max_weight last;
    it returns float32 [..., N, Dv]. Blocks are laid out as _ChunkLayout does (padded at the
    front), so both lowerings pick the same keys; ``causal``, ``window_next`` and ``sinks``
    choose the bodies at rewrite time, each in the builder below that reads it. ``far_chunk``:
    the positions per chunk of a causal window's far part (rounded to whole blocks), a matter
    of speed only.
    """
    op = standard_opset(opset_version)
    blocks = _window_block_functions(op, window, aligned_to_start=causal)
    flatten = flatten_heads_function(opset_version)
    if not causal:
        pieces = _paired_window_functions(op, blocks, flatten, window, scale, window_next, sinks, eps)
        return with_callees(_paired_window_entry(op, flatten, *pieces, rescaled, max_weighted))
    pieces = _causal_paired_window_functions(opset_version, blocks, flatten, window, scale, sinks, eps, far_chunk)
    return with_callees(_causal_paired_entry(op, flatten, pieces, rescaled, max_weighted))


def window_inputs_function(opset_version: int, window: int, causal: bool):
    """WindowInputs(q, k, key_keep) -> (q, k, keep): the q, k and key_keep a windowed kernel's
    entry reads, and the q and k its pass maps to phi_q, phi_k and log scales. Bidirectional:
    the window's rows [..., rows, *] (zero rows around the N positions, keep float
    [..., rows, 1], 0 on them), so the feature maps run on the rows and no [..., N, F] feature
    tensor is copied into them; causal: as they are."""
    op = standard_opset(opset_version)
    if causal:

        @script(ATTNREWRITE, default_opset=op)
        def CausalWindowInputs(q, k, key_keep):
            return op.Identity(q), op.Identity(k), op.Identity(key_keep)

        return CausalWindowInputs
    blocks = _window_block_functions(op, window, aligned_to_start=False)
    FrontPad, RowCount = blocks.FrontPad, _pair_layout_functions(op, blocks, window, False, 0).RowCount

    @script(ATTNREWRITE, default_opset=op)
    def WindowInputs(q, k, key_keep):
        n = op.Shape(k, start=-2, end=-1)
        front = FrontPad(n)
        pads, axis = op.Concat(front, RowCount(n) - front - n, axis=0), op.Constant(value_ints=[-2])
        zero = op.Constant(value_float=0.0)
        keep = op.Expand(
            op.Cast(key_keep, to=FLOAT), op.Concat(op.Shape(k, end=-1), op.Constant(value_ints=[1]), axis=0)
        )
        q_rows = op.Pad(q, pads, op.CastLike(zero, q), axis)
        return q_rows, op.Pad(k, pads, op.CastLike(zero, k), axis), op.Pad(keep, pads, zero, axis)

    return WindowInputs


class _WindowBlocks(typing.NamedTuple):
    """The windowed functions' layout, [G, N, F] <-> [G, chunks, window, F] (_ChunkLayout's),
    and moves of whole blocks along axis 1."""

    BlockCount: OnnxFunction
    FrontPad: OnnxFunction
    WindowBlocks: OnnxFunction
    ShiftBlocks: OnnxFunction


def _window_block_functions(op, window: int, aligned_to_start: bool) -> _WindowBlocks:
    @script(ATTNREWRITE, default_opset=op)
    def BlockCount(n):
        """[1]: the blocks of N positions, ceil(N/window) + 1 (_ChunkLayout's count)."""
        w = op.Constant(value_ints=[window])
        return op.Div(n + w + w - op.Constant(value_ints=[1]), w)

    @script(ATTNREWRITE, default_opset=op)
    def EndAlignedFrontPad(n):
        """[1]: the rows in front of N positions, so that the last block ends with the last one."""
        return BlockCount(n) * op.Constant(value_ints=[window]) - n

    @script(ATTNREWRITE, default_opset=op)
    def StartAlignedFrontPad(n):
        """[1]: one block in front, so that position p lies in block p // window + 1 (causal)."""
        return op.Constant(value_ints=[window])

    FrontPad = StartAlignedFrontPad if aligned_to_start else EndAlignedFrontPad

    @script(ATTNREWRITE, default_opset=op)
    def WindowBlocks(x, fill):
        """[G, N, F] -> [G, chunks, window, F], FrontPad rows in front, the rest of the
        BlockCount blocks at the end."""
        n = op.Shape(x, start=1, end=2)
        w = op.Constant(value_ints=[window])
        zero = op.Constant(value_ints=[0])
        chunks = BlockCount(n)
        front = FrontPad(n)
        pads = op.Concat(zero, front, zero, zero, chunks * w - front - n, zero, axis=0)
        shape = op.Concat(op.Constant(value_ints=[-1]), chunks, w, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill), shape)

    @script(ATTNREWRITE, default_opset=op)
    def ShiftBlocks(x, fill, steps):
        """x moved ``steps`` blocks later along axis 1, fill first."""
        one = op.Constant(value_ints=[1])
        shifted = op.Pad(x, op.Concat(steps, op.Constant(value_ints=[0]), axis=0), fill, one)
        return op.Slice(shifted, op.Constant(value_ints=[0]), op.Neg(steps), one)

    return _WindowBlocks(BlockCount, FrontPad, WindowBlocks, ShiftBlocks)


def _local_key_pieces(op, blocks: _WindowBlocks, window: int):
    """(KeptLocalKeys, WithPreviousBlock, CausalKeptLocalKeys) of the recurrent window: which
    keys are kept, a causal block's local blocks of [G, chunks, window, F] and which of them a
    query takes, from their keep flags."""
    ShiftBlocks = blocks.ShiftBlocks

    @script(ATTNREWRITE, default_opset=op)
    def WithPreviousBlock(x4):
        """[G, chunks, window, F] -> [G, chunks, 2 * window, F]: block c-1's rows, then c's."""
        previous = ShiftBlocks(x4, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Concat(previous, x4, axis=2)

    @script(ATTNREWRITE, default_opset=op)
    def KeptLocalKeys(keep_local):
        return op.Greater(op.Transpose(keep_local, perm=[0, 1, 3, 2]), op.Constant(value_float=0.0))

    @script(ATTNREWRITE, default_opset=op)
    def CausalKeptLocalKeys(keep_local):
        # all of the previous block, the own block up to the query itself
        ones = op.Expand(op.Constant(value_float=1.0), op.Constant(value_ints=[window, 2 * window]))
        visible = op.Cast(op.Trilu(ones, op.Constant(value_int=window), upper=0), to=BOOL)
        return op.And(KeptLocalKeys(keep_local), visible)

    return KeptLocalKeys, WithPreviousBlock, CausalKeptLocalKeys


def _without_sinks_function(op, sinks: int):
    """WithoutSinks(x, fill): [G, N, F] with the sinks' rows set to fill, or NoSinks: x as it is."""

    @script(ATTNREWRITE, default_opset=op)
    def WithoutSinks(x, fill):
        """[G, N, F] with rows 0..sinks-1 set to fill: the kernel never sees a sink key."""
        n = op.Squeeze(op.Shape(x, start=1, end=2))
        position = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
        sink = op.Unsqueeze(op.Less(position, op.Constant(value_int=sinks)), op.Constant(value_ints=[0, 2]))
        return op.Where(sink, fill, x)

    @script(ATTNREWRITE, default_opset=op)
    def NoSinks(x, fill):
        return op.Identity(x)

    return WithoutSinks if sinks else NoSinks


def _local_softmax_sums_function(op, scale: float):
    @script(ATTNREWRITE, default_opset=op)
    def LocalSoftmaxSums(q4, k_x, v_x, allowed):
        """Numerator, denominator and row max m_i of the softmax over each block's exact keys."""
        logits = op.MatMul(q4, op.Transpose(k_x, perm=[0, 1, 3, 2])) * op.Constant(value_float=scale)
        scores = op.Where(allowed, logits, op.Constant(value_float=LOWEST_LOG_SCALE))
        last = op.Constant(value_ints=[-1])
        row_max = op.ReduceMax(scores, last, keepdims=1)
        weights = op.Exp(scores - row_max) * op.Cast(allowed, to=FLOAT)
        return op.MatMul(weights, v_x), op.ReduceSum(weights, last, keepdims=1), row_max

    return LocalSoftmaxSums


def _kernel_sums_function(op):
    """KernelSums(pq4, far_kv, far_key_sum): a query block's kernel numerator and denominator
    from the state and key sum of its far keys (the recurrent window's)."""

    @script(ATTNREWRITE, default_opset=op)
    def KernelSums(pq4, far_kv, far_key_sum):
        numerator = op.MatMul(pq4, far_kv)
        weighted = pq4 * op.Unsqueeze(far_key_sum, op.Constant(value_ints=[2]))
        return numerator, op.ReduceSum(weighted, op.Constant(value_ints=[-1]), keepdims=1)

    return KernelSums


# A causal window's far part by chunks of P blocks, as a chunked causal kernel computes it, from
# the rows themselves (no per-block state, no block copy of phi): query chunk k holds blocks
# kP .. kP + P - 1 of the window's layout, key chunk k the same rows one block earlier (blocks
# kP - 1 .. kP + P - 2). Every key chunk before k is far for all of query chunk k (its last block
# is kP - 2): one exclusive prefix of per-chunk states [G, N / (P W), F, Dv + 1]. Inside key
# chunk k, query block kP + a takes key block kP - 1 + b where b <= a - 1: a block-strictly-lower
# mask on the [P W, P W] kernel scores; for P = 2 (the default's at W = 32) that is one [W, W]
# product, query block 1 with key block 0 (WithinPairSums). No local key enters and leaves again,
# so the far sums are sums of far terms only, rounded as a per-block state's.


def _chunked_far_sums_functions(
    opset_version: int, blocks: _WindowBlocks, pairs: _PairLayout, flatten, without_sinks, window: int, far_chunk: int
):
    """(FarSums, RescaledFarSums), causal: the kernel's sums [G, rows, Dv + 1] over each query
    block's far keys (blocks <= c-2), by chunks of P ~ far_chunk / W blocks (the comment above),
    from rows [G, N, *] (phi_q, phi_k zero on the sinks, v) to the rows of ``pairs``;
    with per-key log scales in units of R_c, the max of s over block c's far keys (the lowest log
    scale if none), which it returns too, [G, rows, 1]."""
    op = standard_opset(opset_version)
    per_chunk = max(1, round(far_chunk / window))
    QueryChunks, KeyChunks, ValueChunks, BlockChunks, AsPairRows = _far_chunk_layout_functions(
        op, blocks, pairs, window, per_chunk
    )
    WithinChunkSums, EarlierKeys = _within_chunk_functions(op, window, per_chunk)
    ExclusivePrefixSum = exclusive_prefix_sum_function(opset_version)
    ChunkRunningMax, RescaledPrefixSum = rescaled_prefix_functions(opset_version)
    WindowBlocks, ShiftBlocks, BlockValueRows = blocks.WindowBlocks, blocks.ShiftBlocks, pairs.BlockValueRows

    @script(ATTNREWRITE, default_opset=op)
    def PerQueryBlock(x_c, factor):
        """[G, chunks', P W, X] times factor [G, chunks', P], one per query block."""
        rows = op.Reshape(x_c, op.Concat(op.Shape(factor), op.Constant(value_ints=[window, -1]), axis=0))
        return op.Reshape(rows * op.Unsqueeze(factor, op.Constant(value_ints=[3, 4])), op.Shape(x_c))

    @script(ATTNREWRITE, default_opset=op)
    def FarSums(pq, pk, v):
        zero = op.Constant(value_float=0.0)
        q_c, k_c, vo_c = QueryChunks(pq, zero), KeyChunks(pk, zero), ValueChunks(v)
        kv = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), vo_c)  # [G, chunks', F, Dv + 1]
        state = op.Reshape(ExclusivePrefixSum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))), op.Shape(kv))
        return AsPairRows(op.MatMul(q_c, state) + WithinChunkSums(q_c, k_c, vo_c, EarlierKeys()), v)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledFarSums(pq, pk, v, key_log_scale):
        """Chunk states relative to their own max U, carried to B_k (the max over the chunks
        before, RescaledPrefixSum's reference) and then to R_c >= B_k; inside a chunk each
        term e^(s_j - R_c) directly: every factor <= 1. The sinks' phi_k need not be zero: their
        lowest log scale weighs them e^(LOWEST_LOG_SCALE - x) = 0 against any x >=
        NO_EXACT_KEY_SHIFT, the least U and R_c taken here."""
        zero, lowest = op.Constant(value_float=0.0), op.Constant(value_float=LOWEST_LOG_SCALE)
        last, two = op.Constant(value_ints=[-1]), op.Constant(value_ints=[2])
        s_rows = without_sinks(flatten(key_log_scale), lowest)
        block_max = op.ReduceMax(op.Squeeze(WindowBlocks(s_rows, lowest), last), last, keepdims=0)
        reach = ShiftBlocks(ChunkRunningMax(block_max), lowest, two)  # R_c [G, chunks]
        least = op.Constant(value_float=NO_EXACT_KEY_SHIFT)
        r_c = BlockChunks(op.Max(reach, least))  # [G, chunks', P]
        s_c = op.Squeeze(KeyChunks(s_rows, lowest), last)  # [G, chunks', P W]
        chunk_max = op.Max(op.ReduceMax(s_c, last, keepdims=0), least)
        before = ShiftBlocks(ChunkRunningMax(chunk_max), lowest, op.Constant(value_ints=[1]))
        q_c, k_c, vo_c = QueryChunks(pq, zero), KeyChunks(pk, zero), ValueChunks(v)
        # the chunk's keys relative to U, the factors on the values side (Dv + 1 columns, not F)
        vo_rel = vo_c * op.Unsqueeze(op.Exp(s_c - op.Unsqueeze(chunk_max, last)), last)
        kv = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), vo_rel)
        flat = RescaledPrefixSum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1])), chunk_max, before)
        into = op.Exp(op.Min(op.Unsqueeze(before, last) - r_c, zero))  # B_k to R_c, per query block
        carried = PerQueryBlock(op.MatMul(q_c, op.Reshape(flat, op.Shape(kv))), into)
        decay = op.Exp(op.Min(op.Unsqueeze(s_c, two) - op.Unsqueeze(r_c, last), zero))  # [G, chunks', P, P W]
        weight = op.Unsqueeze(decay, op.Constant(value_ints=[3])) * EarlierKeys()
        n = op.Shape(v, start=1, end=2)
        return AsPairRows(carried + WithinChunkSums(q_c, k_c, vo_c, weight), v), BlockValueRows(reach, lowest, n)

    return FarSums, RescaledFarSums


def _far_chunk_layout_functions(op, blocks: _WindowBlocks, pairs: _PairLayout, window: int, per_chunk: int):
    """The layout of _chunked_far_sums_functions for chunks of ``per_chunk`` blocks: QueryChunks,
    KeyChunks and ValueChunks (rows [G, N, F] -> [G, chunks', P W, F], the window's FrontPad in
    front, the keys one block later, [v, 1]), BlockChunks (one value per block [G, chunks] -> [G, chunks', P]) and
    AsPairRows (query chunks [G, chunks', P W, X] -> the rows of ``pairs`` [G, rows, X], the
    same layout for P = 2). chunks' = (chunks + P) // P leaves the keys room to move a block."""
    BlockCount, FrontPad, RowCount = blocks.BlockCount, blocks.FrontPad, pairs.RowCount
    size = per_chunk * window

    @script(ATTNREWRITE, default_opset=op)
    def ChunkRows(n):
        """[1]: the rows of (BlockCount(n) + P) // P chunks."""
        p = op.Constant(value_ints=[per_chunk])
        return op.Div(BlockCount(n) + p, p) * op.Constant(value_ints=[size])

    @script(ATTNREWRITE, default_opset=op)
    def InChunks(x, fill, front, columns):
        """``front`` rows of fill before x [G, N, F], the chunks' rest after it, ``columns``
        more of fill at the end of each row."""
        n = op.Shape(x, start=1, end=2)
        zero = op.Constant(value_ints=[0])
        pads = op.Concat(front, zero, ChunkRows(n) - front - n, columns, axis=0)
        padded = op.Pad(x, pads, fill, op.Constant(value_ints=[1, 2]))
        return op.Reshape(padded, op.Concat(op.Constant(value_ints=[0, -1, size]), op.Shape(padded, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def QueryChunks(x, fill):
        return InChunks(x, fill, FrontPad(op.Shape(x, start=1, end=2)), op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def KeyChunks(x, fill):
        front = FrontPad(op.Shape(x, start=1, end=2)) + op.Constant(value_ints=[window])
        return InChunks(x, fill, front, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def ValueChunks(v):
        """KeyChunks of [v, 1] (the denominator as one more value), ones in the padding rows too:
        a padding key weighs 0 whatever its value (zero phi_k, or the lowest log scale)."""
        front = FrontPad(op.Shape(v, start=1, end=2)) + op.Constant(value_ints=[window])
        return InChunks(v, op.Constant(value_float=1.0), front, op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def BlockChunks(x):
        chunks, p = op.Shape(x, start=1, end=2), op.Constant(value_ints=[per_chunk])
        pads = op.Concat(op.Constant(value_ints=[0]), op.Div(chunks + p, p) * p - chunks, axis=0)
        padded = op.Pad(x, pads, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Reshape(padded, op.Constant(value_ints=[0, -1, per_chunk]))

    @script(ATTNREWRITE, default_opset=op)
    def ChunksAsPairs(sums, v):
        """Query chunks of pairs of blocks are the pairs."""
        return op.Reshape(sums, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(sums, start=3), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def ChunksAsPairRows(sums, v):
        """The chunks' first rows, as many as the pairs have (both hold every block, from the
        same FrontPad), zero after them."""
        count = RowCount(op.Shape(v, start=1, end=2))
        zero = op.Constant(value_ints=[0])
        kept = op.Slice(ChunksAsPairs(sums, v), zero, count, op.Constant(value_ints=[1]))
        missing = count - op.Shape(kept, start=1, end=2)
        return op.Pad(kept, op.Concat(zero, zero, zero, zero, missing, zero, axis=0), op.Constant(value_float=0.0))

    as_pair_rows = ChunksAsPairs if per_chunk == 2 else ChunksAsPairRows
    return QueryChunks, KeyChunks, ValueChunks, BlockChunks, as_pair_rows


def _within_chunk_functions(op, window: int, per_chunk: int):
    """(WithinChunkSums, EarlierKeys) of _chunked_far_sums_functions: the weighted kernel scores
    inside a chunk times values (WithinPairSums for P = 2; nothing for P = 1, where every key of
    key chunk k is local to query chunk k), and which key columns a query block takes inside its
    chunk, [P, 1, P W]."""
    size = per_chunk * window
    key_block, query_block = np.arange(size) // window, np.arange(per_chunk)
    earlier = numpy_helper.from_array((key_block[None, :] < query_block[:, None]).astype(np.float32)[:, None, :])

    @script(ATTNREWRITE, default_opset=op)
    def WithinChunkSums(q_c, k_c, vo_c, weight):
        """sum over key j of key chunk k of weight[a, j] phi_q_i.phi_k_j [v_j, 1], a = i's block in
        the chunk; weight [..., P, 1, P W]."""
        scores = op.MatMul(q_c, op.Transpose(k_c, perm=[0, 1, 3, 2]))
        by_block = op.Reshape(scores, op.Constant(value_ints=[0, 0, per_chunk, window, size]))
        return op.MatMul(op.Reshape(by_block * weight, op.Shape(scores)), vo_c)

    @script(ATTNREWRITE, default_opset=op)
    def WithinPairSums(q_c, k_c, vo_c, weight):
        """WithinChunkSums for P = 2: only key block 0 is taken inside the chunk (by query block 1;
        query block 0's weights are 0): [2W, W] products instead of [2W, 2W], and no copy of a
        query block."""
        zero, window_end = op.Constant(value_ints=[0]), op.Constant(value_ints=[window])
        rows, last = op.Constant(value_ints=[2]), op.Constant(value_ints=[-1])
        earlier_k = op.Slice(k_c, zero, window_end, rows)  # [G, chunks', W, F]
        earlier_vo = op.Slice(vo_c, zero, window_end, rows)
        taken = op.Slice(weight, zero, window_end, last)  # [..., 2, 1, W]
        scores = op.MatMul(q_c, op.Transpose(earlier_k, perm=[0, 1, 3, 2]))  # [G, chunks', 2W, W]
        by_block = op.Reshape(scores, op.Constant(value_ints=[0, 0, 2, window, window])) * taken
        return op.MatMul(op.Reshape(by_block, op.Shape(scores)), earlier_vo)

    @script(ATTNREWRITE, default_opset=op)
    def NoKeysWithinChunk(q_c, k_c, vo_c, weight):
        return op.Constant(value_float=0.0)

    @script(ATTNREWRITE, default_opset=op)
    def EarlierKeys():
        return op.Constant(value=earlier)

    within = {1: NoKeysWithinChunk, 2: WithinPairSums}.get(per_chunk, WithinChunkSums)
    return within, EarlierKeys


# --- ONNX: bidirectional windows in pairs of blocks ----------------------------------------------
# Block c's local keys are blocks c-1, c and c+1: rows that overlap from one block to the next,
# which onnxruntime lays out only by copying them (three shifted copies of k, v, phi_k and the keep
# flags cost more than the exact part's products). In pairs of blocks (0, 1), (2, 3), ... (a
# reshape of the rows), a query block meets its own block and one neighbour inside its
# pair; the other neighbour (block 2p-1 for block 2p, 2p+2 for 2p+1) comes from one gather of
# whole blocks per tensor: [W, 2W] and [W, W] products per block, none wasted, and every per-row
# value in one layout.
#
# The far part folds into the same products: with the exact part scaled by e^-max(t, 0) (folded into
# its exponent's shift) and the kernel part by b_i = e^min(t, 0) (t the log ratio of the two parts'
# units), row i's sums are
#     sum_local (e^(s_ij - shift_i) - b_i phi_q_i.phi_k_j) [v_j, 1] + sum_sinks e^(s_ij - shift_i) [v_j, 1]
#     + b_i phi_q_i.[S, z]
# ([v, 1]: the denominator as one more column of values; [S, z] = sum_j phi_k_j [v_j, 1]^T over the
# whole sequence), so the local keys take one weight block and one product with values.


def _pair_structure(window: int, following: bool, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Which local keys a pair's queries take: [2W, 2W] of the pair's own keys (its own block and
    the other one of the pair, the next only ``following``; ``causal``: no key after the query),
    and [2, 1, 1] of the neighbours outside the pair (block 2p takes block 2p-1; block 2p+1 takes
    2p+2 only ``following``)."""
    if causal:  # inside a pair every earlier key is local: its own block's or the one before
        return np.tri(2 * window, dtype=bool), np.array([True, False]).reshape(2, 1, 1)
    block = np.arange(2 * window) // window
    offset = block[None, :] - block[:, None]  # key's block - query's
    in_pair = (offset >= -1) & (offset <= int(following))
    return in_pair, np.array([True, following]).reshape(2, 1, 1)


class _PairLayout(typing.NamedTuple):
    """[G, N, F] -> the rows of the pairs [G, pairs * 2W, F] (PairRows, ValuesAndOnes), seen as
    [G, pairs, 2W, F] (Pairs), [G, pairs, 2, W, F] (Blocks) or the neighbours outside each pair
    (Neighbours), back to rows (Rows), and the rows' masks."""

    PairRows: OnnxFunction
    ValuesAndOnes: OnnxFunction
    Pairs: OnnxFunction
    Blocks: OnnxFunction
    Neighbours: OnnxFunction
    Rows: OnnxFunction
    HasFarKeys: OnnxFunction
    SinkTaken: OnnxFunction
    RowCount: OnnxFunction
    BlockValueRows: OnnxFunction


def _pair_layout_functions(
    op, blocks: _WindowBlocks, window: int, following: bool, sinks: int, causal: bool = False
) -> _PairLayout:
    BlockCount, FrontPad = blocks.BlockCount, blocks.FrontPad
    pair = 2 * window
    # the neighbours outside a pair that anyone takes: block 2p-1, and 2p+2 only ``following``
    neighbour_offsets = [-1, 2] if following else [-1]

    @script(ATTNREWRITE, default_opset=op)
    def PairCount(n):
        """[1]: BlockCount // 2 + 1 pairs of blocks: the last block is padding."""
        return op.Div(BlockCount(n), op.Constant(value_ints=[2])) + op.Constant(value_ints=[1])

    @script(ATTNREWRITE, default_opset=op)
    def RowCount(n):
        """[1]: the rows of the pairs."""
        return PairCount(n) * op.Constant(value_ints=[pair])

    @script(ATTNREWRITE, default_opset=op)
    def RowPads(n, column):
        """Pad's pads for [G, N, F] -> [G, PairCount * 2W, F + column]: FrontPad rows in front."""
        front, zero = FrontPad(n), op.Constant(value_ints=[0])
        return op.Concat(zero, front, zero, zero, RowCount(n) - front - n, column, axis=0)

    @script(ATTNREWRITE, default_opset=op)
    def BlockValueRows(x, fill, n):
        """[G, chunks] of the window's blocks -> [G, rows, 1]: each block's value on its rows,
        fill on the blocks after them."""
        count = op.Div(RowCount(n), op.Constant(value_ints=[window]))
        pads = op.Concat(op.Constant(value_ints=[0, 0, 0]), count - op.Shape(x, start=1, end=2), axis=0)
        per_block = op.Unsqueeze(op.Pad(x, pads, fill), op.Constant(value_ints=[2]))
        rows = op.Expand(per_block, op.Concat(op.Shape(x, end=1), count, op.Constant(value_ints=[window]), axis=0))
        return op.Reshape(rows, op.Constant(value_ints=[0, -1, 1]))

    @script(ATTNREWRITE, default_opset=op)
    def PairRows(x, fill):
        """[G, N, F] -> [G, pairs * 2W, F], the window layout's rows, fill around them."""
        return op.Pad(x, RowPads(op.Shape(x, start=1, end=2), op.Constant(value_ints=[0])), fill)

    @script(ATTNREWRITE, default_opset=op)
    def ValuesAndOnes(v):
        """PairRows of [v, 1] (the denominator as one more value), ones in the padding rows
        too: a padding key weighs 0 in both parts whatever its value (phi_k is 0 there)."""
        pads = RowPads(op.Shape(v, start=1, end=2), op.Constant(value_ints=[1]))
        return op.Pad(v, pads, op.Constant(value_float=1.0))

    @script(ATTNREWRITE, default_opset=op)
    def Pairs(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2W, F]."""
        return op.Reshape(rows, op.Concat(op.Constant(value_ints=[0, -1, pair]), op.Shape(rows, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def Blocks(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2, W, F]: each pair's two blocks."""
        return op.Reshape(rows, op.Concat(op.Constant(value_ints=[0, -1, 2, window]), op.Shape(rows, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def Neighbours(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2 or 1, W, F]: for pair p, blocks 2p-1 and 2p+2, or
        2p-1 alone (the last block, and the first, where those are outside the rows: both are
        padding)."""
        block_rows = op.Reshape(
            rows, op.Concat(op.Constant(value_ints=[0, -1, window]), op.Shape(rows, start=2), axis=0)
        )
        count = op.Shape(block_rows, start=1, end=2)
        first = op.Unsqueeze(
            op.Range(op.Constant(value_int=0), op.Squeeze(count), op.Constant(value_int=2)), op.Constant(value_ints=[1])
        )
        index = op.Mod(first + op.Constant(value_ints=neighbour_offsets), count)  # [pairs, 2 or 1]
        return op.Gather(block_rows, index, axis=1)

    @script(ATTNREWRITE, default_opset=op)
    def Rows(pairs):
        """[G, pairs, 2W, F] or [G, pairs, 2, W, F] -> [G, pairs * 2W, F]."""
        return op.Reshape(pairs, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(pairs, start=-1), axis=0))

    HasFarKeys, SinkTaken = _pair_row_mask_functions(op, blocks, PairCount, window, following, sinks, causal)
    return _PairLayout(
        PairRows, ValuesAndOnes, Pairs, Blocks, Neighbours, Rows, HasFarKeys, SinkTaken, RowCount, BlockValueRows
    )


def _pair_row_mask_functions(
    op, blocks: _WindowBlocks, PairCount, window: int, following: bool, sinks: int, causal: bool
):
    """(HasFarKeys, SinkTaken) of _PairLayout: per row of the pairs, whether its block has far
    keys, and which sinks it takes as extra exact keys (``causal``: only those before its
    previous block, never one after the query)."""
    BlockCount, FrontPad = blocks.BlockCount, blocks.FrontPad
    pair = 2 * window
    far_gap = 2 if following else 1  # the first later block the kernel covers, from block c
    sink_positions = list(range(max(sinks, 1)))

    @script(ATTNREWRITE, default_opset=op)
    def RowBlocks(n):
        """[rows, 1]: the window block of each row."""
        rows = op.Squeeze(PairCount(n) * op.Constant(value_ints=[pair]))
        position = op.Range(op.Constant(value_int=0), rows, op.Constant(value_int=1))
        return op.Unsqueeze(op.Div(position, op.Constant(value_int=window)), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def HasFarKeys(n):
        """[rows, 1]: whether a row's block has far blocks with keys (block 0 is padding)."""
        block = RowBlocks(n)
        earlier = op.GreaterOrEqual(block, op.Constant(value_int=3))
        return op.Or(earlier, op.Less(block + op.Constant(value_int=far_gap), BlockCount(n)))

    @script(ATTNREWRITE, default_opset=op)
    def SinkOffsets(n):
        """[rows, sinks]: sink s's block less each row's (sink s at s + FrontPad)."""
        at = op.Div(op.Constant(value_ints=sink_positions) + FrontPad(n), op.Constant(value_ints=[window]))
        return at - RowBlocks(n)

    @script(ATTNREWRITE, default_opset=op)
    def SinkTaken(n):
        """[rows, sinks]: whether a row takes sink s as an extra exact key, s lying outside its
        block's local keys (kernels._paired_sink_mask)."""
        offset = SinkOffsets(n)
        outside_before, outside_after = (
            op.Less(offset, op.Constant(value_int=-1)),
            op.Greater(offset, op.Constant(value_int=int(following))),
        )
        return op.Or(outside_before, outside_after)

    @script(ATTNREWRITE, default_opset=op)
    def CausalSinkTaken(n):
        """SinkTaken of a causal row: only sinks before its previous block, all earlier than it."""
        return op.Less(SinkOffsets(n), op.Constant(value_int=-1))

    return HasFarKeys, CausalSinkTaken if causal else SinkTaken


def _pair_structure_functions(op, every_key: bool):
    """(Taken(logits, structure), LocalTerms(kernel, structure)): the logits (MASKED_LOGIT_BIAS
    added elsewhere) and kernel terms (0 elsewhere) where ``structure`` takes the key, or with
    ``every_key`` (window_next: all of a pair's keys are local, both structures all true) the
    tensors as they are, not full-size masks of ones."""

    @script(ATTNREWRITE, default_opset=op)
    def StructureTaken(logits, structure):
        # an added bias and a product (each folded once from the constant structure):
        # onnxruntime broadcasts them over [.., 2W, 2W] several times faster than Where
        zero, masked = op.Constant(value_float=0.0), op.Constant(value_float=MASKED_LOGIT_BIAS)
        return logits + op.Where(structure, zero, masked)

    @script(ATTNREWRITE, default_opset=op)
    def StructureTerms(kernel, structure):
        return kernel * op.Cast(structure, to=FLOAT)

    @script(ATTNREWRITE, default_opset=op)
    def AllTaken(logits, structure):
        return op.Identity(logits)

    @script(ATTNREWRITE, default_opset=op)
    def AllTerms(kernel, structure):
        return op.Identity(kernel)

    return (AllTaken, AllTerms) if every_key else (StructureTaken, StructureTerms)


class _PairedParts(typing.NamedTuple):
    """ExactLogits(q, k, keep) -> (logits in pairs and of the neighbours, row max [G, rows, 1])
    and WeightedSums(logits..., shift, far_weight, phi_q, phi_k, v) -> [G, rows, Dv + 1] (module
    comment above): with sinks, one more logits tensor [G, rows, sinks] after the neighbours'."""

    ExactLogits: OnnxFunction
    WeightedSums: OnnxFunction


def _paired_parts_functions(
    op, blocks: _WindowBlocks, pairs: _PairLayout, window: int, scale: float, following: bool, sinks: int
) -> _PairedParts:
    """The bidirectional window's exact logits and its sums with the local kernel terms folded in."""
    in_pair, across = (numpy_helper.from_array(x) for x in _pair_structure(window, following))
    every_key = following  # window_next: all of a pair's keys are local, both structures all true
    logits = _paired_logits_function(op, blocks, pairs, in_pair, across, every_key, sinks, scale)
    sums = _folded_sums_function(op, pairs, in_pair, across, every_key)
    if not sinks:
        return _PairedParts(logits, sums)
    SinkRows, SinkTaken = _sink_rows_function(op, blocks, sinks), pairs.SinkTaken

    @script(ATTNREWRITE, default_opset=op)
    def PairedAndSinkSums(near, neighbour, sink, shift, far_weight, pq, pk, v_rows, n):
        """PairedSums with the sinks' terms. The state holds every key's kernel term, the sinks'
        too (zeroing their features would cost a pass over phi_k): a row that takes a sink as an
        exact key has the sink's kernel term taken out here, as PairSums does for local keys."""
        kernel = op.MatMul(pq, op.Transpose(SinkRows(pk, n), perm=[0, 2, 1]))  # [G, rows, sinks]
        weights = op.Exp(sink - shift) - far_weight * kernel * op.Cast(SinkTaken(n), to=FLOAT)
        paired = sums(near, neighbour, shift, far_weight, pq, pk, v_rows)
        return paired + op.MatMul(weights, SinkRows(v_rows, n))

    return _PairedParts(logits, PairedAndSinkSums)


def _sink_rows_function(op, blocks: _WindowBlocks, sinks: int):
    """SinkRows(rows, n): the window's rows [G, rows, F] -> [G, sinks, F], positions 0..sinks-1
    of N (the rows after FrontPad; the padding's, zero or not kept, beyond N)."""
    FrontPad = blocks.FrontPad

    @script(ATTNREWRITE, default_opset=op)
    def SinkRows(rows, n):
        front, count = FrontPad(n), op.Constant(value_ints=[sinks])
        taken = op.Slice(rows, front, front + count, op.Constant(value_ints=[1]))
        zero = op.Constant(value_ints=[0])  # more sinks than rows after FrontPad: zero rows
        missing = op.Concat(zero, zero, zero, zero, count - op.Shape(taken, start=1, end=2), zero, axis=0)
        return op.Pad(taken, missing, op.Constant(value_float=0.0))

    return SinkRows


def _paired_logits_function(
    op, blocks: _WindowBlocks, pairs: _PairLayout, in_pair, across, every_key: bool, sinks: int, scale: float
):
    """PairedLogits(q, k, keep, n) -> (near [G, pairs, 2W, 2W], neighbour [G, pairs, 2, W, W],
    row max [G, rows, 1]): the rows of q against the local keys, times ``scale`` (which
    onnxruntime folds into the products, no pass over q), where the structures
    ``in_pair`` and ``across`` take them and they are kept (keep > 0; 0 on the padding rows),
    MASKED_LOGIT_BIAS added elsewhere; with sinks PairedAndSinkLogits, the sinks' logits
    [G, rows, sinks] before the row max. n: [1], the positions (read by the sinks' form only,
    taken by both so that their callers are one)."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]
    Taken = _pair_structure_functions(op, every_key)[0]

    # A key that is not kept (padding, or the rows around N) adds MASKED_LOGIT_BIAS to its
    # logits, one bias per key: no [.., 2W, 2W] mask is built for it.

    one, lowest, zero = (rank_constant(x, 3) for x in (1.0, MASKED_LOGIT_BIAS, 0.0))  # rank_constant says why

    @script(ATTNREWRITE, default_opset=op)
    def NotTakenBias(taken):
        """[G, rows, *]: 0 where ``taken``, MASKED_LOGIT_BIAS elsewhere."""
        return (op.Constant(value=one) - op.Cast(taken, to=FLOAT)) * op.Constant(value=lowest)

    @script(ATTNREWRITE, default_opset=op)
    def PairLogits(q_rows, k_rows, bias_rows):
        """Each pair's queries against its keys [G, pairs, 2W, 2W], and their row max [G, rows, 1]."""
        keys = op.Transpose(Pairs(k_rows), perm=[0, 1, 3, 2])
        logits = op.MatMul(Pairs(q_rows), keys) * op.Constant(value_float=scale)
        bias = op.Transpose(Pairs(bias_rows), perm=[0, 1, 3, 2])
        masked = Taken(logits + bias, op.Constant(value=in_pair))
        return masked, Rows(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1))

    @script(ATTNREWRITE, default_opset=op)
    def NeighbourLogits(q_rows, k_rows, bias_rows):
        """Each block against its neighbour outside the pair [G, pairs, 2, W, W], as PairLogits."""
        keys = op.Transpose(Neighbours(k_rows), perm=[0, 1, 2, 4, 3])
        logits = op.MatMul(Blocks(q_rows), keys) * op.Constant(value_float=scale)
        bias = op.Transpose(Neighbours(bias_rows), perm=[0, 1, 2, 4, 3])
        masked = Taken(logits + bias, op.Constant(value=across))
        return masked, Rows(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1))

    @script(ATTNREWRITE, default_opset=op)
    def PairedLogits(q, k, keep, n):
        bias = NotTakenBias(op.Greater(keep, op.Constant(value=zero)))
        near, near_max = PairLogits(q, k, bias)
        neighbour, neighbour_max = NeighbourLogits(q, k, bias)
        return near, neighbour, op.Max(near_max, neighbour_max)

    if not sinks:
        return PairedLogits
    SinkRows, SinkTaken = _sink_rows_function(op, blocks, sinks), pairs.SinkTaken

    @script(ATTNREWRITE, default_opset=op)
    def PairedAndSinkLogits(q, k, keep, n):
        near, neighbour, local_max = PairedLogits(q, k, keep, n)
        logits = op.MatMul(q, op.Transpose(SinkRows(k, n), perm=[0, 2, 1])) * op.Constant(value_float=scale)
        kept = op.Transpose(op.Greater(SinkRows(keep, n), op.Constant(value_float=0.0)), perm=[0, 2, 1])
        sink = logits + NotTakenBias(op.And(kept, SinkTaken(n)))
        return near, neighbour, sink, op.Max(local_max, op.ReduceMax(sink, op.Constant(value_ints=[-1]), keepdims=1))

    return PairedAndSinkLogits


def _folded_sums_function(op, pairs: _PairLayout, in_pair, across, every_key: bool):
    """PairedSums(near, neighbour, shift, far_weight, pq, pk, v_rows) -> [G, rows, Dv + 1]: the
    bidirectional window's local sums with the local kernel terms taken out, and the far part
    (the module comment above _pair_structure), from rows; v_rows: KeptValueRows."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]
    LocalTerms = _pair_structure_functions(op, every_key)[1]

    @script(ATTNREWRITE, default_opset=op)
    def PairSums(logits, shift, far_weight, pq_rows, pk_rows, v_rows):
        """[G, rows, Dv + 1]: (e^(logits - shift) - far_weight phi_q.phi_k) [v, 1] over each
        pair's local keys; shift, far_weight: [G, rows, 1]."""
        exact = op.Exp(logits - Pairs(shift))
        kernel = op.MatMul(Pairs(pq_rows), op.Transpose(Pairs(pk_rows), perm=[0, 1, 3, 2]))
        local_kernel = LocalTerms(kernel, op.Constant(value=in_pair))
        return Rows(op.MatMul(exact - Pairs(far_weight) * local_kernel, Pairs(v_rows)))

    @script(ATTNREWRITE, default_opset=op)
    def NeighbourSums(logits, shift, far_weight, pq_rows, pk_rows, v_rows):
        """PairSums over each block's neighbour outside the pair."""
        exact = op.Exp(logits - Blocks(shift))
        kernel = op.MatMul(Blocks(pq_rows), op.Transpose(Neighbours(pk_rows), perm=[0, 1, 2, 4, 3]))
        local_kernel = LocalTerms(kernel, op.Constant(value=across))
        return Rows(op.MatMul(exact - Blocks(far_weight) * local_kernel, Neighbours(v_rows)))

    @script(ATTNREWRITE, default_opset=op)
    def PairedSums(near, neighbour, shift, far_weight, pq, pk, v_rows):
        state = op.MatMul(op.Transpose(pk, perm=[0, 2, 1]), v_rows)  # [G, F, Dv + 1]: S and z
        in_pair_sums = PairSums(near, shift, far_weight, pq, pk, v_rows)
        neighbour_sums = NeighbourSums(neighbour, shift, far_weight, pq, pk, v_rows)
        return in_pair_sums + neighbour_sums + far_weight * op.MatMul(pq, state)

    return PairedSums


def _paired_window_functions(
    op, blocks: _WindowBlocks, flatten, window: int, scale: float, following: bool, sinks: int, eps: float
):
    """RowInputs(phi_q, q, k, v, key_keep, linear_log_weight), PairedWindow(pq, pk, q, k, v, keep,
    log_ratio_offset, max_weight) -> [G, rows, Dv + 1] and Normalised(sums, q, v): the
    bidirectional window's pieces, in pairs of blocks, whatever its units. Every input but v is
    in the window's rows already (window_inputs_function), v [G, N, Dv] as it is. The log ratio of
    the kernel part's unit to the exact part's is log_ratio_offset - max_weight * m_i per row
    ([G, rows or 1, 1]; m_i the row's max exact logit)."""
    pairs = _pair_layout_functions(op, blocks, window, following, sinks)
    parts = _paired_parts_functions(op, blocks, pairs, window, scale, following, sinks)
    ExactLogits, WeightedSums, HasFarKeys = parts.ExactLogits, parts.WeightedSums, pairs.HasFarKeys
    ValuesAndOnes, UnitsOfBoth = pairs.ValuesAndOnes, _units_function(op)

    @script(ATTNREWRITE, default_opset=op)
    def KeptValueRows(v, keep):
        """[v, 1] on the rows, 0 on a key that is not kept or a padding row: such a key weighs 0
        in every sum whatever its phi_k (which need only be finite there)."""
        return ValuesAndOnes(v) * keep

    @script(ATTNREWRITE, default_opset=op)
    def Units(row_max, ratio, n):
        """UnitsOfBoth, the kernel part's weight 0 where a row has no far key."""
        shift, far_weight = UnitsOfBoth(row_max, ratio)
        return shift, far_weight * op.Cast(HasFarKeys(n), to=FLOAT)

    if sinks:

        @script(ATTNREWRITE, default_opset=op)
        def PairedWindowWithSinks(pq, pk, q, k, v, keep, log_ratio_offset, max_weight):
            n = op.Shape(v, start=1, end=2)
            near, neighbour, sink, row_max = ExactLogits(q, k, keep, n)
            ratio = log_ratio_offset - max_weight * row_max
            shift, far_weight = Units(row_max, ratio, n)
            return WeightedSums(near, neighbour, sink, shift, far_weight, pq, pk, KeptValueRows(v, keep), n)

        window_sums = PairedWindowWithSinks
    else:

        @script(ATTNREWRITE, default_opset=op)
        def PairedWindow(pq, pk, q, k, v, keep, log_ratio_offset, max_weight):
            n = op.Shape(v, start=1, end=2)
            near, neighbour, row_max = ExactLogits(q, k, keep, n)
            ratio = log_ratio_offset - max_weight * row_max
            shift, far_weight = Units(row_max, ratio, n)
            return WeightedSums(near, neighbour, shift, far_weight, pq, pk, KeptValueRows(v, keep))

        window_sums = PairedWindow

    row_inputs = _paired_inputs_functions(op, flatten, sinks)[1]
    return row_inputs, window_sums, _normalised_function(op, blocks, eps)


def _paired_inputs_functions(op, flatten, sinks: int):
    """(PairedInputs, RowInputs): the paired windows' inputs as rows, RowInputs without phi_k
    (which a kernel with per-key log scales takes as it is)."""
    without_sinks, expand_keep = _without_sinks_function(op, sinks), key_keep_function(op.version)
    per_head = _per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def RowInputs(phi_q, q, k, v, key_keep, linear_log_weight):
        """[G, N, *]: phi_q, q, k, v, keep flags, and log w_h [G, 1, 1]: the kernel part's
        weight goes into the units' log ratio (one value per row), not over phi_q."""
        keep = op.Cast(expand_keep(key_keep, k), to=FLOAT)
        return flatten(phi_q), flatten(q), flatten(k), flatten(v), keep, per_head(linear_log_weight, q)

    @script(ATTNREWRITE, default_opset=op)
    def PairedInputs(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        """RowInputs with phi_k zero on the sinks second."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = RowInputs(phi_q, q, k, v, key_keep, linear_log_weight)
        pk = without_sinks(flatten(phi_k), op.Constant(value_float=0.0))
        return pq, pk, q_rows, k_rows, v_rows, keep, log_weight

    return PairedInputs, RowInputs


def _per_head_function(op, flatten):
    @script(ATTNREWRITE, default_opset=op)
    def PerHead(x, q):
        """A value per head [heads, 1, 1] -> [G, 1, 1], G as FlattenHeads(q) has it: one value
        that broadcasts over a head's rows, not a [G, rows, 1] copy of it."""
        head_shape = op.Concat(op.Shape(q, end=-2), op.Constant(value_ints=[1, 1]), axis=0)
        return flatten(op.Expand(op.Cast(x, to=FLOAT), head_shape))

    return PerHead


def _units_function(op):
    # [G, rows, 1] against constants of their rank (rank_constant says why)
    least_shift, rows_zero = rank_constant(NO_EXACT_KEY_SHIFT, 3), rank_constant(0.0, 3)

    @script(ATTNREWRITE, default_opset=op)
    def UnitsOfBoth(row_max, ratio):
        """The exact part's shift and the kernel part's weight per row, from ``ratio``, the log of
        (kernel part's unit / exact part's unit): e^-max(ratio, 0) folded into the shift and
        e^min(ratio, 0), so neither part overflows."""
        zero = op.Constant(value=rows_zero)
        shift = op.Max(row_max + op.Max(ratio, zero), op.Constant(value=least_shift))
        return shift, op.Exp(op.Min(ratio, zero))

    return UnitsOfBoth


def _normalised_function(op, blocks: _WindowBlocks, eps: float):
    FrontPad, eps_rows = blocks.FrontPad, rank_constant(eps, 3)

    @script(ATTNREWRITE, default_opset=op)
    def Normalised(sums, q, v):
        """[G, rows, Dv + 1] -> q's leading axes + [N, Dv]: the numerator over the denominator
        (the last column) on the N rows after FrontPad (q as it is or in the window's rows)."""
        n = op.Shape(v, start=-2, end=-1)
        front, dv = FrontPad(n), op.Shape(v, start=-1)
        axes, zero, one = op.Constant(value_ints=[1, 2]), op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        numerator = op.Slice(sums, op.Concat(front, zero, axis=0), op.Concat(front + n, dv, axis=0), axes)
        denominator = op.Slice(sums, op.Concat(front, dv, axis=0), op.Concat(front + n, dv + one, axis=0), axes)
        out = numerator / (denominator + op.Constant(value=eps_rows))
        return op.Reshape(out, op.Concat(op.Shape(q, end=-2), n, dv, axis=0))

    return Normalised


def _paired_window_entry(op, flatten, row_inputs, window_sums, normalised, rescaled: bool, max_weighted: bool):
    """WindowedKernelAttention, WindowedRescaledKernelAttention or WindowedMaxWeightedKernelAttention
    (inputs as windowed_kernel_attention_functions says, ``key_log_scale`` one per head), bidirectional."""
    per_head = _per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)  # both parts in one unit already, but for w_h
        return normalised(window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, log_weight, zero), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedRescaledKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
    ):
        """The kernel part in units of e^(a_i + b_h) (one key log scale per head), the exact
        part's e^(m_i)."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        offset = flatten(query_log_scale) + flatten(key_log_scale) + log_weight
        one = op.Constant(value_float=1.0)
        return normalised(window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, offset, one), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedMaxWeightedKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
    ):
        """As WindowedRescaledKernelAttention with the kernel part moved by e^(-beta_h m_i),
        beta_h = local_max_weight [heads, 1, 1]."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        offset = flatten(query_log_scale) + flatten(key_log_scale) + log_weight
        sums = window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, offset, per_head(local_max_weight, q))
        return normalised(sums, q, v)

    if not rescaled:
        return WindowedKernelAttention
    return WindowedMaxWeightedKernelAttention if max_weighted else WindowedRescaledKernelAttention


# --- ONNX: causal windows in pairs of blocks -----------------------------------------------------
# Causal block c takes all of block c-1 and its own block up to the query. In the pairs of the
# bidirectional layout (aligned to the start here), block 2p+1 finds both inside its pair and
# block 2p its own there and block 2p-1 in the one gather: the lower triangle of each pair's
# [2W, 2W] logits and one [W, W] neighbour product per block, no shifted copy. The far part is
# the chunked causal kernel (_chunked_far_sums_functions) on the same rows; both parts share one
# normaliser, the exact part's shift and the kernel part's weight as in the bidirectional window.


class _CausalPairedPieces(typing.NamedTuple):
    """What the causal paired entries call: PairedInputs and RowInputs, CausalPairedWindow(far,
    log_ratio_offset, max_weight, q, k, v, keep) -> [G, rows, Dv + 1], the far sums (plain and
    rescaled), Normalised and PairRows."""

    inputs: OnnxFunction
    row_inputs: OnnxFunction
    window_sums: OnnxFunction
    far_sums: OnnxFunction
    rescaled_far_sums: OnnxFunction
    normalised: OnnxFunction
    pair_rows: OnnxFunction


def _causal_paired_window_functions(
    opset_version: int,
    blocks: _WindowBlocks,
    flatten,
    window: int,
    scale: float,
    sinks: int,
    eps: float,
    far_chunk: int,
) -> _CausalPairedPieces:
    op = standard_opset(opset_version)
    pairs = _pair_layout_functions(op, blocks, window, following=False, sinks=sinks, causal=True)
    in_pair, across = (numpy_helper.from_array(x) for x in _pair_structure(window, following=False, causal=True))
    ExactLogits = _paired_logits_function(op, blocks, pairs, in_pair, across, False, sinks, scale)
    ExactSums = _exact_sums_function(op, blocks, pairs, sinks)
    PairRows, ValuesAndOnes = pairs.PairRows, pairs.ValuesAndOnes
    far_sums, rescaled_far_sums = _chunked_far_sums_functions(
        opset_version, blocks, pairs, flatten, _without_sinks_function(op, sinks), window, far_chunk
    )
    UnitsOfBoth = _units_function(op)

    if sinks:

        @script(ATTNREWRITE, default_opset=op)
        def CausalPairedWindowWithSinks(far, log_ratio_offset, max_weight, q, k, v, keep):
            n, zero = op.Shape(v, start=1, end=2), op.Constant(value_float=0.0)
            near, neighbour, sink, row_max = ExactLogits(PairRows(q, zero), PairRows(k, zero), PairRows(keep, zero), n)
            shift, far_weight = UnitsOfBoth(row_max, log_ratio_offset - max_weight * row_max)
            return ExactSums(near, neighbour, sink, shift, ValuesAndOnes(v), n) + far_weight * far

        window_sums = CausalPairedWindowWithSinks
    else:

        @script(ATTNREWRITE, default_opset=op)
        def CausalPairedWindow(far, log_ratio_offset, max_weight, q, k, v, keep):
            """The exact part's sums plus the far sums ``far`` [G, rows, Dv + 1] in one unit."""
            n, zero = op.Shape(v, start=1, end=2), op.Constant(value_float=0.0)
            near, neighbour, row_max = ExactLogits(PairRows(q, zero), PairRows(k, zero), PairRows(keep, zero), n)
            shift, far_weight = UnitsOfBoth(row_max, log_ratio_offset - max_weight * row_max)
            return ExactSums(near, neighbour, shift, ValuesAndOnes(v)) + far_weight * far

        window_sums = CausalPairedWindow
    inputs, row_inputs = _paired_inputs_functions(op, flatten, sinks)
    normalised = _normalised_function(op, blocks, eps)
    return _CausalPairedPieces(inputs, row_inputs, window_sums, far_sums, rescaled_far_sums, normalised, pairs.PairRows)


def _exact_sums_function(op, blocks: _WindowBlocks, pairs: _PairLayout, sinks: int):
    """ExactSums(near, neighbour, shift, v_rows) -> [G, rows, Dv + 1]: e^(logits - shift) [v, 1]
    over each row's exact keys (v_rows: ValuesAndOnes); with sinks ExactAndSinkSums(near,
    neighbour, sink, shift, v_rows, n)."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]

    @script(ATTNREWRITE, default_opset=op)
    def ExactSums(near, neighbour, shift, v_rows):
        in_pair = op.MatMul(op.Exp(near - Pairs(shift)), Pairs(v_rows))
        return Rows(in_pair) + Rows(op.MatMul(op.Exp(neighbour - Blocks(shift)), Neighbours(v_rows)))

    if not sinks:
        return ExactSums
    SinkRows = _sink_rows_function(op, blocks, sinks)

    @script(ATTNREWRITE, default_opset=op)
    def ExactAndSinkSums(near, neighbour, sink, shift, v_rows, n):
        return ExactSums(near, neighbour, shift, v_rows) + op.MatMul(op.Exp(sink - shift), SinkRows(v_rows, n))

    return ExactAndSinkSums


def _causal_paired_entry(op, flatten, pieces: _CausalPairedPieces, rescaled: bool, max_weighted: bool):
    """WindowedKernelAttention, WindowedRescaledKernelAttention or WindowedMaxWeightedKernelAttention
    (inputs as _paired_window_entry's, ``key_log_scale`` one per key [..., N, 1]), causal."""
    inputs, row_inputs, window_sums, far_sums, rescaled_far_sums, normalised, pair_rows = pieces
    per_head = _per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        pq, pk, q_rows, k_rows, v_rows, keep, log_weight = inputs(phi_q, phi_k, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)  # both parts in one unit already, but for w_h
        far = far_sums(pq, pk, v_rows)
        return normalised(window_sums(far, log_weight, zero, q_rows, k_rows, v_rows, keep), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedRescaledKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
    ):
        """The kernel part in units of e^(a_i + R_c) (R_c: the max key log scale of block c's
        far keys), the exact part's e^(m_i)."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        # phi_k as it is: the sinks' lowest log scale keeps them out (RescaledFarSums)
        far, far_log_scale = rescaled_far_sums(pq, flatten(phi_k), v_rows, key_log_scale)
        offset = pair_rows(flatten(query_log_scale), op.Constant(value_float=0.0)) + far_log_scale + log_weight
        one = op.Constant(value_float=1.0)
        return normalised(window_sums(far, offset, one, q_rows, k_rows, v_rows, keep), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedMaxWeightedKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
    ):
        """As WindowedRescaledKernelAttention with the kernel part moved by e^(-beta_h m_i),
        beta_h = local_max_weight [heads, 1, 1]."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)
        far, far_log_scale = rescaled_far_sums(pq, flatten(phi_k), v_rows, key_log_scale)
        offset = pair_rows(flatten(query_log_scale), zero) + far_log_scale + log_weight
        weight = per_head(local_max_weight, q)
        return normalised(window_sums(far, offset, weight, q_rows, k_rows, v_rows, keep), q, v)

    if not rescaled:
        return WindowedKernelAttention
    return WindowedMaxWeightedKernelAttention if max_weighted else WindowedRescaledKernelAttention


# --- ONNX: the causal forms continued from a state (passes/recurrent.py) ------------------------
# Every tensor is flattened to [G, ...] by the caller: the state to [G, F, Dv], [G, F] and
# [G, 1] (its log scale).


def exclusive_prefix_sum_function(opset_version: int, skip: int = 0):
    """ExclusivePrefixSum(x): [G, L, X] -> the sums over rows before each row (axis 1), with no
    CumSum (DESIGN.md "Numerics": onnxruntime's CUDA CumSum is quadratic in its axis); ``skip``
    = 1: PrefixSumBeforePrevious, over rows <= c-2 (the row before is left out too: one row of
    zeros in front, in the padding the grouping does anyway, instead of a shift afterwards).

    Depth 3 whatever L: inside groups of PREFIX_GROUP rows a product with a strictly
    lower-triangular [PREFIX_GROUP]^2 matrix; the same over the groups' totals; over the totals
    of those (L / PREFIX_GROUP^2 rows) one product with a strictly lower-triangular matrix of
    their count. Of per-chunk states (chunk 64) that top matrix is [N / 16384]^2, 64^2 at
    N = 1M: the cost stays the first level's, a 16-row product per row."""
    op = standard_opset(opset_version)
    grouped, ungrouped, strictly_lower = row_group_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixOfGroupTotals(x):
        """The second level and the top."""
        x4 = grouped(x, op.Constant(value_float=0.0), op.Constant(value_ints=[0]))
        within = op.MatMul(strictly_lower(op.Constant(value_ints=[PREFIX_GROUP])), x4)
        totals = op.ReduceSum(x4, op.Constant(value_ints=[2]), keepdims=0)
        across = op.MatMul(strictly_lower(op.Shape(totals, start=1, end=2)), totals)
        return ungrouped(within + op.Unsqueeze(across, op.Constant(value_ints=[2])), x)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixSumAfter(x, front):
        """The first level, ``front`` rows of zeros before x."""
        x4 = grouped(x, op.Constant(value_float=0.0), front)
        within = op.MatMul(strictly_lower(op.Constant(value_ints=[PREFIX_GROUP])), x4)
        across = PrefixOfGroupTotals(op.ReduceSum(x4, op.Constant(value_ints=[2]), keepdims=0))
        return ungrouped(within + op.Unsqueeze(across, op.Constant(value_ints=[2])), x)

    @script(ATTNREWRITE, default_opset=op)
    def ExclusivePrefixSum(x):
        return PrefixSumAfter(x, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def PrefixSumBeforePrevious(x):
        return PrefixSumAfter(x, op.Constant(value_ints=[1]))

    return [ExclusivePrefixSum, PrefixSumBeforePrevious][skip]


def row_group_functions(opset_version: int):
    """(GroupedRows, UngroupedRows, StrictlyLower): x [G, L, *] -> [G, groups, PREFIX_GROUP, *]
    with ``front`` ([1] int64) rows of fill before x and the rest after it; UngroupedRows(x4, x)
    keeps the first L rows (x's count); and the strictly lower-triangular ones of a size."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def GroupedRows(x, fill, front):
        rows = op.Shape(x, start=1, end=2) + front
        g = op.Constant(value_ints=[PREFIX_GROUP])
        groups = op.Div(rows + g - op.Constant(value_ints=[1]), g)
        pads = op.Concat(front, groups * g - rows, axis=0)
        shape = op.Concat(op.Constant(value_ints=[0]), groups, g, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill, op.Constant(value_ints=[1])), shape)

    @script(ATTNREWRITE, default_opset=op)
    def UngroupedRows(x4, x):
        rows = op.Reshape(x4, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(x4, start=3), axis=0))
        return op.Slice(rows, op.Constant(value_ints=[0]), op.Shape(x, start=1, end=2), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def StrictlyLower(size):
        ones = op.Expand(op.Constant(value_float=1.0), op.Concat(size, size, axis=0))
        return op.Trilu(ones, op.Constant(value_int=-1), upper=0)

    return GroupedRows, UngroupedRows, StrictlyLower


def rescaled_prefix_functions(opset_version: int, skip: int = 0):
    """(ChunkRunningMax, RescaledPrefixSum): running maxima and rescaled prefix sums along a
    chunk axis that grows with N, two levels deep (PREFIX_GROUP rows, then their groups), so
    that neither a (chunks x chunks) matrix nor a CumSum appears. Their top matrices are
    [L / PREFIX_GROUP]^2, 1024^2 for chunk states at N = 1M; past N = 2^18 (where the top's
    products cost what the first level's do) compute grows faster than N again.

    ChunkRunningMax(x): [G, L] -> the max of x over rows <= each row.
    RescaledPrefixSum(x, m, r): [G, L, X] with its log scales m [G, L] (row c' stands for
    x[c'] * exp(m[c'])), to references r [G, L] -> per row c, sum over c' < c of
    x[c'] exp(m[c'] - r[c]); ``skip`` = 1: RescaledSumBeforePrevious, over c' <= c-2 (as
    PrefixSumBeforePrevious). Every r[c] must be >= every m[c'] summed into row c, so that no
    factor exceeds 1: inside a group the pairs' factors, across groups each group's total moved
    to its own max U, carried to the max B of the groups before (exp(U' - B) <= 1), then to
    r[c] >= B."""
    op = standard_opset(opset_version)
    RunningMax, LowerTriangle = running_max_functions(opset_version)
    grouped, ungrouped, _ = row_group_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def GroupedScales(x, fill, front):
        """[G, L] -> [G, groups, PREFIX_GROUP], as GroupedRows."""
        last = op.Constant(value_ints=[-1])
        return op.Squeeze(grouped(op.Unsqueeze(x, last), fill, front), last)

    @script(ATTNREWRITE, default_opset=op)
    def MaxOfEarlierGroups(group_max):
        """[G, groups] -> the max over the groups before each (the lowest log scale for the first)."""
        through = RunningMax(group_max, LowerTriangle(op.Shape(group_max, start=1, end=2)))
        one = op.Constant(value_ints=[1])
        earlier = op.Slice(through, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), one)
        return op.Pad(earlier, op.Constant(value_ints=[1, 0]), op.Constant(value_float=LOWEST_LOG_SCALE), one)

    @script(ATTNREWRITE, default_opset=op)
    def ChunkRunningMax(x):
        lowest, group = op.Constant(value_float=LOWEST_LOG_SCALE), op.Constant(value_ints=[PREFIX_GROUP])
        within = RunningMax(GroupedScales(x, lowest, op.Constant(value_ints=[0])), LowerTriangle(group))
        group_max = op.Gather(within, op.Constant(value_int=PREFIX_GROUP - 1), axis=2)
        running = op.Max(within, op.Unsqueeze(MaxOfEarlierGroups(group_max), op.Constant(value_ints=[2])))
        last = op.Constant(value_ints=[-1])
        return op.Squeeze(ungrouped(op.Unsqueeze(running, last), op.Unsqueeze(x, last)), last)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledSumAfter(x, m, r, front):
        """RescaledPrefixSum with ``front`` rows of zeros (log scale: the lowest) before x and m."""
        zero = op.Constant(value_float=0.0)
        two, three = op.Constant(value_ints=[2]), op.Constant(value_ints=[3])
        x4 = grouped(x, zero, front)  # [G, groups, g, X]
        m3 = GroupedScales(m, op.Constant(value_float=LOWEST_LOG_SCALE), front)
        # the references stay on their rows, padded at the end to x's groups
        r_rows = op.Pad(r, op.Concat(op.Constant(value_ints=[0]), front, axis=0), zero, op.Constant(value_ints=[1]))
        r3 = GroupedScales(r_rows, zero, op.Constant(value_ints=[0]))
        pairs = op.Unsqueeze(m3, two) - op.Unsqueeze(r3, three)  # [G, groups, row c, row c']
        within = op.MatMul(op.Trilu(op.Exp(op.Min(pairs, zero)), op.Constant(value_int=-1), upper=0), x4)
        group_max = op.ReduceMax(m3, two, keepdims=0)  # U [G, groups]
        to_group_max = op.Unsqueeze(op.Exp(m3 - op.Unsqueeze(group_max, two)), two)  # [G, groups, 1, g]
        totals = op.Squeeze(op.MatMul(to_group_max, x4), two)  # [G, groups, X]
        before = MaxOfEarlierGroups(group_max)  # B
        moves = op.Unsqueeze(group_max, op.Constant(value_ints=[1])) - op.Unsqueeze(before, two)
        across = op.MatMul(op.Trilu(op.Exp(op.Min(moves, zero)), op.Constant(value_int=-1), upper=0), totals)
        into = op.Unsqueeze(op.Exp(op.Min(op.Unsqueeze(before, two) - r3, zero)), three)  # from B to r[c], <= 1
        return ungrouped(within + into * op.Unsqueeze(across, two), x)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledPrefixSum(x, m, r):
        return RescaledSumAfter(x, m, r, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def RescaledSumBeforePrevious(x, m, r):
        return RescaledSumAfter(x, m, r, op.Constant(value_ints=[1]))

    return ChunkRunningMax, [RescaledPrefixSum, RescaledSumBeforePrevious][skip]


def absorb_keys_functions(opset_version: int):
    """(AbsorbKeys, AbsorbRescaledKeys), as absorb_keys: the state with keys [G, N, F] added."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def AbsorbKeys(phi_k, v, kv_state, key_sum):
        kv = kv_state + op.MatMul(op.Transpose(phi_k, perm=[0, 2, 1]), v)
        return kv, key_sum + op.ReduceSum(phi_k, op.Constant(value_ints=[1]), keepdims=0)

    @script(ATTNREWRITE, default_opset=op)
    def AbsorbRescaledKeys(phi_k, key_log_scale, v, kv_state, key_sum, log_scale):
        """Both sums moved to the new max log scale (a factor <= 1), then the keys added."""
        new_scale = op.Max(log_scale, op.ReduceMax(key_log_scale, op.Constant(value_ints=[1]), keepdims=0))
        held = op.Exp(log_scale - new_scale)  # [G, 1]
        k_rel = phi_k * op.Exp(key_log_scale - op.Unsqueeze(new_scale, op.Constant(value_ints=[1])))
        kv = kv_state * op.Unsqueeze(held, op.Constant(value_ints=[2])) + op.MatMul(
            op.Transpose(k_rel, perm=[0, 2, 1]), v
        )
        return kv, key_sum * held + op.ReduceSum(k_rel, op.Constant(value_ints=[1]), keepdims=0), new_scale

    return AbsorbKeys, AbsorbRescaledKeys


def causal_linear_attention_from_state_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of causal_linear_attention_from_state: CausalKernelAttentionFromState(phi_q,
    phi_k, v, kv_state, key_sum) -> (out, kv_state, key_sum), after the functions it calls."""
    op = standard_opset(opset_version)
    prefix_sum = exclusive_prefix_sum_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalKernelAttentionFromState(phi_q, phi_k, v, kv_state, key_sum):
        n = op.Shape(v, start=1, end=2)
        f = op.Shape(phi_q, start=2)
        dv = op.Shape(v, start=2)
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        c = op.Max(op.Min(op.Constant(value_ints=[chunk]), n), op.Constant(value_ints=[1]))
        zero, minus_one = op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])
        chunks = op.Div(n + c - op.Constant(value_ints=[1]), c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        q4 = op.Reshape(op.Pad(phi_q, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        k4 = op.Reshape(op.Pad(phi_k, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        v4 = op.Reshape(op.Pad(v, pads), op.Concat(minus_one, chunks, c, dv, axis=0))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        kv = op.MatMul(k4t, v4)
        flat_kv = op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))
        one = op.Constant(value_ints=[1])
        earlier = op.Reshape(prefix_sum(flat_kv), op.Shape(kv)) + op.Unsqueeze(kv_state, one)
        sums = op.ReduceSum(k4, op.Constant(value_ints=[2]), keepdims=0)
        earlier_sum = prefix_sum(sums) + op.Unsqueeze(key_sum, one)  # [G, chunks, F]
        scores = op.Trilu(op.MatMul(q4, k4t), upper=0)
        numerator = op.MatMul(q4, earlier) + op.MatMul(scores, v4)
        last_axis = op.Constant(value_ints=[3])
        denominator = op.ReduceSum(
            q4 * op.Unsqueeze(earlier_sum, op.Constant(value_ints=[2])), last_axis, keepdims=1
        ) + op.ReduceSum(scores, last_axis, keepdims=1)
        out = op.Reshape(
            numerator / (denominator + op.Constant(value_float=eps)),
            op.Concat(minus_one, chunks * c, dv, axis=0),
        )
        # the state after every key: the chunks' sums added to it (no second pass over the keys)
        new_kv = kv_state + op.ReduceSum(kv, one, keepdims=0)
        new_sum = key_sum + op.ReduceSum(sums, one, keepdims=0)
        return op.Slice(out, zero, n, one), new_kv, new_sum

    return with_callees(CausalKernelAttentionFromState)


def causal_rescaled_linear_attention_from_state_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of causal_rescaled_linear_attention_from_state:
    CausalRescaledKernelAttentionFromState(phi_q, phi_k, key_log_scale, v, kv_state, key_sum,
    log_scale) -> (out, kv_state, key_sum, log_scale), after the functions it calls."""
    op = standard_opset(opset_version)
    RunningMax, LowerTriangle = running_max_functions(opset_version)
    ChunkRunningMax, RescaledPrefixSum = rescaled_prefix_functions(opset_version)
    absorb = absorb_keys_functions(opset_version)[1]

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledKernelAttentionFromState(phi_q, phi_k, key_log_scale, v, kv_state, key_sum, log_scale):
        # as CausalRescaledKernelAttention, every running max starting from the state's log_scale
        n = op.Shape(v, start=1, end=2)
        f = op.Shape(phi_q, start=2)
        dv = op.Shape(v, start=2)
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        c = op.Max(op.Min(op.Constant(value_ints=[chunk]), n), op.Constant(value_ints=[1]))
        zero, one, minus_one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[-1])
        lowest = op.Constant(value_float=LOWEST_LOG_SCALE)
        no_more = op.Constant(value_float=0.0)
        chunks = op.Div(n + c - one, c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        q4 = op.Reshape(op.Pad(phi_q, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        k4 = op.Reshape(op.Pad(phi_k, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        v4 = op.Reshape(op.Pad(v, pads), op.Concat(minus_one, chunks, c, dv, axis=0))
        s = op.Reshape(op.Pad(key_log_scale, pads, lowest), op.Concat(minus_one, chunks, c, axis=0))
        seen = RunningMax(s, LowerTriangle(c))
        upto = op.Max(ChunkRunningMax(op.Gather(seen, op.Constant(value_int=-1), axis=2)), log_scale)
        shifted = op.Pad(op.Slice(upto, zero, minus_one, one), op.Constant(value_ints=[0, 1, 0, 0]), lowest)
        before = op.Max(shifted, log_scale)
        ref = op.Max(seen, op.Unsqueeze(before, minus_one))
        decay = op.Exp(op.Min(op.Unsqueeze(s, op.Constant(value_ints=[-2])) - op.Unsqueeze(ref, minus_one), no_more))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        scores = op.Trilu(op.MatMul(q4, k4t) * decay, upper=0)
        k_rel = k4 * op.Unsqueeze(op.Exp(s - op.Unsqueeze(upto, minus_one)), minus_one)
        kv = op.MatMul(op.Transpose(k_rel, perm=[0, 1, 3, 2]), v4)
        held = op.Unsqueeze(op.Exp(log_scale - before), minus_one)  # the state at each chunk's start
        flat_kv = RescaledPrefixSum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1])), upto, before)
        flat_state = op.Reshape(kv_state, op.Constant(value_ints=[0, -1]))
        state = op.Reshape(flat_kv + held * op.Unsqueeze(flat_state, one), op.Shape(kv))
        earlier_sum = RescaledPrefixSum(op.ReduceSum(k_rel, op.Constant(value_ints=[2]), keepdims=0), upto, before)
        earlier_sum = earlier_sum + held * op.Unsqueeze(key_sum, one)
        into = op.Unsqueeze(op.Exp(op.Unsqueeze(before, minus_one) - ref), minus_one)
        last_axis = op.Constant(value_ints=[3])
        numerator = into * op.MatMul(q4, state) + op.MatMul(scores, v4)
        denominator = into * op.ReduceSum(
            q4 * op.Unsqueeze(earlier_sum, op.Constant(value_ints=[2])), last_axis, keepdims=1
        ) + op.ReduceSum(scores, last_axis, keepdims=1)
        out = op.Reshape(
            numerator / (denominator + op.Constant(value_float=eps)),
            op.Concat(minus_one, chunks * c, dv, axis=0),
        )
        new_kv, new_sum, new_scale = absorb(phi_k, key_log_scale, v, kv_state, key_sum, log_scale)
        return op.Slice(out, zero, n, one), new_kv, new_sum, new_scale

    return with_callees(CausalRescaledKernelAttentionFromState)


class FunctionNodes:
    """The nodes of a function written node by node (make_function), for bodies whose inputs
    depend on options: each call adds one node and returns its output name(s)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []

    def __call__(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attributes):
        names = [f"n{len(self.nodes)}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def call(self, function: OnnxFunction, *inputs: str, outputs: int = 1):
        """A call of one of our functions."""
        return self(function.name, *inputs, outputs=outputs, domain=DOMAIN)

    def ints(self, *values: int) -> str:
        return self("Constant", value_ints=list(values))

    def output(self, name: str, value: str) -> None:
        """``value`` under the function output's ``name``."""
        self.nodes.append(helper.make_node("Identity", [value], [name]))


def windowed_kernel_attention_from_state_functions(
    opset_version: int,
    window: int,
    scale: float,
    *,
    sinks: int,
    rescaled: bool,
    max_weighted: bool = False,
    eps: float = DENOMINATOR_EPS,
) -> list[onnx.FunctionProto]:
    """ONNX form of windowed_kernel_attention_from_state: the functions it calls, then the entry
    RecurrentWindowedKernelAttention, whose inputs are WINDOWED_FROM_STATE_INPUTS(sinks,
    rescaled, max_weighted), all flattened to [G, ...] (phi_q already weighted by
    linear_log_weight; start int64 [1]); it returns out [G, N', Dv] float32."""
    pieces = _recurrent_window_functions(opset_version, window, scale, sinks, rescaled, eps)
    inputs = windowed_from_state_inputs(sinks, rescaled, max_weighted)
    body = FunctionNodes()
    n_keys, n = body("Shape", "k", start=1, end=2), body("Shape", "q", start=1, end=2)
    front, chunks, first = body.call(pieces.layout, "start", n_keys, n, outputs=3)
    sinks_in = ["start", "sink_keys", "sink_values", "sink_keep"] if sinks else []
    k_x, v_x, allowed = body.call(pieces.exact_keys, "k", "v", "keep", front, chunks, first, *sinks_in, outputs=3)

    def query_blocks(x):
        return body.call(pieces.query_blocks, x, front, chunks, first, n_keys)

    local = body.call(pieces.local_sums, query_blocks("q"), k_x, v_x, allowed, outputs=3)
    states_in = ["far_phi_k", "v", front, chunks, first, "kernel_state", "normaliser"]
    if rescaled:
        states_in[1:1] = ["far_key_log_scale"]
        far_kv, far_key_sum, far_log_scale = body.call(pieces.far_states, *states_in, "log_scale", outputs=3)
    else:
        far_kv, far_key_sum = body.call(pieces.far_states, *states_in, outputs=2)
    far_num, far_den = body.call(pieces.kernel_sums, query_blocks("phi_q"), far_kv, far_key_sum, outputs=2)
    if rescaled:
        weight = query_blocks("row_weight") if max_weighted else body("Constant", value_float=1.0)
        mixed = body.call(pieces.mix, *local, far_num, far_den, far_log_scale, query_blocks("query_log_scale"), weight)
    else:
        mixed = body.call(pieces.mix, local[0], local[1], far_num, far_den)
    body.output("out", body.call(pieces.unblock, mixed, front, first, n_keys, n))
    entry = make_function("RecurrentWindowedKernelAttention", inputs, ["out"], body.nodes, opset_version)
    return [*(f.to_function_proto() for f in with_callees(*pieces)), entry]


def windowed_from_state_inputs(sinks: int, rescaled: bool, max_weighted: bool) -> list[str]:
    """The inputs of RecurrentWindowedKernelAttention for these options, in order."""
    inputs = ["phi_q", "q", "far_phi_k", "k", "v", "keep", "start", "kernel_state", "normaliser"]
    if rescaled:
        inputs += ["log_scale", "query_log_scale", "far_key_log_scale"]
    if max_weighted:
        inputs.append("row_weight")
    if sinks:
        inputs += ["sink_keys", "sink_values", "sink_keep"]
    return inputs


class _RecurrentWindowPieces(typing.NamedTuple):
    """The functions RecurrentWindowedKernelAttention calls (its variant's)."""

    layout: OnnxFunction
    query_blocks: OnnxFunction
    exact_keys: OnnxFunction
    local_sums: OnnxFunction
    far_states: OnnxFunction
    kernel_sums: OnnxFunction
    mix: OnnxFunction
    unblock: OnnxFunction


def _recurrent_window_functions(
    opset_version: int, window: int, scale: float, sinks: int, rescaled: bool, eps: float
) -> _RecurrentWindowPieces:
    op = standard_opset(opset_version)
    blocks = _window_block_functions(op, window, aligned_to_start=True)  # its block moves only
    layout, positioned_blocks, query_blocks, unblock = _positioned_layout_functions(op, window)
    exact_keys = _recurrent_exact_keys_function(op, blocks, positioned_blocks, window, sinks)
    if rescaled:
        far_states = _recurrent_rescaled_far_states_function(opset_version, blocks, positioned_blocks)
    else:
        far_states = _recurrent_far_states_function(opset_version, positioned_blocks)
    kernel_sums = _kernel_sums_function(op)
    mix = _window_mix_function(op, rescaled, eps)
    local_sums = _local_softmax_sums_function(op, scale)
    return _RecurrentWindowPieces(layout, query_blocks, exact_keys, local_sums, far_states, kernel_sums, mix, unblock)


TO_THE_END = 2147483647  # a Slice end past any axis


def _positioned_layout_functions(op, window: int):
    """(PositionedLayout, PositionedBlocks, QueryBlocks, UnblockQueries): _PositionedLayout's
    blocks, for keys of positions start .. start + n_keys - 1 whose last n rows are queries."""

    @script(ATTNREWRITE, default_opset=op)
    def PositionedLayout(start, n_keys, n):
        """[1] each: the rows in front of the keys (their blocks aligned to sequence positions),
        the blocks, and the first block that holds a query."""
        w = op.Constant(value_ints=[window])
        front = op.Mod(start, w)  # integer Mod takes the divisor's sign: in [0, window)
        chunks = op.Div(front + n_keys + w - op.Constant(value_ints=[1]), w)
        return front, chunks, op.Div(front + n_keys - n, w)

    @script(ATTNREWRITE, default_opset=op)
    def PositionedBlocks(x, fill, front, chunks):
        """[G, rows, F] -> [G, chunks, window, F]: ``front`` rows of fill before, the rest after."""
        w = op.Constant(value_ints=[window])
        zero = op.Constant(value_ints=[0])
        pads = op.Concat(zero, front, zero, zero, chunks * w - front - op.Shape(x, start=1, end=2), zero, axis=0)
        shape = op.Concat(op.Constant(value_ints=[-1]), chunks, w, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill), shape)

    @script(ATTNREWRITE, default_opset=op)
    def QueryBlocks(x, front, chunks, first, n_keys):
        """x [G, n, F] of the queries (the last n of n_keys rows), in the blocks from ``first``."""
        behind = front + n_keys - op.Shape(x, start=1, end=2)
        blocked = PositionedBlocks(x, op.Constant(value_float=0.0), behind, chunks)
        return op.Slice(blocked, first, op.Constant(value_ints=[TO_THE_END]), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def UnblockQueries(out4, front, first, n_keys, n):
        """[G, blocks from first, window, Dv] -> the queries' rows [G, n, Dv]."""
        rows = op.Reshape(out4, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(out4, start=3), axis=0))
        offset = front + n_keys - n - first * op.Constant(value_ints=[window])
        return op.Slice(rows, offset, offset + n, op.Constant(value_ints=[1]))

    return PositionedLayout, PositionedBlocks, QueryBlocks, UnblockQueries


def _recurrent_exact_keys_function(op, blocks: _WindowBlocks, positioned_blocks, window: int, sinks: int):
    """RecurrentLocalKeys(k, v, keep, front, chunks, first), or with sinks
    RecurrentLocalAndSinkKeys(..., start, sink_keys, sink_values, sink_keep): the exact keys of
    each query block from ``first`` (_positioned_exact_keys), their values and which each query takes."""
    kept_local_keys, with_previous_block, causal_kept_local_keys = _local_key_pieces(op, blocks, window)

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentLocalKeys(k, v, keep, front, chunks, first):
        """Each query block's previous and own block, and which of those keys each query takes."""
        zero = op.Constant(value_float=0.0)
        end, one = op.Constant(value_ints=[TO_THE_END]), op.Constant(value_ints=[1])
        k_local = op.Slice(with_previous_block(positioned_blocks(k, zero, front, chunks)), first, end, one)
        v_local = op.Slice(with_previous_block(positioned_blocks(v, zero, front, chunks)), first, end, one)
        keep_local = op.Slice(with_previous_block(positioned_blocks(keep, zero, front, chunks)), first, end, one)
        return k_local, v_local, causal_kept_local_keys(keep_local)

    if not sinks:
        return RecurrentLocalKeys
    sink_positions = list(range(sinks))
    query_offsets = list(range(window))

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentSinkMask(start, front, chunks, first):
        """[blocks from first, window, sinks]: a query takes sink s when s lies before its
        block's previous one and not after the query."""
        w = op.Constant(value_ints=[window])
        first_at = start - front + first * w  # a multiple of window, so Div below is exact
        count = op.Squeeze(chunks - first)
        block_at = first_at + op.Range(op.Constant(value_int=0), count, op.Constant(value_int=1)) * w
        query_at = op.Unsqueeze(block_at, op.Constant(value_ints=[1])) + op.Constant(value_ints=query_offsets)
        sink_at = op.Constant(value_ints=sink_positions)
        block_before = op.Unsqueeze(op.Div(block_at, w) - op.Constant(value_ints=[1]), op.Constant(value_ints=[1]))
        outside = op.Unsqueeze(op.Less(op.Div(sink_at, w), block_before), op.Constant(value_ints=[1]))
        return op.And(outside, op.LessOrEqual(sink_at, op.Unsqueeze(query_at, op.Constant(value_ints=[2]))))

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentLocalAndSinkKeys(k, v, keep, front, chunks, first, start, sink_keys, sink_values, sink_keep):
        """RecurrentLocalKeys with the sink columns after each block's local keys."""
        k_local, v_local, allowed = RecurrentLocalKeys(k, v, keep, front, chunks, first)
        one = op.Constant(value_ints=[1])
        per_block = op.Concat(one, op.Shape(k_local, start=1, end=2), one, one, axis=0)
        sink_k = op.Expand(op.Unsqueeze(sink_keys, one), per_block)
        sink_v = op.Expand(op.Unsqueeze(sink_values, one), per_block)
        kept = kept_local_keys(op.Expand(op.Unsqueeze(sink_keep, one), per_block))
        taken = op.And(kept, RecurrentSinkMask(start, front, chunks, first))
        return op.Concat(k_local, sink_k, axis=2), op.Concat(v_local, sink_v, axis=2), op.Concat(allowed, taken, axis=3)

    return RecurrentLocalAndSinkKeys


def _recurrent_far_states_function(opset_version: int, positioned_blocks):
    """RecurrentFarStates: the kernel's state and key sum over each query block's far keys:
    the absorbed ones and the blocks <= c-2 (no CumSum: PrefixSumBeforePrevious)."""
    op = standard_opset(opset_version)
    EarlierBlocksPrefix = exclusive_prefix_sum_function(opset_version, skip=1)  # blocks <= c-2

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentFarStates(far_phi_k, v, front, chunks, first, kv_state, key_sum):
        zero = op.Constant(value_float=0.0)
        end, one = op.Constant(value_ints=[TO_THE_END]), op.Constant(value_ints=[1])
        pk4 = positioned_blocks(far_phi_k, zero, front, chunks)
        kv = op.MatMul(op.Transpose(pk4, perm=[0, 1, 3, 2]), positioned_blocks(v, zero, front, chunks))
        earlier = op.Reshape(EarlierBlocksPrefix(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))), op.Shape(kv))
        sums = EarlierBlocksPrefix(op.ReduceSum(pk4, op.Constant(value_ints=[2]), keepdims=0))
        far_kv = op.Slice(earlier + op.Unsqueeze(kv_state, one), first, end, one)
        return far_kv, op.Slice(sums + op.Unsqueeze(key_sum, one), first, end, one)

    return RecurrentFarStates


def _recurrent_rescaled_far_states_function(opset_version: int, blocks: _WindowBlocks, positioned_blocks):
    """RecurrentRescaledFarStates: _rescaled_earlier_states_after, one state per block carried
    by RescaledSumBeforePrevious (a decoder's prefill; its steps have one block)."""
    op = standard_opset(opset_version)
    ChunkRunningMax, RescaledSumBeforePrevious = rescaled_prefix_functions(opset_version, skip=1)
    ShiftBlocks = blocks.ShiftBlocks

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentRescaledFarStates(far_phi_k, far_key_log_scale, v, front, chunks, first, kv_state, key_sum, log_scale):
        zero, lowest = op.Constant(value_float=0.0), op.Constant(value_float=LOWEST_LOG_SCALE)
        last, one = op.Constant(value_ints=[-1]), op.Constant(value_ints=[1])
        end = op.Constant(value_ints=[TO_THE_END])
        pk4 = positioned_blocks(far_phi_k, zero, front, chunks)
        s = op.Squeeze(positioned_blocks(far_key_log_scale, lowest, front, chunks), last)
        block_max = op.ReduceMax(s, last, keepdims=0)
        running = ChunkRunningMax(block_max)
        reach = op.Max(ShiftBlocks(running, lowest, op.Constant(value_ints=[2])), log_scale)
        k_rel = pk4 * op.Unsqueeze(op.Exp(s - op.Unsqueeze(block_max, last)), last)
        kv = op.MatMul(op.Transpose(k_rel, perm=[0, 1, 3, 2]), positioned_blocks(v, zero, front, chunks))
        flat_kv = RescaledSumBeforePrevious(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1])), block_max, reach)
        held = op.Unsqueeze(op.Exp(log_scale - reach), last)  # the absorbed keys moved to R_c, <= 1
        state = flat_kv + held * op.Unsqueeze(op.Reshape(kv_state, op.Constant(value_ints=[0, -1])), one)
        sums = RescaledSumBeforePrevious(op.ReduceSum(k_rel, op.Constant(value_ints=[2]), keepdims=0), block_max, reach)
        sums = sums + held * op.Unsqueeze(key_sum, one)
        shape = op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(kv, start=2), axis=0)
        far_log_scale = op.Unsqueeze(op.Slice(reach, first, end, one), op.Constant(value_ints=[2, 3]))
        return op.Reshape(op.Slice(state, first, end, one), shape), op.Slice(sums, first, end, one), far_log_scale

    return RecurrentRescaledFarStates


def _window_mix_function(op, rescaled: bool, eps: float):
    """WindowMix: both parts' sums, one normaliser; RescaledWindowMix first moves them to one
    unit by their log ratio, as CombineRescaled."""

    @script(ATTNREWRITE, default_opset=op)
    def WindowMix(local_num, local_den, far_num, far_den):
        return (local_num + far_num) / (local_den + far_den + op.Constant(value_float=eps))

    @script(ATTNREWRITE, default_opset=op)
    def RescaledWindowMix(
        local_num, local_den, local_max, far_num, far_den, far_log_scale, query_log_scale, row_weight
    ):
        zero = op.Constant(value_float=0.0)
        ratio = query_log_scale + far_log_scale - local_max * row_weight
        local_factor = op.Exp(op.Neg(op.Max(ratio, zero)))
        far_factor = op.Exp(op.Min(ratio, zero))
        numerator = local_num * local_factor + far_num * far_factor
        denominator = local_den * local_factor + far_den * far_factor
        return numerator / (denominator + op.Constant(value_float=eps))

    return RescaledWindowMix if rescaled else WindowMix


def without_sinks_from_function(opset_version: int, sinks: int):
    """WithoutSinksFrom(x, fill, start): x [..., N, F] with the rows of positions 0..sinks-1 set
    to fill, row 0 being position ``start`` ([1]), as _without_sinks."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def WithoutSinksFrom(x, fill, start):
        n = op.Squeeze(op.Shape(x, start=-2, end=-1))
        position = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1)) + start
        sink = op.Unsqueeze(op.Less(position, op.Constant(value_int=sinks)), op.Constant(value_ints=[1]))
        return op.Where(sink, fill, x)

    return WithoutSinksFrom
