"""Causal kernel attention as a recurrence, for decoders that generate (DESIGN.md, "Recurrent decoding").

A causal linear attention carries a fixed-size state instead of a KV cache that grows with every
token: S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t), o_t = phi(q_t)^T S_t /
phi(q_t)^T z_t. One code path serves prefill (N new tokens from the zero state) and decoding
(N = 1): the N new tokens run the chunked causal form seeded with the incoming state, and the
outgoing state is the last prefix. Stepping it token by token gives the parallel causal form's
outputs on the whole sequence (the pass's torch_module / onnx_lowering), rounding aside.

Per layer the state is (state_description):
- ``kernel_state`` sum phi(k) v^T [B, H, F, Dv] and ``normaliser`` sum phi(k) [B, H, F], float32;
- FAVOR+ and the rescaled windows (hedgehog's, favor's): ``log_scale`` [B, H] float32, the max of
  the absorbed keys' log scales, which the two sums are relative to (the parallel causal form's
  running max, kernels.causal_rescaled_linear_attention), the lowest log scale before any key;
- with ``window=W``: the last 2W - 1 keys and values with their keep flags (``window_keys``
  [B, H, 2W-1, D], ``window_values`` [B, H, 2W-1, Dv], ``window_keep`` [B, H, 2W-1, 1]), which a
  later query can still take exactly: a query of block c takes blocks c-1 and c, and blocks are
  aligned to sequence positions, so a key leaves the window (into the kernel state) once it is
  2W - 1 positions old; the sinks (``sink_keys``, ``sink_values``, ``sink_keep``, positions
  0..sinks-1, kept from the tokens that had them); and ``position`` (int64 []), the positions
  consumed so far, padding included (blocks and sinks are positions of the padded sequence).
Sizes are fixed in the context length. Padded keys (key_keep 0) never enter a state.

Causal AFT-simple (aft.py) is a recurrence too, per feature: ``numerator`` sum exp(K - m) V,
``denominator`` sum exp(K - m) and ``key_max`` m, their per-feature reference (the max of the
absorbed keys' logits), [B, H, D] each (RecurrentAft, _aft_recurrent_lowering).

Methods whose attention is no causal kernel sum say why (recurrent_refusal).
"""

from __future__ import annotations

import dataclasses
import types
import typing

import numpy as np
from onnxscript import script

from attnrewrite.passes import aft, favor, feature_sums, hedgehog, kernels, linear
from attnrewrite.passes._onnx import ATTNREWRITE, FLOAT, OnnxLowering, make_function, standard_opset, with_callees
from attnrewrite.passes._torch import Module, torch
from attnrewrite.site import AttentionSite

RECURRENT_METHODS = (linear.NAME, hedgehog.NAME, favor.NAME)
REFUSALS = {
    "hydra": (
        "Hydra's causal form is a recurrence too (its state would be sum k_hat * v, [B, H, D]), "
        "but it has no recurrent lowering yet"
    ),
    "linformer": (
        "Linformer projects the keys along the sequence axis, mixing every position into each "
        "projected key, so it has no causal form to carry as a state"
    ),
    "efficient": (
        "Efficient Attention's causal form is a recurrence too (sum exp(k - m) v^T [d, Dv] and the "
        "per-feature normalisers and maxima), but it has no recurrent lowering yet"
    ),
    "lsh": (
        "LSH attends exactly among the keys that share a query's hash bucket, and any past key "
        "may share a future query's: it must keep every key, a cache that grows with the context"
    ),
}
LOWEST = kernels.LOWEST_LOG_SCALE
AFT_LOCAL_REFUSAL = (
    "AFT-local's position bias reaches span - 1 keys back, which a recurrent form would have to keep "
    "as well; only variant=simple is a recurrence here"
)


def recurrent_refusal(method: types.ModuleType, options) -> str | None:
    """Why ``method`` (a pass module) with ``options`` cannot run as a recurrence; None when it can."""
    return _method_refusal(method.NAME, options)


def _method_refusal(name: str, options=None) -> str | None:
    if name == aft.NAME:
        return AFT_LOCAL_REFUSAL if options.local else None
    if name in RECURRENT_METHODS:
        return None
    return REFUSALS.get(name, f"{name} has no recurrent form")


