"""Find softmax attention in an ONNX graph and reduce each match to an AttentionSite.

Detection anchors at Softmax, walks back through scale / mask / Cast nodes to the logits
MatMul (q @ k^T), and forward through NaN guards, Cast and Dropout to the MatMul with V.
The standard ``Attention`` operator (opset 23) and onnxruntime's fused ``com.microsoft``
Attention / MultiHeadAttention are accepted as already-fused sites (the latter with a plan for
unpacking their q, k, v). Each site's KV cache is found too, a Concat(past, new) before the
attention or the past inputs of a fused operator; a contrib Attention or MultiHeadAttention with
a cache is listed with it and refused. GroupQueryAttention (gqa.py) is a KV-cache site with a
plan for unpacking its packed, rotated q, k, v. Mask kinds are not decided here: masks.py probes them numerically.
"""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.detect.common import CachedTensor, HeadLayout, HeadSource, OnnxSite, PackedHeads
from attnrewrite.onnx.detect.contrib import (
    CONTRIB_ATTENTION,
    CONTRIB_DOMAIN,
    FUSED_DECODER_ADVICE,
    fused_cache_before,
    fused_cache_inside,
    match_contrib_attention,
)
from attnrewrite.onnx.detect.fused import match_fused_attention
from attnrewrite.onnx.detect.gqa import GroupedQueryPlan, declared_cache_sizes, match_group_query_attention
from attnrewrite.onnx.detect.kv_cache import cache_inputs, cached_tensor, past_input
from attnrewrite.onnx.detect.softmax import match_softmax
from attnrewrite.passes.lowering import DOMAIN as REPLACEMENT_DOMAIN
from attnrewrite.site import MaskKind, Unsupported

__all__ = [
    "CONTRIB_ATTENTION",
    "CONTRIB_DOMAIN",
    "FUSED_DECODER_ADVICE",
    "GroupedQueryPlan",
    "CachedTensor",
    "HeadLayout",
    "HeadSource",
    "OnnxSite",
    "PackedHeads",
    "Unsupported",
    "cache_inputs",
    "cached_tensor",
    "declared_cache_sizes",
    "find_onnx_sites",
    "fused_cache_before",
    "fused_cache_inside",
    "mark_unsupported_masks",
    "past_input",
]


def find_onnx_sites(graph: ir.Graph) -> list[OnnxSite]:
    sites = []
    layer = 0  # attention layers in graph order, counting those an earlier run replaced
    for node in graph:
        if node.domain == REPLACEMENT_DOMAIN:
            # keeps layer numbers (and so --layers) stable when a model is rewritten in steps
            layer += 1
            continue
        if node.domain == CONTRIB_DOMAIN and node.op_type == "GroupQueryAttention":
            sites.append(match_group_query_attention(node, index=layer))
            layer += 1
            continue
        if node.domain == CONTRIB_DOMAIN and node.op_type in CONTRIB_ATTENTION:
            sites.append(match_contrib_attention(node, index=layer))
            layer += 1
            continue
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Softmax":
            sites.append(match_softmax(node, index=layer))
            layer += 1
        elif node.op_type == "Attention":
            sites.append(match_fused_attention(node, index=layer))
            layer += 1
    return sites


def mark_unsupported_masks(sites: list[OnnxSite]) -> None:
    """Fill the mask kind of sites without masks; others are classified by masks.py."""
    for s in sites:
        if s.site.skip_reason is None and not s.masks:
            s.site.mask = MaskKind.CAUSAL if s.causal_by_attribute else MaskKind.NONE
            if s.grouped_query is not None:  # it attends to each row's real tokens (seqlens_k)
                s.site.mask = MaskKind.CAUSAL_KEY_PADDING
