"""Exact heads under a fidelity budget (``--heads auto`` with ``--min-cosine X`` and/or
``--min-agreement Y``).

Layers are too coarse a unit: within a site some heads resist linearization and most do not.
Head selection replaces every site it can, measures what each head costs, and keeps exact
softmax (inside the replacement: attnrewrite.passes.heads) on the fewest, costliest heads
with which the whole model passes the gates of ``attnrewrite.check``.

A head's cost is its share of its site's output error: on the inputs measured on, every site
replaced, ``|out_h - softmax_h|^2`` over the site's ``|softmax|^2`` (padded query rows left
out). Heads are disjoint slices of the output, so this share is what making the head exact
removes from the site's error (the site's error with that head exact, the rest replaced, is
the rest of it); relative to the site's output, it compares heads of different sites.

The search orders every (site, head) by cost, costliest first, and bisects on how many of them
are exact, each count measured on the whole model: the answer is a count that passes whose
predecessor fails, both measured. That it is the fewest assumes a model with more of the
costliest heads exact passes whenever one with fewer does: likely, not guaranteed (an exact
head changes what the sites after it see). The pipeline's gate measures the model returned,
the last count that passed, once more.

With calibration every head is fitted first, once, on the data before the held-out part; the
trials slice those values and never refit, and the costs and trials are measured on the held-out
part. A site whose every head ends up exact is left as it was, so ``--layers auto`` composes:
heads are the unit, and a site with all of them exact is a site kept. A site whose heads are not
known cannot keep heads exact: it is replaced whole and has no costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from attnrewrite import check as check_mod
from attnrewrite.check import CheckInputs
from attnrewrite.decision import RunPlan
from attnrewrite.layer_selection import Measurement, gate_measurement
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import rewrite_model, with_fitting_of
from attnrewrite.passes.heads import attention_scale
from attnrewrite.passes.lowering import DOMAIN
from attnrewrite.record import METADATA_KEY, RewriteRecord, format_table, json_float, record_json

COSTLIEST_SHOWN = 3  # heads per site the table names with their costs


@dataclasses.dataclass(frozen=True)
class HeadCost:
    layer: int
    head: int
    cost: float  # the head's share of its site's relative squared output error


@dataclasses.dataclass(frozen=True)
class SiteHeads:
    layer: int
    name: str
    heads: int


@dataclasses.dataclass
class HeadSelection:
    sites: list[SiteHeads]  # those whose heads can be exact, in graph order
    costs: list[HeadCost]  # costliest first: the order heads are made exact in
    trials: dict[int, Measurement]  # exact heads (the costliest so many) -> the model measured
    exact_count: int  # the answer: the costliest so many heads are exact
    inputs: str  # what the costs and the trials were measured on
    min_cosine: float | None = None
    min_agreement: float | None = None

    @property
    def exact(self) -> dict[int, list[int]]:
        """Layer -> its exact heads (sorted), for the sites that have any."""
        return by_layer(self.costs[: self.exact_count])

    @property
    def final(self) -> Measurement | None:
        return self.trials.get(self.exact_count)

    @property
    def budget(self) -> str:
        """What the model must keep, in words."""
        parts = [f"cosine >= {self.min_cosine:g}"] if self.min_cosine is not None else []
        parts += [f"argmax agreement >= {self.min_agreement:g}"] if self.min_agreement is not None else []
        return " and ".join(parts)

    def summary(self) -> str:
        final = self.final
        measured = "" if final is None else f", model cosine {final.cosine:.6f}"
        if final is not None and final.agreement is not None:
            measured += f", argmax agreement {final.agreement:.4f}"
        tried = ", ".join(
            f"{count}: {m.cosine:.6f} {'passes' if m.passes else 'fails'}" for count, m in sorted(self.trials.items())
        )
        return (
            f"head selection ({self.budget}, inputs: {self.inputs}): {self.exact_count} of {len(self.costs)} heads "
            f"kept exact{measured}\nheads exact -> model cosine: {tried}"
        )

    def table(self) -> str:
        header = ("layer", "site", "error", "exact heads", "costliest heads", "result")
        exact = self.exact
        rows = [
            (
                str(site.layer),
                site.name,
                f"{self._site_error(site.layer):.6f}",
                ",".join(map(str, exact.get(site.layer, []))) or "-",
                " ".join(f"{c.head}:{c.cost:.3g}" for c in self._site_costs(site.layer)[:COSTLIEST_SHOWN]),
                self._result(site, exact.get(site.layer, [])),
            )
            for site in self.sites
        ]
        return "\n".join([format_table(header, rows), self.summary()])

    def as_dict(self) -> dict[str, Any]:
        exact = self.exact
        final = self.final
        return {
            "unit": "head",
            **({"min_cosine": self.min_cosine} if self.min_cosine is not None else {}),
            **({"min_agreement": self.min_agreement} if self.min_agreement is not None else {}),
            "inputs": self.inputs,
            "exact_heads": self.exact_count,
            "heads": len(self.costs),
            "final_cosine": None if final is None else json_float(final.cosine),
            "trials": [
                {"exact_heads": count, "cosine": json_float(m.cosine), "agreement": m.agreement, "passes": m.passes}
                for count, m in sorted(self.trials.items())
            ],
            "sites": [
                {
                    "layer": site.layer,
                    "site": site.name,
                    "error": json_float(self._site_error(site.layer)),
                    "head_costs": [json_float(c.cost) for c in sorted(self._site_costs(site.layer), key=_by_head)],
                    "exact_heads": exact.get(site.layer, []),
                    "result": self._result(site, exact.get(site.layer, [])),
                }
                for site in self.sites
            ],
        }

    def _site_costs(self, layer: int) -> list[HeadCost]:
        return [c for c in self.costs if c.layer == layer]

    def _site_error(self, layer: int) -> float:
        return sum(c.cost for c in self._site_costs(layer))

    @staticmethod
    def _result(site: SiteHeads, exact: list[int]) -> str:
        if len(exact) == site.heads:
            return "kept: every head exact"
        return f"replaced, {len(exact)} of {site.heads} heads exact" if exact else "replaced"


def by_layer(costs: list[HeadCost]) -> dict[int, list[int]]:
    """The heads of ``costs`` by layer, sorted: rewrite_model's ``exact_heads``."""
    chosen: dict[int, list[int]] = {}
    for cost in costs:
        chosen.setdefault(cost.layer, []).append(cost.head)
    return {layer: sorted(heads) for layer, heads in sorted(chosen.items())}