def site_refusal(site: AttentionSite) -> str | None:
    """Why ``site`` cannot carry a recurrent state; None when it can."""
    if not site.mask.causal:
        return "only a causal attention is a recurrence: a bidirectional one reads keys not yet generated"
    return None


# --- the state ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's recurrent state. ``shape``: symbolic axes by name (B, H: q's
    leading axes, or G for [batch * heads, ...] sites; F features; D, Dv the head dims) and
    fixed sizes as ints; ``dtype``: "float32", "int64" or "model" (the site's k and v dtype);
    ``initial``: its value in the zero state."""

    name: str
    shape: tuple[str | int, ...]
    dtype: str
    initial: float
    meaning: str


def state_description(site: AttentionSite, options) -> list[StateTensor]:
    """The per-layer state of ``site`` under ``options`` (linear, hedgehog or favor), in the
    order the recurrent module and lowering take and return it."""
    lead = ("B", "H") if site.rank == 4 else ("G",)
    if options.method_name == aft.NAME:
        return [
            StateTensor("numerator", (*lead, "D"), "float32", 0.0, "sum of exp(K - key_max) V over absorbed keys"),
            StateTensor("denominator", (*lead, "D"), "float32", 0.0, "sum of exp(K - key_max) over absorbed keys"),
            StateTensor("key_max", (*lead, "D"), "float32", LOWEST, "per-feature max of absorbed K: their reference"),
        ]
    f = feature_count(site, options)
    state = [
        StateTensor("kernel_state", (*lead, f, "Dv"), "float32", 0.0, "sum of phi(k) v^T over absorbed keys"),
        StateTensor("normaliser", (*lead, f), "float32", 0.0, "sum of phi(k) over absorbed keys"),
    ]
    if _has_log_scale(options):
        state.append(
            StateTensor("log_scale", lead, "float32", LOWEST, "max log scale of absorbed keys: the sums' reference")
        )
    if not options.window:
        return state
    window = 2 * options.window - 1
    state += [
        StateTensor("window_keys", (*lead, window, "D"), "model", 0.0, f"the last {window} keys"),
        StateTensor("window_values", (*lead, window, "Dv"), "model", 0.0, f"the last {window} values"),
        StateTensor("window_keep", (*lead, window, 1), "float32", 0.0, "1.0 where those keys are kept"),
    ]
    if options.sinks:
        state += [
            StateTensor("sink_keys", (*lead, options.sinks, "D"), "model", 0.0, "the keys at positions < sinks"),
            StateTensor("sink_values", (*lead, options.sinks, "Dv"), "model", 0.0, "their values"),
            StateTensor("sink_keep", (*lead, options.sinks, 1), "float32", 0.0, "1.0 where those keys are kept"),
        ]
    return [*state, StateTensor("position", (), "int64", 0, "positions consumed, padding included")]


def feature_count(site: AttentionSite, options) -> int | str:
    """F, the features per key: "F" where the head dim is unknown."""
    method, d = options.method_name, site.head_dim
    if method == favor.NAME:
        projection_rows = options.features or favor.default_features(d)
        return projection_rows * (2 if options.variant == "hyperbolic" else 1)
    if d is None:
        return "F"
    return 2 * d if method == hedgehog.NAME else d


def _has_log_scale(options) -> bool:
    """FAVOR+ always carries its keys' log scales, hedgehog with a window."""
    return options.method_name == favor.NAME or (options.method_name == hedgehog.NAME and bool(options.window))


def zero_state(description: list[StateTensor], sizes: dict[str, int], model_dtype=np.float32) -> list[np.ndarray]:
    """The zero state as numpy arrays; ``sizes``: every symbolic axis of ``description``."""
    dtypes = {"float32": np.float32, "int64": np.int64, "model": model_dtype}
    return [np.full(_shape(t, sizes), t.initial, dtypes[t.dtype]) for t in description]


def _shape(tensor: StateTensor, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[axis] if isinstance(axis, str) else axis for axis in tensor.shape)


# --- torch -------------------------------------------------------------------------------------


class _CausalTerms(typing.NamedTuple):
    """What a method's causal form reads: features in float32 (phi_k zero on padded keys), the
    log scales where it has them (padded keys LOWEST), and its denominators' eps."""

    phi_q: typing.Any
    phi_k: typing.Any
    eps: float
    query_log_scale: typing.Any = None
    key_log_scale: typing.Any = None
    local_max_weight: typing.Any = None


def _linear_terms(module, q, k, keep) -> _CausalTerms:
    eps = kernels.DENOMINATOR_EPS
    return _CausalTerms(linear.elu_plus_one(q), linear.elu_plus_one(k) * keep, eps)


def _hedgehog_terms(module, q, k, keep) -> _CausalTerms:
    phi_q, phi_k = module.features(q), module.features(k) * keep
    if not module.window:
        return _CausalTerms(phi_q, phi_k, kernels.DENOMINATOR_EPS)
    query_log_scale, key_log_scale = module.log_scales(q, k, keep)
    return _CausalTerms(phi_q, phi_k, kernels.RESCALED_EPS, query_log_scale, key_log_scale, module.local_max_weight)


def _favor_terms(module, q, k, keep) -> _CausalTerms:
    w, hyperbolic = module.projection.float(), module.variant == "hyperbolic"
    log_q = favor.log_features(q.float() * module.root_scale, w, hyperbolic)
    log_k = favor.log_features(k.float() * module.root_scale, w, hyperbolic)
    phi_k, key_log_scale = favor.causal_key_features(log_k, keep, module.norm)
    query_log_scale = log_q.amax(dim=-1, keepdim=True)
    return _CausalTerms(favor.query_features(log_q, module.norm), phi_k, favor.EPS, query_log_scale, key_log_scale)


_TERMS = {linear.NAME: _linear_terms, hedgehog.NAME: _hedgehog_terms, favor.NAME: _favor_terms}


class RecurrentKernelAttention(Module):
    """forward(q, k, v, key_keep, *state) -> (out, *state): the N new tokens' outputs (q, k, v
    [..., N, *], k and v with q's heads; key_keep [..., 1 or heads, N, 1] or None) and the state
    after them, in state_description's order. The parallel module (``parallel``, a child) holds
    every parameter and buffer, so a fitted one is used as it is."""

    def __init__(self, parallel, method: str, description: list[StateTensor]):
        super().__init__()
        self.parallel = parallel
        self.method = method
        self.window, self.sinks = parallel.window, parallel.sinks
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
            torch.full(_shape(t, sizes), t.initial, dtype=dtypes[t.dtype], device=v.device) for t in self.description
        )

    def _terms(self, q, k, keep) -> _CausalTerms:
        return _TERMS[self.method](self.parallel, q, k, keep)

    def _plain(self, q, k, v, keep, state):
        q, k = kernels.map_queries_and_keys(self.parallel, q, k)
        terms = self._terms(q, k, keep)
        absorbed = kernels.KernelState(state["kernel_state"], state["normaliser"], state.get("log_scale"))
        chunk = self.parallel.chunk
        if terms.key_log_scale is None:
            out, absorbed = kernels.causal_linear_attention_from_state(
                terms.phi_q, terms.phi_k, v.float(), absorbed, chunk, terms.eps
            )
        else:
            out, absorbed = kernels.causal_rescaled_linear_attention_from_state(
                terms.phi_q, terms.phi_k, terms.key_log_scale, v.float(), absorbed, chunk, terms.eps
            )
        return out, _with_kernel_state(state, absorbed)

    def _windowed(self, q, k, v, keep, state):
        n, position = q.shape[-2], int(state["position"])
        k_x = torch.cat([state["window_keys"], k.to(state["window_keys"].dtype)], dim=-2)
        v_x = torch.cat([state["window_values"], v.to(state["window_values"].dtype)], dim=-2)
        keep_x = torch.cat([state["window_keep"], keep], dim=-2)
        start = position - state["window_keys"].shape[-2]  # the position of k_x's first row
        sink_keys = _with_new_sinks(state, k, v, keep, position) if self.sinks else None
        q, mapped_k_x = kernels.map_queries_and_keys(self.parallel, q, k_x)  # the window keeps k unmapped
        terms = self._terms(q, mapped_k_x, keep_x)
        far_phi_k, far_key_log_scale = kernels.far_key_features(terms.phi_k, terms.key_log_scale, start, self.sinks)
        absorbed = kernels.KernelState(state["kernel_state"], state["normaliser"], state.get("log_scale"))
        out = kernels.windowed_kernel_attention_from_state(
            terms.phi_q,
            far_phi_k,
            q,
            mapped_k_x,
            v_x,
            keep_x,
            start=start,
            sink_keys=None if sink_keys is None else sink_keys._replace(k=self._mapped_keys(q, sink_keys.k)),
            far=absorbed,
            scale=self.parallel.scale,
            window=self.window,
            linear_log_weight=self.parallel.linear_log_weight,
            query_log_scale=terms.query_log_scale,
            far_key_log_scale=far_key_log_scale,
            local_max_weight=terms.local_max_weight,
            eps=terms.eps,
        )
        leaving = None if far_key_log_scale is None else far_key_log_scale[..., :n, :]
        absorbed = kernels.absorb_keys(absorbed, far_phi_k[..., :n, :], v_x[..., :n, :], leaving)
        state = _with_kernel_state(state, absorbed)
        state.update(window_keys=k_x[..., n:, :], window_values=v_x[..., n:, :], window_keep=keep_x[..., n:, :])
        if sink_keys is not None:
            state.update(sink_keys=sink_keys.k, sink_values=sink_keys.v, sink_keep=sink_keys.keep)
        state["position"] = state["position"] + n
        return out, state

    def _mapped_keys(self, q, k):
        return kernels.map_queries_and_keys(self.parallel, q, k)[1]

    def extra_repr(self) -> str:
        return f"method={self.method}, state={[t.name for t in self.description]}"


