"""The window hybrid in torch (the FX lowering, and what calibration fits): windowed_kernel_attention,
bidirectional in pairs of blocks, causal with its far part by chunks of blocks; and
feature_map_attention, the one call of a kernel method's module, window or not."""

from __future__ import annotations

from attnrewrite.passes.kernel import delta
from attnrewrite.passes.kernel.chunks import (
    ChunkLayout,
    chunk_running_max,
    exclusive_cumsum,
    rescaled_prefix_sum,
    shift_right,
)
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, EXP_FLOOR, LOWEST_LOG_SCALE, NO_EXACT_KEY_SHIFT
from attnrewrite.passes.kernel.parallel import linear_attention
from attnrewrite.passes.kernel.state import chunk_kernel_attention
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.window.blocks import (
    BlockPairs,
    FarChunks,
    causal_sink_mask,
    local_causal_mask,
    local_softmax_sums,
    pair_structure,
    paired_sink_mask,
    previous_and_own_blocks,
    sink_rows,
    values_and_ones,
    without_sinks,
)
from attnrewrite.passes.window.settings import UNSCALED, WINDOW_FAR_CHUNK, KernelScales, Window
from attnrewrite.passes.window.sparse_cache import sparse_windowed_causal


def windowed_kernel_attention(
    phi_q,
    phi_k,
    q,
    k,
    v,
    window: Window,
    *,
    scale: float,
    causal: bool,
    key_keep=None,
    scales: KernelScales = UNSCALED,
    eps: float = DENOMINATOR_EPS,
    far_chunk: int = WINDOW_FAR_CHUNK,
):
    """Exact softmax over nearby keys and sink keys plus kernel attention over the rest, one
    normaliser.

    Queries go in blocks of ``window.size`` (laid out by ChunkLayout: aligned to the end of the
    sequence, causal ones to its start, so that a causal output never depends on what follows
    it); block c's exact keys are
    - its local keys: blocks c-1, c and, when bidirectional and ``window.following``, c+1 (causal:
      c-1 and the causal part of c; a causal site never sees later keys, whatever following);
    - the sinks: sequence positions 0..window.sinks-1, for every query (attention sinks such as
      [CLS]), unless the sink is already a local key of the block (no key counts twice) or,
      causal, comes after the query. Positions, not the first kept keys: under left padding
      the sinks are padding, masked like any padded key.
    The kernel covers every other key: blocks <= c-2 and >= c+2 (>= c+1 without following;
    causal: <= c-2), never a sink; with ``window.sparse`` (causal) but for the sparse cache's
    pairs, exact too (sparse_cache.py: block by block). Row i is
        (sum_exact e^(s_ij - m_i) v_j + w_h sum_far phi_i.phi_j v_j) / (the same without v_j)
    with s_ij = scale * q_i.k_j, m_i the max over row i's exact keys and w_h =
    exp(scales.linear_log_weight) ([heads, 1, 1], broadcast like phi_q's leading axes).

    Where phi_q_i.phi_k_j * exp(query_log_scale_i + key_log_scale_j) estimates e^(s_ij) itself
    (FAVOR+'s stabilised features, see favor.py), the log scales say so and the kernel part is
    moved to the exact part's units e^(s_ij - m_i): w_h = 1 is then the unbiased hybrid.
    ``scales.key_log_scale``: one per head ([..., 1, 1]) for bidirectional sites, one per key
    ([..., N, 1], the lowest log scale for padding) for causal ones. ``scales.local_max_weight``
    (beta_h, [heads, 1, 1]; default 1) moves the kernel part by e^(-beta_h m_i) instead, for
    fitted features that carry part of the row's scale themselves (hedgehog.py). The two parts
    are scaled by exp(-max(t, 0)) and exp(min(t, 0)) with t their log ratio, so neither
    overflows.

    ``key_keep`` masks the exact part; phi_k must already be zero on padded keys. Memory is
    O(N * (3 * window + sinks) + N * F) and the far states: one [F, Dv + 1] bidirectional (in
    pairs of blocks, see the package docstring for its rounding; one per block up to
    STATE_BLOCKS blocks), one per chunk of about
    ``far_chunk`` positions causal (FarChunks, as the ONNX form; a matter of speed only);
    nothing is N x N. All in float32.
    """
    lead, n = q.shape[:-2], q.shape[-2]
    q, k, v, phi_q, phi_k = q.float(), k.float(), v.float(), phi_q.float(), phi_k.float()
    if scales.linear_log_weight is not None:
        phi_q = phi_q * torch.exp(scales.linear_log_weight.float())  # w_h scales the kernel part only
    keep = torch.ones_like(k[..., :1]) if key_keep is None else key_keep.float().expand(*k.shape[:-1], 1)
    if causal and window.sparse:
        out = sparse_windowed_causal(phi_q, phi_k, q, k, v, keep, scales, window, scale=scale, eps=eps)
    elif causal:  # window.following changes nothing: a causal site never sees later keys
        out = _windowed_causal(phi_q, phi_k, q, k, v, keep, scales, window, scale=scale, far_chunk=far_chunk, eps=eps)
    else:
        out = windowed_bidirectional(phi_q, phi_k, q, k, v, keep, scales, window, scale=scale, eps=eps)
    return out.reshape(*lead, n, v.shape[-1])


