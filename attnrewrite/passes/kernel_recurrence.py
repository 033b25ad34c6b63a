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
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    FLOAT,
    TO_THE_END,
    FunctionNodes,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.recurrent import Recurrence, RecurrentLowering, StateTensor, leading_axes, state_shape
from attnrewrite.passes.window.onnx_state import (
    windowed_kernel_attention_from_state_functions,
    without_sinks_from_function,
)
from attnrewrite.passes.window.settings import KernelScales, KernelUnit, Window
from attnrewrite.passes.window.torch_state import SinkKeys, far_key_features, windowed_kernel_attention_from_state
from attnrewrite.site import AttentionSite

LOWEST = LOWEST_LOG_SCALE


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
    log scale, key log scale]); ``constants(site, options, weights)``: the parallel lowering's
    constants, by name and in order."""

    options: typing.Any
    entry: str
    unit: KernelUnit
    feature_count: Callable[[AttentionSite], int | str]
    torch_terms: Callable[..., CausalTerms]
    onnx_terms: Callable
    constants: Callable[..., dict]

    @property
    def window(self) -> Window | None:
        return Window.of(self.options)

    def state(self, site: AttentionSite) -> list[StateTensor]:
        lead, f = leading_axes(site), self.feature_count(site)
        state = [
            StateTensor("kernel_state", (*lead, f, "Dv"), "float32", 0.0, "sum of phi(k) v^T over absorbed keys"),
            StateTensor("normaliser", (*lead, f), "float32", 0.0, "sum of phi(k) over absorbed keys"),
        ]
        if self.unit.rescaled:
            state.append(
                StateTensor("log_scale", lead, "float32", LOWEST, "max log scale of absorbed keys: the sums' reference")
            )
        window = self.window
        if window is None:
            return state
        kept = 2 * window.size - 1
        state += [
            StateTensor("window_keys", (*lead, kept, "D"), "model", 0.0, f"the last {kept} keys"),
            StateTensor("window_values", (*lead, kept, "Dv"), "model", 0.0, f"the last {kept} values"),
            StateTensor("window_keep", (*lead, kept, 1), "float32", 0.0, "1.0 where those keys are kept"),
        ]
        if window.sinks:
            state += [
                StateTensor("sink_keys", (*lead, window.sinks, "D"), "model", 0.0, "the keys at positions < sinks"),
                StateTensor("sink_values", (*lead, window.sinks, "Dv"), "model", 0.0, "their values"),
                StateTensor("sink_keep", (*lead, window.sinks, 1), "float32", 0.0, "1.0 where those keys are kept"),
            ]
        return [*state, StateTensor("position", (), "int64", 0, "positions consumed, padding included")]

    def torch_module(self, site: AttentionSite, parallel) -> RecurrentKernelAttention:
        return RecurrentKernelAttention(parallel, self, self.state(site))

    def onnx_lowering(self, site: AttentionSite, opset_version: int, weights: dict | None = None) -> RecurrentLowering:
        """The recurrent form as ONNX, the state in ``state``'s order. The constants are the
        parallel lowering's, without building it."""
        constants = self.constants(site, self.options, weights)
        description = self.state(site)
        state = [t.name for t in description]
        glue = _Glue(self, site, opset_version, mapped=QUERY_KEY_MAPS[0] in constants)
        windowed = self.window is not None
        (glue.windowed if windowed else glue.plain)()
        name = ("Learned" if glue.mapped else "") + "Recurrent" + ("Windowed" if windowed else "")
        entry = make_function(
            name + self.entry,
            ["q", "k", "v", "key_keep", *state, *constants],
            ["out", *(f"{s}_out" for s in state)],
            glue.body.nodes,
            opset_version,
        )
        return RecurrentLowering([*_unique(glue.functions), entry], constants, description)


# --- torch -------------------------------------------------------------------------------------


