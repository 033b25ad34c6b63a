"""Hand-built softmax attention graphs (onnx.helper) in the spellings exporters use, with the
inputs and reference values a test needs to check a rewrite against the pass's torch module.

``AttentionSpec`` names one variant: where the scale sits (q, k^T, logits, split as sqrt on
both, none) and whether it is a Mul or a Div; the mask (none, key padding, causal, both) and its
form (additive, Where keeping where true, masked_fill's Where filling where true); the causal
triangle from Trilu or a sliced constant; 3-D [G, N, D] or 4-D [B, H, N, D] layout; k given
as [.., N, D] and transposed in the graph or given pre-transposed [.., D, N]; q, k, v given as
[B, N, H, D] and split into heads by Transpose(0, 2, 1, 3) (so heads are known); the dynamo
exporter's NaN guard; an extra consumer of the probabilities (which must make the site skip).
Masks are computed in the graph from an int64 ``attention_mask`` input [B, N] (for 3-D: [G, N]),
1 = keep, or (``mask_input="key_padding_mask"``) from a bool input whose True marks padding, as
torch's ``key_padding_mask``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MAX_CAUSAL = 256  # rows of the constant triangle the "constant" causal form slices
FILLS = {"-inf": -np.inf, "min": None, "-1e4": -1e4}  # None: the dtype's lowest finite value

NP_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    layout: str = "4d"  # "4d": [B, H, N, D]; "3d": [G, N, D] (heads folded into the batch)
    heads: int = 2
    head_dim: int = 8
    value_dim: int | None = None  # default: head_dim
    scale: float | None = None  # default: 1/sqrt(head_dim)
    scale_at: str = "logits"  # "logits" | "q" | "k" | "split" | "none"
    scale_op: str = "Mul"  # "Mul" | "Div"
    scale_first: bool = False  # Mul(c, x) instead of Mul(x, c)
    mask: str = "none"  # "none" | "key_padding" | "causal" | "causal+key_padding"
    mask_form: str = "additive"  # "additive" | "where_keep" | "where_fill"
    mask_first: bool = False  # Add(mask, logits) instead of Add(logits, mask)
    mask_input: str = "attention_mask"  # "attention_mask": int64, 1 = keep | "key_padding_mask": bool, True = padding
    fill: str = "-1e4"  # the masking constant of Where forms (a key of FILLS)
    causal_from: str = "trilu"  # "trilu" | "constant"
    k_input: str = "k"  # "k": [.., N, D] + Transpose in the graph; "kt": input already [.., D, N]
    split_heads: bool = False  # 4-D only: inputs [B, N, H, D] + Transpose(0, 2, 1, 3)
    nan_guard: bool = False
    extra_consumer: bool = False  # the probabilities are also a graph output
    dtype: int = TensorProto.FLOAT
    opset: int = 18

    @property
    def dv(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def scale_value(self) -> float:
        return self.scale if self.scale is not None else 1 / math.sqrt(self.head_dim)

    @property
    def key_padding(self) -> bool:
        return "key_padding" in self.mask

    @property
    def causal(self) -> bool:
        return "causal" in self.mask

    @property
    def expected_scale(self) -> float:
        return 1.0 if self.scale_at == "none" else self.scale_value


class _Builder:
    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def node(self, op: str, inputs: list[str], hint: str | None = None, **attrs) -> str:
        out = self.name(hint or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"/{op}_{self.count}", **attrs))
        return out

    def const(self, array, hint: str = "c") -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def scalar(self, value: float) -> str:
        if self.spec.dtype == TensorProto.BFLOAT16:
            tensor = helper.make_tensor(self.name("s"), TensorProto.BFLOAT16, [], [float(value)])
            self.inits.append(tensor)
            return tensor.name
        return self.const(np.array(value, dtype=NP_DTYPES[self.spec.dtype]), "s")

    def fill_value(self) -> float:
        value = FILLS[self.spec.fill]
        if value is None:
            value = -65504.0 if self.spec.dtype == TensorProto.FLOAT16 else float(np.finfo(np.float32).min)
            if self.spec.dtype == TensorProto.BFLOAT16:
                value = -3.3e38
        return value

    def scaled(self, x: str, factor: float) -> str:
        spec = self.spec
        c = self.scalar(factor if spec.scale_op == "Mul" else 1 / factor)
        args = [c, x] if spec.scale_first and spec.scale_op == "Mul" else [x, c]
        return self.node(spec.scale_op, args, "scaled")


def build_attention_model(spec: AttentionSpec) -> onnx.ModelProto:
    """One attention: out = softmax(scale * q k^T + mask) v, inputs q, k or kt, v[, attention_mask]."""
    b = _Builder(spec)
    d, dv, h = spec.head_dim, spec.dv, spec.heads
    dt = spec.dtype
    if spec.layout == "3d":
        lead, seq = ["batch"], "sequence"
    else:
        lead, seq = ["batch", h], "sequence"
    inputs = []

    def head_input(name: str, last: int, transposed: bool = False) -> str:
        if spec.split_heads:  # [B, N, H, D] -> [B, H, N, D] (or [B, H, D, N] for k^T)
            inputs.append(helper.make_tensor_value_info(name, dt, ["batch", seq, h, last]))
            return b.node("Transpose", [name], f"{name}_heads", perm=[0, 2, 3, 1] if transposed else [0, 2, 1, 3])
        shape = [*lead, last, seq] if transposed else [*lead, seq, last]
        inputs.append(helper.make_tensor_value_info(name, dt, shape))
        return name

    q = head_input("q", d)
    if spec.k_input == "kt":
        kt = head_input("kt", d, transposed=True)
    else:
        k = head_input("k", d)
        perm = [0, 2, 1] if spec.layout == "3d" else [0, 1, 3, 2]
        kt = b.node("Transpose", [k], "kt", perm=perm)
    v = head_input("v", dv)

    scale = spec.scale_value
    if spec.scale_at == "q":
        q = b.scaled(q, scale)
    elif spec.scale_at == "k":
        kt = b.scaled(kt, scale)
    elif spec.scale_at == "split":
        q = b.scaled(q, math.sqrt(scale))
        kt = b.scaled(kt, math.sqrt(scale))
    logits = b.node("MatMul", [q, kt], "qk")
    if spec.scale_at == "logits":
        logits = b.scaled(logits, scale)

    if spec.key_padding:
        padding_input = spec.mask_input == "key_padding_mask"
        mask_type = TensorProto.BOOL if padding_input else TensorProto.INT64
        inputs.append(helper.make_tensor_value_info(spec.mask_input, mask_type, ["batch", seq]))
        axes = [1] if spec.layout == "3d" else [1, 2]
        if spec.opset < 13:  # axes became an input in opset 13
            keep = b.node("Unsqueeze", [spec.mask_input], "mask_b", axes=axes)
        else:
            keep = b.node("Unsqueeze", [spec.mask_input, b.const(np.array(axes, np.int64), "axes")], "mask_b")
        if padding_input:
            keep = b.node("Not", [keep], "keep")
        logits = _apply_mask(b, logits, keep, is_int=not padding_input)
    if spec.causal:
        logits = _apply_mask(b, logits, _causal_keep(b, q), is_int=False)

    probs = b.node("Softmax", [logits], "probs", axis=-1)
    outputs = []
    if spec.nan_guard:
        is_nan = b.node("IsNaN", [probs], "is_nan")
        probs = b.node("Where", [is_nan, b.scalar(0.0), probs], "guarded")
    if spec.extra_consumer:
        outputs.append(helper.make_tensor_value_info(probs, dt, [*lead, seq, seq]))
    out = b.node("MatMul", [probs, v], "out")
    outputs.insert(0, helper.make_tensor_value_info(out, dt, [*lead, seq, dv]))
    graph = helper.make_graph(b.nodes, "attention", inputs, outputs, initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", spec.opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _causal_keep(b: _Builder, q: str) -> str:
    """A bool [N, N] lower triangle for the sequence length of q, computed in the graph."""
    n = b.node("Shape", [q], "n", start=-2, end=-1)
    if b.spec.causal_from == "constant":
        triangle = b.const(np.tril(np.ones((MAX_CAUSAL, MAX_CAUSAL), dtype=bool)), "triangle")
        zeros = b.const(np.array([0, 0], np.int64), "zeros")
        ends = b.node("Concat", [n, n], "ends", axis=0)
        return b.node("Slice", [triangle, zeros, ends, b.const(np.array([0, 1], np.int64), "axes")], "causal")
    square = b.node("Concat", [n, n], "square", axis=0)
    ones = b.node("ConstantOfShape", [square], "ones", value=helper.make_tensor("one", TensorProto.INT64, [1], [1]))
    lower = b.node("Trilu", [ones], "lower", upper=0)
    return b.node("Cast", [lower], "causal", to=TensorProto.BOOL)


def _apply_mask(b: _Builder, logits: str, keep: str, is_int: bool) -> str:
    """Mask the logits with `keep` (int 1/0 or bool) in the spec's form."""
    spec = b.spec
    if spec.mask_form == "additive":
        keep_t = b.node("Cast", [keep], "keep_t", to=spec.dtype)
        dropped = b.node("Sub", [b.scalar(1.0), keep_t], "dropped")
        bias = b.node("Mul", [dropped, b.scalar(-1e4)], "bias")
        args = [bias, logits] if spec.mask_first else [logits, bias]
        return b.node("Add", args, "masked")
    fill = b.scalar(b.fill_value())
    if spec.mask_form == "where_keep":
        cond = b.node("Cast", [keep], "keep_bool", to=TensorProto.BOOL) if is_int else keep
        return b.node("Where", [cond, logits, fill], "masked")
    # masked_fill: the condition is true where the key is dropped
    if is_int:
        cond = b.node("Equal", [keep, b.const(np.array(0, np.int64), "zero")], "dropped_bool")
    else:
        cond = b.node("Not", [keep], "dropped_bool")
    return b.node("Where", [cond, fill, logits], "masked")


