"""The causal kernel form in chunks, continued from a state, in both lowerings: the one body of
causal kernel attention. Each call takes N new positions and what the keys before them left
behind (a KernelState; none, or zeros, for a whole sequence: kernel.parallel's causal forms are
this one from the start), and returns the outputs and, when asked, the state after the N keys,
as flash-linear-attention's forms do: (q, k, v, initial_state, output_final_state) -> (out, final
state). A decoder feeds a sequence in pieces (kernel/recurrence.py): the sums are those
over the whole sequence, grouped differently, so the pieces differ from one call by rounding
only. kernel.naive is the N x N reference every form is tested against.

Within a chunk a masked (chunk x chunk) product, across chunks a prefix sum of the chunks'
key-value states (kernel.chunks: bounded in depth, no (chunks x chunks) matrix), so compute
grows as N and memory as O(N*F + N/chunk * F*Dv), not the O(N*F*Dv) of a per-position prefix
sum. In ONNX every tensor is flattened to [G, ...] by the caller: the state to [G, F, Dv], [G, F]
and [G, 1] (its log scale)."""

from __future__ import annotations

import typing

from onnxscript import script

from attnrewrite.passes.kernel.chunks import (
    ChunkLayout,
    chunk_rows_functions,
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
from attnrewrite.passes.layout import flatten_heads, sequence_sum_function
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


def empty_state(phi_k, v, rescaled: bool) -> KernelState:
    """The state before any of the keys phi_k [..., N, F] (values v [..., N, Dv])."""
    lead = phi_k.shape[:-2]
    kv = torch.zeros(*lead, phi_k.shape[-1], v.shape[-1], device=phi_k.device)
    log_scale = torch.full(lead, LOWEST_LOG_SCALE, device=phi_k.device) if rescaled else None
    return KernelState(kv, kv.new_zeros(*lead, phi_k.shape[-1]), log_scale)


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


def chunk_kernel_attention(
    phi_q,
    phi_k,
    v,
    key_log_scale=None,
    initial_state: KernelState | None = None,
    output_final_state: bool = False,
    *,
    chunk: int,
    eps: float = DENOMINATOR_EPS,
):
    """Causal kernel attention of phi_q, phi_k [..., N, F] and v [..., N, Dv] after the keys in
    ``initial_state`` (None: the first positions), in chunks of ``chunk`` positions: (out
    [..., N, Dv], the state after the N keys, or None unless ``output_final_state``).

    ``key_log_scale`` [..., N, 1]: key j has features phi_k[j] * exp(key_log_scale[j]), which may
    lie far outside the float range (FAVOR+ stabilises each key by its own max), so no key is
    ever multiplied by it: query i weighs key j <= i by exp(key_log_scale[j] - r[i]) <= 1, with
    r[i] the running max over keys 0..i and the state's log scale. The dropped factor exp(r[i])
    is one constant for every term of row i's numerator and denominator, so it cancels exactly,
    and r[i] reads no key after i. Masked keys: phi_k rows 0 and key_log_scale LOWEST_LOG_SCALE
    (they must not raise r).

    A sequence longer than PASS_POSITIONS runs as passes of that many positions, each from the
    state the one before left: the chunk sums of one pass stay in the cache, so time grows as N
    where one pass over everything would slow down once its sums outgrow the cache."""
    n, step = phi_q.shape[-2], _pass_length(chunk)
    if _traced() or n <= step:  # a graph being traced keeps one pass: no guard on its length
        return _one_pass(phi_q, phi_k, v, key_log_scale, initial_state, output_final_state, chunk, eps)
    outs, state = [], initial_state
    for start in range(0, n, step):
        rows = slice(start, start + step)
        scales = None if key_log_scale is None else key_log_scale[..., rows, :]
        wanted = output_final_state or start + step < n
        out, state = _one_pass(
            phi_q[..., rows, :], phi_k[..., rows, :], v[..., rows, :], scales, state, wanted, chunk, eps
        )
        outs.append(out)
    return torch.cat(outs, dim=-2), state


# Positions one pass of chunk_kernel_attention takes: at F = Dv = 64 and chunks of 64 its
# per-chunk sums of 4 heads are 2 MB. One pass over 32768 positions took 2.7x as long per
# position as passes of 2048 on a 2-core Xeon (bench/kernel_chunk.py).
PASS_POSITIONS = 2048


def _traced() -> bool:
    """Whether torch is tracing (torch.export, dynamo, torch.jit.trace): there N may be symbolic,
    or an example's length that must not decide the graph's passes."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _pass_length(chunk: int) -> int:
    """PASS_POSITIONS rounded down to whole chunks (at least one), so passes split no chunk."""
    return max(chunk, PASS_POSITIONS // chunk * chunk)


def _one_pass(phi_q, phi_k, v, key_log_scale, initial_state, output_final_state, chunk, eps):
    lead, n, dv = phi_q.shape[:-2], phi_q.shape[-2], v.shape[-1]
    layout = ChunkLayout(n, chunk)
    q4, k4, v4 = layout.blocks(phi_q), layout.blocks(phi_k), layout.blocks(v)
    if key_log_scale is None:
        kv, key_sum, scores, into = _plain_chunks(q4, k4, v4, initial_state)
    else:
        s = layout.blocks(key_log_scale, LOWEST_LOG_SCALE)[..., 0]  # [G, chunks, chunk]
        kv, key_sum, scores, into = _rescaled_chunks(q4, k4, v4, s, layout.groups, initial_state)
    earlier, earlier_sum = q4 @ kv, (q4 * key_sum).sum(-1, keepdim=True)
    if into is not None:
        earlier, earlier_sum = into * earlier, into * earlier_sum
    numerator = earlier + scores @ v4
    denominator = earlier_sum + scores.sum(-1, keepdim=True)
    out = layout.unblock(numerator / (denominator + eps)).reshape(*lead, n, dv)
    if not output_final_state:
        return out, None
    state = empty_state(phi_k, v, key_log_scale is not None) if initial_state is None else initial_state
    return out, absorb_keys(state, phi_k, v, key_log_scale)


def _plain_chunks(q4, k4, v4, state: KernelState | None):
    """Per chunk, the sums of the keys before it (the state's too): kv [G, chunks, F, Dv] and
    key sums [G, chunks, 1, F]; its masked scores; and no rescaling of those sums (None)."""
    k4t = k4.transpose(-2, -1)
    kv, key_sum = exclusive_cumsum(k4t @ v4), exclusive_cumsum(k4.sum(dim=2, keepdim=True))
    if state is not None:
        kv = kv + flatten_heads(state.kv).unsqueeze(1)
        key_sum = key_sum + state.key_sum.reshape(-1, 1, 1, k4.shape[-1])
    return kv, key_sum, torch.tril(q4 @ k4t), None


def _rescaled_chunks(q4, k4, v4, s, groups, state: KernelState | None):
    """_plain_chunks with per-key log scales s [G, chunks, chunk]: the sums relative to each
    chunk's starting reference, and the factors [G, chunks, chunk, 1] (<= 1) that move them to
    each row's r[i]. Across chunks the sums are re-referenced from one chunk's running max to the
    next by rescaled_prefix_sum (no CumSum can rescale), bounded in depth as the running max."""
    seen = running_max(s)  # inside each chunk, a [G, chunks, chunk, chunk] masked max
    upto = chunk_running_max(seen[..., -1], groups)  # through the end of each chunk
    before = shift_right(upto, LOWEST_LOG_SCALE)  # through the end of the chunk before
    if state is not None:
        absorbed = state.log_scale.reshape(-1, 1)  # [G, 1]
        upto, before = torch.maximum(upto, absorbed), torch.maximum(before, absorbed)
    ref = torch.maximum(seen, before.unsqueeze(-1))  # r[i]
    # Inside a chunk: (q_i . k_j) exp(s_j - r_i), j <= i; above the diagonal the clamp only keeps
    # exp finite before tril drops those entries.
    decay = torch.exp(torch.clamp_max(s.unsqueeze(-2) - ref.unsqueeze(-1), 0.0))
    scores = torch.tril((q4 @ k4.transpose(-2, -1)) * decay)
    # Each chunk's keys relative to its own end-of-chunk max, then moved to each later chunk's
    # starting max: exp(upto[c'] - before[c]) <= 1 for c' < c.
    k_rel = k4 * torch.exp(s - upto.unsqueeze(-1)).unsqueeze(-1)
    kv = k_rel.transpose(-2, -1) @ v4  # [G, chunks, F, Dv]
    earlier = rescaled_prefix_sum(kv.flatten(2), upto, before, groups)
    key_sum = rescaled_prefix_sum(k_rel.sum(dim=2), upto, before, groups)  # [G, chunks, F]
    if state is not None:
        held = torch.exp(absorbed - before).unsqueeze(-1)  # the state moved to each chunk's start
        earlier = earlier + held * flatten_heads(state.kv).flatten(1).unsqueeze(1)
        key_sum = key_sum + held * state.key_sum.reshape(-1, 1, k4.shape[-1])
    into = torch.exp(before.unsqueeze(-1) - ref).unsqueeze(-1)  # from before[c] to r[i]
    return earlier.reshape(kv.shape), key_sum.unsqueeze(2), scores, into


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
    """The ONNX chunk form without log scales, after the functions it calls:
    CausalKernelAttentionFromState(phi_q, phi_k, v, kv_state, key_sum) -> (out, kv_state,
    key_sum). The chunks' states are summed by ExclusivePrefixSum (no CumSum along the chunks),
    the keys by SequenceSum (GEMMs); the state after the keys is the chunks' sums added to the
    state (no second pass over the keys), so the whole sequence (CausalKernelAttention) is
    this from a zero state at the cost of two sums over the chunks."""
    op = standard_opset(opset_version)
    sequence_sum = sequence_sum_function(opset_version)
    prefix_sum = exclusive_prefix_sum_function(opset_version)
    chunk_size, chunked_rows, unchunked_rows = chunk_rows_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalKernelAttentionFromState(phi_q, phi_k, v, kv_state, key_sum):
        # phi_q, phi_k [G, N, F], v [G, N, Dv]; the state [G, F, Dv] and [G, F]
        one, rows = op.Constant(value_ints=[1]), op.Constant(value_ints=[0, 0, -1])
        c = chunk_size(v, op.Constant(value_ints=[chunk]))
        zero = op.Constant(value_float=0.0)
        q4 = chunked_rows(phi_q, c, zero)
        k4 = chunked_rows(phi_k, c, zero)
        v4 = chunked_rows(v, c, zero)
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        kv = op.MatMul(k4t, v4)
        earlier = op.Reshape(prefix_sum(op.Reshape(kv, rows)), op.Shape(kv)) + op.Unsqueeze(kv_state, one)
        sums = op.Reshape(sequence_sum(k4), rows)  # [G, chunks, F]
        earlier_sum = prefix_sum(sums) + op.Unsqueeze(key_sum, one)
        scores = op.Trilu(op.MatMul(q4, k4t), upper=0)
        numerator = op.MatMul(q4, earlier) + op.MatMul(scores, v4)
        last_axis = op.Constant(value_ints=[3])
        denominator = op.MatMul(q4, op.Unsqueeze(earlier_sum, last_axis)) + op.ReduceSum(scores, last_axis, keepdims=1)
        out = unchunked_rows(numerator / (denominator + op.Constant(value_float=eps)), v)
        new_kv = kv_state + op.ReduceSum(kv, one, keepdims=0)
        return out, new_kv, key_sum + op.ReduceSum(sums, one, keepdims=0)

    return with_callees(CausalKernelAttentionFromState)


@built_once
def causal_rescaled_chunks_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """The ONNX chunk form with per-key log scales, after the functions it calls:
    CausalRescaledKernelChunks(phi_q, phi_k, key_log_scale, v, kv_state, key_sum, log_scale) ->
    out, as chunk_kernel_attention; every running max starts from the state's log_scale. The
    carry across chunks is RescaledPrefixSum's, bounded in depth. It returns no state: that is a
    second pass over the keys (AbsorbRescaledKeys), which the whole sequence must not pay for
    (onnxruntime computes a function's unused outputs too)."""
    op = standard_opset(opset_version)
    RunningMax, LowerTriangle = running_max_functions(opset_version)
    ChunkRunningMax, RescaledPrefixSum = rescaled_prefix_functions(opset_version)
    chunk_size, chunked_rows, unchunked_rows = chunk_rows_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledKernelChunks(phi_q, phi_k, key_log_scale, v, kv_state, key_sum, log_scale):
        # phi_q, phi_k [G, N, F], key_log_scale [G, N, 1], v [G, N, Dv]; the state [G, F, Dv],
        # [G, F] and [G, 1]
        one, minus_one = op.Constant(value_ints=[1]), op.Constant(value_ints=[-1])
        rows = op.Constant(value_ints=[0, 0, -1])
        c = chunk_size(v, op.Constant(value_ints=[chunk]))
        zero, lowest = op.Constant(value_float=0.0), op.Constant(value_float=LOWEST_LOG_SCALE)
        q4 = chunked_rows(phi_q, c, zero)
        k4 = chunked_rows(phi_k, c, zero)
        v4 = chunked_rows(v, c, zero)
        s = op.Reshape(chunked_rows(key_log_scale, c, lowest), rows)  # [G, chunks, c]
        seen = RunningMax(s, LowerTriangle(c))
        upto = op.Max(ChunkRunningMax(op.Gather(seen, op.Constant(value_int=-1), axis=2)), log_scale)
        shifted = op.Pad(
            op.Slice(upto, op.Constant(value_ints=[0]), minus_one, one), op.Constant(value_ints=[0, 1, 0, 0]), lowest
        )
        before = op.Max(shifted, log_scale)
        ref = op.Max(seen, op.Unsqueeze(before, minus_one))
        decay = op.Exp(op.Min(op.Unsqueeze(s, op.Constant(value_ints=[-2])) - op.Unsqueeze(ref, minus_one), zero))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        scores = op.Trilu(op.MatMul(q4, k4t) * decay, upper=0)
        k_rel = k4 * op.Unsqueeze(op.Exp(s - op.Unsqueeze(upto, minus_one)), minus_one)
        kv = op.MatMul(op.Transpose(k_rel, perm=[0, 1, 3, 2]), v4)
        held = op.Unsqueeze(op.Exp(log_scale - before), minus_one)  # the state at each chunk's start
        flat_kv = RescaledPrefixSum(op.Reshape(kv, rows), upto, before)
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
        return unchunked_rows(numerator / (denominator + op.Constant(value_float=eps)), v)

    return with_callees(CausalRescaledKernelChunks)


@built_once
def causal_rescaled_linear_attention_from_state_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    """ONNX form of chunk_kernel_attention with per-key log scales and a state:
    CausalRescaledKernelAttentionFromState(phi_q, phi_k, key_log_scale, v, kv_state, key_sum,
    log_scale) -> (out, kv_state, key_sum, log_scale), after the functions it calls."""
    op = standard_opset(opset_version)
    rescaled_chunks = causal_rescaled_chunks_functions(opset_version, chunk, eps)[-1]
    absorb = absorb_keys_functions(opset_version)[1]

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledKernelAttentionFromState(phi_q, phi_k, key_log_scale, v, kv_state, key_sum, log_scale):
        out = rescaled_chunks(phi_q, phi_k, key_log_scale, v, kv_state, key_sum, log_scale)
        new_kv, new_sum, new_scale = absorb(phi_k, key_log_scale, v, kv_state, key_sum, log_scale)
        return out, new_kv, new_sum, new_scale

    return with_callees(CausalRescaledKernelAttentionFromState)
