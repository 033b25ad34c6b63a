"""What every recurrent form shares: decoders that generate carry a fixed-size state instead of a
KV cache that grows with every token.

A method says whether and how it runs as a recurrence beside its other forms: its module has
``recurrence(options) -> Recurrence | str`` (the form, or why these options have none), or a
``NO_RECURRENCE`` sentence saying why it never does. A Recurrence gives the per-layer state
(``state``: StateTensor, in the order its module and lowering take and return it), the torch
module (``torch_module``: the parallel module's values, fitted or not, stepped) and the ONNX
lowering (``onnx_lowering``: an entry (q, k, v, key_keep, *state, *constants) -> (out, *state
after)). One code path serves prefill (N new tokens from the zero state) and decoding (N = 1);
stepping it token by token gives the parallel causal form's outputs on the whole sequence,
rounding aside. An all-zero state is the initial one, and padded keys (key_keep 0) never enter it.

The forms: the kernel methods' (linear, hedgehog, favor, window included) in passes/kernel/
(recurrence.py, from each method's FeatureMap), causal AFT-simple's in passes/aft.py.

What a state costs beside the KV cache it replaces, per sequence: ``rewrite_memory``
(StateMemory), which ``--list``, the record and ``check`` state (docs/cli.md).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import types

import numpy as np

from attnrewrite.passes.lowering import OnnxLowering
from attnrewrite.site import AttentionSite

NOT_CAUSAL = "only a causal attention is a recurrence: a bidirectional one reads keys not yet generated"


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's recurrent state. ``shape``: symbolic axes by name (B, H: q's
    leading axes, or G for [batch * heads, ...] sites; Hkv the key/value heads of grouped ones;
    F features where they are not known; D, Dv the head dims) and fixed sizes as ints;
    ``dtype``: "float32", "int64" or "model" (the site's k and v dtype); ``initial``: its value
    in the zero state."""

    name: str
    shape: tuple[str | int, ...]
    dtype: str
    initial: float
    meaning: str

    @property
    def output_name(self) -> str:
        """The name of this tensor after a call, among the lowering entry's outputs."""
        return f"{self.name}_out"


def leading_axes(site: AttentionSite) -> tuple[str, ...]:
    """A state tensor's leading axes: q's, [B, H] or [G]."""
    return ("B", "H") if site.rank == 4 else ("G",)


def key_value_groups(site: AttentionSite) -> int:
    """The query heads that share each key/value head at a KV-cache site (grouped or
    multi-query attention): a state part holding keys or values as they came keeps one per
    key/value head, not one per query head. 1 where the grouping is not known."""
    cache = site.kv_cache
    if site.rank != 4 or not site.num_heads or cache is None or not cache.kv_heads:
        return 1
    return site.num_heads // cache.kv_heads if site.num_heads % cache.kv_heads == 0 else 1


def key_value_axes(site: AttentionSite) -> tuple[str, ...]:
    """The leading axes of a state part holding keys or values: [B, Hkv] at grouped heads."""
    return ("B", "Hkv") if key_value_groups(site) > 1 else leading_axes(site)


@dataclasses.dataclass
class RecurrentLowering(OnnxLowering):
    """An OnnxLowering whose entry also takes and returns ``state`` (outputs StateTensor.output_name).
    ``key_value_groups``: the entry's k and v have one head per key/value head, each serving
    that many query heads (1: they have q's heads)."""

    state: list[StateTensor] = dataclasses.field(default_factory=list)
    key_value_groups: int = 1


class Recurrence(abc.ABC):
    """How a method with one set of options runs as a recurrence."""

    @abc.abstractmethod
    def state(self, site: AttentionSite) -> list[StateTensor]:
        """The per-layer state, in the order the module and the lowering take and return it."""

    @abc.abstractmethod
    def torch_module(self, site: AttentionSite, parallel):
        """forward(q, k, v, key_keep, *state) -> (out, *state after), with ``initial_state(q,
        v)``; ``parallel``: the pass's torch_module for the site (fitted or not), whose values it
        uses as they are."""

    @abc.abstractmethod
    def onnx_lowering(
        self, site: AttentionSite, opset_version: int, weights: dict | None = None, contrib_ops: bool = False
    ) -> RecurrentLowering:
        """The entry (q, k, v, key_keep, *state, *constants) -> (out, *state after); constants
        named as the torch module's state_dict entries, so fitted values (``weights``) carry over.
        ``contrib_ops``: the runtime runs onnxruntime's contrib operators (LinearAttention), which
        a form may use where they beat standard ones; else standard operators only."""


# bytes per element of the dtypes a state or a KV cache holds (a StateTensor's "model" is the site's)
DTYPE_BYTES = {"float64": 8, "int64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """One sequence's memory in a recurrent rewrite against the KV cache it replaces, over
    ``layers`` sites: ``state_bytes``, every state tensor at batch 1; ``kv_bytes_per_token``,
    the keys and values one token adds to those sites' caches. None where a site does not know
    a size; ``unknown`` says which (never guessed)."""

    layers: int
    state_bytes: int | None
    kv_bytes_per_token: int | None
    unknown: tuple[str, ...] = ()

    @property
    def kv_tokens_equivalent(self) -> int | None:
        """The tokens of KV cache the state's bytes buy (whole tokens)."""
        if self.state_bytes is None or not self.kv_bytes_per_token:
            return None
        return self.state_bytes // self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return {
            "layers": self.layers,
            "state_bytes": self.state_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_tokens_equivalent": self.kv_tokens_equivalent,
            **({"unknown": list(self.unknown)} if self.unknown else {}),
        }


