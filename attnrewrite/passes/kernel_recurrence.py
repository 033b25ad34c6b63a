"""The kernel methods' recurrent form (linear, hedgehog, favor; window included): causal kernel
attention carries a fixed-size state instead of a KV cache, S_t = S_{t-1} + phi(k_t) v_t^T,
z_t = z_{t-1} + phi(k_t), o_t = phi(q_t)^T S_t / phi(q_t)^T z_t. The N new tokens run the
chunked causal form seeded with the incoming state (kernel/state.py, window/torch_state.py and
window/onnx_state.py), and the outgoing state is the last prefix.

Per layer the state is (KernelRecurrence.state):
- ``kernel_state`` sum phi(k) v^T [B, H, F, Dv] and ``normaliser`` sum phi(k) [B, H, F], float32;
- a rescaled kernel (FAVOR+, hedgehog's window: KernelUnit.rescaled): ``log_scale`` [B, H]
  float32, the max of the absorbed keys' log scales, which the two sums are relative to (the
  parallel causal form's running max, kernel.parallel.causal_rescaled_linear_attention), the
  lowest log scale before any key;
- with a window of W: the last 2W - 1 keys and values with their keep flags (``window_keys``
  [B, H, 2W-1, D], ``window_values`` [B, H, 2W-1, Dv], ``window_keep`` [B, H, 2W-1, 1]), which a
  later query can still take exactly: a query of block c takes blocks c-1 and c, and blocks are
  aligned to sequence positions, so a key leaves the window (into the kernel state) once it is
  2W - 1 positions old; the sinks (``sink_keys``, ``sink_values``, ``sink_keep``, positions
  0..sinks-1, kept from the tokens that had them); and ``position`` (int64 []), the positions
  consumed so far, padding included (blocks and sinks are positions of the padded sequence).
Sizes are fixed in the context length. Padded keys (key_keep 0) never enter a state.

A method declares its form (its ``recurrence(options)``) with what only it knows: its causal
terms in torch and in ONNX (features, and log scales where its unit has them), its feature
count, and its lowering's constants.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import numpy as np
from onnx import numpy_helper
from onnxscript import script

from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.query_key_maps import QUERY_KEY_MAPS, map_queries_and_keys
from attnrewrite.passes.kernel.state import (
    KernelState,
    absorb_keys,
    absorb_keys_functions,
    causal_linear_attention_from_state,
    causal_linear_attention_from_state_functions,
    causal_rescaled_linear_attention_from_state,
    causal_rescaled_linear_attention_from_state_functions,
)
from attnrewrite.passes.layout import expand_to_query_heads, flatten_heads_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    FLOAT,
    MICROSOFT,
    TO_THE_END,
    FunctionNodes,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.recurrent import (
    Recurrence,
    RecurrentLowering,
    StateTensor,
    key_value_axes,
    key_value_groups,
    leading_axes,
    state_shape,
)
from attnrewrite.passes.window.onnx_state import (
    window_step_functions,
    windowed_kernel_attention_from_state_functions,
    without_sinks_from_function,
)
from attnrewrite.passes.window.settings import KernelScales, KernelUnit, Window
from attnrewrite.passes.window.torch_state import SinkKeys, far_key_features, windowed_kernel_attention_from_state
from attnrewrite.site import AttentionSite

LOWEST = LOWEST_LOG_SCALE
SINK_PARTS = ("sink_keys", "sink_values", "sink_keep")  # the state's sinks: keys, values, keep flags


class CausalTerms(typing.NamedTuple):
    """What a method's causal form reads of q, k and keep: features in float32 (phi_k zero on
    padded keys) and, for a rescaled unit, the log scales (padded keys LOWEST) and hedgehog's
    local_max_weight."""

    phi_q: typing.Any
    phi_k: typing.Any
    query_log_scale: typing.Any = None
    key_log_scale: typing.Any = None
    local_max_weight: typing.Any = None


@dataclasses.dataclass(frozen=True)
class KernelRecurrence(Recurrence):
    """A kernel method's recurrent form under ``options``. ``entry``: the name the ONNX entry
    ends in (Recurrent[Windowed]<entry>); ``unit``: how its kernel part is scaled (a rescaled one
    carries a log scale); ``feature_count(site)``: F ("F" where unknown); ``torch_terms(parallel
    module, q, k, keep) -> CausalTerms``; ``onnx_terms(site, options, opset_version) ->
    (function, its constants)``, the function (q, k, keep, *constants) -> (phi_q, phi_k[, query
    log scale, key log scale]), and ``onnx_query_terms`` the same for the query alone, (q,
    *constants) -> phi_q[, query log scale] (a windowed step's); ``constants(site, options,
    weights)``: the parallel lowering's constants, by name and in order."""

    options: typing.Any
    entry: str
    unit: KernelUnit
    feature_count: Callable[[AttentionSite], int | str]
    torch_terms: Callable[..., CausalTerms]
    onnx_terms: Callable
    onnx_query_terms: Callable
    constants: Callable[..., dict]

    @property
    def window(self) -> Window | None:
        return Window.of(self.options)

    def state(self, site: AttentionSite) -> list[StateTensor]:
        lead, f = leading_axes(site), self.feature_count(site)
        state = [
            StateTensor(
                "kernel_state",
                (*lead, f, "Dv+1"),
                "float32",
                0.0,
                "sum of phi(k) [v, 1]^T over absorbed keys: sum phi(k) v^T, and sum phi(k) (the normaliser) as the last column",
            )
        ]
        if self.unit.rescaled:
            state.append(
                StateTensor("log_scale", lead, "float32", LOWEST, "max log scale of absorbed keys: the sums' reference")
            )
        window = self.window
        if window is None:
            return state
        kept, kv = 2 * window.size - 1, key_value_axes(site)  # keys and values once per key/value head
        state += [
            StateTensor("window_keys", (*kv, kept, "D"), "model", 0.0, f"the last {kept} keys"),
            StateTensor("window_values", (*kv, kept, "Dv"), "model", 0.0, f"the last {kept} values"),
            StateTensor("window_keep", (*kv, kept, 1), "float32", 0.0, "1.0 where those keys are kept"),
        ]
        if window.sinks:
            state += [
                StateTensor("sink_keys", (*kv, window.sinks, "D"), "model", 0.0, "the keys at positions < sinks"),
                StateTensor("sink_values", (*kv, window.sinks, "Dv"), "model", 0.0, "their values"),
                StateTensor("sink_keep", (*kv, window.sinks, 1), "float32", 0.0, "1.0 where those keys are kept"),
            ]
        return [*state, StateTensor("position", (), "int64", 0, "positions consumed, padding included")]

    def torch_module(self, site: AttentionSite, parallel) -> RecurrentKernelAttention:
        return RecurrentKernelAttention(parallel, self, self.state(site), self.key_value_groups(site))

    def key_value_groups(self, site: AttentionSite) -> int:
        """The groups of query heads whose keys and values a window keeps once (key_value_groups):
        its module and lowering take k and v with the key/value heads; without a window, q's."""
        return key_value_groups(site) if self.window is not None else 1

    def onnx_lowering(
        self, site: AttentionSite, opset_version: int, weights: dict | None = None, contrib_ops: bool = False
    ) -> RecurrentLowering:
        """The recurrent form as ONNX, the state in ``state``'s order. The constants are the
        parallel lowering's, without building it. With ``contrib_ops`` a step updates and reads
        the kernel state with com.microsoft.LinearAttention (where the feature count and the
        value dim are known); the prefill stays the chunked form, faster on CPU (docs/cli.md)."""
        constants = self.constants(site, self.options, weights)
        description = self.state(site)
        state = [t.name for t in description]
        glue = _Glue(self, site, opset_version, QUERY_KEY_MAPS[0] in constants, contrib_ops)
        windowed = self.window is not None
        outputs = ["out", *(f"{s}_out" for s in state)]
        if windowed:
            glue.window_rows()  # outside the If: what both branches read and return alike
            branched = [name for name in outputs if name not in glue.body.outputs]
            glue.one_token_or_more(glue.windowed_step, glue.windowed, branched)
        else:
            glue.one_token_or_more(glue.plain_step, glue.plain, outputs)
        name = ("Learned" if glue.mapped else "") + "Recurrent" + ("Windowed" if windowed else "")
        entry = make_function(
            name + self.entry, ["q", "k", "v", "key_keep", *state, *constants], outputs, glue.body.nodes, opset_version
        )
        return RecurrentLowering([*_unique(glue.functions), entry], constants, description, glue.groups)


