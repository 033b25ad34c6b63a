"""The ONNX frontend's pipeline: find and classify sites, splice replacements, record."""

from __future__ import annotations

import dataclasses
import json

import onnx_ir as ir

from attnrewrite import decision, passes
from attnrewrite.onnx.detect import OnnxSite, Unsupported, find_onnx_sites, mark_unsupported_masks
from attnrewrite.onnx.io import default_opset, infer_shapes, upgrade_opset
from attnrewrite.onnx.masks import classify_masks, probe_note
from attnrewrite.onnx.splice import Splicer
from attnrewrite.passes._onnx import DOMAIN
from attnrewrite.record import METADATA_KEY, RewriteRecord, SiteOutcome, record_json
from attnrewrite.site import AttentionSite


def analyze(model: ir.Model, seq: int | None = None) -> list[OnnxSite]:
    """Every attention site in the model's main graph, with its mask classified (probed from
    inputs of length ``seq`` when given)."""
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
    **options,
) -> tuple[ir.Model, RewriteRecord]:
    """Rewrite in place where possible; returns the (possibly new, opset-upgraded) model.
    Sites with one query are left exact unless ``include_single_query``. ``calibration``
    (attnrewrite.calibration.Calibration): fit every replacement, in order, to the attention it
    replaces (attnrewrite.onnx.calibrate). ``seq``: the input length the mask probe starts from
    (default: attnrewrite.site.MASK_PROBE_LENGTHS)."""
    method = passes.get_pass(to)
    opts = passes.make_options(method, **options)
    if calibration is not None:
        from attnrewrite.calibration import require_fittable

        require_fittable(method, opts, calibration.ce_weight)
    model = infer_shapes(model)
    sites = analyze(model, seq)
    decisions = [decision.refusal(s.site, method, opts, layers, include_single_query) for s in sites]
    if any(reason is None for reason in decisions) and default_opset(model) < passes._onnx.MIN_OPSET:
        model = infer_shapes(upgrade_opset(model))
        sites = analyze(model, seq)
        decisions = [decision.refusal(s.site, method, opts, layers, include_single_query) for s in sites]

    record = RewriteRecord(method.NAME, dataclasses.asdict(opts))
    note = probe_note([s.site for s in sites])
    if note:
        record.notes.append(note)
    splicer = Splicer(model) if any(reason is None for reason in decisions) else None
    fitting = []  # (outcome, learnable module, names of its constants) per rewritten site
    for s, reason in zip(sites, decisions):
        if reason is None:
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
        lowering = method.onnx_lowering(s.site, opts, default_opset(model), weights=weights)
        replacement = splicer.splice(s, lowering, own=frozenset(weights or ()))
        outcome = SiteOutcome(s.site, rewritten=True, replacement=replacement)
        record.outcomes.append(outcome)
        if module is not None:
            fitting.append((outcome, module, list(lowering.constants)))
    record.bytes_added = splicer.bytes_added if splicer is not None else 0
    if fitting:
        from attnrewrite.onnx.calibrate import calibrate_replacements

        record.end_to_end = calibrate_replacements(model, splicer.calls, fitting, calibration)
    if record.rewritten or METADATA_KEY not in model.metadata_props:
        model.metadata_props[METADATA_KEY] = record_json(record, model.metadata_props.get(METADATA_KEY))
    return model, record


def read_record(model: ir.Model) -> dict | None:
    text = model.metadata_props.get(METADATA_KEY)
    return json.loads(text) if text else None