class RecurrentKernelAttention(Module):
    """forward(q, k, v, key_keep, *state) -> (out, *state): the N new tokens' outputs (q, k, v
    [..., N, *], k and v with q's heads; key_keep [..., 1 or heads, N, 1] or None) and the state
    after them, in KernelRecurrence.state's order. The parallel module (``parallel``, a child) holds
    every parameter and buffer, so a fitted one is used as it is."""

    def __init__(self, parallel, recurrence: KernelRecurrence, description: list[StateTensor]):
        super().__init__()
        self.parallel = parallel
        self.recurrence = recurrence
        self.window = recurrence.window
        self.description = description

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
        absorbed = KernelState(state["kernel_state"], state["normaliser"], state.get("log_scale"))
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
        k_x = torch.cat([state["window_keys"], k.to(state["window_keys"].dtype)], dim=-2)
        v_x = torch.cat([state["window_values"], v.to(state["window_values"].dtype)], dim=-2)
        keep_x = torch.cat([state["window_keep"], keep], dim=-2)
        start = position - state["window_keys"].shape[-2]  # the position of k_x's first row
        sinks = self.window.sinks
        sink_keys = _with_new_sinks(state, k, v, keep, position) if sinks else None
        q, mapped_k_x = map_queries_and_keys(self.parallel, q, k_x)  # the window keeps k unmapped
        terms = self._terms(q, mapped_k_x, keep_x)
        far_phi_k, far_key_log_scale = far_key_features(terms.phi_k, terms.key_log_scale, start, sinks)
        absorbed = KernelState(state["kernel_state"], state["normaliser"], state.get("log_scale"))
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
        leaving = None if far_key_log_scale is None else far_key_log_scale[..., :n, :]
        absorbed = absorb_keys(absorbed, far_phi_k[..., :n, :], v_x[..., :n, :], leaving)
        state = _with_kernel_state(state, absorbed)
        state.update(window_keys=k_x[..., n:, :], window_values=v_x[..., n:, :], window_keep=keep_x[..., n:, :])
        if sink_keys is not None:
            state.update(sink_keys=sink_keys.k, sink_values=sink_keys.v, sink_keep=sink_keys.keep)
        state["position"] = state["position"] + n
        return out, state

    def _mapped_keys(self, q, k):
        return map_queries_and_keys(self.parallel, q, k)[1]

    def extra_repr(self) -> str:
        return f"method={self.recurrence.options.method_name}, state={[t.name for t in self.description]}"