# --- torch -------------------------------------------------------------------------------------


class RecurrentKernelAttention(Module):
    """forward(q, k, v, key_keep, *state) -> (out, *state): the N new tokens' outputs (q, k, v
    [..., N, *], k and v with q's heads, or their key/value heads where ``groups`` > 1 query heads
    share each (KernelRecurrence.key_value_groups); key_keep [..., 1 or heads, N, 1] or None) and
    the state after them, in KernelRecurrence.state's order. The parallel module (``parallel``, a
    child) holds every parameter and buffer, so a fitted one is used as it is."""

    def __init__(self, parallel, recurrence: KernelRecurrence, description: list[StateTensor], groups: int = 1):
        super().__init__()
        self.parallel = parallel
        self.recurrence = recurrence
        self.window = recurrence.window
        self.description = description
        self.groups = groups

    def forward(self, q, k, v, key_keep=None, *state):
        keep = torch.ones_like(k[..., :1], dtype=torch.float32) if key_keep is None else key_keep.float()
        keep = keep.expand(*k.shape[:-1], 1)
        state = dict(zip((t.name for t in self.description), state))
        step = self._windowed if self.window else self._plain
        out, state = step(q, k, v, keep, state)
        return (out.to(v.dtype), *(state[t.name] for t in self.description))

    def initial_state(self, q, v) -> tuple:
        """The zero state for queries and values shaped like q and v (their shapes, dtype and
        device are all it reads)."""
        sizes = {"D": q.shape[-1], "Dv": v.shape[-1], "F": q.shape[-1]}  # F unknown only for linear: d
        sizes.update(zip(("B", "H") if q.dim() == 4 else ("G",), q.shape[:-2]))
        if q.dim() == 4:
            sizes["Hkv"] = q.shape[1] // self.groups
        dtypes = {"float32": torch.float32, "int64": torch.int64, "model": v.dtype}
        return tuple(
            torch.full(state_shape(t, sizes), t.initial, dtype=dtypes[t.dtype], device=v.device)
            for t in self.description
        )

    def _terms(self, q, k, keep) -> CausalTerms:
        return self.recurrence.torch_terms(self.parallel, q, k, keep)

    def _plain(self, q, k, v, keep, state):
        q, k = map_queries_and_keys(self.parallel, q, k)
        terms = self._terms(q, k, keep)
        absorbed = _absorbed(state)
        chunk, eps = self.parallel.chunk, self.recurrence.unit.eps
        if terms.key_log_scale is None:
            out, absorbed = causal_linear_attention_from_state(
                terms.phi_q, terms.phi_k, v.float(), absorbed, chunk, eps
            )
        else:
            out, absorbed = causal_rescaled_linear_attention_from_state(
                terms.phi_q, terms.phi_k, terms.key_log_scale, v.float(), absorbed, chunk, eps
            )
        return out, _with_kernel_state(state, absorbed)

    def _windowed(self, q, k, v, keep, state):
        n, position = q.shape[-2], int(state["position"])
        kept_k_x = torch.cat([state["window_keys"], k.to(state["window_keys"].dtype)], dim=-2)
        kept_v_x = torch.cat([state["window_values"], v.to(state["window_values"].dtype)], dim=-2)
        kept_keep_x = torch.cat([state["window_keep"], keep], dim=-2)
        k_x, v_x, keep_x = (expand_to_query_heads(x, q) for x in (kept_k_x, kept_v_x, kept_keep_x))
        start = position - state["window_keys"].shape[-2]  # the position of k_x's first row
        sinks = self.window.sinks
        kept_sinks = _with_new_sinks(state, k, v, keep, position) if sinks else None
        sink_keys = None if kept_sinks is None else SinkKeys(*(expand_to_query_heads(x, q) for x in kept_sinks))
        q, mapped_k_x = map_queries_and_keys(self.parallel, q, k_x)  # the window keeps k unmapped
        terms = self._terms(q, mapped_k_x, keep_x)
        far_phi_k, far_key_log_scale = far_key_features(terms.phi_k, terms.key_log_scale, start, sinks)
        absorbed = _absorbed(state)
        scales = KernelScales(
            self.parallel.linear_log_weight, terms.query_log_scale, far_key_log_scale, terms.local_max_weight
        )
        out = windowed_kernel_attention_from_state(
            terms.phi_q,
            far_phi_k,
            q,
            mapped_k_x,
            v_x,
            keep_x,
            self.window,
            start=start,
            sink_keys=None if sink_keys is None else sink_keys._replace(k=self._mapped_keys(q, sink_keys.k)),
            far=absorbed,
            scale=self.parallel.scale,
            scales=scales,
            eps=self.recurrence.unit.eps,
        )
        # the state stays block-aligned: the rows behind the next query's previous block join it
        # too (their keep flags turn 0), so a decoding step reads the state alone for the far keys
        behind = self.window.size - 1 - (position + n) % self.window.size
        joining = n + behind
        leaving = None if far_key_log_scale is None else far_key_log_scale[..., :joining, :]
        absorbed = absorb_keys(absorbed, far_phi_k[..., :joining, :], v_x[..., :joining, :], leaving)
        state = _with_kernel_state(state, absorbed)
        window_keep = torch.cat([torch.zeros_like(kept_keep_x[..., :behind, :]), kept_keep_x[..., joining:, :]], dim=-2)
        state.update(window_keys=kept_k_x[..., n:, :], window_values=kept_v_x[..., n:, :], window_keep=window_keep)
        if kept_sinks is not None:
            state.update(sink_keys=kept_sinks.k, sink_values=kept_sinks.v, sink_keep=kept_sinks.keep)
        state["position"] = state["position"] + n
        return out, state

    def _mapped_keys(self, q, k):
        return map_queries_and_keys(self.parallel, q, k)[1]

    def extra_repr(self) -> str:
        return f"method={self.recurrence.options.method_name}, state={[t.name for t in self.description]}"


