"""The kernel methods' recurrent form in ONNX: the entry (q, k, v, key_keep, *state, *constants)
-> (out, *state after), written node by node since its inputs depend on the options. If one new
token, a decoding step (what one token needs, nothing chunked), else the prefill (the chunked
form continued from the state: kernel/state.py, window/onnx_state.py).

Each graph (the entry's own, or an If branch's) is a Body; the builders below take a Body and
what they read besides as arguments: the window's rows (WindowRows) are returned by window_rows
and handed to the branches, and an If branch is a graph branch() returns from a builder.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from attnrewrite.passes.kernel.delta_onnx import delta_rule_from_state_functions, normalised_keys_function
from attnrewrite.passes.kernel.feature_map import OnnxTerms
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.query_key_maps import QUERY_KEY_MAPS
from attnrewrite.passes.kernel.recurrent_state import (
    CACHE_PARTS,
    KERNEL_STATE,
    LOG_SCALE,
    POSITION,
    SINK_KEEP,
    SINK_PARTS,
    WINDOW_KEEP,
    WINDOW_KEYS,
    WINDOW_VALUES,
)
from attnrewrite.passes.kernel.state import (
    absorb_keys_functions,
    causal_linear_attention_from_state_functions,
    causal_rescaled_linear_attention_from_state_functions,
)
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import (
    DOMAIN,
    FLOAT,
    MICROSOFT,
    TO_THE_END,
    FunctionNodes,
    make_function,
    unique_functions,
    with_callees,
)
from attnrewrite.passes.recurrent import StateTensor
from attnrewrite.passes.window.onnx_sparse import (
    Candidates,
    gathered_rows,
    leave_block,
    sparse_from_state_functions,
    sparse_from_state_outputs,
)
from attnrewrite.passes.window.onnx_state import (
    sinks_after_function,
    window_step_functions,
    windowed_kernel_attention_from_state_functions,
    without_sinks_from_function,
)
from attnrewrite.passes.window.settings import KernelUnit, Window
from attnrewrite.site import AttentionSite

LOWEST = LOWEST_LOG_SCALE


@dataclasses.dataclass(frozen=True)
class EntryPlan:
    """What every part of one entry reads. ``groups``: query heads per kept key/value head;
    ``mapped``: q and k go through the fitted query/key maps first; ``delta``: the state is
    updated by the delta rule (kernel/delta.py; no window); ``linear_attention_rows``:
    (F, Dv + 1) where a step runs com.microsoft.LinearAttention, else None; ``functions``: the
    entry's callees, each added where it is first called."""

    site: AttentionSite
    opset_version: int
    unit: KernelUnit
    window: Window | None
    chunk: int
    groups: int
    mapped: bool
    delta: bool
    terms: OnnxTerms
    query_terms: OnnxTerms
    state: dict[str, StateTensor]
    linear_attention_rows: tuple[int, int] | None
    functions: list = dataclasses.field(default_factory=list)

    @property
    def rescaled(self) -> bool:
        return self.unit.rescaled

    @property
    def heads(self) -> int | None:
        return self.site.num_heads


class WindowRows(typing.NamedTuple):
    """What both branches of a windowed entry read, made in the entry itself (an If's outputs
    are copies): the new rows (k and v with their key/value heads, keep), the kept window's rows
    then those (k_x, v_x, keep_x), the first new position, the new rows' count and the next
    position after them ([1] each)."""

    new_keys: tuple[str, str, str]
    k_x: str
    v_x: str
    keep_x: str
    position: str
    new_rows: str
    next_position: str


