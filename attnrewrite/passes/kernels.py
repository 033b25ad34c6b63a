"""Kernelized attention out = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)), in both lowerings.

Feature maps are computed by each pass; these pieces only contract them. The causal form is a
chunked prefix sum: within a chunk a masked (chunk x chunk) product, across chunks an exclusive
prefix sum of per-chunk key-value states, so memory stays O(N*F + N/chunk * F*Dv) instead of
the O(N*F*Dv) of a per-position prefix sum. The ONNX bodies take no CumSum along an axis that
grows with N (onnxruntime's CUDA CumSum sums each output's whole prefix: O(L^2) along an axis
of length L): prefix sums and the rescaled carry go through bounded-depth hierarchies of
triangular products (ExclusivePrefixSum, rescaled_prefix_functions). The torch forms keep
torch.cumsum and the one-level (chunks x chunks) carry: they are the reference, and calibration
runs them at a few hundred positions.

The window hybrid (``window=W`` of linear, favor, hedgehog) is here too, once per lowering:
exact softmax over each query's block of W positions, the previous block, the next one
(bidirectional, ``window_next``) and the first ``sinks`` positions, the kernel over the other
keys, one shared normaliser (windowed_kernel_attention). Its blocks decide which keys are
exact, so both lowerings lay them out alike; windowed_attention_weights writes the same thing
as an N x N matrix, for fitting losses and tests.

A bidirectional window's far sums keep no state per block: one state for the whole sequence,
S = sum_j phi_k_j v_j^T and z = sum_j phi_k_j (sinks have zero features), and each query block's
local kernel terms taken back out with a [W, 2W or 3W] kernel-score block beside the exact
logits: far_i = phi_q_i.S - sum_{j local} (phi_q_i.phi_k_j) v_j (_bidirectional_far_sums). What
is left keeps the rounding of the whole sum, so row i's output moves by up to about
    eps32 * sum_{j local} K_ij |v_j| / D_i
beyond the per-block form's (K_ij the kernel weight in the output's units, D_i the row's
normaliser): small where a kernel is in the exact part's units (fitted hedgehog, favor: on
MiniLM's q, k, v at N = 256..4096 both forms are within 1.5e-6 of the float64 definition,
bench/window_rounding.md), large only where unit-free local kernel terms outweigh the exact part
and a row has almost no far key (N near 3W). A block without any far block gives exactly 0.
Superblock states (exact, no cancellation) cost a [W, 3P] masked kernel-score block per query
block for superblocks of P positions: several times the work, for no rounding gain measurable
on MiniLM.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import onnx
from onnx import helper
from onnxscript import OnnxFunction, script

from attnrewrite.passes._onnx import (
    ATTNREWRITE,
    DOMAIN,
    FLOAT,
    OnnxLowering,
    make_function,
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
# "No key yet" in running maxima of log scales: finite, so differences of two stay NaN-free
# (-inf - -inf is NaN) while exp of any difference with a real scale is still 0.
LOWEST_LOG_SCALE = -3.0e38
EXP_FLOOR = 80.0  # e^-80 is a normal float32; see _local_softmax_sums

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
    state is re-referenced from one chunk's running max to the next with a (chunks x chunks)
    lower-triangular matrix of factors <= 1 (no CumSum can rescale), so compute grows as
    (N/chunk)^2 * F * Dv for that part (the ONNX form nests it two levels deep instead:
    RescaledPrefixSum); memory stays that of causal_linear_attention.
    Masked keys: phi_k rows 0 and key_log_scale LOWEST_LOG_SCALE (they must not raise r).
    """
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = _ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]  # [G, chunks, chunk]
    # Running maxima as masked maxima: [G, chunks, chunk, chunk] then [G, chunks, chunks], no
    # more than the scores and the carry below hold.
    seen = _running_max(s)  # inside each chunk
    upto = _running_max(seen[..., -1])  # through the end of each chunk
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
    carry = torch.tril(torch.exp(torch.clamp_max(upto.unsqueeze(1) - before.unsqueeze(2), 0.0)), diagonal=-1)
    state = (carry @ kv.flatten(2)).reshape(kv.shape)
    key_sum = carry @ k_rel.sum(dim=2)  # [G, chunks, F]
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
    O(N * (3 * window + sinks) + N * F) and the far states: one [F, Dv] bidirectional (see the
    module docstring for its rounding), one per block causal; nothing is N x N. All in float32.
    """
    lead, n = q.shape[:-2], q.shape[-2]
    q, k, v, phi_q, phi_k = q.float(), k.float(), v.float(), phi_q.float(), phi_k.float()
    if linear_log_weight is not None:
        phi_q = phi_q * torch.exp(linear_log_weight.float())  # w_h scales the kernel part only
    keep = torch.ones_like(k[..., :1]) if key_keep is None else key_keep.float().expand(*k.shape[:-1], 1)
    layout = _ChunkLayout(n, window, aligned_to_start=causal)
    following = window_next and not causal
    local_num, local_den, local_max = _local_softmax_sums(
        layout.blocks(q), *_exact_keys(layout, k, v, keep, causal, following, sinks), scale
    )
    # The kernel never sees a sink: zero features, and (per-key log scales) the lowest log
    # scale, so that no sink raises a running max.
    pq4, v4 = layout.blocks(phi_q), layout.blocks(v)
    pk4 = layout.blocks(_without_sinks(phi_k, sinks, 0.0))
    if not causal:
        far_num, far_den = _bidirectional_far_sums(pq4, pk4, v4, following)
        far_log_scale = None if key_log_scale is None else flatten_heads(key_log_scale.float())[..., None]
    elif key_log_scale is not None:
        far_key_log_scale = _without_sinks(key_log_scale.float(), sinks, LOWEST_LOG_SCALE)
        far_kv, far_key_sum, far_log_scale = _rescaled_earlier_states(
            pk4, layout.blocks(far_key_log_scale, LOWEST_LOG_SCALE)[..., 0], v4
        )
    else:
        far_kv = _earlier_blocks_sum(pk4.transpose(-2, -1) @ v4)
        far_key_sum = _earlier_blocks_sum(pk4.sum(dim=2))
        far_log_scale = None
    if causal:
        far_num = pq4 @ far_kv
        far_den = (pq4 * far_key_sum.unsqueeze(2)).sum(-1, keepdim=True)
    if far_log_scale is not None:
        # log of (kernel part's unit / exact part's unit), per query row
        if local_max_weight is not None:  # [heads, 1, 1] -> one per query row, blocked
            local_max = local_max * layout.blocks(local_max_weight.float().expand(*lead, n, 1))
        ratio = layout.blocks(query_log_scale) + far_log_scale - local_max
        local_factor = torch.exp(-torch.clamp_min(ratio, 0.0))
        far_factor = torch.exp(torch.clamp_max(ratio, 0.0))
        local_num, local_den = local_num * local_factor, local_den * local_factor
        far_num, far_den = far_num * far_factor, far_den * far_factor
    out = (local_num + far_num) / (local_den + far_den + eps)
    return layout.unblock(out).reshape(*lead, n, v.shape[-1])


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


def _exact_keys(layout, k, v, keep, causal: bool, following: bool, sinks: int):
    """Every query block's exact keys [G, chunks, 2 or 3 * window + sinks, *]: its local blocks
    (_local_blocks), then the sink columns; their values likewise; and which of them each query
    takes ([G, chunks, window, keys]): kept ones, causally visible, a sink only outside the
    block's local keys. One concatenation per tensor: at MiniLM's lengths these copies are a
    good part of the whole."""

    def exact(x):
        sink = [_sink_rows(x, sinks, layout.chunks)] if sinks else []
        return torch.cat([*_local_blocks(layout.blocks(x), following), *sink], dim=2)

    if causal:
        taken = _local_causal_mask(layout.chunk, k.device)
    else:
        taken = torch.ones(layout.chunk, (3 if following else 2) * layout.chunk, dtype=torch.bool, device=k.device)
    if sinks:
        sink = _sink_mask(layout, sinks, causal, following, k.device).expand(layout.chunks, layout.chunk, sinks)
        taken = torch.cat([taken.expand(layout.chunks, -1, -1), sink], dim=-1)
    return exact(k), exact(v), (exact(keep).transpose(-2, -1) > 0) & taken


def _local_softmax_sums(q4, k_x, v_x, allowed, scale: float):
    """Block c's queries over its exact keys (_exact_keys): the unnormalised numerator and
    denominator of their softmax relative to the row max m_i, and m_i (the lowest log scale
    where no exact key is kept; its weights are then all zero, never NaN). Logits more than
    EXP_FLOOR below m_i weigh e^-EXP_FLOOR (< 1e-34 of the max's 1) instead of less: exp of
    an argument so low that its result is subnormal or 0 takes several times longer."""
    scores = torch.where(allowed, (q4 * scale) @ k_x.transpose(-2, -1), LOWEST_LOG_SCALE)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(torch.clamp_min(scores - row_max, -EXP_FLOOR)) * allowed
    return weights @ v_x, weights.sum(-1, keepdim=True), row_max


def _local_blocks(x4, following: bool) -> list:
    """[G, chunks, window, F] -> block c-1's rows, c's and, ``following``, c+1's, each
    [G, chunks, window, F]."""
    blocks = [_shift_right(x4, 0.0), x4]
    if following:
        blocks.append(_shift_left(x4, 0.0))
    return blocks


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


def _sink_mask(layout, sinks: int, causal: bool, following: bool, device):
    """[chunks, window or 1, sinks]: True where block c's query takes sink s as an extra exact
    key: s lies outside the block's local keys and (causal) not after the query. Positions are
    the padded layout's (sink s at s + pad)."""
    at = torch.arange(sinks, device=device) + layout.pad
    offset = at // layout.chunk - torch.arange(layout.chunks, device=device).unsqueeze(-1)
    outside = ((offset < -1) | (offset > int(following))).unsqueeze(1)
    if not causal:
        return outside
    query_at = torch.arange(layout.chunks * layout.chunk, device=device).reshape(layout.chunks, layout.chunk, 1)
    return outside & (at <= query_at)


def _earlier_blocks_sum(x):
    """Per block c (dim 1), the sum of x over blocks <= c-2 (a causal window's far blocks)."""
    return _shift_right(torch.cumsum(x, dim=1), 0.0, steps=2)


def _bidirectional_far_sums(pq4, pk4, v4, following: bool):
    """Per query block c, the kernel's numerator [G, chunks, window, Dv] and denominator
    [..., 1] over its far keys: the whole sequence's sums, one state sum_j phi_k_j v_j^T and
    sum_j phi_k_j, less the terms of the block's local keys (blocks c-1, c and, ``following``,
    c+1), taken from a [window, 2 or 3 * window] kernel-score block like the exact logits. No
    state per block; what cancels is the local terms (the module docstring bounds it)."""
    g, chunks, window, _ = pq4.shape
    pq, pk, v = (x.reshape(g, chunks * window, x.shape[-1]) for x in (pq4, pk4, v4))
    total_num = (pq @ (pk.transpose(-2, -1) @ v)).reshape(g, chunks, window, -1)
    total_den = (pq @ pk.sum(dim=1).unsqueeze(-1)).reshape(g, chunks, window, 1)
    local_scores = pq4 @ torch.cat(_local_blocks(pk4, following), dim=2).transpose(-2, -1)
    local_num = local_scores @ torch.cat(_local_blocks(v4, following), dim=2)
    # Where no far block exists (window >= N) nothing is left but rounding: exactly 0 instead.
    # Block 0 is padding (_ChunkLayout), so block c has far keys from c >= 3 or c + gap < chunks.
    block = torch.arange(chunks, device=pq4.device)
    has_far = ((block >= 3) | (block + (2 if following else 1) < chunks)).reshape(chunks, 1, 1)
    far_den = total_den - local_scores.sum(-1, keepdim=True)
    return torch.where(has_far, total_num - local_num, 0.0), torch.where(has_far, far_den, 0.0)


def _rescaled_earlier_states(pk4, s, v4):
    """Causal kernel states over blocks <= c-2 when key j's features are pk_j * exp(s_j):
    referenced to R_c, the max of s over those blocks (lowest log scale if none), with the
    (chunks x chunks) carry of causal_rescaled_linear_attention, so no factor exceeds 1 and
    R_c reads no key after the block. Returns (state, key sum, R_c as [G, chunks, 1, 1])."""
    block_max = s.amax(dim=-1)  # [G, chunks]
    reach = _shift_right(_running_max(block_max), LOWEST_LOG_SCALE, steps=2)
    k_rel = pk4 * torch.exp(s - block_max.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4  # [G, chunks, F, Dv]
    moves = block_max.unsqueeze(1) - reach.unsqueeze(2)  # [G, c, c']: from block c''s max to R_c
    carry = torch.tril(torch.exp(torch.clamp_max(moves, 0.0)), diagonal=-2)
    state = (carry @ kv.flatten(2)).reshape(kv.shape)
    return state, carry @ k_rel.sum(dim=2), reach[..., None, None]


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


def _shift_left(x, fill: float, steps: int = 1):
    """x moved ``steps`` chunks earlier along dim 1, fill last (as _shift_right)."""
    pads = [0, 0] * (x.dim() - 2) + [0, steps]
    return torch.nn.functional.pad(x, pads, value=fill)[:, steps:]


def _running_max(x):
    """Running max over the last axis as a lower-triangular masked max ([..., L] -> [..., L, L]),
    as the ONNX RunningMax: torch.cummax has no ONNX conversion."""
    size = x.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    return torch.where(lower, x.unsqueeze(-2), LOWEST_LOG_SCALE).amax(dim=-1)


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
    """_exact_keys (causal) of a _PositionedLayout: the previous and own block up to the query,
    then the sinks from ``sink_keys``, taken by a query of a later block than their next one and
    not before them."""
    taken = _local_causal_mask(layout.chunk, k.device)

    def exact(x, sink):
        local = torch.cat(_local_blocks(layout.blocks(x), False), dim=2)
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
    """_rescaled_earlier_states with the keys of ``far`` before the first block: R_c is the max
    over them too, and they are moved from their reference to R_c (a factor <= 1)."""
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

    @script(ATTNREWRITE, default_opset=op)
    def KernelAttention(phi_q, phi_k, v):
        kv = op.MatMul(op.Transpose(phi_k, perm=[0, 2, 1]), v)
        numerator = op.MatMul(phi_q, kv)
        key_sum = op.Transpose(sequence_sum(phi_k), perm=[0, 2, 1])  # [G, F, 1]
        denominator = op.MatMul(phi_q, key_sum)
        return numerator / (denominator + op.Constant(value_float=eps))

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
):
    """ONNX form of windowed_kernel_attention: the functions it calls, then itself last.

    The entry reads (phi_q, phi_k, q, k, v, key_keep, linear_log_weight) as the passes have
    them ([..., N, *], key_keep broadcastable to [..., N, 1]), with ``rescaled`` also
    (query_log_scale, key_log_scale) after phi_k and, ``max_weighted``, local_max_weight last;
    it returns float32 [..., N, Dv]. Blocks are laid out as _ChunkLayout does (padded at the
    front), so both lowerings pick the same keys; ``causal``, ``window_next`` and ``sinks``
    choose the bodies at rewrite time, each in the builder below that reads it.
    """
    op = standard_opset(opset_version)
    following = window_next and not causal
    blocks = _window_block_functions(op, window, aligned_to_start=causal)
    flatten = flatten_heads_function(opset_version)
    without_sinks = _without_sinks_function(op, sinks)
    exact_keys = _exact_keys_function(op, blocks, window, causal, following, sinks)
    local_part = _local_part_function(op, blocks, flatten, key_keep_function(opset_version), exact_keys, scale)
    far_key_features = _far_key_features_function(op, blocks, flatten, without_sinks)
    if causal:
        far_states, kernel_sums = _far_kernel_functions(op)
        rescaled_far_states = _causal_rescaled_far_states_function(opset_version, blocks, flatten, without_sinks)
        far_sums, rescaled_far_sums = _blocked_far_sums_functions(op, far_states, rescaled_far_states, kernel_sums)
    else:
        local_blocks = _local_key_pieces(op, blocks, window, causal, following)[2]
        far_sums = _total_less_local_function(op, local_blocks, following)
        rescaled_far_sums = _head_rescaled_far_sums_function(op, flatten, far_sums)
    if not rescaled:
        return with_callees(_windowed_kernel_entry(op, blocks, flatten, local_part, far_key_features, far_sums, eps))
    parts = _rescaled_parts_function(op, blocks, flatten, local_part, far_key_features, rescaled_far_sums)
    combine = _combine_rescaled_function(op, blocks, eps)
    return with_callees(_windowed_rescaled_entry(op, blocks, flatten, parts, combine, max_weighted))


class _WindowBlocks(typing.NamedTuple):
    """The windowed functions' layout, [G, N, F] <-> [G, chunks, window, F] (_ChunkLayout's),
    and moves of whole blocks along axis 1."""

    BlockCount: OnnxFunction
    FrontPad: OnnxFunction
    WindowBlocks: OnnxFunction
    UnblockLike: OnnxFunction
    ShiftBlocks: OnnxFunction
    ShiftBlocksEarlier: OnnxFunction


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
    def UnblockLike(out4, q, v):
        """[G, chunks, window, Dv] -> q's leading axes + [N, Dv]: the N rows after FrontPad."""
        rows = op.Reshape(out4, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(v, start=-1), axis=0))
        n = op.Shape(v, start=-2, end=-1)
        front = FrontPad(n)
        kept = op.Slice(rows, front, front + n, op.Constant(value_ints=[1]))
        return op.Reshape(kept, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def ShiftBlocks(x, fill, steps):
        """x moved ``steps`` blocks later along axis 1, fill first."""
        one = op.Constant(value_ints=[1])
        shifted = op.Pad(x, op.Concat(steps, op.Constant(value_ints=[0]), axis=0), fill, one)
        return op.Slice(shifted, op.Constant(value_ints=[0]), op.Neg(steps), one)

    @script(ATTNREWRITE, default_opset=op)
    def ShiftBlocksEarlier(x, fill, steps):
        """x moved ``steps`` blocks earlier along axis 1, fill last."""
        one = op.Constant(value_ints=[1])
        shifted = op.Pad(x, op.Concat(op.Constant(value_ints=[0]), steps, axis=0), fill, one)
        return op.Slice(shifted, steps, op.Constant(value_ints=[2147483647]), one)

    return _WindowBlocks(BlockCount, FrontPad, WindowBlocks, UnblockLike, ShiftBlocks, ShiftBlocksEarlier)


def _exact_keys_function(op, blocks: _WindowBlocks, window: int, causal: bool, following: bool, sinks: int):
    """LocalKeys(k, v, keep), or with sinks LocalAndSinkKeys: every query block's exact keys,
    their values and which each query takes (kernels._exact_keys), and v in blocks."""
    kept_local_keys, local_keys = _local_keys_functions(op, blocks, window, causal, following)
    if not sinks:
        return local_keys
    sink_mask = _sink_mask_function(op, blocks, window, causal, following, sinks)
    return _local_and_sink_keys_function(op, sinks, kept_local_keys, local_keys, sink_mask)


def _local_keys_functions(op, blocks: _WindowBlocks, window: int, causal: bool, following: bool):
    """(KeptLocalKeys, LocalKeys): the kept keys among a block's local ones, and the local keys
    (blocks c-1, c and, ``following``, c+1) with which of them each query takes."""
    kept_local_keys, local_keys, _, _ = _local_key_pieces(op, blocks, window, causal, following)
    return kept_local_keys, local_keys


def _local_key_pieces(op, blocks: _WindowBlocks, window: int, causal: bool, following: bool):
    """_local_keys_functions' two, then the pieces LocalKeys is made of: the local blocks of
    [G, chunks, window, F] (WithPreviousBlock or WithNeighbourBlocks) and which of them a query
    takes, from their keep flags (KeptLocalKeys or CausalKeptLocalKeys)."""
    WindowBlocks, ShiftBlocks, ShiftBlocksEarlier = blocks.WindowBlocks, blocks.ShiftBlocks, blocks.ShiftBlocksEarlier

    @script(ATTNREWRITE, default_opset=op)
    def WithPreviousBlock(x4):
        """[G, chunks, window, F] -> [G, chunks, 2 * window, F]: block c-1's rows, then c's."""
        previous = ShiftBlocks(x4, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Concat(previous, x4, axis=2)

    @script(ATTNREWRITE, default_opset=op)
    def WithNeighbourBlocks(x4):
        """[G, chunks, window, F] -> [G, chunks, 3 * window, F]: blocks c-1, c, then c+1."""
        following_block = ShiftBlocksEarlier(x4, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Concat(WithPreviousBlock(x4), following_block, axis=2)

    local_blocks = WithNeighbourBlocks if following else WithPreviousBlock

    @script(ATTNREWRITE, default_opset=op)
    def KeptLocalKeys(keep_local):
        return op.Greater(op.Transpose(keep_local, perm=[0, 1, 3, 2]), op.Constant(value_float=0.0))

    @script(ATTNREWRITE, default_opset=op)
    def CausalKeptLocalKeys(keep_local):
        # all of the previous block, the own block up to the query itself
        ones = op.Expand(op.Constant(value_float=1.0), op.Constant(value_ints=[window, 2 * window]))
        visible = op.Cast(op.Trilu(ones, op.Constant(value_int=window), upper=0), to=BOOL)
        return op.And(KeptLocalKeys(keep_local), visible)

    allowed_local_keys = CausalKeptLocalKeys if causal else KeptLocalKeys

    @script(ATTNREWRITE, default_opset=op)
    def LocalKeys(k, v, keep):
        """Blocked v, and every block's local keys, their values and which each query takes
        (kernels._exact_keys without sinks)."""
        zero = op.Constant(value_float=0.0)
        v4 = WindowBlocks(v, zero)
        allowed = allowed_local_keys(local_blocks(WindowBlocks(keep, zero)))
        return v4, local_blocks(WindowBlocks(k, zero)), local_blocks(v4), allowed

    return KeptLocalKeys, LocalKeys, local_blocks, allowed_local_keys


def _sink_mask_function(op, blocks: _WindowBlocks, window: int, causal: bool, following: bool, sinks: int):
    """SinkMask(n), or causal CausalSinkMask: which query of block c takes sink s as an extra
    exact key (kernels._sink_mask)."""
    BlockCount, FrontPad = blocks.BlockCount, blocks.FrontPad
    sink_positions = list(range(sinks))

    @script(ATTNREWRITE, default_opset=op)
    def SinkPositions(n):
        """[sinks]: the sinks' positions in the padded layout (sink s at s + pad)."""
        return op.Constant(value_ints=sink_positions) + FrontPad(n)

    @script(ATTNREWRITE, default_opset=op)
    def SinkMask(n):
        """[chunks, 1, sinks]: True where sink s lies outside block c's local keys, so block c's
        queries take it as an extra exact key (kernels._sink_mask)."""
        w = op.Constant(value_ints=[window])
        blocks = op.Range(op.Constant(value_int=0), op.Squeeze(BlockCount(n)), op.Constant(value_int=1))
        offset = op.Unsqueeze(op.Div(SinkPositions(n), w), op.Constant(value_ints=[0])) - op.Unsqueeze(
            blocks, op.Constant(value_ints=[1])
        )
        outside = op.Or(
            op.Less(offset, op.Constant(value_int=-1)), op.Greater(offset, op.Constant(value_int=int(following)))
        )
        return op.Unsqueeze(outside, op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def CausalSinkMask(n):
        """[chunks, window, sinks]: as SinkMask, and never a sink after the query."""
        rows = BlockCount(n) * op.Constant(value_ints=[window])
        query_at = op.Reshape(
            op.Range(op.Constant(value_int=0), op.Squeeze(rows), op.Constant(value_int=1)),
            op.Constant(value_ints=[-1, window, 1]),
        )
        return op.And(SinkMask(n), op.LessOrEqual(SinkPositions(n), query_at))

    return CausalSinkMask if causal else SinkMask


def _local_and_sink_keys_function(op, sinks: int, kept_local_keys, local_keys, sink_mask):
    """LocalAndSinkKeys(k, v, keep): LocalKeys with the sinks' columns after each block's local
    keys, taken where kept and where ``sink_mask`` says so."""

    @script(ATTNREWRITE, default_opset=op)
    def SinkRows(x, chunks):
        """[G, N, F] -> [G, chunks, sinks, F]: rows 0..sinks-1 (zero beyond N) for every block."""
        one = op.Constant(value_ints=[1])
        padded = op.Pad(x, op.Constant(value_ints=[0, sinks]), op.Constant(value_float=0.0), one)
        rows = op.Slice(padded, op.Constant(value_ints=[0]), op.Constant(value_ints=[sinks]), one)
        return op.Expand(op.Unsqueeze(rows, one), op.Concat(one, chunks, one, one, axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def LocalAndSinkKeys(k, v, keep):
        """LocalKeys with the sink columns after each block's local keys (kernels._exact_keys)."""
        v4, k_x, v_x, allowed = local_keys(k, v, keep)
        chunks = op.Shape(v4, start=1, end=2)
        taken = op.And(kept_local_keys(SinkRows(keep, chunks)), sink_mask(op.Shape(v, start=1, end=2)))
        k_all = op.Concat(k_x, SinkRows(k, chunks), axis=2)
        v_all = op.Concat(v_x, SinkRows(v, chunks), axis=2)
        return v4, k_all, v_all, op.Concat(allowed, taken, axis=3)

    return LocalAndSinkKeys


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


def _local_part_function(op, blocks: _WindowBlocks, flatten, expand_keep, exact_keys, scale: float):
    """LocalPart(q, k, v, key_keep): v in blocks, and the softmax sums and row max of every
    query block over its ``exact_keys``."""
    WindowBlocks = blocks.WindowBlocks
    LocalSoftmaxSums = _local_softmax_sums_function(op, scale)

    @script(ATTNREWRITE, default_opset=op)
    def LocalPart(q, k, v, key_keep):
        """v in blocks, and the exact part's softmax sums of every query block."""
        zero = op.Constant(value_float=0.0)
        v4, k_x, v_x, allowed = exact_keys(flatten(k), flatten(v), op.Cast(expand_keep(key_keep, k), to=FLOAT))
        local_num, local_den, local_max = LocalSoftmaxSums(WindowBlocks(flatten(q), zero), k_x, v_x, allowed)
        return v4, local_num, local_den, local_max

    return LocalPart


def _far_key_features_function(op, blocks: _WindowBlocks, flatten, without_sinks):
    """FarKeyFeatures(phi_k): the features the kernel part reads, in blocks, zero on the sinks."""
    WindowBlocks = blocks.WindowBlocks

    @script(ATTNREWRITE, default_opset=op)
    def FarKeyFeatures(phi_k):
        """phi_k in blocks, zero on the sinks."""
        zero = op.Constant(value_float=0.0)
        return WindowBlocks(without_sinks(flatten(phi_k), zero), zero)

    return FarKeyFeatures


def _far_kernel_functions(op):
    """(FarStates, KernelSums), causal: the kernel's key-value state and key sum over each
    block's far keys (blocks <= c-2), and a query block's numerator and denominator from them."""
    before_previous = exclusive_prefix_sum_function(op.version, skip=1)

    @script(ATTNREWRITE, default_opset=op)
    def EarlierBlocksSum(x):
        """Per block c (axis 1), the sum of x over blocks <= c-2 (no CumSum: PrefixSumBeforePrevious)."""
        return op.Reshape(before_previous(op.Reshape(x, op.Constant(value_ints=[0, 0, -1]))), op.Shape(x))

    @script(ATTNREWRITE, default_opset=op)
    def FarStates(pk4, v4):
        """The kernel's key-value state and key sum over each block's far keys."""
        kv = op.MatMul(op.Transpose(pk4, perm=[0, 1, 3, 2]), v4)
        return EarlierBlocksSum(kv), EarlierBlocksSum(op.ReduceSum(pk4, op.Constant(value_ints=[2]), keepdims=0))

    @script(ATTNREWRITE, default_opset=op)
    def KernelSums(pq4, far_kv, far_key_sum):
        numerator = op.MatMul(pq4, far_kv)
        weighted = pq4 * op.Unsqueeze(far_key_sum, op.Constant(value_ints=[2]))
        return numerator, op.ReduceSum(weighted, op.Constant(value_ints=[-1]), keepdims=1)

    return FarStates, KernelSums


def _total_less_local_function(op, local_blocks, following: bool):
    """TotalLessLocalSums(pq4, pk4, v4), bidirectional: the kernel's numerator and denominator
    over each query block's far keys, the whole sequence's sums less the block's local kernel
    terms (kernels._bidirectional_far_sums); ``local_blocks`` lays out a block's local keys."""
    far_gap = 2 if following else 1  # the first later block the kernel covers, from block c
    SequenceSum = sequence_sum_function(op.version)

    @script(ATTNREWRITE, default_opset=op)
    def HasFarBlocks(chunks):
        """[chunks, 1, 1]: whether block c has far blocks with keys (block 0 is padding)."""
        block = op.Range(op.Constant(value_int=0), op.Squeeze(chunks), op.Constant(value_int=1))
        earlier = op.GreaterOrEqual(block, op.Constant(value_int=3))
        later = op.Less(block + op.Constant(value_int=far_gap), op.Squeeze(chunks))
        return op.Unsqueeze(op.Or(earlier, later), op.Constant(value_ints=[1, 2]))

    @script(ATTNREWRITE, default_opset=op)
    def TotalLessLocalSums(pq4, pk4, v4):
        """phi(q).S - (phi(q) phi(k_local)^T) v_local, and the same with the key sum for S."""
        rows = op.Constant(value_ints=[0, -1])  # [G, chunks, window, *] -> [G, chunks * window, *]
        pq = op.Reshape(pq4, op.Concat(rows, op.Shape(pq4, start=3), axis=0))
        pk = op.Reshape(pk4, op.Concat(rows, op.Shape(pk4, start=3), axis=0))
        v = op.Reshape(v4, op.Concat(rows, op.Shape(v4, start=3), axis=0))
        state = op.MatMul(op.Transpose(pk, perm=[0, 2, 1]), v)  # [G, F, Dv]
        key_sum = SequenceSum(pk)  # [G, 1, F]
        blocked = op.Shape(pq4, end=3)
        total_num = op.Reshape(op.MatMul(pq, state), op.Concat(blocked, op.Shape(v4, start=3), axis=0))
        total_den = op.Reshape(
            op.MatMul(pq, op.Transpose(key_sum, perm=[0, 2, 1])),
            op.Concat(blocked, op.Constant(value_ints=[1]), axis=0),
        )
        local_scores = op.MatMul(pq4, op.Transpose(local_blocks(pk4), perm=[0, 1, 3, 2]))
        local_den = op.ReduceSum(local_scores, op.Constant(value_ints=[-1]), keepdims=1)
        far_num = total_num - op.MatMul(local_scores, local_blocks(v4))
        has_far = HasFarBlocks(op.Shape(pq4, start=1, end=2))
        zero = op.Constant(value_float=0.0)
        return op.Where(has_far, far_num, zero), op.Where(has_far, total_den - local_den, zero)

    return TotalLessLocalSums


def _blocked_far_sums_functions(op, far_states, rescaled_far_states, kernel_sums):
    """(FarSums, RescaledFarSums), causal: the kernel's numerator and denominator over each
    query block's far keys from per-block states (``far_states``, ``rescaled_far_states``)."""

    @script(ATTNREWRITE, default_opset=op)
    def FarSums(pq4, pk4, v4):
        far_kv, far_key_sum = far_states(pk4, v4)
        far_num, far_den = kernel_sums(pq4, far_kv, far_key_sum)
        return far_num, far_den

    @script(ATTNREWRITE, default_opset=op)
    def RescaledFarSums(pq4, pk4, v4, key_log_scale):
        far_kv, far_key_sum, far_log_scale = rescaled_far_states(pk4, v4, key_log_scale)
        far_num, far_den = kernel_sums(pq4, far_kv, far_key_sum)
        return far_num, far_den, far_log_scale

    return FarSums, RescaledFarSums


def _windowed_kernel_entry(op, blocks: _WindowBlocks, flatten, local_part, far_key_features, far_sums, eps: float):
    """WindowedKernelAttention: both parts' sums added, one normaliser (kernel features in the
    exact part's units already)."""
    WindowBlocks, UnblockLike = blocks.WindowBlocks, blocks.UnblockLike

    @script(ATTNREWRITE, default_opset=op)
    def WindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        zero = op.Constant(value_float=0.0)
        weighted_q = op.Cast(phi_q, to=FLOAT) * op.Exp(op.Cast(linear_log_weight, to=FLOAT))
        v4, local_num, local_den, local_max = local_part(q, k, v, key_keep)
        far_num, far_den = far_sums(WindowBlocks(flatten(weighted_q), zero), far_key_features(phi_k), v4)
        out = (local_num + far_num) / (local_den + far_den + op.Constant(value_float=eps))
        return UnblockLike(out, q, v)

    return WindowedKernelAttention


def _causal_rescaled_far_states_function(opset_version: int, blocks: _WindowBlocks, flatten, without_sinks):
    """CausalRescaledFarStates(pk4, v4, key_log_scale): far states when each key carries its
    own log scale (kernels._rescaled_earlier_states)."""
    op = standard_opset(opset_version)
    ChunkRunningMax, RescaledSumBeforePrevious = rescaled_prefix_functions(opset_version, skip=1)
    WindowBlocks, ShiftBlocks = blocks.WindowBlocks, blocks.ShiftBlocks

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledFarStates(pk4, v4, key_log_scale):
        """States over blocks <= c-2 when key j's features are pk_j * exp(s_j), referenced to
        R_c, the max of s over those blocks (see _rescaled_earlier_states); sinks count as
        missing keys."""
        lowest = op.Constant(value_float=LOWEST_LOG_SCALE)
        last = op.Constant(value_ints=[-1])
        s = op.Squeeze(WindowBlocks(without_sinks(flatten(key_log_scale), lowest), lowest), last)
        block_max = op.ReduceMax(s, last, keepdims=0)
        running = ChunkRunningMax(block_max)
        reach = ShiftBlocks(running, lowest, op.Constant(value_ints=[2]))
        k_rel = pk4 * op.Unsqueeze(op.Exp(s - op.Unsqueeze(block_max, last)), last)
        kv = op.MatMul(op.Transpose(k_rel, perm=[0, 1, 3, 2]), v4)
        flat_kv = RescaledSumBeforePrevious(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1])), block_max, reach)
        sums = RescaledSumBeforePrevious(op.ReduceSum(k_rel, op.Constant(value_ints=[2]), keepdims=0), block_max, reach)
        return op.Reshape(flat_kv, op.Shape(kv)), sums, op.Unsqueeze(reach, op.Constant(value_ints=[2, 3]))

    return CausalRescaledFarStates


def _head_rescaled_far_sums_function(op, flatten, far_sums):
    """HeadRescaledFarSums(pq4, pk4, v4, key_log_scale): the kernel's far sums when the keys
    share one log scale per head, and that log scale."""

    @script(ATTNREWRITE, default_opset=op)
    def HeadRescaledFarSums(pq4, pk4, v4, key_log_scale):
        """Bidirectional: one key log scale per head ([..., 1, 1]), so plain far sums."""
        far_num, far_den = far_sums(pq4, pk4, v4)
        return far_num, far_den, op.Unsqueeze(flatten(key_log_scale), op.Constant(value_ints=[-1]))

    return HeadRescaledFarSums


def _rescaled_parts_function(op, blocks: _WindowBlocks, flatten, local_part, far_key_features, rescaled_far_sums):
    """RescaledParts: both parts' sums, each in its own unit, before they are combined."""
    WindowBlocks = blocks.WindowBlocks

    @script(ATTNREWRITE, default_opset=op)
    def RescaledParts(phi_q, phi_k, key_log_scale, q, k, v, key_keep, linear_log_weight):
        """Both parts' sums, each in its own unit, the exact part's row max and the kernel
        part's log scale per block."""
        zero = op.Constant(value_float=0.0)
        weighted_q = op.Cast(phi_q, to=FLOAT) * op.Exp(op.Cast(linear_log_weight, to=FLOAT))
        v4, local_num, local_den, local_max = local_part(q, k, v, key_keep)
        pq4 = WindowBlocks(flatten(weighted_q), zero)
        far_num, far_den, far_log_scale = rescaled_far_sums(pq4, far_key_features(phi_k), v4, key_log_scale)
        return local_num, local_den, local_max, far_num, far_den, far_log_scale

    return RescaledParts


def _combine_rescaled_function(op, blocks: _WindowBlocks, eps: float):
    """CombineRescaled: the two parts moved to one unit by their log ratio, one normaliser."""
    UnblockLike = blocks.UnblockLike

    @script(ATTNREWRITE, default_opset=op)
    def CombineRescaled(local_num, local_den, far_num, far_den, ratio, q, v):
        """ratio: log of (kernel part's unit / exact part's unit), per query row; each side is
        scaled <= 1, so neither overflows."""
        zero = op.Constant(value_float=0.0)
        local_factor = op.Exp(op.Neg(op.Max(ratio, zero)))
        far_factor = op.Exp(op.Min(ratio, zero))
        numerator = local_num * local_factor + far_num * far_factor
        denominator = local_den * local_factor + far_den * far_factor
        return UnblockLike(numerator / (denominator + op.Constant(value_float=eps)), q, v)

    return CombineRescaled


def _windowed_rescaled_entry(op, blocks: _WindowBlocks, flatten, rescaled_parts, combine_rescaled, max_weighted: bool):
    """WindowedRescaledKernelAttention, whose kernel part is in units of e^(a_i + b_j) (the
    log scales), or ``max_weighted`` WindowedMaxWeightedKernelAttention, moved by e^(-beta_h m_i)."""
    WindowBlocks = blocks.WindowBlocks

    @script(ATTNREWRITE, default_opset=op)
    def WindowedRescaledKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
    ):
        local_num, local_den, local_max, far_num, far_den, far_log_scale = rescaled_parts(
            phi_q, phi_k, key_log_scale, q, k, v, key_keep, linear_log_weight
        )
        ratio = WindowBlocks(flatten(query_log_scale), op.Constant(value_float=0.0)) + far_log_scale - local_max
        return combine_rescaled(local_num, local_den, far_num, far_den, ratio, q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedMaxWeightedKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
    ):
        """As WindowedRescaledKernelAttention with the kernel part moved by e^(-beta_h m_i),
        beta_h = local_max_weight [heads, 1, 1]."""
        zero = op.Constant(value_float=0.0)
        local_num, local_den, local_max, far_num, far_den, far_log_scale = rescaled_parts(
            phi_q, phi_k, key_log_scale, q, k, v, key_keep, linear_log_weight
        )
        row_weight = op.Expand(op.Cast(local_max_weight, to=FLOAT), op.Shape(query_log_scale))
        weighted_max = local_max * WindowBlocks(flatten(row_weight), zero)
        ratio = WindowBlocks(flatten(query_log_scale), zero) + far_log_scale - weighted_max
        return combine_rescaled(local_num, local_den, far_num, far_den, ratio, q, v)

    return WindowedMaxWeightedKernelAttention if max_weighted else WindowedRescaledKernelAttention


# --- ONNX: the causal forms continued from a state (passes/recurrent.py) ------------------------
# Every tensor is flattened to [G, ...] by the caller: the state to [G, F, Dv], [G, F] and
# [G, 1] (its log scale).

PREFIX_GROUP = 16  # rows per group at each level of the hierarchical prefix sums and maxima


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
    kernel_sums = _far_kernel_functions(op)[1]
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
    kept_local_keys, _, with_previous_block, causal_kept_local_keys = _local_key_pieces(
        op, blocks, window, causal=True, following=False
    )

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
    """RecurrentRescaledFarStates: _rescaled_earlier_states_after, with the block carry of
    CausalRescaledFarStates."""
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