def fewest_exact_heads(total: int, measure: Callable[[int], Measurement]) -> tuple[int, dict[int, Measurement]]:
    """The fewest of the ``total`` heads (costliest first) to keep exact for the model to pass,
    by bisection (the module docstring says what it assumes), and every count measured.
    ``measure(count)``: the model with the costliest ``count`` heads exact. ``total`` when even
    every head exact fails (the measurements say so)."""
    trials: dict[int, Measurement] = {}

    def passes(count: int) -> bool:
        if count not in trials:
            trials[count] = measure(count)
        return trials[count].passes

    if passes(0) or not passes(total):
        return (0 if trials[0].passes else total), trials
    failing, passing = 0, total
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if passes(middle):
            passing = middle
        else:
            failing = middle
    return passing, trials


# --- what each head costs ------------------------------------------------------------------------


def head_costs(model: ir.Model, record: RewriteRecord, feeds: dict[str, np.ndarray]) -> list[HeadCost]:
    """Every head's cost (module docstring) in ``model`` (rewritten, ``record`` its record)
    run on ``feeds``, costliest first (a NaN first of all), ties by layer and head. Changes
    ``model``: it is a copy made for this."""
    from attnrewrite.onnx.rewrite import rewritten_sites

    calls = {node.name: node for node in rewritten_sites(model)}
    measured = [
        o
        for o in record.rewritten
        if o.site.num_heads is not None and o.site.rank == 4 and o.replacement.startswith(f"{DOMAIN}.")
    ]  # an operator kept as its own replacement (a GroupQueryAttention's local window) has no call to measure
    nodes = [calls[f"{o.site.name}/{o.replacement.split('.', 1)[1]}"] for o in measured]
    collected = _collected(model, [[*node.inputs[:4], node.outputs[0]] for node in nodes], feeds)
    costs = [
        HeadCost(outcome.site.layer, head, float(share))
        for outcome, arrays in zip(measured, collected)
        for head, share in enumerate(
            error_shares(*arrays, scale=attention_scale(outcome.site), causal=outcome.site.mask.causal)
        )
    ]
    return sorted(costs, key=lambda c: (-_sortable(c.cost), c.layer, c.head))


