"""onnxruntime's ``com.microsoft.GroupQueryAttention``: the decoder attention of
onnxruntime-genai's model builder, Olive and onnxruntime's optimizer, a KV-cache site whose cache
lives inside the operator.

The operator takes q, k, v packed into one [batch, seq, (heads + 2 kv_heads) * head_size] input
or as three [batch, seq, hidden] inputs, appends the new keys and values to ``past_key`` /
``past_value`` ([batch, kv_heads, past, head_size]) after each row's real tokens (``seqlens_k``:
a row's tokens minus one, from the attention mask), returns ``present_key`` / ``present_value``
and attends causally with one key/value head per group of ``heads / kv_heads`` query heads. With
``do_rotary=1`` it rotates q and k itself, at each token's position among its row's real tokens,
from ``cos_cache`` / ``sin_cache`` ([max positions, rotary_dim / 2]). The site records all of it
(GroupedQueryPlan); what the plan does not describe is refused with the reason.
"""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.detect.common import (
    CachedTensor,
    GroupedQueryPlan,
    OnnxSite,
    projected_features,
    refused,
    static_dims,
)
from attnrewrite.onnx.detect.contrib import CONTRIB_DOMAIN
from attnrewrite.onnx.detect.fused import fused_site, set_scale
from attnrewrite.onnx.detect.kv_cache import returned
from attnrewrite.site import KvCache, Unsupported

# the operator's inputs, as onnxruntime's ContribOperators.md names them
_INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
)
_UNSUPPORTED_INPUTS = {
    "position_ids": "positions given to the operator (the replacement takes them from the attention mask)",
    "attention_bias": "an attention bias, which a linear attention cannot add to its scores",
    "head_sink": "a learned sink per head (smooth softmax), which a linear attention has no place for",
}


def match_group_query_attention(node: ir.Node, index: int) -> OnnxSite:
    inputs = {name: v for name, v in zip(_INPUTS, node.inputs) if v is not None}
    onnx_site = fused_site(node, index, inputs["query"], inputs.get("key"), inputs.get("value"))
    site = onnx_site.site
    try:
        plan = _plan(node, inputs)
    except Unsupported as reason:
        _describe_refused(onnx_site, node, inputs)
        return refused(onnx_site, str(reason))
    key, value = (_cached(node, inputs, i) for i in (1, 2))
    onnx_site.key_cache, onnx_site.value_cache, onnx_site.grouped_query = key, value, plan
    site.kv_cache = _kv_cache(key, value, plan.kv_heads)
    site.rank, site.num_heads = 4, plan.num_heads
    site.head_dim = site.value_dim = plan.head_size
    if plan.query.dtype is not None:
        site.dtype = plan.query.dtype.numpy().name
    set_scale(site, node, zero_is_default=True)
    site.query_length = static_dims(plan.query, 1)[0]
    onnx_site.causal_by_attribute = True  # by definition; its padded keys are the attention mask's
    return onnx_site


def _kv_cache(key: CachedTensor, value: CachedTensor, kv_heads: int) -> KvCache:
    return KvCache(
        past_key=key.past.name,
        past_value=value.past.name,
        present_key=key.output.name if key.output is not None else None,
        present_value=value.output.name if value.output is not None else None,
        kv_heads=kv_heads,
    )


def _describe_refused(onnx_site: OnnxSite, node: ir.Node, inputs: dict[str, ir.Value]) -> None:
    """What a refused operator still says: its heads and the cache it carries (listed with it,
    and kept by a recurrent rewrite of the other layers), where it says them."""
    try:
        heads, kv_heads, size = _heads(node, inputs)
    except Unsupported:
        return
    site = onnx_site.site
    site.num_heads, site.head_dim = heads, size
    set_scale(site, node, zero_is_default=True)
    if all(name in inputs and inputs[name].is_graph_input() for name in ("past_key", "past_value")):
        site.kv_cache = _kv_cache(*(_cached(node, inputs, i) for i in (1, 2)), kv_heads)


