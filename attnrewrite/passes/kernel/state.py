"""The causal kernel forms continued from a state, in both lowerings (the recurrence,
passes/kernel_recurrence.py). A decoder feeds the positions of a sequence in pieces: each call
takes the N new positions and what the earlier ones left behind (KernelState), and returns the
new outputs and the state after them. The sums are the parallel forms' over the whole sequence,
grouped differently: rounding only. In ONNX every tensor is flattened to [G, ...] by the
caller: the state to [G, F, Dv], [G, F] and [G, 1] (its log scale)."""

from __future__ import annotations

import typing

from onnxscript import script

from attnrewrite.passes.kernel.chunks import (
    ChunkLayout,
    exclusive_cumsum,
    exclusive_prefix_sum_function,
    rescaled_prefix_functions,
    running_max,
    running_max_functions,
    shift_right,
)
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, LOWEST_LOG_SCALE
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, standard_opset, with_callees
from attnrewrite.passes.optional_torch import torch


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
    layout = ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    k4t = k4.transpose(-2, -1)
    earlier = exclusive_cumsum(k4t @ v4) + flatten_heads(state.kv).unsqueeze(1)
    key_sum = exclusive_cumsum(k4.sum(dim=2, keepdim=True)) + state.key_sum.reshape(-1, 1, 1, q4.shape[-1])
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
    layout = ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]
    absorbed = state.log_scale.reshape(-1, 1)  # [G, 1]
    seen = running_max(s)
    upto = torch.maximum(running_max(seen[..., -1]), absorbed)
    before = torch.maximum(shift_right(upto, LOWEST_LOG_SCALE), absorbed)
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


@built_once
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


@built_once
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


@built_once
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
