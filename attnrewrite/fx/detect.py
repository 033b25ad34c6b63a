"""Finding attention in a GraphModule and reducing each match to an AttentionSite.

Three anchors:

- a softmax (any spelling), walked back through scale, mask and cast nodes to the logits
  matmul q @ k^T, and forward through casts, dropout and NaN guards to the matmul with v;
- a call of scaled_dot_product_attention (torch-level or aten);
- a call of nn.MultiheadAttention, directly or inside a torch.nn leaf module such as
  nn.TransformerEncoderLayer (symbolic_trace does not enter those).

Every match becomes an ``FxMatch``: the site, plus what the rewrite needs (the q/k/v nodes and
the node to replace, or the module to swap). What is not fully understood raises
``site.Unsupported`` where it is found; each matcher catches it once and the match carries the
reason as ``site.skip_reason``: it is reported and never rewritten.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from attnrewrite.fx import evaluate, masks, ops
from attnrewrite.fx.facts import GraphFacts
from attnrewrite.fx.modules import LinearizedMultiheadAttention
from attnrewrite.site import (
    MASKED_BELOW,
    UPSTREAM_WALK_DEPTH,
    AttentionSite,
    MaskEncoding,
    MaskKind,
    MaskTerm,
    Unsupported,
)


@dataclasses.dataclass(kw_only=True)
class FxMatch:
    site: AttentionSite
    # graph sites (softmax chains, SDPA calls): the output node is replaced by a module call
    q: Node | None = None
    k: Node | None = None  # [..., Nk, Dh]
    k_transposed: Node | None = None  # [..., Dh, Nk], when k itself is not in the graph
    v: Node | None = None
    output: Node | None = None
    key_padding: list[MaskTerm] = dataclasses.field(default_factory=list)
    # softmax .. output: erased once unused even where torch calls them impure (dropout, SDPA)
    probability_path: list[Node] = dataclasses.field(default_factory=list)
    # module sites: the nn.MultiheadAttention at attention_path is swapped, the graph unchanged
    attention_path: str | None = None
    container: Node | None = None  # the torch.nn leaf module call holding it, if any


# --- entry point --------------------------------------------------------------------------------


def find_matches(facts: GraphFacts) -> list[FxMatch]:
    matches: list[FxMatch] = []
    layer = 0  # attention sites in graph order, counting those an earlier run replaced, as in ONNX
    for node in list(facts.gm.graph.nodes):
        if node not in facts.live:
            continue
        found: list[FxMatch] = []
        if ops.softmax_call(node, facts.module_of) is not None:
            match = match_softmax(facts, node)
            found = [match] if match is not None else []
        elif _is_sdpa(node):
            found = [match_sdpa(facts, node)]
        elif node.op == "call_module":
            layer += _sites_replaced_earlier(facts, node)
            found = match_module_call(facts, node)
        for match in found:
            match.site.layer, layer = layer, layer + 1
        matches.extend(found)
    _refuse_shared_modules(matches)
    _make_names_unique(matches)
    return matches


# --- sites --------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def _sites_replaced_earlier(facts: GraphFacts, node: Node) -> int:
    """How many sites an earlier run replaced at this module call (so that layer numbers, and
    --layers, stay the same when a model is rewritten in steps): a pass module spliced into the
    graph is one; a Linearized* module swapped in holds one per attention module in it."""
    module = facts.module_of(node)
    owner = type(module).__module__
    if owner.startswith("attnrewrite.passes."):
        return 1
    if not owner.startswith("attnrewrite."):
        return 0
    return sum(isinstance(m, (LinearizedMultiheadAttention, nn.MultiheadAttention)) for m in module.modules())


def _new_site(facts: GraphFacts, anchor: Node, form: str, path: str | None = None) -> AttentionSite:
    path = path or facts.module_path(anchor)
    return AttentionSite(
        name=path or anchor.name,
        dtype=_dtype_name(facts.default_dtype),
        provenance={"form": form, "module": path, "nodes": {"anchor": anchor.name}},
    )


def _refused(match: FxMatch, reason: Unsupported) -> FxMatch:
    match.site.skip_reason = str(reason)
    return match


def _heads_of_split_layout(facts: GraphFacts, q: Node) -> int | None:
    """Heads, when q is [batch, heads, seq, head_dim] by the usual head split: [batch, seq, heads,
    head_dim] with axes 1 and 2 swapped (possibly scaled or cast after). Any other producer could
    put batch elsewhere, so heads stay unknown (as in the ONNX frontend)."""
    node = q
    while True:
        if (scaled := _scaled(facts, node)) is not None:
            node = scaled[0]
        elif (x := ops.cast_input(node)) is not None:
            node = x
        else:
            break
    split = ops.head_split_input(node)
    if split is None or facts.rank(q) != 4:
        return None
    heads = facts.shape(q)[1]
    if not isinstance(heads, int):
        heads = (facts.shape(split) or (None,) * 4)[2]
    return heads if isinstance(heads, int) else None


def _fill_shapes(facts: GraphFacts, site: AttentionSite, q: Node, k_shape, v: Node) -> None:
    q_shape, v_shape = facts.shape(q), facts.shape(v)
    if q_shape is not None:
        site.rank = len(q_shape)
        site.head_dim = q_shape[-1]
        site.query_length = q_shape[-2] if len(q_shape) >= 2 and isinstance(q_shape[-2], int) else None
        site.num_heads = _heads_of_split_layout(facts, q)
    if v_shape is not None:
        site.value_dim = v_shape[-1]
    site.dtype = _dtype_name(facts.dtype(q) or facts.default_dtype)
    site.provenance["shapes"] = {"q": q_shape, "k": k_shape, "v": v_shape}


def _apply_masks(facts: GraphFacts, match: FxMatch, terms: list[MaskTerm], causal: bool = False) -> None:
    """Classify every mask of a site and set site.mask; key-padding masks feed key_keep."""
    site = match.site
    site.provenance["masks"] = [f"{t.encoding.value} {t.value.name}" for t in terms]
    key_padding = False
    details = []
    for term in terms:
        try:
            verdict = masks.classify(facts, term)
        except Unsupported as reason:
            details.append(str(reason))
            continue
        causal |= verdict.causal
        if verdict.key_padding:
            key_padding = True
            match.key_padding.append(term)
    if details:  # no method can express it: refused here, as the ONNX frontend does
        site.mask = MaskKind.BIAS
        raise Unsupported("; ".join(details))
    if causal and key_padding:
        site.mask = MaskKind.CAUSAL_KEY_PADDING
    elif causal:
        site.mask = MaskKind.CAUSAL
    elif key_padding:
        site.mask = MaskKind.KEY_PADDING


def _check_causal_lengths(match: FxMatch, q_shape, k_shape) -> None:
    """Causal linear attention runs prefix sums over one axis: queries and keys must align."""
    if not match.site.mask.causal or q_shape is None or k_shape is None:
        return
    nq, nk = q_shape[-2], k_shape[-2]
    if isinstance(nq, int) and isinstance(nk, int) and nq != nk:
        raise Unsupported(f"causal attention with {nq} queries and {nk} keys (a cache) is not supported")


# --- softmax chains -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Logits:
    product: Node  # the node holding q @ k^T
    left: Node
    right: Node
    scale: float
    masks: list[MaskTerm]


def _scaled(facts: GraphFacts, node: Node) -> tuple[Node, float] | None:
    """(x, c) when node is x * c, c * x or x / c with c a static number."""
    operands = ops.scaled_operands(node)
    if operands is None:
        return None
    kind, a, b = operands
    candidates = [(a, b), (b, a)] if kind == "mul" else [(a, b)]
    for tensor, factor in candidates:
        if not isinstance(tensor, Node) or facts.is_scalar(tensor):
            continue
        value = facts.scalar(factor)
        if value is None or value == 0:
            continue
        return tensor, (value if kind == "mul" else 1.0 / value)
    return None


def _scaled_at_run_time(facts: GraphFacts, node: Node) -> bool:
    """node = x * s or x / s with s one number known only at run time (a learned temperature):
    taking the scaled tensor as q or k would change what methods that read q, k or the scale do."""
    operands = ops.scaled_operands(node)
    if operands is None:
        return False
    kind, a, b = operands
    for operand in (a, b) if kind == "mul" else (b,):  # a factor, or the divisor
        if not isinstance(operand, Node):
            continue
        if facts.shape(operand) == () or facts.is_scalar(operand):
            return True
        if operand.op == "get_attr":
            value = evaluate.fetch_attr(facts.gm, operand.target)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return True
    return False


def _strip_scales(facts: GraphFacts, node: Node) -> tuple[Node, float]:
    scale = 1.0
    while (scaled := _scaled(facts, node)) is not None:
        node, factor = scaled
        scale *= factor
    return node, scale


def _undo_batch_flatten(facts: GraphFacts, node: Any) -> Node | None:
    """x from view(expand(x)) / view(clone(expand(x))) that only merge x's batch axes."""
    if not isinstance(node, Node) or not ops.is_view(node):
        return None
    x = node.args[0]
    if ops.is_copy(x):
        x = x.args[0]
    if ops.is_expand(x):
        if facts.shape(x.args[0]) != facts.shape(x):
            return None  # a real broadcast, not a reshape
        x = x.args[0]
    x_shape, flat_shape = facts.shape(x), facts.shape(node)
    if x_shape is None or flat_shape is None or len(flat_shape) != 3 or x_shape[-2:] != flat_shape[-2:]:
        return None
    return x


