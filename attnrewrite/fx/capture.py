"""Capturing a torch model as a graph that runs at any batch size and length.

symbolic_trace where it can (its graphs are shape-generic); where it cannot (every transformers
model), torch.export with ``Dim.AUTO`` on each tensor input's batch axis and, for [batch, seq]
and [batch, seq, features] inputs, its sequence axis. AUTO lets torch.export keep a dim static
where the model's code fixes it (or where the example has size 0 or 1, which torch.export
specializes); the dims that stayed static are said in a warning and recorded, and a model that
will not export with dynamic dims at all is captured at the example's shapes, saying why.

Example inputs are taken as users hold them: a tuple (or list) of positional arguments, a
mapping of keyword arguments (a dict, a tokenizer's BatchEncoding) or a single tensor. The module
torch.export returns takes them the same way and returns what the model returns (a
transformers ModelOutput stays one).
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx import GraphModule
from torch.utils import _pytree

from attnrewrite.errors import AttnRewriteError

Example = tuple | dict


class StaticShapes(UserWarning):
    """The captured module runs only at some of the example's sizes (capture's ``static``)."""


def as_example(inputs: Any) -> Example:
    """Positional arguments (a tuple) or keyword arguments (a dict) from what the user holds."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    return (inputs,)


def call(module: nn.Module, example: Example) -> Any:
    return module(**example) if isinstance(example, dict) else module(*example)


def dynamic_axes(rank: int) -> tuple[int, ...]:
    """The axes captured as dynamic by default: batch, and sequence for [B, N] and [B, N, D]."""
    return (0, 1) if rank in (2, 3) else (0,) if rank else ()


def export(model: nn.Module, example: Example, dynamic_shapes: Any = None) -> tuple[GraphModule, dict]:
    """(torch.export's module of a copy of ``model``, the record's ``capture`` entry). With
    ``dynamic_shapes`` the user's choice is passed through; without, default_dynamic_shapes,
    falling back to the example's shapes where the model does not export with them."""
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), example)
    model, cache_off = without_kv_cache(model)
    notes = {"use_cache": False} if cache_off else {}
    if dynamic_shapes is not None:
        program = _export(model, args, kwargs, dynamic_shapes)
        return program.module(), capture_entry(program, requested=False) | notes
    shapes = default_dynamic_shapes(model, args, kwargs)
    try:
        program = _export(model, args, kwargs, shapes)
    except AttnRewriteError as dynamic_failure:
        program = _export(model, args, kwargs, None)
        entry = capture_entry(program, requested=True) | notes | {"fallback": str(dynamic_failure)}
        _warn(f"captured at the example's shapes only ({dynamic_failure})")
        return program.module(), entry
    entry = capture_entry(program, requested=True) | notes
    if entry["static"]:
        _warn(f"kept static by torch.export: {', '.join(entry['static'])}; the module runs only at those sizes")
    return program.module(), entry


def without_kv_cache(model: nn.Module) -> tuple[nn.Module, bool]:
    """(a copy of ``model`` to capture, whether its transformers config's ``use_cache`` was
    turned off in it). Decoders return a KV cache by default: a DynamicCache, which torch.export
    cannot output, and which a linearized attention would not keep (it needs --recurrent, an
    ONNX rewrite). The user's model is untouched."""
    model = copy.deepcopy(model)
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for config in configs.values():
        config.use_cache = False
    return model, bool(configs)


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``Dim.AUTO`` on the dynamic_axes of every tensor argument, keyed by parameter name."""

    def spec(value):
        if not isinstance(value, torch.Tensor):
            return None
        return {axis: Dim.AUTO for axis in dynamic_axes(value.dim())} or None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as error:
        raise AttnRewriteError(f"the example inputs do not fit {type(model).__name__}.forward: {error}") from None
    return {name: _pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def capture_entry(program: torch.export.ExportedProgram, requested: bool) -> dict:
    """Which input dims are dynamic (with the largest size the model allows, where bounded)
    and, where ``requested`` (the defaults), which of the dynamic_axes stayed static."""
    dynamic, static = [], []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.name not in program.graph_signature.user_inputs or not isinstance(value, torch.Tensor):
            continue
        for axis, size in enumerate(value.shape):
            name = f"{node.name}.size({axis})"
            if isinstance(size, torch.SymInt):
                bound = program.range_constraints.get(size.node.expr)
                upper = bound.upper if bound is not None and bound.upper.is_Integer else None  # int_oo is not
                dynamic.append(name if upper is None else f"{name} <= {int(upper)}")
            elif requested and axis in dynamic_axes(value.dim()):
                static.append(f"{name} = {size}{' (torch.export fixes sizes 0 and 1)' * (size < 2)}")
    return {"exporter": "torch.export", "dynamic": dynamic, "static": static}


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> torch.export.ExportedProgram:
    try:
        with warnings.catch_warnings():  # transformers and torch warn about their own deprecations
            warnings.simplefilter("ignore")
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as error:  # noqa: BLE001 - torch.export fails in many ways; each is the user's to act on
        raise AttnRewriteError(f"torch.export cannot capture {type(model).__name__}: {first_line(error)}") from None


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _warn(message: str) -> None:
    warnings.warn(StaticShapes(f"attnrewrite: {message}"), stacklevel=_first_caller_outside_attnrewrite())


def _first_caller_outside_attnrewrite() -> int:
    """The warning's stacklevel: the user's line, however many of this package's calls lie between."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