class Body(FunctionNodes):
    """One graph of the entry: its nodes, and the values it flattened once (in an If's branch
    onnxruntime ran each repeated FlattenHeads of one value again, 3 per windowed prefill)."""

    def __init__(self, plan: EntryPlan, prefix: str = ""):
        super().__init__(prefix)
        self.plan = plan
        self._flats: dict[str, str] = {}
        self._flat_state: list[str] | None = None

    def uses(self, *functions) -> None:
        """Functions this graph calls (FunctionProtos), for the entry's callees."""
        self.plan.functions.extend(functions)

    def state_output(self, name: str, value: str) -> None:
        """``value`` as the state tensor ``name`` after the call."""
        self.output(self.plan.state[name].output_name, value)

    def flat(self, x: str) -> str:
        """x flattened to [G, N, F], once per value."""
        if x not in self._flats:
            self._flats[x] = self.call(flatten_heads_function(self.plan.opset_version), x)
        return self._flats[x]

    def flat_state(self) -> list[str]:
        """The incoming kernel state's sum phi(k) v^T and normaliser (and log_scale) as [G, F,
        Dv], [G, F] (and [G, 1]), flattened once."""
        if self._flat_state is None:
            flat = self.flat(KERNEL_STATE)
            normaliser = self("Gather", flat, self("Constant", value_int=-1), axis=-1)
            self._flat_state = [self("Slice", flat, self.ints(0), self.ints(-1), self.ints(-1)), normaliser]
            if self.plan.rescaled:
                log_scale = self("Reshape", LOG_SCALE, self.ints(-1, 1))
                self._flat_state.append(empty_state_log_scale(self, normaliser, log_scale))
        return self._flat_state

    def map(self, which: str, x: str) -> str:
        """q (``which`` "q") or k through the fitted maps, where the entry has them."""
        if not self.plan.mapped:
            return x
        query_map, key_map = QUERY_KEY_MAPS
        return self("MatMul", self("Cast", x, to=FLOAT), query_map if which == "q" else key_map)

    def terms(self, q: str, k: str, keep: str) -> list[str]:
        """(phi_q, phi_k[, query log scale, key log scale]) of the method, q and k mapped."""
        terms = self.plan.terms
        q, k = self.map("q", q), self.map("k", k)
        # every output the function has: the delta rule reads only the features of favor's four
        outputs = len(terms.function.to_function_proto().output)
        return self.call(terms.function, q, k, keep, *terms.constants, outputs=outputs)

    def query_terms(self, mapped_q: str) -> list[str]:
        """[phi_q[, query log scale]]: a step's query's terms alone, of the query as mapped."""
        terms = self.plan.query_terms
        outputs = 2 if self.plan.rescaled else 1
        found = self.call(terms.function, mapped_q, *terms.constants, outputs=outputs)
        return [found] if outputs == 1 else found

    def keep(self) -> str:
        """key_keep as float32 with k's leading axes: [..., N, 1]."""
        keep = self("Cast", "key_keep", to=FLOAT)
        return self("Expand", keep, self("Concat", self("Shape", "k", end=-1), self.ints(1), axis=0))

    def like_v(self, out: str) -> str:
        """The float32 output in v's type: as it is at a float32 site (onnxruntime keeps a Cast
        to the same type as a node of its own)."""
        return out if self.plan.site.dtype == "float32" else self("CastLike", out, "v")

    def output_flat(self, out_flat: str) -> None:
        """The flat [G, N, Dv] output as ``out``, shaped as q's rows of v's columns."""
        shape = self("Concat", self("Shape", "q", end=-1), self("Shape", "v", start=-1), axis=0)
        self.output("out", self.like_v(self("Reshape", out_flat, shape)))

    def rolled(self, x: str, n: str) -> str:
        """x without its first ``n`` rows."""
        return self("Slice", x, n, self.ints(TO_THE_END), self.ints(-2))

    def swap_last(self) -> list[int]:
        rank = self.plan.site.rank
        return [*range(rank - 2), rank - 1, rank - 2]

    def per_query_head(self, x: str) -> str:
        """A kept [B, Hkv, ...] part with each key/value head repeated for its query heads."""
        groups = self.plan.groups
        if groups == 1:
            return x
        repeated = self("Expand", self("Unsqueeze", x, self.ints(2)), self.ints(1, 1, groups, 1, 1))
        shape = self("Concat", self("Shape", x, end=1), self.ints(self.plan.heads), self("Shape", x, start=2), axis=0)
        return self("Reshape", repeated, shape)

    def as_block(self, x: str) -> str:
        """A step's [B, H, ...] as the window functions' [G, blocks, ...] (rank 3 sites: [G, 1, ...])."""
        return x if self.plan.site.rank == 4 else self("Unsqueeze", x, self.ints(1))


def entry_body(plan: EntryPlan) -> tuple[Body, list[str]]:
    """The entry's body and its outputs: out, then the state after, in the state's order."""
    body = Body(plan)
    outputs = ["out", *(t.output_name for t in plan.state.values())]
    if plan.window is None:
        one_token_or_more(body, plain_step, plain, outputs)
        return body, outputs
    rows = window_rows(body)  # outside the If: what both branches read and return alike
    branched = [name for name in outputs if name not in body.outputs]
    if plan.window.sparse:
        one_token_or_more(body, lambda b: sparse_windowed_step(b, rows), lambda b: sparse_windowed(b, rows), branched)
        return body, outputs
    one_token_or_more(body, lambda b: windowed_step(b, rows), lambda b: windowed(b, rows), branched)
    return body, outputs


def entry_function(plan: EntryPlan, name: str, constants: list[str]):
    """(the entry's callees, then the entry ``name``), each function once."""
    body, outputs = entry_body(plan)
    inputs = ["q", "k", "v", "key_keep", *plan.state, *constants]
    entry = make_function(name, inputs, outputs, body.nodes, plan.opset_version)
    return [*unique_functions(plan.functions), entry]