def _decomposed_matmul(facts: GraphFacts, node: Node) -> tuple[Node, Node] | None:
    """(a, b) when node is view(bmm(view(expand(a)), view(expand(b)))): a matmul after
    run_decompositions."""
    if not ops.is_view(node) or not isinstance(node.args[0], Node) or not ops.is_bmm(node.args[0]):
        return None
    bmm = node.args[0]
    a, b = (_undo_batch_flatten(facts, x) for x in bmm.args[:2])
    if a is None or b is None or len(facts.users(bmm)) != 1:
        return None
    sa, sb, out = facts.shape(a), facts.shape(b), facts.shape(node)
    if out is None or out[:-2] != sa[:-2] or out[:-2] != sb[:-2] or out[-2:] != (sa[-2], sb[-1]):
        return None
    return a, b


def _matmul(facts: GraphFacts, node: Node) -> tuple[Node, Node] | None:
    return ops.matmul_operands(node) or _decomposed_matmul(facts, node)


def _reaches_matmul(facts: GraphFacts, node: Any) -> bool:
    """Whether a product of two tensors lies upstream of node, UPSTREAM_WALK_DEPTH nodes deep at most."""
    frontier = [node] if isinstance(node, Node) else []
    for _ in range(UPSTREAM_WALK_DEPTH):
        following = []
        for n in frontier:
            if _matmul(facts, n) or ops.baddbmm_operands(n):
                return True
            following.extend(n.all_input_nodes)
        frontier = following
    return False


