"""Kernel attention over a whole sequence, in both lowerings: bidirectional (linear_attention),
causal (causal_linear_attention) and causal with per-key log scales (FAVOR+'s stabilisers,
causal_rescaled_linear_attention), and the N x N weights they give (for fitting losses only).

The causal form is a chunked prefix sum: within a chunk a masked (chunk x chunk) product, across
chunks an exclusive prefix sum of per-chunk key-value states (chunks.py), so memory stays
O(N*F + N/chunk * F*Dv) instead of the O(N*F*Dv) of a per-position prefix sum."""

from __future__ import annotations

from onnxscript import script

from attnrewrite.passes.kernel.chunks import (
    ChunkLayout,
    chunk_running_max,
    exclusive_cumsum,
    exclusive_prefix_sum_function,
    rescaled_prefix_functions,
    rescaled_prefix_sum,
    running_max,
    running_max_functions,
    shift_right,
)
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, LOWEST_LOG_SCALE
from attnrewrite.passes.layout import sequence_sum_function
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, rank_constant, standard_opset, with_callees
from attnrewrite.passes.optional_torch import torch


def linear_attention(phi_q, phi_k, v, eps: float = DENOMINATOR_EPS):
    kv = phi_k.transpose(-2, -1) @ v  # [..., F, Dv]: the reassociated product, never N x N
    numerator = phi_q @ kv
    denominator = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
    return numerator / (denominator + eps)


def causal_linear_attention(phi_q, phi_k, v, chunk: int, eps: float = DENOMINATOR_EPS):
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    k4t = k4.transpose(-2, -1)
    state = exclusive_cumsum(k4t @ v4)  # keys of earlier chunks only
    key_sum = exclusive_cumsum(k4.sum(dim=2, keepdim=True))
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
    state is re-referenced from one chunk's running max to the next by rescaled_prefix_sum
    (no CumSum can rescale): two levels of factors <= 1, as the ONNX RescaledPrefixSum, so
    compute stays near linear in N and memory that of causal_linear_attention.
    Masked keys: phi_k rows 0 and key_log_scale LOWEST_LOG_SCALE (they must not raise r).
    """
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]  # [G, chunks, chunk]
    seen = running_max(s)  # inside each chunk, a [G, chunks, chunk, chunk] masked max
    upto = chunk_running_max(seen[..., -1], layout.groups)  # through the end of each chunk
    before = shift_right(upto, LOWEST_LOG_SCALE)  # through the end of the chunk before
    ref = torch.maximum(seen, before.unsqueeze(-1))  # r[i]
    # Inside a chunk: (q_i . k_j) exp(s_j - r_i), j <= i; above the diagonal the clamp only keeps
    # exp finite before tril drops those entries.
    decay = torch.exp(torch.clamp_max(s.unsqueeze(-2) - ref.unsqueeze(-1), 0.0))
    scores = torch.tril((q4 @ k4.transpose(-2, -1)) * decay)
    # Each chunk's keys relative to its own end-of-chunk max, then moved to each later chunk's
    # starting max: exp(upto[c'] - before[c]) <= 1 for c' < c.
    k_rel = k4 * torch.exp(s - upto.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4  # [G, chunks, F, Dv]
    state = rescaled_prefix_sum(kv.flatten(2), upto, before, layout.groups).reshape(kv.shape)
    key_sum = rescaled_prefix_sum(k_rel.sum(dim=2), upto, before, layout.groups)  # [G, chunks, F]
    into = torch.exp(before.unsqueeze(-1) - ref).unsqueeze(-1)  # from before[c] to r[i], <= 1
    numerator = into * (q4 @ state) + scores @ v4
    denominator = into * (q4 * key_sum.unsqueeze(2)).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    return layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)


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


@built_once
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
