"""Softmax-anchored attention: detection anchors at Softmax, walks back through scale / mask /
Cast nodes to the logits MatMul (q @ k^T), and forward through NaN guards, Cast and Dropout to
the MatMul with V."""

from __future__ import annotations

import onnx_ir as ir

from attnrewrite.onnx.constants import constant_scalar
from attnrewrite.onnx.detect.common import OnnxSite, describe_shapes, is_constant, rank_of, refused, static_dims
from attnrewrite.onnx.detect.kv_cache import caches_of, set_caches
from attnrewrite.site import (
    MASKED_BELOW,
    PROBABILITY_PATH_LENGTH,
    SCORE_PATH_LENGTH,
    UPSTREAM_WALK_DEPTH,
    AttentionSite,
    MaskEncoding,
    MaskTerm,
    Unsupported,
)

# --- Softmax-anchored attention -----------------------------------------------------------------


def match_softmax(softmax: ir.Node, index: int) -> OnnxSite:
    site = AttentionSite(name=softmax.name or f"Softmax_{index}", layer=index)
    logits = softmax.inputs[0]
    try:
        _check_softmax_axis(softmax)
        walk = _LogitsWalk()
        matmul = walk.back_to_matmul(logits)
        q, q_scale = _strip_scalar_scale(matmul.inputs[0], walk.nodes)
        k_t, k_scale = _strip_scalar_scale(matmul.inputs[1], walk.nodes)
        v, output, forward_nodes = _forward_to_value_matmul(softmax)
        for operand in (q, k_t, v):  # a vector operand makes a matrix-vector product (a valid graph)
            if rank_of(operand) is not None and rank_of(operand) < 2:
                raise Unsupported(
                    f"q @ k^T or p @ v has a rank-{rank_of(operand)} operand {operand.name!r}: not attention"
                )
        caches = caches_of(k_t, v)
    except Unsupported as reason:
        return refused(OnnxSite(site=site, q=None, v=None, output=softmax.outputs[0], nodes=[softmax]), str(reason))

    site.scale = walk.scale * q_scale * k_scale
    describe_shapes(site, q, v, softmax.inputs[0])
    nodes = [*walk.nodes, matmul, softmax, *forward_nodes]
    site.provenance = {"nodes": [n.name for n in nodes]}
    lengths = static_dims(softmax.inputs[0], -2, -1)
    site.query_length = lengths[0]
    onnx_site = OnnxSite(
        site=site, q=q, k_transposed=k_t, v=v, output=output, nodes=nodes, masks=walk.masks, static_lengths=lengths
    )
    set_caches(onnx_site, *caches)
    return onnx_site


def _check_softmax_axis(softmax: ir.Node) -> None:
    attr = softmax.attributes.get("axis")
    # Before opset 13 the default axis is 1 (and the input is flattened from it): the key
    # axis only for a rank-2 input.
    axis = attr.as_int() if attr is not None else -1 if _default_opset(softmax) >= 13 else 1
    rank = rank_of(softmax.inputs[0])
    if axis == -1 or (rank is not None and axis == rank - 1):
        return
    where = f"axis {axis}" + ("" if rank is None else f" of a rank-{rank} tensor")
    raise Unsupported(f"softmax over {where}, not the key axis (the last)")


def _default_opset(node: ir.Node) -> int:
    if node.version is not None:
        return node.version
    imports = node.graph.opset_imports if node.graph is not None else {}
    return imports.get("", imports.get("ai.onnx", 13))


class _LogitsWalk:
    """Walks from the softmax input back to the q @ k^T MatMul, folding scales, collecting masks."""

    def __init__(self):
        self.scale = 1.0
        self.masks: list[MaskTerm] = []
        self.nodes: list[ir.Node] = []

    def back_to_matmul(self, value: ir.Value) -> ir.Node:
        for _ in range(SCORE_PATH_LENGTH):
            node = value.producer()
            if node is None:
                raise Unsupported("the softmax input is not computed from a MatMul of q and k")
            if node.domain not in ("", "ai.onnx"):
                raise Unsupported(f"unexpected {node.domain}.{node.op_type} between q @ k^T and softmax")
            if node.op_type == "MatMul":
                return node
            self.nodes.append(node)
            value = self._step(node)
        raise Unsupported("too many nodes between q @ k^T and softmax")

    def _step(self, node: ir.Node) -> ir.Value:
        op = node.op_type
        if op in ("Cast", "Identity"):
            return node.inputs[0]
        if op in ("Mul", "Div"):
            for i, other in ((0, 1), (1, 0)):
                c = constant_scalar(node.inputs[other])
                if c is not None and not (op == "Div" and other == 0):
                    self.scale *= c if op == "Mul" else 1.0 / c
                    return node.inputs[i]
            raise Unsupported(f"logits scaled by a non-constant tensor ({node.name})")
        if op == "Add":
            return self._additive_mask(node)
        if op == "Where":
            return self._where_mask(node)
        if not _reaches_dot_product(node):
            raise Unsupported(
                "the attention scores are not a dot product q @ k^T (additive attention?): "
                f"no MatMul of two activations computes {op} {node.name!r}"
            )
        raise Unsupported(f"{op} node {node.name!r} between q @ k^T and softmax is not understood")

    def _additive_mask(self, node: ir.Node) -> ir.Value:
        a, b = node.inputs
        logits_side = _which_leads_to_matmul(a, b)
        if logits_side is None:
            raise Unsupported(f"cannot tell the logits from the mask in {node.name!r}")
        mask = b if logits_side is a else a
        self.masks.append(MaskTerm(mask, MaskEncoding.ADDITIVE))
        return logits_side

    def _where_mask(self, node: ir.Node) -> ir.Value:
        cond, x, y = node.inputs
        for logits, fill, encoding in (
            (x, y, MaskEncoding.KEEP_WHERE_TRUE),
            (y, x, MaskEncoding.KEEP_WHERE_FALSE),
        ):
            fill_value = constant_scalar(fill)
            if fill_value is not None and fill_value <= MASKED_BELOW:
                self.masks.append(MaskTerm(cond, encoding))
                return logits
        raise Unsupported(f"Where {node.name!r} on the logits does not fill with a masking constant")