def _is_drop_value(facts: GraphFacts, value: Any) -> bool:
    number = facts.scalar(value)
    return number is not None and number <= MASKED_BELOW


def _walk_logits(facts: GraphFacts, node: Node) -> _Logits | None:
    """From the softmax input back to q @ k^T. None: this softmax is not attention; Unsupported:
    attention whose logits are not understood."""
    scale, uses = 1.0, []
    while True:
        operands = _matmul(facts, node)
        if operands:
            return _Logits(node, *operands, scale, uses)
        if (baddbmm := ops.baddbmm_operands(node)) is not None:
            bias, a, b = baddbmm
            return _Logits(node, a, b, scale, [*uses, MaskTerm(bias, MaskEncoding.ADDITIVE)])
        if (x := ops.cast_input(node)) is not None:
            node = x
            continue
        if (scaled := _scaled(facts, node)) is not None:
            node, factor = scaled
            scale *= factor
            continue
        step = _mask_step(facts, node)
        if isinstance(step, tuple):
            node, use = step
            uses.append(use)
            continue
        if _reaches_matmul(facts, node):
            raise Unsupported(f"the logits pass through {ops.describe(node)}, which is not a scale, mask or cast")
        return None


def _mask_step(facts: GraphFacts, node: Node) -> tuple[Node, MaskTerm] | None:
    """(logits before the mask, the mask) when node applies a mask to logits."""
    if (add := ops.add_operands(node)) is not None:
        for logits, mask in (add, add[::-1]):
            if isinstance(logits, Node) and isinstance(mask, Node) and _reaches_matmul(facts, logits):
                return logits, MaskTerm(mask, MaskEncoding.ADDITIVE)
        return None
    if (fill := ops.masked_fill_operands(node)) is not None:
        x, condition, value = fill
        if isinstance(condition, Node) and _is_drop_value(facts, value):
            return x, MaskTerm(condition, MaskEncoding.KEEP_WHERE_FALSE)
        return None
    if (where := ops.where_operands(node)) is not None:
        condition, if_true, if_false = where
        if not isinstance(condition, Node):
            return None
        if isinstance(if_true, Node) and _is_drop_value(facts, if_false):
            return if_true, MaskTerm(condition, MaskEncoding.KEEP_WHERE_TRUE)
        if isinstance(if_false, Node) and _is_drop_value(facts, if_true):
            return if_false, MaskTerm(condition, MaskEncoding.KEEP_WHERE_FALSE)
    return None


