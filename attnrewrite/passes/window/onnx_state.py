"""The causal window hybrid continued from a state, in ONNX (passes/kernel/recurrence.py):
RecurrentWindowedKernelAttention, whose inputs depend on the window and unit (so it is written
node by node, FunctionNodes), and the functions it calls."""

from __future__ import annotations

import typing

import onnx
from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.chunks import exclusive_prefix_sum_function, rescaled_prefix_functions
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    BOOL,
    FLOAT,
    TO_THE_END,
    FunctionNodes,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.window.onnx_blocks import WindowBlockFunctions, window_block_functions
from attnrewrite.passes.window.settings import KernelUnit, Window


def windowed_kernel_attention_from_state_functions(
    opset_version: int, window: Window, scale: float, unit: KernelUnit
) -> list[onnx.FunctionProto]:
    """ONNX form of windowed_kernel_attention_from_state: the functions it calls, then the entry
    RecurrentWindowedKernelAttention, whose inputs are windowed_from_state_inputs(window, unit),
    all flattened to [G, ...] (phi_q already weighted by linear_log_weight; start int64 [1]); it
    returns out [G, N', Dv] float32."""
    sinks, rescaled, max_weighted = window.sinks, unit.rescaled, unit.max_weighted
    pieces = _recurrent_window_functions(opset_version, window.size, scale, sinks, rescaled, unit.eps)
    inputs = windowed_from_state_inputs(window, unit)
    body = FunctionNodes()
    n_keys, n = body("Shape", "k", start=1, end=2), body("Shape", "q", start=1, end=2)
    front, chunks, first = body.call(pieces.layout, "start", n_keys, n, outputs=3)
    sinks_in = ["start", "sink_keys", "sink_values", "sink_keep"] if sinks else []
    k_x, v_x, allowed = body.call(pieces.exact_keys, "k", "v", "keep", front, chunks, first, *sinks_in, outputs=3)

    def query_blocks(x):
        return body.call(pieces.query_blocks, x, front, chunks, first, n_keys)

    kept = body("Cast", allowed, to=FLOAT)
    local = body.call(pieces.local_sums, query_blocks("q"), k_x, v_x, kept, outputs=3)
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


def windowed_from_state_inputs(window: Window, unit: KernelUnit) -> list[str]:
    """The inputs of RecurrentWindowedKernelAttention for this window and unit, in order."""
    inputs = ["phi_q", "q", "far_phi_k", "k", "v", "keep", "start", "kernel_state", "normaliser"]
    if unit.rescaled:
        inputs += ["log_scale", "query_log_scale", "far_key_log_scale"]
    if unit.max_weighted:
        inputs.append("row_weight")
    if window.sinks:
        inputs += ["sink_keys", "sink_values", "sink_keep"]
    return inputs


class WindowStepFunctions(typing.NamedTuple):
    """A decoding step of the window hybrid, for one query block of one query:
    ExactSoftmaxSums(q4, k_x, v_x, kept) over the window's 2W rows, or with sinks
    ExactAndSinkSoftmaxSums(q4, k_x, v_x, sink_k, sink_v, kept) (kept [..., 1, 2W + sinks], the
    sinks last); and WindowMix or RescaledWindowMix (their inputs as in
    RecurrentWindowedKernelAttention)."""

    local_sums: OnnxFunction
    mix: OnnxFunction


@built_once
def window_step_functions(opset_version: int, window: Window, scale: float, unit: KernelUnit) -> WindowStepFunctions:
    op = standard_opset(opset_version)
    return WindowStepFunctions(
        # the step's exact keys: the sparse cache's pairs (if any), the window's 2W rows, then the sinks
        exact_softmax_sums_function(
            op, scale, (window.sparse + 2 * window.size, window.sinks) if window.sinks else None
        ),
        window_mix_function(op, unit.rescaled, unit.eps),
    )


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
    blocks = window_block_functions(op, window, aligned_to_start=True)  # its block moves only
    layout, positioned_blocks, query_blocks, unblock = positioned_layout_functions(op, window)
    exact_keys = recurrent_exact_keys_function(op, blocks, positioned_blocks, window, sinks)
    if rescaled:
        far_states = _recurrent_rescaled_far_states_function(opset_version, blocks, positioned_blocks)
    else:
        far_states = _recurrent_far_states_function(opset_version, positioned_blocks)
    kernel_sums = _kernel_sums_function(op)
    mix = window_mix_function(op, rescaled, eps)
    local_sums = exact_softmax_sums_function(op, scale)
    return _RecurrentWindowPieces(layout, query_blocks, exact_keys, local_sums, far_states, kernel_sums, mix, unblock)


