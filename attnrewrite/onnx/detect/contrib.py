"""onnxruntime's fused attention (``com.microsoft`` Attention and MultiHeadAttention), accepted
as already-fused sites with a plan for unpacking their q, k, v; one with a KV cache is listed
with it and refused. GroupQueryAttention, a KV-cache site the splice unpacks, is gqa.py's."""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.detect.common import (
    HeadLayout,
    HeadSource,
    OnnxSite,
    PackedHeads,
    projected_features,
    rank_of,
    refused,
    static_dims,
)
from attnrewrite.onnx.detect.fused import fused_site, set_scale
from attnrewrite.onnx.detect.kv_cache import FUSED_PAST_SLOTS, caches_of, set_caches
from attnrewrite.site import MASKED_BELOW, KvCache, MaskEncoding, MaskTerm, Unsupported

# --- onnxruntime's fused attention (com.microsoft) ---------------------------------------------
#
# onnxruntime's transformer optimizer (and Olive) fuse a BERT's attention into one contrib
# operator that also projects (Attention: input @ packed weights + bias) or takes q, k, v with
# heads packed into features (MultiHeadAttention). The site records how they are packed; the
# splice unpacks them around the replacement. Inputs are named as in onnxruntime's
# docs/ContribOperators.md.

CONTRIB_DOMAIN = "com.microsoft"
CONTRIB_ATTENTION = ("Attention", "MultiHeadAttention")


def match_contrib_attention(node: ir.Node, index: int) -> OnnxSite:
    inputs = [*node.inputs, *[None] * (10 - len(node.inputs))]
    onnx_site = fused_site(node, index, inputs[0], inputs[1], inputs[2])
    site = onnx_site.site
    site.kv_cache = _contrib_cache(node)  # listed with the site, which is refused for it below
    try:
        _check_no_cache_inside(node)
        _check_contrib_limits(node)
        if node.op_type == "Attention":
            packing, masks = _attention_packing(node, inputs)
        else:
            packing, masks = _multi_head_packing(node, inputs)
        _check_no_cache_before(onnx_site, packing)
    except Unsupported as reason:
        return refused(onnx_site, str(reason))
    attrs = node.attributes
    onnx_site.packing, onnx_site.masks = packing, masks
    onnx_site.static_batch = static_dims(inputs[0], 0)[0]
    onnx_site.static_lengths = _contrib_lengths(packing)
    site.query_length = onnx_site.static_lengths[0]
    onnx_site.causal_by_attribute = bool(attrs["unidirectional"].as_int()) if "unidirectional" in attrs else False
    heads = packing.num_heads
    q_size, _, v_size = packing.sizes
    site.rank, site.num_heads = 4, heads
    site.head_dim = q_size // heads if q_size is not None else None
    site.value_dim = v_size // heads if v_size is not None else None
    dtype = next((v.dtype for v in (inputs[0], inputs[1]) if v is not None and v.dtype is not None), None)
    if dtype is not None:
        site.dtype = dtype.numpy().name
    set_scale(site, node, zero_is_default=True)
    fill = attrs["mask_filter_value"].as_float() if "mask_filter_value" in attrs else -10000.0
    if fill > MASKED_BELOW and (any(t.batch_first for t in masks) or onnx_site.causal_by_attribute):
        return refused(
            onnx_site,
            f"{node.op_type} masks with mask_filter_value={fill:g}, which leaves masked keys a weight: a bias, not a mask",
        )
    return onnx_site


def _contrib_cache(node: ir.Node) -> KvCache | None:
    """The cache a contrib operator appends to inside itself: past key and value inputs (one
    packed ``past`` [2, batch, heads, past, head_dim] for Attention), present outputs 1 and 2
    (one packed ``present`` for Attention)."""
    slots = FUSED_PAST_SLOTS[("com.microsoft", node.op_type)]
    if not any(_has_input(node, i) for i in slots):
        return None
    (key, value), (present_key, present_value) = (slots * 2, (1, 1)) if len(slots) == 1 else (slots, (1, 2))

    def name(i: int) -> str:
        return node.inputs[i].name if _has_input(node, i) else ""

    def returned(i: int) -> str | None:
        out = node.outputs[i] if i < len(node.outputs) else None
        return out.name if out is not None and out.is_graph_output() else None

    heads = node.attributes.get("kv_num_heads") or node.attributes.get("num_heads")
    return KvCache(
        name(key), name(value), returned(present_key), returned(present_value), heads.as_int() if heads else None
    )


def _contrib_lengths(packing: PackedHeads) -> tuple[int | None, int | None]:
    """(queries, keys) when the shapes say them."""
    if packing.projection is not None:  # Attention: self-attention over its input
        n = static_dims(packing.projection[0], 1)[0]
        return n, n
    q, k = packing.sources[:2]
    return static_dims(q.value, 1)[0], static_dims(k.value, 2 if k.layout is HeadLayout.HEADS else 1)[0]


