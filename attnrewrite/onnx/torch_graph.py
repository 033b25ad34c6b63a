"""An ONNX graph evaluated in torch, so that a loss on its outputs reaches the replacements'
parameters (end-to-end calibration; onnxruntime gives no gradients).

Every node of the main graph runs as the torch op of the same meaning (``OPS``), in graph order,
on one device (the graph's constants are moved there once; tensors an op makes go there too);
each replacement call runs as the callable the caller gives for it (the learnable module, or the
exact attention it stands in for). Only what exported transformers use is covered: a graph with
any other op, a subgraph or an op setting not implemented here is refused up front by
``uncovered``, before any fitting.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.state_layout import STATE_NAMES
from attnrewrite.passes.layout import expand_to_query_heads


class TorchGraph:
    """``calls``: the replacement nodes (read as (q, k, v, key_keep, *constants)); whatever
    runs in their place is given to ``run``."""

    def __init__(self, graph: ir.Graph, calls: list[ir.Node], device=None):
        reason = uncovered(graph, calls)
        if reason:
            raise AttnRewriteError(f"cannot fit end to end: {reason}")
        self.graph = graph
        self.device = torch.device(device or "cpu")
        self.constants = {
            value.name: _tensor(value.const_value.numpy()).to(self.device)
            for value in graph.initializers.values()
            if value.const_value is not None
        }
        self.dequantized: set[ir.Node] = set()  # DequantizeLinear nodes whose output is a constant now
        self.nbits_weights: dict[ir.Node, torch.Tensor] = {}  # MatMulNBits -> its weight [K, N]
        self._dequantize_weights_once()
        self.spent = _spent_after(graph)
        # what is fitted on: the model's floating-point outputs, not the states a recurrent replacement returns
        self.output_names = [
            v.name
            for v in graph.outputs
            if v.dtype is not None
            and v.dtype.is_floating_point()
            and not (v.name.startswith("present.") and v.name.endswith(STATE_NAMES))
        ]

    def _dequantize_weights_once(self) -> None:
        """Quantized weights are frozen (fine-tuning's adapters go beside them), so each is
        dequantized here once: a DequantizeLinear of initializers becomes a constant, and a
        MatMulNBits keeps its weight as a float [K, N]."""
        for node in self.graph:
            inputs = [None if v is None else self.constants.get(v.name) for v in node.inputs]
            if any(v is not None and x is None for v, x in zip(node.inputs[1:], inputs[1:])):
                continue  # a weight, scale or zero point that is computed
            if node.op_type == "DequantizeLinear" and inputs[0] is not None:
                self.constants[node.outputs[0].name] = _dequantize_linear(node, *inputs)
                self.dequantized.add(node)
            elif node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
                self.nbits_weights[node] = _nbits_weight(node, *inputs[1:4])

    def _evaluate(self, node: ir.Node, inputs: list):
        if node in self.nbits_weights:
            return _with_bias(inputs[0] @ self.nbits_weights[node], *inputs[5:6])
        return _evaluation(node)(node, *inputs)

    def run(
        self, feeds: dict[str, np.ndarray], stand_ins: dict[ir.Node, object], adapters: dict | None = None
    ) -> list[torch.Tensor]:
        """The graph's floating-point outputs on ``feeds``, ``stand_ins[call](q, k, v,
        key_keep)`` computing each replacement, and ``adapters[node](x)`` added to the product of
        each projection (MatMul, MatMulNBits, or Gemm without transA) it names, scaled as the product is."""
        with self.device:  # where the ops' own tensors (shapes, ranges, constants) are made
            return self._run(feeds, stand_ins, adapters or {})

    def _run(self, feeds, stand_ins, adapters) -> list[torch.Tensor]:
        values: dict[str, torch.Tensor] = dict(self.constants)
        values.update((name, _tensor(array).to(self.device)) for name, array in feeds.items())
        for node in self.graph:
            inputs = [values[v.name] if v is not None and v.name in values else None for v in node.inputs]
            if node not in stand_ins and any(v is not None and x is None for v, x in zip(node.inputs, inputs)):
                continue  # reads a recurrent replacement's state, which a stand-in does not return
            if node in self.dequantized:
                continue
            if node in stand_ins:
                outputs = [stand_ins[node](*with_query_heads(*inputs[:4]))]
            else:
                outputs = self._evaluate(node, inputs)
                if node in adapters:
                    outputs = outputs + _attr(node, "alpha", 1.0) * adapters[node](inputs[0]).to(outputs.dtype)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            for value, tensor in zip(node.outputs, outputs):
                values[value.name] = tensor
            for name in self.spent.get(node, ()):  # kept only as long as a later node reads it
                values.pop(name, None)
        return [values[name] for name in self.output_names]


def with_query_heads(q, k, v, key_keep):
    """A replacement call's inputs as the stand-ins and the fitted parallel modules take them: k
    and v with q's heads where the call takes fewer (a recurrent window keeps each key/value head
    once: passes/recurrent.key_value_groups)."""
    q, k, v = (torch.as_tensor(x) for x in (q, k, v))
    return q, expand_to_query_heads(k, q), expand_to_query_heads(v, q), key_keep


def _spent_after(graph: ir.Graph) -> dict[ir.Node, list[str]]:
    """For each node, the values computed in the graph that no later node and no output reads."""
    last_reader: dict[str, ir.Node] = {}
    for node in graph:
        for value in node.inputs:
            if value is not None and value.producer() is not None:
                last_reader[value.name] = node
    outputs = {v.name for v in graph.outputs}
    spent: dict[ir.Node, list[str]] = {}
    for name, node in last_reader.items():
        if name not in outputs:
            spent.setdefault(node, []).append(name)
    return spent


def uncovered(graph: ir.Graph, calls: list[ir.Node]) -> str | None:
    """Why ``graph`` cannot be evaluated here (the first node that is not covered), or None."""
    called = set(calls)
    for node in graph:
        if node in called:
            continue
        if _evaluation(node) is None:
            where = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
            return f"{where}{node.op_type} (node {node.name!r}) has no torch evaluation in attnrewrite"
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return f"node {node.name!r} ({node.op_type}) has a subgraph"
        setting = _unimplemented_setting(node)
        if setting:
            return f"{node.op_type} node {node.name!r} {setting}, which attnrewrite does not evaluate in torch"
    return None


def _unimplemented_setting(node: ir.Node) -> str | None:
    """What a covered op's attributes ask for that its torch evaluation does not do."""
    if node.op_type == "ScatterND" and _attr(node, "reduction", "none") != "none":
        return "reduces"
    if node.op_type == "Conv" and _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return "pads automatically"
    if node.op_type == "MatMulNBits":
        return _unimplemented_nbits(node)
    if node.op_type == "RotaryEmbedding" and (_attr(node, "scale", 1.0) != 1.0 or _attr(node, "is_packed_batching", 0)):
        return "scales or packs its batch"
    if node.op_type == "GroupQueryAttention":
        given = [name for name, v in zip(_GQA_UNEVALUATED, node.inputs[9:]) if v is not None]
        if given:
            return f"takes {given[0]}"
    return None