def _absorbed(state: dict) -> KernelState:
    """The state's kernel part as KernelState (kernel_state's last column is the normaliser)."""
    return KernelState(state["kernel_state"][..., :-1], state["kernel_state"][..., -1], state.get("log_scale"))


def _with_kernel_state(state: dict, absorbed: KernelState) -> dict:
    state = dict(state, kernel_state=torch.cat([absorbed.kv, absorbed.key_sum.unsqueeze(-1)], dim=-1))
    if absorbed.log_scale is not None:
        state["log_scale"] = absorbed.log_scale
    return state


def _with_new_sinks(state: dict, k, v, keep, position: int) -> SinkKeys:
    """The sinks with those among the N new positions (position .. position + N - 1) filled in."""
    sinks, n = state["sink_keys"].shape[-2], k.shape[-2]
    row = torch.arange(sinks, device=k.device) - position  # sink s is new row s - position
    new = ((row >= 0) & (row < n)).unsqueeze(-1)
    rows = row.clamp(0, n - 1)

    def fill(x, old):
        return torch.where(new, x.index_select(-2, rows).to(old.dtype), old)

    return SinkKeys(fill(k, state["sink_keys"]), fill(v, state["sink_values"]), fill(keep, state["sink_keep"]))


# --- ONNX --------------------------------------------------------------------------------------


