"""One module per linearization. Each module provides:

- ``NAME``: the method's name on the command line (``--to NAME``);
- ``Options``: a dataclass of the method's settings (every method takes ``seed``),
  ``class Options(MethodOptions, method=NAME)``, each field declared with
  ``passes.options.option(default, help, choices=..., valid=...)`` (``valid``: a range such as
  ``AtLeast(1)``), so ``--list-options`` can say what it accepts and building one refuses
  anything else with an ``OptionError``;
- ``supports(site, options) -> None | reason``: why a site cannot be replaced, if it cannot;
- ``torch_module(site, options, learnable=False)``: an nn.Module ``forward(q, k, v,
  key_keep=None)``, the FX lowering and the numeric reference (``key_keep``: 1.0 for keys to
  attend to, 0.0 for padding, broadcastable to [..., Nk, 1]);
- ``onnx_lowering(site, options, opset_version, weights=None) -> OnnxLowering``: model-local
  functions in domain ``attnrewrite`` with the same inputs, plus the constants (random
  features, projections) they read;
- ``nothing_to_fit(options) -> None | reason``: why calibration cannot fit this method
  (``hooks.nothing_unfittable`` where it always can);
- ``exact_part(options, causal) -> None | ExactPart``: up to which length the replacement is
  softmax attention itself (a window, N <= k, one chunk), so a fidelity check can look past it
  (``hooks.never_exact`` for a method never exact).

Calibration (attnrewrite/passes/fit.py; the frontends only collect q, k, v, key_keep and write values back):
- ``torch_module(..., learnable=True)``: every fittable value is an ``nn.Parameter``, initialised
  so that the output is the uncalibrated module's; fixed values stay buffers. What is fitted:
  favor the projection W (from the seeded draw); linformer E and F (gaussian or learned;
  pool/identity have nothing to fit); linear and hydra ``query_map`` / ``key_map``, a per-head
  linear map of q and k before the feature map ([heads, d, d] when heads are known, else
  [1, d, d]; identity at first; present only when learnable; with ``window`` the window's exact
  part sees the mapped q and k too); hedgehog W and b (with a window also its log scales and
  local max weight, hedgehog.py); aft its gate and key scales and, variant=local, its
  position bias; efficient its query and key temperatures (aft.py, efficient.py); nystrom a
  per-head log scale of each of its three softmaxes' logits; lsh nothing. A window's ``linear_log_weight`` (and hedgehog's
  other window values) is a parameter either way.
- The lowering's ``constants`` are named as the module's ``state_dict()`` entries and hold the
  same values. ``weights`` (name -> np.ndarray, a fitted module's state) replaces them; for
  linear and hydra it also selects the ``Learned<Entry>`` function that applies the maps
  (kernel.query_key_maps.with_learned_entry). With ``weights=None`` and ``learnable=False`` the output is
  exactly what it was before calibration existed.
- Optional: ``attention_weights(q, k, key_keep=None)`` on the module, its normalized weights
  [..., Nq, Nk] (linear, favor, hedgehog), for the fitter's attention-weight cross-entropy; such
  every method says for which options it has them with ``attention_weights_unavailable(options)
  -> None | reason`` (``hooks.no_attention_weights(NAME)`` where it never has).

Decoders that generate (passes/recurrent.py): a method that runs as a recurrence, carrying a
fixed-size state instead of a KV cache, says so beside its other forms with ``recurrence(options)
-> Recurrence | str`` (linear, hedgehog and favor through passes/kernel/recurrence.py from their FeatureMap,
window included; AFT-simple in aft.py; streaming's cache of exact keys in streaming.py); one that never does says why in ``NO_RECURRENCE``.

Adding a method means adding a module here and listing it in ``_METHODS``; building the registry
checks that it declares every hook (passes/hooks.py), so a missing or misspelled one fails at
import. A kernel method can
take ``window`` (exact softmax over neighbouring blocks and sink keys, the kernel beyond, with
``window_next`` and ``sinks``: passes/window/); a method that cannot says why in ``NO_WINDOW``,
which ``make_options`` reports.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes import (
    aft,
    efficient,
    favor,
    hedgehog,
    hooks,
    hydra,
    linear,
    linformer,
    lsh,
    nystrom,
    optional_torch,
    streaming,
)
from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.options import MethodOptions, OptionError


def _declared(method: types.ModuleType) -> types.ModuleType:
    """``method``, once it declares every hook (hooks.undeclared); TypeError saying what it lacks."""
    problems = hooks.undeclared(method)
    if problems:
        raise TypeError(f"method module {method.__name__} {'; '.join(problems)}")
    return method


_METHODS = tuple(
    _declared(m) for m in (linear, hydra, favor, linformer, lsh, hedgehog, nystrom, aft, efficient, streaming)
)
PASSES: dict[str, types.ModuleType] = {m.NAME: m for m in _METHODS}
# Methods with the ``window`` option (passes/window/); the others say why not.
WINDOWED = tuple(m.NAME for m in _METHODS if "window" in {f.name for f in dataclasses.fields(m.Options)})


def get_pass(name: str) -> types.ModuleType:
    try:
        return PASSES[name]
    except KeyError:
        raise OptionError(f"unknown method {name!r}; choose one of: {', '.join(PASSES)}") from None


def nothing_to_fit(method: types.ModuleType, options) -> str | None:
    """Why calibration cannot fit ``method`` with ``options``; None when it can."""
    return method.nothing_to_fit(options)


def exact_part(method: types.ModuleType, options, causal: bool = False) -> ExactPart | None:
    """Where ``method`` with ``options`` is softmax attention itself (ExactPart): up to
    which length, and how many keys a query attends to exactly; None for a method never exact."""
    return method.exact_part(options, causal)


def attention_weights_unavailable(method: types.ModuleType, options) -> str | None:
    """Why ``method``'s modules cannot give the attention weights the fitter's cross-entropy
    compares; None when they can."""
    return method.attention_weights_unavailable(options)


def method_and_options(to, **values) -> tuple[types.ModuleType, MethodOptions]:
    """(the pass module, its Options) for ``to``: a method's name with its option ``values``
    (strings from the CLI or values), or Options a caller built once and hands on."""
    if isinstance(to, MethodOptions):
        if values:
            raise TypeError(f"options given twice: as {type(to).__name__} and as {', '.join(values)}")
        return get_pass(to.method_name), to
    method = get_pass(to)
    return method, make_options(method, **values)


def require_fittable(method: types.ModuleType, options, ce_weight: float = 0.0) -> None:
    """One clear line, before any work, when calibration cannot run at all (or not with the
    attention-weight cross-entropy ``ce_weight`` asks for)."""
    if optional_torch.torch is None:  # looked up at each call: a torch-less install is tested so
        raise AttnRewriteError("calibration fits in PyTorch: pip install 'attnrewrite[torch]'")
    reason = nothing_to_fit(method, options)
    if reason:
        raise AttnRewriteError(f"cannot calibrate: {reason}")
    if not 0 <= ce_weight < math.inf:
        raise AttnRewriteError(
            f"the attention-weight cross-entropy weight must be a finite number >= 0, got {ce_weight:g}"
        )
    if ce_weight and (reason := attention_weights_unavailable(method, options)):
        raise AttnRewriteError(f"cannot calibrate with the attention-weight cross-entropy: {reason}")


def make_options(method: types.ModuleType, **values):
    """Build ``method.Options`` from keyword values, converting strings (from the CLI); the
    Options check what they got against their declarations (passes.options.MethodOptions)."""
    fields = {f.name: f for f in dataclasses.fields(method.Options)}
    hints = typing.get_type_hints(method.Options)
    converted = {}
    for key, value in values.items():
        if key == "window" and "window" not in fields:  # such a method says why (hooks.NO_WINDOW)
            if _convert(value, int) != 0:  # 0 is "off", which such a method always is
                raise OptionError(
                    f"method {method.NAME!r} cannot take window={value}: {method.NO_WINDOW} "
                    f"(window is for {', '.join(WINDOWED)})"
                )
            continue
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise OptionError(f"method {method.NAME!r} has no option {key!r} (options: {known})")
        converted[key] = _convert(value, hints[key])
    return method.Options(**converted)


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _convert(value, hint):
    """A command line string as the hint's type; a string that is none of it stays a string,
    for the Options to refuse with what the option accepts."""
    if not isinstance(value, str):
        return value
    args = typing.get_args(hint)
    if type(None) in args and value.lower() == "none":
        return None
    target = next((t for t in args if t is not type(None)), hint)
    if target is bool:
        word = value.lower()
        return word in _TRUE if word in _TRUE + _FALSE else value
    if target in (int, float):
        try:
            return target(value)
        except ValueError:
            return value
    return value
