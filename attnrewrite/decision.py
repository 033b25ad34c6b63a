"""What becomes of a site: replaced by the method, or left alone with one reason.

The frontends (attnrewrite/onnx/rewrite.py, attnrewrite/fx/rewrite.py) find sites their own way
and reduce each to an AttentionSite; from there on they decide here, from the site alone, so a
model gets the same statuses and the same reasons through ONNX and through torch.fx.
"""

from __future__ import annotations

import types
from typing import Any

from attnrewrite.site import AttentionSite

SINGLE_QUERY = "a single query: linearizing saves nothing"
NO_CACHE = "not a KV-cache site: --recurrent replaces the KV caches of a decoder exported for generation"


def refusal(
    site: AttentionSite,
    method: types.ModuleType,
    options: Any,
    layers: list[int] | None = None,
    include_single_query: bool = False,
    recurrent: bool = False,
    exact_heads: list[int] | None = None,
) -> str | None:
    """None when ``method`` is to replace the site, else why it is left alone. The first reason
    that applies: what detection found (probabilities used elsewhere, a mask that is a bias),
    the layer selection, the heads to keep exact (all of them, or a site whose heads are not
    known), with ``recurrent`` a KV cache (its absence, or the method having no recurrence), a
    single query, the method's own limits. Without ``recurrent`` a KV-cache site is rewritten
    in parallel over its cache (the splice places each new query at its position)."""
    if site.skip_reason is not None:
        return site.skip_reason
    if layers is not None and site.layer not in layers:
        return f"layer {site.layer} is not among the selected layers"
    if exact_heads:
        from attnrewrite.passes import heads

        reason = heads.refusal(site, exact_heads)
        if reason is not None:
            return reason
    if recurrent:
        return _recurrent_refusal(site, method, options)
    if site.query_length == 1 and not include_single_query:
        # one query (a decoder step) attends to N keys in O(N) already: a linear method would
        # only approximate it
        return SINGLE_QUERY
    return method.supports(site, options)


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
