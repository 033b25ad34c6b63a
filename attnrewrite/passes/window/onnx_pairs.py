"""The bidirectional ONNX window in pairs of blocks: the pairs' layout and row masks, the exact
logits, the sums with the local kernel terms folded in, and the entry functions.

Block c's local keys are blocks c-1, c and c+1: rows that overlap from one block to the next,
which onnxruntime lays out only by copying them (three shifted copies of k, v, phi_k and the keep
flags cost more than the exact part's products). In pairs of blocks (0, 1), (2, 3), ... (a
reshape of the rows), a query block meets its own block and one neighbour inside its
pair; the other neighbour (block 2p-1 for block 2p, 2p+2 for 2p+1) comes from one gather of
whole blocks per tensor: [W, 2W] and [W, W] products per block, none wasted, and every per-row
value in one layout.

The far part folds into the same products: with the exact part scaled by e^-max(t, 0) (folded into
its exponent's shift) and the kernel part by b_i = e^min(t, 0) (t the log ratio of the two parts'
units), row i's sums are
    sum_local (e^(s_ij - shift_i) - b_i phi_q_i.phi_k_j) [v_j, 1] + sum_sinks e^(s_ij - shift_i) [v_j, 1]
    + b_i phi_q_i.[S, z]
([v, 1]: the denominator as one more column of values; [S, z] = sum_j phi_k_j [v_j, 1]^T over the
whole sequence), so the local keys take one weight block and one product with values.
"""

from __future__ import annotations

import typing

from onnx import numpy_helper
from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.numerics import MASKED_LOGIT_BIAS
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, built_once, rank_constant
from attnrewrite.passes.window.blocks import pair_structure
from attnrewrite.passes.window.onnx_blocks import (
    WindowBlockFunctions,
    normalised_function,
    paired_inputs_functions,
    per_head_function,
    sink_rows_function,
    units_function,
)


class PairLayout(typing.NamedTuple):
    """[G, N, F] -> the rows of the pairs [G, pairs * 2W, F] (PairRows, ValuesAndOnes), seen as
    [G, pairs, 2W, F] (Pairs), [G, pairs, 2, W, F] (Blocks) or the neighbours outside each pair
    (Neighbours), back to rows (Rows), and the rows' masks."""

    PairRows: OnnxFunction
    ValuesAndOnes: OnnxFunction
    Pairs: OnnxFunction
    Blocks: OnnxFunction
    Neighbours: OnnxFunction
    Rows: OnnxFunction
    HasFarKeys: OnnxFunction
    SinkTaken: OnnxFunction
    RowCount: OnnxFunction
    BlockValueRows: OnnxFunction