# GroupQueryAttention's inputs from the tenth on, which its torch evaluation does not read
_GQA_UNEVALUATED = ("position_ids", "attention_bias", "head_sink")


def _tensor(array) -> torch.Tensor:
    array = np.array(array, copy=True)  # a copy: the graph's arrays stay read-only
    if array.dtype.name in ("int4", "uint4"):  # ml_dtypes' (a QDQ int4 weight): torch has none
        array = array.astype(np.int8 if array.dtype.name == "int4" else np.uint8)
    return torch.from_numpy(array)


def _attr(node: ir.Node, name: str, default=None):
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def _ints(tensor) -> list[int]:
    return [int(x) for x in tensor.reshape(-1).tolist()]


def _dtype(onnx_type: int) -> torch.dtype:
    return torch.from_numpy(np.empty(0, ir.DataType(onnx_type).numpy())).dtype


def _axes(node: ir.Node, given) -> list[int] | None:
    """The axes of Unsqueeze / Squeeze / Reduce*: an attribute before opset 13 / 18, else an input."""
    axes = _attr(node, "axes")
    if axes is not None:
        return list(axes)
    return None if given is None else _ints(given)


# --- the ops ---------------------------------------------------------------------------------------


def _div(node, a, b):
    if a.is_floating_point() or b.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer division truncates