def _with_kernel_state(state: dict, absorbed) -> dict:
    state = dict(state, kernel_state=absorbed.kv, normaliser=absorbed.key_sum)
    if absorbed.log_scale is not None:
        state["log_scale"] = absorbed.log_scale
    return state


def _with_new_sinks(state: dict, k, v, keep, position: int) -> kernels.SinkKeys:
    """The sinks with those among the N new positions (position .. position + N - 1) filled in."""
    sinks, n = state["sink_keys"].shape[-2], k.shape[-2]
    row = torch.arange(sinks, device=k.device) - position  # sink s is new row s - position
    new = ((row >= 0) & (row < n)).unsqueeze(-1)
    rows = row.clamp(0, n - 1)

    def fill(x, old):
        return torch.where(new, x.index_select(-2, rows).to(old.dtype), old)

    return kernels.SinkKeys(fill(k, state["sink_keys"]), fill(v, state["sink_values"]), fill(keep, state["sink_keep"]))


def recurrent_module(site: AttentionSite, options, parallel_module) -> RecurrentKernelAttention:
    """The recurrent form of ``parallel_module`` (the pass's torch_module for ``site``, fitted or
    not), sharing its parameters and buffers."""
    _check(site, options)
    if options.method_name == aft.NAME:
        return RecurrentAft(parallel_module, state_description(site, options))
    return RecurrentKernelAttention(parallel_module, options.method_name, state_description(site, options))