@built_once
def pair_layout_functions(
    op, blocks: WindowBlockFunctions, window: int, following: bool, sinks: int, causal: bool = False
) -> PairLayout:
    BlockCount, FrontPad = blocks.BlockCount, blocks.FrontPad
    pair = 2 * window
    # the neighbours outside a pair that anyone takes: block 2p-1, and 2p+2 only ``following``
    neighbour_offsets = [-1, 2] if following else [-1]

    @script(ATTNREWRITE, default_opset=op)
    def PairCount(n):
        """[1]: BlockCount // 2 + 1 pairs of blocks: the last block is padding."""
        return op.Div(BlockCount(n), op.Constant(value_ints=[2])) + op.Constant(value_ints=[1])

    @script(ATTNREWRITE, default_opset=op)
    def RowCount(n):
        """[1]: the rows of the pairs."""
        return PairCount(n) * op.Constant(value_ints=[pair])

    @script(ATTNREWRITE, default_opset=op)
    def RowPads(n, column):
        """Pad's pads for [G, N, F] -> [G, PairCount * 2W, F + column]: FrontPad rows in front."""
        front, zero = FrontPad(n), op.Constant(value_ints=[0])
        return op.Concat(zero, front, zero, zero, RowCount(n) - front - n, column, axis=0)

    @script(ATTNREWRITE, default_opset=op)
    def BlockValueRows(x, fill, n):
        """[G, chunks] of the window's blocks -> [G, rows, 1]: each block's value on its rows,
        fill on the blocks after them."""
        count = op.Div(RowCount(n), op.Constant(value_ints=[window]))
        pads = op.Concat(op.Constant(value_ints=[0, 0, 0]), count - op.Shape(x, start=1, end=2), axis=0)
        per_block = op.Unsqueeze(op.Pad(x, pads, fill), op.Constant(value_ints=[2]))
        rows = op.Expand(per_block, op.Concat(op.Shape(x, end=1), count, op.Constant(value_ints=[window]), axis=0))
        return op.Reshape(rows, op.Constant(value_ints=[0, -1, 1]))

    @script(ATTNREWRITE, default_opset=op)
    def PairRows(x, fill):
        """[G, N, F] -> [G, pairs * 2W, F], the window layout's rows, fill around them."""
        return op.Pad(x, RowPads(op.Shape(x, start=1, end=2), op.Constant(value_ints=[0])), fill)

    @script(ATTNREWRITE, default_opset=op)
    def ValuesAndOnes(v):
        """PairRows of [v, 1] (the denominator as one more value), ones in the padding rows
        too: a padding key weighs 0 in both parts whatever its value (phi_k is 0 there)."""
        pads = RowPads(op.Shape(v, start=1, end=2), op.Constant(value_ints=[1]))
        return op.Pad(v, pads, op.Constant(value_float=1.0))

    @script(ATTNREWRITE, default_opset=op)
    def Pairs(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2W, F]."""
        return op.Reshape(rows, op.Concat(op.Constant(value_ints=[0, -1, pair]), op.Shape(rows, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def Blocks(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2, W, F]: each pair's two blocks."""
        return op.Reshape(rows, op.Concat(op.Constant(value_ints=[0, -1, 2, window]), op.Shape(rows, start=2), axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def Neighbours(rows):
        """[G, pairs * 2W, F] -> [G, pairs, 2 or 1, W, F]: for pair p, blocks 2p-1 and 2p+2, or
        2p-1 alone (the last block, and the first, where those are outside the rows: both are
        padding)."""
        block_rows = op.Reshape(
            rows, op.Concat(op.Constant(value_ints=[0, -1, window]), op.Shape(rows, start=2), axis=0)
        )
        count = op.Shape(block_rows, start=1, end=2)
        first = op.Unsqueeze(
            op.Range(op.Constant(value_int=0), op.Squeeze(count), op.Constant(value_int=2)), op.Constant(value_ints=[1])
        )
        index = op.Mod(first + op.Constant(value_ints=neighbour_offsets), count)  # [pairs, 2 or 1]
        return op.Gather(block_rows, index, axis=1)

    @script(ATTNREWRITE, default_opset=op)
    def Rows(pairs):
        """[G, pairs, 2W, F] or [G, pairs, 2, W, F] -> [G, pairs * 2W, F]."""
        return op.Reshape(pairs, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(pairs, start=-1), axis=0))

    HasFarKeys, SinkTaken = _pair_row_mask_functions(op, blocks, PairCount, window, following, sinks, causal)
    return PairLayout(
        PairRows, ValuesAndOnes, Pairs, Blocks, Neighbours, Rows, HasFarKeys, SinkTaken, RowCount, BlockValueRows
    )


@built_once
def _pair_row_mask_functions(
    op, blocks: WindowBlockFunctions, PairCount, window: int, following: bool, sinks: int, causal: bool
):
    """(HasFarKeys, SinkTaken) of PairLayout: per row of the pairs, whether its block has far
    keys, and which sinks it takes as extra exact keys (``causal``: only those before its
    previous block, never one after the query)."""
    BlockCount, FrontPad = blocks.BlockCount, blocks.FrontPad
    pair = 2 * window
    far_gap = 2 if following else 1  # the first later block the kernel covers, from block c
    sink_positions = list(range(max(sinks, 1)))

    @script(ATTNREWRITE, default_opset=op)
    def RowBlocks(n):
        """[rows, 1]: the window block of each row."""
        rows = op.Squeeze(PairCount(n) * op.Constant(value_ints=[pair]))
        position = op.Range(op.Constant(value_int=0), rows, op.Constant(value_int=1))
        return op.Unsqueeze(op.Div(position, op.Constant(value_int=window)), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def HasFarKeys(n):
        """[rows, 1]: whether a row's block has far blocks with keys (block 0 is padding)."""
        block = RowBlocks(n)
        earlier = op.GreaterOrEqual(block, op.Constant(value_int=3))
        return op.Or(earlier, op.Less(block + op.Constant(value_int=far_gap), BlockCount(n)))

    @script(ATTNREWRITE, default_opset=op)
    def SinkOffsets(n):
        """[rows, sinks]: sink s's block less each row's (sink s at s + FrontPad)."""
        at = op.Div(op.Constant(value_ints=sink_positions) + FrontPad(n), op.Constant(value_ints=[window]))
        return at - RowBlocks(n)

    @script(ATTNREWRITE, default_opset=op)
    def SinkTaken(n):
        """[rows, sinks]: whether a row takes sink s as an extra exact key, s lying outside its
        block's local keys (window.blocks.paired_sink_mask)."""
        offset = SinkOffsets(n)
        outside_before, outside_after = (
            op.Less(offset, op.Constant(value_int=-1)),
            op.Greater(offset, op.Constant(value_int=int(following))),
        )
        return op.Or(outside_before, outside_after)

    @script(ATTNREWRITE, default_opset=op)
    def CausalSinkTaken(n):
        """SinkTaken of a causal row: only sinks before its previous block, all earlier than it."""
        return op.Less(SinkOffsets(n), op.Constant(value_int=-1))

    return HasFarKeys, CausalSinkTaken if causal else SinkTaken


@built_once
def _pair_structure_functions(op, every_key: bool):
    """(Taken(logits, structure), LocalTerms(kernel, structure)): the logits (MASKED_LOGIT_BIAS
    added elsewhere) and kernel terms (0 elsewhere) where ``structure`` takes the key, or with
    ``every_key`` (window_next: all of a pair's keys are local, both structures all true) the
    tensors as they are, not full-size masks of ones."""

    @script(ATTNREWRITE, default_opset=op)
    def StructureTaken(logits, structure):
        # an added bias and a product (each folded once from the constant structure):
        # onnxruntime broadcasts them over [.., 2W, 2W] several times faster than Where
        zero, masked = op.Constant(value_float=0.0), op.Constant(value_float=MASKED_LOGIT_BIAS)
        return logits + op.Where(structure, zero, masked)

    @script(ATTNREWRITE, default_opset=op)
    def StructureTerms(kernel, structure):
        return kernel * op.Cast(structure, to=FLOAT)

    @script(ATTNREWRITE, default_opset=op)
    def AllTaken(logits, structure):
        return op.Identity(logits)

    @script(ATTNREWRITE, default_opset=op)
    def AllTerms(kernel, structure):
        return op.Identity(kernel)

    return (AllTaken, AllTerms) if every_key else (StructureTaken, StructureTerms)


class _PairedParts(typing.NamedTuple):
    """ExactLogits(q, k, keep) -> (logits in pairs and of the neighbours, row max [G, rows, 1])
    and WeightedSums(logits..., shift, far_weight, phi_q, phi_k, v) -> [G, rows, Dv + 1] (module
    module docstring): with sinks, one more logits tensor [G, rows, sinks] after the neighbours'."""

    ExactLogits: OnnxFunction
    WeightedSums: OnnxFunction


@built_once
def _paired_parts_functions(
    op, blocks: WindowBlockFunctions, pairs: PairLayout, window: int, scale: float, following: bool, sinks: int
) -> _PairedParts:
    """The bidirectional window's exact logits and its sums with the local kernel terms folded in."""
    in_pair, across = (numpy_helper.from_array(x) for x in pair_structure(window, following))
    every_key = following  # window_next: all of a pair's keys are local, both structures all true
    logits = paired_logits_function(op, blocks, pairs, in_pair, across, every_key, sinks, scale)
    sums = _folded_sums_function(op, pairs, in_pair, across, every_key)
    if not sinks:
        return _PairedParts(logits, sums)
    SinkRows, SinkTaken = sink_rows_function(op, blocks, sinks), pairs.SinkTaken

    @script(ATTNREWRITE, default_opset=op)
    def PairedAndSinkSums(near, neighbour, sink, shift, far_weight, pq, pk, v_rows, n):
        """PairedSums with the sinks' terms. The state holds every key's kernel term, the sinks'
        too (zeroing their features would cost a pass over phi_k): a row that takes a sink as an
        exact key has the sink's kernel term taken out here, as PairSums does for local keys."""
        kernel = op.MatMul(pq, op.Transpose(SinkRows(pk, n), perm=[0, 2, 1]))  # [G, rows, sinks]
        weights = op.Exp(sink - shift) - far_weight * kernel * op.Cast(SinkTaken(n), to=FLOAT)
        paired = sums(near, neighbour, shift, far_weight, pq, pk, v_rows)
        return paired + op.MatMul(weights, SinkRows(v_rows, n))

    return _PairedParts(logits, PairedAndSinkSums)


def paired_logits_function(
    op, blocks: WindowBlockFunctions, pairs: PairLayout, in_pair, across, every_key: bool, sinks: int, scale: float
):
    """PairedLogits(q, k, keep, n) -> (near [G, pairs, 2W, 2W], neighbour [G, pairs, 2, W, W],
    row max [G, rows, 1]): the rows of q against the local keys, times ``scale`` (which
    onnxruntime folds into the products, no pass over q), where the structures
    ``in_pair`` and ``across`` take them and they are kept (keep > 0; 0 on the padding rows),
    MASKED_LOGIT_BIAS added elsewhere; with sinks PairedAndSinkLogits, the sinks' logits
    [G, rows, sinks] before the row max. n: [1], the positions (read by the sinks' form only,
    taken by both so that their callers are one)."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]
    Taken = _pair_structure_functions(op, every_key)[0]

    # A key that is not kept (padding, or the rows around N) adds MASKED_LOGIT_BIAS to its
    # logits, one bias per key: no [.., 2W, 2W] mask is built for it.

    one, lowest, zero = (rank_constant(x, 3) for x in (1.0, MASKED_LOGIT_BIAS, 0.0))  # rank_constant says why

    @script(ATTNREWRITE, default_opset=op)
    def NotTakenBias(taken):
        """[G, rows, *]: 0 where ``taken``, MASKED_LOGIT_BIAS elsewhere."""
        return (op.Constant(value=one) - op.Cast(taken, to=FLOAT)) * op.Constant(value=lowest)

    @script(ATTNREWRITE, default_opset=op)
    def PairLogits(q_rows, k_rows, bias_rows):
        """Each pair's queries against its keys [G, pairs, 2W, 2W], and their row max [G, rows, 1]."""
        keys = op.Transpose(Pairs(k_rows), perm=[0, 1, 3, 2])
        logits = op.MatMul(Pairs(q_rows), keys) * op.Constant(value_float=scale)
        bias = op.Transpose(Pairs(bias_rows), perm=[0, 1, 3, 2])
        masked = Taken(logits + bias, op.Constant(value=in_pair))
        return masked, Rows(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1))

    @script(ATTNREWRITE, default_opset=op)
    def NeighbourLogits(q_rows, k_rows, bias_rows):
        """Each block against its neighbour outside the pair [G, pairs, 2, W, W], as PairLogits."""
        keys = op.Transpose(Neighbours(k_rows), perm=[0, 1, 2, 4, 3])
        logits = op.MatMul(Blocks(q_rows), keys) * op.Constant(value_float=scale)
        bias = op.Transpose(Neighbours(bias_rows), perm=[0, 1, 2, 4, 3])
        masked = Taken(logits + bias, op.Constant(value=across))
        return masked, Rows(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1))

    @script(ATTNREWRITE, default_opset=op)
    def PairedLogits(q, k, keep, n):
        bias = NotTakenBias(op.Greater(keep, op.Constant(value=zero)))
        near, near_max = PairLogits(q, k, bias)
        neighbour, neighbour_max = NeighbourLogits(q, k, bias)
        return near, neighbour, op.Max(near_max, neighbour_max)

    if not sinks:
        return PairedLogits
    SinkRows, SinkTaken = sink_rows_function(op, blocks, sinks), pairs.SinkTaken

    @script(ATTNREWRITE, default_opset=op)
    def PairedAndSinkLogits(q, k, keep, n):
        near, neighbour, local_max = PairedLogits(q, k, keep, n)
        logits = op.MatMul(q, op.Transpose(SinkRows(k, n), perm=[0, 2, 1])) * op.Constant(value_float=scale)
        kept = op.Transpose(op.Greater(SinkRows(keep, n), op.Constant(value_float=0.0)), perm=[0, 2, 1])
        sink = logits + NotTakenBias(op.And(kept, SinkTaken(n)))
        return near, neighbour, sink, op.Max(local_max, op.ReduceMax(sink, op.Constant(value_ints=[-1]), keepdims=1))

    return PairedAndSinkLogits


