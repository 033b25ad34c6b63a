"""What a method module declares (passes/__init__.py says what each name means), checked when
the registry is built: a missing or misspelled name fails at import instead of quietly meaning
"never exact" or "nothing to fit". Every module defines each of REQUIRED; of RECURRENCE exactly
one; and NO_WINDOW exactly when its Options have no ``window``. The answers below are for the
methods to which a hook does not apply, each module naming the one it takes."""

from __future__ import annotations

import dataclasses
import types

REQUIRED = (
    "NAME",
    "Options",
    "supports",
    "torch_module",
    "onnx_lowering",
    "nothing_to_fit",
    "exact_part",
    "attention_weights_unavailable",
)
RECURRENCE = ("recurrence", "NO_RECURRENCE")  # the form, or why there is none
NO_WINDOW = "NO_WINDOW"


def undeclared(method: types.ModuleType) -> list[str]:
    """What ``method`` fails to declare, as sentences; [] when it declares every hook."""
    problems = [f"defines no {name}" for name in REQUIRED if not hasattr(method, name)]
    recurrence = [name for name in RECURRENCE if hasattr(method, name)]
    if len(recurrence) != 1:
        problems.append(f"must define exactly one of {' and '.join(RECURRENCE)}, not {recurrence or 'neither'}")
    if hasattr(method, "Options"):
        windowed = "window" in {f.name for f in dataclasses.fields(method.Options)}
        if windowed == hasattr(method, NO_WINDOW):
            problems.append(f"must define {NO_WINDOW} exactly when its Options have no window")
    return problems


def nothing_unfittable(options) -> None:
    """nothing_to_fit of a method that always has values to fit."""
    return None


def never_exact(options, causal: bool = False) -> None:
    """exact_part of a method that is softmax attention at no length."""
    return None


def no_attention_weights(name: str):
    """attention_weights_unavailable of the method ``name``, whose modules give no attention weights."""

    def attention_weights_unavailable(options) -> str:
        return f"{name} gives no attention weights"

    return attention_weights_unavailable


def none_apply(name: str):
    """(nothing_to_fit, exact_part, attention_weights_unavailable) of the method ``name``, to
    which none of them applies: always fittable, never exact, no attention weights."""
    return nothing_unfittable, never_exact, no_attention_weights(name)