def _reaches_dot_product(node: ir.Node) -> bool:
    """Whether some MatMul of two activations feeds `node` (UPSTREAM_WALK_DEPTH nodes deep at
    most): the scores of additive attention (v^T tanh(W q + U k)) have none."""
    frontier, seen = [node], set()
    for _ in range(UPSTREAM_WALK_DEPTH):
        following = []
        for current in frontier:
            if id(current) in seen:
                continue
            seen.add(id(current))
            operands = [v for v in current.inputs if v is not None]
            # a constant operand is a weight: a projection, not queries or keys
            if current.op_type in ("MatMul", "Einsum") and not any(is_constant(v) for v in operands):
                return True
            following.extend(v.producer() for v in operands if v.producer() is not None)
        if not following:
            return False
        frontier = following
    return True  # deeper than the walk goes: do not claim there is none


def _which_leads_to_matmul(a: ir.Value, b: ir.Value) -> ir.Value | None:
    """The operand of an Add that is the logits path (reaches a MatMul through scale/mask ops)."""
    hits = [v for v in (a, b) if _reaches_matmul(v, depth=UPSTREAM_WALK_DEPTH)]
    return hits[0] if len(hits) == 1 else None


def _reaches_matmul(value: ir.Value, depth: int) -> bool:
    node = value.producer()
    if node is None or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type in ("Cast", "Identity", "Mul", "Div", "Add", "Where"):
        data_inputs = node.inputs[1:] if node.op_type == "Where" else node.inputs
        return any(v is not None and _reaches_matmul(v, depth - 1) for v in data_inputs)
    return False


def _strip_scalar_scale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """Fold Mul/Div by scalar constants on an operand of the logits MatMul (dynamo splits
    1/sqrt(d) as sqrt on q and on k^T)."""
    scale = 1.0
    while (node := value.producer()) is not None and node.op_type in ("Mul", "Div"):
        c = constant_scalar(node.inputs[1])
        if c is not None:
            scale *= c if node.op_type == "Mul" else 1.0 / c
            nodes.append(node)
            value = node.inputs[0]
            continue
        c = constant_scalar(node.inputs[0])
        if c is not None and node.op_type == "Mul":
            scale *= c
            nodes.append(node)
            value = node.inputs[1]
            continue
        if any(_is_scalar(v) for v in node.inputs):
            # a scale computed at run time: taking the scaled tensor for q or k would silently
            # change what every method that reads q and k (or the scale) computes
            raise Unsupported(f"q or k^T is scaled by a scalar that is not a compile-time constant ({node.name!r})")
        break
    return value, scale


def _is_scalar(value: ir.Value) -> bool:
    return value.shape is not None and all(d == 1 for d in value.shape)


def _forward_to_value_matmul(softmax: ir.Node) -> tuple[ir.Value, ir.Value, list[ir.Node]]:
    """Follow the probabilities to the MatMul with V; they must not be used anywhere else."""
    probs = softmax.outputs[0]
    nodes: list[ir.Node] = []
    for _ in range(PROBABILITY_PATH_LENGTH):
        _check_not_graph_output(probs)
        users = {use.node for use in probs.uses()}
        guard = _nan_guard(probs, users)
        if guard is not None:
            nodes.extend(users)
            probs = guard.outputs[0]
            continue
        if len(users) != 1:
            names = ", ".join(sorted(f"{u.op_type} {u.name!r}" for u in users)) or "nothing"
            raise Unsupported(f"attention probabilities are used by {names}, not only by the V MatMul")
        (user,) = users
        if user.op_type == "MatMul" and user.inputs[0] is probs and user.inputs[1] is not probs:
            return user.inputs[1], user.outputs[0], [*nodes, user]
        if user.op_type in ("Cast", "Identity") or (user.op_type == "Dropout" and not _dropout_mask_used(user)):
            nodes.append(user)
            probs = user.outputs[0]
            continue
        raise Unsupported(f"attention probabilities flow into {user.op_type} {user.name!r}, not a MatMul with V")
    raise Unsupported("too many nodes between softmax and the V MatMul")


def _check_not_graph_output(probs: ir.Value) -> None:
    if probs.is_graph_output():
        raise Unsupported(f"attention probabilities are a graph output ({probs.name!r})")


def _nan_guard(probs: ir.Value, users: set[ir.Node]) -> ir.Node | None:
    """The dynamo exporter's Where(IsNaN(p), 0, p): returns the Where when `users` is exactly it."""
    if len(users) != 2:
        return None
    by_op = {u.op_type: u for u in users}
    is_nan, where = by_op.get("IsNaN"), by_op.get("Where")
    if is_nan is None or where is None:
        return None
    cond, fill, data = where.inputs
    if cond is not is_nan.outputs[0] or data is not probs or constant_scalar(fill) != 0.0:
        return None
    if len(is_nan.outputs[0].uses()) != 1:
        return None
    return where


def _dropout_mask_used(dropout: ir.Node) -> bool:
    return len(dropout.outputs) > 1 and bool(dropout.outputs[1].uses())