def _folded_sums_function(op, pairs: PairLayout, in_pair, across, every_key: bool):
    """PairedSums(near, neighbour, shift, far_weight, pq, pk, v_rows) -> [G, rows, Dv + 1]: the
    bidirectional window's local sums with the local kernel terms taken out, and the far part
    (the module docstring), from rows; v_rows: KeptValueRows."""
    Pairs, Blocks, Neighbours, Rows = pairs[2:6]
    LocalTerms = _pair_structure_functions(op, every_key)[1]

    @script(ATTNREWRITE, default_opset=op)
    def PairSums(logits, shift, far_weight, pq_rows, pk_rows, v_rows):
        """[G, rows, Dv + 1]: (e^(logits - shift) - far_weight phi_q.phi_k) [v, 1] over each
        pair's local keys; shift, far_weight: [G, rows, 1]."""
        exact = op.Exp(logits - Pairs(shift))
        kernel = op.MatMul(Pairs(pq_rows), op.Transpose(Pairs(pk_rows), perm=[0, 1, 3, 2]))
        local_kernel = LocalTerms(kernel, op.Constant(value=in_pair))
        return Rows(op.MatMul(exact - Pairs(far_weight) * local_kernel, Pairs(v_rows)))

    @script(ATTNREWRITE, default_opset=op)
    def NeighbourSums(logits, shift, far_weight, pq_rows, pk_rows, v_rows):
        """PairSums over each block's neighbour outside the pair."""
        exact = op.Exp(logits - Blocks(shift))
        kernel = op.MatMul(Blocks(pq_rows), op.Transpose(Neighbours(pk_rows), perm=[0, 1, 2, 4, 3]))
        local_kernel = LocalTerms(kernel, op.Constant(value=across))
        return Rows(op.MatMul(exact - Blocks(far_weight) * local_kernel, Neighbours(v_rows)))

    @script(ATTNREWRITE, default_opset=op)
    def PairedSums(near, neighbour, shift, far_weight, pq, pk, v_rows):
        state = op.MatMul(op.Transpose(pk, perm=[0, 2, 1]), v_rows)  # [G, F, Dv + 1]: S and z
        in_pair_sums = PairSums(near, shift, far_weight, pq, pk, v_rows)
        neighbour_sums = NeighbourSums(neighbour, shift, far_weight, pq, pk, v_rows)
        return in_pair_sums + neighbour_sums + far_weight * op.MatMul(pq, state)

    return PairedSums