def one_token_or_more(b: Body, step: Callable[[Body], None], prefill: Callable[[Body], None], outputs: list[str]):
    """The body: If one new token, ``step``, else ``prefill``; both return ``outputs``."""
    one_token = b("Equal", b("Shape", "q", start=-2, end=-1), b.ints(1))
    branches = {
        "then_branch": branch(b.plan, step, "step", outputs),
        "else_branch": branch(b.plan, prefill, "prefill", outputs),
    }
    values = b("If", one_token, outputs=len(outputs), **branches)
    for name, value in zip(outputs, [values] if len(outputs) == 1 else values):
        b.output(name, value)


def branch(plan: EntryPlan, build: Callable[[Body], None], name: str, outputs: list[str]):
    """``build``'s nodes as an If branch graph returning ``outputs``."""
    body = Body(plan, prefix=f"{name}_")
    build(body)
    return body.graph(name, outputs)


def empty_state_log_scale(b: Body, normaliser: str, log_scale: str) -> str:
    """The incoming ``log_scale`` (shaped as ``normaliser`` [..., F] with F as 1), the lowest
    where nothing was absorbed yet (a zero normaliser): so an all-zero state, the one
    generate() and onnxruntime-genai start from, is the initial state too."""
    empty = b("Equal", b("ReduceSum", normaliser, b.ints(-1), keepdims=1), b("Constant", value_float=0.0))
    return b("Where", empty, b("Constant", value_float=LOWEST), log_scale)


def state_outputs(b: Body, new_state: list[str]) -> None:
    """The flat [G, F, Dv] and [G, F] sums (and [G, 1] log scale) as the state's outputs."""
    kv, normaliser, *log_scale = new_state
    kernel_state = b("Concat", kv, b("Unsqueeze", normaliser, b.ints(-1)), axis=-1)
    b.state_output(KERNEL_STATE, b("Reshape", kernel_state, b("Shape", KERNEL_STATE)))
    if log_scale:
        b.state_output(LOG_SCALE, b("Reshape", log_scale[0], b("Shape", LOG_SCALE)))


# --- without a window ----------------------------------------------------------------------------


def plain(b: Body) -> None:
    """N tokens: the chunked causal form continued from the state."""
    plan = b.plan
    terms = b.terms("q", "k", b.keep())
    if plan.delta:
        delta_prefill(b, terms[0], terms[1])
        return
    if plan.rescaled:
        functions = causal_rescaled_linear_attention_from_state_functions(plan.opset_version, plan.chunk, plan.unit.eps)
        inputs = [b.flat(terms[0]), b.flat(terms[1]), b.flat(terms[3]), b.flat("v")]
    else:
        functions = causal_linear_attention_from_state_functions(plan.opset_version, plan.chunk)
        inputs = [b.flat(terms[0]), b.flat(terms[1]), b.flat("v")]
    b.uses(*(f.to_function_proto() for f in functions))
    out, *new_state = b.call(functions[-1], *inputs, *b.flat_state(), outputs=4 if plan.rescaled else 3)
    b.output_flat(out)
    state_outputs(b, new_state)


def plain_step(b: Body) -> None:
    """One token: the kernel state gains phi(k) [v, 1]^T (rank one) and is read once by
    phi(q), numerator and normaliser together; rescaled, it first moves to the new max log
    scale (the chunked form's references at N = 1)."""
    terms = b.terms("q", "k", b.keep())
    phi_q, phi_k, state = terms[0], terms[1], KERNEL_STATE
    if b.plan.delta:
        phi_k = normalised_keys(b, phi_k)
    if b.plan.rescaled:
        log_scale = step_log_scale(b)
        new_log_scale = b("Max", log_scale, b("Squeeze", terms[3], b.ints(-1)))
        held = b("Exp", b("Sub", log_scale, new_log_scale))  # <= 1
        phi_k = b("Mul", phi_k, b("Exp", b("Sub", terms[3], b("Unsqueeze", new_log_scale, b.ints(-1)))))
        state = b("Mul", state, b("Unsqueeze", held, b.ints(-1)))
        b.state_output(LOG_SCALE, b("Squeeze", new_log_scale, b.ints(-1)))
    read, new_state = update_and_read(b, phi_q, phi_k, state)
    b.output("out", b.like_v(normalised(b, read)))
    b.state_output(KERNEL_STATE, new_state)


def step_log_scale(b: Body) -> str:
    """The incoming log scale [..., 1] in the state's own layout (empty_state_log_scale)."""
    normaliser = b("Gather", KERNEL_STATE, b("Constant", value_int=-1), axis=-1)
    return empty_state_log_scale(b, normaliser, b("Unsqueeze", LOG_SCALE, b.ints(-1)))


