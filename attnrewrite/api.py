"""The Python API: ``rewrite`` and ``find_sites`` for ONNX models and torch graphs alike."""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import onnx
import onnx_ir as ir

from attnrewrite import calibration, passes, pipeline
from attnrewrite import settings as run_settings
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError, NothingRewritten
from attnrewrite.onnx.rewrite import find_sites as find_onnx_sites
from attnrewrite.record import METADATA_KEY
from attnrewrite.site import AttentionSite


def rewrite(
    model: Any,
    to: str,
    layers: list[int] | str | None = None,
    validate: bool = True,
    include_single_query: bool = False,
    *,
    recurrent: bool = False,
    standard_ops: bool = False,
    state_budget: str | None = None,
    heads: dict[int, list[int]] | str | None = None,
    example_inputs: Any = None,
    dynamic_shapes: Any = None,
    **keywords,
):
    """Replace every attention site it can prove it understands with method ``to``.

    ``model``: an ``onnx.ModelProto``, an ``onnx_ir.Model`` (rewritten in place), a path to an
    ONNX file (an ``onnx.ModelProto`` is returned), or a torch ``nn.Module`` / ``GraphModule`` /
    ``ExportedProgram`` (a ``GraphModule`` is returned). ``keywords``: the run's settings
    (attnrewrite.settings, each described below: the gates', calibration's, fine-tuning's) and
    the method's options (``attnrewrite.passes.<method>.Options``). The record of what was done
    is in the ONNX model's ``metadata_props["attnrewrite"]`` or the GraphModule's
    ``meta["attnrewrite"]``. When nothing can be rewritten the model comes back unchanged, with
    that record, and a ``NothingRewritten`` warning says so. A site with a single query (a
    decoder step) is left exact unless ``include_single_query``: linearizing it saves nothing. A
    rewritten ONNX model has passed the validation gates (unless ``validate=False``): the ONNX
    checker, an onnxruntime session and a run.

    ``recurrent`` (ONNX decoders exported with a KV cache; linear, hedgehog, favor and their
    windows): each KV-cache site becomes a recurrence and its cache a fixed-size state, inputs
    ``past_key_values.{i}.<part>`` and outputs ``present.{i}.<part>`` (docs/cli.md, "Decoders").
    A decoding step updates and reads the kernel state with onnxruntime's
    ``com.microsoft.LinearAttention`` where the installed onnxruntime runs it; ``standard_ops``
    keeps to standard ONNX operators, for other runtimes. ``state_budget`` (with ``recurrent``:
    ``"16MB"``, ``"322tok"``) sizes the state to fit it: the widest window or the most recent
    keys that fit, said in the record's notes (``attnrewrite.state_budget``).

    What the run did and how it ended (docs/report.md, the CLI's ``--report``): an error raised
    for an ONNX model carries it as ``error.report``, the ``NothingRewritten`` warning as
    ``warning.report``; ``attnrewrite.pipeline.run`` returns it as ``Result.report`` with the
    model, its record and the comparison (``Result.fidelity``).

    ``layers``: the site indices to replace (default: all), or ``"auto"`` with ``min_cosine``
    (ONNX models): replace the sites that cost least while the model keeps the fidelity gates
    on ``inputs`` (with ``calibrate`` and no ``inputs``: the last batch of the calibration data,
    which is then not fitted on), as ``attnrewrite.layer_selection`` describes; the record's
    ``selection`` says what each site cost.

    ``heads`` (ONNX models): heads kept exact softmax inside their site's replacement, by layer
    (``{3: [0, 7]}``; the method runs on the other heads, with its values for them; a site with
    every head exact is left as it was), or ``"auto"`` with ``min_cosine`` and/or
    ``min_agreement``: measure each head's share of its site's output error and keep the fewest,
    costliest heads exact with which the model keeps the gates, on ``inputs`` or held-out
    calibration data as for ``layers="auto"`` (which it composes with), as
    ``attnrewrite.head_selection`` describes; the record's ``selection`` says each head's cost
    and each site's ``exact_heads`` which are exact. With ``calibrate`` every head is fitted,
    then the exact heads' values are left out. Not with ``recurrent``.
    """
    given, options = run_settings.split(keywords)
    if "finetune" in given:
        given["finetune"] = calibration.FINETUNE_STEPS if given["finetune"] is True else int(given["finetune"])
    run = dict(include_single_query=include_single_query, standard_ops=standard_ops, state_budget=state_budget)
    settings = pipeline.Settings(to, options, layers, heads, recurrent=recurrent, validate=validate, **run, **given)
    if not _is_onnx(model):
        return _rewrite_torch(model, settings, example_inputs=example_inputs, dynamic_shapes=dynamic_shapes)
    if example_inputs is not None or dynamic_shapes is not None:
        raise AttnRewriteError("example_inputs and dynamic_shapes capture torch models; an ONNX model's are inputs=")
    result = pipeline.run(model, settings)
    if not result.record.rewritten:
        _warn_nothing_rewritten(result)
        if not isinstance(model, ir.Model):
            # unchanged means the caller's bytes, not a re-serialization after shape inference
            original = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))
            return _with_record(original, result.model)
    return result.model if isinstance(model, ir.Model) else ir.serde.serialize_model(result.model)


