"""The causal window's sparse exact cache (``sparse=G``; LoLA, arXiv 2505.23666): G key/value
pairs per key/value head kept exactly beyond the window, those the kernel state recalls worst.

Definition. Blocks of W positions are aligned to sequence positions (block c holds positions
cW .. cW + W - 1), as everywhere in the causal window. The queries of block c take exactly
blocks c-1 and c (up to themselves), the sinks (positions < sinks) and the cache C_c; the kernel
state S_c, z_c holds every other earlier key; one normaliser. Going from block c-1 to block c,
block c-2 leaves the window: the candidates are C_{c-1} and block c-2's keys (kept ones only:
padded keys and sinks never enter), each scored by its self-recall error against the state as
it is before that block is folded,
    e_j = sum over the query heads h sharing j's key/value head of
          || phi_h(k_j)^T S_h / (phi_h(k_j)^T z_h + eps) - v_j ||^2
(phi_h(k_j) the key's features without its log scale: the ratio does not depend on it; S, z in
the state's own units); the G with the largest e_j form C_c (equal errors: the earlier position
stays), the others are folded into S, z (with their log scales, where the unit has them). The
selection is discrete (no gradient); gradients flow through the kept pairs and the state. The
query heads of a key/value head share its cache (Window.groups; 1 where the site does not say
how its heads are grouped: then every head has its own).

Because the cache changes only where a block leaves, the parallel form is block-sequential
(sparse_cached_blocks: a loop over blocks, the kernel state carried), and the recurrent form is
the same loop from a decoder's state (sparse_attention_from_state): a block leaves once the next
query lies two blocks past it, so stepped equals parallel. The reference is
reference.sparse_cached_keys (a plain sequential simulation in float64)."""

from __future__ import annotations

import typing

from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.state import KernelState, absorb_keys
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.window.blocks import PositionedLayout, local_softmax_sums
from attnrewrite.passes.window.settings import KernelScales, Window
from attnrewrite.passes.window.torch_state import SinkKeys, far_key_features, positioned_exact_keys


class Pairs(typing.NamedTuple):
    """Keys, values and keep flags [..., rows, *]."""

    k: typing.Any
    v: typing.Any
    keep: typing.Any


class CacheSlots(typing.NamedTuple):
    """Which rows the cache holds, per key/value head: ``index`` [Gkv, G] into the rows of
    CachedRows, ``kept`` [Gkv, G] (False: an empty slot). Slots hold their rows in position
    order, empty ones last."""

    index: typing.Any
    kept: typing.Any


class CachedRows(typing.NamedTuple):
    """Every row the cache can hold, per query head [G, rows, *]: the incoming cache's rows, then
    the layout's blocks, flattened. k as the exact part reads it, v, phi_k as the kernel state
    takes it (zero on sinks and padding) and its log scale (None: a shared unit)."""

    k: typing.Any
    v: typing.Any
    phi_k: typing.Any
    key_log_scale: typing.Any


class QueryBlocks(typing.NamedTuple):
    """The queries in blocks [G, chunks, W, *]: q, phi_q (weighted), their log scales and the
    max weight beta_h (None where the unit has none)."""

    q: typing.Any
    phi_q: typing.Any
    log_scale: typing.Any
    max_weight: typing.Any