def update_and_read(b: Body, phi_q: str, phi_k: str, state: str) -> tuple[str, str]:
    """(phi_q S' [..., 1, Dv + 1], S'): S' = state + phi_k^T [v, 1], one token's update; by the
    delta rule S' = state + phi_k^T ([v, 1] - phi_k state), phi_k normalised."""
    values = values_and_ones(b)
    if b.plan.linear_attention_rows:
        read, new_state = linear_attention(b, phi_q, phi_k, values, state)
        # typed again (CastLike: no conversion) for the ONNX checker, which cannot type a contrib
        # operator and then finds the If's branches disagree
        return b("CastLike", read, values), b("CastLike", new_state, state)
    if b.plan.delta:
        values = b("Sub", values, b("MatMul", phi_k, state))
    new_state = b("Add", state, b("MatMul", b("Transpose", phi_k, perm=b.swap_last()), values))
    return b("MatMul", phi_q, new_state), new_state


def linear_attention(b: Body, phi_q: str, phi_k: str, values: str, state: str) -> tuple[str, str]:
    """One token through com.microsoft.LinearAttention. With the heads known, its packed rows
    [B, 1, H X] are a reshape of [B, H, 1, X] and the state [B, H, F, Dv + 1] is its own
    layout, as it lies; else each head of each batch row is a row of its own."""
    features, columns = b.plan.linear_attention_rows
    heads = b.plan.heads if b.plan.site.rank == 4 else None
    if heads:
        rows = [b("Reshape", x, b.ints(0, 1, -1)) for x in (phi_q, phi_k, values)]
        folded = state
    else:
        sized = ((phi_q, features), (phi_k, features), (values, columns))
        rows = [b("Reshape", x, b.ints(-1, 1, size)) for x, size in sized]
        folded = b("Reshape", state, b.ints(-1, 1, features, columns))
    read, new_state = linear_attention_node(b, rows, folded, heads or 1)
    if heads:
        return b("Reshape", read, b.ints(0, heads, 1, columns)), new_state
    return b("Reshape", read, b("Shape", values)), b("Reshape", new_state, b("Shape", state))


def linear_attention_node(b: Body, rows: list[str], state: str, heads: int) -> tuple[str, str]:
    """com.microsoft.LinearAttention of packed rows (q, k, [v, 1]) [B, T, heads X] from ``state``
    [B, heads, F, Dv + 1]: (the reads, the state after), by the plan's update rule (the delta
    rule's beta 1 for every row and head)."""
    beta = []
    if b.plan.delta:
        one = onnx.helper.make_tensor("one", FLOAT, [1], [1.0])
        beta = ["", b("ConstantOfShape", b("Concat", b("Shape", rows[0], end=2), b.ints(1), axis=0), value=one)]
    return b(
        "LinearAttention",
        *rows,
        state,
        *beta,
        outputs=2,
        domain=MICROSOFT,
        q_num_heads=heads,
        kv_num_heads=heads,
        update_rule="delta" if b.plan.delta else "linear",
        scale=1.0,
    )


def normalised_keys(b: Body, phi_k: str) -> str:
    """phi_k over its L2 norm per key (delta_onnx.NormalisedKeys)."""
    function = normalised_keys_function(b.plan.opset_version)
    b.uses(function.to_function_proto())
    return b.call(function, phi_k)


def delta_prefill(b: Body, phi_q: str, phi_k: str) -> None:
    """N tokens of the delta rule from the state: com.microsoft.LinearAttention (each head of
    each batch row a row of its own) where the plan runs it, else DeltaRuleFromState."""
    plan, q, k, v = b.plan, b.flat(phi_q), b.flat(phi_k), b.flat("v")
    if plan.linear_attention_rows:
        features, columns = plan.linear_attention_rows
        state = b("Reshape", KERNEL_STATE, b.ints(-1, 1, features, columns))
        values = b("Pad", v, b.ints(0, 0, 0, 0, 0, 1), b("Constant", value_float=1.0))
        read, new_state = linear_attention_node(b, [q, normalised_keys(b, k), values], state, 1)
        b.output_flat(normalised(b, b("CastLike", read, values)))
        b.state_output(KERNEL_STATE, b("Reshape", b("CastLike", new_state, values), b("Shape", KERNEL_STATE)))
        return
    functions = delta_rule_from_state_functions(plan.opset_version, plan.chunk)
    b.uses(*functions)
    out, *new_state = b(functions[-1].name, q, k, v, *b.flat_state(), outputs=3, domain=DOMAIN)
    b.output_flat(out)
    state_outputs(b, new_state)


def values_and_ones(b: Body) -> str:
    """[v, 1] [..., N, Dv + 1] float32: what the kernel state sums (its last column the normaliser)."""
    pads = b.ints(*[0] * (2 * b.plan.site.rank - 1), 1)
    return b("Pad", b("Cast", "v", to=FLOAT), pads, b("Constant", value_float=1.0))


