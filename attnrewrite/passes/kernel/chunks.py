"""Chunks of positions and sums over them, in both lowerings: the layout the causal forms work in
(ChunkLayout, and the ONNX chunk_rows_functions), prefix sums and running maxima along a chunk
axis that grows with N, and prefix sums of states rescaled to a running reference.

The ONNX bodies take no CumSum along an axis that grows with N (onnxruntime's CUDA CumSum sums
each output's whole prefix: O(L^2) along an axis of length L): prefix sums and the rescaled
carry go through bounded-depth hierarchies of triangular products (ExclusivePrefixSum,
rescaled_prefix_functions). The torch forms (what the FX frontend and calibration run) keep
torch.cumsum, a running sum, and nest the running maxima and the rescaled carry two levels deep
as the ONNX forms do (chunk_running_max, rescaled_prefix_sum). No form holds a (chunks x chunks)
matrix: the largest square is a top level's, [chunks / PREFIX_GROUP]^2 for the running maxima
and rescaled carries (1024^2 at N = 1M, chunk 64: from about N = 2^18 its products cost what the
first level's do, and compute grows faster than N again) and [chunks / PREFIX_GROUP^2]^2 for
ExclusivePrefixSum; below that, compute and memory grow as N."""

from __future__ import annotations

from onnxscript import script

from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.lowering import ATTNREWRITE, BOOL, built_once, standard_opset
from attnrewrite.passes.optional_torch import torch

PREFIX_GROUP = 16  # rows per group at each level of the hierarchical prefix sums and maxima


class ChunkLayout:
    """[..., N, F] <-> [G, chunks, chunk, F], written so torch.export adds no guard on N >= 1.

    Rows are padded at the front, never at the end: causal outputs do not depend on zero keys
    before them, and the real rows are then the last N, taken with a gather rather than a slice
    (slicing [:N] off the padded length needs N <= chunks * chunk, which the symbolic solver
    cannot prove, so it guards on the example's N). The padding is a whole chunk more than
    needed: with chunks = ceil(N / chunk) + 1 >= 2 written as one floor division, no size is
    ever 1 or 0 for some N and not others (each would be a guard), and the reshape's
    divisibility check is exact. The causal ONNX functions pad at the end: the same sums with
    chunk boundaries elsewhere, so the two lowerings differ by rounding only. The windowed ONNX
    function pads as here, since there the blocks decide which keys are exact. (A window >= N
    thus costs two blocks of W: exact attention, with W x 2W logits per block.)

    ``aligned_to_start`` (the causal window's layout): one whole chunk in front and the rest at
    the end, so position p lies in block p // chunk + 1 whatever N is. Blocks decide which keys
    are exact, and a causal output must not depend on how many positions follow it: aligned to
    the end, appending a token would move every block boundary, and a decoder stepping token by
    token (passes/recurrent.py) could not reproduce the outputs. Padding at the end is hidden
    from every real query by the causal mask.
    """

    def __init__(self, n, chunk: int, aligned_to_start: bool = False):
        self.n, self.chunk = n, chunk
        self.chunks = (n + 2 * chunk - 1) // chunk
        self.pad = chunk if aligned_to_start else self.chunks * chunk - n  # in [chunk, 2 * chunk - 1]
        self.tail = self.chunks * chunk - chunk - n if aligned_to_start else 0  # in [0, chunk - 1]
        self.groups = prefix_groups(n, chunk)  # of the chunks, for prefixes over them

    def blocks(self, x, fill: float = 0.0):
        x = torch.nn.functional.pad(flatten_heads(x), (0, 0, self.pad, self.tail), value=fill)
        return x.reshape(x.shape[0], self.chunks, self.chunk, x.shape[-1])

    def unblock(self, x4):
        rows = x4.reshape(x4.shape[0], self.chunks * self.chunk, x4.shape[-1])
        return rows.index_select(1, torch.arange(self.n, device=x4.device) + self.pad)


