"""The best exact alternative to a rewrite: the same model with its softmax attention fused.

A rewrite has to beat exact attention as onnxruntime would run it in production, not only the
unfused MatMul/Softmax/MatMul chain an exporter writes. Two ways, the first that covers every
site wins:

1. ``onnxruntime.transformers.optimizer`` (BERT-like models): what onnxruntime's own tooling
   does to a model, whose ``com.microsoft.Attention`` runs fused kernels on CPU and CUDA. Its
   fusion fuses all sites or we do not use it;
2. each site spliced into one opset-23 ``Attention`` node (works for any site the splicer can
   take, e.g. attention-only graphs the optimizer has no pattern for). The model is converted to
   opset 23 first: a function body's opset must be the model's.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.detect import OnnxSite, Unsupported
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.rewrite import analyze
from attnrewrite.onnx.splice import Splicer
from attnrewrite.passes.lowering import DOMAIN, OnnxLowering

ATTENTION_OPSET = 23
OPTIMIZER = "onnxruntime.transformers.optimizer"


@dataclasses.dataclass
class FusedModel:
    model: ir.Model
    how: str  # one line for reports: which fusion, how many sites
    already_fp16: bool = False


def fused_exact_attention(model: ir.Model, site_names: list[str], fp16: bool = False) -> FusedModel:
    """The model with the named attention sites fused (see the module docstring), checked
    against the original on generated inputs; ``fp16`` asks for a float16 model (the optimizer
    route converts with onnxruntime's own tool, the other is left to the caller)."""
    sites = _named_sites(model, site_names)
    optimized, why_not = _optimizer_fusion(model, sites)
    if optimized is not None:
        disagreement = _disagreement(model, optimized.model)
        if disagreement is None:
            return _optimizer_fp16(optimized) if fp16 else optimized
        why_not = f"its fused model disagrees with the original ({disagreement})"
    try:
        fused = _attention23(model, site_names)
    except Unsupported as error:
        raise AttnRewriteError(f"no fused exact attention for this model: {error}; {OPTIMIZER}: {why_not}") from None
    disagreement = _disagreement(model, fused)
    if disagreement is not None:
        raise AttnRewriteError(
            f"opset-{ATTENTION_OPSET} Attention disagrees with the original ({disagreement}); {OPTIMIZER}: {why_not}"
        )
    return FusedModel(fused, f"opset-{ATTENTION_OPSET} Attention x{len(sites)} ({OPTIMIZER}: {why_not})")


CHECK_LENGTH = 16
CHECK_TOLERANCE = 1e-4  # relative to the output's largest magnitude; fp32 reassociation is ~1e-6


def _disagreement(original: ir.Model, fused: ir.Model) -> str | None:
    """None when both models give the same outputs on generated inputs (onnxruntime, CPU),
    else what differs. The optimizer's fusion assumes right-padded masks, for one."""
    import onnxruntime as ort

    feeds = generate_inputs(original.graph, seq=CHECK_LENGTH)
    outputs = []
    try:
        for model in (original, fused):
            with onnx_io.saved_copy(model) as path:
                outputs.append(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds))
    except Exception as error:
        return f"it does not run: {(str(error).splitlines() or [type(error).__name__])[0][:160]}"
    for a, b in zip(*outputs):
        if a.shape != b.shape:
            return f"shape {b.shape} instead of {a.shape}"
        error = float(np.max(np.abs(a.astype(np.float64) - b))) / max(float(np.max(np.abs(a))), 1e-30)
        if not error <= CHECK_TOLERANCE:
            return f"relative error {error:.2g} at N = {CHECK_LENGTH}"
    return None


def _named_sites(model: ir.Model, site_names: list[str]) -> list[OnnxSite]:
    wanted = set(site_names)
    sites = [s for s in analyze(onnx_io.infer_shapes(model)) if s.site.name in wanted]
    if len(sites) != len(wanted):
        raise AttnRewriteError(f"fused exact attention: {len(wanted) - len(sites)} of the sites were not found again")
    return sites


# --- 1. onnxruntime's optimizer -----------------------------------------------------------------


def _optimizer_fusion(model: ir.Model, sites: list[OnnxSite]) -> tuple[FusedModel | None, str]:
    """(the optimizer-fused model, "") when it fuses every site, else (None, why not)."""
    heads = {s.site.num_heads for s in sites}
    head_dims = {s.site.head_dim for s in sites}
    if len(heads) != 1 or len(head_dims) != 1 or None in heads | head_dims:
        return None, "the head count or head size is unknown or differs between sites"
    try:
        from onnxruntime.transformers import optimizer
    except ImportError as error:
        return None, f"not importable ({error})"
    [num_heads], [head_dim] = heads, head_dims
    proto = _scale_as_division(ir.serde.serialize_model(model))
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)  # its fusion chatter
    try:
        optimized = optimizer.optimize_model(
            proto, model_type="bert", num_heads=num_heads, hidden_size=num_heads * head_dim, opt_level=0
        )
    except Exception as error:  # its pattern matchers assume things about graphs they do not check
        return None, f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
    fused = optimized.get_fused_operator_statistics().get("Attention", 0)
    if fused != len(sites):
        return None, f"fused {fused} of {len(sites)} attention sites"
    return FusedModel(onnx_io.from_proto(optimized.model), f"{OPTIMIZER}: com.microsoft.Attention x{fused}"), ""