def normalised(b: Body, read: str) -> str:
    """A read of the kernel state [..., Dv + 1] as numerator / (normaliser + eps)."""
    numerator = b("Slice", read, b.ints(0), b.ints(-1), b.ints(-1))
    denominator = b("Slice", read, b.ints(-1), b.ints(TO_THE_END), b.ints(-1))
    return b("Div", numerator, b("Add", denominator, b("Constant", value_float=b.plan.unit.eps)))


# --- with a window -------------------------------------------------------------------------------


def window_rows(b: Body) -> WindowRows:
    """The rows both branches read (WindowRows), and the window's keys and values after the new
    rows and the next position, which are state outputs."""
    new_keys = ("k", "v", b.keep())
    k, v, keep = new_keys
    k_x = b("Concat", WINDOW_KEYS, b("CastLike", k, WINDOW_KEYS), axis=-2)
    v_x = b("Concat", WINDOW_VALUES, b("CastLike", v, WINDOW_VALUES), axis=-2)
    keep_x = b("Concat", WINDOW_KEEP, keep, axis=-2)
    position = b("Reshape", POSITION, b.ints(1))
    new_rows = b("Shape", "q", start=-2, end=-1)
    next_position = b("Add", position, new_rows)
    b.state_output(WINDOW_KEYS, b.rolled(k_x, new_rows))  # the last 2W - 1 rows
    b.state_output(WINDOW_VALUES, b.rolled(v_x, new_rows))
    b.state_output(POSITION, b("Squeeze", next_position, b.ints(0)))
    return WindowRows(new_keys, k_x, v_x, keep_x, position, new_rows, next_position)


def windowed(b: Body, rows: WindowRows) -> None:
    """N tokens of the window hybrid continued from the state; then the rows behind the next
    query's previous block join the state (it stays block-aligned)."""
    plan = b.plan
    window = plan.window
    k_x, v_x, keep_x = (b.per_query_head(x) for x in (rows.k_x, rows.v_x, rows.keep_x))
    start = b("Sub", rows.position, b.ints(2 * window.size - 1))
    terms = b.terms("q", k_x, keep_x)
    far_phi_k, far_key_log_scale = far_features(b, terms[1], terms[3] if plan.rescaled else None, start)
    inputs = [weighted(b, terms[0]), b.map("q", "q"), far_phi_k, b.map("k", k_x), v_x, keep_x]
    inputs = [*(b.flat(x) for x in inputs), start, *b.flat_state()]
    if plan.rescaled:
        inputs += [b.flat(terms[2]), b.flat(far_key_log_scale)]
    inputs += row_weights_and_sinks(b, terms, rows)
    functions = windowed_kernel_attention_from_state_functions(plan.opset_version, window, plan.site.scale, plan.unit)
    b.uses(*functions)
    b.output_flat(b.call(functions[-1], *inputs))
    absorb_first_rows(b, b("Add", rows.new_rows, window_keep_after(b, rows)), far_phi_k, v_x, far_key_log_scale)


def weighted(b: Body, phi_q: str) -> str:
    """phi_q times the kernel part's weight w_h = exp(linear_log_weight)."""
    return b("Mul", phi_q, b("Exp", b("Cast", "linear_log_weight", to=FLOAT)))


def row_weights_and_sinks(b: Body, terms: list[str], rows: WindowRows) -> list[str]:
    """A windowed prefill's last inputs: beta_h for each query row (max weighted units), then
    the sinks (sinks())."""
    extra = []
    if b.plan.unit.max_weighted:
        extra.append(b.flat(b("Expand", b("Cast", "local_max_weight", to=FLOAT), b("Shape", terms[2]))))
    if b.plan.window.sinks:
        extra += sinks(b, rows)
    return extra


def window_keep_after(b: Body, rows: WindowRows) -> str:
    """The window's keep flags after the new rows, a state output: 0 on the rows behind the
    next query's previous block, which have left the window. Returns their count ([1])."""
    w = b.plan.window.size
    behind = b("Sub", b.ints(w - 1), b("Mod", rows.next_position, b.ints(w)))
    kept_rows = b("Constant", value=numpy_helper.from_array(np.arange(2 * w - 1).reshape(-1, 1)))
    in_reach = b("Cast", b("GreaterOrEqual", kept_rows, behind), to=FLOAT)
    b.state_output(WINDOW_KEEP, b("Mul", b.rolled(rows.keep_x, rows.new_rows), in_reach))
    return behind


