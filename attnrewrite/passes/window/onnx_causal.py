"""The causal ONNX window: the exact part in pairs of blocks (onnx_pairs.py's layout, in a pair's
lower triangle), the far part by chunks of blocks, and the entry functions."""

from __future__ import annotations

import typing

import numpy as np
from onnx import numpy_helper
from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.chunks import exclusive_prefix_sum_function, rescaled_prefix_functions
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE, NO_EXACT_KEY_SHIFT
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, standard_opset
from attnrewrite.passes.window import onnx_blocks
from attnrewrite.passes.window.onnx_blocks import WindowBlockFunctions
from attnrewrite.passes.window.onnx_pairs import (
    PairLayout,
    pair_layout_functions,
    pair_structure,
    paired_logits_function,
)

# --- ONNX: causal windows in pairs of blocks -----------------------------------------------------
# Causal block c takes all of block c-1 and its own block up to the query. In the pairs of the
# bidirectional layout (aligned to the start here), block 2p+1 finds both inside its pair and
# block 2p its own there and block 2p-1 in the one gather: the lower triangle of each pair's
# [2W, 2W] logits and one [W, W] neighbour product per block, no shifted copy. The far part is
# the chunked causal kernel (_chunked_far_sums_functions) on the same rows; both parts share one
# normaliser, the exact part's shift and the kernel part's weight as in the bidirectional window.


class _CausalPairedPieces(typing.NamedTuple):
    """What the causal paired entries call: PairedInputs and RowInputs, CausalPairedWindow(far,
    log_ratio_offset, max_weight, q, k, v, keep) -> [G, rows, Dv + 1], the far sums (plain and
    rescaled), Normalised and PairRows."""

    inputs: OnnxFunction
    row_inputs: OnnxFunction
    window_sums: OnnxFunction
    far_sums: OnnxFunction
    rescaled_far_sums: OnnxFunction
    normalised: OnnxFunction
    pair_rows: OnnxFunction


@built_once
def causal_paired_window_functions(
    opset_version: int,
    blocks: WindowBlockFunctions,
    flatten,
    window: int,
    scale: float,
    sinks: int,
    eps: float,
    far_chunk: int,
) -> _CausalPairedPieces:
    op = standard_opset(opset_version)
    pairs = pair_layout_functions(op, blocks, window, following=False, sinks=sinks, causal=True)
    in_pair, across = (numpy_helper.from_array(x) for x in pair_structure(window, following=False, causal=True))
    ExactLogits = paired_logits_function(op, blocks, pairs, in_pair, across, False, sinks, scale)
    ExactSums = _exact_sums_function(op, blocks, pairs, sinks)
    PairRows, ValuesAndOnes = pairs.PairRows, pairs.ValuesAndOnes
    far_sums, rescaled_far_sums = _chunked_far_sums_functions(
        opset_version, blocks, pairs, flatten, onnx_blocks.without_sinks_function(op, sinks), window, far_chunk
    )
    UnitsOfBoth = onnx_blocks.units_function(op)

    if sinks:

        @script(ATTNREWRITE, default_opset=op)
        def CausalPairedWindowWithSinks(far, log_ratio_offset, max_weight, q, k, v, keep):
            n, zero = op.Shape(v, start=1, end=2), op.Constant(value_float=0.0)
            near, neighbour, sink, row_max = ExactLogits(PairRows(q, zero), PairRows(k, zero), PairRows(keep, zero), n)
            shift, far_weight = UnitsOfBoth(row_max, log_ratio_offset - max_weight * row_max)
            return ExactSums(near, neighbour, sink, shift, ValuesAndOnes(v), n) + far_weight * far

        window_sums = CausalPairedWindowWithSinks
    else:

        @script(ATTNREWRITE, default_opset=op)
        def CausalPairedWindow(far, log_ratio_offset, max_weight, q, k, v, keep):
            """The exact part's sums plus the far sums ``far`` [G, rows, Dv + 1] in one unit."""
            n, zero = op.Shape(v, start=1, end=2), op.Constant(value_float=0.0)
            near, neighbour, row_max = ExactLogits(PairRows(q, zero), PairRows(k, zero), PairRows(keep, zero), n)
            shift, far_weight = UnitsOfBoth(row_max, log_ratio_offset - max_weight * row_max)
            return ExactSums(near, neighbour, shift, ValuesAndOnes(v)) + far_weight * far

        window_sums = CausalPairedWindow
    inputs, row_inputs = onnx_blocks.paired_inputs_functions(op, flatten, sinks)
    normalised = onnx_blocks.normalised_function(op, blocks, eps)
    return _CausalPairedPieces(inputs, row_inputs, window_sums, far_sums, rescaled_far_sums, normalised, pairs.PairRows)