def rewrite_memory(method: types.ModuleType, options, sites: list[AttentionSite]) -> StateMemory:
    """The memory per sequence of ``sites`` replaced by ``method``'s recurrence with ``options``."""
    state_bytes, kv_bytes, unknown = 0, 0, []
    for site in sites:
        state = sized_bytes(form_for(method, site, options).state(site), site)
        cache = kv_cache_bytes_per_token(site)
        for size, what in ((state, "state"), (cache, "KV cache")):
            if isinstance(size, str):
                unknown.append(f"{site.name}'s {what}: {size}")
        state_bytes = None if state_bytes is None or isinstance(state, str) else state_bytes + state
        kv_bytes = None if kv_bytes is None or isinstance(cache, str) else kv_bytes + cache
    return StateMemory(len(sites), state_bytes, kv_bytes, tuple(unknown))


def sized_bytes(state: list[StateTensor], site: AttentionSite) -> int | str:
    """The bytes of ``state`` at ``site`` for one sequence (batch 1), or what is not known."""
    sizes = {"B": 1, "H": site.num_heads, "D": site.head_dim, "Dv": site.value_dim}
    sizes["Hkv"] = site.kv_cache.kv_heads if site.kv_cache is not None else None
    shapes = [state_shape(t, {axis: n for axis, n in sizes.items() if n is not None}) for t in state]
    missing = sorted({axis for shape in shapes for axis in shape if isinstance(axis, str)})
    element_bytes = [DTYPE_BYTES.get(site.dtype if t.dtype == "model" else t.dtype) for t in state]
    if missing or None in element_bytes:
        return f"{'the axes ' + ', '.join(missing) if missing else 'the dtype ' + site.dtype} not known"
    return sum(math.prod(shape) * n for shape, n in zip(shapes, element_bytes))


def kv_cache_bytes_per_token(site: AttentionSite) -> int | str:
    """The bytes one token adds to ``site``'s KV cache (its key and its value, every key/value
    head), or what is not known."""
    cache = site.kv_cache
    if cache is None:
        return "no KV cache"
    dims = {"key/value heads": cache.kv_heads, "head_dim": site.head_dim, "value_dim": site.value_dim}
    missing = [name for name, n in dims.items() if n is None]
    if missing or site.dtype not in DTYPE_BYTES:
        return f"{', '.join(missing) or 'the dtype ' + site.dtype} not known"
    return cache.kv_heads * (site.head_dim + site.value_dim) * DTYPE_BYTES[site.dtype]


def recurrence(method: types.ModuleType, options) -> Recurrence | str:
    """``method``'s recurrent form with ``options``, or why it has none."""
    # a method module defines exactly one of the two (checked at import: passes/hooks.py)
    return method.recurrence(options) if hasattr(method, "recurrence") else method.NO_RECURRENCE


def recurrent_refusal(method: types.ModuleType, options) -> str | None:
    """Why ``method`` (a pass module) with ``options`` cannot run as a recurrence; None when it can."""
    form = recurrence(method, options)
    return form if isinstance(form, str) else None


def site_refusal(site: AttentionSite) -> str | None:
    """Why ``site`` cannot carry a recurrent state; None when it can."""
    return None if site.mask.causal else NOT_CAUSAL


def form_for(method: types.ModuleType, site: AttentionSite, options) -> Recurrence:
    """The recurrence of ``method`` at ``site``; ValueError saying why where there is none."""
    form = recurrence(method, options)
    reason = form if isinstance(form, str) else site_refusal(site)
    if reason:
        raise ValueError(f"no recurrent form for {method.NAME} at {site.name}: {reason}")
    return form


def zero_state(description: list[StateTensor], sizes: dict[str, int], model_dtype=np.float32) -> list[np.ndarray]:
    """The zero state as numpy arrays; ``sizes``: every symbolic axis of ``description``."""
    dtypes = {"float32": np.float32, "int64": np.int64, "model": model_dtype}
    return [np.full(state_shape(t, sizes), t.initial, dtypes[t.dtype]) for t in description]


def state_shape(tensor: StateTensor, sizes: dict) -> tuple:
    """``tensor``'s shape with its symbolic axes looked up in ``sizes`` (left as they are where
    ``sizes`` does not have them); "X+1" is one more than X."""
    return tuple(_size(axis, sizes) if isinstance(axis, str) else axis for axis in tensor.shape)


def _size(axis: str, sizes: dict):
    base, plus_one, _ = axis.partition("+1")
    if plus_one and base in sizes:
        return sizes[base] + 1
    return sizes.get(axis, axis)
