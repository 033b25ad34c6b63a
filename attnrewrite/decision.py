"""What becomes of a site: replaced by the method, or left alone with one reason.

The frontends (attnrewrite/onnx/rewrite.py, attnrewrite/fx/rewrite.py) find sites their own way
and reduce each to an AttentionSite; from there on they decide here, from the site alone, so a
model gets the same statuses and the same reasons through ONNX and through torch.fx.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from attnrewrite import passes
from attnrewrite.passes.options import MethodOptions
from attnrewrite.site import AttentionSite

SINGLE_QUERY = "a single query: linearizing saves nothing"
NO_CACHE = "not a KV-cache site: --recurrent replaces the KV caches of a decoder exported for generation"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one run asks of every site, settled once at the top (attnrewrite.pipeline, the API)
    and handed down whole to the frontends (onnx/rewrite.py's rewrite_model, fx/rewrite.py's
    rewrite_graph_module), which read it and never rebuild it.

    ``method``, ``options``: the pass and its Options (passes.method_and_options). ``layers``:
    the site indices to replace (None: all). ``include_single_query``: also sites with one query,
    left exact by default. ``recurrent``: KV-cache sites become recurrences (onnx/recurrent.py),
    whose steps use onnxruntime's contrib operators unless ``standard_ops``. ``exact_heads``
    (layer -> head indices): heads kept softmax inside the replacement (passes/heads.py).
    ``calibration`` (attnrewrite.calibration.Calibration): fit every replacement. ``seq``: the
    length the ONNX mask probe starts from. ``fitted`` (layer -> values, a record's ``fitted``):
    the values the replacements hold instead of their initial ones."""

    method: types.ModuleType
    options: MethodOptions
    layers: list[int] | None = None
    include_single_query: bool = False
    recurrent: bool = False
    standard_ops: bool = False
    exact_heads: dict[int, list[int]] | None = None
    calibration: Any = None
    seq: int | None = None
    fitted: dict[int, dict[str, Any]] | None = None

    @classmethod
    def of(cls, to: Any, **keywords: Any) -> RunPlan:
        """The plan for ``to`` (a method's name or its Options) with ``keywords``: the plan's own
        fields by name, the method's options besides (as the frontends' callers spell them)."""
        if isinstance(to, RunPlan):
            return to.but(**keywords)
        own = {name: keywords.pop(name) for name in _FIELDS if name in keywords}
        method, options = passes.method_and_options(to, **keywords)
        return cls(method, options, **own)

    def but(self, **changes: Any) -> RunPlan:
        """This plan with ``changes``: a trial of layer or head selection, say."""
        return dataclasses.replace(self, **changes)

    def exact_in(self, layer: int | None) -> list[int] | None:
        """The heads kept exact in ``layer``'s site (None: none)."""
        return (self.exact_heads or {}).get(layer)


_FIELDS = [field.name for field in dataclasses.fields(RunPlan) if field.name not in ("method", "options")]


def refusal(site: AttentionSite, plan: RunPlan) -> str | None:
    """None when ``plan``'s method is to replace the site, else why it is left alone. The first
    reason that applies: what detection found (probabilities used elsewhere, a mask that is a
    bias), the layer selection, the heads to keep exact (all of them, or a site whose heads are
    not known), with ``plan.recurrent`` a KV cache (its absence, or the method having no
    recurrence), a single query, the method's own limits. Without ``recurrent`` a KV-cache site
    is rewritten in parallel over its cache (the splice places each new query at its position)."""
    if site.skip_reason is not None:
        return site.skip_reason
    if plan.layers is not None and site.layer not in plan.layers:
        return f"layer {site.layer} is not among the selected layers"
    exact_heads = plan.exact_in(site.layer)
    if exact_heads:
        from attnrewrite.passes import heads

        reason = heads.refusal(site, exact_heads)
        if reason is not None:
            return reason
    if plan.recurrent:
        return _recurrent_refusal(site, plan.method, plan.options)
    if site.query_length == 1 and not plan.include_single_query:
        # one query (a decoder step) attends to N keys in O(N) already: a linear method would
        # only approximate it
        return SINGLE_QUERY
    return plan.method.supports(site, plan.options)


def _recurrent_refusal(site: AttentionSite, method: types.ModuleType, options: Any) -> str | None:
    """A KV-cache site becomes a recurrence where the method has one (it then serves any number
    of queries: one is a decoding step)."""
    from attnrewrite.passes import recurrent

    if site.kv_cache is None:
        return NO_CACHE
    return (
        recurrent.recurrent_refusal(method, options) or recurrent.site_refusal(site) or method.supports(site, options)
    )


def learnable_module(
    site: AttentionSite, method: types.ModuleType, options: Any
) -> tuple[Any, None] | tuple[None, str]:
    """(the pass's torch module with every value calibration may fit as an nn.Parameter, None),
    or (None, why no such module can be built for the site)."""
    try:
        return method.torch_module(site, options, learnable=True), None
    except ValueError as why:  # e.g. maps for a head dimension nobody knows
        return None, f"cannot be calibrated: {why}"