# Where a fused decoder attention's cache lives, the splice would have to unpack the operator
# around a recurrence (packed heads, the cache appended inside): it does not, and says so with
# what the user can do instead.
FUSED_DECODER_ADVICE = (
    "attnrewrite rewrites it neither in parallel nor with --recurrent; rewrite the decoder as exported, before "
    "onnxruntime's fusion (--recurrent takes KV caches appended by Concat, opset-23 Attention or GroupQueryAttention)"
)


def fused_cache_inside(op: str, inputs: list[str]) -> str:
    """Why a contrib operator that appends to its own KV cache is left alone."""
    return f"{CONTRIB_DOMAIN}.{op} keeps its KV cache inside the operator ({', '.join(inputs)}): {FUSED_DECODER_ADVICE}"


def fused_cache_before(op: str, past: str) -> str:
    """Why a contrib operator whose keys are a Concat(past, new) made outside it is left alone."""
    return (
        f"{CONTRIB_DOMAIN}.{op} attends over the KV cache {past!r} (a Concat of past and new keys before it) "
        f"with q, k and v packed: {FUSED_DECODER_ADVICE}"
    )


# the inputs through which each contrib operator holds a cache
_CACHE_INPUTS = {"Attention": (4, 6), "MultiHeadAttention": (6, 7, 8, 9)}


def _check_no_cache_inside(node: ir.Node) -> None:
    names = [_input_name(node, i) for i in _CACHE_INPUTS[node.op_type] if _has_input(node, i)]
    if names:
        raise Unsupported(fused_cache_inside(node.op_type, names))


def _check_no_cache_before(onnx_site: OnnxSite, packing: PackedHeads) -> None:
    """MultiHeadAttention given past and new keys and values as inputs (onnxscript's fusion of
    scaled_dot_product_attention over Concat(past, new)): a KV-cache site, listed as one."""
    keys, values = (source.value for source in packing.sources[1:])
    if keys is None or values is None:  # Attention projects its keys from its input
        return
    key, value = caches_of(keys, values)
    if key is not None:
        set_caches(onnx_site, key, value)
        raise Unsupported(fused_cache_before(onnx_site.nodes[0].op_type, key.past.name))


def _check_contrib_limits(node: ir.Node) -> None:
    op, attrs = node.op_type, node.attributes
    used = [
        f"output {i}"
        for i, out in enumerate(node.outputs)
        if i > 0 and out is not None and (out.uses() or out.is_graph_output())
    ]
    if used:
        raise Unsupported(f"{op}'s present key/value or qk outputs are used ({', '.join(used)})")
    if "do_rotary" in attrs and attrs["do_rotary"].as_int():
        raise Unsupported(f"{op} applies rotary embeddings inside the operator (do_rotary=1)")
    if "num_heads" not in attrs or attrs["num_heads"].as_int() <= 0:
        raise Unsupported(f"{op} without a positive num_heads")


_CONTRIB_INPUT_NAMES = {
    "Attention": ("input", "weights", "bias", "mask_index", "past", "attention_bias", "past_sequence_length"),
    "MultiHeadAttention": (
        "query",
        "key",
        "value",
        "bias",
        "key_padding_mask",
        "attention_bias",
        "past_key",
        "past_value",
        "past_sequence_length",
        "cache_indirection",
    ),
}


def _input_name(node: ir.Node, i: int) -> str:
    return _CONTRIB_INPUT_NAMES[node.op_type][i]


def _has_input(node: ir.Node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i] is not None