def _check(site: AttentionSite, options) -> None:
    reason = _method_refusal(options.method_name, options) or site_refusal(site)
    if reason:
        raise ValueError(f"no recurrent form for {options.method_name} at {site.name}: {reason}")


class RecurrentAft(Module):
    """forward(q, k, v, key_keep, numerator, denominator, key_max) -> (out, numerator,
    denominator, key_max): causal AFT-simple continued from the state. The reference is the max
    over the state's and the new keys' logits (an all-zero state is the empty one: nothing
    absorbed where the denominator is 0), so from the empty state it is the parallel form's."""

    def __init__(self, parallel, description: list[StateTensor]):
        super().__init__()
        self.parallel = parallel  # aft.AftAttention: its values, fitted or not
        self.description = description

    def forward(self, q, k, v, key_keep, numerator, denominator, key_max):
        masked = self.parallel.masked_logits(k, key_keep)
        past = torch.where(denominator > 0, key_max, LOWEST).unsqueeze(-2)
        reference = feature_sums.reference(masked, past)
        held, w = torch.exp(past - reference), torch.exp(masked - reference)
        chunk = self.parallel.chunk
        numerator = feature_sums.causal_feature_sums(w * v.float(), chunk) + held * numerator.unsqueeze(-2)
        denominator = feature_sums.causal_feature_sums(w, chunk) + held * denominator.unsqueeze(-2)
        out = self.parallel.gate(q) * numerator / denominator.clamp_min(feature_sums.TINY)
        return out.to(v.dtype), numerator[..., -1, :], denominator[..., -1, :], reference.squeeze(-2)

    def initial_state(self, q, v) -> tuple:
        """The empty state for queries shaped like q."""
        shape = (*q.shape[:-2], q.shape[-1])
        return tuple(torch.full(shape, t.initial, dtype=torch.float32, device=q.device) for t in self.description)

    def extra_repr(self) -> str:
        return f"method=aft, state={[t.name for t in self.description]}"


