"""One rewrite of an ONNX model, from the model as given to the model proved: the stages that
``attnrewrite MODEL --to M`` and ``attnrewrite.rewrite`` both run, in this order.

1. ``rewrite``: load the model; make the inputs the fidelity check compares on from the
   original's signature (before the rewrite changes the model in place); load the calibration
   data; replace the sites asked for, or those layer selection chooses (layer_selection).
2. ``validate`` and ``compare`` take the rewritten model saved to a file: the validation gates
   (onnx/validate.py) and, when asked, the fidelity check against the original (check.py). The
   caller decides where that file is: the CLI gates its staged output, renamed into place only
   once every gate passed (onnx.io.staged_save); ``run`` a temporary copy.
3. ``gate``: the fidelity thresholds on the check's report, once the caller has shown it.

``run`` does all of it for a model in memory and returns one ``Result``. Every stage adds what
it found to the run's report (record.Report, docs/report.md) and times itself (record.stage),
so a run that stops anywhere still says how far it got; ``ending`` says how an error ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from attnrewrite import calibration, passes
from attnrewrite import check as check_mod
from attnrewrite.check import CheckInputs, CheckReport, FidelityBelowThreshold
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError, NothingToRewrite, RewriteFailed
from attnrewrite.head_selection import HeadSelection, select_heads_onnx
from attnrewrite.layer_selection import Selection, hold_out_for_selection, select_onnx
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import sequence_length
from attnrewrite.onnx.rewrite import find_sites, rewrite_model, rewritten_sites
from attnrewrite.onnx.validate import DEFAULT_SEQ as DEFAULT_GATE_SEQ
from attnrewrite.onnx.validate import validate_saved
from attnrewrite.passes import heads
from attnrewrite.record import (
    ERROR,
    GATE_FAILED,
    INPUT_FAILED,
    METADATA_KEY,
    REFUSED,
    RETURNED,
    Report,
    RewriteRecord,
    stage,
)
from attnrewrite.settings import CalibrationSettings, FinetuneSettings, GateSettings, TextSettings
from attnrewrite.state_budget import Budget
from attnrewrite.state_budget import fit as fit_budget

# exit statuses, the CLI's; a report says which one its run ended with, the API's too
EXIT_FAILED = 1  # nothing could be rewritten, the result failed a gate, or the environment failed
EXIT_BAD_INPUT = 2  # bad input or usage
EXIT_BUG = 3


@dataclasses.dataclass(frozen=True)
class Settings(GateSettings, TextSettings, FinetuneSettings, CalibrationSettings):
    """What one rewrite does, in the API's words; each of the CLI's flags sets one of these. The
    fidelity gates', calibration's and fine-tuning's are declared in their groups
    (attnrewrite.settings), keyword-only; building Settings refuses a value outside their ranges."""

    method: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the method's (passes.<method>.Options)
    layers: list[int] | str | None = None  # site indices (None: all), or "auto": layer selection
    # heads kept exact (softmax) inside the replacements: layer -> head indices, or "auto": head
    # selection (attnrewrite.head_selection), which "auto" layers compose with
    heads: dict[int, list[int]] | str | None = None
    include_single_query: bool = False
    recurrent: bool = False  # KV caches become recurrent states (attnrewrite.onnx.recurrent)
    standard_ops: bool = False  # no onnxruntime contrib operator in the recurrent steps
    state_budget: str | None = None  # with recurrent: the method's settings sized to fit (attnrewrite.state_budget)
    validate: bool = True
    check: bool = False  # compare the rewritten model's outputs with the original's

    def __post_init__(self):
        if self.standard_ops and not self.recurrent:
            raise AttnRewriteError("standard_ops is for recurrent=True's decoding steps; give recurrent=True too")
        if self.state_budget is not None:
            if not self.recurrent:
                raise AttnRewriteError("state_budget sizes a recurrent state; give recurrent=True too")
            Budget.parse(self.state_budget)  # a size or one line now, before any work
        super().__post_init__()
        _refuse_stages_without_their_data(self)
        refuse_comparison_settings_that_do_nothing(self)

    @property
    def compares(self) -> bool:
        """Whether the rewritten model is compared with the original: asked for, or implied by a
        threshold or by inputs to compare on (layer selection always has its budget)."""
        return self.check or self.min_cosine is not None or self.min_agreement is not None or self.inputs is not None

    @property
    def selects(self) -> bool:
        """Whether a search chooses what to replace (layer or head selection)."""
        return self.layers == "auto" or self.heads == "auto"

    def calibration_settings(self) -> dict[str, Any]:
        """How calibration fits (calibration.Calibration's fields)."""
        return dict(
            steps=self.calibrate_steps,
            lr=self.calibrate_lr,
            ce_weight=self.calibrate_ce_weight,
            seed=self.calibrate_seed,
            end_to_end=self.calibrate_end_to_end,
            finetune=calibration.Finetune(self.finetune, self.finetune_rank, self.finetune_lr)
            if self.finetune
            else None,
        )


class Source:
    """The model as the caller gave it (a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``)
    and the forms of it a run needs."""

    def __init__(self, model, loaded: ir.Model | None = None):
        """``loaded``: the model at path ``model``, when the caller has read it already."""
        self.given = model
        self._loaded = loaded
        self._proto: onnx.ModelProto | None = None

    @property
    def is_file(self) -> bool:
        return isinstance(self.given, (str, os.PathLike))

    def load(self) -> ir.Model:
        """The model to rewrite: a given ``onnx_ir.Model`` itself, rewritten in place."""
        if isinstance(self.given, ir.Model):
            return self.given
        if self._loaded is None:
            self._loaded = onnx_io.load_model(self.given) if self.is_file else onnx_io.from_proto(self.given)
        return self._loaded

    def fresh(self) -> ir.Model:
        """A new copy at each call, from the model as given (layer selection rewrites one per trial)."""
        if self.is_file:
            return onnx_io.load_model(self.given)
        if self._proto is None:
            self._proto = ir.serde.serialize_model(self.given) if isinstance(self.given, ir.Model) else self.given
        return onnx_io.from_proto(self._proto)

    def original(self):
        """The original as the fidelity check runs it: its file, else a copy, taken before the
        rewrite changes an ``onnx_ir.Model`` in place."""
        return os.fspath(self.given) if self.is_file else self.fresh()

    def runnable(self):
        """The original for the run gate to fall back on (onnx.validate.validate_saved): a path or
        the ModelProto; None for an ``onnx_ir.Model``, which the rewrite may have changed."""
        if isinstance(self.given, ir.Model):
            return None
        return os.fspath(self.given) if self.is_file else self.given


@dataclasses.dataclass
class Result:
    model: ir.Model  # rewritten; the original, unchanged but for the record, when nothing was
    record: RewriteRecord
    settings: Settings
    source: Source
    report: Report  # the run's, as far as it has got (its outcome once ``run`` returns)
    selection: Selection | HeadSelection | None = None  # with layers or heads "auto": what each site or head cost
    inputs: CheckInputs | None = None  # what the fidelity check compares on (None: no check)
    original: Any = None  # the original as the fidelity check runs it
    note: str | None = None  # the run gate's, when it had to adapt (longer inputs than asked for)
    fidelity: CheckReport | None = None  # the fidelity check's

    @property
    def given_inputs(self) -> dict | None:
        """The user's own arrays (not generated, not held out of the calibration data), which
        the original runs on (a recurrent rewrite's are tokens only: check.decoder_inputs)."""
        return self.inputs.feeds if self.settings.inputs is not None and not self.settings.recurrent else None


def rewrite(source: Source, settings: Settings, report: Report | None = None) -> Result:
    """Stage 1: the model rewritten in memory, with its record (also in ``report``, the run's);
    nothing proved yet."""
    report = report or Report("rewrite")
    report.method = settings.method
    report.thresholds = {name: getattr(settings, name) for name in ("min_cosine", "min_agreement", "allow_exact")}
    _check_selection(settings)
    if settings.state_budget is None:  # a budget builds them itself, with the settings it chooses
        with stage("rewrite"):  # the method's Options, built once and handed on: a wrong option fails the rewrite
            method, options = passes.method_and_options(settings.method, **settings.options)
    with stage("load"):
        model = source.load()
    if settings.state_budget is not None:
        with stage("rewrite"):
            method, options, budgeted = _budgeted(settings, model)
    inputs = original = None
    if settings.compares:
        with stage("check"):  # from the original's signature, before the rewrite changes the model in place
            inputs = _check_inputs(model, settings, passes.exact_part(method, options))
            original = source.original()
    given = inputs.feeds if settings.inputs is not None and not settings.recurrent else None  # Result.given_inputs
    fitting, inputs = _calibration(settings, method, options, model, inputs)
    plan = RunPlan(
        method,
        options,
        layers=None if settings.layers == "auto" else settings.layers,
        include_single_query=settings.include_single_query,
        recurrent=settings.recurrent,
        standard_ops=settings.standard_ops,
        exact_heads=None if settings.heads == "auto" else settings.heads,
        calibration=fitting,
        seq=probe_seq(settings.seq, model.graph, given),
    )
    with stage("rewrite"):
        model, record, selection = _rewrite(source, model, settings, plan, inputs)
    if settings.state_budget is not None:
        _add_note(model, record, budgeted)
    report.record = record
    return Result(model, record, settings, source, report, selection, inputs, original)


def _budgeted(settings: Settings, model: ir.Model) -> tuple:
    """(method, its options, what the budget chose in one line): the settings of the method that
    fit its state over the sites this run replaces into ``settings.state_budget``."""
    sites = find_sites(model, settings.seq)
    choice = fit_budget(settings.method, settings.options, sites, settings.state_budget, settings.layers)
    method, options = passes.method_and_options(settings.method, **choice.options)
    return method, options, choice.describe()


def _check_inputs(model: ir.Model, settings: Settings, exact_part: passes.ExactPart | None) -> CheckInputs:
    """What the fidelity check and layer selection compare on: the given inputs, or generated
    ones ``settings.seq`` long, by default past the method's ``exact_part`` (a bidirectional
    site's, which reaches at least as far as a causal one's: check.default_length). A recurrent
    model takes states where the original takes caches: both run as they generate."""
    seq, why = settings.seq, None
    if seq is None and settings.inputs is None:
        parts = [exact_part] if exact_part is not None else []
        seq, why = check_mod.default_length(model.graph, parts, from_empty_cache=settings.recurrent)
    prepare = check_mod.prepare_decoder_inputs if settings.recurrent else check_mod.prepare_inputs
    return check_mod.with_reason(prepare(model, settings.inputs, seq=seq or check_mod.DEFAULT_SEQ), why)


def _refuse_stages_without_their_data(settings: Settings) -> None:
    """Calibration's later stages run on its data (either frontend's)."""
    if settings.finetune and settings.calibrate is None:
        raise AttnRewriteError("finetune trains on the calibration data: give calibrate too")
    if settings.calibrate_end_to_end and settings.calibrate is None:
        raise AttnRewriteError("calibrate_end_to_end is a stage of calibration: give calibrate too")
    if settings.finetune and settings.selects:  # its trials measure stage 1's models, and would each train
        raise AttnRewriteError(
            "finetune with layer or head selection: select first, then fine-tune a rewrite of the layers or heads it chose"
        )


def refuse_comparison_settings_that_do_nothing(settings, spell: Callable[[str], str] = str) -> None:
    """``settings``: the comparison's (Settings, or the CLI's arguments, whose rewrite and check
    both have them); ``spell`` writes a setting's name as its user knows it (the CLI: its flag)."""
    if settings.allow_exact and settings.min_cosine is None and settings.min_agreement is None:
        gates = f"{spell('min_cosine')} or {spell('min_agreement')}"
        raise AttnRewriteError(f"{spell('allow_exact')} lets a gate pass: give {gates} too")
    if settings.inputs is not None and settings.seq is not None:
        raise AttnRewriteError(
            f"{spell('seq')} is the length of generated inputs, and {spell('inputs')} gives yours: give one of them"
        )


def _check_selection(settings: Settings) -> None:
    """What layer and head selection need, and what they cannot be given with (the one place a
    run refuses exact heads with recurrent, the CLI's and the API's)."""
    if settings.heads is not None and settings.recurrent:
        raise AttnRewriteError(f"heads with recurrent: {heads.RECURRENT}")
    if settings.heads == "auto":
        if settings.min_cosine is None and settings.min_agreement is None:
            raise AttnRewriteError(
                "heads='auto' needs min_cosine and/or min_agreement: the fidelity the model must keep"
            )
        return
    if settings.layers == "auto" and settings.heads is not None:
        raise AttnRewriteError("layers='auto' chooses whole sites: give heads='auto' to choose heads with it")
    if settings.layers == "auto" and settings.min_cosine is None:
        raise AttnRewriteError("layers='auto' needs min_cosine: the cosine the rewritten model must keep")


def _rewrite(source: Source, model: ir.Model, settings: Settings, plan: RunPlan, inputs):
    """The sites asked for replaced, or those layer or head selection chooses: (model, record,
    selection). ``plan``: the run's, with "auto" layers and heads left unset."""
    if settings.heads == "auto":  # "auto" layers compose: heads are the unit
        return select_heads_onnx(source.fresh, plan, inputs, settings.min_cosine, settings.min_agreement)
    if settings.layers != "auto":
        model, record = rewrite_model(model, plan)
        return model, record, None
    return select_onnx(source.fresh, plan, settings.min_cosine, inputs, settings.min_agreement)


def probe_seq(seq: int | None, graph: ir.Graph, given: dict | None) -> int | None:
    """The length the mask probe starts from: ``seq``, or that of the user's inputs, else its own."""
    return seq or (sequence_length(graph, given) if given is not None else None)


def _calibration(settings: Settings, method, options, model: ir.Model, inputs: CheckInputs | None):
    """The data to fit on, checked and loaded before any rewriting (None without it), with the
    guard's held-out part and the original's outputs there; and the inputs to compare on: layer
    selection without inputs of its own holds the last batch out, and the guard measures on that
    same batch (one part held out, never two)."""
    if settings.calibrate is None:
        return None, inputs
    with stage("calibrate"):
        passes.require_fittable(method, options, settings.calibrate_ce_weight)
        selecting = settings.selects and settings.inputs is None
        fitting = calibration.onnx_calibration(
            settings.calibrate,
            model.graph,
            tokenizer=settings.tokenizer,
            max_length=settings.max_length,
            pack=settings.calibrate_pack,
            guard=not selecting,
            original=model,
            **settings.calibration_settings(),
        )
        if selecting:
            return hold_out_for_selection(fitting, model, decoding=settings.recurrent)
        return fitting, inputs


def validate(result: Result, path: str | os.PathLike) -> None:
    """Stage 2: the validation gates on the rewritten model saved at ``path``: RewriteFailed
    naming the gate, or InputFails when the original fails too. ``result.note`` says what the
    run gate had to adapt to."""
    with stage("validate"):
        gate = validate_saved(
            path,
            result.model.graph,
            seq=result.settings.seq or DEFAULT_GATE_SEQ,
            original=result.source.runnable(),
            feeds=result.given_inputs,
        )
    result.note = gate.note
    if gate.note:
        result.report.notes.append(gate.note)


def compare(result: Result, path: str | os.PathLike) -> CheckReport | None:
    """Stage 2: the fidelity check of the rewritten model saved at ``path`` against the
    original, when the settings ask for one (``result.fidelity``)."""
    if result.inputs is not None:
        result.fidelity = result.report.fidelity = check_mod.check(result.original, path, result.inputs)
    return result.fidelity


def gate(result: Result) -> None:
    """Stage 3: FidelityBelowThreshold when the check's report falls below a threshold."""
    if result.fidelity is not None:
        with stage("check"):
            settings = result.settings
            result.fidelity.gate(settings.min_cosine, settings.min_agreement, settings.allow_exact)


def refusal(result: Result) -> NothingToRewrite:
    """Why nothing was rewritten, as the CLI fails with it."""
    record, selection = result.record, result.selection
    if isinstance(selection, HeadSelection):
        return NothingToRewrite(
            f"head selection: the model keeps {selection.budget} only with every head exact; nothing written", record
        )
    if selection is not None and selection.choices:
        best = selection.choices[0]
        return NothingToRewrite(
            f"layer selection: no site can be replaced keeping {selection.budget} "
            f"(the least harmful, layer {best.layer} alone, gives {best.alone:.6f}); nothing written",
            record,
        )
    if not record.outcomes:
        done = len(rewritten_sites(result.model))
        if done:
            return NothingToRewrite(
                f"no softmax attention left: {done} sites were already rewritten; nothing written", record
            )
        return NothingToRewrite("no softmax attention found; nothing written", record)
    return NothingToRewrite(
        f"none of the {len(record.outcomes)} attention sites could be rewritten; nothing written",
        record,
    )


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a run that raised ends: its report's outcome, the exit status, the CLI's one line."""

    outcome: str
    exit_code: int
    reason: str
    failed_stage: str | None = None


def ending(error: BaseException, failed_stage: str | None = None) -> Ending:
    """The ending of a run ``error`` stopped in stage ``failed_stage`` (record.StageTimes.stage_of)."""
    outcome, code, reason = _classify(error, failed_stage)
    return Ending(outcome, code, reason, failed_stage)


def _classify(error: BaseException, failed_stage: str | None) -> tuple[str, int, str]:
    if isinstance(error, NothingToRewrite):
        return REFUSED, EXIT_FAILED, str(error)
    if isinstance(error, RewriteFailed) and failed_stage == "write":  # the disk, not the model
        return ERROR, EXIT_FAILED, str(error)
    if isinstance(error, (FidelityBelowThreshold, RewriteFailed)):
        return GATE_FAILED, EXIT_FAILED, str(error)
    if isinstance(error, (AttnRewriteError, passes.OptionError)):  # InputFails too: the input is to blame
        return INPUT_FAILED, EXIT_BAD_INPUT, str(error)
    if isinstance(error, KeyboardInterrupt):
        return ERROR, EXIT_FAILED, "interrupted"
    if isinstance(error, MemoryError):
        return ERROR, EXIT_FAILED, "out of memory"
    if isinstance(error, OSError):  # the environment (disk full, a file vanished), not a bug
        where = f"{error.filename}: " if error.filename else ""
        return ERROR, EXIT_FAILED, f"{where}{error.strerror or error}"
    text = str(error).strip().splitlines()  # a bug: still one line, the traceback on request
    return (
        ERROR,
        EXIT_BUG,
        f"internal error: {type(error).__name__}: {text[0] if text else ''} (run with -v for the traceback)",
    )


def run(model, settings: Settings) -> Result:
    """Every stage, on the model as given (a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``,
    rewritten in place), the gates on a temporary copy. A note of the run gate joins the record
    in the model. Nothing rewritten: the result says so, nothing is proved. ``Result.report``
    says how the run ended (``returned`` or ``refused``); an error raised carries the report
    as ``error.report``."""
    report = Report("rewrite", input=os.fspath(model) if isinstance(model, (str, os.PathLike)) else None)
    with report.times.measuring():
        try:
            return _run(model, settings, report)
        except Exception as error:
            end = ending(error, report.times.stage_of(error))
            report.end(end.outcome, end.exit_code, end.reason, failed_stage=end.failed_stage)
            error.report = report
            raise


def _run(model, settings: Settings, report: Report) -> Result:
    result = rewrite(Source(model), settings, report)
    if not result.record.rewritten:
        report.end(REFUSED, EXIT_FAILED, str(refusal(result)))
        return result
    if settings.validate or result.inputs is not None:
        with stage("write"), onnx_io.saved_copy(result.model) as path:
            if settings.validate:
                validate(result, path)
            compare(result, path)
        gate(result)
    if result.note:
        _add_note(result.model, result.record, result.note)
    report.end(RETURNED, 0)
    return result


def _add_note(model: ir.Model, record: RewriteRecord, note: str) -> None:
    """A note joins the record, the one in the model too (which may keep an earlier run's)."""
    record.notes.append(note)
    stored = json.loads(model.metadata_props[METADATA_KEY])
    stored["notes"] = [*stored.get("notes", []), note]
    model.metadata_props[METADATA_KEY] = json.dumps(stored, sort_keys=True)