def _gemm(node, a, b, c=None):
    a = a.transpose(-2, -1) if _attr(node, "transA", 0) else a
    b = b.transpose(-2, -1) if _attr(node, "transB", 0) else b
    out = _attr(node, "alpha", 1.0) * (a @ b)
    return out if c is None else out + _attr(node, "beta", 1.0) * c


def _gather(node, data, indices):
    axis = _attr(node, "axis", 0) % data.dim()
    flat = indices.reshape(-1).long() % data.shape[axis]  # negative indices count from the end
    picked = torch.index_select(data, axis, flat)
    return picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1 :]))


def _gather_nd(node, data, indices):
    batch = _attr(node, "batch_dims", 0)
    batch_shape = data.shape[:batch]
    rows = int(np.prod(batch_shape, dtype=np.int64))
    data = data.reshape(rows, *data.shape[batch:])
    indices = indices.reshape(rows, *indices.shape[batch:]).long()
    row = torch.arange(rows).reshape(rows, *[1] * (indices.dim() - 2)).expand(indices.shape[:-1])
    picked = data[(row, *indices.unbind(-1))]
    return picked.reshape(*batch_shape, *picked.shape[1:])


def _gather_elements(node, data, indices):
    axis = _attr(node, "axis", 0) % data.dim()
    return torch.gather(data, axis, indices.long() % data.shape[axis])


def _scatter_nd(node, data, indices, updates):
    out = data.clone()  # out of place: autograd flows into both data and updates
    index = indices.long().unbind(-1)
    out[tuple(i % data.shape[axis] for axis, i in enumerate(index))] = updates  # negative: from the end
    return out