def _with_kernel_state(state: dict, absorbed) -> dict:
    state = dict(state, kernel_state=absorbed.kv, normaliser=absorbed.key_sum)
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

    def __init__(self, recurrence: KernelRecurrence, site: AttentionSite, opset_version: int, mapped: bool):
        self.site, self.opset_version, self.mapped = site, opset_version, mapped
        self.options, self.unit, self.window = recurrence.options, recurrence.unit, recurrence.window
        self.body = FunctionNodes()
        self.rescaled = self.unit.rescaled
        self.terms, self.terms_constants = recurrence.onnx_terms(site, self.options, opset_version)
        self.flatten = flatten_heads_function(opset_version)
        self.functions = [self.flatten.to_function_proto(), *_protos(self.terms)]
        self._flat_state = None

    def call_terms(self, q, k, keep):
        """(phi_q, phi_k[, query log scale, key log scale]) of the method, q and k mapped
        first where the module has query/key maps."""
        q, k = self.map("q", q), self.map("k", k)
        return self.body.call(self.terms, q, k, keep, *self.terms_constants, outputs=4 if self.rescaled else 2)

    def map(self, which: str, x: str) -> str:
        if not self.mapped:
            return x
        return self.body("MatMul", self.body("Cast", x, to=FLOAT), "query_map" if which == "q" else "key_map")

    def flat(self, x: str) -> str:
        return self.body.call(self.flatten, x)

    def flat_state(self) -> list[str]:
        """The incoming kernel_state, normaliser (and log_scale) as [G, F, Dv], [G, F] (and
        [G, 1]), flattened once."""
        if self._flat_state is None:
            b = self.body
            normaliser_shape = b("Concat", b.ints(-1), b("Shape", "normaliser", start=-1), axis=0)
            normaliser = b("Reshape", "normaliser", normaliser_shape)
            self._flat_state = [self.flat("kernel_state"), normaliser]
            if self.rescaled:
                self._flat_state.append(self.empty_state_log_scale(normaliser))
        return self._flat_state

    def empty_state_log_scale(self, normaliser: str) -> str:
        """The incoming log scale [G, 1], the lowest where nothing was absorbed yet (a zero
        normaliser): so an all-zero state, the one generate() and onnxruntime-genai start from,
        is the initial state too."""
        b = self.body
        empty = b("Equal", b("ReduceSum", normaliser, b.ints(-1), keepdims=1), b("Constant", value_float=0.0))
        return b("Where", empty, b("Constant", value_float=LOWEST), b("Reshape", "log_scale", b.ints(-1, 1)))

    def state_outputs(self, new_state: list[str]) -> None:
        names = ["kernel_state", "normaliser", "log_scale"][: len(new_state)]
        for name, value in zip(names, new_state):
            self.body.output(f"{name}_out", self.body("Reshape", value, self.body("Shape", name)))

    def output(self, out_flat: str) -> None:
        b = self.body
        shape = b("Concat", b("Shape", "q", end=-1), b("Shape", "v", start=-1), axis=0)
        b.output("out", b("CastLike", b("Reshape", out_flat, shape), "v"))

    def keep(self) -> str:
        """key_keep as float32 with k's leading axes: [..., N, 1]."""
        b = self.body
        return b("Expand", b("Cast", "key_keep", to=FLOAT), b("Concat", b("Shape", "k", end=-1), b.ints(1), axis=0))

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

    def windowed(self) -> None:
        b, window = self.body, self.window
        keep = self.keep()
        k_x = b("Concat", "window_keys", b("CastLike", "k", "window_keys"), axis=-2)
        v_x = b("Concat", "window_values", b("CastLike", "v", "window_values"), axis=-2)
        keep_x = b("Concat", "window_keep", keep, axis=-2)
        position = b("Reshape", "position", b.ints(1))
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
            inputs += self.sinks(keep, position)
        functions = windowed_kernel_attention_from_state_functions(
            self.opset_version, window, self.site.scale, self.unit
        )
        self.functions += functions
        self.output(b.call(functions[-1], *inputs))
        self.absorb_leaving_keys(far_phi_k, v_x, far_key_log_scale)
        self.roll_window(k_x, v_x, keep_x, position)

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

    def sinks(self, keep: str, position: str) -> list[str]:
        """The sinks with the new tokens' filled in, flattened for the kernel (keys mapped);
        their outputs are the state's."""
        sinks_after = _sinks_after_function(self.opset_version)
        self.functions.append(sinks_after.to_function_proto())
        b = self.body
        new = {}
        for name, x in (("sink_keys", "k"), ("sink_values", "v"), ("sink_keep", keep)):
            new[name] = b.call(sinks_after, name, x, position)
            b.output(f"{name}_out", new[name])
        return [self.flat(self.map("k", new["sink_keys"])), self.flat(new["sink_values"]), self.flat(new["sink_keep"])]

    def absorb_leaving_keys(self, far_phi_k: str, v_x: str, far_key_log_scale: str | None) -> None:
        """The oldest N keys leave the window into the kernel state (2W - 1 stay)."""
        b = self.body
        n = b("Shape", "q", start=-2, end=-1)
        zero, one = b.ints(0), b.ints(1)

        def leaving(x):
            return b("Slice", self.flat(x), zero, n, one)

        absorb, absorb_rescaled = absorb_keys_functions(self.opset_version)
        if self.rescaled:
            self.functions.append(absorb_rescaled.to_function_proto())
            inputs = [leaving(far_phi_k), leaving(far_key_log_scale), leaving(v_x)]
            new_state = b.call(absorb_rescaled, *inputs, *self.flat_state(), outputs=3)
        else:
            self.functions.append(absorb.to_function_proto())
            new_state = b.call(absorb, leaving(far_phi_k), leaving(v_x), *self.flat_state(), outputs=2)
        self.state_outputs(new_state)

    def roll_window(self, k_x: str, v_x: str, keep_x: str, position: str) -> None:
        b = self.body
        n = b("Shape", "q", start=-2, end=-1)
        to_the_end, axis = b.ints(TO_THE_END), b.ints(-2)
        for name, x in (("window_keys", k_x), ("window_values", v_x), ("window_keep", keep_x)):
            b.output(f"{name}_out", b("Slice", x, n, to_the_end, axis))
        b.output("position_out", b("Squeeze", b("Add", position, n), b.ints(0)))


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