@built_once
def paired_window_functions(
    op, blocks: WindowBlockFunctions, flatten, window: int, scale: float, following: bool, sinks: int, eps: float
):
    """RowInputs(phi_q, q, k, v, key_keep, linear_log_weight), PairedWindow(pq, pk, q, k, v, keep,
    log_ratio_offset, max_weight) -> [G, rows, Dv + 1] and Normalised(sums, q, v): the
    bidirectional window's pieces, in pairs of blocks, whatever its units. Every input but v is
    in the window's rows already (window_inputs_function), v [G, N, Dv] as it is. The log ratio of
    the kernel part's unit to the exact part's is log_ratio_offset - max_weight * m_i per row
    ([G, rows or 1, 1]; m_i the row's max exact logit)."""
    pairs = pair_layout_functions(op, blocks, window, following, sinks)
    parts = _paired_parts_functions(op, blocks, pairs, window, scale, following, sinks)
    ExactLogits, WeightedSums, HasFarKeys = parts.ExactLogits, parts.WeightedSums, pairs.HasFarKeys
    ValuesAndOnes, UnitsOfBoth = pairs.ValuesAndOnes, units_function(op)

    @script(ATTNREWRITE, default_opset=op)
    def KeptValueRows(v, keep):
        """[v, 1] on the rows, 0 on a key that is not kept or a padding row: such a key weighs 0
        in every sum whatever its phi_k (which need only be finite there)."""
        return ValuesAndOnes(v) * keep

    @script(ATTNREWRITE, default_opset=op)
    def Units(row_max, ratio, n):
        """UnitsOfBoth, the kernel part's weight 0 where a row has no far key."""
        shift, far_weight = UnitsOfBoth(row_max, ratio)
        return shift, far_weight * op.Cast(HasFarKeys(n), to=FLOAT)

    if sinks:

        @script(ATTNREWRITE, default_opset=op)
        def PairedWindowWithSinks(pq, pk, q, k, v, keep, log_ratio_offset, max_weight):
            n = op.Shape(v, start=1, end=2)
            near, neighbour, sink, row_max = ExactLogits(q, k, keep, n)
            ratio = log_ratio_offset - max_weight * row_max
            shift, far_weight = Units(row_max, ratio, n)
            return WeightedSums(near, neighbour, sink, shift, far_weight, pq, pk, KeptValueRows(v, keep), n)

        window_sums = PairedWindowWithSinks
    else:

        @script(ATTNREWRITE, default_opset=op)
        def PairedWindow(pq, pk, q, k, v, keep, log_ratio_offset, max_weight):
            n = op.Shape(v, start=1, end=2)
            near, neighbour, row_max = ExactLogits(q, k, keep, n)
            ratio = log_ratio_offset - max_weight * row_max
            shift, far_weight = Units(row_max, ratio, n)
            return WeightedSums(near, neighbour, shift, far_weight, pq, pk, KeptValueRows(v, keep))

        window_sums = PairedWindow

    row_inputs = paired_inputs_functions(op, flatten, sinks)[1]
    return row_inputs, window_sums, normalised_function(op, blocks, eps)


