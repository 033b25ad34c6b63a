"""Kernel attention over a whole sequence: the bidirectional form in both lowerings
(linear_attention), the ONNX causal forms over a whole sequence, plain and with per-key log
scales (FAVOR+'s stabilisers), and the N x N weights kernel attention gives (for fitting losses
only).

A causal form is kernel.state's one chunk form started from no state: in torch
chunk_kernel_attention without an initial state, in ONNX its functions fed a zero state (adding
exact zeros and a max with the lowest log scale leave every output as it was)."""

from __future__ import annotations

from onnxscript import script

from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.state import (
    causal_linear_attention_from_state_functions,
    causal_rescaled_chunks_functions,
)
from attnrewrite.passes.layout import sequence_sum_function
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, rank_constant, standard_opset, with_callees
from attnrewrite.passes.optional_torch import torch


def linear_attention(phi_q, phi_k, v, eps: float = DENOMINATOR_EPS):
    kv = phi_k.transpose(-2, -1) @ v  # [..., F, Dv]: the reassociated product, never N x N
    numerator = phi_q @ kv
    denominator = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
    return numerator / (denominator + eps)


def kernel_attention_weights(phi_q, phi_k, causal: bool, eps: float = DENOMINATOR_EPS):
    """The normalised weights [..., Nq, Nk] kernel attention gives each key (phi_k zero on
    padded keys). N x N: for attention-weight losses when fitting, never for inference."""
    scores = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        scores = torch.tril(scores)
    return scores / (scores.sum(-1, keepdim=True) + eps)


@built_once
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


@built_once
def causal_linear_attention_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """Causal kernel attention over a whole sequence: CausalKernelAttentionFromState from a zero state,
    after the functions it calls."""
    op = standard_opset(opset_version)
    from_state = causal_linear_attention_from_state_functions(opset_version, chunk, eps)[-1]
    no_kv, no_key_sum = rank_constant(0.0, 3), rank_constant(0.0, 2)

    @script(ATTNREWRITE, default_opset=op)
    def CausalKernelAttention(phi_q, phi_k, v):
        # phi_q, phi_k [G, N, F], v [G, N, Dv]; G = batch * heads, flattened by the caller.
        out, _, _ = from_state(phi_q, phi_k, v, op.Constant(value=no_kv), op.Constant(value=no_key_sum))
        return out

    return with_callees(CausalKernelAttention)


@built_once
def causal_rescaled_linear_attention_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """Causal kernel attention with per-key log scales over a whole sequence: CausalRescaledKernelChunks from a zero
    state (log scale the lowest), after the functions it calls."""
    op = standard_opset(opset_version)
    rescaled_chunks = causal_rescaled_chunks_functions(opset_version, chunk, eps)[-1]
    no_kv, no_key_sum, no_scale = rank_constant(0.0, 3), rank_constant(0.0, 2), rank_constant(LOWEST_LOG_SCALE, 2)

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledKernelAttention(phi_q, phi_k, key_log_scale, v):
        # phi_q, phi_k [G, N, F], key_log_scale [G, N, 1], v [G, N, Dv].
        no_kv_state, no_sum = op.Constant(value=no_kv), op.Constant(value=no_key_sum)
        return rescaled_chunks(phi_q, phi_k, key_log_scale, v, no_kv_state, no_sum, op.Constant(value=no_scale))

    return with_callees(CausalRescaledKernelAttention)
