"""The causal window's sparse cache in ONNX (sparse_cache.py defines it; this is its torch
form's twin): RecurrentSparseWindow, the window with its cache continued from a state, one
Loop over the blocks carrying the kernel state and the cache's slots, and
SparseWindowedKernelAttention, the parallel entry, which is that loop from nothing.

Both are written node by node (a Loop's body, shapes chosen by the window and unit), so a
script entry calls SparseWindowedKernelAttention by name through sparse_window_entry's shim,
which carries them (feature_map.entry_functions adds them before the entry)."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import onnx
from onnx import numpy_helper
from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.state import absorb_keys_functions
from attnrewrite.passes.layout import flatten_heads_function, key_keep_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    BOOL,
    DOMAIN,
    FLOAT,
    NODE_BUILT,
    TO_THE_END,
    FunctionNodes,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.window.onnx_blocks import per_head_function, window_block_functions
from attnrewrite.passes.window.onnx_state import (
    exact_softmax_sums_function,
    positioned_layout_functions,
    recurrent_exact_keys_function,
    window_mix_function,
    without_sinks_from_function,
)
from attnrewrite.passes.window.settings import KernelUnit, Window

INT64 = onnx.TensorProto.INT64
# Keys of the order a leave puts its survivors in (_leave): a held candidate's key is minus its
# place, an unheld one's that minus this, so TopK's largest are the held ones in place order.
UNHELD = 1.0e7


def sparse_from_state_inputs(window: Window, unit: KernelUnit) -> list[str]:
    """The inputs of RecurrentSparseWindow, in order. Per query head [G, ...]: phi_q (weighted
    by w_h), q [G, N', *] of the queries; k, v, phi_k (, key_log_scale), keep [G, S + N, *] of
    the rows, the cache's S first, then positions start .. start + N - 1 (phi_k zero where
    padded, the sinks' rows as they are); per key/value head [Gkv, S + N, *]: pair_k, pair_v,
    pair_keep, the same rows as the state keeps them; start [1]; the kernel state [G, F, Dv],
    normaliser [G, F] (, log_scale [G, 1]); then the queries' log scales and row weights
    [G, N', 1] and the sinks [G, sinks, *] where the unit and window have them."""
    inputs = ["phi_q", "q", "k", "v", "phi_k", "keep", "pair_k", "pair_v", "pair_keep", "start"]
    inputs += ["kernel_state", "normaliser"]
    if unit.rescaled:
        inputs[5:5] = ["key_log_scale"]
        inputs += ["log_scale", "query_log_scale"]
    if unit.max_weighted:
        inputs.append("row_weight")
    if window.sinks:
        inputs += ["sink_keys", "sink_values", "sink_keep"]
    return inputs


def sparse_from_state_outputs(unit: KernelUnit, state_after: bool = True) -> list[str]:
    """Its outputs: out [G, N', Dv], then (``state_after``) the kernel state after every block
    that has left by the next position and the cache ([Gkv, S, *]; keep 1.0 in a held slot)."""
    if not state_after:
        return ["out"]
    state = ["kernel_state_after", "normaliser_after", *(["log_scale_after"] if unit.rescaled else [])]
    return ["out", *state, "cache_k", "cache_v", "cache_keep"]


class Candidates(typing.NamedTuple):
    """The rows a leave chooses among and folds from: per query head [G, R, *] their values,
    features and log scales (None: a shared unit), and which of them may enter the cache, per
    key/value head [Gkv, R] (kept keys that are no sink; none of the cache's own rows, whose
    slots say which they hold)."""

    v: str
    phi_k: str
    key_log_scale: str | None
    candidate: str


class _Rows(typing.NamedTuple):
    """The values the loop reads from its function (sparse_cache.CachedRows and the rest): every
    row the cache can hold, [G, S + chunks * W, *] (``pairs``: phi_k and log scales as the
    kernel reads them, zero / the lowest on sinks and padding; ``k`` as the exact part reads
    it), the query blocks and their exact keys [G, blocks from the first holding a query, ...]."""

    pairs: Candidates
    k: str
    queries: str
    phi_q: str
    query_log_scale: str | None
    row_weight: str | None
    local_k: str
    local_v: str
    taken: str


@dataclasses.dataclass(frozen=True)
class _Carried:
    """What the loop carries: the kernel state [G, F, Dv], [G, F] (, [G, 1]) and the cache's
    slots, per key/value head [Gkv, S]: their rows (int64) and whether they hold one (bool)."""

    kv: str
    key_sum: str
    log_scale: str | None
    index: str
    held: str

    def present(self) -> list[str]:
        """The fields carried (log_scale only in a rescaled unit), in order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def values(self) -> list[str]:
        return [getattr(self, name) for name in self.present()]

    def with_values(self, values) -> _Carried:
        """The present fields as ``values`` (in present()'s order)."""
        return dataclasses.replace(self, **dict(zip(self.present(), values)))


class _Plan(typing.NamedTuple):
    """What every piece of the loop reads: the window, the unit, and the mix and exact softmax
    sums it calls (onnx_state's, as the window without a cache)."""

    window: Window
    unit: KernelUnit
    mix: OnnxFunction
    sums: OnnxFunction

    @property
    def groups(self) -> int:
        return self.window.groups


@built_once
def sparse_from_state_functions(
    opset_version: int, window: Window, scale: float, unit: KernelUnit, state_after: bool = True
) -> list:
    """RecurrentSparseWindow (sparse_cache.sparse_attention_from_state) after the functions it
    calls, all FunctionProtos; without ``state_after`` SparseWindowOutputs, the outputs alone
    (the parallel form's: no last leave, no cache gathered)."""
    op = standard_opset(opset_version)
    size, width, sinks = window.sparse, window.size, window.sinks
    layout, positioned_blocks, query_blocks, unblock = positioned_layout_functions(op, width)
    blocks = window_block_functions(op, width, aligned_to_start=True)
    exact_keys = recurrent_exact_keys_function(op, blocks, positioned_blocks, width, sinks)
    absorb = absorb_keys_functions(opset_version)[1 if unit.rescaled else 0]
    plan = _Plan(window, unit, window_mix_function(op, unit.rescaled, unit.eps), exact_softmax_sums_function(op, scale))
    without_sinks = without_sinks_from_function(opset_version, sinks) if sinks else None
    callees = [layout, positioned_blocks, query_blocks, unblock, exact_keys, absorb, plan.mix, plan.sums]
    callees += [without_sinks] if sinks else []
    b = FunctionNodes()
    count = b.ints(size)
    n_rows, n = b("Shape", "k", start=1, end=2), b("Shape", "q", start=1, end=2)
    n_keys = b("Sub", n_rows, count)
    front, chunks, first = b.call(layout, "start", n_keys, n, outputs=3)  # blocks before first: no query
    zero, end, one = b.ints(0), b.ints(TO_THE_END), b.ints(1)

    def cached(x):
        return b("Slice", x, zero, count, one)

    def positioned(x):
        return b("Slice", x, count, end, one)

    def far(x, fill):  # the kernel's view of positioned rows: nothing of the sinks
        if not sinks:
            return positioned(x)
        return b.call(without_sinks, positioned(x), b("Constant", value_float=fill), "start")

    def laid_out(x, positioned_x, fill=0.0, head=None):
        """The cache's rows of x (or ``head``), then positioned_x in blocks: [G, S + chunks * W, *]."""
        laid = b.call(positioned_blocks, positioned_x, b("Constant", value_float=fill), front, chunks)
        flat = b("Reshape", laid, b("Concat", b.ints(0, -1), b("Shape", x, start=2), axis=0))
        return b("Concat", cached(x) if head is None else head, flat, axis=1)

    rescaled = unit.rescaled
    p_k, p_v, p_keep = positioned("k"), positioned("v"), positioned("keep")
    sink_inputs = ["start", "sink_keys", "sink_values", "sink_keep"] if sinks else []
    local_k, local_v, taken = b.call(exact_keys, p_k, p_v, p_keep, front, chunks, first, *sink_inputs, outputs=3)

    def query_rows(x):
        return None if x is None else b.call(query_blocks, x, front, chunks, first, n_keys)

    pairs = Candidates(
        laid_out("v", p_v),
        laid_out("phi_k", far("phi_k", 0.0)),
        laid_out("key_log_scale", far("key_log_scale", LOWEST_LOG_SCALE), LOWEST_LOG_SCALE) if rescaled else None,
        _candidates(b, laid_out, cached("pair_keep"), positioned("pair_keep"), n_keys, sinks),
    )
    rows = _Rows(
        pairs,
        laid_out("k", p_k),
        query_rows("q"),
        query_rows("phi_q"),
        query_rows("query_log_scale" if rescaled else None),
        query_rows("row_weight" if unit.max_weighted else None),
        local_k,
        local_v,
        taken,
    )
    index, held = _incoming_slots(b, cached("pair_keep"), size)
    carried = _Carried("kernel_state", "normaliser", "log_scale" if rescaled else None, index, held)
    carried, out = _block_loop(b, plan, rows, carried, absorb, chunks, first)
    b.output("out", b.call(unblock, b("Transpose", out, perm=[1, 0, 2, 3]), front, first, n_keys, n))
    if state_after:
        carried = _last_leave(b, plan, rows, carried, absorb, front, chunks, n_keys)
        for name, value in zip(sparse_from_state_outputs(unit)[1:], carried.values()[:-2]):  # the state, not the slots
            b.output(name, value)
        b.output("cache_k", gathered_rows(b, laid_out("pair_k", positioned("pair_k")), carried.index))
        b.output("cache_v", gathered_rows(b, laid_out("pair_v", positioned("pair_v")), carried.index))
        b.output("cache_keep", b("Unsqueeze", b("Cast", carried.held, to=FLOAT), b.ints(-1)))
    name = "RecurrentSparseWindow" if state_after else "SparseWindowOutputs"
    inputs, outputs = sparse_from_state_inputs(window, unit), sparse_from_state_outputs(unit, state_after)
    entry = make_function(name, inputs, outputs, b.nodes, opset_version)
    return [*(f.to_function_proto() for f in with_callees(*callees)), entry]


def _incoming_slots(b: FunctionNodes, cached_keep: str, size: int) -> tuple[str, str]:
    """The incoming cache's slots [Gkv, S]: each its own row, held where its keep flag is."""
    places = b("Constant", value=numpy_helper.from_array(np.arange(size)))
    index = b("Expand", places, b("Concat", b("Shape", cached_keep, end=1), b.ints(size), axis=0))
    return index, b("Greater", b("Squeeze", cached_keep, b.ints(-1)), b("Constant", value_float=0.0))


def _last_leave(b: FunctionNodes, plan: _Plan, rows: _Rows, carried: _Carried, absorb, front, chunks, n_keys):
    """``carried`` after the block before the last leaves where the next position starts a
    block (sparse_cache.sparse_cached_blocks' leave_last: a decoder's next query is past it)."""
    width, zero = plan.window.size, b.ints(0)
    tail = b("Sub", b("Mul", chunks, b.ints(width)), b("Add", front, n_keys))
    leaves = b("Squeeze", b("And", b("Equal", tail, zero), b("GreaterOrEqual", chunks, b.ints(2))))
    return _if_leaves(b, plan, rows, carried, absorb, leaves, _leaving_row(b, plan.window, chunks), "last")


def _leaving_row(b: FunctionNodes, window: Window, block: str) -> str:
    """[1]: the first laid-out row (after the cache's S) of block ``block`` - 2, the block that
    leaves the window when block ``block``'s queries come (after the last: the next query's)."""
    return b("Add", b.ints(window.sparse), b("Mul", b("Sub", block, b.ints(2)), b.ints(window.size)))


def _candidates(b: FunctionNodes, laid_out, cached_keep: str, pair_keep: str, n_keys: str, sinks: int) -> str:
    """[Gkv, S + chunks * W] bool: the rows that may enter the cache, as laid out (none of the
    cache's own: its slots say which it holds): kept keys that are no sink."""
    flags = b("Greater", pair_keep, b("Constant", value_float=0.0))
    if sinks:
        position = b("Add", b("Range", _scalar(b, 0), b("Squeeze", n_keys), _scalar(b, 1)), "start")
        beyond = b("GreaterOrEqual", position, b("Constant", value_int=sinks))
        flags = b("And", flags, b("Unsqueeze", beyond, b.ints(-1)))
    none = b("Mul", cached_keep, b("Constant", value_float=0.0))
    laid = laid_out("pair_keep", b("Cast", flags, to=FLOAT), head=none)
    return b("Greater", b("Squeeze", laid, b.ints(-1)), b("Constant", value_float=0.0))


def _block_loop(b: FunctionNodes, plan: _Plan, rows: _Rows, carried: _Carried, absorb, chunks: str, first: str):
    """(the carried values after every block, the outputs [chunks - first, G, W, Dv] of the
    blocks from ``first``, the first that holds a query): block c by block c, block c - 2
    leaving first (sparse_cache.sparse_cached_blocks). The blocks before ``first`` hold only
    the window's kept rows, fewer than two blocks, so none of them is reached by a leave."""
    body = FunctionNodes(prefix="block_")
    block = body("Add", "block_i", b("Squeeze", first))
    names = carried.present()
    incoming = carried.with_values([f"block_{name}_in" for name in names])
    leaves = body("GreaterOrEqual", block, _scalar(body, 2))
    after = _if_leaves(body, plan, rows, incoming, absorb, leaves, _leaving_row(body, plan.window, block), "leaves")
    out = _block_attention(body, plan, rows, after, "block_i")
    body.output("cond_out", body("Identity", "block_cond"))
    for name in names:
        body.output(f"{name}_out", getattr(after, name))
    body.output("out_block", out)
    types = {"index": INT64, "held": BOOL}
    graph = body.graph(
        "blocks",
        ["cond_out", *(f"{name}_out" for name in names), "out_block"],
        inputs=(
            ("block_i", INT64, []),
            ("block_cond", BOOL, []),
            *((f"block_{n}_in", types.get(n, FLOAT), None) for n in names),
        ),
    )
    trips = b("Squeeze", b("Sub", chunks, first))
    values = b("Loop", trips, "", *carried.values(), outputs=len(names) + 1, body=graph)
    return carried.with_values(values[:-1]), values[-1]


def _if_leaves(
    b: FunctionNodes, plan: _Plan, rows: _Rows, carried: _Carried, absorb, condition: str, first_row: str, name: str
) -> _Carried:
    """``carried`` after the block of rows first_row .. first_row + W - 1 leaves the window if
    ``condition`` (a bool []), else as it is."""
    present = carried.present()

    def branch(build, label):
        inner = FunctionNodes(prefix=f"{b.prefix}{name}_{label}_")
        for field, value in zip(present, build(inner).values()):
            inner.output(field, value)
        return inner.graph(f"{name}_{label}", present)

    branches = {
        "then_branch": branch(
            lambda inner: _leave(inner, plan.window, plan.unit, rows.pairs, carried, absorb, first_row), "then"
        ),
        "else_branch": branch(lambda inner: carried, "else"),
    }
    return carried.with_values(b("If", condition, outputs=len(present), **branches))


def leave_block(
    b: FunctionNodes, window: Window, unit: KernelUnit, absorb, pairs: Candidates, state: list[str], cache_keep: str
) -> tuple[list[str], str, str]:
    """A decoding step's leave (recurrent_onnx.block_leaves): ``pairs`` [G, S + W, *] the
    cache's S rows, then the W of the block leaving; ``state`` the flat kernel state [kv,
    key_sum(, log_scale)]; ``cache_keep`` [Gkv, S, 1] the cache's keep flags; ``absorb`` the
    absorb_keys function of the unit. Returns (the state after, the new slots' rows [Gkv, S]
    among the S + W, whether they hold one)."""
    index, held = _incoming_slots(b, cache_keep, window.sparse)
    kv, key_sum, *log_scale = state
    carried = _Carried(kv, key_sum, log_scale[0] if log_scale else None, index, held)
    after = _leave(b, window, unit, pairs, carried, absorb, b.ints(window.sparse))
    return after.values()[:-2], after.index, after.held


def _leave(
    b: FunctionNodes, window: Window, unit: KernelUnit, rows: Candidates, carried: _Carried, absorb, first_row: str
) -> _Carried:
    """Of the leaving block's rows and the cache, the window.sparse pairs the state recalls
    worst stay, the others are folded into the state (sparse_cache._leave)."""
    size, width = window.sparse, window.size
    row_after = b("Add", first_row, b.ints(width))
    block = b("Range", b("Squeeze", first_row), b("Squeeze", row_after), _scalar(b, 1))
    kv_heads = b("Shape", carried.index, end=1)
    index = b("Concat", carried.index, b("Expand", block, b("Concat", kv_heads, b.ints(width), axis=0)), axis=1)
    leaving = b("Slice", rows.candidate, first_row, row_after, b.ints(1))
    valid = b("Concat", carried.held, leaving, axis=1)
    per_head = _per_query_head(b, window.groups, index)
    phi_k, values = gathered_rows(b, rows.phi_k, per_head), gathered_rows(b, rows.v, per_head)
    # self-recall error ||phi_k S / (phi_k z + eps) - v||^2, the state as it is before the block folds
    normaliser = b("MatMul", phi_k, b("Unsqueeze", carried.key_sum, b.ints(-1)))
    recalled = b("Div", b("MatMul", phi_k, carried.kv), b("Add", normaliser, b("Constant", value_float=unit.eps)))
    miss = b("Sub", recalled, values)
    errors = b("ReduceSum", b("Mul", miss, miss), b.ints(-1), keepdims=0)
    if window.groups > 1:  # summed over a key/value head's query heads
        grouped = b("Reshape", errors, b("Concat", b.ints(-1, window.groups), b("Shape", errors, start=1), axis=0))
        errors = b("ReduceSum", grouped, b.ints(1), keepdims=0)
    kept = _worst(b, errors, valid, size)
    folded = b("And", valid, b("Not", kept))
    folded = b("Unsqueeze", _per_query_head(b, window.groups, folded), b.ints(-1))
    phi_folded = b("Mul", phi_k, b("Cast", folded, to=FLOAT))
    if unit.rescaled:
        lowest = b("Constant", value_float=LOWEST_LOG_SCALE)
        log_scale = b("Where", folded, gathered_rows(b, rows.key_log_scale, per_head), lowest)
        kv, key_sum, new_scale = b.call(
            absorb, phi_folded, log_scale, values, carried.kv, carried.key_sum, carried.log_scale, outputs=3
        )
    else:
        (kv, key_sum), new_scale = b.call(absorb, phi_folded, values, carried.kv, carried.key_sum, outputs=2), None
    # held ones first, each group in place order (position order: the cache's rows come first)
    place = b("Cast", _places(b, index), to=FLOAT)
    key = b("Where", kept, b("Neg", place), b("Sub", b("Neg", place), b("Constant", value_float=UNHELD)))
    _, order = b("TopK", key, b.ints(size), axis=-1, largest=1, sorted=1, outputs=2)
    held = b("Greater", b("GatherElements", b("Cast", kept, to=FLOAT), order, axis=1), b("Constant", value_float=0.0))
    return _Carried(kv, key_sum, new_scale, b("GatherElements", index, order, axis=1), held)


def _worst(b: FunctionNodes, errors: str, valid: str, size: int) -> str:
    """[Gkv, R] bool: the ``size`` valid candidates with the largest errors; of equal ones the
    earlier (sparse_cache._worst)."""
    errors = b("Where", valid, errors, b("Constant", value_float=-np.inf))
    a, other = b("Unsqueeze", errors, b.ints(-1)), b("Unsqueeze", errors, b.ints(-2))
    place = _places(b, errors)
    before = b("Less", b("Unsqueeze", place, b.ints(-1)), b("Unsqueeze", place, b.ints(0)))
    ahead = b("Or", b("Greater", a, other), b("And", b("Equal", a, other), before))  # [.., a, b]: a ranks before b
    counted = b("And", ahead, b("Unsqueeze", valid, b.ints(-1)))
    rank = b("ReduceSum", b("Cast", counted, to=INT64), b.ints(-2), keepdims=0)
    return b("And", valid, b("Less", rank, _scalar(b, size)))


def _block_attention(b: FunctionNodes, plan: _Plan, rows: _Rows, carried: _Carried, block: str) -> str:
    """The queries of ``rows``' query block ``block`` over its local keys, the sinks and the
    cache (one softmax) and the kernel state, one normaliser: [G, W, Dv]."""

    def take(x):
        return b("Gather", x, block, axis=1)

    index = _per_query_head(b, plan.groups, carried.index)
    keys = b("Concat", take(rows.local_k), gathered_rows(b, rows.k, index), axis=1)
    values = b("Concat", take(rows.local_v), gathered_rows(b, rows.pairs.v, index), axis=1)
    local_taken = take(rows.taken)
    held = b("Unsqueeze", _per_query_head(b, plan.groups, carried.held), b.ints(1))
    held = b("Expand", held, b("Concat", b("Shape", local_taken, end=2), b.ints(plan.window.sparse), axis=0))
    taken = b("Cast", b("Concat", local_taken, held, axis=-1), to=FLOAT)
    one = b.ints(1)
    local = b.call(plan.sums, *(b("Unsqueeze", x, one) for x in (take(rows.queries), keys, values, taken)), outputs=3)
    num, den, row_max = (b("Squeeze", x, one) for x in local)
    phi_q = take(rows.phi_q)
    far_num, far_den = b("MatMul", phi_q, carried.kv), b("MatMul", phi_q, b("Unsqueeze", carried.key_sum, b.ints(-1)))
    if not plan.unit.rescaled:
        return b.call(plan.mix, num, den, far_num, far_den)
    weight = take(rows.row_weight) if plan.unit.max_weighted else b("Constant", value_float=1.0)
    far_log_scale = b("Unsqueeze", carried.log_scale, b.ints(-1))
    return b.call(plan.mix, num, den, row_max, far_num, far_den, far_log_scale, take(rows.query_log_scale), weight)


def _per_query_head(b: FunctionNodes, groups: int, x: str) -> str:
    """x [Gkv, R] with each key/value head's row repeated for its ``groups`` query heads: [G, R]."""
    if groups == 1:
        return x
    repeated = b("Expand", b("Unsqueeze", x, b.ints(1)), b.ints(1, groups, 1))
    return b("Reshape", repeated, b("Concat", b.ints(-1), b("Shape", x, start=1), axis=0))


def gathered_rows(b: FunctionNodes, x: str, index: str) -> str:
    """Rows ``index`` [G, R] of x [G, rows, F]."""
    expanded = b(
        "Expand", b("Unsqueeze", index, b.ints(-1)), b("Concat", b("Shape", index), b("Shape", x, start=2), axis=0)
    )
    return b("GatherElements", x, expanded, axis=1)


def _scalar(b: FunctionNodes, value: int) -> str:
    """An int64 [] constant (Range's bounds, a Loop's trip count, a scalar's comparand)."""
    return b("Constant", value=numpy_helper.from_array(np.array(value, np.int64)))


def _places(b: FunctionNodes, x: str) -> str:
    """0 .. R - 1 for x [*, R]."""
    return b("Range", _scalar(b, 0), b("Squeeze", b("Shape", x, start=1, end=2)), _scalar(b, 1))


# --- the parallel entry ---------------------------------------------------------------------------


def causal_entry_inputs(unit: KernelUnit) -> list[str]:
    """The inputs of a causal windowed kernel's entry for ``unit`` (onnx_causal.causal_paired_entry's)."""
    if not unit.rescaled:
        return ["phi_q", "phi_k", "q", "k", "v", "key_keep", "linear_log_weight"]
    inputs = ["phi_q", "phi_k", "query_log_scale", "key_log_scale", "q", "k", "v", "key_keep", "linear_log_weight"]
    return [*inputs, "local_max_weight"] if unit.max_weighted else inputs


@built_once
def sparse_windowed_kernel_functions(opset_version: int, window: Window, scale: float, unit: KernelUnit) -> list:
    """SparseWindowedKernelAttention after the functions it calls (FunctionProtos): the causal
    windowed_kernel_attention with a sparse cache (sparse_cache.sparse_windowed_causal), that
    is RecurrentSparseWindow from position 0, an empty cache and a zero state. Inputs as
    causal_entry_inputs(unit), [..., N, *]; returns float32 [..., N, Dv]."""
    op = standard_opset(opset_version)
    flatten = flatten_heads_function(opset_version)
    per_head, key_keep = per_head_function(op, flatten), key_keep_function(opset_version)
    from_state = sparse_from_state_functions(opset_version, window, scale, unit, state_after=False)
    size, groups, sinks = window.sparse, window.groups, window.sinks
    b = FunctionNodes()

    def flat(x):
        return b.call(flatten, x)

    def after_empty_cache(x):  # the cache's S rows in front: empty (none held, none may enter)
        return b("Pad", x, b.ints(0, size, 0, 0, 0, 0), b("Constant", value_float=0.0))

    def first_of_group(x):  # [G, R, 1] -> [Gkv, R, 1]: a key/value head's keep flags are its query heads'
        if groups == 1:
            return x
        shape = b("Concat", b.ints(-1, groups), b("Shape", x, start=1), axis=0)
        return b("Gather", b("Reshape", x, shape), _scalar(b, 0), axis=1)

    def zeros(*shape_parts):
        return b("Expand", b("Constant", value_float=0.0), b("Concat", *shape_parts, axis=0))

    keep = b("Cast", b.call(key_keep, "key_keep", "k"), to=FLOAT)
    weight = b("Exp", b.call(per_head, "linear_log_weight", "q"))
    k, v, phi_k = flat("k"), flat("v"), flat("phi_k")
    rows = {name: after_empty_cache(x) for name, x in (("k", k), ("v", v), ("keep", keep))}
    inputs = [b("Mul", flat("phi_q"), weight), flat("q"), rows["k"], rows["v"], after_empty_cache(phi_k)]
    if unit.rescaled:
        inputs.append(after_empty_cache(flat("key_log_scale")))
    # pair_k and pair_v only make the cache's outputs, which SparseWindowOutputs has not
    inputs += [rows["keep"], rows["k"], rows["v"], first_of_group(rows["keep"]), b.ints(0)]
    heads, features = b("Shape", phi_k, end=1), b("Shape", phi_k, start=2)
    inputs += [zeros(heads, features, b("Shape", v, start=2)), zeros(heads, features)]
    if unit.rescaled:
        lowest = b("Expand", b("Constant", value_float=LOWEST_LOG_SCALE), b("Concat", heads, b.ints(1), axis=0))
        query_log_scale = flat("query_log_scale")
        inputs += [lowest, query_log_scale]
    if unit.max_weighted:
        inputs.append(b("Expand", b.call(per_head, "local_max_weight", "q"), b("Shape", query_log_scale)))
    if sinks:  # the first rows, zero past the sequence
        for x in (k, v, keep):
            padded = b("Pad", x, b.ints(0, 0, 0, 0, sinks, 0), b("Constant", value_float=0.0))
            inputs.append(b("Slice", padded, b.ints(0), b.ints(sinks), b.ints(1)))
    out = b(from_state[-1].name, *inputs, domain=DOMAIN)
    b.output("out", b("Reshape", out, b("Concat", b("Shape", "q", end=-1), b("Shape", "v", start=-1), axis=0)))
    entry = make_function("SparseWindowedKernelAttention", causal_entry_inputs(unit), ["out"], b.nodes, opset_version)
    callees = [f.to_function_proto() for f in with_callees(flatten, per_head, key_keep)]
    return [*callees, *from_state, entry]


@built_once
def sparse_window_entry(opset_version: int, window: Window, scale: float, unit: KernelUnit) -> OnnxFunction:
    """A script function with the causal entry's inputs for ``unit`` that calls
    SparseWindowedKernelAttention by name, for the passes' script entries to call; NODE_BUILT on
    it lists the FunctionProtos behind that name (feature_map.entry_functions adds them)."""
    op = standard_opset(opset_version)
    if unit.max_weighted:

        @script(ATTNREWRITE, default_opset=op)
        def SparseWindowedMaxWeightedKernel(
            phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
        ):
            return ATTNREWRITE.SparseWindowedKernelAttention(
                phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight, local_max_weight
            )

        shim = SparseWindowedMaxWeightedKernel
    elif unit.rescaled:

        @script(ATTNREWRITE, default_opset=op)
        def SparseWindowedRescaledKernel(
            phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
        ):
            return ATTNREWRITE.SparseWindowedKernelAttention(
                phi_q, phi_k, query_log_scale, key_log_scale, q, k, v, key_keep, linear_log_weight
            )

        shim = SparseWindowedRescaledKernel
    else:

        @script(ATTNREWRITE, default_opset=op)
        def SparseWindowedKernel(phi_q, phi_k, q, k, v, key_keep, linear_log_weight):
            return ATTNREWRITE.SparseWindowedKernelAttention(phi_q, phi_k, q, k, v, key_keep, linear_log_weight)

        shim = SparseWindowedKernel
    setattr(shim, NODE_BUILT, sparse_windowed_kernel_functions(opset_version, window, scale, unit))
    return shim