def _attention_packing(node: ir.Node, inputs: list) -> tuple[PackedHeads, list[MaskTerm]]:
    """Attention: q | k | v = input @ weights (+ bias), split by qkv_hidden_sizes."""
    x, weights, bias, mask_index, _, attention_bias = inputs[:6]
    heads = node.attributes["num_heads"].as_int()
    total = static_dims(weights, -1)[0] if rank_of(weights) == 2 else None
    if total is None:
        raise Unsupported("Attention weights of unknown shape: q, k and v cannot be split from them")
    attr = node.attributes.get("qkv_hidden_sizes")
    sizes = tuple(attr.as_ints()) if attr is not None else (total // 3,) * 3
    if len(sizes) != 3 or sum(sizes) != total or sizes[0] != sizes[1]:
        raise Unsupported(
            f"Attention's hidden sizes {list(sizes)} do not split weights of {total} columns into q, k, v"
        )
    _check_divisible(sizes, heads)
    sources = (HeadSource(None), HeadSource(None), HeadSource(None))
    packing = PackedHeads(heads, sources, sizes, projection=(x, weights), bias=bias)
    return packing, _contrib_masks(mask_index, attention_bias, x)


def _multi_head_packing(node: ir.Node, inputs: list) -> tuple[PackedHeads, list[MaskTerm]]:
    """MultiHeadAttention: q, k, v separate ([batch, seq, hidden]; k and v may be split into
    heads already), k and v packed ([batch, seq, heads, 2, head_dim]) or all three packed."""
    query, key, value, bias, key_padding_mask, attention_bias = inputs[:6]
    heads = node.attributes["num_heads"].as_int()
    if key is None:
        if value is not None or rank_of(query) not in (5, None):
            raise Unsupported(
                "MultiHeadAttention without a key input needs packed qkv [batch, seq, heads, 3, head_dim]"
            )
        sources = tuple(HeadSource(query, HeadLayout.PACKED, i) for i in range(3))
        size = _packed_hidden(query, heads)
        sizes = (size, size, size)
    elif value is None:
        if rank_of(key) not in (5, None):
            raise Unsupported(
                "MultiHeadAttention without a value input needs packed kv [batch, seq, heads, 2, head_dim]"
            )
        sources = (HeadSource(query), HeadSource(key, HeadLayout.PACKED, 0), HeadSource(key, HeadLayout.PACKED, 1))
        size = _packed_hidden(key, heads)
        sizes = (_hidden_features(query) or size, size, size)
    else:
        k_layout, v_layout = _key_value_layout(key), _key_value_layout(value)
        if bias is not None and HeadLayout.HEADS in (k_layout, v_layout):
            raise Unsupported("MultiHeadAttention with a bias and key/value already split into heads is not supported")
        sources = (HeadSource(query), HeadSource(key, k_layout), HeadSource(value, v_layout))
        sizes = (_hidden_features(query), *(_hidden_features(x, heads) for x in (key, value)))
    if bias is not None and None in sizes:
        raise Unsupported(
            "MultiHeadAttention with a bias and q, k, v of unknown hidden sizes: the bias cannot be split"
        )
    _check_divisible(sizes, heads)
    return PackedHeads(heads, sources, sizes, bias=bias), _contrib_masks(key_padding_mask, attention_bias, query)


def _key_value_layout(value: ir.Value) -> HeadLayout:
    rank = rank_of(value)
    if rank == 4:
        return HeadLayout.HEADS
    if rank == 3 or projected_features(value) is not None:
        return HeadLayout.FEATURES  # a projection's output: heads still packed into features
    raise Unsupported(
        f"cannot tell whether {value.name!r} is [batch, seq, hidden] or [batch, heads, seq, head_dim] (unknown rank)"
    )


def _contrib_masks(mask: ir.Value | None, attention_bias: ir.Value | None, batch_of: ir.Value) -> list[MaskTerm]:
    terms = []
    if mask is not None:
        _check_index_declaration(mask, batch_of)
        terms.append(MaskTerm(mask, MaskEncoding.KEEP_WHERE_POSITIVE, batch_first=True))
    if attention_bias is not None:  # [batch or 1, heads or 1, queries, keys]: a mask if its values say so
        terms.append(MaskTerm(attention_bias, MaskEncoding.ADDITIVE))
    return terms


def _check_index_declaration(mask: ir.Value, batch_of: ir.Value) -> None:
    """A 1-D mask index is key lengths [batch] or end and start positions [2 * batch]; the
    probe tells them apart by its size. A graph input is probed with generated values of its
    declared size, so that size must say which it is."""
    if not mask.is_graph_input() or rank_of(mask) != 1 or batch_of.shape is None or rank_of(batch_of) is None:
        return
    size, batch = mask.shape[0], batch_of.shape[0]
    same_symbol = str(size) == str(batch) and str(size) not in ("None", "")
    if not same_symbol and not (isinstance(size, int) and isinstance(batch, int)):
        raise Unsupported(
            f"the 1-D mask index {mask.name!r} is declared [{size}] for a batch of {batch}: "
            "cannot tell key lengths [batch] from end and start positions [2 * batch]"
        )


def _check_divisible(sizes, heads: int) -> None:
    for name, size in zip("qkv", sizes):
        if size is not None and size % heads:
            raise Unsupported(f"{name} hidden size {size} is not a multiple of num_heads={heads}")


def _packed_hidden(packed: ir.Value, heads: int) -> int | None:
    head_dim = static_dims(packed, -1)[0]
    return heads * head_dim if head_dim is not None else None


def _hidden_features(value: ir.Value, heads: int | None = None) -> int | None:
    """heads * head_dim of a [batch, seq, hidden] or (given heads) [batch, heads, seq, head_dim] input."""
    if rank_of(value) == 4:
        head_dim = static_dims(value, -1)[0]
        return heads * head_dim if heads and head_dim is not None else None
    return projected_features(value)