def windowed_bidirectional(phi_q, phi_k, q, k, v, keep, scales: KernelScales, window: Window, *, scale, eps):
    """windowed_kernel_attention, bidirectional: in pairs of blocks (_bidirectional_window)."""
    lead, n = q.shape[:-2], q.shape[-2]
    pairs = BlockPairs(n, window.size)
    if scales.key_log_scale is None:
        ratio_of = torch.zeros_like  # both parts in one unit already
    else:
        offset = pairs.rows(flatten_heads(scales.query_log_scale.float())) + flatten_heads(scales.key_log_scale.float())
        weight = 1.0
        if scales.local_max_weight is not None:  # [heads, 1, 1] -> one per query row
            weight = pairs.rows(flatten_heads(scales.local_max_weight.float().expand(*lead, n, 1)))
        ratio_of = lambda row_max: offset - weight * row_max  # noqa: E731
    flat = (flatten_heads(x) for x in (q * scale, k, v, keep, phi_q, without_sinks(phi_k, window.sinks, 0.0)))
    sums = _bidirectional_window(pairs, *flat, ratio_of, following=window.following, sinks=window.sinks)
    sums = pairs.real_rows(sums)
    return sums[..., :-1] / (sums[..., -1:] + eps)


def _windowed_causal(phi_q, phi_k, q, k, v, keep, scales: KernelScales, window: Window, *, scale, far_chunk, eps):
    """windowed_kernel_attention, causal: the exact part over concatenated local blocks, the
    far part (blocks <= c-2) by chunks of blocks (FarChunks)."""
    _, query_log_scale, key_log_scale, local_max_weight = scales
    lead, n, sinks = q.shape[:-2], q.shape[-2], window.sinks
    layout = ChunkLayout(n, window.size, aligned_to_start=True)
    local_num, local_den, local_max = local_softmax_sums(
        layout.blocks(q), *_causal_exact_keys(layout, k, v, keep, sinks), scale
    )
    # The kernel never sees a sink: zero features, and (per-key log scales) the lowest log
    # scale, so that no sink raises a running max.
    chunks = FarChunks(layout, far_chunk, q.device)
    far_rows = flatten_heads(phi_q), flatten_heads(without_sinks(phi_k, sinks, 0.0)), flatten_heads(v)
    if key_log_scale is None:
        far_sums = _far_sums(chunks, *far_rows)
    else:
        far_key_log_scale = without_sinks(flatten_heads(key_log_scale.float()), sinks, LOWEST_LOG_SCALE)
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


def module_windowed_attention(module, phi_q, phi_k, q, k, v, key_keep, scales, eps: float = DENOMINATOR_EPS):
    """windowed_kernel_attention with the ``window``, ``scale`` and ``causal`` of a module (linear,
    favor)."""
    return windowed_kernel_attention(
        phi_q,
        phi_k,
        q,
        k,
        v,
        module.window,
        scale=module.scale,
        causal=module.causal,
        key_keep=key_keep,
        scales=scales,
        eps=eps,
    )


def feature_map_attention(module, phi_q, phi_k, q, k, v, key_keep=None):
    """Attention with the feature maps phi_q, phi_k of a module that has ``causal``, ``chunk``,
    ``window`` (a Window or None), ``scale``, ``linear_log_weight`` and ``update`` (linear,
    hedgehog): the window hybrid when it has a window, else the plain or causal chunked kernel,
    its state additive or by the delta rule (kernel/delta.py). Padded keys leave numerator and
    denominator (their phi_k rows are zeroed here)."""
    if key_keep is not None:
        phi_k = phi_k * key_keep
    if module.window is not None:
        scales = KernelScales(linear_log_weight=module.linear_log_weight)
        return module_windowed_attention(module, phi_q, phi_k, q, k, v, key_keep, scales)
    if module.causal and module.update == delta.DELTA:
        return delta.chunk_delta_attention(phi_q, phi_k, v, chunk=module.chunk)[0]
    if module.causal:
        return chunk_kernel_attention(phi_q, phi_k, v.float(), chunk=module.chunk)[0]
    return linear_attention(phi_q, phi_k, v.float())


def _causal_exact_keys(layout, k, v, keep, sinks: int):
    """Every causal query block's exact keys [G, chunks, 2 * window + sinks, *]: its local blocks
    (previous_and_own_blocks), then the sink columns; their values likewise; and which of them
    each query takes ([G, chunks, window, keys]): kept ones, causally visible, a sink only
    outside the block's local keys and not after the query."""

    def exact(x):
        sink = [sink_rows(x, sinks, layout.chunks)] if sinks else []
        return torch.cat([*previous_and_own_blocks(layout.blocks(x)), *sink], dim=2)

    taken = local_causal_mask(layout.chunk, k.device)
    if sinks:
        sink = causal_sink_mask(layout, sinks, k.device)
        taken = torch.cat([taken.expand(layout.chunks, -1, -1), sink], dim=-1)
    return exact(k), exact(v), (exact(keep).transpose(-2, -1) > 0) & taken


