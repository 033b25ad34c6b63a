"""The standard ``Attention`` operator (opset 23), accepted as an already-fused site; and what
the fused operators' sites share (onnxruntime's contrib operators build theirs with it)."""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.detect.common import (
    CachedTensor,
    OnnxSite,
    describe_shapes,
    rank_of,
    refused,
    static_dim,
    static_dims,
)
from attnrewrite.onnx.detect.kv_cache import caches_of, past_input, returned, set_caches
from attnrewrite.site import AttentionSite, MaskEncoding, MaskTerm, Unsupported

# --- fused Attention (opset 23) -----------------------------------------------------------------


def match_fused_attention(node: ir.Node, index: int) -> OnnxSite:
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    q, k, v, attn_mask, past_key, past_value = inputs[:6]
    onnx_site = fused_site(node, index, q, k, v)
    site = onnx_site.site
    try:
        caches = _fused_caches(node, k, v, past_key, past_value)
        _check_fused_attention_limits(node, q, cached=caches[0] is not None)
    except Unsupported as reason:
        return refused(onnx_site, str(reason))
    attrs = node.attributes
    onnx_site.causal_by_attribute = bool(attrs["is_causal"].as_int()) if "is_causal" in attrs else False
    if attn_mask is not None:
        boolean = attn_mask.dtype == ir.DataType.BOOL
        encoding = MaskEncoding.KEEP_WHERE_TRUE if boolean else MaskEncoding.ADDITIVE
        onnx_site.masks.append(MaskTerm(attn_mask, encoding))
    describe_shapes(site, q, v, None)
    site.num_heads = static_dim(q.shape[1])  # the operator defines 4-D inputs as [B, H, N, D]
    onnx_site.static_lengths = (static_dims(q, -2)[0], static_dims(k, -2)[0])
    site.query_length = onnx_site.static_lengths[0]
    set_scale(site, node, zero_is_default=False)
    set_caches(onnx_site, *caches)
    return onnx_site


def _fused_caches(node: ir.Node, k, v, past_key, past_value) -> tuple[CachedTensor | None, CachedTensor | None]:
    """Attention (opset 23) appends k and v to past_key and past_value (graph inputs) and
    returns them as present_key and present_value (outputs 1 and 2); its causal mask is then
    aligned to the last key (query i sees keys up to past + i), as a Concat(past, new) decoder's.
    Without past inputs its k and v may still hold a cache: the dynamo exporter at opset 23
    writes scaled_dot_product_attention over Concat(past, new) as one."""
    if past_key is None and past_value is None:
        return caches_of(k, v)
    if past_key is None or past_value is None:
        raise Unsupported("Attention with only one of past_key and past_value is not understood")
    caches = []
    for past, new, slot in ((past_key, k, 1), (past_value, v, 2)):
        if past_input(past) is None:
            raise Unsupported(f"Attention's past cache {past.name!r} is computed in the graph, not a graph input")
        present = node.outputs[slot] if len(node.outputs) > slot else None
        output = returned(present) if present is not None else None
        caches.append(CachedTensor(node, past_input(past), new, present, output))
    return caches[0], caches[1]


def fused_site(node: ir.Node, index: int, q: ir.Value, k: ir.Value | None, v: ir.Value) -> OnnxSite:
    """A site for one fused attention node: the node is all the splice removes."""
    site = AttentionSite(name=node.name or f"{node.op_type}_{index}", layer=index)
    site.provenance = {"nodes": [node.name]}
    return OnnxSite(site=site, q=q, k=k, v=v, output=node.outputs[0], nodes=[node])


def set_scale(site: AttentionSite, node: ir.Node, zero_is_default: bool) -> None:
    """The ``scale`` attribute, else the operators' default 1/sqrt(head_dim) (onnxruntime's
    contrib ops write 0 for the default)."""
    attr = node.attributes.get("scale")
    if attr is not None and not (zero_is_default and attr.as_float() == 0.0):
        site.scale = attr.as_float()
    elif site.head_dim is not None:
        site.scale = site.head_dim**-0.5
    else:
        site.skip_reason = f"{node.op_type} without a scale attribute and with an unknown head size"


def _check_fused_attention_limits(node, q, cached: bool) -> None:
    attrs = node.attributes
    qk = node.outputs[3] if len(node.outputs) > 3 else None
    if qk is not None and (qk.uses() or qk.is_graph_output()):
        raise Unsupported("Attention's qk output (the attention scores) is used")
    presents = [out for out in node.outputs[1:3] if out is not None and (out.uses() or out.is_graph_output())]
    if presents and not cached:
        raise Unsupported("Attention's present key/value outputs are used without a past cache")
    if "softcap" in attrs and attrs["softcap"].as_float() != 0.0:
        raise Unsupported("Attention with softcap is not expressible by linear methods")
    if rank_of(q) != 4:
        raise Unsupported("Attention with 3-D inputs (heads packed into features) is not supported; 4-D expected")
    if q.shape is not None and node.inputs[1].shape is not None:
        qh, kh = q.shape[1], node.inputs[1].shape[1]
        # grouped key/value heads are repeated by the splice; that needs both counts
        if not (isinstance(qh, int) and isinstance(kh, int) and qh % kh == 0):
            raise Unsupported(
                f"grouped-query Attention ({qh} query heads, {kh} key heads): "
                "the head counts must be static, the key heads dividing the query heads"
            )