def sparse_windowed(b: Body, rows: WindowRows) -> None:
    """N tokens of the window with a sparse cache (window/onnx_sparse.py's block loop): the
    cache's pairs are rows in front of the window's, and the blocks that leave by the next
    position go into the cache or the kernel state."""
    plan, window = b.plan, b.plan.window
    pairs = [b("Concat", name, x, axis=-2) for name, x in zip(CACHE_PARTS, (rows.k_x, rows.v_x, rows.keep_x))]
    k_x, v_x, keep_x = (b.per_query_head(x) for x in pairs)
    terms = b.terms("q", k_x, keep_x)
    inputs = [weighted(b, terms[0]), b.map("q", "q"), b.map("k", k_x), v_x, terms[1]]
    if plan.rescaled:
        inputs.append(terms[3])
    start = b("Sub", rows.position, b.ints(2 * window.size - 1))
    inputs = [*(b.flat(x) for x in [*inputs, keep_x, *pairs]), start, *b.flat_state()]
    if plan.rescaled:
        inputs.append(b.flat(terms[2]))
    inputs += row_weights_and_sinks(b, terms, rows)
    functions = sparse_from_state_functions(plan.opset_version, window, plan.site.scale, plan.unit)
    b.uses(*functions)
    out, *after = b(functions[-1].name, *inputs, outputs=len(sparse_from_state_outputs(plan.unit)), domain=DOMAIN)
    b.output_flat(out)
    state_outputs(b, after[:-3])
    for name, value in zip(CACHE_PARTS, after[-3:]):
        b.state_output(name, b("Reshape", b("CastLike", value, name), b("Shape", name)))
    window_keep_after(b, rows)


def far_features(b: Body, phi_k: str, key_log_scale: str | None, start: str):
    """far_key_features: the sinks' features zero, their log scales the lowest."""
    sink_count = b.plan.window.sinks
    if not sink_count:
        return phi_k, key_log_scale
    without = without_sinks_from_function(b.plan.opset_version, sink_count)
    b.uses(without.to_function_proto())
    far_phi_k = b.call(without, phi_k, b("Constant", value_float=0.0), start)
    if key_log_scale is None:
        return far_phi_k, None
    return far_phi_k, b.call(without, key_log_scale, b("Constant", value_float=LOWEST), start)


def sinks(b: Body, rows: WindowRows) -> list[str]:
    """The sinks with the new tokens' filled in, flattened for the kernel (keys mapped);
    their outputs are the state's."""
    sinks_after = sinks_after_function(b.plan.opset_version)
    b.uses(sinks_after.to_function_proto())
    new = []
    for name, x in zip(SINK_PARTS, rows.new_keys):
        new.append(b.call(sinks_after, name, x, rows.position))
        b.state_output(name, new[-1])
    k, v, keep = (b.per_query_head(x) for x in new)
    return [b.flat(b.map("k", k)), b.flat(v), b.flat(keep)]


def absorb_first_rows(b: Body, count: str, far_phi_k: str, v_x: str, far_key_log_scale: str | None) -> None:
    """The first ``count`` rows ([1]) of the window's keys join the kernel state."""
    zero, one = b.ints(0), b.ints(1)

    def leaving(x):
        return b("Slice", b.flat(x), zero, count, one)

    absorb, absorb_rescaled = absorb_keys_functions(b.plan.opset_version)
    if b.plan.rescaled:
        b.uses(absorb_rescaled.to_function_proto())
        inputs = [leaving(far_phi_k), leaving(far_key_log_scale), leaving(v_x)]
        new_state = b.call(absorb_rescaled, *inputs, *b.flat_state(), outputs=3)
    else:
        b.uses(absorb.to_function_proto())
        new_state = b.call(absorb, leaving(far_phi_k), leaving(v_x), *b.flat_state(), outputs=2)
    state_outputs(b, new_state)


def windowed_step(b: Body, rows: WindowRows, at_block_end: Callable[[Body], None] | None = None) -> None:
    """One token of the window hybrid: exact softmax over the window's kept rows and the
    sinks before its blocks, the kernel over the state alone, which holds every key before
    the query's previous block (the state is block-aligned); at a block's last position the
    previous block joins the state (``at_block_end``, by default block_joins_state), the only
    features of keys computed."""
    plan = b.plan
    mapped_q = b.map("q", "q")
    terms = b.query_terms(mapped_q)  # the key's features wait for its block to join the state
    step = window_step_functions(plan.opset_version, plan.window, plan.site.scale, plan.unit)
    b.uses(*(proto for f in step for proto in _protos(f)))
    # grouped heads: each group's queries are the rows of one query block over its key/value
    # head's keys as kept, so nothing kept is repeated (learned key maps are per query head)
    grouped = plan.groups > 1 and not plan.mapped
    local = local_sums(b, step, rows, mapped_q, grouped)
    weighted_q = weighted(b, terms[0])
    read = b.as_block(b("MatMul", weighted_q, KERNEL_STATE))  # the far keys': all in the state
    minus_one = b.ints(-1)
    far = [
        b("Slice", read, b.ints(0), minus_one, minus_one),
        b("Slice", read, minus_one, b.ints(TO_THE_END), minus_one),
    ]
    if plan.rescaled:
        weight = b("Constant", value_float=1.0)
        if plan.unit.max_weighted:  # [heads, 1, 1]: broadcast over the rows
            weight = b.as_block(b("Cast", "local_max_weight", to=FLOAT))
        mixed = b.call(step.mix, *local, *far, read_log_scale(b, far[1]), b.as_block(terms[1]), weight)
    else:
        mixed = b.call(step.mix, local[0], local[1], *far)
    if plan.site.rank == 3:
        mixed = b("Squeeze", mixed, b.ints(1))
    b.output("out", b.like_v(mixed))
    if at_block_end is None:
        block_joins_state(b, rows)
    else:
        at_block_end(b)