@built_once
def positioned_layout_functions(op, window: int):
    """(PositionedLayout, PositionedBlocks, QueryBlocks, UnblockQueries): PositionedLayout's
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


@built_once
def recurrent_exact_keys_function(op, blocks: WindowBlockFunctions, positioned_blocks, window: int, sinks: int):
    """RecurrentLocalKeys(k, v, keep, front, chunks, first), or with sinks
    RecurrentLocalAndSinkKeys(..., start, sink_keys, sink_values, sink_keep): the exact keys of
    each query block from ``first`` (torch_state.positioned_exact_keys), their values and which each query takes."""
    kept_local_keys, with_previous_block, causal_kept_local_keys = _local_key_pieces(op, blocks, window)

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


@built_once
def _local_key_pieces(op, blocks: WindowBlockFunctions, window: int):
    """(KeptLocalKeys, WithPreviousBlock, CausalKeptLocalKeys) of the recurrent window: which
    keys are kept, a causal block's local blocks of [G, chunks, window, F] and which of them a
    query takes, from their keep flags."""
    ShiftBlocks = blocks.ShiftBlocks

    @script(ATTNREWRITE, default_opset=op)
    def WithPreviousBlock(x4):
        """[G, chunks, window, F] -> [G, chunks, 2 * window, F]: block c-1's rows, then c's."""
        previous = ShiftBlocks(x4, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Concat(previous, x4, axis=2)

    @script(ATTNREWRITE, default_opset=op)
    def KeptLocalKeys(keep_local):
        return op.Greater(op.Transpose(keep_local, perm=[0, 1, 3, 2]), op.Constant(value_float=0.0))

    @script(ATTNREWRITE, default_opset=op)
    def CausalKeptLocalKeys(keep_local):
        # all of the previous block, the own block up to the query itself
        ones = op.Expand(op.Constant(value_float=1.0), op.Constant(value_ints=[window, 2 * window]))
        visible = op.Cast(op.Trilu(ones, op.Constant(value_int=window), upper=0), to=BOOL)
        return op.And(KeptLocalKeys(keep_local), visible)

    return KeptLocalKeys, WithPreviousBlock, CausalKeptLocalKeys


@built_once
def exact_softmax_sums_function(op, scale: float, sink_split: tuple[int, int] | None = None):
    """ExactSoftmaxSums(q4, k_x, v_x, kept): numerator, denominator and row max m_i of the
    softmax over each query block's exact keys, ``kept`` [..., rows, keys] float (1 where the
    query takes the key: it weights the exponentials as it is). With ``sink_split`` (the window's
    rows, the sinks) a step's ExactAndSinkSoftmaxSums(q4, k_x, v_x, sink_k, sink_v, kept): the
    sinks a second set of keys whose logits alone are joined to the window's, where joining their
    keys and values would copy the window's each step."""

    @script(ATTNREWRITE, default_opset=op)
    def SoftmaxSumsOf(logits, kept):
        """(exp(logits - row max) where kept, their sum, the row max) of scaled logits."""
        scores = op.Where(
            op.Greater(kept, op.Constant(value_float=0.0)), logits, op.Constant(value_float=LOWEST_LOG_SCALE)
        )
        last = op.Constant(value_ints=[-1])
        row_max = op.ReduceMax(scores, last, keepdims=1)
        weights = op.Exp(scores - row_max) * kept
        return weights, op.ReduceSum(weights, last, keepdims=1), row_max

    @script(ATTNREWRITE, default_opset=op)
    def ExactSoftmaxSums(q4, k_x, v_x, kept):
        logits = op.MatMul(q4, op.Transpose(k_x, perm=[0, 1, 3, 2])) * op.Constant(value_float=scale)
        weights, denominator, row_max = SoftmaxSumsOf(logits, kept)
        return op.MatMul(weights, v_x), denominator, row_max

    if sink_split is None:
        return ExactSoftmaxSums
    split = list(sink_split)

    @script(ATTNREWRITE, default_opset=op)
    def ExactAndSinkSoftmaxSums(q4, k_x, v_x, sink_k, sink_v, kept):
        local_logits = op.MatMul(q4, op.Transpose(k_x, perm=[0, 1, 3, 2]))
        sink_logits = op.MatMul(q4, op.Transpose(sink_k, perm=[0, 1, 3, 2]))
        logits = op.Concat(local_logits, sink_logits, axis=-1) * op.Constant(value_float=scale)
        weights, denominator, row_max = SoftmaxSumsOf(logits, kept)
        local_weights, sink_weights = op.Split(weights, op.Constant(value_ints=split), axis=-1)
        return op.MatMul(local_weights, v_x) + op.MatMul(sink_weights, sink_v), denominator, row_max

    return ExactAndSinkSoftmaxSums