def sparse_windowed_causal(phi_q, phi_k, q, k, v, keep, scales: KernelScales, window: Window, *, scale, eps):
    """The causal windowed_kernel_attention with a sparse cache, from no state: inputs [..., N, *]
    in float32 (phi_q weighted, phi_k zero on padded keys, keep [..., N, 1]); returns [G, N, Dv]."""
    sinks, size, n = window.sinks, window.sparse, q.shape[-2]
    layout = PositionedLayout(0, n, window.size)
    sink_keys = SinkKeys(*(_first_rows(x, sinks) for x in (k, v, keep))) if sinks else None
    far_phi_k, far_key_log_scale = far_key_features(phi_k, scales.key_log_scale, 0, sinks)
    positioned = CachedRows(k, v, far_phi_k, far_key_log_scale)
    no_cache = CachedRows(*(None if x is None else torch.zeros_like(flatten_heads(x)[:, :1]) for x in positioned))
    no_cache = CachedRows(*(None if x is None else x.expand(-1, size, -1) for x in no_cache))
    rows = _laid_out(layout, no_cache, positioned)
    heads, features = rows.phi_k.shape[0], rows.phi_k.shape[-1]
    state = KernelState(
        rows.phi_k.new_zeros(heads, features, rows.v.shape[-1]),
        rows.phi_k.new_zeros(heads, features),
        None if far_key_log_scale is None else rows.phi_k.new_full((heads,), LOWEST_LOG_SCALE),
    )
    kv_keep = flatten_heads(keep)[:: window.groups]
    no_slot = torch.zeros(kv_keep.shape[0], size, dtype=torch.bool, device=q.device)
    out, _, _ = sparse_cached_blocks(
        _query_blocks(layout, n, q, phi_q, scales),
        positioned_exact_keys(layout, 0, k, v, keep, sink_keys),
        rows,
        _candidates(layout, kv_keep, 0, window),
        CacheSlots(torch.arange(size, device=q.device).expand(kv_keep.shape[0], -1), no_slot),
        state,
        window=window,
        scale=scale,
        eps=eps,
    )
    return layout.unblock(out)


def sparse_attention_from_state(
    phi_q, q, rows: CachedRows, keep, pairs: Pairs, window: Window, *, start, sink_keys, far, scale, scales, eps
):
    """The causal window with a sparse cache continued from a decoder's state (kernel.recurrent_torch):
    the queries phi_q, q [..., N', *] of the last N' of the rows (per query head, unweighted
    phi_q): ``rows`` and ``keep`` [..., G + N, *], the G cached pairs first, then positions
    ``start`` .. start + N - 1 (the window's 2W - 1 and the new ones; phi_k zero where padded),
    ``pairs`` the same rows per key/value head as the state keeps them. ``far``: the kernel state.
    Returns (out [..., N', Dv], the kernel state and the cache, Pairs shaped as pairs' first G
    rows, after every block that has left by the next position)."""
    size, n = window.sparse, q.shape[-2]
    lead, n_keys = rows.k.shape[:-2], rows.k.shape[-2] - size
    layout = PositionedLayout(start, n_keys, window.size)
    if scales.linear_log_weight is not None:
        phi_q = phi_q.float() * torch.exp(scales.linear_log_weight.float())
    cached = CachedRows(*(None if x is None else x[..., :size, :].float() for x in rows))
    positioned = CachedRows(*(None if x is None else x[..., size:, :].float() for x in rows))
    far_phi_k, far_key_log_scale = far_key_features(positioned.phi_k, positioned.key_log_scale, start, window.sinks)
    positioned = positioned._replace(phi_k=far_phi_k, key_log_scale=far_key_log_scale)
    kv_keep = flatten_heads(pairs.keep.float())
    out, state, slots = sparse_cached_blocks(
        _query_blocks(layout, n_keys, q, phi_q, scales),
        positioned_exact_keys(layout, start, positioned.k, positioned.v, keep[..., size:, :].float(), sink_keys),
        _laid_out(layout, cached, positioned),
        _candidates(layout, kv_keep[:, size:], start, window),
        CacheSlots(torch.arange(size, device=q.device).expand(kv_keep.shape[0], -1), kv_keep[:, :size, 0] > 0),
        _flat_state(far),
        window=window,
        scale=scale,
        eps=eps,
        leave_last=layout.tail == 0,
    )
    out = layout.unblock(out)[:, n_keys - n :].reshape(*lead, n, rows.v.shape[-1])
    state = KernelState(*(None if x is None else x.reshape(y.shape) for x, y in zip(state, far)))
    return out, state, _cached_pairs(layout, pairs, slots, size)


def _flat_state(state: KernelState) -> KernelState:
    """``state`` with its heads flattened: [G, F, Dv], [G, F], [G]."""
    kv = flatten_heads(state.kv)
    log_scale = None if state.log_scale is None else state.log_scale.reshape(-1)
    return KernelState(kv, state.key_sum.reshape(kv.shape[0], -1), log_scale)


