"""The torch window's layouts: blocks of W positions (kernel.chunks.ChunkLayout's), their pairs
(BlockPairs, as the ONNX bidirectional window lays them out), the causal far part's chunks of
blocks (FarChunks), blocks aligned to a decoder's positions (PositionedLayout), and the sinks'
rows and masks in each of them; and the softmax sums of a block's exact keys."""

from __future__ import annotations

import numpy as np

from attnrewrite.passes.kernel.chunks import ChunkLayout, prefix_groups, shift_right
from attnrewrite.passes.kernel.numerics import EXP_FLOOR, LOWEST_LOG_SCALE
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.optional_torch import torch


def previous_and_own_blocks(x4) -> list:
    """[G, chunks, window, F] -> block c-1's rows and c's, each [G, chunks, window, F]."""
    return [shift_right(x4, 0.0), x4]


def local_causal_mask(window: int, device):
    """[window, 2 * window]: all of the previous block, own block up to the query itself."""
    return torch.ones(window, 2 * window, dtype=torch.bool, device=device).tril(window)


def without_sinks(x, sinks: int, fill: float, start: int = 0):
    """x [..., N, F] with the rows of positions 0..sinks-1 set to ``fill`` (x itself without
    sinks); row 0 is position ``start``."""
    if not sinks:
        return x
    sink = torch.arange(x.shape[-2], device=x.device).unsqueeze(-1) + start < sinks
    return torch.where(sink, fill, x)


def sink_rows(x, sinks: int, chunks: int):
    """[..., N, F] -> [G, chunks, sinks, F]: rows 0..sinks-1 (zero beyond N) for every block.
    Padded at the end before the slice, so its size never depends on N (see ChunkLayout)."""
    rows = torch.nn.functional.pad(flatten_heads(x), (0, 0, 0, sinks))[:, :sinks]
    return rows.unsqueeze(1).expand(-1, chunks, -1, -1)


def causal_sink_mask(layout, sinks: int, device):
    """[chunks, window, sinks]: True where block c's query takes sink s as an extra exact key: s
    lies outside the block's local keys (blocks c-1 and c) and not after the query. Positions
    are the padded layout's (sink s at s + pad)."""
    at = torch.arange(sinks, device=device) + layout.pad
    offset = at // layout.chunk - torch.arange(layout.chunks, device=device).unsqueeze(-1)
    outside = ((offset < -1) | (offset > 0)).unsqueeze(1)
    query_at = torch.arange(layout.chunks * layout.chunk, device=device).reshape(layout.chunks, layout.chunk, 1)
    return outside & (at <= query_at)


def earlier_blocks_sum(x):
    """Per block c (dim 1), the sum of x over blocks <= c-2 (a causal window's far blocks)."""
    return shift_right(torch.cumsum(x, dim=1), 0.0, steps=2)


class FarChunks:
    """A causal window's far part by chunks of P = round(far_chunk / W) blocks, as the ONNX
    FarSums lays it out (the comment above onnx_causal._chunked_far_sums_functions): rows [G, N, *] ->
    [G, chunks', P W, *], query chunk k holding blocks kP .. kP + P - 1 of the window's layout,
    key chunk k the rows one block earlier (blocks kP - 1 .. kP + P - 2), so that every key
    chunk before k is far for all of query chunk k, and inside key chunk k query block kP + a
    takes key block kP - 1 + b where b < a (``earlier_blocks``, [P, P]). chunks' =
    ceil(N / (P W)) + 2 (written so that torch.export proves its guards, see prefix_groups)
    leaves the keys room to move a block and is never 1 for some N (a guard, see ChunkLayout);
    where it exceeds the ONNX form's (chunks + P) // P, the extra chunk holds padding only."""

    def __init__(self, layout: ChunkLayout, far_chunk: int, device):
        self.layout, self.window = layout, layout.chunk
        self.per_chunk = max(1, round(far_chunk / layout.chunk))
        self.size = self.per_chunk * layout.chunk
        self.count = (layout.n + 3 * self.size - 1) // self.size
        self.groups = prefix_groups(layout.n, self.size)
        self.earlier_blocks = torch.ones(self.per_chunk, self.per_chunk, device=device).tril(-1)

    def queries(self, x, fill: float = 0.0):
        return self._in_chunks(x, fill, self.layout.pad)

    def keys(self, x, fill: float = 0.0):
        return self._in_chunks(x, fill, self.layout.pad + self.window)

    def _in_chunks(self, x, fill: float, front):
        rows = self.count * self.size - front - x.shape[-2]  # x's own length (see BlockPairs.rows)
        x = torch.nn.functional.pad(x, (0, 0, front, rows), value=fill)
        return x.reshape(x.shape[0], self.count, self.size, x.shape[-1])

    def in_blocks(self, x):
        """[G, chunks', P W, *] -> [G, chunks', P, W, *]."""
        return x.unflatten(2, (self.per_chunk, self.window))

    def per_block(self, x, fill: float = 0.0):
        """One value per block of the window's layout [G, chunks] -> [G, chunks', P]."""
        x = torch.nn.functional.pad(x, (0, self.count * self.per_chunk - self.layout.chunks), value=fill)
        return x.reshape(x.shape[0], self.count, self.per_chunk)

    def blocks(self, sums):
        """[G, chunks', P W, X] -> the window's blocks [G, chunks, W, X]: a gather, not a slice
        (see ChunkLayout)."""
        in_blocks = sums.reshape(sums.shape[0], self.count * self.per_chunk, self.window, sums.shape[-1])
        return in_blocks.index_select(1, torch.arange(self.layout.chunks, device=sums.device))

    def within(self, q_c, k_c, vo_c, weight):
        """sum over key j of key chunk k of weight[a, b] phi_q_i.phi_k_j [v_j, 1], a and b the
        blocks of query i and key j in the chunk; weight [..., P, P] is zero unless b < a."""
        if self.per_chunk == 1:  # every key of key chunk k is local to query chunk k
            return 0.0
        if self.per_chunk == 2:  # only query block 1 takes keys here, key block 0's: [W, W] products
            later_q, earlier_k = self.in_blocks(q_c)[:, :, 1], self.in_blocks(k_c)[:, :, 0]
            scores = (later_q @ earlier_k.transpose(-2, -1)) * weight[..., 1:, :1]
            return torch.nn.functional.pad(scores @ self.in_blocks(vo_c)[:, :, 0], (0, 0, self.window, 0))
        scores = self.in_blocks((q_c @ k_c.transpose(-2, -1)).unflatten(-1, (self.per_chunk, self.window)))
        weighted = scores * weight[..., :, None, :, None]  # [G, chunks', P, W, P, W]
        return weighted.flatten(4, 5).flatten(2, 3) @ vo_c