_ZERO_LIKE = ops.aten_overloads("zeros_like.default", "full_like.default", "new_zeros.default") | {
    torch.zeros_like,
    torch.full_like,
}


def _is_zero(facts: GraphFacts, value: Any) -> bool:
    if facts.scalar(value) == 0:
        return True
    if isinstance(value, Node) and value.op in ("call_function", "call_method"):
        if value.target in _ZERO_LIKE or value.target in ("new_zeros", "zero_"):
            fill = value.args[1] if value.target in (torch.full_like, ops.aten.full_like.default) else 0
            return facts.scalar(fill) == 0
    return False


def _reads_only(node: Node, allowed: set[Node]) -> bool:
    """Whether node is computed from the allowed nodes and constants alone."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n in allowed:
            continue
        seen.add(n)
        if n.op in ("placeholder", "call_module"):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _guarded_input(facts: GraphFacts, node: Node, logits: Node) -> Node | None:
    """p when node zeroes rows of p that are NaN because every key was masked:
    where(all_masked(logits), 0, p) (export's _safe_softmax), p.masked_fill(isnan(p), 0),
    nan_to_num(p)."""
    if (x := ops.nan_to_num_input(node)) is not None:
        return x
    if (where := ops.where_operands(node)) is not None:
        condition, zero, p = where
    elif (fill := ops.masked_fill_operands(node)) is not None:
        p, condition, zero = fill
    else:
        return None
    if isinstance(p, Node) and isinstance(condition, Node) and _is_zero(facts, zero):
        if _reads_only(condition, {logits, p}):
            return p
    return None


def _decomposed_matmul_from_left(facts: GraphFacts, probs: Node) -> tuple[Node, Node] | None:
    """(v, output) when probs is the left operand of a decomposed matmul."""
    node = probs
    while True:
        users = facts.users(node)
        if len(users) != 1:
            return None
        user = users[0]
        if ops.is_bmm(user):
            if len(facts.users(user)) != 1:
                return None
            output = facts.users(user)[0]
            operands = _decomposed_matmul(facts, output)
            if operands and operands[0] is probs:
                return operands[1], output
            return None
        if not (ops.is_expand(user) or ops.is_copy(user) or ops.is_view(user)):
            return None
        node = user


def _walk_probabilities(facts: GraphFacts, softmax: Node, logits: Node, path: list[Node]) -> tuple[Node, Node, float]:
    """From the softmax forward to probs @ v: (v, the product node, attention dropout p);
    the nodes in between are appended to path. Unsupported where the probabilities go elsewhere."""
    node, dropout = softmax, 0.0
    while True:
        path.append(node)
        decomposed = _decomposed_matmul_from_left(facts, node)
        if decomposed:
            return (*decomposed, dropout)
        users = facts.users(node)
        if len(users) != 1:
            raise Unsupported(
                f"the attention probabilities have {len(users)} consumers: they are used outside "
                "the product with the values (e.g. returned as attention weights)"
                if users
                else "the attention probabilities are unused"
            )
        user = users[0]
        if (operands := ops.matmul_operands(user)) is not None:
            if operands[0] is node and operands[1] is not node:
                return operands[1], user, dropout
            raise Unsupported(f"the attention probabilities are not the left operand of {ops.describe(user)}")
        call = ops.dropout_call(user, facts.module_of)
        if call is not None and call.input is node:
            dropout = call.p if call.p is not None else dropout
            node = user
        elif ops.cast_input(user) is node or _guarded_input(facts, user, logits) is node:
            node = user
        else:
            raise Unsupported(f"the attention probabilities feed {ops.describe(user)}, not a product with the values")


def _swap_last_two(shape):
    return None if shape is None or len(shape) < 2 else (*shape[:-2], shape[-1], shape[-2])


def match_softmax(facts: GraphFacts, node: Node) -> FxMatch | None:
    call = ops.softmax_call(node, facts.module_of)
    match = FxMatch(site=_new_site(facts, node, "softmax"))
    match.site.provenance["nodes"]["softmax"] = node.name
    try:
        logits = _walk_logits(facts, call.input)
        if logits is None:
            return None  # a softmax that is not attention (a classifier head, a gate)
        _describe_softmax(facts, match, node, call, logits)
    except Unsupported as reason:
        return _refused(match, reason)
    return match


def _describe_softmax(facts: GraphFacts, match: FxMatch, node: Node, call: ops.SoftmaxCall, logits: _Logits) -> None:
    """The site of a softmax whose logits are q @ k^T: q, k, v, its scale, shapes and masks."""
    site = match.site
    site.provenance["nodes"]["logits"] = logits.product.name

    # scales directly on q and on k^T fold into site.scale (as in the ONNX frontend)
    q, q_scale = _strip_scales(facts, logits.left)
    k_side, k_scale = _strip_scales(facts, logits.right)
    for operand in (q, k_side):
        if _scaled_at_run_time(facts, operand):
            raise Unsupported(f"q or k^T is scaled by a scalar that is not a constant ({ops.describe(operand)})")
    k = ops.last_two_swapped_input(k_side, facts.rank)
    match.q, match.k = q, k
    match.k_transposed = None if k is not None else k_side
    site.scale = logits.scale * q_scale * k_scale

    k_shape = facts.shape(k) if k is not None else _swap_last_two(facts.shape(k_side))
    rank = facts.rank(call.input) or facts.rank(logits.product)
    if call.dim is None:
        raise Unsupported("softmax without an explicit dim")
    if not (call.dim == -1 or (rank is not None and call.dim == rank - 1)):
        axis = f"axis {call.dim}" + (f" of rank-{rank} logits" if rank else "")
        raise Unsupported(f"softmax over {axis}: not the key axis (the last)")

    match.v, match.output, dropout = _walk_probabilities(facts, node, call.input, match.probability_path)
    site.provenance["nodes"]["output"] = match.output.name
    if dropout:
        site.provenance["attention_dropout"] = dropout
    _fill_shapes(facts, site, q, k_shape, match.v)
    _apply_masks(facts, match, logits.masks)
    _check_causal_lengths(match, facts.shape(q), k_shape)


# --- scaled_dot_product_attention ---------------------------------------------------------------

_SDPA = frozenset({F.scaled_dot_product_attention}) | ops.aten_overloads("scaled_dot_product_attention.default")


def _is_sdpa(node: Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA


def match_sdpa(facts: GraphFacts, node: Node) -> FxMatch:
    q, k, v = node.args[:3]
    attn_mask = ops.arg(node, 3, "attn_mask")
    dropout_p = ops.arg(node, 4, "dropout_p", 0.0)
    is_causal = ops.arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale", node.args[6] if len(node.args) > 6 else None)

    site = _new_site(facts, node, "scaled_dot_product_attention")
    match = FxMatch(site=site, q=q, k=k, v=v, output=node, probability_path=[node])
    try:
        _describe_sdpa(facts, match, attn_mask, dropout_p, is_causal, scale)
    except Unsupported as reason:
        return _refused(match, reason)
    return match


def _describe_sdpa(
    facts: GraphFacts, match: FxMatch, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any
) -> None:
    site, q, k = match.site, match.q, match.k
    k_shape = facts.shape(k)
    _fill_shapes(facts, site, q, k_shape, match.v)
    if dropout_p:
        site.provenance["attention_dropout"] = dropout_p
    if not isinstance(is_causal, bool):
        raise Unsupported("is_causal is not a constant")
    if scale is None:
        # SDPA's default, 1/sqrt(q.shape[-1]): without shapes the replacement reads it from q
        site.scale = 1.0 / math.sqrt(site.head_dim) if isinstance(site.head_dim, int) else None
    else:
        site.scale = facts.scalar(scale) if facts.scalar(scale) is not None else scale
        if not isinstance(site.scale, (int, float)):
            raise Unsupported("the scale is not a constant")
    q_shape = facts.shape(q)
    # grouped or multi-query heads (enable_gqa, or one key/value head broadcast): the splice
    # gives the replacement one key/value head per query head (passes.layout.expand_to_query_heads)
    if is_causal and attn_mask is not None:
        raise Unsupported("both attn_mask and is_causal are set")
    terms = [MaskTerm(attn_mask, MaskEncoding.SDPA)] if isinstance(attn_mask, Node) else []
    _apply_masks(facts, match, terms, causal=is_causal)
    _check_causal_lengths(match, q_shape, k_shape)


# --- nn.MultiheadAttention and the torch.nn modules that hold it -------------------------------

# torch.nn leaf modules whose calling convention the rewrite knows (modules.slow_path_container
# has their replacements): type -> the name of their attn_mask argument
_CONTAINERS: dict[type, str] = {
    nn.TransformerEncoderLayer: "src_mask",
    nn.TransformerEncoder: "mask",
}


def _bind(module: nn.Module, node: Node) -> dict[str, Any]:
    bound = inspect.signature(module.forward).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _mha_site(facts: GraphFacts, anchor: Node, path: str, mha: nn.MultiheadAttention) -> AttentionSite:
    site = _new_site(facts, anchor, "nn.MultiheadAttention", path=path)
    site.name = path
    site.rank, site.num_heads = 4, mha.num_heads
    site.head_dim = site.value_dim = mha.head_dim
    site.scale = 1.0 / math.sqrt(mha.head_dim)
    weight = mha.in_proj_weight if mha.in_proj_weight is not None else mha.q_proj_weight
    site.dtype = _dtype_name(weight.dtype)
    if mha.dropout:
        site.provenance["attention_dropout"] = mha.dropout
    return site


def _check_mha(mha: nn.MultiheadAttention) -> None:
    if mha.bias_k is not None or mha.bias_v is not None:
        raise Unsupported("nn.MultiheadAttention with bias_k/bias_v (learned extra key/value rows)")
    if mha.add_zero_attn:
        raise Unsupported("nn.MultiheadAttention with add_zero_attn")


def _mha_masks(facts: GraphFacts, match: FxMatch, attn_mask: Any, key_padding_mask: Any, is_causal: Any) -> None:
    """Mask kind from nn.MultiheadAttention's arguments: key_padding_mask is key padding by
    definition; attn_mask must be proven causal (or empty), or be hinted with is_causal=True."""
    site = match.site
    key_padding = isinstance(key_padding_mask, Node)
    site.provenance["masks"] = [
        f"{name} {value.name}"
        for name, value in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask))
        if isinstance(value, Node)
    ]
    if attn_mask is None:
        causal = False
    elif is_causal is True:
        causal = True
    elif isinstance(attn_mask, Node):
        causal = _attn_mask_is_causal(facts, site, attn_mask)
    else:
        raise Unsupported("attn_mask is not a tensor in the graph")
    site.mask = {
        (False, False): MaskKind.NONE,
        (True, False): MaskKind.CAUSAL,
        (False, True): MaskKind.KEY_PADDING,
        (True, True): MaskKind.CAUSAL_KEY_PADDING,
    }[(causal, key_padding)]
    if attn_mask is None and is_causal is True:
        raise Unsupported("is_causal=True without attn_mask (torch rejects it)")


def _attn_mask_is_causal(facts: GraphFacts, site: AttentionSite, attn_mask: Node) -> bool:
    """Whether nn.MultiheadAttention's attn_mask is a causal triangle (else it masks nothing);
    Unsupported, the site's mask a bias, when it is neither."""
    try:
        verdict = masks.classify(facts, MaskTerm(attn_mask, MaskEncoding.MHA))
    except Unsupported as reason:
        detail = str(reason)
    else:
        if not verdict.key_padding:
            return verdict.causal
        detail = "an attn_mask built from inputs (pass key_padding_mask instead)"
    site.mask = MaskKind.BIAS
    raise Unsupported(f"{detail}; pass is_causal=True if it is a causal mask")


def _mha_call(facts: GraphFacts, node: Node, mha: nn.MultiheadAttention) -> FxMatch:
    args = _bind(mha, node)
    match = FxMatch(site=_mha_site(facts, node, node.target, mha), attention_path=node.target)
    try:
        for user in facts.users(node):
            is_output = user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0
            weights_unused = user.op == "call_function" and user.target is operator.getitem and not facts.users(user)
            if not (is_output or weights_unused):
                raise Unsupported("the attention weights of nn.MultiheadAttention are used")
        _check_mha(mha)
        _mha_masks(facts, match, args["attn_mask"], args["key_padding_mask"], args["is_causal"])
        if match.site.mask.causal and args["query"] is not args["key"]:
            raise Unsupported("a causal mask on cross-attention (query is not key)")
    except Unsupported as reason:
        return _refused(match, reason)
    return match


def _contained_calls(facts: GraphFacts, node: Node, container: nn.Module) -> list[FxMatch]:
    inner = [(path, m) for path, m in container.named_modules() if isinstance(m, nn.MultiheadAttention)]
    matches = []
    for path, mha in inner:
        full_path = f"{node.target}.{path}"
        match = FxMatch(site=_mha_site(facts, node, full_path, mha), attention_path=full_path, container=node)
        matches.append(match)
        try:
            mask_name = _CONTAINERS.get(type(container))
            if mask_name is None:
                raise Unsupported(
                    f"inside {type(container).__name__}, whose calling convention the rewrite does not know"
                )
            _check_mha(mha)
            args = _bind(container, node)
            _mha_masks(facts, match, args[mask_name], args["src_key_padding_mask"], args["is_causal"])
        except Unsupported as reason:
            _refused(match, reason)
    return matches


def match_module_call(facts: GraphFacts, node: Node) -> list[FxMatch]:
    module = facts.module_of(node)
    if isinstance(module, nn.MultiheadAttention):
        return [_mha_call(facts, node, module)]
    if module is not None and type(module).__module__.startswith("torch.nn"):
        return _contained_calls(facts, node, module)
    return []


# --- consistency across matches ----------------------------------------------------------------


def _refuse_shared_modules(matches: list[FxMatch]) -> None:
    """A module swap changes every call of it: refuse when one module is called from several places."""
    calls: dict[str, list[FxMatch]] = {}
    for match in matches:
        if match.attention_path is not None:
            calls.setdefault(match.attention_path, []).append(match)
    for path, group in calls.items():
        if len(group) > 1:
            for match in group:
                if match.site.skip_reason is None:
                    match.site.skip_reason = f"{path} is called from {len(group)} places"


def _make_names_unique(matches: list[FxMatch]) -> None:
    counts: dict[str, int] = {}
    for match in matches:
        counts[match.site.name] = counts.get(match.site.name, 0) + 1
    for match in matches:
        if counts[match.site.name] > 1:
            match.site.name = f"{match.site.name}:{match.site.provenance['nodes']['anchor']}"
