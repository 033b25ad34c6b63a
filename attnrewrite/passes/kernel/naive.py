"""Kernel attention written the obvious way, the reference the chunk forms are tested against:
N x N masked scores, causal or bidirectional, with per-key log scales or without, in the chunk
forms' signature (kernel.state.chunk_kernel_attention: after an optional initial KernelState,
(out, final state)). Quadratic in N: for tests and fitting losses, never for inference."""

from __future__ import annotations

from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS
from attnrewrite.passes.kernel.state import KernelState, absorb_keys, empty_state
from attnrewrite.passes.optional_torch import torch


def naive_kernel_attention(
    phi_q,
    phi_k,
    v,
    key_log_scale=None,
    initial_state: KernelState | None = None,
    output_final_state: bool = False,
    *,
    causal: bool = True,
    eps: float = DENOMINATOR_EPS,
):
    """out_i = sum_j w_ij (phi_q_i . phi_k_j) v_j / (sum_j w_ij (phi_q_i . phi_k_j) + eps) over
    the keys j row i sees (j <= i when causal, and the state's keys, causal only), w_ij =
    exp(s_j - r_i) with s = ``key_log_scale`` [..., N, 1] and r_i the max of the log scales row
    i sees, the state's included; w = 1 without log scales."""
    scores = phi_q @ phi_k.transpose(-2, -1)  # [..., N, N]
    n = scores.shape[-1]
    seen = torch.ones(n, n, dtype=torch.bool, device=scores.device)
    seen = seen.tril() if causal else seen
    held = 1.0  # the state's keys' weight
    if key_log_scale is not None:
        s = key_log_scale.transpose(-2, -1)  # [..., 1, N]
        # every row sees a key (its own): -inf is never the max, and stays below a padded key's
        # LOWEST_LOG_SCALE in float64 too, which the float32 constant is not
        ref = torch.where(seen, s, -torch.inf).amax(-1, keepdim=True)  # [..., N, 1]
        if initial_state is not None:
            ref = torch.maximum(ref, initial_state.log_scale[..., None, None])
            held = torch.exp(initial_state.log_scale[..., None, None] - ref)
        scores = scores * torch.exp(torch.clamp_max(s - ref, 0.0))
    scores = torch.where(seen, scores, 0.0)
    numerator, denominator = scores @ v, scores.sum(-1, keepdim=True)
    if initial_state is not None:
        numerator = numerator + held * (phi_q @ initial_state.kv)
        denominator = denominator + held * (phi_q @ initial_state.key_sum.unsqueeze(-1))
    out = numerator / (denominator + eps)
    if not output_final_state:
        return out, None
    state = empty_state(phi_k, v, key_log_scale is not None) if initial_state is None else initial_state
    return out, absorb_keys(state, phi_k, v, key_log_scale)
