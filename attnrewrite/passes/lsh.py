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
no kept key in any round outputs 0. Memory is O(n_hashes * N * chunk) per head in torch; the
ONNX body runs the rounds one after another in a Loop, O(N * chunk) per head (see the ONNX
section).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import numpy as np
import onnx
from onnx import helper
from onnxscript import script

from attnrewrite.passes import hooks
from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.layout import flatten_heads_function, key_keep_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    DOMAIN,
    FLOAT,
    OnnxLowering,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import ONE_OR_EVEN, AtLeast, MethodOptions, option
from attnrewrite.site import AttentionSite

NAME = "lsh"
# Why ``window`` (exact softmax nearby, kernel beyond, one normaliser) is refused.
NO_WINDOW = "it is already a softmax over a few keys per query (its bucket), with no kernel part to mix in"
NO_RECURRENCE = (
    "LSH attends exactly among the keys that share a query's hash bucket, and any past key "
    "may share a future query's: it must keep every key, a cache that grows with the context"
)
MASKED_LOGIT = -1e30  # finite: max and exp stay NaN-free when a row has no visible key
TINY = float(np.finfo(np.float32).tiny)  # divisor floor: a row with no visible key gives 0, not 0/0


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    n_buckets: int = option(32, "hash buckets; 1 puts everything in one bucket", valid=ONE_OR_EVEN)
    n_hashes: int = option(4, "hash rounds; more rounds, fewer missed keys", valid=AtLeast(1))
    chunk: int = option(64, "positions per chunk (2 * chunk sorted items)", valid=AtLeast(1))
    dedup: bool = option(
        False,
        "count a key that several rounds show a query once (the paper's eq. 7), so the result is "
        "the softmax over the union of the keys seen; costs n_hashes comparisons per scored pair",
    )
    seed: int = option(0, "numpy default_rng seed the rotations are drawn from", valid=AtLeast(0))


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed by bucketed attention"
    if site.head_dim is None:
        return "the head dimension is unknown, and the LSH rotations are drawn for it"
    return None


attention_weights_unavailable = hooks.no_attention_weights(NAME)


def exact_part(options: Options, causal: bool = False) -> ExactPart | None:
    """Up to ``chunk`` positions every round's sorted items fit in one chunk: softmax attention
    itself. A query sees its chunk and the previous one, about 2 * chunk keys per round."""
    return ExactPart(options.chunk, 2 * options.chunk, f"chunk={options.chunk}")


def rotations(options: Options, head_dim: int) -> np.ndarray:
    """Random rotations [n_hashes, head_dim, max(n_buckets // 2, 1)] float32, fixed by the seed."""
    rng = np.random.default_rng(options.seed)
    shape = (options.n_hashes, head_dim, max(options.n_buckets // 2, 1))
    return rng.standard_normal(shape).astype(np.float32)


# --- torch -----------------------------------------------------------------------------------


def hash_buckets(x, rotations, n_buckets: int):
    """[G, N, D] -> bucket ids [G, n_hashes, N]."""
    if n_buckets == 1:
        return torch.zeros(x.shape[0], rotations.shape[0], x.shape[1], dtype=torch.long, device=x.device)
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
    key_pos = torch.cat([arange_q.new_full((g, nq), -1), torch.where(keep[..., 0] > 0, arange_k, -1)], dim=1)
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
# The numbers (scale, 2 * chunk, the rotations) are inputs, so one body serves every site; causal
# is a separate entry function. Items are kept rank 4, [G, H, M, F] (F = 1 for positions), one
# round (H = 1) at a time from the sort on.
#
# Written for onnxruntime's CUDA provider as well as its CPU one (issue 12's profile):
# - no op without a CUDA kernel for its type: buckets by TopK(k = 1), not ArgMax (CUDA has it
#   for old opsets only); chunks padded by Concat with an Expand block, not Pad (no int64 CUDA
#   kernel, and the positions are int64);
# - positions and ranks come from CumSum over data-shaped ones and gathers use GatherND's
#   batch_dims, not Range over shape scalars, which onnxruntime keeps with the shape
#   arithmetic on the CPU (a copy to the device per use); the sort's stride comes from the
#   positions' maximum for the same reason; and the
#   chunk length arrives as the initializer ``items`` (2 * chunk), not computed from ``chunk``,
#   so the chunk counts stay CPU shape arithmetic instead of a device tensor copied back;
# - the rounds run one at a time in a Loop, so no intermediate holds more than one round's
#   window logits [G, 1, C, 2 * chunk, 4 * chunk]: at [1, 12, 131072, 64] that is 8e8 elements
#   where all 4 rounds together were 3.2e9, past cuDNN's int32 sizes (and unrolled calls ran
#   side by side: see _entry);
# - every index a round gathers with is a rank of the sort, in range by construction: the causal
#   round's own-position key comes as item tables sorted like the rows (CausalItems), not as a
#   gather of k, v and keep by each row's position clamped from -1 (issue 33: the causal graph
#   computed another answer on CUDA than on CPU, the non-causal one did not);
# - hidden keys are masked by an additive bias built at the window's size (see
#   AttendInChunks), not a Where over the full logits and a mask product over the weights.

_ONE_INT64 = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64))
_ZERO_INT64 = onnx.numpy_helper.from_array(np.array([0], dtype=np.int64))