def sparse_windowed_step(b: Body, rows: WindowRows) -> None:
    """One token of the window with a sparse cache: windowed_step with the cache's pairs as
    more exact keys in front of the window's rows; at a block's last position the window's
    first block leaves into the cache or the kernel state (block_leaves)."""
    cached = [b("Concat", name, x, axis=-2) for name, x in zip(CACHE_PARTS, (rows.k_x, rows.v_x, rows.keep_x))]
    with_cache = WindowRows(rows.new_keys, *cached, rows.position, rows.new_rows, rows.next_position)
    windowed_step(b, with_cache, at_block_end=lambda inner: block_leaves(inner, rows))


def block_leaves(b: Body, rows: WindowRows) -> None:
    """At a block's last position the window's first block leaves (block_end): of its real keys
    that are no sink and the cache's pairs, the G the kernel state recalls worst are the cache
    after, the others join the state (onnx_sparse.leave_block)."""
    plan, w = b.plan, b.plan.window.size

    def leaves(inner: Body):
        leaving = [
            inner("Slice", x, inner.ints(0), inner.ints(w), inner.ints(-2)) for x in (rows.k_x, rows.v_x, rows.keep_x)
        ]
        pairs = [inner("Concat", name, x, axis=-2) for name, x in zip(CACHE_PARTS, leaving)]  # [B, Hkv, G + W, *]
        k, v, keep = (inner.per_query_head(x) for x in pairs)
        terms = inner.terms("q", k, keep)
        start = inner("Sub", rows.position, inner.ints(2 * w - 1))  # the leaving block's first position
        candidates = Candidates(
            inner.flat(v),
            inner.flat(terms[1]),
            inner.flat(terms[3]) if plan.rescaled else None,
            leaving_candidates(inner, pairs[2], start),
        )
        absorb = absorb_keys_functions(plan.opset_version)[1 if plan.rescaled else 0]
        inner.uses(*(f.to_function_proto() for f in with_callees(absorb)))
        cache_keep = inner.flat(CACHE_PARTS[2])
        state, index, held = leave_block(
            inner, plan.window, plan.unit, absorb, candidates, inner.flat_state(), cache_keep
        )
        state_outputs(inner, state)
        for name, x in zip(CACHE_PARTS[:2], pairs[:2]):
            kept = gathered_rows(inner, inner.flat(x), index)
            inner.state_output(name, inner("Reshape", inner("CastLike", kept, name), inner("Shape", name)))
        kept = inner("Unsqueeze", inner("Cast", held, to=FLOAT), inner.ints(-1))
        inner.state_output(CACHE_PARTS[2], inner("Reshape", kept, inner("Shape", CACHE_PARTS[2])))

    block_end(b, rows, leaves, CACHE_PARTS)


def leaving_candidates(b: Body, pair_keep: str, start: str) -> str:
    """[Gkv, G + W] bool, as leave_block reads it: which of the leaving block's rows (positions
    start ..) may enter the cache, its real keys that are no sink, after G flags for the cache's
    own pairs, which are never read (their slots say which hold one)."""
    size, w = b.plan.window.sparse, b.plan.window.size
    real = b("Greater", b("Squeeze", b.flat(pair_keep), b.ints(-1)), b("Constant", value_float=0.0))
    position = b("Add", b("Constant", value=numpy_helper.from_array(np.arange(-size, w))), start)
    return b("And", real, b("GreaterOrEqual", position, b.ints(b.plan.window.sinks)))


def local_sums(b: Body, step, rows: WindowRows, mapped_q: str, grouped: bool) -> list[str]:
    """A step's exact part over the window's kept rows and the sinks: (numerator, normaliser,
    max) of its query, [..., 1, *] as the step's mix reads them."""
    as_block = b.as_block

    def exact(x):
        return x if grouped else b.per_query_head(x)

    keys = [as_block(b.map("k", exact(rows.k_x))), as_block(exact(rows.v_x))]
    keep = rows.keep_x
    if b.plan.window.sinks:
        sink_k, sink_v, sink_keep = step_sinks(b, rows)
        keys += [as_block(b.map("k", exact(sink_k))), as_block(exact(sink_v))]
        keep = b("Concat", keep, sink_keep, axis=-2)
    kept = as_block(b("Transpose", exact(keep), perm=b.swap_last()))  # [..., 1, keys]: one query's
    query = grouped_queries(b, mapped_q) if grouped else as_block(mapped_q)
    local = b.call(step.local_sums, query, *keys, kept, outputs=3)
    if grouped:
        local = [b("Reshape", x, b.ints(0, b.plan.heads, 1, -1)) for x in local]
    return local