@built_once
def _kernel_sums_function(op):
    """KernelSums(pq4, far_kv, far_key_sum): a query block's kernel numerator and denominator
    from the state and key sum of its far keys (the recurrent window's)."""

    @script(ATTNREWRITE, default_opset=op)
    def KernelSums(pq4, far_kv, far_key_sum):
        numerator = op.MatMul(pq4, far_kv)
        weighted = pq4 * op.Unsqueeze(far_key_sum, op.Constant(value_ints=[2]))
        return numerator, op.ReduceSum(weighted, op.Constant(value_ints=[-1]), keepdims=1)

    return KernelSums


@built_once
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


@built_once
def _recurrent_rescaled_far_states_function(opset_version: int, blocks: WindowBlockFunctions, positioned_blocks):
    """RecurrentRescaledFarStates: _rescaled_earlier_states_after, one state per block carried
    by RescaledSumBeforePrevious (a decoder's prefill; its steps have one block)."""
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


@built_once
def window_mix_function(op, rescaled: bool, eps: float):
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


@built_once
def without_sinks_from_function(opset_version: int, sinks: int):
    """WithoutSinksFrom(x, fill, start): x [..., N, F] with the rows of positions 0..sinks-1 set
    to fill, row 0 being position ``start`` ([1]), as without_sinks."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def WithoutSinksFrom(x, fill, start):
        n = op.Squeeze(op.Shape(x, start=-2, end=-1))
        position = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1)) + start
        sink = op.Unsqueeze(op.Less(position, op.Constant(value_int=sinks)), op.Constant(value_ints=[1]))
        return op.Where(sink, fill, x)

    return WithoutSinksFrom


@built_once
def sinks_after_function(opset_version: int):
    """SinksAfter(sink_x, x, position): the sinks [..., sinks, F] with those among the new rows
    x [..., N, F] (positions position .. position + N - 1, position [1]) filled in."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def SinksAfter(sink_x, x, position):
        zero = op.Constant(value_int=0)
        sinks = op.Squeeze(op.Shape(sink_x, start=-2, end=-1))
        n = op.Shape(x, start=-2, end=-1)
        row = op.Range(zero, sinks, op.Constant(value_int=1)) - position  # sink s is new row s - position
        new = op.And(op.GreaterOrEqual(row, zero), op.Less(row, n))
        picked = op.Gather(x, op.Max(op.Min(row, n - op.Constant(value_ints=[1])), zero), axis=-2)
        return op.Where(op.Unsqueeze(new, op.Constant(value_ints=[1])), op.CastLike(picked, sink_x), sink_x)

    return SinksAfter
