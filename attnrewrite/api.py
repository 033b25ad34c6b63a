"""The Python API: ``rewrite`` and ``find_sites`` for ONNX models and torch graphs alike."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import onnx
import onnx_ir as ir

from attnrewrite import calibration
from attnrewrite import check as check_mod
from attnrewrite.errors import AttnRewriteError, NothingRewritten
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import find_sites as _find_onnx_sites
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.onnx.validate import DEFAULT_SEQ as DEFAULT_GATE_SEQ
from attnrewrite.onnx.validate import validate as _validate
from attnrewrite.record import METADATA_KEY
from attnrewrite.layer_selection import hold_out_for_selection, select_onnx
from attnrewrite.site import AttentionSite


def rewrite(
    model: Any,
    to: str,
    layers: list[int] | str | None = None,
    validate: bool = True,
    include_single_query: bool = False,
    *,
    seq: int | None = None,
    calibrate: Any = None,
    calibrate_steps: int = calibration.DEFAULT_STEPS,
    calibrate_lr: float | None = None,
    calibrate_ce_weight: float = 0.0,
    calibrate_seed: int = 0,
    calibrate_end_to_end: int = 0,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = calibration.DEFAULT_MAX_LENGTH,
    min_cosine: float | None = None,
    inputs: str | os.PathLike | dict | None = None,
    **options,
):
    """Replace every attention site it can prove it understands with method ``to``.

    ``layers``: the site indices to replace (default: all), or ``"auto"`` with ``min_cosine``
    (ONNX models): replace the sites that cost least while the model's outputs keep that cosine
    on ``inputs`` (a ``.npz`` path or arrays by input name; default: generated from the
    signature; with ``calibrate`` and no ``inputs``, the last batch of the calibration data,
    which is then not fitted on), as ``attnrewrite.layer_selection`` describes; the record's
    ``selection`` says what each site cost.

    ``model``: an ``onnx.ModelProto``, an ``onnx_ir.Model``, a path to an ONNX file (an
    ``onnx.ModelProto`` is returned), or a torch ``nn.Module`` / ``GraphModule`` /
    ``ExportedProgram`` (a ``GraphModule`` is returned). ``options`` are the method's
    (``passes.<method>.Options``). The record of what was done is in the ONNX model's
    ``metadata_props["attnrewrite"]`` or the GraphModule's ``meta["attnrewrite"]``. When nothing
    can be rewritten the model comes back unchanged, with that record, and a ``NothingRewritten``
    warning says so. A site with a single query (a decoder step) is left exact unless
    ``include_single_query``: linearizing it saves nothing. ``seq``: the length of the generated
    inputs the mask probe and the run gate start from (ONNX only; both double it until the
    original model runs, e.g. past an audio model's convolutional front end).

    ``calibrate``: fit every replacement to the attention it replaces on this data, site by
    site (``calibrate_steps`` Adam steps each, learning rate ``calibrate_lr``, by default the
    method's: 0.03, linformer 0.003; minibatches drawn by ``calibrate_seed``; with
    ``calibrate_ce_weight`` > 0 the loss adds that times Hedgehog's cross-entropy between the
    softmax weights and the replacement's on sampled rows: linear, favor without a window,
    hedgehog). ``calibrate_end_to_end``: then fit all replacements
    together for that many steps (one batch each) so that the model's outputs match the
    original's; the record's ``end_to_end`` says how it went. For ONNX: an ``.npz`` path
    (arrays by input name), a text file path (one text per line, made into inputs
    by ``tokenizer``, a tokenizer.json, truncated to ``max_length`` tokens), a dict of arrays
    (batch axis stacked) or a list of such dicts. For torch: a list of example inputs, each a
    tuple of positional arguments or a dict of keyword arguments.
    """
    fit = dict(
        steps=calibrate_steps, lr=calibrate_lr, ce_weight=calibrate_ce_weight, seed=calibrate_seed,
        end_to_end=calibrate_end_to_end,
    )
    if layers == "auto":
        options = {**options, "include_single_query": include_single_query, "seq": seq}
        fit.update(tokenizer=tokenizer, max_length=max_length)
        return _rewrite_auto(model, to, validate, min_cosine, inputs, calibrate, fit, options)
    if min_cosine is not None or inputs is not None:
        raise AttnRewriteError("min_cosine and inputs choose layers: they go with layers='auto'")
    if _is_onnx(model):
        ir_model = _to_ir(model)
        fitting = None
        if calibrate is not None:
            fitting = calibration.onnx_calibration(
                calibrate, ir_model.graph, tokenizer=tokenizer, max_length=max_length, **fit
            )
        ir_model, record = rewrite_model(
            ir_model, to, layers=layers, include_single_query=include_single_query,
            calibration=fitting, seq=seq, **options,
        )
        _warn_if_nothing_rewritten(len(record.outcomes), len(record.rewritten))
        if not record.rewritten and not isinstance(model, ir.Model):
            # unchanged means the caller's bytes, not a re-serialization after shape inference
            original = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))
            return _with_record(original, ir_model)
        if validate and record.rewritten:
            gate = _validate(ir_model, seq=seq or DEFAULT_GATE_SEQ, original=_runnable(model))
            if gate.note:
                _add_note(ir_model, gate.note)
        return ir_model if isinstance(model, ir.Model) else ir.serde.serialize_model(ir_model)
    from attnrewrite.fx import rewrite_graph_module

    if calibrate is not None:
        options.update(calibrate=calibrate, **{f"calibrate_{name}": value for name, value in fit.items()})
    gm = rewrite_graph_module(model, to, layers=layers, include_single_query=include_single_query, **options)
    _warn_if_nothing_rewritten(gm.meta[METADATA_KEY]["sites_found"], gm.meta[METADATA_KEY]["sites_rewritten"])
    return gm


def _rewrite_auto(model, to: str, validate: bool, min_cosine, inputs, calibrate, fit_settings: dict, options):
    if not _is_onnx(model):
        raise AttnRewriteError("layers='auto' measures fidelity with onnxruntime: it takes an ONNX model")
    if min_cosine is None:
        raise AttnRewriteError("layers='auto' needs min_cosine: the cosine the rewritten model must keep")
    fresh = _fresh_copies(model)
    base = fresh()
    fitting = None if calibrate is None else calibration.onnx_calibration(calibrate, base.graph, **fit_settings)
    if fitting is not None and inputs is None:
        fitting, prepared = hold_out_for_selection(fitting, base.graph)
    else:
        prepared = check_mod.prepare_inputs(base, inputs)
    ir_model, record, selection = select_onnx(fresh, to, options, min_cosine, prepared, calibration=fitting)
    if not record.rewritten and selection.choices:
        warnings.warn(
            f"attnrewrite: layer selection: no site keeps the cosine >= {min_cosine:g}; the model is returned "
            "unchanged (the record's selection says what each site cost)", NothingRewritten, stacklevel=3,
        )
    else:
        _warn_if_nothing_rewritten(len(record.outcomes), len(record.rewritten))
    if not record.rewritten and not isinstance(model, ir.Model):
        original = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))
        return _with_record(original, ir_model)
    if validate and record.rewritten:
        gate = _validate(ir_model, seq=options.get("seq") or DEFAULT_GATE_SEQ, original=_runnable(model))
        if gate.note:
            _add_note(ir_model, gate.note)
    return ir_model if isinstance(model, ir.Model) else ir.serde.serialize_model(ir_model)


def _fresh_copies(model):
    """A function returning a new ir.Model of ``model`` at each call (a rewrite changes its model)."""
    if isinstance(model, (str, os.PathLike)):
        return lambda: onnx_io.load_model(model)
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    return lambda: onnx_io.from_proto(proto)


def find_sites(model: Any, seq: int | None = None) -> list[AttentionSite]:
    """Every attention site in the model, rewritable or not (``skip_reason`` says why not).
    ``seq``: the input length the ONNX mask probe starts from."""
    if _is_onnx(model):
        return _find_onnx_sites(_to_ir(model), seq)
    from attnrewrite.fx import find_fx_sites

    return find_fx_sites(model)


def _warn_if_nothing_rewritten(found: int, rewritten: int) -> None:
    """The CLI fails when nothing is rewritten; the API returns the model, so it says so."""
    if rewritten:
        return
    why = "no softmax attention found" if not found else f"none of the {found} attention sites could be rewritten"
    warnings.warn(f"attnrewrite: {why}; the model is returned unchanged (the record says why)", NothingRewritten, stacklevel=3)


def _runnable(model):
    """The original model for onnxruntime (a path, or a ModelProto), when the rewrite left it intact:
    an ``onnx_ir.Model`` is rewritten in place."""
    if isinstance(model, onnx.ModelProto):
        return model  # serialized only if the gate needs to run it
    return None if isinstance(model, ir.Model) else os.fspath(model)


def _add_note(model: ir.Model, note: str) -> None:
    record = json.loads(model.metadata_props[METADATA_KEY])
    record["notes"] = [*record.get("notes", []), note]
    model.metadata_props[METADATA_KEY] = json.dumps(record, sort_keys=True)


def _with_record(original: onnx.ModelProto, rewritten: ir.Model) -> onnx.ModelProto:
    """The original proto untouched but for the record (an existing record is kept as is)."""
    if any(p.key == METADATA_KEY for p in original.metadata_props):
        return original
    copy = onnx.ModelProto()
    copy.CopyFrom(original)
    onnx.helper.set_model_props(copy, {**{p.key: p.value for p in copy.metadata_props}, METADATA_KEY: rewritten.metadata_props[METADATA_KEY]})
    return copy


def _is_onnx(model: Any) -> bool:
    return isinstance(model, (onnx.ModelProto, ir.Model, str, os.PathLike))


def _to_ir(model) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return onnx_io.from_proto(model)
    return onnx_io.load_model(model)