@built_once
def _gather_function(op):
    @script(ATTNREWRITE, default_opset=op)
    def GatherItems(table, index):
        """table [B, M, F], index [B, ..., L] (into M) -> [B, ..., L, F]."""
        minus_one = op.Constant(value_ints=[-1])
        per_batch = op.Concat(op.Shape(table, start=0, end=1), minus_one, axis=0)
        flat_index = op.Unsqueeze(op.Reshape(index, per_batch), minus_one)  # [B, K, 1]
        rows = op.GatherND(table, flat_index, batch_dims=1)
        return op.Reshape(rows, op.Concat(op.Shape(index), op.Shape(table, start=2), axis=0))

    return GatherItems


@built_once
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
        """[G, N, D] -> argmax([xR, -xR]) [G, H, N] int64, one R [D, B/2] per round. TopK
        keeps the lower index of a tie, as argmax does."""
        rotated = op.MatMul(op.Unsqueeze(x, op.Constant(value_ints=[1])), rotations)
        both = op.Concat(rotated, op.Neg(rotated), axis=-1)
        _, top = op.TopK(both, op.Constant(value_ints=[1]), axis=-1, largest=1, sorted=1)
        return op.Squeeze(top, op.Constant(value_ints=[-1]))

    return AngularBuckets


@built_once
def _sort_functions(op, n_buckets: int):
    """(Positions, SortOrder): positions along an axis, and every round's order of the items."""

    @script(ATTNREWRITE, default_opset=op)
    def Positions(x, axis):
        """0, 1, 2, ... along axis of an int64 tensor shaped as x: a CumSum on the device."""
        return op.CumSum(op.ConstantOfShape(op.Shape(x), value=_ONE_INT64), axis) - op.Constant(value_int=1)

    @script(ATTNREWRITE, default_opset=op)
    def SortOrder(q_buckets, k_buckets, q_pos, k_pos, keep):
        """[G, H, Nq], [G, H, Nk] buckets, positions [G, 1, N], keep [G, Nk, 1] -> permutation
        [G, H, Nq + Nk] by (bucket, position, query first); padded keys go after every bucket."""
        two = op.Constant(value_int=2)
        kept = op.Transpose(keep, perm=[0, 2, 1]) > op.Constant(value_float=0.0)
        k_buckets = op.Where(kept, k_buckets, op.Constant(value_int=n_buckets))
        # Keys 2 * position (+ 1 for keys) are below stride; from the positions' data, not shapes.
        stride = two * op.Max(op.ReduceMax(q_pos), op.ReduceMax(k_pos)) + two
        q_key = q_buckets * stride + q_pos * two
        k_key = k_buckets * stride + k_pos * two + op.Constant(value_int=1)
        m = op.Shape(q_buckets, start=2, end=3) + op.Shape(k_buckets, start=2, end=3)
        _, order = op.TopK(op.Concat(q_key, k_key, axis=2), m, axis=-1, largest=0, sorted=1)
        return order

    return Positions, SortOrder


