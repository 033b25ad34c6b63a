"""The ONNX frontend's pipeline: find and classify sites, splice replacements, record."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir

from attnrewrite import decision, passes
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.detect import OnnxSite, Unsupported, cache_inputs, find_onnx_sites, mark_unsupported_masks
from attnrewrite.onnx.io import default_opset, infer_shapes, shape_notes, upgrade_opset
from attnrewrite.onnx.masks import classify_masks, probe_note
from attnrewrite.onnx.prune import prune_unread_nodes
from attnrewrite.onnx.recurrent import RecurrentSplicer, interface_refusal
from attnrewrite.onnx.recurrent import record_note as recurrent_note
from attnrewrite.onnx.splice import Splicer
from attnrewrite.onnx.validate import runs_linear_attention
from attnrewrite.passes import heads
from attnrewrite.passes import recurrent as passes_recurrent
from attnrewrite.passes.lowering import DOMAIN, MIN_OPSET
from attnrewrite.passes.options import MethodOptions
from attnrewrite.record import METADATA_KEY, RewriteRecord, SiteOutcome, record_json, stage
from attnrewrite.site import AttentionSite

PARALLEL_CACHE_NOTE = (
    "the KV-cache sites keep their caches: each call runs the linear attention over every cached "
    "position again, so a decoding step costs more than the softmax's and grows with the context; "
    "--recurrent carries a fixed-size state instead"
)


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


def rewrite_model(model: ir.Model, plan: RunPlan | str | MethodOptions, **keywords) -> tuple[ir.Model, RewriteRecord]:
    """Rewrite in place where possible; returns the (possibly new, opset-upgraded) model.
    ``plan`` (decision.RunPlan): what the run asks of every site, as the pipeline settled it; or,
    for a caller of its own, the method's name or Options with the plan's fields and the
    method's options as ``keywords`` (RunPlan.of). Sites with one query are left exact unless
    ``plan.include_single_query``. ``plan.calibration``: fit every replacement, in order, to the
    attention it replaces (attnrewrite.onnx.calibrate). ``plan.seq``: the input length the mask
    probe starts from (default: attnrewrite.site.MASK_PROBE_LENGTHS). ``plan.recurrent``: the
    KV-cache sites become recurrences and the caches fixed-size states (attnrewrite.onnx.recurrent),
    the others stay; their steps use com.microsoft.LinearAttention where onnxruntime runs it,
    unless ``plan.standard_ops``. ``plan.exact_heads``: those heads stay softmax inside the
    site's replacement (attnrewrite.passes.heads); with calibration every head is fitted first
    and the exact heads' values are sliced out (_fitted_on_every_head). Not with ``recurrent``: a
    run refuses the two together (pipeline). ``plan.fitted``: the replacements hold these values
    instead of their initial ones."""
    plan = RunPlan.of(plan, **keywords)
    assert not (plan.exact_heads and plan.recurrent), "exact heads have no recurrent form: pipeline refuses both"
    if plan.exact_heads and plan.calibration is not None:
        return _fitted_on_every_head(model, plan)
    if plan.calibration is not None:
        passes.require_fittable(plan.method, plan.options, plan.calibration.ce_weight)
    model, sites, decisions = _decided(model, plan)
    decisions, splicer = _splicer(model, sites, decisions, plan)
    record = RewriteRecord(plan.method.NAME, dataclasses.asdict(plan.options))
    record.notes.extend(shape_notes(model))
    note = probe_note([s.site for s in sites])
    if note:
        record.notes.append(note)
    fitting = _splice(model, plan, splicer, sites, decisions, record)
    record.bytes_added = splicer.bytes_added if splicer is not None else 0
    if not plan.recurrent and any(o.site.kv_cache is not None for o in record.rewritten):
        record.notes.append(PARALLEL_CACHE_NOTE)
    if plan.recurrent and record.rewritten:
        splicer.finish()
        record.options["recurrent"] = True
        sites = [o.site for o in record.rewritten]
        record.state_memory = passes_recurrent.rewrite_memory(plan.method, plan.options, sites).as_dict()
        record.notes.append(recurrent_note(splicer.state_inputs, splicer.parts, list(cache_inputs(model.graph))))
    if fitting:
        _calibrate(model, plan, splicer, fitting, record)
    if record.rewritten:
        prune_unread_nodes(model)  # what onnxruntime would drop with a warning on each load
    if record.rewritten or METADATA_KEY not in model.metadata_props:
        model.metadata_props[METADATA_KEY] = record_json(record, model.metadata_props.get(METADATA_KEY))
    return model, record


def _decided(model: ir.Model, plan: RunPlan) -> tuple[ir.Model, list[OnnxSite], list[str | None]]:
    """(the model, its sites, each one's refusal or None): upgraded to the opset the
    replacements need, and analysed again, where a site is to be replaced."""
    model = infer_shapes(model)
    sites = analyze(model, plan.seq)
    _check_exact_heads(plan.exact_heads or {}, sites)
    decisions = [decision.refusal(s.site, plan) for s in sites]
    if any(reason is None for reason in decisions) and default_opset(model) < MIN_OPSET:
        model = infer_shapes(upgrade_opset(model))
        sites = analyze(model, plan.seq)
        decisions = [decision.refusal(s.site, plan) for s in sites]
    return model, sites, decisions


def _splice(model: ir.Model, plan: RunPlan, splicer, sites, decisions, record: RewriteRecord) -> list:
    """Replace the sites decided for, each outcome in ``record``; returns (outcome, learnable
    module, names of its constants) per site calibration is to fit."""
    contrib_ops = plan.recurrent and not plan.standard_ops and runs_linear_attention()  # for decoding steps
    fitting = []
    for s, reason in zip(sites, decisions):
        exact = plan.exact_in(s.site.layer)
        if reason is None:
            weights = (plan.fitted or {}).get(s.site.layer)
            replacement = _replacement(splicer, s, plan, default_opset(model), weights, contrib_ops)
            reason = replacement if isinstance(replacement, str) else None
        if reason is not None:
            record.outcomes.append(SiteOutcome(s.site, rewritten=False, reason=reason))
            continue
        call = splicer.splice(s, replacement.lowering, own=frozenset(replacement.weights or ()))
        outcome = SiteOutcome(s.site, True, replacement=call, exact_heads=sorted(set(exact)) if exact else None)
        record.outcomes.append(outcome)
        if replacement.module is not None:
            fitting.append((outcome, replacement.module, list(replacement.lowering.constants)))
    return fitting


def _calibrate(model: ir.Model, plan: RunPlan, splicer, fitting: list, record: RewriteRecord) -> None:
    """Fit the replacements (onnx/calibrate.py); the record says how, and what was fitted."""
    from attnrewrite.onnx.calibrate import calibrate_replacements

    with stage("calibrate"):
        stages = calibrate_replacements(model, splicer.calls, fitting, plan.calibration)
    record.end_to_end, record.finetune = stages.get("end_to_end"), stages.get("finetune")
    record.fitted = {
        outcome.site.layer: _fitted_values(splicer.calls[outcome.site.name], names, module)
        for outcome, module, names in fitting
    }


class _Replacement(NamedTuple):
    lowering: Any
    module: Any  # the learnable module calibration fits, or None
    weights: dict | None  # the values the lowering holds instead of its initial ones


def _replacement(splicer, s: OnnxSite, plan: RunPlan, opset: int, weights, contrib_ops: bool) -> _Replacement | str:
    """How a site decided for is replaced (weights: values given for it, fitted earlier): by
    the method's recurrent form (its steps with onnxruntime's contrib operators where
    ``contrib_ops``) or its parallel one; or why it cannot be after all."""
    try:
        splicer.check(s)
    except Unsupported as why:
        return str(why)
    method, opts, module = plan.method, plan.options, None
    if plan.calibration is not None:
        module, reason = decision.learnable_module(s.site, method, opts)
        if module is None:
            return reason
        weights = {name: t.detach().numpy() for name, t in module.state_dict().items()}
    if plan.recurrent:
        form = passes_recurrent.form_for(method, s.site, opts)
        lowering = form.onnx_lowering(s.site, opset, weights, contrib_ops=contrib_ops)
        return _Replacement(lowering, module, weights)
    exact = plan.exact_in(s.site.layer)
    if not exact:
        return _Replacement(method.onnx_lowering(s.site, opts, opset, weights=weights), module, weights)
    try:
        return _Replacement(heads.onnx_lowering(method, s.site, opts, opset, exact, weights), module, weights)
    except ValueError as why:  # a method whose values have no head axis
        return f"cannot keep heads exact: {why}"


def _fitted_values(call: ir.Node, names: list[str], module) -> dict[str, np.ndarray]:
    """The fitted module's values as the replacement holds them (its lowering's other constants,
    such as the site's scale, are not fitted and are rebuilt with the lowering)."""
    state = module.state_dict()
    return {name: value for name, value in _values(call, names).items() if name in state}