def _plan(node: ir.Node, inputs: dict[str, ir.Value]) -> GroupedQueryPlan:
    attrs = node.attributes

    def attr(name: str, default):
        return attrs[name].value if name in attrs else default

    for name, why in _UNSUPPORTED_INPUTS.items():
        if name in inputs:
            raise Unsupported(f"GroupQueryAttention with {why}")
    if attr("softcap", 0.0):
        raise Unsupported(
            f"GroupQueryAttention caps its scores (softcap={attr('softcap', 0.0):g}): not a softmax of q k^T"
        )
    if attr("smooth_softmax", 0):
        raise Unsupported(
            "GroupQueryAttention with smooth_softmax=1 (an extra zero logit per row): not a plain softmax"
        )
    if attr("local_window_size", -1) != -1:
        raise Unsupported(
            f"GroupQueryAttention attends to a local window of {attr('local_window_size', -1)} keys "
            "(sliding-window attention), which the replacement would widen to the whole context"
        )
    for name in ("past_key", "past_value"):
        past = inputs.get(name)
        if past is None or not past.is_graph_input() or past.is_initializer():
            raise Unsupported(f"GroupQueryAttention's {name} is not a graph input: a cache it does not carry")
    for present in node.outputs[1:3]:
        if present is not None and present.uses():
            raise Unsupported(f"GroupQueryAttention's {present.name!r} is read inside the graph, not only returned")
    heads, kv_heads, size = _heads(node, inputs)
    query, key, value = inputs["query"], inputs.get("key"), inputs.get("value")
    rotary, rotary_dim = None, None
    if attr("do_rotary", 0):
        if "cos_cache" not in inputs or "sin_cache" not in inputs:
            raise Unsupported("GroupQueryAttention rotates (do_rotary=1) without cos_cache and sin_cache")
        rotary = (inputs["cos_cache"], inputs["sin_cache"])
        half = static_dims(rotary[0], 1)[0]
        if half is None or 2 * half > size:
            raise Unsupported("GroupQueryAttention's cos_cache does not say its rotary dimension")
        rotary_dim = 2 * half
    interleaved = bool(attr("rotary_interleaved", 0))
    return GroupedQueryPlan(heads, kv_heads, size, query, key, value, rotary, rotary_dim, interleaved)


def _heads(node: ir.Node, inputs: dict[str, ir.Value]) -> tuple[int, int, int]:
    """(heads, key/value heads, head size) as the operator reads q, k, v and its caches."""
    attrs = node.attributes
    heads = attrs["num_heads"].value if "num_heads" in attrs else 0
    kv_heads = attrs["kv_num_heads"].value if "kv_num_heads" in attrs else 0
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise Unsupported(f"GroupQueryAttention with num_heads={heads}, kv_num_heads={kv_heads} is not understood")
    if ("key" in inputs) != ("value" in inputs):
        raise Unsupported("GroupQueryAttention with only one of key and value is not understood")
    hidden = projected_features(inputs["query"])
    if hidden is None:
        raise Unsupported("GroupQueryAttention's query width is unknown: its heads cannot be split")
    return heads, kv_heads, hidden // (heads + 2 * kv_heads) if "key" not in inputs else hidden // heads


def _cached(node: ir.Node, inputs: dict[str, ir.Value], output: int) -> CachedTensor:
    """The cache appended to inside the operator: past input, present output; the new keys or
    values are computed by the splice from the plan (``new`` None)."""
    past = inputs["past_key" if output == 1 else "past_value"]
    present = node.outputs[output] if output < len(node.outputs) else None
    return CachedTensor(node, past, None, present, returned(present) if present is not None else None)


def declared_cache_sizes(graph: ir.Graph) -> dict[str, dict[int, int]]:
    """The sizes of GroupQueryAttention caches, which their declarations may leave symbolic (the
    builder declares [batch, kv_heads, past, "kv_cache_dim"]): cache input -> {axis: size}, the
    key/value heads and head size the operator reads them with; the caches of an operator left
    alone too (a sliding window's), which the model carries all the same."""
    sizes = {}
    for node in graph:
        if node.domain != CONTRIB_DOMAIN or node.op_type != "GroupQueryAttention":
            continue
        inputs = {name: v for name, v in zip(_INPUTS, node.inputs) if v is not None}
        try:
            _, kv_heads, size = _heads(node, inputs)
        except Unsupported:
            continue
        for past in (inputs.get("past_key"), inputs.get("past_value")):
            if past is not None:
                sizes[past.name] = {1: kv_heads, 3: size}
    return sizes
