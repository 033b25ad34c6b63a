"""LSH bucketing attention (Kitaev et al., 2020, Reformer) as the op ``attnrewrite.LSHAttention``.

Each query attends only to keys that hash near it. Per hash round:

1. angular LSH with seeded random rotations R [D, n_buckets/2]: h(x) = argmax([xR, -xR]),
   for the (scaled) queries and the keys with the same R;
2. queries and keys are sorted into ONE sequence by (bucket, position, query before key);
3. the sorted sequence is cut into chunks of 2*chunk items (on average a query and a key per
   position, so ``chunk`` positions); each chunk's queries attend to the keys of the chunk and
   of the previous one (the first chunk has no previous one: nothing is counted twice);
4. outputs are put back in position order, and the rounds are combined weighted by their
   log-sum-exp, i.e. a softmax over all (round, key) pairs the query saw.

Separate queries and keys. Reformer shares Q and K, so one sort places a query next to the keys
that hash with it. A rewritten model has its own W_q and W_k, so queries and keys hash
separately, and sorting them separately would misalign the two orders wherever a bucket holds
more queries than keys (query chunk i would meet the keys of other buckets). Sorting them
together keeps every query next to the keys of its bucket. The hash is scale-invariant, so this
hashes the directions of q and k (the "normalize, then share R" of the paper). Scaling q by the
logits' scale first keeps a negative scale's meaning (it flips the direction q looks for).

Masks. Padded keys are sorted after every bucket (they use no chunk space) and masked. Causal:
a key is visible only at a position <= the query's, by original positions; every query also
sees the key at its own position (a separate slot, taken out of the chunk window so it is
counted once), so no causal row is empty and the first position is exact. A query that sees
no kept key in any round outputs 0. Memory is O(n_hashes * N * chunk) per head.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import onnx
from onnxscript import script

from attnrewrite.site import AttentionSite
from passes import kernels
from passes._options import option
from passes._onnx import ATTNREWRITE, FLOAT, OnnxLowering, standard_opset
from passes._torch import Module, torch

NAME = "lsh"
# Why ``window`` (exact softmax nearby, kernel beyond, one normaliser) is refused.
NO_WINDOW = "it is already a softmax over a few keys per query (its bucket), with no kernel part to mix in"
MASKED_LOGIT = -1e30  # finite: max and exp stay NaN-free when a row has no visible key
TINY = float(np.finfo(np.float32).tiny)  # divisor floor: a row with no visible key gives 0, not 0/0


@dataclasses.dataclass
class Options:
    n_buckets: int = option(32, "hash buckets; 1 puts everything in one bucket", valid="1 or even")
    n_hashes: int = option(4, "hash rounds; more rounds, fewer missed keys", valid=">= 1")
    chunk: int = option(64, "positions per chunk (2 * chunk sorted items)", valid=">= 1")
    dedup: bool = option(
        False,
        "count a key that several rounds show a query once (the paper's eq. 7), so the result is "
        "the softmax over the union of the keys seen; costs n_hashes comparisons per scored pair",
    )
    seed: int = option(0, "numpy default_rng seed the rotations are drawn from")

    def __post_init__(self):
        if self.n_buckets < 1 or (self.n_buckets > 1 and self.n_buckets % 2):
            raise ValueError(f"n_buckets must be 1 or even, got {self.n_buckets}")
        if self.n_hashes < 1 or self.chunk < 1:
            raise ValueError(f"n_hashes and chunk must be >= 1, got {self.n_hashes}, {self.chunk}")


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by bucketed attention"
    if site.head_dim is None:
        return "the head dimension is unknown, and the LSH rotations are drawn for it"
    return None


def rotations(options: Options, head_dim: int) -> np.ndarray:
    """Random rotations [n_hashes, head_dim, max(n_buckets // 2, 1)] float32, fixed by the seed."""
    rng = np.random.default_rng(options.seed)
    shape = (options.n_hashes, head_dim, max(options.n_buckets // 2, 1))
    return rng.standard_normal(shape).astype(np.float32)


# --- torch -----------------------------------------------------------------------------------


def hash_buckets(x, rotations, n_buckets: int):
    """[G, N, D] -> bucket ids [G, n_hashes, N]."""
    if n_buckets == 1:
        return torch.zeros(
            x.shape[0], rotations.shape[0], x.shape[1], dtype=torch.long, device=x.device
        )
    rotated = x.unsqueeze(1) @ rotations  # [G, H, N, B/2]
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)


def sort_order(q_buckets, k_buckets, keep, n_buckets: int):
    """Permutation [G, H, Nq + Nk] sorting queries (items 0..Nq-1) and keys (items Nq..) by
    (bucket, position, query first); padded keys go after every bucket."""
    nq, nk = q_buckets.shape[-1], k_buckets.shape[-1]
    k_buckets = torch.where(keep.squeeze(-1).unsqueeze(1) > 0, k_buckets, n_buckets)
    stride = 2 * max(nq, nk)
    q_key = q_buckets * stride + 2 * torch.arange(nq, device=keep.device)
    k_key = k_buckets * stride + 2 * torch.arange(nk, device=keep.device) + 1
    return torch.cat([q_key, k_key], dim=-1).argsort(dim=-1)


def in_chunks(x, items_per_chunk: int, fill):
    """[G, H, M, ...] -> [G, H, chunks, items_per_chunk, ...], padded at the end with fill."""
    m = x.shape[2]
    chunks = -(-m // items_per_chunk)
    pad_shape = (*x.shape[:2], chunks * items_per_chunk - m, *x.shape[3:])
    x = torch.cat([x, torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)], dim=2)
    return x.reshape(*x.shape[:2], chunks, items_per_chunk, *x.shape[3:])


def with_previous_chunk(x, fill):
    """[G, H, C, L, ...] -> [G, H, C, 2L, ...]: each chunk preceded by the one before it (the
    first by a chunk of fill)."""
    previous = torch.cat([torch.full_like(x[:, :, :1], fill), x[:, :, :-1]], dim=2)
    return torch.cat([previous, x], dim=3)


def rounds_together(query_chunk, key_chunk, rows_pos, cols_pos):
    """How many rounds put each (row query, column key) pair in one window: query_chunk
    [G, Nq, H] and key_chunk [G, Nk, H] are every round's chunk of each position, rows_pos
    [G, H, C, L] and cols_pos [G, H, C, 2L] the positions (-1: none) -> [G, H, C, L, 2L] float."""
    g, h = rows_pos.shape[:2]
    rows = rows_pos.clamp_min(0).reshape(g, -1)
    cols = cols_pos.clamp_min(0).reshape(g, -1)
    count = torch.zeros(*rows_pos.shape, cols_pos.shape[-1], device=rows_pos.device)
    for r in range(h):  # one round at a time: memory stays that of one count
        row_chunk = query_chunk[..., r].gather(1, rows).reshape(rows_pos.shape).unsqueeze(-1)
        col_chunk = key_chunk[..., r].gather(1, cols).reshape(cols_pos.shape).unsqueeze(-2)
        count += (col_chunk == row_chunk) | (col_chunk == row_chunk - 1)
    return count


class SortedChunks(typing.NamedTuple):
    """One round's items per chunk (rows) and its window of own + previous chunk (columns)."""

    rows_x: typing.Any  # [G, H, C, L, D]: scaled q for query items, k for key items
    rows_pos: typing.Any  # [G, H, C, L]: the query's position, -1 for other items
    cols_x: typing.Any  # [G, H, C, 2L, D]
    cols_v: typing.Any  # [G, H, C, 2L, Dv]: v for key items, 0 for others
    cols_pos: typing.Any  # [G, H, C, 2L]: the kept key's position, -1 for other items
    seen: typing.Any  # [G, H, C, L, 2L] or 1: rounds that count the pair once
    own_seen: float  # the same for the own-position key (causal), which every round shows


def sorted_chunks(q, k, v, keep, order, inverse, chunk: int, dedup: bool) -> SortedChunks:
    g, nq = q.shape[:2]
    nk, dv = k.shape[1], v.shape[-1]
    n_hashes = order.shape[1]
    arange_q, arange_k = torch.arange(nq, device=q.device), torch.arange(nk, device=q.device)
    vectors = torch.cat([q, k], dim=1)
    values = torch.cat([v.new_zeros(g, nq, dv), v], dim=1)
    key_pos = torch.cat(
        [arange_q.new_full((g, nq), -1), torch.where(keep[..., 0] > 0, arange_k, -1)], dim=1
    )
    query_pos = torch.cat([arange_q, arange_k.new_full((nk,), -1)]).expand(g, -1)

    def sorted_items(table):  # [G, M, ...] -> [G, H, M, ...] in each round's order
        index = order.reshape(g, n_hashes, -1, *[1] * (table.dim() - 2))
        source = table.unsqueeze(1).expand(g, n_hashes, *table.shape[1:])
        return source.gather(2, index.expand(*index.shape[:3], *table.shape[2:]))

    items = 2 * chunk
    rows_x = in_chunks(sorted_items(vectors), items, 0.0)
    rows_pos = in_chunks(sorted_items(query_pos), items, -1)
    cols_pos = with_previous_chunk(in_chunks(sorted_items(key_pos), items, -1), -1)
    if dedup:
        chunk_of = (inverse // items).transpose(1, 2)  # [G, M, H]: each item's chunk per round
        seen = rounds_together(chunk_of[:, :nq], chunk_of[:, nq:], rows_pos, cols_pos)
    else:
        seen = torch.ones(())
    return SortedChunks(
        rows_x,
        rows_pos,
        with_previous_chunk(rows_x, 0.0),  # keys are read from the same item vectors
        with_previous_chunk(in_chunks(sorted_items(values), items, 0.0), 0.0),
        cols_pos,
        seen,
        float(n_hashes if dedup else 1),
    )


def own_position_slot(chunks: SortedChunks, k, v, keep):
    """(logit, value, visible) of the key at each row's own position, [G, H, C, L, 1 or Dv]."""
    g = chunks.rows_pos.shape[0]
    own = chunks.rows_pos.clamp_min(0)
    index = own.reshape(g, -1, 1)
    self_k = k.gather(1, index.expand(-1, -1, k.shape[-1])).reshape(*own.shape, -1)
    self_v = v.gather(1, index.expand(-1, -1, v.shape[-1])).reshape(*own.shape, -1)
    self_keep = keep.gather(1, index).reshape(*own.shape, 1)
    visible = (chunks.rows_pos.unsqueeze(-1) >= 0) & (self_keep > 0)
    logit = (chunks.rows_x * self_k).sum(-1, keepdim=True) - math.log(chunks.own_seen)
    return logit, self_v, visible


def attend_in_chunks(chunks: SortedChunks, causal: bool, own_slot=None):
    """Each row's softmax over its window (and own slot) -> (out [G, H, C, L, Dv], log-sum-exp)."""
    cols_pos = chunks.cols_pos.unsqueeze(-2)  # [G, H, C, 1, 2L]
    visible = cols_pos >= 0
    if causal:  # earlier positions only: the own one comes through own_slot
        visible = visible & (cols_pos < chunks.rows_pos.unsqueeze(-1))
    # dedup: a key seen in several rounds counts once overall, each round's logit loses log(rounds).
    logits = chunks.rows_x @ chunks.cols_x.transpose(-2, -1) - torch.log(chunks.seen.clamp_min(1))
    logits = torch.where(visible, logits, MASKED_LOGIT)
    row_max = logits.amax(dim=-1, keepdim=True)
    if own_slot is not None:
        own_logit, own_v, own_visible = own_slot
        own_logit = torch.where(own_visible, own_logit, MASKED_LOGIT)
        row_max = torch.maximum(row_max, own_logit)
    weights = torch.exp(logits - row_max) * visible
    numerator, total = weights @ chunks.cols_v, weights.sum(-1, keepdim=True)
    if own_slot is not None:
        own_weight = torch.exp(own_logit - row_max) * own_visible
        numerator, total = numerator + own_weight * own_v, total + own_weight
    out = numerator / total.clamp_min(TINY)
    return out, torch.where(total > 0, row_max + torch.log(total), MASKED_LOGIT)


def combine_rounds(out, lse, query_rank):
    """Rows in sorted order -> per query [G, Nq, Dv], the rounds weighted by their log-sum-exp
    (a softmax over every (round, key) pair the query saw). query_rank [G, H, Nq]."""
    g, h = query_rank.shape[:2]
    index = query_rank.unsqueeze(-1)
    out = out.reshape(g, h, -1, out.shape[-1]).gather(2, index.expand(-1, -1, -1, out.shape[-1]))
    lse = lse.reshape(g, h, -1, 1).gather(2, index)
    return (torch.softmax(lse, dim=1) * out).sum(dim=1)


def lsh_attention(q, k, v, keep, rotations, scale: float, options: Options, causal: bool):
    """q [G, Nq, D], k [G, Nk, D], v [G, Nk, Dv], keep [G, Nk, 1] float 1/0 -> [G, Nq, Dv]."""
    q = q * scale  # hashing scaled q keeps a negative scale's meaning
    n_buckets = options.n_buckets
    q_buckets, k_buckets = (
        hash_buckets(q, rotations, n_buckets),
        hash_buckets(k, rotations, n_buckets),
    )
    order = sort_order(q_buckets, k_buckets, keep, n_buckets)
    inverse = order.argsort(dim=-1)  # each item's rank in each round
    chunks = sorted_chunks(q, k, v, keep, order, inverse, options.chunk, options.dedup)
    own_slot = own_position_slot(chunks, k, v, keep) if causal else None
    out, lse = attend_in_chunks(chunks, causal, own_slot)
    return combine_rounds(out, lse, inverse[..., : q.shape[1]])


class LSHAttention(Module):
    def __init__(self, scale: float, causal: bool, head_dim: int, options: Options):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.options = options
        self.register_buffer("rotations", torch.from_numpy(rotations(options, head_dim)))

    def forward(self, q, k, v, key_keep=None):
        keep = torch.ones((), device=k.device) if key_keep is None else key_keep.float()
        keep = keep.expand(*k.shape[:-1], 1).reshape(-1, k.shape[-2], 1)
        flat = [x.float().reshape(-1, *x.shape[-2:]) for x in (q, k, v)]
        out = lsh_attention(*flat, keep, self.rotations, self.scale, self.options, self.causal)
        return out.reshape(*q.shape[:-1], v.shape[-1]).to(v.dtype)

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"scale={self.scale}, causal={self.causal}, n_buckets={o.n_buckets}, "
            f"n_hashes={o.n_hashes}, chunk={o.chunk}, dedup={o.dedup}"
        )


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> LSHAttention:
    if learnable:
        raise ValueError(nothing_to_fit(options))
    return LSHAttention(site.scale, site.mask.causal, site.head_dim, options)


def nothing_to_fit(options: Options) -> str | None:
    return "lsh has nothing to fit (its buckets come from random rotations and a sort)"


# --- ONNX ------------------------------------------------------------------------------------
# The numbers (scale, chunk, the rotations) are inputs, so one body serves every site; causal
# is a separate entry function. Items are kept rank 4, [G, H, M, F] (F = 1 for positions).

_ZERO_INT64 = onnx.numpy_helper.from_array(np.array([0], dtype=np.int64))
_FALSE = onnx.numpy_helper.from_array(np.array(False))


def _gather_function(op):
    @script(ATTNREWRITE, default_opset=op)
    def GatherItems(table, index):
        """table [B, M, F], index [B, ..., L] (into M) -> [B, ..., L, F]."""
        b = op.Shape(table, start=0, end=1)
        m = op.Shape(table, start=1, end=2)
        minus_one = op.Constant(value_ints=[-1])
        base = op.Unsqueeze(
            op.Range(op.Constant(value_int=0), op.Squeeze(b * m), op.Squeeze(m)), minus_one
        )
        flat_index = op.Reshape(index, op.Concat(b, minus_one, axis=0)) + base  # rows of [B * M, F]
        rows = op.Gather(
            op.Reshape(table, op.Concat(minus_one, op.Shape(table, start=2), axis=0)),
            flat_index,
            axis=0,
        )
        return op.Reshape(rows, op.Concat(op.Shape(index), op.Shape(table, start=2), axis=0))

    return GatherItems


def _hash_function(op, n_buckets: int):
    if n_buckets == 1:

        @script(ATTNREWRITE, default_opset=op)
        def SingleBucket(x, rotations):
            """[G, N, D] -> zeros [G, H, N] int64: one bucket, every round."""
            shape = op.Concat(
                op.Shape(x, start=0, end=1),
                op.Shape(rotations, start=0, end=1),
                op.Shape(x, start=1, end=2),
                axis=0,
            )
            return op.ConstantOfShape(shape, value=_ZERO_INT64)

        return SingleBucket

    @script(ATTNREWRITE, default_opset=op)
    def AngularBuckets(x, rotations):
        """[G, N, D] -> argmax([xR, -xR]) [G, H, N] int64, one R [D, B/2] per round."""
        rotated = op.MatMul(op.Unsqueeze(x, op.Constant(value_ints=[1])), rotations)
        return op.ArgMax(op.Concat(rotated, op.Neg(rotated), axis=-1), axis=-1, keepdims=0)

    return AngularBuckets


def _item_functions(op):
    @script(ATTNREWRITE, default_opset=op)
    def SortOrder(q_buckets, k_buckets, keep, padded_bucket):
        """[G, H, Nq], [G, H, Nk] buckets, keep [G, Nk, 1] -> permutation [G, H, Nq + Nk] by
        (bucket, position, query first); padded keys go after every bucket."""
        nq = op.Shape(q_buckets, start=2, end=3)
        nk = op.Shape(k_buckets, start=2, end=3)
        zero, one, two = (
            op.Constant(value_int=0),
            op.Constant(value_int=1),
            op.Constant(value_int=2),
        )
        kept = op.Unsqueeze(
            op.Squeeze(keep, op.Constant(value_ints=[2])), op.Constant(value_ints=[1])
        )
        k_buckets = op.Where(kept > op.Constant(value_float=0.0), k_buckets, padded_bucket)
        stride = op.Max(nq, nk) * two
        q_key = q_buckets * stride + op.Range(zero, op.Squeeze(nq), one) * two
        k_key = k_buckets * stride + op.Range(zero, op.Squeeze(nk), one) * two + one
        _, order = op.TopK(op.Concat(q_key, k_key, axis=2), nq + nk, axis=-1, largest=0, sorted=1)
        return order

    @script(ATTNREWRITE, default_opset=op)
    def InChunks(x, items, fill):
        """[G, H, M, F] -> [G, H, C, items, F], padded at the end with fill."""
        m = op.Shape(x, start=2, end=3)
        chunks = op.Div(m + items - op.Constant(value_ints=[1]), items)
        zero = op.Constant(value_ints=[0])
        pads = op.Concat(zero, zero, zero, zero, zero, zero, chunks * items - m, zero, axis=0)
        padded = op.Pad(x, pads, op.CastLike(fill, x))
        return op.Reshape(
            padded,
            op.Concat(op.Shape(x, start=0, end=2), chunks, items, op.Shape(x, start=3), axis=0),
        )

    @script(ATTNREWRITE, default_opset=op)
    def WithPreviousChunk(x, fill):
        """[G, H, C, L, F] -> [G, H, C, 2L, F]: each chunk preceded by the one before it (the
        first by a chunk of fill)."""
        shift = op.Constant(value_ints=[0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
        previous = op.Pad(x, shift, op.CastLike(fill, x))
        previous = op.Slice(
            previous,
            op.Constant(value_ints=[0]),
            op.Shape(x, start=2, end=3),
            op.Constant(value_ints=[2]),
        )
        return op.Concat(previous, x, axis=3)

    return SortOrder, InChunks, WithPreviousChunk


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: values for the constants by name (lsh has nothing to fit; accepted for a
    uniform interface)."""
    return _lowering(site, options, opset_version).with_weights(weights)


def _lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    op = standard_opset(opset_version)
    flatten = kernels.flatten_heads_function(opset_version)
    key_keep_3d = kernels.key_keep_function(opset_version)
    gather_items = _gather_function(op)
    hash_buckets = _hash_function(op, options.n_buckets)
    sort_items, in_chunks, with_previous = items_fns = _item_functions(op)

    @script(ATTNREWRITE, default_opset=op)
    def RoundsTogether(query_chunk, key_chunk, rows_pos, cols_pos):
        """How many rounds put each (row query, column key) pair in one window: query_chunk
        [G, Nq, H], key_chunk [G, Nk, H] (each position's chunk per round), rows_pos
        [G, H, C, L, 1], cols_pos [G, H, C, 2L, 1] (-1: none) -> ([G, H, C, L, 2L] float, and
        for the own-position key, which every round shows: H)."""
        zero = op.Constant(value_int=0)
        per_batch = op.Concat(
            op.Shape(rows_pos, start=0, end=1), op.Constant(value_ints=[-1]), axis=0
        )
        rows = op.Reshape(op.Max(rows_pos, zero), per_batch)
        cols = op.Reshape(op.Max(cols_pos, zero), per_batch)
        col_shape = op.Concat(
            op.Shape(cols_pos, start=0, end=3),
            op.Constant(value_ints=[1]),
            op.Shape(cols_pos, start=3, end=4),
            axis=0,
        )
        rounds = op.Shape(query_chunk, start=2, end=3)
        count = op.ConstantOfShape(
            op.Concat(
                op.Shape(rows_pos, start=0, end=4), op.Shape(cols_pos, start=3, end=4), axis=0
            )
        )
        for r in range(op.Squeeze(rounds)):  # one round at a time: memory of one count
            row_chunk = op.GatherElements(op.Gather(query_chunk, r, axis=2), rows, axis=1)
            row_chunk = op.Reshape(row_chunk, op.Shape(rows_pos))
            col_chunk = op.GatherElements(op.Gather(key_chunk, r, axis=2), cols, axis=1)
            col_chunk = op.Reshape(col_chunk, col_shape)
            previous = op.Equal(col_chunk, row_chunk - op.Constant(value_int=1))
            count = count + op.Cast(op.Or(op.Equal(col_chunk, row_chunk), previous), to=FLOAT)
        return count, op.Cast(rounds, to=FLOAT)

    @script(ATTNREWRITE, default_opset=op)
    def EachRoundApart(query_chunk, key_chunk, rows_pos, cols_pos):
        """No dedup: every round counts its keys, so each pair's and own key's count is 1."""
        return op.Constant(value_float=1.0), op.Constant(value_float=1.0)

    count_rounds = RoundsTogether if options.dedup else EachRoundApart

    @script(ATTNREWRITE, default_opset=op)
    def SortedChunks(q3, k3, v3, keep, rotations, chunk):
        """Sort, chunk and window the items of every round; see the module docstring."""
        g = op.Shape(q3, start=0, end=1)
        nq = op.Shape(q3, start=1, end=2)
        nk = op.Shape(k3, start=1, end=2)
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        none = op.Constant(value_int=-1)
        items = chunk * op.Constant(value_ints=[2])
        padded_bucket = op.Shape(rotations, start=2, end=3) * op.Constant(value_ints=[2])
        order = sort_items(
            hash_buckets(q3, rotations), hash_buckets(k3, rotations), keep, padded_bucket
        )
        m = nq + nk
        ranks = op.Expand(op.Range(zero, op.Squeeze(m), one), op.Shape(order))
        inverse = op.ScatterElements(
            op.ConstantOfShape(op.Shape(order), value=_ZERO_INT64), order, ranks, axis=2
        )
        chunk_of = op.Transpose(inverse / items, perm=[0, 2, 1])  # [G, M, H]
        axis1 = op.Constant(value_ints=[1])
        query_chunk = op.Slice(chunk_of, op.Constant(value_ints=[0]), nq, axis1)
        key_chunk = op.Slice(chunk_of, nq, m, axis1)

        # Per item: vector (q for queries, k for keys), value, key position (-1: not a visible
        # key) and query position (-1: not a query); the last two as [G, M, 1].
        vectors = op.Concat(q3, k3, axis=1)
        no_values = op.ConstantOfShape(op.Concat(g, nq, op.Shape(v3, start=2), axis=0))
        values = op.Concat(no_values, v3, axis=1)
        kept = op.Squeeze(keep, op.Constant(value_ints=[2])) > op.Constant(value_float=0.0)
        key_pos = op.Where(kept, op.Range(zero, op.Squeeze(nk), one), none)
        key_pos = op.Concat(op.Expand(none, op.Concat(g, nq, axis=0)), key_pos, axis=1)
        query_pos = op.Concat(op.Range(zero, op.Squeeze(nq), one), op.Expand(none, nk), axis=0)
        query_pos = op.Expand(query_pos, op.Concat(g, m, axis=0))
        last = op.Constant(value_ints=[-1])
        no_float, no_pos = op.Constant(value_float=0.0), op.Constant(value_float=-1.0)

        rows_x = in_chunks(gather_items(vectors, order), items, no_float)
        rows_pos = in_chunks(gather_items(op.Unsqueeze(query_pos, last), order), items, no_pos)
        cols_x = with_previous(rows_x, no_float)  # keys are read from the same item vectors
        cols_v = with_previous(in_chunks(gather_items(values, order), items, no_float), no_float)
        cols_pos = with_previous(
            in_chunks(gather_items(op.Unsqueeze(key_pos, last), order), items, no_pos), no_pos
        )
        seen, own_seen = count_rounds(query_chunk, key_chunk, rows_pos, cols_pos)
        return inverse, rows_x, rows_pos, cols_x, cols_v, cols_pos, seen, own_seen

    @script(ATTNREWRITE, default_opset=op)
    def CombineRounds(out, lse, inverse, q, v):
        """Sorted rows [G, H, C, L, Dv] and their log-sum-exp [G, H, C, L, 1] -> q's layout."""
        gh = op.Shape(inverse, start=0, end=2)
        nq = op.Shape(q, start=-2, end=-1)
        dv = op.Shape(v, start=-1)
        one, minus_one = op.Constant(value_ints=[1]), op.Constant(value_ints=[-1])
        rows = op.ReduceProd(gh, keepdims=1)
        index = op.Reshape(
            op.Slice(inverse, op.Constant(value_ints=[0]), nq, op.Constant(value_ints=[2])),
            op.Concat(rows, one, nq, axis=0),
        )
        out = gather_items(op.Reshape(out, op.Concat(rows, minus_one, dv, axis=0)), index)
        lse = gather_items(op.Reshape(lse, op.Concat(rows, minus_one, one, axis=0)), index)
        out = op.Reshape(out, op.Concat(gh, nq, dv, axis=0))
        lse = op.Reshape(lse, op.Concat(gh, nq, one, axis=0))
        combined = op.ReduceSum(op.Softmax(lse, axis=1) * out, one, keepdims=0)
        return op.CastLike(op.Reshape(combined, op.Concat(op.Shape(q, end=-1), dv, axis=0)), v)

    @script(ATTNREWRITE, default_opset=op)
    def AttendInChunks(rows_x, cols_x, cols_v, visible, seen, own_logit, own_v, own_visible):
        """Each row's softmax over its window [G, H, C, L, 2L] plus its own-position slot
        [G, H, C, L, 1] -> (out [G, H, C, L, Dv], log-sum-exp [G, H, C, L, 1])."""
        masked = op.Constant(value_float=MASKED_LOGIT)
        last = op.Constant(value_ints=[-1])
        # dedup: a key seen in several rounds counts once overall, each round's logit loses
        # log(rounds); without, seen is 1.
        logits = op.MatMul(rows_x, op.Transpose(cols_x, perm=[0, 1, 2, 4, 3]))
        logits = op.Where(
            visible, logits - op.Log(op.Max(seen, op.Constant(value_float=1.0))), masked
        )
        own_logit = op.Where(own_visible, own_logit, masked)
        row_max = op.Max(op.ReduceMax(logits, last, keepdims=1), own_logit)
        weights = op.Exp(logits - row_max) * op.Cast(visible, to=FLOAT)
        own_weight = op.Exp(own_logit - row_max) * op.Cast(own_visible, to=FLOAT)
        total = op.ReduceSum(weights, last, keepdims=1) + own_weight
        out = (op.MatMul(weights, cols_v) + own_weight * own_v) / op.Max(
            total, op.Constant(value_float=TINY)
        )
        lse = op.Where(total > op.Constant(value_float=0.0), row_max + op.Log(total), masked)
        return out, lse

    @script(ATTNREWRITE, default_opset=op)
    def LSHAttention(q, k, v, key_keep, scale, rotations, chunk):
        inverse, rows_x, rows_pos, cols_x, cols_v, cols_pos, seen, own_seen = SortedChunks(
            flatten(q) * scale, flatten(k), flatten(v), key_keep_3d(key_keep, k), rotations, chunk
        )
        visible = op.Transpose(cols_pos, perm=[0, 1, 2, 4, 3]) >= op.Constant(value_int=0)
        nothing = op.Constant(value_float=0.0)  # no own-position slot
        out, lse = AttendInChunks(
            rows_x, cols_x, cols_v, visible, seen, nothing, nothing, op.Constant(value=_FALSE)
        )
        return CombineRounds(out, lse, inverse, q, v)

    @script(ATTNREWRITE, default_opset=op)
    def CausalLSHAttention(q, k, v, key_keep, scale, rotations, chunk):
        k3 = flatten(k)
        v3 = flatten(v)
        keep = key_keep_3d(key_keep, k)
        inverse, rows_x, rows_pos, cols_x, cols_v, cols_pos, seen, own_seen = SortedChunks(
            flatten(q) * scale, k3, v3, keep, rotations, chunk
        )
        zero = op.Constant(value_int=0)
        cols_pos = op.Transpose(cols_pos, perm=[0, 1, 2, 4, 3])
        visible = op.And(cols_pos >= zero, cols_pos < rows_pos)  # earlier positions; own: below

        # The key at the row's own position, which every round shows.
        last = op.Constant(value_ints=[-1])
        own = op.Reshape(
            op.Max(rows_pos, zero),
            op.Concat(
                op.Shape(rows_pos, start=0, end=1), op.Constant(value_ints=[1]), last, axis=0
            ),
        )
        row_shape = op.Concat(op.Shape(rows_pos, start=0, end=4), last, axis=0)
        own_k = op.Reshape(gather_items(k3, own), row_shape)
        own_v = op.Reshape(gather_items(v3, own), row_shape)
        own_keep = op.Reshape(gather_items(keep, own), row_shape)
        own_visible = op.And(rows_pos >= zero, own_keep > op.Constant(value_float=0.0))
        own_logit = op.ReduceSum(rows_x * own_k, last, keepdims=1) - op.Log(own_seen)
        out, lse = AttendInChunks(
            rows_x, cols_x, cols_v, visible, seen, own_logit, own_v, own_visible
        )
        return CombineRounds(out, lse, inverse, q, v)

    entry = CausalLSHAttention if site.mask.causal else LSHAttention
    functions = [
        f.to_function_proto()
        for f in (
            flatten,
            key_keep_3d,
            gather_items,
            hash_buckets,
            *items_fns,
            count_rounds,
            SortedChunks,
            AttendInChunks,
            CombineRounds,
            entry,
        )
    ]
    constants = {
        "scale": np.array(site.scale, dtype=np.float32),
        "rotations": rotations(options, site.head_dim),
        "chunk": np.array([options.chunk], dtype=np.int64),
    }
    return OnnxLowering(functions, constants)