def _cached_pairs(layout: PositionedLayout, pairs: Pairs, slots: CacheSlots, size: int) -> Pairs:
    """The pairs the cache's slots hold, shaped as ``pairs``' first ``size`` rows (keep: 1.0 in a
    held slot; an empty slot's key and value are whichever row its index names)."""

    def held(x):
        rows = torch.cat([flatten_heads(x[..., :size, :]), layout.blocks(x[..., size:, :]).flatten(1, 2)], dim=1)
        return _gathered(rows, slots.index).reshape(x[..., :size, :].shape)

    keep = slots.kept.to(pairs.keep.dtype).unsqueeze(-1).reshape(pairs.keep[..., :size, :].shape)
    return Pairs(held(pairs.k), held(pairs.v), keep)


def sparse_cached_blocks(
    queries: QueryBlocks,
    exact,
    rows: CachedRows,
    candidate,
    slots: CacheSlots,
    state: KernelState,
    *,
    window: Window,
    scale: float,
    eps: float,
    leave_last: bool = False,
):
    """The blocks' outputs [G, chunks, W, Dv] and the kernel state and cache slots after them:
    block by block, block b - 2 leaving before block b's queries (and, ``leave_last``, the one
    before the last block after it: the next query starts a new block). ``exact``: each block's
    local and sink keys, values and which each query takes (torch_state.positioned_exact_keys);
    ``candidate`` [Gkv, rows]: the rows that may enter the cache (kept keys, no sinks)."""
    width, chunks = window.size, exact[0].shape[1]
    first = rows.k.shape[1] - chunks * width  # the incoming cache's own rows come first
    outs = []
    for block in range(chunks):
        if block >= 2:
            state, slots = _leave(rows, candidate, slots, state, first + (block - 2) * width, window, eps)
        outs.append(_block_attention(queries, exact, rows, slots, state, block, window.groups, scale, eps))
    if leave_last and chunks >= 2:
        state, slots = _leave(rows, candidate, slots, state, first + (chunks - 2) * width, window, eps)
    return torch.stack(outs, dim=1), state, slots


def _block_attention(
    queries: QueryBlocks, exact, rows: CachedRows, slots: CacheSlots, state, block, groups, scale, eps
):
    """Block ``block``'s queries over its local keys, the sinks and the cache (one softmax), and
    the kernel state, under one normaliser (as the causal window's, torch_state's)."""
    local_keys, local_values, taken = (x[:, block] for x in exact)
    index = slots.index.repeat_interleave(groups, 0)
    keys = torch.cat([local_keys, _gathered(rows.k, index)], dim=1)
    values = torch.cat([local_values, _gathered(rows.v, index)], dim=1)
    held = slots.kept.repeat_interleave(groups, 0).unsqueeze(1).expand(-1, taken.shape[1], -1)
    num, den, row_max = local_softmax_sums(queries.q[:, block], keys, values, torch.cat([taken, held], -1), scale)
    phi_q = queries.phi_q[:, block]
    far_num, far_den = phi_q @ state.kv, phi_q @ state.key_sum.unsqueeze(-1)
    if state.log_scale is not None:  # log of (kernel part's unit / exact part's unit), per query row
        if queries.max_weight is not None:
            row_max = row_max * queries.max_weight[:, block]
        ratio = queries.log_scale[:, block] + state.log_scale[:, None, None] - row_max
        local_factor, far_factor = torch.exp(-torch.clamp_min(ratio, 0.0)), torch.exp(torch.clamp_max(ratio, 0.0))
        num, den = num * local_factor, den * local_factor
        far_num, far_den = far_num * far_factor, far_den * far_factor
    return (num + far_num) / (den + far_den + eps)