@built_once
def chunk_rows_functions(opset_version: int):
    """(ChunkSize, ChunkedRows, UnchunkedRows), ChunkLayout's ONNX twin for the causal forms:
    ChunkSize(x, chunk) the chunk ([1]) for x [G, N, X]; ChunkedRows(x, c, fill) [G, N, X] ->
    [G, ceil(N / c), c, X], fill after the last row (padding at the end: see ChunkLayout);
    UnchunkedRows(x4, x) -> its first N rows, N that of x."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def ChunkSize(x, chunk):
        # chunks no longer than the sequence: a decoding step (N = 1) pads nothing to a chunk
        return op.Max(op.Min(chunk, op.Shape(x, start=1, end=2)), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def ChunkedRows(x, c, fill):
        n = op.Shape(x, start=1, end=2)
        zero = op.Constant(value_ints=[0])
        chunks = op.Div(n + c - op.Constant(value_ints=[1]), c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        shape = op.Concat(op.Constant(value_ints=[-1]), chunks, c, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill), shape)

    @script(ATTNREWRITE, default_opset=op)
    def UnchunkedRows(x4, x):
        rows = op.Reshape(x4, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(x4, start=3), axis=0))
        return op.Slice(rows, op.Constant(value_ints=[0]), op.Shape(x, start=1, end=2), op.Constant(value_ints=[1]))

    return ChunkSize, ChunkedRows, UnchunkedRows


def exclusive_cumsum(x):
    """Prefix sums over chunks (dim 1) that leave out the chunk itself."""
    return torch.cumsum(shift_right(x, 0.0), dim=1)


def shift_right(x, fill: float, steps: int = 1):
    """x moved ``steps`` chunks later along dim 1, fill first: a pad, then dropping the last
    ``steps`` of chunks + steps (never a slice that is empty or of size 1 for some N, see
    ChunkLayout)."""
    pads = [0, 0] * (x.dim() - 2) + [steps, 0]
    return torch.nn.functional.pad(x, pads, value=fill)[:, :-steps]


def running_max(x):
    """Running max over the last axis as a lower-triangular masked max ([..., L] -> [..., L, L]),
    as the ONNX RunningMax: torch.cummax has no ONNX conversion."""
    size = x.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    return torch.where(lower, x.unsqueeze(-2), LOWEST_LOG_SCALE).amax(dim=-1)


# Along a chunk axis that grows with N, running maxima and rescaled prefix sums go two levels deep
# (groups of PREFIX_GROUP rows, then the groups), as the ONNX ChunkRunningMax and RescaledPrefixSum:
# no (chunks x chunks) matrix, so compute stays near linear in N.


def prefix_groups(n, span: int):
    """Groups of PREFIX_GROUP rows for the chunks of ``span`` positions of n (at most
    n / span + 3 of them: ChunkLayout, FarChunks): ceil(n / (PREFIX_GROUP span)) + 1, at least
    one more group than they fill, so that the count is never 1 for some N and not others (a
    guard, see ChunkLayout). Written as a ceiling of n itself: torch.export proves its guards
    (as it does ChunkLayout's), not those of the groups of a floor division's result."""
    return (n + 2 * PREFIX_GROUP * span - 1) // (PREFIX_GROUP * span)


def _in_groups(x, fill: float, groups):
    """[G, L, *] -> [G, groups, PREFIX_GROUP, *], fill after the last row (prefix_groups)."""
    pads = [0, 0] * (x.dim() - 2) + [0, groups * PREFIX_GROUP - x.shape[1]]
    return torch.nn.functional.pad(x, pads, value=fill).reshape(x.shape[0], groups, PREFIX_GROUP, *x.shape[2:])


def _out_of_groups(x4, rows):
    """_in_groups undone: the first ``rows`` rows, a gather rather than a slice (see ChunkLayout)."""
    flat = x4.reshape(x4.shape[0], x4.shape[1] * PREFIX_GROUP, *x4.shape[3:])
    return flat.index_select(1, torch.arange(rows, device=x4.device))


def chunk_running_max(x, groups):
    """[G, L] -> the max of x over rows <= each row: inside each group, then the groups before."""
    within = running_max(_in_groups(x, LOWEST_LOG_SCALE, groups))  # [G, groups, PREFIX_GROUP]
    earlier_groups = shift_right(running_max(within[..., -1]), LOWEST_LOG_SCALE)
    return _out_of_groups(torch.maximum(within, earlier_groups.unsqueeze(-1)), x.shape[1])


def rescaled_prefix_sum(x, m, r, groups):
    """Per row c of x [G, L, X] (row c' standing for x[c'] exp(m[c']), m [G, L]), the sum over
    c' < c of x[c'] exp(m[c'] - r[c]), to references r [G, L] >= every m[c'] summed into their
    row, so that no factor exceeds 1: inside a group each pair's factor, across groups each
    group's total moved to its own max U, carried to the max B of the groups before, then to
    r[c] >= B. Rows that fit one group at a length known now (not a symbol of torch.export)
    take that group's product alone: the grouping's padding (at least one whole group more,
    see prefix_groups) would triple a calibration passage's states, and moving and gathering
    them took 20 times the product (hedgehog, window 64, 11 chunks of [128 x 65] states)."""
    rows = x.shape[1]
    if isinstance(rows, int) and rows <= PREFIX_GROUP:
        pairs = m.unsqueeze(1) - r.unsqueeze(2)  # [G, row c, row c']
        return torch.tril(torch.exp(torch.clamp_max(pairs, 0.0)), diagonal=-1) @ x
    x4, m3, r3 = _in_groups(x, 0.0, groups), _in_groups(m, LOWEST_LOG_SCALE, groups), _in_groups(r, 0.0, groups)
    pairs = m3.unsqueeze(2) - r3.unsqueeze(3)  # [G, groups, row c, row c']
    within = torch.tril(torch.exp(torch.clamp_max(pairs, 0.0)), diagonal=-1) @ x4
    group_max = m3.amax(dim=-1)  # U [G, groups]
    totals = (torch.exp(m3 - group_max.unsqueeze(-1)).unsqueeze(2) @ x4).squeeze(2)  # [G, groups, X]
    before = shift_right(running_max(group_max), LOWEST_LOG_SCALE)  # B
    moves = group_max.unsqueeze(1) - before.unsqueeze(2)
    across = torch.tril(torch.exp(torch.clamp_max(moves, 0.0)), diagonal=-1) @ totals
    into = torch.exp(torch.clamp_max(before.unsqueeze(-1) - r3, 0.0)).unsqueeze(-1)  # from B to r[c]
    # in place: the one value as large as x4 that is not x4 itself
    return _out_of_groups(within.addcmul_(into, across.unsqueeze(2)), x.shape[1])


@built_once
def running_max_functions(opset_version: int):
    """RunningMax(x, lower) over the last axis and LowerTriangle(size), the mask it takes."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def RunningMax(x, lower):
        # ONNX has no CumMax: max over a lower-triangular mask of the last axis ([..., L] x [L, L]).
        lowest = op.Constant(value_float=LOWEST_LOG_SCALE)
        masked = op.Where(lower, op.Unsqueeze(x, op.Constant(value_ints=[-2])), lowest)
        return op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=0)

    @script(ATTNREWRITE, default_opset=op)
    def LowerTriangle(size):
        ones = op.Expand(op.Constant(value_float=1.0), op.Concat(size, size, axis=0))
        return op.Cast(op.Trilu(ones, upper=0), to=BOOL)

    return RunningMax, LowerTriangle


@built_once
def exclusive_prefix_sum_function(opset_version: int, skip: int = 0):
    """ExclusivePrefixSum(x): [G, L, X] -> the sums over rows before each row (axis 1), with no
    CumSum (onnxruntime's CUDA CumSum is quadratic in its axis: the module docstring); ``skip``
    = 1: PrefixSumBeforePrevious, over rows <= c-2 (the row before is left out too: one row of
    zeros in front, in the padding the grouping does anyway, instead of a shift afterwards).

    Depth 3 whatever L: inside groups of PREFIX_GROUP rows a product with a strictly
    lower-triangular [PREFIX_GROUP]^2 matrix; the same over the groups' totals; over the totals
    of those (L / PREFIX_GROUP^2 rows) one product with a strictly lower-triangular matrix of
    their count. Of per-chunk states (chunk 64) that top matrix is [N / 16384]^2, 64^2 at
    N = 1M: the cost stays the first level's, a 16-row product per row."""
    op = standard_opset(opset_version)
    grouped, ungrouped, strictly_lower = row_group_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixOfGroupTotals(x):
        """The second level and the top."""
        x4 = grouped(x, op.Constant(value_float=0.0), op.Constant(value_ints=[0]))
        within = op.MatMul(strictly_lower(op.Constant(value_ints=[PREFIX_GROUP])), x4)
        totals = op.ReduceSum(x4, op.Constant(value_ints=[2]), keepdims=0)
        across = op.MatMul(strictly_lower(op.Shape(totals, start=1, end=2)), totals)
        return ungrouped(within + op.Unsqueeze(across, op.Constant(value_ints=[2])), x)

    @script(ATTNREWRITE, default_opset=op)
    def PrefixSumAfter(x, front):
        """The first level, ``front`` rows of zeros before x."""
        x4 = grouped(x, op.Constant(value_float=0.0), front)
        within = op.MatMul(strictly_lower(op.Constant(value_ints=[PREFIX_GROUP])), x4)
        across = PrefixOfGroupTotals(op.ReduceSum(x4, op.Constant(value_ints=[2]), keepdims=0))
        return ungrouped(within + op.Unsqueeze(across, op.Constant(value_ints=[2])), x)

    @script(ATTNREWRITE, default_opset=op)
    def ExclusivePrefixSum(x):
        return PrefixSumAfter(x, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def PrefixSumBeforePrevious(x):
        return PrefixSumAfter(x, op.Constant(value_ints=[1]))

    return [ExclusivePrefixSum, PrefixSumBeforePrevious][skip]


@built_once
def row_group_functions(opset_version: int):
    """(GroupedRows, UngroupedRows, StrictlyLower): x [G, L, *] -> [G, groups, PREFIX_GROUP, *]
    with ``front`` ([1] int64) rows of fill before x and the rest after it; UngroupedRows(x4, x)
    keeps the first L rows (x's count); and the strictly lower-triangular ones of a size."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def GroupedRows(x, fill, front):
        rows = op.Shape(x, start=1, end=2) + front
        g = op.Constant(value_ints=[PREFIX_GROUP])
        groups = op.Div(rows + g - op.Constant(value_ints=[1]), g)
        pads = op.Concat(front, groups * g - rows, axis=0)
        shape = op.Concat(op.Constant(value_ints=[0]), groups, g, op.Shape(x, start=2), axis=0)
        return op.Reshape(op.Pad(x, pads, fill, op.Constant(value_ints=[1])), shape)

    @script(ATTNREWRITE, default_opset=op)
    def UngroupedRows(x4, x):
        rows = op.Reshape(x4, op.Concat(op.Constant(value_ints=[0, -1]), op.Shape(x4, start=3), axis=0))
        return op.Slice(rows, op.Constant(value_ints=[0]), op.Shape(x, start=1, end=2), op.Constant(value_ints=[1]))

    @script(ATTNREWRITE, default_opset=op)
    def StrictlyLower(size):
        ones = op.Expand(op.Constant(value_float=1.0), op.Concat(size, size, axis=0))
        return op.Trilu(ones, op.Constant(value_int=-1), upper=0)

    return GroupedRows, UngroupedRows, StrictlyLower


@built_once
def rescaled_prefix_functions(opset_version: int, skip: int = 0):
    """(ChunkRunningMax, RescaledPrefixSum): running maxima and rescaled prefix sums along a
    chunk axis that grows with N, two levels deep (PREFIX_GROUP rows, then their groups), so
    that neither a (chunks x chunks) matrix nor a CumSum appears. Their top matrices are
    [L / PREFIX_GROUP]^2, 1024^2 for chunk states at N = 1M; past N = 2^18 (where the top's
    products cost what the first level's do) compute grows faster than N again.

    ChunkRunningMax(x): [G, L] -> the max of x over rows <= each row.
    RescaledPrefixSum(x, m, r): [G, L, X] with its log scales m [G, L] (row c' stands for
    x[c'] * exp(m[c'])), to references r [G, L] -> per row c, sum over c' < c of
    x[c'] exp(m[c'] - r[c]); ``skip`` = 1: RescaledSumBeforePrevious, over c' <= c-2 (as
    PrefixSumBeforePrevious). Every r[c] must be >= every m[c'] summed into row c, so that no
    factor exceeds 1: inside a group the pairs' factors, across groups each group's total moved
    to its own max U, carried to the max B of the groups before (exp(U' - B) <= 1), then to
    r[c] >= B."""
    op = standard_opset(opset_version)
    RunningMax, LowerTriangle = running_max_functions(opset_version)
    grouped, ungrouped, _ = row_group_functions(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def GroupedScales(x, fill, front):
        """[G, L] -> [G, groups, PREFIX_GROUP], as GroupedRows."""
        last = op.Constant(value_ints=[-1])
        return op.Squeeze(grouped(op.Unsqueeze(x, last), fill, front), last)

    @script(ATTNREWRITE, default_opset=op)
    def MaxOfEarlierGroups(group_max):
        """[G, groups] -> the max over the groups before each (the lowest log scale for the first)."""
        through = RunningMax(group_max, LowerTriangle(op.Shape(group_max, start=1, end=2)))
        one = op.Constant(value_ints=[1])
        earlier = op.Slice(through, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), one)
        return op.Pad(earlier, op.Constant(value_ints=[1, 0]), op.Constant(value_float=LOWEST_LOG_SCALE), one)

    @script(ATTNREWRITE, default_opset=op)
    def ChunkRunningMax(x):
        lowest, group = op.Constant(value_float=LOWEST_LOG_SCALE), op.Constant(value_ints=[PREFIX_GROUP])
        within = RunningMax(GroupedScales(x, lowest, op.Constant(value_ints=[0])), LowerTriangle(group))
        group_max = op.Gather(within, op.Constant(value_int=PREFIX_GROUP - 1), axis=2)
        running = op.Max(within, op.Unsqueeze(MaxOfEarlierGroups(group_max), op.Constant(value_ints=[2])))
        last = op.Constant(value_ints=[-1])
        return op.Squeeze(ungrouped(op.Unsqueeze(running, last), op.Unsqueeze(x, last)), last)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledSumAfter(x, m, r, front):
        """RescaledPrefixSum with ``front`` rows of zeros (log scale: the lowest) before x and m."""
        zero = op.Constant(value_float=0.0)
        two, three = op.Constant(value_ints=[2]), op.Constant(value_ints=[3])
        x4 = grouped(x, zero, front)  # [G, groups, g, X]
        m3 = GroupedScales(m, op.Constant(value_float=LOWEST_LOG_SCALE), front)
        # the references stay on their rows, padded at the end to x's groups
        r_rows = op.Pad(r, op.Concat(op.Constant(value_ints=[0]), front, axis=0), zero, op.Constant(value_ints=[1]))
        r3 = GroupedScales(r_rows, zero, op.Constant(value_ints=[0]))
        pairs = op.Unsqueeze(m3, two) - op.Unsqueeze(r3, three)  # [G, groups, row c, row c']
        within = op.MatMul(op.Trilu(op.Exp(op.Min(pairs, zero)), op.Constant(value_int=-1), upper=0), x4)
        group_max = op.ReduceMax(m3, two, keepdims=0)  # U [G, groups]
        to_group_max = op.Unsqueeze(op.Exp(m3 - op.Unsqueeze(group_max, two)), two)  # [G, groups, 1, g]
        totals = op.Squeeze(op.MatMul(to_group_max, x4), two)  # [G, groups, X]
        before = MaxOfEarlierGroups(group_max)  # B
        moves = op.Unsqueeze(group_max, op.Constant(value_ints=[1])) - op.Unsqueeze(before, two)
        across = op.MatMul(op.Trilu(op.Exp(op.Min(moves, zero)), op.Constant(value_int=-1), upper=0), totals)
        into = op.Unsqueeze(op.Exp(op.Min(op.Unsqueeze(before, two) - r3, zero)), three)  # from B to r[c], <= 1
        return ungrouped(within + into * op.Unsqueeze(across, two), x)

    @script(ATTNREWRITE, default_opset=op)
    def RescaledPrefixSum(x, m, r):
        return RescaledSumAfter(x, m, r, op.Constant(value_ints=[0]))

    @script(ATTNREWRITE, default_opset=op)
    def RescaledSumBeforePrevious(x, m, r):
        return RescaledSumAfter(x, m, r, op.Constant(value_ints=[1]))

    return ChunkRunningMax, [RescaledPrefixSum, RescaledSumBeforePrevious][skip]