def _values(call: ir.Node, names: list[str]) -> dict[str, np.ndarray]:
    """The values a replacement holds, by its lowering's constant names (the call's last inputs)."""
    return {name: value.const_value.numpy() for name, value in zip(names, call.inputs[len(call.inputs) - len(names) :])}


def _check_exact_heads(exact_heads: dict[int, list[int]], sites: list[OnnxSite]) -> None:
    """Every layer named has a site, and every head named is one of its heads (where known)."""
    by_layer = {s.site.layer: s.site for s in sites}
    for layer, chosen in exact_heads.items():
        if layer not in by_layer:
            raise AttnRewriteError(f"--heads: no attention site in layer {layer}")
        site = by_layer[layer]
        wrong = heads.out_of_range(site, chosen) if site.num_heads is not None else []
        if wrong:
            raise AttnRewriteError(
                f"--heads: layer {layer} has heads 0-{site.num_heads - 1}, not {','.join(map(str, wrong))}"
            )


def _fitted_on_every_head(model: ir.Model, plan: RunPlan):
    """Calibrated exact heads: every head is fitted (on a copy of the model, as it would be
    without exact heads), then the model is rewritten with those values, the exact heads' left
    out; what head selection measures (attnrewrite.head_selection). The record says how each
    site was fitted."""
    earlier = model.metadata_props.get(METADATA_KEY)
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    _, every_head = rewrite_model(copy, plan.but(exact_heads=None))
    model, record = rewrite_model(model, plan.but(calibration=None, fitted=every_head.fitted))
    with_fitting_of(record, every_head)
    if record.rewritten:
        model.metadata_props[METADATA_KEY] = record_json(record, earlier)
    return model, record