def _leave(rows: CachedRows, candidate, slots: CacheSlots, state: KernelState, first: int, window: Window, eps):
    """The block of rows ``first`` .. first + W - 1 leaves the window: of it and the cache, the
    window.sparse pairs the state recalls worst stay (recall_errors, summed over a key/value
    head's query heads), the others are folded into the state."""
    groups = window.groups
    block = torch.arange(first, first + window.size, device=candidate.device)
    index = torch.cat([slots.index, block.expand(slots.index.shape[0], -1)], dim=-1)
    valid = torch.cat([slots.kept, candidate[:, first : first + window.size]], dim=-1)
    per_head = index.repeat_interleave(groups, 0)
    phi_k, values = _gathered(rows.phi_k, per_head), _gathered(rows.v, per_head)
    with torch.no_grad():  # the selection is discrete
        errors = recall_errors(phi_k, values, state, eps).unflatten(0, (-1, groups)).sum(1)
        kept = _worst(errors, valid, window.sparse)
    folded = (valid & ~kept).repeat_interleave(groups, 0).unsqueeze(-1)
    log_scale = None
    if rows.key_log_scale is not None:
        log_scale = torch.where(folded, _gathered(rows.key_log_scale, per_head), LOWEST_LOG_SCALE)
    state = absorb_keys(state, phi_k * folded, values, log_scale)
    order = torch.argsort((~kept).to(torch.uint8), dim=-1, stable=True)[:, : window.sparse]  # held ones first
    return state, CacheSlots(index.gather(-1, order), kept.gather(-1, order))


def recall_errors(phi_k, v, state: KernelState, eps: float):
    """|| phi_k^T S / (phi_k^T z + eps) - v ||^2 per row of phi_k [G, R, F], v [G, R, Dv]: how
    badly the kernel state recalls each pair (S, z in the state's own units)."""
    recalled = (phi_k @ state.kv) / (phi_k @ state.key_sum.unsqueeze(-1) + eps)
    return ((recalled - v) ** 2).sum(-1)


def _worst(errors, valid, size: int):
    """[Gkv, R] bool: the ``size`` valid candidates with the largest errors; of equal ones the
    earlier row (candidates are in position order)."""
    errors = torch.where(valid, errors, -torch.inf)
    row = torch.arange(errors.shape[-1], device=errors.device)
    worse = errors.unsqueeze(-1) > errors.unsqueeze(-2)  # [.., a, b]: a recalled worse than b
    tied_before = (errors.unsqueeze(-1) == errors.unsqueeze(-2)) & (row.unsqueeze(-1) < row)
    rank = ((worse | tied_before) & valid.unsqueeze(-1)).sum(-2)
    return valid & (rank < size)


def _gathered(x, index):
    """Rows ``index`` [G, R] of x [G, rows, F]."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _laid_out(layout: PositionedLayout, cached: CachedRows, positioned: CachedRows) -> CachedRows:
    """CachedRows [G, G' + chunks * W, *]: the cache's rows, then the positioned ones in blocks."""

    def rows(head, tail, fill=0.0):
        if head is None:
            return None
        return torch.cat([flatten_heads(head), layout.blocks(tail, fill).flatten(1, 2)], dim=1)

    return CachedRows(
        rows(cached.k, positioned.k),
        rows(cached.v, positioned.v),
        rows(cached.phi_k, positioned.phi_k),
        rows(cached.key_log_scale, positioned.key_log_scale, LOWEST_LOG_SCALE),
    )


def _candidates(layout: PositionedLayout, keep, start: int, window: Window):
    """[Gkv, G' + chunks * W]: the rows that may enter the cache, as _laid_out lays them out
    (none of the cache's own: its slots say which it holds), from ``keep`` [Gkv, N, 1] of the
    positioned rows: kept keys that are no sink."""
    position = start + torch.arange(keep.shape[-2], device=keep.device).unsqueeze(-1)
    flags = layout.blocks(((keep > 0) & (position >= window.sinks)).float()).flatten(1, 2)[..., 0] > 0
    return torch.cat([torch.zeros_like(flags[:, :1]).expand(-1, window.sparse), flags], dim=-1)


def _query_blocks(layout: PositionedLayout, n_keys, q, phi_q, scales: KernelScales) -> QueryBlocks:
    """The queries (the last rows of the layout's) in blocks; the rows before them zero."""
    lead, n = q.shape[:-2], q.shape[-2]

    def blocks(x):
        if x is None:
            return None
        return layout.blocks(torch.nn.functional.pad(x.float().expand(*lead, n, x.shape[-1]), (0, 0, n_keys - n, 0)))

    return QueryBlocks(blocks(q), blocks(phi_q), blocks(scales.query_log_scale), blocks(scales.local_max_weight))


def _first_rows(x, count: int):
    """Rows 0 .. count - 1 of x [..., N, *], zero beyond N."""
    return torch.nn.functional.pad(x, (0, 0, 0, max(0, count - x.shape[-2])))[..., :count, :]