# --- ONNX --------------------------------------------------------------------------------------

_PASSES = {linear.NAME: linear, hedgehog.NAME: hedgehog, favor.NAME: favor}
_ENTRY_NAMES = {linear.NAME: "LinearAttention", hedgehog.NAME: "Hedgehog", favor.NAME: "Favor"}


def recurrent_lowering(site: AttentionSite, options, opset_version: int, weights: dict | None = None) -> OnnxLowering:
    """The recurrent form as ONNX: an entry (q, k, v, key_keep, *state, *constants) -> (out,
    *state after), the state in state_description's order (outputs named ``<name>_out``). The
    constants are the parallel lowering's (the pass's onnx_lowering with ``weights``): named as
    the torch module's state_dict entries, so fitted values carry over."""
    _check(site, options)
    if options.method_name == aft.NAME:
        return _aft_recurrent_lowering(site, options, opset_version, weights)
    parallel = _PASSES[options.method_name].onnx_lowering(site, options, opset_version, weights)
    constants = dict(parallel.constants)
    description = state_description(site, options)
    state = [t.name for t in description]
    glue = _Glue(site, options, opset_version, mapped=kernels.QUERY_KEY_MAPS[0] in constants)
    (glue.windowed if options.window else glue.plain)()
    name = ("Learned" if glue.mapped else "") + "Recurrent" + ("Windowed" if options.window else "")
    entry = make_function(
        name + _ENTRY_NAMES[options.method_name],
        ["q", "k", "v", "key_keep", *state, *constants],
        ["out", *(f"{s}_out" for s in state)],
        glue.body.nodes,
        opset_version,
    )
    return OnnxLowering([*_unique(glue.functions), entry], constants)