# --- one pass's lowering, called by a one-node graph -----------------------------------------


def lowering_session(lowering, rank: int, dtype: int = TensorProto.FLOAT, keep_rank: int | None = None):
    """An onnxruntime session of lowering_model."""
    import onnxruntime as ort

    model = lowering_model(lowering, rank, dtype, keep_rank)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def lowering_model(lowering, rank: int, dtype: int = TensorProto.FLOAT, keep_rank: int | None = None):
    """A model of one attnrewrite node reading graph inputs q, k, v (rank ``rank``, type
    ``dtype``), key_keep (float, rank ``keep_rank``, default ``rank``), every dim dynamic, and
    the lowering's constants as initializers."""
    names = list(lowering.constants)
    node = helper.make_node(lowering.op_type, ["q", "k", "v", "key_keep", *names], ["out"], domain="attnrewrite")

    def value(name, elem_type=dtype, rank=rank):
        return helper.make_tensor_value_info(name, elem_type, [f"{name}{i}" for i in range(rank)])

    graph = helper.make_graph(
        [node],
        "attention",
        [value("q"), value("k"), value("v"), value("key_keep", TensorProto.FLOAT, keep_rank or rank)],
        [value("out")],
        initializer=[numpy_helper.from_array(array, name) for name, array in lowering.constants.items()],
    )
    model = helper.make_model(
        graph,
        functions=lowering.functions,
        ir_version=10,
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("attnrewrite", 1)],
    )
    onnx.checker.check_model(model, full_check=True)
    return model