def _optimizer_fp16(fused: FusedModel) -> FusedModel:
    """float16 the way onnxruntime's tooling makes its fused models float16 (our to_fp16 knows
    only standard ops)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(ir.serde.serialize_model(fused.model))
    model.convert_float_to_float16(keep_io_types=False)
    return FusedModel(
        onnx_io.from_proto(model.model), fused.how + ", float16 by onnxruntime's converter", already_fp16=True
    )


def _scale_as_division(proto: onnx.ModelProto) -> onnx.ModelProto:
    """logits * c before a Softmax becomes logits / (1/c): the optimizer's pattern for attention
    without a mask expects a Div (exact for c = 1/sqrt(64) and every power of two)."""
    graph = proto.graph
    constants = {
        n.output[0]: n for n in graph.node if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    initializers = {t.name: t for t in graph.initializer}
    softmax_inputs = {n.input[0] for n in graph.node if n.op_type == "Softmax"}
    for node in graph.node:
        if node.op_type != "Mul" or node.output[0] not in softmax_inputs:
            continue
        factor = node.input[1]
        if factor in constants:
            value = onnx.numpy_helper.to_array(constants[factor].attribute[0].t)
        elif factor in initializers:
            value = onnx.numpy_helper.to_array(initializers[factor])
        else:
            continue
        if value.size != 1 or not np.issubdtype(value.dtype, np.floating) or value.item() == 0:
            continue
        divisor = onnx.numpy_helper.from_array((1 / value).astype(value.dtype), f"{factor}/reciprocal")
        graph.initializer.append(divisor)
        node.op_type, node.input[1] = "Div", divisor.name
    return proto


# --- 2. opset-23 Attention ----------------------------------------------------------------------


def _attention23(model: ir.Model, site_names: list[str]) -> ir.Model:
    model = _at_opset(model, ATTENTION_OPSET)
    model = onnx_io.infer_shapes(model)
    wanted = set(site_names)
    sites = [s for s in analyze(model) if s.site.name in wanted]
    splicer = Splicer(model)
    for s in sites:
        splicer.check(s)
        splicer.splice(s, attention23_lowering(s))
    return model


def _at_opset(model: ir.Model, version: int) -> ir.Model:
    """A copy of the model at opset >= version (a copy either way: the splice works in place,
    and the original is still needed to check the result against)."""
    if onnx_io.default_opset(model) >= version:
        return onnx_io.from_proto(ir.serde.serialize_model(model))
    from onnx import version_converter

    try:
        return onnx_io.from_proto(version_converter.convert_version(ir.serde.serialize_model(model), version))
    except Exception as error:
        raise Unsupported(f"the model cannot be converted to opset {version} ({type(error).__name__})") from None


def attention23_lowering(s: OnnxSite) -> OnnxLowering:
    """(q, k, v, key_keep) -> Attention(q, k, v[, mask]) with the site's scale and causality.
    Rank 4 is [batch, heads, N, Dh]; rank 3 is heads folded into batch: one head each."""
    site = s.site
    if site.rank not in (3, 4):
        raise Unsupported(f"opset-{ATTENTION_OPSET} Attention takes rank 3 or 4, this site has rank {site.rank}")
    attributes = {"scale": float(site.scale), "is_causal": int(site.mask.causal)}
    if site.rank == 3:
        attributes |= {"q_num_heads": 1, "kv_num_heads": 1}
    nodes, inputs = [], ["q", "k", "v"]
    if site.mask.key_padding:
        # key_keep [..., Nk, 1] -> booleans [..., Nq, Nk] (True: attend). onnxruntime wants the
        # query axis spelled out (it does not broadcast it): an Nq x Nk mask per batch, which
        # only masked models pay for (the benchmark's have no mask).
        nodes += [
            onnx.helper.make_node("Constant", [], ["last"], value_ints=[-1]),
            onnx.helper.make_node("Constant", [], ["second_last"], value_ints=[-2]),
            onnx.helper.make_node("Constant", [], ["one"], value_ints=[1]),
            onnx.helper.make_node("Squeeze", ["key_keep", "last"], ["keep_keys"]),
            onnx.helper.make_node("Unsqueeze", ["keep_keys", "second_last"], ["keep_row"]),
            onnx.helper.make_node("Shape", ["q"], ["nq"], start=-2, end=-1),
            onnx.helper.make_node("Concat", ["nq", "one"], ["rows"], axis=0),
            onnx.helper.make_node("Expand", ["keep_row", "rows"], ["keep"]),
            onnx.helper.make_node("Cast", ["keep"], ["attend"], to=onnx.TensorProto.BOOL),
        ]
        if site.rank == 3:  # [G, Nq, Nk] would read as heads: [G, 1, Nq, Nk] (one head per batch)
            nodes[-1].output[0] = "attend_rows"
            nodes += [
                onnx.helper.make_node("Constant", [], ["third_last"], value_ints=[-3]),
                onnx.helper.make_node("Unsqueeze", ["attend_rows", "third_last"], ["attend"]),
            ]
        inputs.append("attend")
    nodes.append(onnx.helper.make_node("Attention", inputs, ["out"], **attributes))
    name = (
        "ExactAttention"
        + ("Causal" if site.mask.causal else "")
        + ("Masked" if site.mask.key_padding else "")
        + f"Rank{site.rank}"
    )
    function = onnx.helper.make_function(
        DOMAIN,
        name,
        ["q", "k", "v", "key_keep"],
        ["out"],
        nodes,
        [onnx.helper.make_opsetid("", ATTENTION_OPSET)],
    )
    return OnnxLowering([function])
