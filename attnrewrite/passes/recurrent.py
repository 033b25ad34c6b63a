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
"""

from __future__ import annotations

import abc
import dataclasses
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