# --- inputs and the reference ----------------------------------------------------------------


def make_feeds(spec: AttentionSpec, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = NP_DTYPES.get(spec.dtype, np.float32)
    if spec.dtype == TensorProto.BFLOAT16:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    d, dv, h = spec.head_dim, spec.dv, spec.heads

    def draw(last, transposed=False):
        if spec.split_heads:
            shape = (batch, seq, h, last)
        elif spec.layout == "3d":
            shape = (batch, last, seq) if transposed else (batch, seq, last)
        else:
            shape = (batch, h, last, seq) if transposed else (batch, h, seq, last)
        return rng.standard_normal(shape).astype(np.float32).astype(np_dtype)

    feeds = {"q": draw(d)}
    if spec.k_input == "kt":
        feeds["kt"] = draw(d, transposed=True)
    else:
        feeds["k"] = draw(d)
    feeds["v"] = draw(dv)
    if spec.key_padding:
        keep = padding_mask(batch, seq)
        feeds[spec.mask_input] = keep == 0 if spec.mask_input == "key_padding_mask" else keep
    return feeds


def padding_mask(batch: int, seq: int) -> np.ndarray:
    """Row 0 unpadded; row r > 0 drops r keys at the end and one at the start (never all)."""
    mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):
        mask[row, seq - min(row, seq - 2) :] = 0
        if seq > 3:
            mask[row, 0] = 0
    return mask