def _far_sums(chunks: FarChunks, pq, pk, v):
    """[G, chunks, W, Dv + 1]: the kernel's numerator and denominator over each query block's
    far keys, from rows [G, N, *] (phi_q weighted, phi_k zero on the sinks), as the ONNX
    FarSums: the exclusive prefix of per-chunk states, and the far keys inside the chunk."""
    q_c, k_c, vo_c = chunks.queries(pq), chunks.keys(pk), chunks.keys(values_and_ones(v))
    state = exclusive_cumsum(k_c.transpose(-2, -1) @ vo_c)  # [G, chunks', F, Dv + 1]
    return chunks.blocks(q_c @ state + chunks.within(q_c, k_c, vo_c, chunks.earlier_blocks))


def _rescaled_far_sums(chunks: FarChunks, pq, pk, v, s):
    """_far_sums when key j's features are pk_j * exp(s_j) (s [G, N, 1], the lowest log scale on
    the sinks and padding), in units of R_c, the max of s over block c's far keys (the lowest
    log scale if none), so that no factor exceeds 1 and R_c reads no key after the block;
    returns R_c too, as [G, chunks, 1, 1]. The references are the ONNX RescaledFarSums': chunk
    states relative to their own max U_k, carried to B_k (the max over the key chunks before)
    by rescaled_prefix_sum, then to R_c >= B_k. Each key is first moved to its block's max M_b
    (<= U_k, and <= R_c where the block is far) on its features: a key whose features are huge
    and whose log scale is tiny keeps its product, where e^(s_j - U_k) alone could underflow."""
    lowest, least = LOWEST_LOG_SCALE, NO_EXACT_KEY_SHIFT
    block_max = chunks.layout.blocks(s, lowest)[..., 0].amax(dim=-1)  # [G, chunks]
    reach = shift_right(chunk_running_max(block_max, chunks.layout.groups), lowest, steps=2)  # R_c
    r_c = chunks.per_block(torch.clamp_min(reach, least))  # [G, chunks', P]
    s_b = chunks.in_blocks(chunks.keys(s, lowest))  # [G, chunks', P, W, 1]
    key_block_max = torch.clamp_min(s_b.amax(dim=(-2, -1)), least)  # M_b [G, chunks', P]
    chunk_max = key_block_max.amax(dim=-1)  # U_k
    before = shift_right(chunk_running_max(chunk_max, chunks.groups), lowest)  # B_k
    q_c, k_c, vo_c = chunks.queries(pq), chunks.keys(pk), chunks.keys(values_and_ones(v))
    k_rel = chunks.in_blocks(k_c) * torch.exp(s_b - key_block_max[..., None, None])  # [G, chunks', P, W, F]
    to_chunk = torch.exp(key_block_max - chunk_max.unsqueeze(-1))[..., None, None]  # M_b to U_k
    kv = (k_rel * to_chunk).flatten(2, 3).transpose(-2, -1) @ vo_c
    state = rescaled_prefix_sum(kv.flatten(2), chunk_max, before, chunks.groups).reshape(kv.shape)
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


def _bidirectional_window(pairs: BlockPairs, q, k, v, keep, phi_q, phi_k, ratio_of, *, following: bool, sinks: int):
    """[G, rows, Dv + 1]: the bidirectional window's numerator and denominator (the ONNX
    PairedWindow's sums: see onnx_pairs.py's docstring), from [G, N, *] inputs (q scaled,
    phi_q weighted, phi_k zero on the sinks and padded keys) and ``ratio_of``, the log ratio of the
    kernel part's unit to the exact part's as a function of the rows' max exact logit. Over at
    most STATE_BLOCKS blocks the far part comes from per-block states instead (_far_block_sums).

    A padded key's logit is the lowest log scale (it never raises a max) and its [v, 1] row is
    zero (it adds nothing), so that no [.., 2W, 2W] mask is built or applied for it."""
    in_pair, across = (
        None if x.all() else torch.from_numpy(x).to(q.device) for x in pair_structure(pairs.window, following)
    )
    v = values_and_ones(v) * keep
    if sinks:
        sink_keys, sink_values, sink_keep = (sink_rows(x, sinks, 1)[:, 0] for x in (k, v, keep))
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
        sink_taken = (sink_keep.transpose(-2, -1) > 0) & paired_sink_mask(pairs, sinks, following, q.device)
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


def _far_block_sums(pairs: BlockPairs, phi_q, phi_k, v, following: bool):
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
    local_softmax_sums, no weight below e^-EXP_FLOOR of the max's: a subnormal exp takes several
    times longer (a masked key's weight is e^-EXP_FLOOR too, and its zero value row takes it out)."""
    exponent = torch.clamp_min(scores - row_max, -EXP_FLOOR)
    weights = torch.exp(exponent if shift is None else exponent - shift)
    return weights if taken is None else torch.where(taken, weights, 0.0)