@built_once
def paired_window_entry(op, flatten, row_inputs, window_sums, normalised, rescaled: bool, max_weighted: bool):
    """WindowedKernelAttention, WindowedRescaledKernelAttention or WindowedMaxWeightedKernelAttention
    (inputs as windowed_kernel_attention_functions says, ``key_log_scale`` one per head), bidirectional."""
    per_head = per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        zero = op.Constant(value_float=0.0)  # both parts in one unit already, but for w_h
        return normalised(window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, log_weight, zero), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedRescaledKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
    ):
        """The kernel part in units of e^(a_i + b_h) (one key log scale per head), the exact
        part's e^(m_i)."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        offset = flatten(query_log_scale) + flatten(key_log_scale) + log_weight
        one = op.Constant(value_float=1.0)
        return normalised(window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, offset, one), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def WindowedMaxWeightedKernelAttention(
        phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
    ):
        """As WindowedRescaledKernelAttention with the kernel part moved by e^(-beta_h m_i),
        beta_h = local_max_weight [heads, 1, 1]."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = row_inputs(phi_q, q, k, v, key_keep, linear_log_weight)
        offset = flatten(query_log_scale) + flatten(key_log_scale) + log_weight
        sums = window_sums(pq, flatten(phi_k), q_rows, k_rows, v_rows, keep, offset, per_head(local_max_weight, q))
        return normalised(sums, q, v)

    if not rescaled:
        return WindowedKernelAttention
    return WindowedMaxWeightedKernelAttention if max_weighted else WindowedRescaledKernelAttention