def grouped_queries(b: Body, q: str) -> str:
    """A step's queries [B, H, 1, D] as [B, Hkv, groups, D]: each group's as rows."""
    groups = b.plan.groups
    return b("Reshape", q, b.ints(0, b.plan.heads // groups, groups, -1))


def read_log_scale(b: Body, far_den: str) -> str:
    """The incoming log scale as a step's read of the kernel state (normaliser ``far_den``,
    [G, blocks, 1, 1]) takes it: the lowest where the read's normaliser is 0. Positive
    features read 0 from a state that absorbed nothing (empty_state_log_scale's rule, without
    reading the state's normaliser column again), or where exp(linear_log_weight) underflows,
    when the far part adds nothing either way."""
    log_scale = b.as_block(b("Unsqueeze", LOG_SCALE, b.ints(-2, -1)))
    empty = b("Equal", far_den, b("Constant", value_float=0.0))
    return b("Where", empty, b("Constant", value_float=LOWEST), log_scale)


def step_sinks(b: Body, rows: WindowRows) -> tuple[str, str, str]:
    """The sinks with the new token's filled in (outputs of the state), and their keep flags
    as the query takes them: 0 for a sink still among the window's rows, that is, not before
    the query's previous block (sink s is taken from position (s // W + 2) W on)."""
    w, sink_count, position = b.plan.window.size, b.plan.window.sinks, rows.position
    sink_rows = np.arange(sink_count).reshape(-1, 1)
    new = b("Equal", b("Constant", value=numpy_helper.from_array(sink_rows)), position)
    after = {}
    for name, x in zip(SINK_PARTS, rows.new_keys):
        after[name] = b("Where", new, b("CastLike", x, name), name)
        b.state_output(name, after[name])
    taken_from = b("Constant", value=numpy_helper.from_array((sink_rows // w + 2) * w))
    outside = b("LessOrEqual", taken_from, position)
    taken = b("Where", outside, after[SINK_KEEP], b("Constant", value_float=0.0))
    return after[SINK_PARTS[0]], after[SINK_PARTS[1]], taken


def block_joins_state(b: Body, rows: WindowRows) -> None:
    """At a block's last position (the next one starts a block) the previous block (the
    window's first W rows) joins the kernel state (block_end)."""

    def joins(inner: Body):
        first = [
            inner("Slice", x, inner.ints(0), inner.ints(b.plan.window.size), inner.ints(-2))
            for x in (rows.k_x, rows.v_x, rows.keep_x)
        ]
        k, v, keep = (inner.per_query_head(x) for x in first)
        terms = inner.terms("q", k, keep)
        start = inner("Sub", rows.position, inner.ints(2 * b.plan.window.size - 1))  # k_x's first row's
        far_phi_k, far_log_scale = far_features(inner, terms[1], terms[3] if b.plan.rescaled else None, start)
        absorb_first_rows(inner, inner.ints(b.plan.window.size), far_phi_k, v, far_log_scale)

    block_end(b, rows, joins)


def block_end(b: Body, rows: WindowRows, leave: Callable[[Body], None], parts: tuple[str, ...] = ()) -> None:
    """At a block's last position the window's first W rows leave it: ``leave`` writes the
    kernel state after (and ``parts``, the other state parts it changes) and their keep flags
    turn 0; else all of them are carried as they came."""
    w = b.plan.window.size
    carried_parts = [KERNEL_STATE, *([LOG_SCALE] if b.plan.rescaled else []), *parts]
    names = [b.plan.state[name].output_name for name in [*carried_parts, WINDOW_KEEP]]

    def leaves(inner: Body):
        leave(inner)
        left = numpy_helper.from_array(np.repeat([[0.0], [1.0]], [w - 1, w], axis=0).astype(np.float32))
        kept = inner("Mul", inner.rolled(rows.keep_x, inner.ints(1)), inner("Constant", value=left))
        inner.state_output(WINDOW_KEEP, kept)

    def carried(inner: Body):
        for name in carried_parts:
            inner.state_output(name, name)
        inner.state_output(WINDOW_KEEP, inner.rolled(rows.keep_x, inner.ints(1)))

    at_block_end = b("Equal", b("Mod", rows.next_position, b.ints(w)), b.ints(0))
    branches = {
        "then_branch": branch(b.plan, leaves, "joins", names),
        "else_branch": branch(b.plan, carried, "carried", names),
    }
    for name, value in zip(names, b("If", at_block_end, outputs=len(names), **branches)):
        b.output(name, value)


def _protos(function) -> list:
    return [f.to_function_proto() for f in with_callees(function)]
