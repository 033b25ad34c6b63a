"""The ONNX frontend's pipeline: find and classify sites, splice replacements, record."""

from __future__ import annotations

import dataclasses
import json

import onnx_ir as ir

from attnrewrite import decision, passes
from attnrewrite.onnx.detect import OnnxSite, Unsupported, find_onnx_sites, mark_unsupported_masks
from attnrewrite.onnx.io import default_opset, infer_shapes, upgrade_opset
from attnrewrite.onnx.masks import classify_masks, probe_note
from attnrewrite.onnx.recurrent import RecurrentSplicer, interface_refusal
from attnrewrite.onnx.recurrent import record_note as recurrent_note
from attnrewrite.onnx.splice import Splicer
from attnrewrite.passes._onnx import DOMAIN
from attnrewrite.passes.recurrent import recurrent_lowering
from attnrewrite.record import METADATA_KEY, RewriteRecord, SiteOutcome, record_json, stage
from attnrewrite.site import AttentionSite


def analyze(model: ir.Model, seq: int | None = None) -> list[OnnxSite]:
    """Every attention site in the model's main graph, with its mask classified (probed from
    inputs of length ``seq`` when given)."""
    with stage("detect"):
        sites = find_onnx_sites(model.graph)
        mark_unsupported_masks(sites)
        classify_masks(model, sites, seq)
    return sites


def find_sites(model: ir.Model, seq: int | None = None) -> list[AttentionSite]:
    return [s.site for s in analyze(infer_shapes(model), seq)]


def rewritten_sites(model: ir.Model) -> list[ir.Node]:
    """Replacement nodes an earlier run left (their record says how they were made)."""
    return [n for n in model.graph if n.domain == DOMAIN]


def rewrite_model(
    model: ir.Model,
    to: str,
    layers: list[int] | None = None,
    include_single_query: bool = False,
    calibration=None,
    seq: int | None = None,
    recurrent: bool = False,
    **options,
) -> tuple[ir.Model, RewriteRecord]:
    """Rewrite in place where possible; returns the (possibly new, opset-upgraded) model.
    Sites with one query are left exact unless ``include_single_query``. ``calibration``
    (attnrewrite.calibration.Calibration): fit every replacement, in order, to the attention it
    replaces (attnrewrite.onnx.calibrate). ``seq``: the input length the mask probe starts from
    (default: attnrewrite.site.MASK_PROBE_LENGTHS). ``recurrent``: the KV-cache sites become
    recurrences and the caches fixed-size states (attnrewrite.onnx.recurrent), the others stay."""
    method = passes.get_pass(to)
    opts = passes.make_options(method, **options)
    if calibration is not None:
        from attnrewrite.calibration import require_fittable

        require_fittable(method, opts, calibration.ce_weight)
    model = infer_shapes(model)
    sites = analyze(model, seq)
    decisions = [decision.refusal(s.site, method, opts, layers, include_single_query, recurrent) for s in sites]
    if any(reason is None for reason in decisions) and default_opset(model) < passes._onnx.MIN_OPSET:
        model = infer_shapes(upgrade_opset(model))
        sites = analyze(model, seq)
        decisions = [decision.refusal(s.site, method, opts, layers, include_single_query, recurrent) for s in sites]
    decisions, splicer = _splicer(model, sites, decisions, recurrent)
    record = RewriteRecord(method.NAME, dataclasses.asdict(opts))
    note = probe_note([s.site for s in sites])
    if note:
        record.notes.append(note)
    fitting = []  # (outcome, learnable module, names of its constants) per rewritten site
    for s, reason in zip(sites, decisions):
        if reason is None and not recurrent:
            try:
                splicer.check(s)
            except Unsupported as why:
                reason = str(why)
        module = weights = None
        if reason is None and calibration is not None:
            module, reason = decision.learnable_module(s.site, method, opts)
            if module is not None:
                weights = {name: t.detach().numpy() for name, t in module.state_dict().items()}
        if reason is not None:
            record.outcomes.append(SiteOutcome(s.site, rewritten=False, reason=reason))
            continue
        lowering, replacement = _replace(splicer, s, method, opts, default_opset(model), weights)
        outcome = SiteOutcome(s.site, rewritten=True, replacement=replacement)
        record.outcomes.append(outcome)
        if module is not None:
            fitting.append((outcome, module, list(lowering.constants)))
    record.bytes_added = splicer.bytes_added if splicer is not None else 0
    if recurrent and record.rewritten:
        splicer.finish()
        record.options["recurrent"] = True
        record.notes.append(recurrent_note(splicer.state_inputs))
    if fitting:
        from attnrewrite.onnx.calibrate import calibrate_replacements

        with stage("calibrate"):
            record.end_to_end = calibrate_replacements(model, splicer.calls, fitting, calibration)
    if record.rewritten or METADATA_KEY not in model.metadata_props:
        model.metadata_props[METADATA_KEY] = record_json(record, model.metadata_props.get(METADATA_KEY))
    return model, record


def _replace(splicer: Splicer, s: OnnxSite, method, opts, opset: int, weights: dict | None):
    """(the lowering, the replacement's op) of the site spliced: its recurrent form for a
    RecurrentSplicer."""
    own = frozenset(weights or ())  # fitted per site: never shared, though they start equal
    if isinstance(splicer, RecurrentSplicer):
        lowering = recurrent_lowering(s.site, opts, opset, weights)
        return lowering, splicer.splice_recurrent(s, lowering, opts, own)
    lowering = method.onnx_lowering(s.site, opts, opset, weights=weights)
    return lowering, splicer.splice(s, lowering, own)


def _splicer(model: ir.Model, sites: list[OnnxSite], decisions: list[str | None], recurrent: bool):
    """(decisions, the splicer of the sites accepted; None where none is). A recurrent rewrite
    refuses every site with the model's reason where its caches cannot become states."""
    accepted = [s for s, reason in zip(sites, decisions) if reason is None]
    if not accepted:
        return decisions, None
    if not recurrent:
        return decisions, Splicer(model)
    interface, reason = interface_refusal(model.graph, accepted)
    if reason is not None:
        return [reason if d is None else d for d in decisions], None
    return decisions, RecurrentSplicer(model, interface)


def read_record(model: ir.Model) -> dict | None:
    text = model.metadata_props.get(METADATA_KEY)
    return json.loads(text) if text else None