@built_once
def _chunk_functions(op):
    """(InChunks, WithPreviousChunk): sorted items cut into chunks, and each chunk's window."""

    @script(ATTNREWRITE, default_opset=op)
    def InChunks(x, items, fill):
        """[G, H, M, F] -> [G, H, C, items, F], padded at the end with fill."""
        m = op.Shape(x, start=2, end=3)
        chunks = op.Div(m + items - op.Constant(value_ints=[1]), items)
        lead, features = op.Shape(x, start=0, end=2), op.Shape(x, start=3)
        pad = op.Expand(op.CastLike(fill, x), op.Concat(lead, chunks * items - m, features, axis=0))
        return op.Reshape(op.Concat(x, pad, axis=2), op.Concat(lead, chunks, items, features, axis=0))

    @script(ATTNREWRITE, default_opset=op)
    def WithPreviousChunk(x, fill):
        """[G, H, C, L, F] -> [G, H, C, 2L, F]: each chunk preceded by the one before it (the
        first by a chunk of fill)."""
        axis2 = op.Constant(value_ints=[2])
        one_chunk = op.Concat(op.Shape(x, start=0, end=2), op.Constant(value_ints=[1]), op.Shape(x, start=3), axis=0)
        first = op.Expand(op.CastLike(fill, x), one_chunk)
        earlier = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), axis2)
        return op.Concat(op.Concat(first, earlier, axis=2), x, axis=3)

    return InChunks, WithPreviousChunk


