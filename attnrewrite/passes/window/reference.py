"""The window hybrid written as its definition, an N x N matrix of weights (same exact keys, same
units): for the fitter's attention-weight losses and as the reference the blocked forms are
tested against; never for inference."""

from __future__ import annotations

from attnrewrite.passes.kernel import delta
from attnrewrite.passes.kernel.chunks import ChunkLayout
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.parallel import kernel_attention_weights
from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.window.settings import UNSCALED, KernelScales, Window


def feature_map_attention_weights(module, phi_q, phi_k, q, k, key_keep=None):
    """The normalised weights [..., Nq, Nk] feature_map_attention gives each key. N x N: for
    the fitter's attention-weight cross-entropy, never for inference."""
    if module.update == delta.DELTA:
        raise ValueError(delta.NO_WEIGHTS)
    if key_keep is not None:
        phi_k = phi_k * key_keep
    if module.window is None:
        return kernel_attention_weights(phi_q, phi_k, module.causal)
    scales = KernelScales(linear_log_weight=module.linear_log_weight)
    return windowed_attention_weights(
        phi_q,
        phi_k,
        q.float(),
        k.float(),
        module.window,
        scale=module.scale,
        causal=module.causal,
        key_keep=key_keep,
        scales=scales,
    )


def windowed_attention_weights(
    phi_q,
    phi_k,
    q,
    k,
    window: Window,
    *,
    scale: float,
    causal: bool,
    key_keep=None,
    scales: KernelScales = UNSCALED,
    eps: float = DENOMINATOR_EPS,
    cached=None,
):
    """The normalised weights [..., Nq, Nk] of windowed_kernel_attention, written as the N x N
    matrix of its definition (same exact keys, same units), in the inputs' dtype: for
    attention-weight losses when fitting, and as the reference the blocked form is tested
    against; never for inference. ``cached`` [..., Nq, Nk]: the keys each query's sparse cache
    holds (sparse_cached_keys), exact too."""
    linear_log_weight, query_log_scale, key_log_scale, local_max_weight = scales
    n = q.shape[-2]
    position = torch.arange(n, device=q.device)
    block = (position + ChunkLayout(n, window.size, aligned_to_start=causal).pad) // window.size
    offset = block.unsqueeze(0) - block.unsqueeze(1)  # key's block - query's block
    following = window.following and not causal
    local = (offset >= -1) & (offset <= int(following))
    exact = local | (position < window.sinks)  # the sinks: for every query
    if cached is not None:
        exact = exact | cached
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


def sparse_windowed_reference(phi_q, phi_k, q, k, v, window: Window, *, scale, key_keep=None, scales=UNSCALED, eps):
    """The causal window with a sparse cache (sparse_cache.py's definition) as N x N weights times
    v: its cache simulated by sparse_cached_keys. For tests, never for inference."""
    keep = torch.ones_like(k[..., :1]) if key_keep is None else key_keep.expand(*k.shape[:-1], 1)
    cached = sparse_cached_keys(phi_k, v, keep, window, scales.key_log_scale, eps)
    weights = windowed_attention_weights(
        phi_q, phi_k, q, k, window, scale=scale, causal=True, key_keep=key_keep, scales=scales, eps=eps, cached=cached
    )
    return weights @ v


def sparse_cached_keys(phi_k, v, keep, window: Window, key_log_scale=None, eps: float = DENOMINATOR_EPS):
    """[..., N, N] bool: the keys each query's sparse cache holds, by a plain sequential
    simulation of sparse_cache.py's definition in float64, one key/value head at a time (its
    window.groups query heads share the cache): block c - 2's kept non-sink keys and the cache
    ranked by their summed recall error against the keys folded so far, the worst
    window.sparse kept (ties: the earlier position)."""
    lead, n, width = phi_k.shape[:-2], phi_k.shape[-2], window.size
    phi, values = phi_k.reshape(-1, n, phi_k.shape[-1]).double(), v.reshape(-1, n, v.shape[-1]).double()
    kept = keep.reshape(-1, n) > 0
    log_scale = torch.zeros_like(phi[..., 0]) if key_log_scale is None else key_log_scale.reshape(-1, n).double()
    cached = torch.zeros(phi.shape[0], n, n, dtype=torch.bool)
    for first in range(0, phi.shape[0], window.groups):
        heads = range(first, first + window.groups)
        cache, folded = [], []
        for block in range(2, -(-n // width)):
            leaving = [
                j for j in range((block - 2) * width, (block - 1) * width) if j >= window.sinks and kept[first, j]
            ]
            candidates = cache + leaving
            errors = [
                sum(_recall_error(phi[h], values[h], log_scale[h], folded, j, eps) for h in heads) for j in candidates
            ]
            ranked = sorted(range(len(candidates)), key=lambda c: (-errors[c], candidates[c]))
            held = {candidates[c] for c in ranked[: window.sparse]}
            cache, folded = [j for j in candidates if j in held], folded + [j for j in candidates if j not in held]
            for h in heads:
                cached[h, block * width : (block + 1) * width, cache] = True
    return cached.reshape(*lead, n, n).to(phi_k.device)


def _recall_error(phi, v, log_scale, folded: list, j: int, eps: float) -> float:
    """|| phi_j^T S / (phi_j^T z + eps) - v_j ||^2, S and z over the keys ``folded`` (each weighed
    by e^(its log scale - their max))."""
    if not folded:
        return float((v[j] ** 2).sum())
    weight = torch.exp(log_scale[folded] - log_scale[folded].max()).unsqueeze(-1)
    state, key_sum = (phi[folded] * weight).T @ v[folded], (phi[folded] * weight).sum(0)
    recalled = phi[j] @ state / (phi[j] @ key_sum + eps)
    return float(((recalled - v[j]) ** 2).sum())
