"""Layer selection under a fidelity budget (``--layers auto --min-cosine X``).

Replacing every attention of a trained model can cost more fidelity than a user accepts, and
the layers do not cost the same. Selection measures what replacing each site ALONE costs on
held-out inputs, then replaces sites from the least to the most harmful while the whole model
still passes the ``--min-cosine`` gate of ``attnrewrite.check`` (the same comparison, the same
threshold); it stops at the first site that would break it, so the result is a prefix of the
cost ordering and its measured cosine is >= X.

``select_layers`` is the search, frontend-agnostic: it only calls ``measure(layers)``.
``select_onnx`` runs it on an ONNX model: each trial is a fresh rewrite of the given layers
compared with the original by ``check.check``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from attnrewrite import check as check_mod
from attnrewrite.check import CheckInputs, FidelityBelowThreshold, decoder_inputs
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.record import METADATA_KEY, RewriteRecord, format_table, json_float, record_json

NOT_TRIED = "not tried: a less harmful site already broke the budget"


@dataclasses.dataclass
class Measurement:
    cosine: float  # the --min-cosine gate's metric: the worst output's cosine
    passes: bool  # the gates accept it
    agreement: float | None = None  # the worst argmax agreement, where --min-agreement gates it too


@dataclasses.dataclass
class SiteChoice:
    layer: int
    name: str
    alone: float  # the model's cosine with only this site replaced
    together: float | None = None  # with it and every less harmful site chosen before it; None: not tried
    together_agreement: float | None = None  # the same model's argmax agreement, where gated
    replaced: bool = False

    def why_kept(self, min_cosine: float, min_agreement: float | None = None) -> str | None:
        if self.replaced:
            return None
        if self.together is None:
            return NOT_TRIED
        if self.together >= min_cosine and min_agreement is not None and self.together_agreement is not None:
            return f"with it the model's argmax agreement is {self.together_agreement:.4f} < {min_agreement:g}"
        return f"with it the model's cosine is {_fmt(self.together)} < {min_cosine:g}"

    def result(self, min_cosine: float, min_agreement: float | None = None) -> str:
        return "replaced" if self.replaced else f"kept: {self.why_kept(min_cosine, min_agreement)}"

    def as_dict(self, min_cosine: float, min_agreement: float | None = None) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "site": self.name,
            "alone_cosine": json_float(self.alone),
            "cumulative_cosine": json_float(self.together),
            "replaced": self.replaced,
            "reason": self.why_kept(min_cosine, min_agreement),
        }


@dataclasses.dataclass
class Selection:
    min_cosine: float
    choices: list[SiteChoice]  # in the order tried: least harmful first
    inputs: str  # what the costs were measured on
    min_agreement: float | None = None

    @property
    def chosen(self) -> list[int]:
        return [c.layer for c in self.choices if c.replaced]

    @property
    def final_cosine(self) -> float | None:
        replaced = [c for c in self.choices if c.replaced]
        return replaced[-1].together if replaced else None

    @property
    def budget(self) -> str:
        """What the model must keep, in words."""
        agreement = "" if self.min_agreement is None else f" and argmax agreement >= {self.min_agreement:g}"
        return f"cosine >= {self.min_cosine:g}{agreement}"

    def summary(self) -> str:
        final = "" if self.final_cosine is None else f", model cosine {_fmt(self.final_cosine)}"
        agreement = "" if self.min_agreement is None else f", --min-agreement {self.min_agreement:g}"
        return (
            f"layer selection (--min-cosine {self.min_cosine:g}{agreement}, inputs: {self.inputs}): "
            f"{len(self.chosen)} of {len(self.choices)} sites replaced{final}"
        )

    def table(self) -> str:
        header = ("order", "layer", "site", "alone_cosine", "cumulative_cosine", "result")
        rows = [
            (
                str(i),
                str(c.layer),
                c.name,
                _fmt(c.alone),
                "-" if c.together is None else _fmt(c.together),
                c.result(self.min_cosine, self.min_agreement),
            )
            for i, c in enumerate(self.choices)
        ]
        return "\n".join([format_table(header, rows), self.summary()])

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_cosine": self.min_cosine,
            **({"min_agreement": self.min_agreement} if self.min_agreement is not None else {}),
            "inputs": self.inputs,
            "chosen": self.chosen,
            "final_cosine": json_float(self.final_cosine),
            "sites": [c.as_dict(self.min_cosine, self.min_agreement) for c in self.choices],
        }


def select_layers(
    candidates: dict[int, str],
    measure: Callable[[list[int]], Measurement],
    min_cosine: float,
    inputs: str,
    min_agreement: float | None = None,
) -> Selection:
    """``candidates``: layer -> site name, the sites the method can replace. ``measure(layers)``:
    the model with exactly those sites replaced, compared with the original."""
    alone = {layer: measure([layer]) for layer in candidates}
    # least harmful first; NaN sorts last; ties by layer so the order is reproducible
    order = sorted(candidates, key=lambda layer: (-_sortable(alone[layer].cosine), layer))
    choices = [SiteChoice(layer, candidates[layer], alone[layer].cosine) for layer in order]
    chosen: list[int] = []
    for choice in choices:
        together = alone[choice.layer] if not chosen else measure(sorted([*chosen, choice.layer]))
        choice.together, choice.together_agreement = together.cosine, together.agreement
        if not together.passes:
            break  # what follows costs more alone; the prefix ends here
        choice.replaced = True
        chosen.append(choice.layer)
    return Selection(min_cosine, choices, inputs, min_agreement)


def gate_measurement(
    report: check_mod.CheckReport, min_cosine: float, min_agreement: float | None = None
) -> Measurement:
    """The gates' own verdict on a check report (--min-cosine, and --min-agreement when given),
    and the cosine they compare. Sites exact at the length measured cost nothing here; the final
    gate says whether that proves anything (check.CheckReport.gate)."""
    agreement = report.min_agreement if min_agreement is not None else None
    try:
        report.gate(min_cosine, min_agreement, allow_exact=True)
    except FidelityBelowThreshold:
        return Measurement(report.min_cosine, passes=False, agreement=agreement)
    return Measurement(report.min_cosine, passes=True, agreement=agreement)


# --- the ONNX frontend ---------------------------------------------------------------------------


def select_onnx(
    fresh: Callable[[], ir.Model],
    plan: RunPlan,
    min_cosine: float,
    inputs: CheckInputs,
    min_agreement: float | None = None,
) -> tuple[ir.Model, RewriteRecord, Selection]:
    """Choose the layers of the ONNX model ``fresh()`` returns (a new copy at each call: a rewrite
    changes its model) and rewrite them. Returns the rewritten model (the original, unchanged,
    when no site fits the budget), its record (unselected sites say why) and the selection.
    ``plan``: the run's (decision.RunPlan), its layers unset. With its ``calibration``
    (attnrewrite.calibration) every trial is calibrated: a site's cost is its cost once fitted,
    and the chosen sites are fitted in the model returned."""
    calibration = plan.calibration
    _, full_record = rewrite_model(fresh(), plan.but(calibration=None))  # which sites the method can replace
    candidates = {o.site.layer: o.site.name for o in full_record.rewritten}
    base = fresh()
    earlier_record = base.metadata_props.get(METADATA_KEY)

    with onnx_io.saved_copy(base) as original:  # every trial runs the original from one file
        # trials fit silently; the final rewrite below reports its fits
        quiet = None if calibration is None else dataclasses.replace(calibration, progress=lambda line: None)

        def measure(layers: list[int]) -> Measurement:
            model, _ = rewrite_model(fresh(), plan.but(layers=layers, calibration=quiet))
            return gate_measurement(check_mod.check(original, model, inputs), min_cosine, min_agreement)

        selection = select_layers(candidates, measure, min_cosine, inputs.source, min_agreement)

    # rewrites are deterministic (seeded): this is the model measured last for the chosen layers
    model, record = rewrite_model(fresh(), plan.but(layers=sorted(selection.chosen)))
    kept = [c for c in selection.choices if not c.replaced]
    reasons = {c.layer: f"layer selection: {c.why_kept(min_cosine, min_agreement)}" for c in kept}
    for outcome in record.outcomes:
        if outcome.site.layer in reasons:
            outcome.reason = reasons[outcome.site.layer]
    record.selection = selection.as_dict()
    model.metadata_props[METADATA_KEY] = record_json(record, earlier_record)
    return model, record, selection


def hold_out_for_selection(calibration, model: ir.Model, decoding: bool = False) -> tuple[Any, CheckInputs]:
    """Layer selection with calibration data and no inputs of its own: the last batch of the
    data measures the costs and is never fitted on; the batches before it are fitted on (a
    decoder, ``decoding``, is measured as it generates: check.decoder_inputs). The calibration's
    guard (attnrewrite.calibration.HeldOut) compares on that same batch: nothing else is held out.
    ``model``: the original, not rewritten yet. Returns (the calibration to fit with, the inputs
    to measure on)."""
    from attnrewrite.calibration import HeldOut, OriginalModel, fitted_calibration

    if len(calibration.batches) < 2:
        raise AttnRewriteError(
            f"layer selection measures costs on calibration data it does not fit on: {calibration.examples} "
            "examples make one batch; give more, or inputs to measure on (--inputs)"
        )
    fitted, held = calibration.batches[:-1], calibration.batches[-1]
    # every setting of how to fit but fine-tuning, which is refused with selection
    how = ("steps", "lr", "seed", "ce_weight", "end_to_end", "progress", "text")
    settings = {name: getattr(calibration, name) for name in how}
    rows = next(iter(held.values())).shape[0]
    # rebuilt from the fitted batches, so the record's examples and sha256 describe what was fitted
    fit = fitted_calibration(list(fitted), model.graph, held_out=HeldOut.of(OriginalModel(model), [held]), **settings)
    source = f"the last {rows} calibration examples (not fitted on)"
    return fit, (decoder_inputs(held, source) if decoding else CheckInputs(held, source))


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"