@built_once
def _item_order_functions(op, n_buckets: int):
    """(ItemOrder, ItemPositions): every round's sort of the items, and their positions."""
    hash_buckets = _hash_function(op, n_buckets)
    positions, sort_items = _sort_functions(op, n_buckets)

    @script(ATTNREWRITE, default_opset=op)
    def ItemOrder(q3, k3, keep, rotations, items):
        """Every round's sort of the items, each item's rank in it and its chunk, and the
        queries' and keys' positions [G, N, 1]."""
        one = op.Constant(value_int=1)
        first = op.Slice(q3, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
        q_pos = positions(first, one)  # [G, Nq, 1]
        k_pos = positions(keep, one)  # [G, Nk, 1]
        order = sort_items(
            hash_buckets(q3, rotations),
            hash_buckets(k3, rotations),
            op.Transpose(q_pos, perm=[0, 2, 1]),
            op.Transpose(k_pos, perm=[0, 2, 1]),
            keep,
        )
        # Each item's rank per round; order is a permutation, so every slot of its copy is written.
        ranks = positions(order, op.Constant(value_int=2))
        inverse = op.ScatterElements(order, order, ranks, axis=2)
        chunk_of = op.Transpose(inverse / items, perm=[0, 2, 1])
        return order, inverse, chunk_of, q_pos, k_pos

    @script(ATTNREWRITE, default_opset=op)
    def ItemPositions(q_pos, k_pos, keep):
        """query_pos and key_pos [G, M, 1]: the query's position for query items and the kept
        key's for key items, -1 elsewhere."""
        none = op.Constant(value_int=-1)
        kept_pos = op.Where(keep > op.Constant(value_float=0.0), k_pos, none)
        query_pos = op.Concat(q_pos, op.Expand(none, op.Shape(k_pos)), axis=1)
        key_pos = op.Concat(op.Expand(none, op.Shape(q_pos)), kept_pos, axis=1)
        return query_pos, key_pos

    return ItemOrder, ItemPositions


@built_once
def _items_function(opset_version: int, n_buckets: int, causal: bool):
    """Items(q, k, v, key_keep, scale, rotations, items), or CausalItems: the hashes and sorts
    of every round, and the per-item tables a round gathers from."""
    op = standard_opset(opset_version)
    flatten = flatten_heads_function(opset_version)
    key_keep_3d = key_keep_function(opset_version)
    item_order, item_positions = _item_order_functions(op, n_buckets)

    @script(ATTNREWRITE, default_opset=op)
    def Items(q, k, v, key_keep, scale, rotations, items):
        """The sorts and the tables: vectors (q for queries, k for keys), values (0 for
        queries), query and key positions."""
        q3, k3, v3, keep = flatten(q) * scale, flatten(k), flatten(v), key_keep_3d(key_keep, k)
        nq = op.Shape(q3, start=1, end=2)
        order, inverse, chunk_of, q_pos, k_pos = item_order(q3, k3, keep, rotations, items)
        query_pos, key_pos = item_positions(q_pos, k_pos, keep)
        no_values = op.Concat(op.Shape(q3, end=2), op.Shape(v3, start=2), axis=0)
        values = op.Concat(op.Expand(op.Constant(value_float=0.0), no_values), v3, axis=1)
        return order, inverse, chunk_of, op.Concat(q3, k3, axis=1), values, query_pos, key_pos, nq

    @script(ATTNREWRITE, default_opset=op)
    def CausalItems(q, k, v, key_keep, scale, rotations, items):
        """Items for a causal site, whose query items also carry the key at their own position
        (which every round shows): its value in ``values`` and its logit in ``own_logit``
        [G, M, 1] (MASKED_LOGIT for key items and padded own keys). Computed once here rather than
        gathered by position in every round: a round reads them with the sort's own gather."""
        q3, k3, v3, keep = flatten(q) * scale, flatten(k), flatten(v), key_keep_3d(key_keep, k)
        nq = op.Shape(q3, start=1, end=2)
        order, inverse, chunk_of, q_pos, k_pos = item_order(q3, k3, keep, rotations, items)
        query_pos, key_pos = item_positions(q_pos, k_pos, keep)
        zero, axis1 = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
        own_k, own_v = op.Slice(k3, zero, nq, axis1), op.Slice(v3, zero, nq, axis1)
        own_kept = op.Slice(keep, zero, nq, axis1) > op.Constant(value_float=0.0)
        masked = op.Constant(value_float=MASKED_LOGIT)
        own_logit = op.Where(own_kept, op.ReduceSum(q3 * own_k, op.Constant(value_ints=[-1]), keepdims=1), masked)
        own_logit = op.Concat(own_logit, op.Expand(masked, op.Shape(keep)), axis=1)  # key items: masked
        values = op.Concat(own_v, v3, axis=1)
        return order, inverse, chunk_of, op.Concat(q3, k3, axis=1), values, query_pos, key_pos, nq, own_logit

    return CausalItems if causal else Items


@built_once
def _rounds_seen_function(op, dedup: bool):
    """RoundsTogether, or without ``dedup`` EachRoundApart: the logit bias that makes a key
    several rounds show a query count once (or count every time)."""

    @script(ATTNREWRITE, default_opset=op)
    def RoundsTogether(query_chunk, key_chunk, rows_pos, cols_pos):
        """-log(rounds that put each (row query, column key) pair in one window), so a key
        seen in several rounds counts once overall: query_chunk [G, Nq, H], key_chunk
        [G, Nk, H] (each position's chunk per round), rows_pos [G, 1, C, L, 1], cols_pos
        [G, 1, C, 1, 2L] (-1: none) -> ([G, 1, C, L, 2L], and for the own-position key, which
        every round shows, -log(H))."""
        zero = op.Constant(value_int=0)
        per_batch = op.Concat(op.Shape(rows_pos, start=0, end=1), op.Constant(value_ints=[-1]), axis=0)
        rows = op.Reshape(op.Max(rows_pos, zero), per_batch)
        cols = op.Reshape(op.Max(cols_pos, zero), per_batch)
        rounds = op.Shape(query_chunk, start=2, end=3)
        count = op.ConstantOfShape(
            op.Concat(op.Shape(rows_pos, start=0, end=4), op.Shape(cols_pos, start=4, end=5), axis=0)
        )
        for r in range(op.Squeeze(rounds)):  # one round at a time: memory of one count
            row_chunk = op.GatherElements(op.Gather(query_chunk, r, axis=2), rows, axis=1)
            row_chunk = op.Reshape(row_chunk, op.Shape(rows_pos))
            col_chunk = op.GatherElements(op.Gather(key_chunk, r, axis=2), cols, axis=1)
            col_chunk = op.Reshape(col_chunk, op.Shape(cols_pos))
            previous = op.Equal(col_chunk, row_chunk - op.Constant(value_int=1))
            count = count + op.Cast(op.Or(op.Equal(col_chunk, row_chunk), previous), to=FLOAT)
        one = op.Constant(value_float=1.0)
        return op.Neg(op.Log(op.Max(count, one))), op.Neg(op.Log(op.Cast(rounds, to=FLOAT)))

    @script(ATTNREWRITE, default_opset=op)
    def EachRoundApart(query_chunk, key_chunk, rows_pos, cols_pos):
        """No dedup: every round counts its keys, so no logit loses anything."""
        return op.Constant(value_float=0.0), op.Constant(value_float=0.0)

    return RoundsTogether if dedup else EachRoundApart


@built_once
def _sorted_chunks_function(op, gather_items, count_rounds):
    """SortedChunks: one round's items sorted, chunked and windowed, with the rounds-seen bias."""
    in_chunks, with_previous = _chunk_functions(op)

    @script(ATTNREWRITE, default_opset=op)
    def SortedChunks(order, chunk_of, vectors, values, query_pos, key_pos, nq, items):
        """One round's items (order [G, 1, M]) sorted, chunked and windowed; see the module
        docstring. rows_v is each row item's own entry of ``values``."""
        axis1 = op.Constant(value_ints=[1])
        query_chunk = op.Slice(chunk_of, op.Constant(value_ints=[0]), nq, axis1)
        key_chunk = op.Slice(chunk_of, nq, op.Shape(chunk_of, start=1, end=2), axis1)
        no_float, no_pos = op.Constant(value_float=0.0), op.Constant(value_int=-1)
        rows_x = in_chunks(gather_items(vectors, order), items, no_float)
        rows_pos = in_chunks(gather_items(query_pos, order), items, no_pos)
        rows_v = in_chunks(gather_items(values, order), items, no_float)
        cols_x = with_previous(rows_x, no_float)  # keys are read from the same item vectors
        cols_v = with_previous(rows_v, no_float)
        cols_pos = with_previous(in_chunks(gather_items(key_pos, order), items, no_pos), no_pos)
        cols_pos = op.Transpose(cols_pos, perm=[0, 1, 2, 4, 3])  # [G, 1, C, 1, 2L]
        seen_bias, own_seen_bias = count_rounds(query_chunk, key_chunk, rows_pos, cols_pos)
        return rows_x, rows_pos, rows_v, cols_x, cols_v, cols_pos, seen_bias, own_seen_bias

    return SortedChunks


@built_once
def _attend_in_chunks_function(op):
    @script(ATTNREWRITE, default_opset=op)
    def AttendInChunks(rows_x, cols_x, cols_v, bias, own_logit, own_v):
        """Each row's softmax over its window [G, 1, C, L, 2L] plus its own-position slot
        [G, 1, C, L, 1] -> (out [G, 1, C, L, Dv], log-sum-exp [G, 1, C, L, 1]).

        bias is 0 for a visible key and MASKED_LOGIT for a hidden one, added to the logits
        instead of a Where over them: one broadcast Add, and the weights need no mask product
        afterwards, since a hidden logit sits ~1e30 below row_max, floored at MASKED_LOGIT / 2
        for a row that sees nothing, and its exp is exactly 0."""
        last = op.Constant(value_ints=[-1])
        logits = op.MatMul(rows_x, op.Transpose(cols_x, perm=[0, 1, 2, 4, 3])) + bias
        floor = op.Constant(value_float=MASKED_LOGIT / 2)
        row_max = op.Max(op.ReduceMax(logits, last, keepdims=1), own_logit, floor)
        weights = op.Exp(logits - row_max)
        own_weight = op.Exp(own_logit - row_max)
        total = op.ReduceSum(weights, last, keepdims=1) + own_weight
        out = (op.MatMul(weights, cols_v) + own_weight * own_v) / op.Max(total, op.Constant(value_float=TINY))
        masked = op.Constant(value_float=MASKED_LOGIT)
        lse = op.Where(total > op.Constant(value_float=0.0), row_max + op.Log(total), masked)
        return out, lse

    return AttendInChunks


@built_once
def _in_query_order_function(op, gather_items):
    @script(ATTNREWRITE, default_opset=op)
    def InQueryOrder(x, inverse, nq):
        """A round's sorted rows [G, 1, C, L, F] -> [G, 1, Nq, F], by inverse [G, 1, M]."""
        index = op.Slice(inverse, op.Constant(value_ints=[0]), nq, op.Constant(value_ints=[2]))
        rows = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[-1]), op.Shape(x, start=-1), axis=0)
        return gather_items(op.Reshape(x, rows), index)

    return InQueryOrder