class _Glue:
    """The entry's body, node by node: its inputs depend on the options."""

    def __init__(
        self, recurrence: KernelRecurrence, site: AttentionSite, opset_version: int, mapped: bool, contrib_ops: bool
    ):
        self.site, self.opset_version, self.mapped = site, opset_version, mapped
        features, columns = recurrence.feature_count(site), site.value_dim
        # LinearAttention with each head of each batch row as its own row: their sizes fixed
        known = contrib_ops and isinstance(features, int) and columns is not None
        self.linear_attention_rows = (features, columns + 1) if known else None
        self.options, self.unit, self.window = recurrence.options, recurrence.unit, recurrence.window
        self.groups, self.heads = recurrence.key_value_groups(site), site.num_heads
        self.body = FunctionNodes()
        self.rescaled = self.unit.rescaled
        self.terms, self.terms_constants = recurrence.onnx_terms(site, self.options, opset_version)
        self.query_terms, self.query_terms_constants = recurrence.onnx_query_terms(site, self.options, opset_version)
        self.flatten = flatten_heads_function(opset_version)
        self.functions = [self.flatten.to_function_proto(), *_protos(self.terms), *_protos(self.query_terms)]
        self._flat_state, self._flats = None, {}

    def one_token_or_more(self, step, prefill, outputs: list[str]) -> None:
        """The body: If one new token, ``step`` (a decoding step: what one token needs, nothing
        chunked), else ``prefill`` (the chunked form); both return ``outputs``."""
        b = self.body
        one_token = b("Equal", b("Shape", "q", start=-2, end=-1), b.ints(1))
        branches = {
            "then_branch": self.branch(step, "step", outputs),
            "else_branch": self.branch(prefill, "prefill", outputs),
        }
        values = b("If", one_token, outputs=len(outputs), **branches)
        for name, value in zip(outputs, [values] if len(outputs) == 1 else values):
            b.output(name, value)

    def branch(self, build, name: str, outputs: list[str]):
        """``build``'s nodes as an If branch graph returning ``outputs``."""
        saved = self.body, self._flat_state, self._flats
        self.body, self._flat_state, self._flats = FunctionNodes(prefix=f"{name}_"), None, {}
        try:
            build()
            return self.body.graph(name, outputs)
        finally:
            self.body, self._flat_state, self._flats = saved

    def call_terms(self, q, k, keep):
        """(phi_q, phi_k[, query log scale, key log scale]) of the method, q and k mapped
        first where the module has query/key maps."""
        q, k = self.map("q", q), self.map("k", k)
        return self.body.call(self.terms, q, k, keep, *self.terms_constants, outputs=4 if self.rescaled else 2)

    def call_query_terms(self, mapped_q: str):
        """(phi_q[, query log scale]): a step's query's terms alone, of the query as mapped."""
        outputs = 2 if self.rescaled else 1
        return self.body.call(self.query_terms, mapped_q, *self.query_terms_constants, outputs=outputs)

    def map(self, which: str, x: str) -> str:
        if not self.mapped:
            return x
        return self.body("MatMul", self.body("Cast", x, to=FLOAT), "query_map" if which == "q" else "key_map")

    def flat(self, x: str) -> str:
        """x flattened to [G, N, F], once per value: in an If's branch onnxruntime ran each
        repeated FlattenHeads of one value again (3 per windowed prefill)."""
        if x not in self._flats:
            self._flats[x] = self.body.call(self.flatten, x)
        return self._flats[x]

    def flat_state(self) -> list[str]:
        """The incoming kernel state's sum phi(k) v^T and normaliser (and log_scale) as [G, F,
        Dv], [G, F] (and [G, 1]), flattened once."""
        if self._flat_state is None:
            b = self.body
            flat = self.flat("kernel_state")
            normaliser = b("Gather", flat, b("Constant", value_int=-1), axis=-1)
            self._flat_state = [b("Slice", flat, b.ints(0), b.ints(-1), b.ints(-1)), normaliser]
            if self.rescaled:
                log_scale = b("Reshape", "log_scale", b.ints(-1, 1))
                self._flat_state.append(self.empty_state_log_scale(normaliser, log_scale))
        return self._flat_state

    def empty_state_log_scale(self, normaliser: str, log_scale: str) -> str:
        """The incoming ``log_scale`` (shaped as ``normaliser`` [..., F] with F as 1), the lowest
        where nothing was absorbed yet (a zero normaliser): so an all-zero state, the one
        generate() and onnxruntime-genai start from, is the initial state too."""
        b = self.body
        empty = b("Equal", b("ReduceSum", normaliser, b.ints(-1), keepdims=1), b("Constant", value_float=0.0))
        return b("Where", empty, b("Constant", value_float=LOWEST), log_scale)

    def state_outputs(self, new_state: list[str]) -> None:
        """The flat [G, F, Dv] and [G, F] sums (and [G, 1] log scale) as the state's outputs."""
        b = self.body
        kv, normaliser, *log_scale = new_state
        kernel_state = b("Concat", kv, b("Unsqueeze", normaliser, b.ints(-1)), axis=-1)
        b.output("kernel_state_out", b("Reshape", kernel_state, b("Shape", "kernel_state")))
        if log_scale:
            b.output("log_scale_out", b("Reshape", log_scale[0], b("Shape", "log_scale")))

    def output(self, out_flat: str) -> None:
        b = self.body
        shape = b("Concat", b("Shape", "q", end=-1), b("Shape", "v", start=-1), axis=0)
        b.output("out", self.like_v(b("Reshape", out_flat, shape)))

    def like_v(self, out: str) -> str:
        """The float32 output in v's type: as it is at a float32 site (onnxruntime keeps a Cast
        to the same type as a node of its own)."""
        return out if self.site.dtype == "float32" else self.body("CastLike", out, "v")

    def keep(self) -> str:
        """key_keep as float32 with k's leading axes: [..., N, 1]."""
        b = self.body
        return b("Expand", b("Cast", "key_keep", to=FLOAT), b("Concat", b("Shape", "k", end=-1), b.ints(1), axis=0))

    def plain_step(self) -> None:
        """One token: the kernel state gains phi(k) [v, 1]^T (rank one) and is read once by
        phi(q), numerator and normaliser together; rescaled, it first moves to the new max log
        scale (the chunked form's references at N = 1)."""
        b = self.body
        terms = self.call_terms("q", "k", self.keep())
        phi_q, phi_k, state = terms[0], terms[1], "kernel_state"
        if self.rescaled:
            log_scale = self.step_log_scale()
            new_log_scale = b("Max", log_scale, b("Squeeze", terms[3], b.ints(-1)))
            held = b("Exp", b("Sub", log_scale, new_log_scale))  # <= 1
            phi_k = b("Mul", phi_k, b("Exp", b("Sub", terms[3], b("Unsqueeze", new_log_scale, b.ints(-1)))))
            state = b("Mul", state, b("Unsqueeze", held, b.ints(-1)))
            b.output("log_scale_out", b("Squeeze", new_log_scale, b.ints(-1)))
        read, new_state = self.update_and_read(phi_q, phi_k, state)
        b.output("out", self.like_v(self.normalised(read)))
        b.output("kernel_state_out", new_state)

    def update_and_read(self, phi_q: str, phi_k: str, state: str) -> tuple[str, str]:
        """(phi_q S' [..., 1, Dv + 1], S'): S' = state + phi_k^T [v, 1], one token's update."""
        b = self.body
        values = self.values_and_ones()
        if self.linear_attention_rows:
            read, new_state = self.linear_attention(phi_q, phi_k, values, state)
            # typed again (CastLike: no conversion) for the ONNX checker, which cannot type a contrib
            # operator and then finds the If's branches disagree
            return b("CastLike", read, values), b("CastLike", new_state, state)
        new_state = b("Add", state, b("MatMul", b("Transpose", phi_k, perm=self.swap_last()), values))
        return b("MatMul", phi_q, new_state), new_state

    def linear_attention(self, phi_q: str, phi_k: str, values: str, state: str) -> tuple[str, str]:
        """One token through com.microsoft.LinearAttention. With the heads known, its packed rows
        [B, 1, H X] are a reshape of [B, H, 1, X] and the state [B, H, F, Dv + 1] is its own
        layout, as it lies; else each head of each batch row is a row of its own."""
        b = self.body
        features, columns = self.linear_attention_rows
        heads = self.heads if self.site.rank == 4 else None
        if heads:
            rows = [b("Reshape", x, b.ints(0, 1, -1)) for x in (phi_q, phi_k, values)]
            folded = state
        else:
            sized = ((phi_q, features), (phi_k, features), (values, columns))
            rows = [b("Reshape", x, b.ints(-1, 1, size)) for x, size in sized]
            folded = b("Reshape", state, b.ints(-1, 1, features, columns))
        read, new_state = b(
            "LinearAttention",
            *rows,
            folded,
            outputs=2,
            domain=MICROSOFT,
            q_num_heads=heads or 1,
            kv_num_heads=heads or 1,
            update_rule="linear",
            scale=1.0,
        )
        if heads:
            return b("Reshape", read, b.ints(0, heads, 1, columns)), new_state
        return b("Reshape", read, b("Shape", values)), b("Reshape", new_state, b("Shape", state))

    def values_and_ones(self) -> str:
        """[v, 1] [..., N, Dv + 1] float32: what the kernel state sums (its last column the normaliser)."""
        b, rank = self.body, self.site.rank
        pads = b.ints(*[0] * (2 * rank - 1), 1)
        return b("Pad", b("Cast", "v", to=FLOAT), pads, b("Constant", value_float=1.0))

    def normalised(self, read: str) -> str:
        """A read of the kernel state [..., Dv + 1] as numerator / (normaliser + eps)."""
        b = self.body
        numerator = b("Slice", read, b.ints(0), b.ints(-1), b.ints(-1))
        denominator = b("Slice", read, b.ints(-1), b.ints(TO_THE_END), b.ints(-1))
        return b("Div", numerator, b("Add", denominator, b("Constant", value_float=self.unit.eps)))

    def swap_last(self) -> list[int]:
        rank = self.site.rank
        return [*range(rank - 2), rank - 1, rank - 2]

    def step_log_scale(self) -> str:
        """The incoming log scale [..., 1] in the state's own layout (empty_state_log_scale)."""
        b = self.body
        normaliser = b("Gather", "kernel_state", b("Constant", value_int=-1), axis=-1)
        return self.empty_state_log_scale(normaliser, b("Unsqueeze", "log_scale", b.ints(-1)))

    def plain(self) -> None:
        terms = self.call_terms("q", "k", self.keep())
        chunk = self.options.chunk
        if self.rescaled:
            eps = self.unit.eps
            functions = causal_rescaled_linear_attention_from_state_functions(self.opset_version, chunk, eps)
            inputs = [self.flat(terms[0]), self.flat(terms[1]), self.flat(terms[3]), self.flat("v")]
        else:
            functions = causal_linear_attention_from_state_functions(self.opset_version, chunk)
            inputs = [self.flat(terms[0]), self.flat(terms[1]), self.flat("v")]
        self.functions += [f.to_function_proto() for f in functions]
        out, *new_state = self.body.call(functions[-1], *inputs, *self.flat_state(), outputs=4 if self.rescaled else 3)
        self.output(out)
        self.state_outputs(new_state)

    def window_rows(self) -> None:
        """What both branches of a windowed entry share, in the entry itself (an If's outputs are
        copies): the new rows (k and v with their key/value heads), the kept window's rows then
        those (k_x, v_x, keep_x), the first new position and the next one after the new rows ([1]
        each), and the window's keys and values after the new rows, which are outputs."""
        b = self.body
        self.new_keys = ("k", "v", self.keep())
        k, v, keep = self.new_keys
        self.k_x = b("Concat", "window_keys", b("CastLike", k, "window_keys"), axis=-2)
        self.v_x = b("Concat", "window_values", b("CastLike", v, "window_values"), axis=-2)
        self.keep_x = b("Concat", "window_keep", keep, axis=-2)
        self.position = b("Reshape", "position", b.ints(1))
        self.new_rows = b("Shape", "q", start=-2, end=-1)
        self.next_position = b("Add", self.position, self.new_rows)
        b.output("window_keys_out", self.rolled(self.k_x, self.new_rows))  # the last 2W - 1 rows
        b.output("window_values_out", self.rolled(self.v_x, self.new_rows))
        b.output("position_out", b("Squeeze", self.next_position, b.ints(0)))

    def per_query_head(self, x: str) -> str:
        """A kept [B, Hkv, ...] part with each key/value head repeated for its query heads."""
        if self.groups == 1:
            return x
        b = self.body
        repeated = b("Expand", b("Unsqueeze", x, b.ints(2)), b.ints(1, 1, self.groups, 1, 1))
        shape = b("Concat", b("Shape", x, end=1), b.ints(self.heads), b("Shape", x, start=2), axis=0)
        return b("Reshape", repeated, shape)

    def windowed(self) -> None:
        b, window = self.body, self.window
        position = self.position
        k_x, v_x, keep_x = (self.per_query_head(x) for x in (self.k_x, self.v_x, self.keep_x))
        start = b("Sub", position, b.ints(2 * window.size - 1))
        terms = self.call_terms("q", k_x, keep_x)
        far_phi_k, far_key_log_scale = self.far_features(terms[1], terms[3] if self.rescaled else None, start)
        weighted_q = b("Mul", terms[0], b("Exp", b("Cast", "linear_log_weight", to=FLOAT)))
        inputs = [weighted_q, self.map("q", "q"), far_phi_k, self.map("k", k_x), v_x, keep_x]
        inputs = [*(self.flat(x) for x in inputs), start, *self.flat_state()]
        if self.rescaled:
            inputs += [self.flat(terms[2]), self.flat(far_key_log_scale)]
        if self.unit.max_weighted:
            inputs.append(self.flat(b("Expand", b("Cast", "local_max_weight", to=FLOAT), b("Shape", terms[2]))))
        if window.sinks:
            inputs += self.sinks(position)
        functions = windowed_kernel_attention_from_state_functions(
            self.opset_version, window, self.site.scale, self.unit
        )
        self.functions += functions
        self.output(b.call(functions[-1], *inputs))
        n = self.new_rows
        # block-aligned state: the rows behind the next query's previous block join the state
        behind = b("Sub", b.ints(window.size - 1), b("Mod", self.next_position, b.ints(window.size)))
        self.absorb_first_rows(b("Add", n, behind), far_phi_k, v_x, far_key_log_scale)
        rows = b("Constant", value=numpy_helper.from_array(np.arange(2 * window.size - 1).reshape(-1, 1)))
        in_reach = b("Cast", b("GreaterOrEqual", rows, behind), to=FLOAT)
        b.output("window_keep_out", b("Mul", self.rolled(self.keep_x, n), in_reach))

    def far_features(self, phi_k: str, key_log_scale: str | None, start: str):
        """far_key_features: the sinks' features zero, their log scales the lowest."""
        if not self.window.sinks:
            return phi_k, key_log_scale
        without = without_sinks_from_function(self.opset_version, self.window.sinks)
        self.functions.append(without.to_function_proto())
        b = self.body
        far_phi_k = b.call(without, phi_k, b("Constant", value_float=0.0), start)
        if key_log_scale is None:
            return far_phi_k, None
        return far_phi_k, b.call(without, key_log_scale, b("Constant", value_float=LOWEST), start)

    def sinks(self, position: str) -> list[str]:
        """The sinks with the new tokens' filled in, flattened for the kernel (keys mapped);
        their outputs are the state's."""
        sinks_after = _sinks_after_function(self.opset_version)
        self.functions.append(sinks_after.to_function_proto())
        b = self.body
        new = []
        for name, x in zip(SINK_PARTS, self.new_keys):
            new.append(b.call(sinks_after, name, x, position))
            b.output(f"{name}_out", new[-1])
        k, v, keep = (self.per_query_head(x) for x in new)
        return [self.flat(self.map("k", k)), self.flat(v), self.flat(keep)]

    def absorb_first_rows(self, count: str, far_phi_k: str, v_x: str, far_key_log_scale: str | None) -> None:
        """The first ``count`` rows ([1]) of the window's keys join the kernel state."""
        b = self.body
        zero, one = b.ints(0), b.ints(1)

        def leaving(x):
            return b("Slice", self.flat(x), zero, count, one)

        absorb, absorb_rescaled = absorb_keys_functions(self.opset_version)
        if self.rescaled:
            self.functions.append(absorb_rescaled.to_function_proto())
            inputs = [leaving(far_phi_k), leaving(far_key_log_scale), leaving(v_x)]
            new_state = b.call(absorb_rescaled, *inputs, *self.flat_state(), outputs=3)
        else:
            self.functions.append(absorb.to_function_proto())
            new_state = b.call(absorb, leaving(far_phi_k), leaving(v_x), *self.flat_state(), outputs=2)
        self.state_outputs(new_state)

    def rolled(self, x: str, n: str) -> str:
        return self.body("Slice", x, n, self.body.ints(TO_THE_END), self.body.ints(-2))

    def windowed_step(self) -> None:
        """One token of the window hybrid: exact softmax over the window's kept rows and the
        sinks before its blocks, the kernel over the state alone, which holds every key before
        the query's previous block (the state is block-aligned); at a block's last position the
        previous block joins the state (block_joins_state), the only features of keys computed."""
        b, window = self.body, self.window
        mapped_q = self.map("q", "q")
        terms = self.call_query_terms(mapped_q)  # the key's features wait for its block to join the state
        terms = [terms] if isinstance(terms, str) else terms
        step = window_step_functions(self.opset_version, window, self.site.scale, self.unit)
        self.functions += [proto for f in step for proto in _protos(f)]
        as_block = self.as_block
        # grouped heads: each group's queries are the rows of one query block over its key/value
        # head's keys as kept, so nothing kept is repeated (learned key maps are per query head)
        grouped = self.groups > 1 and not self.mapped

        def exact(x):
            return x if grouped else self.per_query_head(x)

        keys = [as_block(self.map("k", exact(self.k_x))), as_block(exact(self.v_x))]
        keep = self.keep_x
        if window.sinks:
            sink_k, sink_v, sink_keep = self.step_sinks(self.position)
            keys += [as_block(self.map("k", exact(sink_k))), as_block(exact(sink_v))]
            keep = b("Concat", keep, sink_keep, axis=-2)
        kept = as_block(b("Transpose", exact(keep), perm=self.swap_last()))  # [..., 1, keys]: one query's
        query = self.grouped(mapped_q) if grouped else as_block(mapped_q)
        local = b.call(step.local_sums, query, *keys, kept, outputs=3)
        if grouped:
            local = [b("Reshape", x, b.ints(0, self.heads, 1, -1)) for x in local]
        weighted_q = b("Mul", terms[0], b("Exp", b("Cast", "linear_log_weight", to=FLOAT)))
        read = as_block(b("MatMul", weighted_q, "kernel_state"))  # the far keys': all in the state
        minus_one = b.ints(-1)
        far = [
            b("Slice", read, b.ints(0), minus_one, minus_one),
            b("Slice", read, minus_one, b.ints(TO_THE_END), minus_one),
        ]
        if self.rescaled:
            weight = b("Constant", value_float=1.0)
            if self.unit.max_weighted:  # [heads, 1, 1]: broadcast over the rows
                weight = as_block(b("Cast", "local_max_weight", to=FLOAT))
            mixed = b.call(step.mix, *local, *far, self.read_log_scale(far[1]), as_block(terms[1]), weight)
        else:
            mixed = b.call(step.mix, local[0], local[1], *far)
        if self.site.rank == 3:
            mixed = b("Squeeze", mixed, b.ints(1))
        b.output("out", self.like_v(mixed))
        self.block_joins_state()

    def grouped(self, q: str) -> str:
        """A step's queries [B, H, 1, D] as [B, Hkv, groups, D]: each group's as rows."""
        return self.body("Reshape", q, self.body.ints(0, self.heads // self.groups, self.groups, -1))

    def read_log_scale(self, far_den: str) -> str:
        """The incoming log scale as a step's read of the kernel state (normaliser ``far_den``,
        [G, blocks, 1, 1]) takes it: the lowest where the read's normaliser is 0. Positive
        features read 0 from a state that absorbed nothing (empty_state_log_scale's rule, without
        reading the state's normaliser column again), or where exp(linear_log_weight) underflows,
        when the far part adds nothing either way."""
        b = self.body
        log_scale = self.as_block(b("Unsqueeze", "log_scale", b.ints(-2, -1)))
        empty = b("Equal", far_den, b("Constant", value_float=0.0))
        return b("Where", empty, b("Constant", value_float=LOWEST), log_scale)

    def as_block(self, x: str) -> str:
        """A step's [B, H, ...] as the window functions' [G, blocks, ...] (rank 3 sites: [G, 1, ...])."""
        return x if self.site.rank == 4 else self.body("Unsqueeze", x, self.body.ints(1))

    def step_sinks(self, position: str) -> tuple[str, str, str]:
        """The sinks with the new token's filled in (outputs of the state), and their keep flags
        as the query takes them: 0 for a sink still among the window's rows, that is, not before
        the query's previous block (sink s is taken from position (s // W + 2) W on)."""
        b, w, sinks = self.body, self.window.size, self.window.sinks
        new = b("Equal", b("Constant", value=numpy_helper.from_array(np.arange(sinks).reshape(-1, 1))), position)
        after = {}
        for name, x in zip(SINK_PARTS, self.new_keys):
            after[name] = b("Where", new, b("CastLike", x, name), name)
            b.output(f"{name}_out", after[name])
        taken_from = b("Constant", value=numpy_helper.from_array((np.arange(sinks).reshape(-1, 1) // w + 2) * w))
        outside = b("LessOrEqual", taken_from, position)
        taken = b("Where", outside, after["sink_keep"], b("Constant", value_float=0.0))
        return after["sink_keys"], after["sink_values"], taken

    def block_joins_state(self) -> None:
        """At a block's last position (the next one starts a block), the previous block (the
        window's first W rows) joins the kernel state and its keep flags turn 0; else the state
        is carried as it came."""
        b, w, keep_x = self.body, self.window.size, self.keep_x
        names = ["kernel_state_out", *(["log_scale_out"] if self.rescaled else []), "window_keep_out"]

        def joins():
            b = self.body  # the branch's
            first = [b("Slice", x, b.ints(0), b.ints(w), b.ints(-2)) for x in (self.k_x, self.v_x, keep_x)]
            k, v, keep = (self.per_query_head(x) for x in first)
            terms = self.call_terms("q", k, keep)
            start = b("Sub", self.position, b.ints(2 * w - 1))  # k_x's first row's
            far_phi_k, far_log_scale = self.far_features(terms[1], terms[3] if self.rescaled else None, start)
            self.absorb_first_rows(b.ints(w), far_phi_k, v, far_log_scale)
            left = numpy_helper.from_array(np.repeat([[0.0], [1.0]], [w - 1, w], axis=0).astype(np.float32))
            b.output("window_keep_out", b("Mul", self.rolled(keep_x, b.ints(1)), b("Constant", value=left)))

        def carried():
            for name in names[:-1]:
                self.body.output(name, name.removesuffix("_out"))
            self.body.output("window_keep_out", self.rolled(keep_x, self.body.ints(1)))

        at_block_end = b("Equal", b("Mod", self.next_position, b.ints(w)), b.ints(0))
        branches = {
            "then_branch": self.branch(joins, "joins", names),
            "else_branch": self.branch(carried, "carried", names),
        }
        for name, value in zip(names, b("If", at_block_end, outputs=len(names), **branches)):
            b.output(name, value)


@built_once
def _sinks_after_function(opset_version: int):
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


def _protos(function) -> list:
    return [f.to_function_proto() for f in with_callees(function)]


def _unique(functions: list) -> list:
    """Each function once (by name; a name is one body here), callees before callers kept."""
    seen = {}
    for function in functions:
        seen.setdefault(function.name, function)
    return list(seen.values())
