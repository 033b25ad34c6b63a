"""The causal window hybrid continued from a state, in torch (passes/kernel/recurrence.py): the
queries of N new positions over the last 2W - 1 keys kept exactly, the sinks, and the kernel
state of every key before them."""

from __future__ import annotations

import typing

from attnrewrite.passes.kernel.chunks import running_max, shift_right
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.state import KernelState
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.window.blocks import (
    PositionedLayout,
    earlier_blocks_sum,
    local_causal_mask,
    local_softmax_sums,
    previous_and_own_blocks,
    without_sinks,
)
from attnrewrite.passes.window.settings import UNSCALED, KernelScales, Window


def far_key_features(phi_k, key_log_scale, start: int, sinks: int):
    """What the window's kernel part reads of keys at positions start, start + 1, ...: phi_k
    zero and the log scale (if any) LOWEST_LOG_SCALE on the sinks, which are exact keys only."""
    far_phi_k = without_sinks(phi_k.float(), sinks, 0.0, start)
    if key_log_scale is None:
        return far_phi_k, None
    return far_phi_k, without_sinks(key_log_scale.float(), sinks, LOWEST_LOG_SCALE, start)


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
    window: Window,
    *,
    start: int,
    sink_keys: SinkKeys | None,
    far: KernelState,
    scale: float,
    scales: KernelScales = UNSCALED,
    eps: float = DENOMINATOR_EPS,
):
    """The causal windowed_kernel_attention of the last N' rows of the keys k, v, keep [..., N, *]
    (positions start .. start + N - 1; far_phi_k and ``scales.key_log_scale`` from
    far_key_features), whose queries phi_q, q, ``scales.query_log_scale`` are [..., N', *].
    ``far``: every key before ``start`` that is no sink; they lie in blocks before every
    query's previous one (the caller keeps the 2 * window.size - 1 positions before the queries
    among k), so they are all kernel part. The sinks are ``sink_keys`` (None: none). Blocks are
    aligned to sequence positions, as the parallel causal form's."""
    linear_log_weight, query_log_scale, far_key_log_scale, local_max_weight = scales
    lead, n_keys, n = k.shape[:-2], k.shape[-2], q.shape[-2]
    q, k, v, phi_q = q.float(), k.float(), v.float(), phi_q.float()
    if linear_log_weight is not None:
        phi_q = phi_q * torch.exp(linear_log_weight.float())
    layout = PositionedLayout(start, n_keys, window.size)

    def query_blocks(x):  # queries are the last rows: none for the rows before them
        return layout.blocks(torch.nn.functional.pad(x.float().expand(*lead, n, x.shape[-1]), (0, 0, n_keys - n, 0)))

    keep = keep.float().expand(*k.shape[:-1], 1)
    local_num, local_den, local_max = local_softmax_sums(
        query_blocks(q), *positioned_exact_keys(layout, start, k, v, keep, sink_keys), scale
    )
    pq4, v4, pk4 = query_blocks(phi_q), layout.blocks(v), layout.blocks(far_phi_k)
    if far_key_log_scale is None:
        far_kv = earlier_blocks_sum(pk4.transpose(-2, -1) @ v4) + flatten_heads(far.kv).unsqueeze(1)
        far_key_sum = earlier_blocks_sum(pk4.sum(dim=2)) + far.key_sum.reshape(-1, 1, pk4.shape[-1])
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


def positioned_exact_keys(layout, start: int, k, v, keep, sink_keys: SinkKeys):
    """_causal_exact_keys of a PositionedLayout: the previous and own block up to the query,
    then the sinks from ``sink_keys``, taken by a query of a later block than their next one and
    not before them."""
    taken = local_causal_mask(layout.chunk, k.device)

    def exact(x, sink):
        local = torch.cat(previous_and_own_blocks(layout.blocks(x)), dim=2)
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
    reach = torch.maximum(shift_right(running_max(block_max), LOWEST_LOG_SCALE, steps=2), absorbed)
    k_rel = pk4 * torch.exp(s - block_max.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4
    carry = torch.tril(torch.exp(torch.clamp_max(block_max.unsqueeze(1) - reach.unsqueeze(2), 0.0)), diagonal=-2)
    held = torch.exp(absorbed - reach).unsqueeze(-1)
    state = carry @ kv.flatten(2) + held * flatten_heads(far.kv).flatten(1).unsqueeze(1)
    key_sum = carry @ k_rel.sum(dim=2) + held * far.key_sum.reshape(-1, 1, pk4.shape[-1])
    return state.reshape(kv.shape), key_sum, reach[..., None, None]
