"""The ONNX window's blocks ([G, N, F] <-> [G, chunks, window, F], as kernel.chunks.ChunkLayout
lays them out) and the per-row pieces both paired entries share: the sinks' rows, the inputs as
rows, per-head values, the two parts' units and the normalised output."""

from __future__ import annotations

import typing

from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.numerics import NO_EXACT_KEY_SHIFT
from attnrewrite.passes.layout import key_keep_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, built_once, rank_constant


class WindowBlockFunctions(typing.NamedTuple):
    """The windowed functions' layout, [G, N, F] <-> [G, chunks, window, F] (ChunkLayout's),
    and moves of whole blocks along axis 1."""

    BlockCount: OnnxFunction
    FrontPad: OnnxFunction
    WindowBlocks: OnnxFunction
    ShiftBlocks: OnnxFunction


@built_once
def window_block_functions(op, window: int, aligned_to_start: bool) -> WindowBlockFunctions:
    @script(ATTNREWRITE, default_opset=op)
    def BlockCount(n):
        """[1]: the blocks of N positions, ceil(N/window) + 1 (ChunkLayout's count)."""
        w = op.Constant(value_ints=[window])
        return op.Div(n + w + w - op.Constant(value_ints=[1]), w)

    @script(ATTNREWRITE, default_opset=op)
    def EndAlignedFrontPad(n):
        """[1]: the rows in front of N positions, so that the last block ends with the last one."""
        return BlockCount(n) * op.Constant(value_ints=[window]) - n

    @script(ATTNREWRITE, default_opset=op)
    def StartAlignedFrontPad(n):
        """[1]: one block in front, so that position p lies in block p // window + 1 (causal)."""
        return op.Constant(value_ints=[window])

    FrontPad = StartAlignedFrontPad if aligned_to_start else EndAlignedFrontPad

    @script(ATTNREWRITE, default_opset=op)
    def WindowBlocks(x, fill):
        """[G, N, F] -> [G, chunks, window, F], FrontPad rows in front, the rest of the
        BlockCount blocks at the end."""
        n = op.Shape(x, start=1, end=2)
        w = op.Constant(value_ints=[window])
        zero = op.Constant(value_ints=[0])
        chunks = BlockCount(n)
        front = FrontPad(n)
        pads = op.Concat(zero, front, zero, zero, chunks * w - front - n, zero, axis=0)
        shape = op.Concat(op.Constant(value_ints=[-1]), chunks, w, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill), shape)

    @script(ATTNREWRITE, default_opset=op)
    def ShiftBlocks(x, fill, steps):
        """x moved ``steps`` blocks later along axis 1, fill first."""
        one = op.Constant(value_ints=[1])
        shifted = op.Pad(x, op.Concat(steps, op.Constant(value_ints=[0]), axis=0), fill, one)
        return op.Slice(shifted, op.Constant(value_ints=[0]), op.Neg(steps), one)

    return WindowBlockFunctions(BlockCount, FrontPad, WindowBlocks, ShiftBlocks)


@built_once
def without_sinks_function(op, sinks: int):
    """WithoutSinks(x, fill): [G, N, F] with the sinks' rows set to fill, or NoSinks: x as it is."""

    @script(ATTNREWRITE, default_opset=op)
    def WithoutSinks(x, fill):
        """[G, N, F] with rows 0..sinks-1 set to fill: the kernel never sees a sink key."""
        n = op.Squeeze(op.Shape(x, start=1, end=2))
        position = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
        sink = op.Unsqueeze(op.Less(position, op.Constant(value_int=sinks)), op.Constant(value_ints=[0, 2]))
        return op.Where(sink, fill, x)

    @script(ATTNREWRITE, default_opset=op)
    def NoSinks(x, fill):
        return op.Identity(x)

    return WithoutSinks if sinks else NoSinks


@built_once
def sink_rows_function(op, blocks: WindowBlockFunctions, sinks: int):
    """SinkRows(rows, n): the window's rows [G, rows, F] -> [G, sinks, F], positions 0..sinks-1
    of N (the rows after FrontPad; the padding's, zero or not kept, beyond N)."""
    FrontPad = blocks.FrontPad

    @script(ATTNREWRITE, default_opset=op)
    def SinkRows(rows, n):
        front, count = FrontPad(n), op.Constant(value_ints=[sinks])
        taken = op.Slice(rows, front, front + count, op.Constant(value_ints=[1]))
        zero = op.Constant(value_ints=[0])  # more sinks than rows after FrontPad: zero rows
        missing = op.Concat(zero, zero, zero, zero, count - op.Shape(taken, start=1, end=2), zero, axis=0)
        return op.Pad(taken, missing, op.Constant(value_float=0.0))

    return SinkRows