def error_shares(q, k, v, key_keep, out, scale: float, causal: bool) -> np.ndarray:
    """Per head, ``out``'s squared error against softmax attention over the exact output's
    squared norm (all heads), query rows that are padding left out; one example at a time, so
    that the weights [heads, Nq, Nk] of one are all that is held."""
    error, norm = np.zeros(q.shape[1]), 0.0
    key_keep = key_keep.reshape((1,) * (4 - key_keep.ndim) + key_keep.shape)  # [B or 1, heads or 1, Nk, 1]
    rows = key_keep if key_keep.shape[-2] == q.shape[-2] else np.ones((1, 1, 1, 1), np.float32)
    for b in range(q.shape[0]):
        keep = key_keep[min(b, key_keep.shape[0] - 1)]
        exact = softmax_attention(q[b], k[b], v[b], keep, scale, causal)
        weight = rows[min(b, rows.shape[0] - 1)]
        error += (weight * (out[b].astype(np.float64) - exact) ** 2).sum(axis=(1, 2))
        norm += float((weight * exact**2).sum())
    return error / max(norm, np.finfo(np.float64).tiny)


def softmax_attention(q, k, v, key_keep, scale: float, causal: bool) -> np.ndarray:
    """softmax(scale q k^T, padded and (causal) later keys hidden) v in float64; [..., N, d]."""
    logits = scale * (q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64))
    hidden = np.swapaxes(key_keep, -1, -2) == 0
    if causal:
        queries, keys = logits.shape[-2:]
        hidden = hidden | (np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries))
    logits = np.where(hidden, -np.inf, logits)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.nan_to_num(weights / weights.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def _collected(model: ir.Model, values: list[list[ir.Value]], feeds: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
    """``values`` (per site) as float32 arrays, from one run of ``model`` with them as extra outputs."""
    from attnrewrite.onnx.validate import make_session

    names = []
    for i, site_values in enumerate(values):
        for j, value in enumerate(site_values):
            name = f"attnrewrite/heads/{i}/{j}"
            cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)], name=name, num_outputs=1)
            cast.outputs[0].name, cast.outputs[0].type = name, ir.TensorType(ir.DataType.FLOAT)
            model.graph.append(cast)
            model.graph.outputs.append(cast.outputs[0])
            names.append(name)
    with onnx_io.saved_copy(model) as path:
        session = make_session(str(path))
        known = {i.name for i in session.get_inputs()}
        arrays = iter(session.run(names, {name: array for name, array in feeds.items() if name in known}))
    return [[next(arrays) for _ in site_values] for site_values in values]


def _sortable(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _by_head(cost: HeadCost) -> int:
    return cost.head


# --- the ONNX frontend ---------------------------------------------------------------------------


def select_heads_onnx(
    fresh: Callable[[], ir.Model],
    plan: RunPlan,
    inputs: CheckInputs,
    min_cosine: float | None = None,
    min_agreement: float | None = None,
) -> tuple[ir.Model, RewriteRecord, HeadSelection]:
    """Choose the exact heads of the ONNX model ``fresh()`` returns (a new copy at each call)
    and rewrite it with them. Returns the rewritten model, its record (with the selection) and
    the selection. ``plan``: the run's (decision.RunPlan), its exact heads unset; with its
    ``calibration`` every head is fitted once, first (module docstring)."""
    every_model, every_head = rewrite_model(fresh(), plan)
    costs = head_costs(every_model, every_head, inputs.feeds)
    del every_model
    sites = [
        SiteHeads(o.site.layer, o.site.name, o.site.num_heads)
        for o in every_head.rewritten
        if o.site.rank == 4 and o.site.num_heads is not None
    ]

    def rewritten(count: int) -> tuple[ir.Model, RewriteRecord]:
        exact = by_layer(costs[:count])
        return rewrite_model(fresh(), plan.but(calibration=None, exact_heads=exact, fitted=every_head.fitted))

    base = fresh()
    earlier_record = base.metadata_props.get(METADATA_KEY)
    with onnx_io.saved_copy(base) as original:

        def measure(count: int) -> Measurement:
            report = check_mod.check(original, rewritten(count)[0], inputs)
            return gate_measurement(report, min_cosine, min_agreement)

        count, trials = fewest_exact_heads(len(costs), measure)
    selection = HeadSelection(sites, costs, trials, count, inputs.source, min_cosine, min_agreement)
    model, record = rewritten(count)  # rewrites are deterministic: the model measured for this count
    if plan.calibration is not None:
        with_fitting_of(record, every_head)
    for outcome in record.skipped:
        if outcome.site.layer in selection.exact and outcome.reason and outcome.reason.startswith("every head"):
            outcome.reason = f"head selection: {outcome.reason}"
    record.selection = selection.as_dict()
    model.metadata_props[METADATA_KEY] = record_json(record, earlier_record)
    return model, record, selection