def _aft_recurrent_lowering(site: AttentionSite, options, opset_version: int, weights: dict | None) -> OnnxLowering:
    """RecurrentAft as ONNX: (q, k, v, key_keep, numerator, denominator, key_max, key_scale,
    gate_scale, gate_bias) -> (out, *state after), the constants the parallel lowering's."""
    op = standard_opset(opset_version)
    constants = aft.onnx_lowering(site, options, opset_version, weights).constants
    masked_logits = feature_sums.masked_logits_function(opset_version, key_padding=True)
    prefix_sums = feature_sums.causal_feature_sums_function(opset_version, options.chunk)
    gate = aft.gate_function(opset_version)
    reference_of = feature_sums.reference_function(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def RecurrentAft(q, k, v, key_keep, numerator, denominator, key_max, key_scale, gate_scale, gate_bias):
        rows = op.Constant(value_ints=[-2])
        masked = masked_logits(op.Cast(k, to=FLOAT) * key_scale, key_keep)
        absorbed = op.Where(denominator > op.Constant(value_float=0.0), key_max, op.Constant(value_float=LOWEST))
        past = op.Unsqueeze(absorbed, rows)
        reference = op.Max(past, reference_of(masked))
        held = op.Exp(past - reference)
        w = op.Exp(masked - reference)
        numerator_out = prefix_sums(w * op.Cast(v, to=FLOAT)) + held * op.Unsqueeze(numerator, rows)
        denominator_out = prefix_sums(w) + held * op.Unsqueeze(denominator, rows)
        ratio = numerator_out / op.Max(denominator_out, op.Constant(value_float=feature_sums.TINY))
        last = op.Constant(value_int=-1)
        return (
            op.CastLike(gate(q, gate_scale, gate_bias) * ratio, v),
            op.Gather(numerator_out, last, axis=-2),
            op.Gather(denominator_out, last, axis=-2),
            op.Squeeze(reference, rows),
        )

    return OnnxLowering([f.to_function_proto() for f in with_callees(RecurrentAft)], constants)


class _Glue:
    """The entry's body, node by node: its inputs depend on the options."""

    def __init__(self, site: AttentionSite, options, opset_version: int, mapped: bool):
        self.site, self.options, self.opset_version, self.mapped = site, options, opset_version, mapped
        self.body = kernels.FunctionNodes()
        self.rescaled = _has_log_scale(options)
        self.terms, self.terms_constants = _PASSES[options.method_name].causal_terms_function(
            site, options, opset_version
        )
        self.flatten = kernels.flatten_heads_function(opset_version)
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
            eps = favor.EPS
            functions = kernels.causal_rescaled_linear_attention_from_state_functions(self.opset_version, chunk, eps)
            inputs = [self.flat(terms[0]), self.flat(terms[1]), self.flat(terms[3]), self.flat("v")]
        else:
            functions = kernels.causal_linear_attention_from_state_functions(self.opset_version, chunk)
            inputs = [self.flat(terms[0]), self.flat(terms[1]), self.flat("v")]
        self.functions += [f.to_function_proto() for f in functions]
        out, *new_state = self.body.call(functions[-1], *inputs, *self.flat_state(), outputs=4 if self.rescaled else 3)
        self.output(out)
        self.state_outputs(new_state)

    def windowed(self) -> None:
        b, options = self.body, self.options
        keep = self.keep()
        k_x = b("Concat", "window_keys", b("CastLike", "k", "window_keys"), axis=-2)
        v_x = b("Concat", "window_values", b("CastLike", "v", "window_values"), axis=-2)
        keep_x = b("Concat", "window_keep", keep, axis=-2)
        position = b("Reshape", "position", b.ints(1))
        start = b("Sub", position, b.ints(2 * options.window - 1))
        terms = self.call_terms("q", k_x, keep_x)
        far_phi_k, far_key_log_scale = self.far_features(terms[1], terms[3] if self.rescaled else None, start)
        weighted_q = b("Mul", terms[0], b("Exp", b("Cast", "linear_log_weight", to=FLOAT)))
        inputs = [weighted_q, self.map("q", "q"), far_phi_k, self.map("k", k_x), v_x, keep_x]
        inputs = [*(self.flat(x) for x in inputs), start, *self.flat_state()]
        if self.rescaled:
            inputs += [self.flat(terms[2]), self.flat(far_key_log_scale)]
        max_weighted = options.method_name == hedgehog.NAME
        if max_weighted:
            inputs.append(self.flat(b("Expand", b("Cast", "local_max_weight", to=FLOAT), b("Shape", terms[2]))))
        if options.sinks:
            inputs += self.sinks(keep, position)
        functions = kernels.windowed_kernel_attention_from_state_functions(
            self.opset_version,
            options.window,
            self.site.scale,
            sinks=options.sinks,
            rescaled=self.rescaled,
            max_weighted=max_weighted,
            eps=kernels.RESCALED_EPS if self.rescaled else kernels.DENOMINATOR_EPS,
        )
        self.functions += functions
        self.output(b.call(functions[-1], *inputs))
        self.absorb_leaving_keys(far_phi_k, v_x, far_key_log_scale)
        self.roll_window(k_x, v_x, keep_x, position)

    def far_features(self, phi_k: str, key_log_scale: str | None, start: str):
        """kernels.far_key_features: the sinks' features zero, their log scales the lowest."""
        if not self.options.sinks:
            return phi_k, key_log_scale
        without = kernels.without_sinks_from_function(self.opset_version, self.options.sinks)
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

        absorb, absorb_rescaled = kernels.absorb_keys_functions(self.opset_version)
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
        to_the_end, axis = b.ints(kernels.TO_THE_END), b.ints(-2)
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