@built_once
def _round_function(op, sorted_chunks, attend, in_query_order):
    """Round: one hash round of a site without a causal mask."""

    @script(ATTNREWRITE, default_opset=op)
    def Round(round_index, order, inverse, chunk_of, vectors, values, query_pos, key_pos, nq, items):
        """One hash round, no own-position slot -> (out, log-sum-exp) [G, 1, Nq, Dv or 1]."""
        order = op.Gather(order, round_index, axis=1)
        inverse = op.Gather(inverse, round_index, axis=1)
        rows_x, rows_pos, rows_v, cols_x, cols_v, cols_pos, seen_bias, own_seen_bias = sorted_chunks(
            order, chunk_of, vectors, values, query_pos, key_pos, nq, items
        )
        masked = op.Constant(value_float=MASKED_LOGIT)
        # [G, 1, C, 1, 2L]: built at 1 / (2 * chunk) of the logits' size (dedup: full size).
        bias = op.Where(cols_pos >= op.Constant(value_int=0), seen_bias, masked)
        nothing = op.Constant(value_float=0.0)
        out, lse = attend(rows_x, cols_x, cols_v, bias, masked, nothing)
        return in_query_order(out, inverse, nq), in_query_order(lse, inverse, nq)

    return Round


@built_once
def _causal_round_function(op, gather_items, sorted_chunks, attend, in_query_order):
    """CausalRound: one hash round of a causal site, with the own-position slot."""
    in_chunks, _ = _chunk_functions(op)

    @script(ATTNREWRITE, default_opset=op)
    def CausalRound(round_index, order, inverse, chunk_of, vectors, values, query_pos, key_pos, nq, items, own_logit):
        """One hash round: keys at earlier positions in the window, plus the key at the row's
        own position, which every round shows -> (out, log-sum-exp) [G, 1, Nq, Dv or 1]. The
        own key's logit and value are item tables (CausalItems) sorted like the rows, so every
        index this round gathers with is a rank of the sort, never a position."""
        order = op.Gather(order, round_index, axis=1)
        inverse = op.Gather(inverse, round_index, axis=1)
        rows_x, rows_pos, rows_v, cols_x, cols_v, cols_pos, seen_bias, own_seen_bias = sorted_chunks(
            order, chunk_of, vectors, values, query_pos, key_pos, nq, items
        )
        masked = op.Constant(value_float=MASKED_LOGIT)
        # Causal visibility is per (row, column) pair, so this bias has one round's logits' size;
        # the kept-key part is selected at the window's size first (as Round's bias).
        key_bias = op.Where(cols_pos >= op.Constant(value_int=0), seen_bias, masked)
        bias = op.Where(cols_pos < rows_pos, key_bias, masked)
        own_logit = in_chunks(gather_items(own_logit, order), items, masked) + own_seen_bias
        out, lse = attend(rows_x, cols_x, cols_v, bias, own_logit, rows_v)
        return in_query_order(out, inverse, nq), in_query_order(lse, inverse, nq)

    return CausalRound