@built_once
def _exact_sums_function(op, blocks: WindowBlockFunctions, pairs: PairLayout, sinks: int):
    """ExactSums(near, neighbour, shift, v_rows) -> [G, rows, Dv + 1]: e^(logits - shift) [v, 1]
    over each row's exact keys (v_rows: ValuesAndOnes); with sinks ExactAndSinkSums(near,
    neighbour, sink, shift, v_rows, n)."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]

    @script(ATTNREWRITE, default_opset=op)
    def ExactSums(near, neighbour, shift, v_rows):
        in_pair = op.MatMul(op.Exp(near - Pairs(shift)), Pairs(v_rows))
        return Rows(in_pair) + Rows(op.MatMul(op.Exp(neighbour - Blocks(shift)), Neighbours(v_rows)))

    if not sinks:
        return ExactSums
    SinkRows = onnx_blocks.sink_rows_function(op, blocks, sinks)

    @script(ATTNREWRITE, default_opset=op)
    def ExactAndSinkSums(near, neighbour, sink, shift, v_rows, n):
        return ExactSums(near, neighbour, shift, v_rows) + op.MatMul(op.Exp(sink - shift), SinkRows(v_rows, n))

    return ExactAndSinkSums


@built_once
def causal_paired_entry(op, flatten, pieces: _CausalPairedPieces, rescaled: bool, max_weighted: bool):
    """WindowedKernelAttention, WindowedRescaledKernelAttention or WindowedMaxWeightedKernelAttention
    (inputs as paired_window_entry's, ``key_log_scale`` one per key [..., N, 1]), causal."""
    inputs, row_inputs, window_sums, far_sums, rescaled_far_sums, normalised, pair_rows = pieces
    per_head = onnx_blocks.per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        pq, pk, q_rows, k_rows, v_rows, keep, log_weight = inputs(phi_q, phi_k, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)  # both parts in one unit already, but for w_h
        far = far_sums(pq, pk, v_rows)
        return normalised(window_sums(far, log_weight, zero, q_rows, k_rows, v_rows, keep), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedRescaledKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
    ):
        """The kernel part in units of e^(a_i + R_c) (R_c: the max key log scale of block c's
        far keys), the exact part's e^(m_i)."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        # phi_k as it is: the sinks' lowest log scale keeps them out (RescaledFarSums)
        far, far_log_scale = rescaled_far_sums(pq, flatten(phi_k), v_rows, key_log_scale)
        offset = pair_rows(flatten(query_log_scale), op.Constant(value_float=0.0)) + far_log_scale + log_weight
        one = op.Constant(value_float=1.0)
        return normalised(window_sums(far, offset, one, q_rows, k_rows, v_rows, keep), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedMaxWeightedKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
    ):
        """As WindowedRescaledKernelAttention with the kernel part moved by e^(-beta_h m_i),
        beta_h = local_max_weight [heads, 1, 1]."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)
        far, far_log_scale = rescaled_far_sums(pq, flatten(phi_k), v_rows, key_log_scale)
        offset = pair_rows(flatten(query_log_scale), zero) + far_log_scale + log_weight
        weight = per_head(local_max_weight, q)
        return normalised(window_sums(far, offset, weight, q_rows, k_rows, v_rows, keep), q, v)

    if not rescaled:
        return WindowedKernelAttention
    return WindowedMaxWeightedKernelAttention if max_weighted else WindowedRescaledKernelAttention


# A causal window's far part by chunks of P blocks, as a chunked causal kernel computes it, from
# the rows themselves (no per-block state, no block copy of phi): query chunk k holds blocks
# kP .. kP + P - 1 of the window's layout, key chunk k the same rows one block earlier (blocks
# kP - 1 .. kP + P - 2). Every key chunk before k is far for all of query chunk k (its last block
# is kP - 2): one exclusive prefix of per-chunk states [G, N / (P W), F, Dv + 1]. Inside key
# chunk k, query block kP + a takes key block kP - 1 + b where b <= a - 1: a block-strictly-lower
# mask on the [P W, P W] kernel scores; for P = 2 (the default's at W = 32) that is one [W, W]
# product, query block 1 with key block 0 (WithinPairSums). No local key enters and leaves again,
# so the far sums are sums of far terms only, rounded as a per-block state's.


@built_once
def _chunked_far_sums_functions(
    opset_version: int,
    blocks: WindowBlockFunctions,
    pairs: PairLayout,
    flatten,
    without_sinks,
    window: int,
    far_chunk: int,
):
    """(FarSums, RescaledFarSums), causal: the kernel's sums [G, rows, Dv + 1] over each query
    block's far keys (blocks <= c-2), by chunks of P ~ far_chunk / W blocks (the comment above),
    from rows [G, N, *] (phi_q, phi_k zero on the sinks, v) to the rows of ``pairs``;
    with per-key log scales in units of R_c, the max of s over block c's far keys (the lowest log
    scale if none), which it returns too, [G, rows, 1]."""
    op = standard_opset(opset_version)
    per_chunk = max(1, round(far_chunk / window))
    QueryChunks, KeyChunks, ValueChunks, BlockChunks, AsPairRows = _far_chunk_layout_functions(
        op, blocks, pairs, window, per_chunk
    )
    WithinChunkSums, EarlierKeys = _within_chunk_functions(op, window, per_chunk)
    ExclusivePrefixSum = exclusive_prefix_sum_function(opset_version)
    ChunkRunningMax, RescaledPrefixSum = rescaled_prefix_functions(opset_version)
    WindowBlocks, ShiftBlocks, BlockValueRows = blocks.WindowBlocks, blocks.ShiftBlocks, pairs.BlockValueRows

    @script(ATTNREWRITE, default_opset=op)
    def PerQueryBlock(x_c, factor):
        """[G, chunks', P W, X] times factor [G, chunks', P], one per query block."""
        rows = op.Reshape(x_c, op.Concat(op.Shape(factor), op.Constant(value_ints=[window, -1]), axis=0))
        return op.Reshape(rows * op.Unsqueeze(factor, op.Constant(value_ints=[3, 4])), op.Shape(x_c))

    @script(ATTNREWRITE, default_opset=op)
    def FarSums(pq, pk, v):
        zero = op.Constant(value_float=0.0)
        q_c, k_c, vo_c = QueryChunks(pq, zero), KeyChunks(pk, zero), ValueChunks(v)
        kv = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), vo_c)  # [G, chunks', F, Dv + 1]
        state = op.Reshape(ExclusivePrefixSum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1]))), op.Shape(kv))
        return AsPairRows(op.MatMul(q_c, state) + WithinChunkSums(q_c, k_c, vo_c, EarlierKeys()), v)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledFarSums(pq, pk, v, key_log_scale):
        """Chunk states relative to their own max U, carried to B_k (the max over the chunks
        before, RescaledPrefixSum's reference) and then to R_c >= B_k; inside a chunk each
        term e^(s_j - R_c) directly: every factor <= 1. The sinks' phi_k need not be zero: their
        lowest log scale weighs them e^(LOWEST_LOG_SCALE - x) = 0 against any x >=
        NO_EXACT_KEY_SHIFT, the least U and R_c taken here."""
        zero, lowest = op.Constant(value_float=0.0), op.Constant(value_float=LOWEST_LOG_SCALE)
        last, two = op.Constant(value_ints=[-1]), op.Constant(value_ints=[2])
        s_rows = without_sinks(flatten(key_log_scale), lowest)
        block_max = op.ReduceMax(op.Squeeze(WindowBlocks(s_rows, lowest), last), last, keepdims=0)
        reach = ShiftBlocks(ChunkRunningMax(block_max), lowest, two)  # R_c [G, chunks]
        least = op.Constant(value_float=NO_EXACT_KEY_SHIFT)
        r_c = BlockChunks(op.Max(reach, least))  # [G, chunks', P]
        s_c = op.Squeeze(KeyChunks(s_rows, lowest), last)  # [G, chunks', P W]
        chunk_max = op.Max(op.ReduceMax(s_c, last, keepdims=0), least)
        before = ShiftBlocks(ChunkRunningMax(chunk_max), lowest, op.Constant(value_ints=[1]))
        q_c, k_c, vo_c = QueryChunks(pq, zero), KeyChunks(pk, zero), ValueChunks(v)
        # the chunk's keys relative to U, the factors on the values side (Dv + 1 columns, not F)
        vo_rel = vo_c * op.Unsqueeze(op.Exp(s_c - op.Unsqueeze(chunk_max, last)), last)
        kv = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), vo_rel)
        flat = RescaledPrefixSum(op.Reshape(kv, op.Constant(value_ints=[0, 0, -1])), chunk_max, before)
        into = op.Exp(op.Min(op.Unsqueeze(before, last) - r_c, zero))  # B_k to R_c, per query block
        carried = PerQueryBlock(op.MatMul(q_c, op.Reshape(flat, op.Shape(kv))), into)
        decay = op.Exp(op.Min(op.Unsqueeze(s_c, two) - op.Unsqueeze(r_c, last), zero))  # [G, chunks', P, P W]
        weight = op.Unsqueeze(decay, op.Constant(value_ints=[3])) * EarlierKeys()
        n = op.Shape(v, start=1, end=2)
        return AsPairRows(carried + WithinChunkSums(q_c, k_c, vo_c, weight), v), BlockValueRows(reach, lowest, n)

    return FarSums, RescaledFarSums