def values_and_ones(v):
    """[v, 1]: the denominator as one more value column."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


class BlockPairs:
    """ChunkLayout's blocks in pairs, as the ONNX bidirectional window lays them out (see the
    docstring of onnx_pairs.py): rows [G, pairs * 2W, F], seen as [G, pairs, 2W, F] pairs,
    [G, pairs, 2, W, F] blocks, or each block's neighbour outside its pair."""

    def __init__(self, n, window: int):
        self.layout = ChunkLayout(n, window)
        self.n, self.window = n, window
        # BlockCount // 2 + 1 (the last block is padding) as one floor division, so that
        # torch.export sees the rows divisible by it (as ChunkLayout)
        self.count = (n + 4 * window - 1) // (2 * window)
        self.size = 2 * window * self.count

    def rows(self, x, fill: float = 0.0):
        # x's own length: the keys' may be another symbol of the same size
        return torch.nn.functional.pad(
            x, (0, 0, self.layout.pad, self.size - self.layout.pad - x.shape[-2]), value=fill
        )

    def pairs(self, rows):
        return rows.reshape(rows.shape[0], -1, 2 * self.window, rows.shape[-1])

    def blocks(self, rows):
        return rows.reshape(rows.shape[0], -1, 2, self.window, rows.shape[-1])

    def neighbours(self, rows):
        """[G, pairs, 2, W, F]: for pair p, blocks 2p-1 and 2p+2 (wrapped: padding blocks)."""
        block_rows = rows.reshape(rows.shape[0], -1, self.window, rows.shape[-1])
        first = torch.arange(0, 2 * self.count, 2, device=rows.device).unsqueeze(-1)
        index = (first + torch.tensor([-1, 2], device=rows.device)) % (2 * self.count)
        return block_rows.index_select(1, index.flatten()).reshape(rows.shape[0], -1, 2, self.window, rows.shape[-1])

    def unpaired(self, x):
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def row_blocks(self, device):
        """[rows, 1]: the layout block of each row."""
        return (torch.arange(self.size, device=device) // self.window).unsqueeze(-1)

    def real_rows(self, rows):
        return rows.index_select(1, torch.arange(self.n, device=rows.device) + self.layout.pad)


def paired_sink_mask(pairs: BlockPairs, sinks: int, following: bool, device):
    """[rows, sinks]: True where a row's block takes sink s as an extra exact key."""
    offset = (torch.arange(sinks, device=device) + pairs.layout.pad) // pairs.window - pairs.row_blocks(device)
    return (offset < -1) | (offset > int(following))


class PositionedLayout(ChunkLayout):
    """ChunkLayout's blocks for the rows of positions start .. start + N - 1 of a longer
    sequence: aligned to the sequence's positions as the causal window's layout is (position p
    in block p // chunk, counted from the first block), padded only as far as that needs."""

    def __init__(self, start: int, n: int, chunk: int):
        self.n, self.chunk = n, chunk
        self.pad = start % chunk
        self.chunks = (self.pad + n + chunk - 1) // chunk
        self.tail = self.chunks * chunk - self.pad - n


def pair_structure(window: int, following: bool, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Which local keys a pair's queries take: [2W, 2W] of the pair's own keys (its own block and
    the other one of the pair, the next only ``following``; ``causal``: no key after the query),
    and [2, 1, 1] of the neighbours outside the pair (block 2p takes block 2p-1; block 2p+1 takes
    2p+2 only ``following``)."""
    if causal:  # inside a pair every earlier key is local: its own block's or the one before
        return np.tri(2 * window, dtype=bool), np.array([True, False]).reshape(2, 1, 1)
    block = np.arange(2 * window) // window
    offset = block[None, :] - block[:, None]  # key's block - query's
    in_pair = (offset >= -1) & (offset <= int(following))
    return in_pair, np.array([True, following]).reshape(2, 1, 1)


def local_softmax_sums(q4, k_x, v_x, allowed, scale: float):
    """Block c's queries over its exact keys (torch_form's and torch_state's): the unnormalised
    numerator and denominator of their softmax relative to the row max m_i, and m_i (the lowest log scale
    where no exact key is kept; its weights are then all zero, never NaN). Logits more than
    EXP_FLOOR below m_i weigh e^-EXP_FLOOR (< 1e-34 of the max's 1) instead of less: exp of
    an argument so low that its result is subnormal or 0 takes several times longer."""
    scores = torch.where(allowed, (q4 * scale) @ k_x.transpose(-2, -1), LOWEST_LOG_SCALE)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(torch.clamp_min(scores - row_max, -EXP_FLOOR)) * allowed
    return weights @ v_x, weights.sum(-1, keepdim=True), row_max