def reference_qkv(spec: AttentionSpec, feeds: dict[str, np.ndarray]):
    """(q, k, v, key_keep) as float32 arrays in the site's layout: what the replacement reads."""

    def heads(x, transposed=False):
        x = np.asarray(x, dtype=np.float32)
        if spec.split_heads:
            return x.transpose(0, 2, 3, 1) if transposed else x.transpose(0, 2, 1, 3)
        return x

    q = heads(feeds["q"])
    k = heads(feeds["k"]) if "k" in feeds else np.swapaxes(heads(feeds["kt"], transposed=True), -1, -2)
    v = heads(feeds["v"])
    key_keep = None
    if spec.key_padding:
        mask = feeds["attention_mask"] if "attention_mask" in feeds else ~feeds["key_padding_mask"]
        mask = mask.astype(np.float32)
        key_keep = mask[:, :, None] if spec.layout == "3d" else mask[:, None, :, None]
    return q, k, v, key_keep


def softmax_attention(spec: AttentionSpec, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The original graph's math in float64 (for checking the graphs themselves)."""
    q, k, v, key_keep = reference_qkv(spec, feeds)
    logits = spec.expected_scale * (q.astype(np.float64) @ np.swapaxes(k, -1, -2))
    if key_keep is not None:
        logits = np.where(np.swapaxes(key_keep, -1, -2) > 0, logits, -np.inf)
    if spec.causal:
        n = logits.shape[-1]
        logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return (p / p.sum(-1, keepdims=True)) @ v


def expected_refusal(method: str, mask: str, head_dim: int, value_dim: int) -> str | None:
    """Why ``method`` must leave a found site with a positive scale and no bias alone, written out
    here rather than asked of the pass (whose ``supports`` is what the tests check)."""
    if method == "linformer" and mask.startswith("causal"):
        return "Linformer mixes every position into each projected key, so a causal mask cannot be expressed"
    if method == "nystrom" and mask.startswith("causal"):
        return "Nystromformer's landmarks mix every position of a segment, so a causal mask cannot be expressed"
    if method == "streaming" and not mask.startswith("causal"):
        return "the most recent keys are a decoder's cache: a bidirectional site has no last keys to keep"
    if method == "hydra" and head_dim != value_dim:
        return f"Hydra multiplies keys and values feature-wise: key dim {head_dim} != value dim {value_dim}"
    if method == "aft" and head_dim != value_dim:
        return f"AFT weighs each value feature by its key feature: key dim {head_dim} != value dim {value_dim}"
    return None