_CAPTURE = """``example_inputs`` (torch models): inputs as the model is called with them, a tuple of
positional arguments, a dict of keyword arguments or a tokenizer's ``BatchEncoding``. A model
``torch.fx.symbolic_trace`` cannot trace (every transformers model) is captured with
``torch.export`` on them, batch and sequence axes dynamic (``Dim.AUTO``; ``dynamic_shapes``,
torch.export's argument, to choose otherwise): the module runs at any batch and any length up
to the model's position limit, takes its inputs as the example gave them and returns what the
model returns (``gm(**batch).last_hidden_state``). Dims torch.export keeps static (a size of
1 in the example, or fixed by the model's code) are said in a ``StaticShapes`` warning; the
record's ``capture`` lists which are dynamic and which static."""


def _declare_settings(function) -> None:
    """``function``'s signature lists every declared run setting as a keyword (its default and
    type), before the method's options; its docstring adds each group's description."""
    signature = inspect.signature(function)
    fixed = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    declared = [
        inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=field.type)
        for field in run_settings.declared()
    ]
    options = inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)
    function.__signature__ = signature.replace(parameters=[*fixed, *declared, options])
    sections = [inspect.cleandoc(group.__doc__) for group in run_settings.GROUPS]
    function.__doc__ = "\n\n".join([inspect.cleandoc(function.__doc__), *sections, _CAPTURE])


_declare_settings(rewrite)


def _rewrite_torch(model, settings: pipeline.Settings, **capture):
    from attnrewrite.fx import rewrite_graph_module
    from attnrewrite.fx.capture import as_example

    if settings.layers == "auto":
        raise AttnRewriteError("layers='auto' measures fidelity with onnxruntime: it takes an ONNX model")
    if settings.heads is not None:
        raise AttnRewriteError("heads keeps heads exact inside ONNX replacements: it takes an ONNX model")
    if settings.recurrent:
        raise AttnRewriteError("recurrent=True rewrites an ONNX decoder's KV caches: it takes an ONNX model")
    if settings.compares:
        raise AttnRewriteError(
            "min_cosine, min_agreement and inputs measure fidelity with onnxruntime: they take an ONNX model"
        )
    method, options = passes.method_and_options(settings.method, **settings.options)
    fitting = None
    if settings.calibrate is not None:
        passes.require_fittable(method, options, settings.calibrate_ce_weight)
        examples = [as_example(example) for example in _examples(settings.calibrate)]
        fitting = calibration.torch_calibration(examples, **settings.calibration_settings())
    plan = RunPlan(
        method, options, layers=settings.layers, include_single_query=settings.include_single_query, calibration=fitting
    )
    gm = rewrite_graph_module(model, plan, **capture)
    record = gm.meta[METADATA_KEY]
    if not record["sites_rewritten"]:
        _warn(_nothing_rewritten(record["sites_found"]))
    return gm


def find_sites(
    model: Any, seq: int | None = None, example_inputs: Any = None, dynamic_shapes: Any = None
) -> list[AttentionSite]:
    """Every attention site in the model, rewritable or not (``skip_reason`` says why not).
    ``seq``: the input length the ONNX mask probe starts from; ``example_inputs`` and
    ``dynamic_shapes``: how a torch model is captured, as for ``rewrite``."""
    if _is_onnx(model):
        return find_onnx_sites(pipeline.Source(model).load(), seq)
    from attnrewrite.fx import find_fx_sites

    return find_fx_sites(model, example_inputs, dynamic_shapes)


def _warn_nothing_rewritten(result: pipeline.Result) -> None:
    """The CLI fails when nothing is rewritten; the API returns the model, so it says so."""
    if isinstance(result.selection, pipeline.HeadSelection):
        _warn(
            f"head selection: the model keeps {result.selection.budget} only with every head exact; the model "
            "is returned unchanged (the record's selection says what each head cost)",
            result.report,
        )
    elif result.selection is not None and result.selection.choices:
        _warn(
            f"layer selection: no site keeps the {result.selection.budget}; the model is returned "
            "unchanged (the record's selection says what each site cost)",
            result.report,
        )
    else:
        _warn(_nothing_rewritten(len(result.record.outcomes)), result.report)


def _nothing_rewritten(found: int) -> str:
    why = "no softmax attention found" if not found else f"none of the {found} attention sites could be rewritten"
    return f"{why}; the model is returned unchanged (the record says why)"


def _warn(message: str, report=None) -> None:
    # at the line that called rewrite: through _warn and the helper that chose the message
    warnings.warn(NothingRewritten(f"attnrewrite: {message}", report), stacklevel=4)


def _with_record(original: onnx.ModelProto, rewritten: ir.Model) -> onnx.ModelProto:
    """The original proto untouched but for the record (an existing record is kept as is)."""
    if any(p.key == METADATA_KEY for p in original.metadata_props):
        return original
    copy = onnx.ModelProto()
    copy.CopyFrom(original)
    onnx.helper.set_model_props(
        copy, {**{p.key: p.value for p in copy.metadata_props}, METADATA_KEY: rewritten.metadata_props[METADATA_KEY]}
    )
    return copy


def _is_onnx(model: Any) -> bool:
    return isinstance(model, (onnx.ModelProto, ir.Model, str, os.PathLike))


def _examples(calibrate: Any) -> list:
    """The calibration examples: a mapping (a dict, a BatchEncoding) alone is one."""
    return [calibrate] if isinstance(calibrate, Mapping) else list(calibrate)