@built_once
def _far_chunk_layout_functions(op, blocks: WindowBlockFunctions, pairs: PairLayout, window: int, per_chunk: int):
    """The layout of _chunked_far_sums_functions for chunks of ``per_chunk`` blocks: QueryChunks,
    KeyChunks and ValueChunks (rows [G, N, F] -> [G, chunks', P W, F], the window's FrontPad in
    front, the keys one block later, [v, 1]), BlockChunks (one value per block [G, chunks] -> [G, chunks', P]) and
    AsPairRows (query chunks [G, chunks', P W, X] -> the rows of ``pairs`` [G, rows, X], the
    same layout for P = 2). chunks' = (chunks + P) // P leaves the keys room to move a block."""
    BlockCount, FrontPad, RowCount = blocks.BlockCount, blocks.FrontPad, pairs.RowCount
    size = per_chunk * window

    @script(ATTNREWRITE, default_opset=op)
    def ChunkRows(n):
        """[1]: the rows of (BlockCount(n) + P) // P chunks."""
        p = op.Constant(value_ints=[per_chunk])
        return op.Div(BlockCount(n) + p, p) * op.Constant(value_ints=[size])

    @script(ATTNREWRITE, default_opset=op)
    def InChunks(x, fill, front, columns):
        """``front`` rows of fill before x [G, N, F], the chunks' rest after it, ``columns``
        more of fill at the end of each row."""
        n = op.Shape(x, start=1, end=2)
        zero = op.Constant(value_ints=[0])
        pads = op.Concat(front, zero, ChunkRows(n) - front - n, columns, axis=0)
        padded = op.Pad(x, pads, fill, op.Constant(value_ints=[1, 2]))
        return op.Reshape(padded, op.Concat(op.Constant(value_ints=[0, -1, size]), op.Shape(padded, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def QueryChunks(x, fill):
        return InChunks(x, fill, FrontPad(op.Shape(x, start=1, end=2)), op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def KeyChunks(x, fill):
        front = FrontPad(op.Shape(x, start=1, end=2)) + op.Constant(value_ints=[window])
        return InChunks(x, fill, front, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def ValueChunks(v):
        """KeyChunks of [v, 1] (the denominator as one more value), ones in the padding rows too:
        a padding key weighs 0 whatever its value (zero phi_k, or the lowest log scale)."""
        front = FrontPad(op.Shape(v, start=1, end=2)) + op.Constant(value_ints=[window])
        return InChunks(v, op.Constant(value_float=1.0), front, op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def BlockChunks(x):
        chunks, p = op.Shape(x, start=1, end=2), op.Constant(value_ints=[per_chunk])
        pads = op.Concat(op.Constant(value_ints=[0]), op.Div(chunks + p, p) * p - chunks, axis=0)
        padded = op.Pad(x, pads, op.Constant(value_float=0.0), op.Constant(value_ints=[1]))
        return op.Reshape(padded, op.Constant(value_ints=[0, -1, per_chunk]))

    @script(ATTNREWRITE, default_opset=op)
    def ChunksAsPairs(sums, v):
        """Query chunks of pairs of blocks are the pairs."""
        return op.Reshape(sums, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(sums, start=3), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def ChunksAsPairRows(sums, v):
        """The chunks' first rows, as many as the pairs have (both hold every block, from the
        same FrontPad), zero after them."""
        count = RowCount(op.Shape(v, start=1, end=2))
        zero = op.Constant(value_ints=[0])
        kept = op.Slice(ChunksAsPairs(sums, v), zero, count, op.Constant(value_ints=[1]))
        missing = count - op.Shape(kept, start=1, end=2)
        return op.Pad(kept, op.Concat(zero, zero, zero, zero, missing, zero, axis=0), op.Constant(value_float=0.0))

    as_pair_rows = ChunksAsPairs if per_chunk == 2 else ChunksAsPairRows
    return QueryChunks, KeyChunks, ValueChunks, BlockChunks, as_pair_rows


@built_once
def _within_chunk_functions(op, window: int, per_chunk: int):
    """(WithinChunkSums, EarlierKeys) of _chunked_far_sums_functions: the weighted kernel scores
    inside a chunk times values (WithinPairSums for P = 2; nothing for P = 1, where every key of
    key chunk k is local to query chunk k), and which key columns a query block takes inside its
    chunk, [P, 1, P W]."""
    size = per_chunk * window
    key_block, query_block = np.arange(size) // window, np.arange(per_chunk)
    earlier = numpy_helper.from_array((key_block[None, :] < query_block[:, None]).astype(np.float32)[:, None, :])

    @script(ATTNREWRITE, default_opset=op)
    def WithinChunkSums(q_c, k_c, vo_c, weight):
        """sum over key j of key chunk k of weight[a, j] phi_q_i.phi_k_j [v_j, 1], a = i's block in
        the chunk; weight [..., P, 1, P W]."""
        scores = op.MatMul(q_c, op.Transpose(k_c, perm=[0, 1, 3, 2]))
        by_block = op.Reshape(scores, op.Constant(value_ints=[0, 0, per_chunk, window, size]))
        return op.MatMul(op.Reshape(by_block * weight, op.Shape(scores)), vo_c)

    @script(ATTNREWRITE, default_opset=op)
    def WithinPairSums(q_c, k_c, vo_c, weight):
        """WithinChunkSums for P = 2: only key block 0 is taken inside the chunk (by query block 1;
        query block 0's weights are 0): [2W, W] products instead of [2W, 2W], and no copy of a
        query block."""
        zero, window_end = op.Constant(value_ints=[0]), op.Constant(value_ints=[window])
        rows, last = op.Constant(value_ints=[2]), op.Constant(value_ints=[-1])
        earlier_k = op.Slice(k_c, zero, window_end, rows)  # [G, chunks', W, F]
        earlier_vo = op.Slice(vo_c, zero, window_end, rows)
        taken = op.Slice(weight, zero, window_end, last)  # [..., 2, 1, W]
        scores = op.MatMul(q_c, op.Transpose(earlier_k, perm=[0, 1, 3, 2]))  # [G, chunks', 2W, W]
        by_block = op.Reshape(scores, op.Constant(value_ints=[0, 0, 2, window, window])) * taken
        return op.MatMul(op.Reshape(by_block, op.Shape(scores)), earlier_vo)

    @script(ATTNREWRITE, default_opset=op)
    def NoKeysWithinChunk(q_c, k_c, vo_c, weight):
        return op.Constant(value_float=0.0)

    @script(ATTNREWRITE, default_opset=op)
    def EarlierKeys():
        return op.Constant(value=earlier)

    within = {1: NoKeysWithinChunk, 2: WithinPairSums}.get(per_chunk, WithinChunkSums)
    return within, EarlierKeys