@built_once
def _combine_rounds_function(op):
    @script(ATTNREWRITE, default_opset=op)
    def CombineRounds(out, lse, q, v):
        """Every round's out [H, G, 1, Nq, Dv] weighted by the softmax of its log-sum-exp
        [H, G, 1, Nq, 1] over rounds -> q's layout."""
        rounds = op.Constant(value_ints=[0])
        combined = op.ReduceSum(op.Softmax(lse, axis=0) * out, rounds, keepdims=0)
        shape = op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)
        return op.CastLike(op.Reshape(combined, shape), v)

    return CombineRounds


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: values for the constants by name (lsh has nothing to fit; accepted for a
    uniform interface)."""
    return _lowering(site, options, opset_version).with_weights(weights)


def _lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    """Items, one round function and CombineRounds, called by an entry unrolled over the rounds."""
    op = standard_opset(opset_version)
    gather_items = _gather_function(op)
    items = _items_function(opset_version, options.n_buckets, site.mask.causal)
    sorted_chunks = _sorted_chunks_function(op, gather_items, _rounds_seen_function(op, options.dedup))
    round_parts = (sorted_chunks, _attend_in_chunks_function(op), _in_query_order_function(op, gather_items))
    if site.mask.causal:
        one_round = _causal_round_function(op, gather_items, *round_parts)
    else:
        one_round = _round_function(op, *round_parts)
    combine = _combine_rounds_function(op)
    entry = _entry(
        "CausalLSHAttention" if site.mask.causal else "LSHAttention",
        (items.name, one_round.name, combine.name),
        options.n_hashes,
        site.mask.causal,
        opset_version,
    )
    constants = {
        "scale": np.array(site.scale, dtype=np.float32),
        "rotations": rotations(options, site.head_dim),
        "items": np.array([2 * options.chunk], dtype=np.int64),
    }
    functions = [f.to_function_proto() for f in with_callees(items, one_round, combine)]
    return OnnxLowering([*functions, entry], constants)


def _entry(name: str, calls, n_hashes: int, causal: bool, opset_version: int):
    """Entry(q, k, v, key_keep, scale, rotations, items), calling (items, one round, combine):
    the items sorted for every round at once (small: [G, hashes, 2N] int64), then a Loop over
    the rounds, and the rounds combined by their log-sum-exp. A Loop, not one call per round:
    onnxruntime may interleave independent calls, and did: with unrolled rounds the peak grew
    by a round's window tensors per round (CPU, [1, 12, 16384, 64]: 2.9 / 4.0 / 5.9 GB for
    1 / 2 / 4 rounds); a Loop's iterations run one after another."""
    items_fn, round_fn, combine_fn = calls
    call = functools.partial(helper.make_node, domain=DOMAIN)
    inputs = ["q", "k", "v", "key_keep", "scale", "rotations", "items"]
    tables = ["order", "inverse", "chunk_of", "vectors", "values", "query_pos", "key_pos", "nq"]
    own_slot = ["own_logit"] if causal else []
    rounds = helper.make_tensor("rounds", onnx.TensorProto.INT64, [], [n_hashes])
    body = _round_body(round_fn, [*tables, "items", *own_slot])
    nodes = [
        call(items_fn, inputs, [*tables, *own_slot]),
        helper.make_node("Constant", [], ["rounds"], value=rounds),
        helper.make_node("Loop", ["rounds", ""], ["out", "lse"], body=body),
        call(combine_fn, ["out", "lse", "q", "v"], ["result"]),
    ]
    return make_function(name, inputs, ["result"], nodes, opset_version)


def _round_body(round_fn: str, outer: list[str]) -> onnx.GraphProto:
    """The Loop body: round ``i`` of the sorts, reading the tables from the entry's scope ->
    its (out, log-sum-exp) as scan outputs, stacked on a new leading rounds axis."""
    call = functools.partial(helper.make_node, domain=DOMAIN)
    nodes = [
        helper.make_node("Constant", [], ["axis0"], value_ints=[0]),
        helper.make_node("Unsqueeze", ["i", "axis0"], ["round_index"]),
        call(round_fn, ["round_index", *outer], ["round_out", "round_lse"]),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
    ]
    scalar = functools.partial(helper.make_tensor_value_info, shape=[])
    return helper.make_graph(
        nodes,
        "round",
        [scalar("i", onnx.TensorProto.INT64), scalar("cond", onnx.TensorProto.BOOL)],
        [
            scalar("cond_out", onnx.TensorProto.BOOL),
            helper.make_tensor_value_info("round_out", FLOAT, None),
            helper.make_tensor_value_info("round_lse", FLOAT, None),
        ],
    )