def with_fitting_of(record: RewriteRecord, fitted: RewriteRecord) -> None:
    """``record`` (of a rewrite with ``fitted``'s values) says how they were fitted: each site's
    calibration entry, the end-to-end stage's."""
    calibration = {o.site.name: o.calibration for o in fitted.outcomes}
    for outcome in record.rewritten:
        outcome.calibration = calibration.get(outcome.site.name)
    record.end_to_end, record.finetune, record.fitted = fitted.end_to_end, fitted.finetune, fitted.fitted


def _splicer(model: ir.Model, sites: list[OnnxSite], decisions: list[str | None], plan: RunPlan):
    """(decisions, the splicer of the sites accepted; None where none is). A recurrent rewrite
    refuses every site with the model's reason where its caches cannot become states."""
    accepted = [s for s, reason in zip(sites, decisions) if reason is None]
    if not accepted:
        return decisions, None
    if not plan.recurrent:
        return decisions, Splicer(model)
    interface, reason = interface_refusal(model.graph, accepted)
    if reason is not None:
        return [reason if d is None else d for d in decisions], None
    return decisions, RecurrentSplicer(model, interface, contrib_ops=not plan.standard_ops)


def read_record(model: ir.Model) -> dict | None:
    text = model.metadata_props.get(METADATA_KEY)
    return json.loads(text) if text else None