def _split(node, data, split=None):
    axis = _attr(node, "axis", 0)
    sizes = _attr(node, "split")
    sizes = list(sizes) if sizes is not None else _ints(split) if split is not None else None
    if sizes is None:  # equal parts, the last one smaller if need be
        parts = len(node.outputs)
        sizes = -(-data.shape[axis] // parts)
    return tuple(torch.split(data, sizes, dim=axis))


def _conv(node, x, weight, bias=None):
    dims = weight.dim() - 2
    pads = list(_attr(node, "pads", [0] * 2 * dims))
    padding = [p for axis in reversed(range(dims)) for p in (pads[axis], pads[axis + dims])]  # last axis first
    x = torch.nn.functional.pad(x, padding) if any(padding) else x
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[dims - 1]
    return conv(
        x,
        weight,
        bias,
        stride=list(_attr(node, "strides", [1] * dims)),
        dilation=list(_attr(node, "dilations", [1] * dims)),
        groups=_attr(node, "group", 1),
    )


def _reshape(node, data, shape):
    target = _ints(shape)
    if not _attr(node, "allowzero", 0):  # 0 copies the input's size on that axis
        target = [data.shape[i] if size == 0 else size for i, size in enumerate(target)]
    return data.reshape(target)


def _slice(node, data, starts, ends, axes=None, steps=None):
    axes = _ints(axes) if axes is not None else list(range(len(_ints(starts))))
    steps = _ints(steps) if steps is not None else [1] * len(axes)
    for axis, start, end, step in zip(axes, _ints(starts), _ints(ends), steps):
        start, end = _slice_bounds(start, end, step, data.shape[axis])
        if step > 0:
            data = data[(slice(None),) * (axis % data.dim()) + (slice(start, end, step),)]
        else:  # torch indexing does not step backwards: pick the positions
            data = torch.index_select(data, axis, torch.arange(start, end, step))
    return data


def _slice_bounds(start: int, end: int, step: int, size: int) -> tuple[int, int]:
    """Slice's start and end as ONNX clamps them: negative counts from the end, and exporters
    write INT64_MAX / INT64_MIN for "to the end"."""
    start, end = (i + size if i < 0 else i for i in (start, end))
    if step > 0:
        return min(max(start, 0), size), min(max(end, 0), size)
    return min(max(start, 0), size - 1), min(max(end, -1), size - 1)


def _squeeze(node, data, axes=None):
    axes = _axes(node, axes)
    if axes is None:
        return data.squeeze()
    return data.squeeze(tuple(a % data.dim() for a in axes))


def _unsqueeze(node, data, axes=None):
    axes = _axes(node, axes)
    for axis in sorted(a % (data.dim() + len(axes)) for a in axes):
        data = data.unsqueeze(axis)
    return data


def _expand(node, data, shape):
    return data.expand(torch.broadcast_shapes(data.shape, tuple(_ints(shape))))


def _shape(node, data):
    shape = list(data.shape)[_attr(node, "start", 0) : _attr(node, "end", None)]
    return torch.tensor(shape, dtype=torch.int64)


def _constant(node):
    for name in ("value", "sparse_value"):
        if name in node.attributes:
            return _tensor(_attr(node, name).numpy()).to(torch.get_default_device())
    for name, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
        if name in node.attributes:
            return torch.tensor(_attr(node, name), dtype=dtype)
    for name, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if name in node.attributes:
            return torch.tensor(list(_attr(node, name)), dtype=dtype)
    raise AttnRewriteError(f"cannot fit end to end: Constant node {node.name!r} holds no value attnrewrite reads")


def _constant_of_shape(node, shape):
    value = _attr(node, "value")
    fill = _tensor(value.numpy()).to(torch.get_default_device()) if value is not None else torch.zeros(1)
    return fill.reshape(()).expand(_ints(shape)).clone()


def _reduce(function):
    def reduce(node, data, axes=None):
        axes = _axes(node, axes)
        keep = bool(_attr(node, "keepdims", 1))
        if not axes:
            if _attr(node, "noop_with_empty_axes", 0):
                return data
            axes = list(range(data.dim()))
        return function(data, dim=tuple(axes), keepdim=keep)

    return reduce


def _layer_norm(node, x, scale, bias=None):
    axis = _attr(node, "axis", -1) % x.dim()
    return torch.nn.functional.layer_norm(x, x.shape[axis:], scale, bias, _attr(node, "epsilon", 1e-5))


def _rms_norm(x, scale, epsilon: float):
    """onnxruntime's SimplifiedLayerNormalization over the last axis, in float32 (stash_type 1)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (normed * scale.float()).to(x.dtype)


def _simplified_layer_norm(node, x, scale):
    return _rms_norm(x, scale, _attr(node, "epsilon", 1e-5))


def _skip_simplified_layer_norm(node, x, skip, scale, bias=None):
    """(the normalised sum, no mean, no inverse deviation, the sum x + skip (+ bias))."""
    total = x + skip if bias is None else x + skip + bias
    return _rms_norm(total, scale, _attr(node, "epsilon", 1e-5)), None, None, total


def _flatten(node, x):
    axis = _attr(node, "axis", 1) % (x.dim() + 1) if x.dim() else 0
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _cumsum(node, x, axis):
    dim = int(axis)
    if _attr(node, "reverse", 0):
        x = x.flip(dim)
    out = torch.cumsum(x, dim).to(x.dtype)
    if _attr(node, "exclusive", 0):
        out = out - x
    return out.flip(dim) if _attr(node, "reverse", 0) else out


def _variadic(function):
    def apply(node, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = function(out, x)
        return out

    return apply


def _elementwise(function):
    return lambda node, *xs: function(*xs)


# --- quantized weights ---------------------------------------------------------------------------


def _dequantize_linear(node, x, scale, zero_point=None):
    """(x - zero point) * scale in the scale's dtype: one scale, one per index along ``axis``,
    or one per ``block_size`` consecutive indices along it."""
    axis, block = _attr(node, "axis", 1) % max(x.dim(), 1), _attr(node, "block_size", 0)

    def spread(t):  # t over x's elements
        if block:
            return t.repeat_interleave(block, dim=axis).narrow(axis, 0, x.shape[axis])
        return t.reshape([-1 if i == axis else 1 for i in range(x.dim())]) if t.numel() > 1 else t

    centred = x.float() if zero_point is None else x.float() - spread(zero_point.float())
    return (centred * spread(scale.float())).to(scale.dtype)


def _unimplemented_nbits(node: ir.Node) -> str | None:
    if _attr(node, "bits", 4) not in (2, 4, 8):
        return f"has {_attr(node, 'bits')}-bit weights"
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        return "reorders its weight's rows (g_idx)"
    zero_points = node.inputs[3] if len(node.inputs) > 3 else None
    if zero_points is not None and zero_points.dtype not in (None, ir.DataType.UINT8):
        return "has floating-point zero points"
    return None


def _unpacked(packed, bits: int):
    """[rows, bytes] uint8 -> [rows, bytes * 8 / bits]: each byte's values, its low bits first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(packed.shape[0], -1)


def _nbits_weight(node, packed, scales, zero_points=None):
    """MatMulNBits' weight as x W takes it, [K, N] in the scales' dtype: each of its N rows'
    K values in blocks of ``block_size``, minus the block's zero point (2^(bits - 1) where
    none is given), times the block's scale."""
    bits, block, k, n = _attr(node, "bits", 4), _attr(node, "block_size"), _attr(node, "K"), _attr(node, "N")
    blocks = -(-k // block)
    values = _unpacked(packed.reshape(n, -1), bits)[:, : blocks * block].reshape(n, blocks, block).float()
    if zero_points is None:
        zero = torch.full((n, blocks, 1), float(2 ** (bits - 1)), device=values.device)
    else:
        zero = _unpacked(zero_points.reshape(n, -1), bits)[:, :blocks].float().unsqueeze(-1)
    weight = ((values - zero) * scales.float().reshape(n, blocks, 1)).reshape(n, -1)[:, :k]
    return weight.T.to(scales.dtype)


def _with_bias(product, bias=None):
    return product if bias is None else product + bias


def _matmul_nbits(node, a, packed, scales, zero_points=None, g_idx=None, bias=None):
    return _with_bias(a @ _nbits_weight(node, packed, scales, zero_points), bias)


OPS = {
    "Add": _elementwise(torch.add),
    "Sub": _elementwise(torch.sub),
    "Mul": _elementwise(torch.mul),
    "Div": _div,
    "Pow": _elementwise(lambda a, b: torch.pow(a, b.to(a.dtype)) if a.is_floating_point() else torch.pow(a, b)),
    "Neg": _elementwise(torch.neg),
    "Abs": _elementwise(torch.abs),
    "Sqrt": _elementwise(torch.sqrt),
    "Reciprocal": _elementwise(torch.reciprocal),
    "Exp": _elementwise(torch.exp),
    "Log": _elementwise(torch.log),
    "Erf": _elementwise(torch.erf),
    "Cos": _elementwise(torch.cos),
    "Sin": _elementwise(torch.sin),
    "Floor": _elementwise(torch.floor),
    "Ceil": _elementwise(torch.ceil),
    "Sign": _elementwise(torch.sign),
    "Clip": lambda node, x, low=None, high=None: torch.clamp(x, low, high),
    "Mod": lambda node, a, b: torch.fmod(a, b) if _attr(node, "fmod", 0) else torch.remainder(a, b),
    "Tanh": _elementwise(torch.tanh),
    "Sigmoid": _elementwise(torch.sigmoid),
    "Relu": _elementwise(torch.relu),
    "Gelu": lambda node, x: torch.nn.functional.gelu(x, approximate=_attr(node, "approximate", "none")),
    "Softmax": lambda node, x: torch.softmax(x, dim=_attr(node, "axis", -1)),
    "Max": _variadic(torch.maximum),
    "Min": _variadic(torch.minimum),
    "Sum": _variadic(torch.add),
    "Not": _elementwise(torch.logical_not),
    "And": _elementwise(torch.logical_and),
    "Or": _elementwise(torch.logical_or),
    "Xor": _elementwise(torch.logical_xor),
    "Equal": _elementwise(torch.eq),
    "Less": _elementwise(torch.lt),
    "LessOrEqual": _elementwise(torch.le),
    "Greater": _elementwise(torch.gt),
    "GreaterOrEqual": _elementwise(torch.ge),
    "IsNaN": _elementwise(torch.isnan),
    "IsInf": _elementwise(torch.isinf),
    "Where": _elementwise(lambda c, a, b: torch.where(c.bool(), a, b)),
    "MatMul": _elementwise(torch.matmul),
    "DequantizeLinear": _dequantize_linear,
    "Gemm": _gemm,
    "Cast": lambda node, x: x.to(_dtype(_attr(node, "to"))),
    "CastLike": lambda node, x, like: x.to(like.dtype),
    "Identity": lambda node, x: x,
    "Dropout": lambda node, x, *_: x,  # inference: no dropout
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Shape": _shape,
    "Size": lambda node, x: torch.tensor(x.numel(), dtype=torch.int64),
    "Range": _elementwise(
        lambda start, limit, delta: torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)
    ),
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "ScatterND": _scatter_nd,
    "Split": _split,
    "Conv": _conv,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": lambda node, x: x.permute(_attr(node, "perm", list(range(x.dim()))[::-1])),
    "Concat": lambda node, *xs: torch.cat([x for x in xs if x is not None], dim=_attr(node, "axis")),
    "Slice": _slice,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Expand": _expand,
    "Tile": _elementwise(lambda x, repeats: x.repeat(_ints(repeats))),
    "Trilu": lambda node, x, k=None: (torch.triu if _attr(node, "upper", 1) else torch.tril)(
        x, 0 if k is None else int(k)
    ),
    "ReduceMean": _reduce(torch.mean),
    "ReduceSum": _reduce(torch.sum),
    "ReduceMax": _reduce(torch.amax),
    "ReduceMin": _reduce(torch.amin),
    "ReduceL2": _reduce(torch.linalg.vector_norm),
    "NonZero": lambda node, x: torch.nonzero(x).T.contiguous(),
    "LayerNormalization": _layer_norm,
    "SimplifiedLayerNormalization": _simplified_layer_norm,  # onnxruntime's, in the default domain
    "CumSum": _cumsum,
}


def _group_query_attention(node, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None, *rest):
    """onnxruntime's GroupQueryAttention on a prompt (an empty past, as the fitting's batches
    come): q, k, v packed or apart, rotated inside where do_rotary says so, each row's real
    tokens its first seqlens_k + 1 (right padding), a query at position i reading the keys up
    to min(i, the row's last), only its last local_window_size of them where that is set;
    softcap and smooth_softmax as the operator applies them. (output, present_key,
    present_value)."""
    if past_key is not None and past_key.shape[2]:
        raise AttnRewriteError(
            f"GroupQueryAttention node {node.name!r} is evaluated in torch from an empty cache only, "
            f"got a past of {past_key.shape[2]}"
        )
    heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    batch, length, width = query.shape
    if key is None:
        size = width // (heads + 2 * kv_heads)
        query, key, value = query.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
    q, k, v = (x.reshape(batch, length, -1, query.shape[-1] // heads).transpose(1, 2) for x in (query, key, value))
    if _attr(node, "do_rotary", 0):
        cos, sin = rest[1][:length], rest[2][:length]  # positions 0 .. length - 1: a prompt's
        interleaved = bool(_attr(node, "rotary_interleaved", 0))
        q, k = (_rotated(x, cos, sin, interleaved) for x in (q, k))
    scale = _attr(node, "scale", 0.0) or q.shape[-1] ** -0.5
    logits = (q @ expand_to_query_heads(k, q).transpose(-1, -2)).float() * scale
    softcap = _attr(node, "softcap", 0.0)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    reach = torch.minimum(  # [B, 1, N, 1]: the keys a query reads end before this
        torch.arange(1, length + 1).view(1, 1, -1, 1), (seqlens_k.long() + 1).view(-1, 1, 1, 1)
    )
    keys = torch.arange(length).view(1, 1, 1, -1)
    allowed = keys < reach
    window = _attr(node, "local_window_size", -1)
    if window >= 0:
        allowed = allowed & (keys >= reach - window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if _attr(node, "smooth_softmax", 0):  # a zero logit beside the keys
        logits = torch.cat([logits, torch.zeros_like(logits[..., :1])], dim=-1)
    weights = torch.softmax(logits, dim=-1)[..., :length].to(v.dtype)
    out = (weights @ expand_to_query_heads(v, q)).transpose(1, 2).reshape(batch, length, -1)
    return out, k, v


def _rotary_embedding(node, x, position_ids, cos_cache, sin_cache):
    """onnxruntime's RotaryEmbedding of x [B, N, heads * D] (or [B, heads, N, D]) at
    ``position_ids`` [B, N], its first rotary_embedding_dim features (all where 0) turned."""
    packed = x.dim() == 3
    if packed:
        batch, length, _ = x.shape
        x = x.reshape(batch, length, _attr(node, "num_heads"), -1).transpose(1, 2)
    rotary = _attr(node, "rotary_embedding_dim", 0) or x.shape[-1]
    cos, sin = (table[position_ids.long()][..., : rotary // 2].unsqueeze(1) for table in (cos_cache, sin_cache))
    out = _rotated(x, cos, sin, bool(_attr(node, "interleaved", 0)))
    return out.transpose(1, 2).reshape(batch, length, -1) if packed else out


def _rotated(x, cos, sin, interleaved: bool):
    """x [B, heads, N, D] with its first 2 * cos.shape[-1] features rotated: by cos and sin
    [N, D'] at positions 0 .. N - 1, or [B, 1, N, D'] at each token's own."""
    rotary = 2 * cos.shape[-1]
    part, rest = x[..., :rotary], x[..., rotary:]
    if interleaved:
        first, second = part[..., 0::2], part[..., 1::2]
    else:
        first, second = part.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    turned = (first * cos - second * sin, second * cos + first * sin)
    joined = torch.stack(turned, dim=-1).flatten(-2) if interleaved else torch.cat(turned, dim=-1)
    return torch.cat([joined, rest], dim=-1)


# onnxruntime's com.microsoft operators that exported decoders use (onnxruntime-genai's builder;
# a GroupQueryAttention left alone beside replaced ones: a sliding window's)
CONTRIB_OPS = {
    "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm,
    "GroupQueryAttention": _group_query_attention,
    "MatMulNBits": _matmul_nbits,
    "RotaryEmbedding": _rotary_embedding,  # a recurrent rewrite's of a GroupQueryAttention's rotation
}


def _evaluation(node: ir.Node):
    """The torch evaluation of ``node``'s op, None where there is none."""
    if node.domain in ("", "ai.onnx"):
        return OPS.get(node.op_type)
    return CONTRIB_OPS.get(node.op_type) if node.domain == "com.microsoft" else None