@built_once
def paired_inputs_functions(op, flatten, sinks: int):
    """(PairedInputs, RowInputs): the paired windows' inputs as rows, RowInputs without phi_k
    (which a kernel with per-key log scales takes as it is)."""
    without_sinks, expand_keep = without_sinks_function(op, sinks), key_keep_function(op.version)
    per_head = per_head_function(op, flatten)

    @script(ATTNREWRITE, default_opset=op)
    def RowInputs(phi_q, q, k, v, key_keep, linear_log_weight):
        """[G, N, *]: phi_q, q, k, v, keep flags, and log w_h [G, 1, 1]: the kernel part's
        weight goes into the units' log ratio (one value per row), not over phi_q."""
        keep = op.Cast(expand_keep(key_keep, k), to=FLOAT)
        return flatten(phi_q), flatten(q), flatten(k), flatten(v), keep, per_head(linear_log_weight, q)

    @script(ATTNREWRITE, default_opset=op)
    def PairedInputs(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
        """RowInputs with phi_k zero on the sinks second."""
        pq, q_rows, k_rows, v_rows, keep, log_weight = RowInputs(phi_q, q, k, v, key_keep, linear_log_weight)
        pk = without_sinks(flatten(phi_k), op.Constant(value_float=0.0))
        return pq, pk, q_rows, k_rows, v_rows, keep, log_weight

    return PairedInputs, RowInputs


@built_once
def per_head_function(op, flatten):
    @script(ATTNREWRITE, default_opset=op)
    def PerHead(x, q):
        """A value per head [heads, 1, 1] -> [G, 1, 1], G as FlattenHeads(q) has it: one value
        that broadcasts over a head's rows, not a [G, rows, 1] copy of it."""
        head_shape = op.Concat(op.Shape(q, end=-2), op.Constant(value_ints=[1, 1]), axis=0)
        return flatten(op.Expand(op.Cast(x, to=FLOAT), head_shape))

    return PerHead


@built_once
def units_function(op):
    # [G, rows, 1] against constants of their rank (rank_constant says why)
    least_shift, rows_zero = rank_constant(NO_EXACT_KEY_SHIFT, 3), rank_constant(0.0, 3)

    @script(ATTNREWRITE, default_opset=op)
    def UnitsOfBoth(row_max, ratio):
        """The exact part's shift and the kernel part's weight per row, from ``ratio``, the log of
        (kernel part's unit / exact part's unit): e^-max(ratio, 0) folded into the shift and
        e^min(ratio, 0), so neither part overflows."""
        zero = op.Constant(value=rows_zero)
        shift = op.Max(row_max + op.Max(ratio, zero), op.Constant(value=least_shift))
        return shift, op.Exp(op.Min(ratio, zero))

    return UnitsOfBoth


@built_once
def normalised_function(op, blocks: WindowBlockFunctions, eps: float):
    FrontPad, eps_rows = blocks.FrontPad, rank_constant(eps, 3)

    @script(ATTNREWRITE, default_opset=op)
    def Normalised(sums, q, v):
        """[G, rows, Dv + 1] -> q's leading axes + [N, Dv]: the numerator over the denominator
        (the last column) on the N rows after FrontPad (q as it is or in the window's rows)."""
        n = op.Shape(v, start=-2, end=-1)
        front, dv = FrontPad(n), op.Shape(v, start=-1)
        axes, zero, one = op.Constant(value_ints=[1, 2]), op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        numerator = op.Slice(sums, op.Concat(front, zero, axis=0), op.Concat(front + n, dv, axis=0), axes)
        denominator = op.Slice(sums, op.Concat(front, dv, axis=0), op.Concat(front + n, dv + one, axis=0), axes)
        out = numerator / (denominator + op.Constant(value=eps_rows))
        return op.Reshape(out, op.Concat(op.Shape(q, end=-2), n, dv, axis=0))

    return Normalised
