"""Fused decoder attention and --recurrent (issue 26, "Done means": ORT-fused forms).

Decoders whose attention is one operator, built the ways people get them:
- opset-23 ``Attention``: the dynamo exporter at opset 23 writes scaled_dot_product_attention
  over Concat(past, new) as one; also the same with the cache inside it (past_key/past_value).
  KV-cache sites that become recurrent, equal step by step to the parallel rewrite;
- onnxruntime's ``com.microsoft`` operators with a cache: MultiHeadAttention with past_key/
  past_value (onnxscript's ``optimize_for_ort`` on a GPT-2), MultiHeadAttention over a
  Concat(past, new) (onnxscript's SDPA fusion on a Llama), Attention with a packed ``past`` (what
  onnxruntime's GPT-2 fusion writes) and GroupQueryAttention (as onnxruntime-genai's decoders
  use it): listed with their cache and refused with the reason, with and without --recurrent,
  nothing written;
- a GPT-2 through onnxruntime's transformer optimizer, whose GPT-2 fusion matches none of
  today's exports: its attention stays standard ops, the shapes after its fused layer norms
  come from onnxruntime's symbolic shape inference, and it becomes recurrent.
"""

from __future__ import annotations

import contextlib
import functools
import io
from pathlib import Path

import decoders
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import decoder_exported, read_record
from decoders import DECODERS, HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, export_decoder, logits_error
from models import ExportUnsupported, op_counts
from onnx import TensorProto, helper
from test_recurrent_models import CONFIGS, TOLERANCE, full_sequence, prefill_then_steps, session, stepped

import attnrewrite
from attnrewrite import cli
from attnrewrite.errors import NothingRewritten
from attnrewrite.generate import forced_logits
from attnrewrite.onnx.detect import fused_cache_before, fused_cache_inside
from attnrewrite.site import KvCache, MaskKind

KV_HEADS = 2  # GroupQueryAttention's key/value heads
NOTHING_WRITTEN = f"none of the {LAYERS} attention sites could be rewritten; nothing written"


def cli_output(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def saved(model: onnx.ModelProto | ir.Model, path: Path) -> Path:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, path)
    return path


def layer_caches(past: str, present: str, kv_heads: int) -> list[KvCache]:
    """Each layer's KvCache from name patterns with {i} (the layer) and {kv} (key or value)."""
    return [
        KvCache(*(name.format(i=i, kv=kv) for name in (past, present) for kv in ("key", "value")), kv_heads)
        for i in range(LAYERS)
    ]


STANDARD_CACHES = "past_key_values.{i}.{kv}", "present.{i}.{kv}"


# --- onnxruntime's fused operators with a cache ---------------------------------------------------


def fused_by_onnxscript(export, path: Path, fusions: str) -> Path:
    """The dynamo export fused by onnxscript for onnxruntime: ``fusions`` "all" is
    ``optimize_for_ort`` (a GPT-2's attention becomes MultiHeadAttention with past_key/past_value);
    "sdpa" only the attention fusions (a Llama's becomes MultiHeadAttention over Concat(past, new);
    its RMS norms, fused too, would be SimplifiedLayerNormalization in the ONNX domain, which the
    ONNX checker does not know)."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import optimize_for_ort
    from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa
    from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha

    model = ir.load(str(export.path))
    if fusions == "all":
        model, counts = optimize_for_ort(model)
        assert counts["mha1"] == LAYERS
    else:
        common_passes.ShapeInferencePass()(model)
        optimize(model)
        assert fuse_sdpa(model, apply_shape_inference=True) == replace_sdpa_by_mha(model) == LAYERS
        optimize(model)
    return saved(model, path)


def _initializer(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    array = np.random.default_rng(seed).normal(0, 0.2, shape).astype(np.float32)
    return onnx.numpy_helper.from_array(array, name)


def _decoder_graph(name: str, layer, inputs: dict, outputs: dict, nodes: list, weights: list) -> onnx.ModelProto:
    """input_ids -> embedding -> LAYERS x (x + layer(i, x)) -> logits: ``layer(i, x)`` returns
    the nodes of layer i and its attention output."""
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["x0"]), *nodes]
    weights = [_initializer("embedding", (VOCAB, HIDDEN), 0), _initializer("lm_head", (HIDDEN, VOCAB), 1), *weights]
    for i in range(LAYERS):
        layer_nodes, attended = layer(i, f"x{i}")
        nodes += [*layer_nodes, helper.make_node("Add", [f"x{i}", attended], [f"x{i + 1}"])]
    nodes.append(helper.make_node("MatMul", [f"x{LAYERS}", "lm_head"], ["logits"]))
    declared = {"input_ids": (TensorProto.INT64, ["batch", "sequence"]), **inputs}
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, elem, shape) for n, (elem, shape) in declared.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in outputs.items()],
        weights,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def onnxruntime_gpt2_attention() -> onnx.ModelProto:
    """What onnxruntime's GPT-2 fusion writes per layer: com.microsoft.Attention(hidden states,
    packed q|k|v weights and bias, the attention mask as int32, past_{i} [2, batch, heads, past,
    head_dim]) -> (output, present_{i}), unidirectional."""
    cache = [2, "batch", HEADS, "past", HEAD_DIM]
    inputs = {"attention_mask": (TensorProto.INT64, ["batch", "total"])}
    inputs |= {f"past_{i}": (TensorProto.FLOAT, cache) for i in range(LAYERS)}
    outputs = {"logits": ["batch", "sequence", VOCAB]}
    outputs |= {f"present_{i}": [2, "batch", HEADS, "total", HEAD_DIM] for i in range(LAYERS)}
    weights = [_initializer(f"qkv_{i}", (HIDDEN, 3 * HIDDEN), 10 + i) for i in range(LAYERS)]
    weights += [_initializer(f"qkv_bias_{i}", (3 * HIDDEN,), 20 + i) for i in range(LAYERS)]

    def layer(i: int, x: str):
        attention = helper.make_node(
            "Attention",
            [x, f"qkv_{i}", f"qkv_bias_{i}", "mask_index", f"past_{i}"],
            [f"attention_{i}", f"present_{i}"],
            name=f"GptAttention_{i}",
            domain="com.microsoft",
            num_heads=HEADS,
            unidirectional=1,
        )
        return [attention], f"attention_{i}"

    mask = helper.make_node("Cast", ["attention_mask"], ["mask_index"], to=TensorProto.INT32)
    return _decoder_graph("onnxruntime_gpt2_attention", layer, inputs, outputs, [mask], weights)


def group_query_decoder() -> onnx.ModelProto:
    """A decoder on com.microsoft.GroupQueryAttention as onnxruntime-genai runs it: the caches
    past_key_values.{i}.key/value [batch, kv_heads, past, head_dim], seqlens_k (the last real
    position per row) and total_sequence_length from the attention mask."""
    cache = ["batch", KV_HEADS, "past", HEAD_DIM]
    inputs = {"attention_mask": (TensorProto.INT64, ["batch", "total"])}
    inputs |= {
        f"past_key_values.{i}.{kv}": (TensorProto.FLOAT, cache) for i in range(LAYERS) for kv in ("key", "value")
    }
    present = ["batch", KV_HEADS, "total", HEAD_DIM]
    outputs = {"logits": ["batch", "sequence", VOCAB]}
    outputs |= {f"present.{i}.{kv}": present for i in range(LAYERS) for kv in ("key", "value")}
    sizes = {"q": HIDDEN, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    weights = [
        _initializer(f"{p}_{i}", (HIDDEN, size), 10 * i + j)
        for i in range(LAYERS)
        for j, (p, size) in enumerate(sizes.items())
    ]
    weights += [
        onnx.numpy_helper.from_array(np.array([1], np.int64), "axis_1"),
        onnx.numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    lengths = [
        helper.make_node("ReduceSum", ["attention_mask", "axis_1"], ["tokens"], keepdims=0),
        helper.make_node("Sub", ["tokens", "one"], ["last"]),
        helper.make_node("Cast", ["last"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "one"], ["total"]),
        helper.make_node("Cast", ["total"], ["total_sequence_length"], to=TensorProto.INT32),
    ]
    lengths_out = ["seqlens_k", "total_sequence_length"]

    def layer(i: int, x: str):
        projections = [helper.make_node("MatMul", [x, f"{p}_{i}"], [f"{p}{i}"]) for p in sizes]
        attention = helper.make_node(
            "GroupQueryAttention",
            [*(f"{p}{i}" for p in sizes), *(f"past_key_values.{i}.{kv}" for kv in ("key", "value")), *lengths_out],
            [f"attention_{i}", f"present.{i}.key", f"present.{i}.value"],
            name=f"GroupQueryAttention_{i}",
            domain="com.microsoft",
            num_heads=HEADS,
            kv_num_heads=KV_HEADS,
        )
        return [*projections, attention], f"attention_{i}"

    return _decoder_graph("group_query_decoder", layer, inputs, outputs, lengths, weights)


def with_attributes(model: onnx.ModelProto, **attributes) -> onnx.ModelProto:
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.extend(helper.make_attribute(name, value) for name, value in attributes.items())
    return model


@pytest.mark.parametrize(
    "attributes, reason",
    [
        ({"softcap": 30.0}, "GroupQueryAttention caps its scores (softcap=30): not a softmax of q k^T"),
        (
            {"smooth_softmax": 1},
            "GroupQueryAttention with smooth_softmax=1 (an extra zero logit per row): not a plain softmax",
        ),
        (
            {"local_window_size": 4},
            "GroupQueryAttention attends to a local window of 4 keys (sliding-window attention), which the "
            "replacement would widen to the whole context",
        ),
    ],
)
def test_a_group_query_attention_it_does_not_describe_is_left_alone_with_the_reason(attributes, reason):
    sites = attnrewrite.find_sites(with_attributes(group_query_decoder(), **attributes))
    assert [s.skip_reason for s in sites] == [reason] * LAYERS


def test_a_group_query_decoder_becomes_recurrent_and_steps_as_it_prefills(tmp_path):
    """q, k and v as three inputs, no rotary: stepped token by token, the recurrent model gives
    the logits of one prefill over the whole sequence."""
    path = saved(group_query_decoder(), tmp_path / "gqa.onnx")
    assert [s.kv_cache.kv_heads for s in attnrewrite.find_sites(str(path))] == [KV_HEADS] * LAYERS
    out = tmp_path / "recurrent.onnx"
    code, stdout, _ = cli_output(str(path), "--to", "hedgehog", "--recurrent", "-o", str(out))
    assert code == 0 and f"{LAYERS} of {LAYERS} attention sites replaced by hedgehog" in stdout
    assert op_counts(onnx.load(out))[("com.microsoft", "GroupQueryAttention")] == 0
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), np.int64)
    mask[1, :2] = 0
    whole = forced_logits(session(onnx.load(out)), "recurrent", ids, mask, prefill=9)
    stepped = forced_logits(session(onnx.load(out)), "recurrent", ids, mask, prefill=1)
    assert logits_error(stepped, whole, mask) <= TOLERANCE * np.abs(whole).max()


@pytest.mark.parametrize("build", [onnxruntime_gpt2_attention, group_query_decoder])
def test_the_hand_built_fused_decoders_run_on_onnxruntime(build):
    """They are models onnxruntime runs (a decoding step: a past of 3, one new token per row),
    each present the cache one longer: the refusals below are about real graphs."""
    model = build()
    onnx.checker.check_model(model, full_check=True)
    feeds = {"input_ids": np.array([[5], [8]], np.int64), "attention_mask": np.ones((2, 4), np.int64)}
    for value in model.graph.input[2:]:
        dims = [{"batch": 2, "past": 3}.get(d.dim_param, d.dim_value) for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = np.random.default_rng(0).normal(size=dims).astype(np.float32)
    outputs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert outputs[0].shape == (2, 1, VOCAB)
    assert {o.shape[-2] for o in outputs[1:]} == {4}


FUSED_FORMS = {
    # form: (how it is built, the reason per layer, the caches listed)
    "multi-head-past": (
        "gpt2 through onnxscript's optimize_for_ort",
        [fused_cache_inside("MultiHeadAttention", ["past_key", "past_value"])] * LAYERS,
        layer_caches(*STANDARD_CACHES, HEADS),
    ),
    "multi-head-over-concat": (
        "llama through onnxscript's attention fusions",
        [fused_cache_before("MultiHeadAttention", f"past_key_values.{i}.key") for i in range(LAYERS)],
        layer_caches(*STANDARD_CACHES, KV_HEADS),
    ),
    "attention-packed-past": (
        "onnxruntime's GPT-2 fusion, by hand",
        [fused_cache_inside("Attention", ["past"])] * LAYERS,
        [KvCache(f"past_{i}", f"past_{i}", f"present_{i}", f"present_{i}", HEADS) for i in range(LAYERS)],
    ),
}


@pytest.fixture(scope="module", params=list(FUSED_FORMS))
def fused_decoder(request, decoder_exports, tmp_path_factory) -> tuple[Path, list[str], list[KvCache]]:
    form = request.param
    path = tmp_path_factory.mktemp("fused") / f"{form}.onnx"
    if form == "multi-head-past":
        fused_by_onnxscript(decoder_exported(decoder_exports, "gpt2", "dynamo"), path, "all")
    elif form == "multi-head-over-concat":
        fused_by_onnxscript(decoder_exported(decoder_exports, "llama", "dynamo"), path, "sdpa")
    else:
        saved(onnxruntime_gpt2_attention(), path)
    _, reasons, caches = FUSED_FORMS[form]
    return path, reasons, caches


def test_each_fused_site_is_listed_with_its_cache_and_reason(fused_decoder):
    path, reasons, caches = fused_decoder
    sites = attnrewrite.find_sites(str(path))
    assert [(s.kv_cache, s.skip_reason, s.mask_label) for s in sites] == [
        (cache, reason, "unknown (kv cache)") for cache, reason in zip(caches, reasons)
    ]
    code, out, _ = cli_output(str(path), "--list")
    *rows, summary = out.splitlines()[1:]
    assert (code, summary) == (0, f"{LAYERS} attention sites, 0 rewritable")
    assert [row.split("  unknown (kv cache)  ")[1].split("unsupported: ")[1] for row in rows] == reasons


@pytest.mark.parametrize("recurrent", [False, True], ids=["parallel", "recurrent"])
def test_the_command_line_refuses_each_fused_site_and_writes_nothing(fused_decoder, recurrent, tmp_path):
    path, reasons, _ = fused_decoder
    out_path = tmp_path / "out.onnx"
    code, out, err = cli_output(
        str(path), "--to", "hedgehog", *(["--recurrent"] if recurrent else []), "-o", str(out_path)
    )
    assert (code, err.strip()) == (1, f"attnrewrite: error: {NOTHING_WRITTEN}")
    assert [row.split("skipped: ")[1] for row in out.splitlines() if "skipped: " in row] == reasons
    assert not out_path.exists()


def test_the_api_refuses_each_fused_site_and_returns_the_model_unchanged(fused_decoder):
    path, reasons, _ = fused_decoder
    with pytest.warns(NothingRewritten):
        model = attnrewrite.rewrite(str(path), to="hedgehog", recurrent=True)
    assert [(s["status"], s["reason"]) for s in read_record(model)["sites"]] == [("skipped", r) for r in reasons]
    assert op_counts(model) == op_counts(onnx.load(path))


# --- opset-23 Attention: recurrent --------------------------------------------------------------


@pytest.fixture(scope="module")
def opset23_export(decoder_exports, tmp_path_factory):
    """name -> the dynamo export at opset 23 of tests/decoders.py's model (the same weights as
    decoder_exports'), whose every attention is one Attention node over Concat(past, new)."""
    folder = tmp_path_factory.mktemp("opset23")

    @functools.cache
    def export(name: str) -> Path | ExportUnsupported:
        path = folder / f"{name}.onnx"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decoders, "OPSET", 23)
            try:
                export_decoder(DECODERS[name], decoder_exports.model(name), path, "dynamo")
            except ExportUnsupported as reason:
                return reason
        assert op_counts(onnx.load(path))[("", "Attention")] == LAYERS
        return path

    def get(name: str) -> Path:
        made = export(name)
        if isinstance(made, ExportUnsupported):
            pytest.skip(str(made))
        return made

    return get


def past_inside(path: Path) -> ir.Model:
    """The export with each Attention(q, Concat(past_k, k), Concat(past_v, v), mask) written as
    Attention(q, k, v, mask, past_k, past_v) -> (output, present_k, present_v): the opset-23
    operator appending to its cache itself. Multi-head attention only (the Concats feed it)."""
    model = ir.load(str(path))
    for node in [n for n in model.graph if n.op_type == "Attention"]:
        q, keys, values, mask = node.inputs[:4]
        concats = [keys.producer(), values.producer()]
        assert [c.op_type for c in concats] == ["Concat", "Concat"]
        inputs = [q, *(c.inputs[1] for c in concats), mask, *(c.inputs[0] for c in concats)]
        fused = ir.node("Attention", inputs, dict(node.attributes), num_outputs=3, name=node.name)
        model.graph.insert_before(node, fused)
        node.outputs[0].replace_all_uses_with(fused.outputs[0])
        for concat, present in zip(concats, fused.outputs[1:]):
            cache = concat.outputs[0]
            present.shape, present.type, name = cache.shape, cache.type, cache.name
            cache.replace_all_uses_with(present, replace_graph_outputs=True)
            cache.name, present.name = None, name
        model.graph.remove([node, *concats], safe=True)
    return model


def assert_steps_equal_the_parallel_rewrite(recurrent_model, uncached, method: str, config: str) -> None:
    """The recurrent rewrite of ``recurrent_model``, prefilled then stepped a token at a time,
    against the parallel rewrite of ``uncached`` (the same weights, no cache) on the whole sequence."""
    full = full_sequence(uncached.spec)
    expected = session(attnrewrite.rewrite(str(uncached.path), method, **CONFIGS[config])).run(["logits"], full)[0]
    recurrent_session = session(attnrewrite.rewrite(recurrent_model, method, recurrent=True, **CONFIGS[config]))
    steps = prefill_then_steps()
    for (start, end), (logits, _) in zip(steps, stepped(recurrent_session, full, steps)):
        error = logits_error(logits, expected[:, :end], full["attention_mask"][:, :end])
        assert error <= TOLERANCE * np.abs(expected).max(), (start, end, error)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_opset23_attention_over_a_concat_cache_is_a_kv_cache_site(decoder_exports, opset23_export, name):
    """Found with its cache, and rewritten in parallel over it: prefilled then stepped, the
    logits of the parallel rewrite of the no-cache export."""
    path = opset23_export(name)
    sites = attnrewrite.find_sites(str(path))
    kv_heads = DECODERS[name].kv_heads
    assert [(s.kv_cache, s.mask, s.num_heads, s.skip_reason) for s in sites] == [
        (cache, MaskKind.CAUSAL_KEY_PADDING, HEADS, None) for cache in layer_caches(*STANDARD_CACHES, kv_heads)
    ]
    uncached = decoder_exported(decoder_exports, name, "dynamo", cache=False)
    full = full_sequence(uncached.spec)
    expected = session(attnrewrite.rewrite(str(uncached.path), "hedgehog")).run(["logits"], full)[0]
    model = session(attnrewrite.rewrite(str(path), to="hedgehog"))
    actual = forced_logits(model, "parallel", full["input_ids"], full["attention_mask"], prefill=5)
    assert logits_error(actual, expected, full["attention_mask"]) <= TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize(("method", "config"), [("hedgehog", "plain"), ("favor", "window")])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_opset23_attention_decoders_become_recurrent(decoder_exports, opset23_export, name, method, config):
    uncached = decoder_exported(decoder_exports, name, "dynamo", cache=False)
    assert_steps_equal_the_parallel_rewrite(str(opset23_export(name)), uncached, method, config)


@pytest.mark.parametrize(("method", "config"), [("hedgehog", "plain"), ("linear", "window")])
def test_opset23_attention_with_its_cache_inside_becomes_recurrent(decoder_exports, opset23_export, method, config):
    model = past_inside(opset23_export("gpt2"))
    (site, _) = attnrewrite.find_sites(ir.serde.serialize_model(model))
    assert site.kv_cache == layer_caches(*STANDARD_CACHES, HEADS)[0]
    uncached = decoder_exported(decoder_exports, "gpt2", "dynamo", cache=False)
    assert_steps_equal_the_parallel_rewrite(ir.serde.serialize_model(model), uncached, method, config)


# --- onnxruntime's transformer optimizer on a GPT-2 -------------------------------------------


@pytest.fixture(scope="module")
def ort_optimized_gpt2(decoder_exports, tmp_path_factory) -> Path:
    """The legacy KV-cache export through onnxruntime.transformers.optimizer (model_type gpt2):
    its layer norms and GELUs become com.microsoft operators, its attention stays standard ops
    (its GPT-2 attention patterns expect the older export with one packed ``past`` per layer)."""
    from onnxruntime.transformers.optimizer import optimize_model

    export = decoder_exported(decoder_exports, "gpt2", "legacy")
    folder = tmp_path_factory.mktemp("ort")
    with contextlib.chdir(folder):  # its shape inference leaves a model in the working directory
        optimized = optimize_model(str(export.path), model_type="gpt2", num_heads=HEADS, hidden_size=HIDDEN)
    counts = op_counts(optimized.model)
    assert counts[("com.microsoft", "SkipLayerNormalization")] > 0
    assert not {("com.microsoft", op) for op in ("Attention", "MultiHeadAttention")} & set(counts), (
        "onnxruntime's optimizer now fuses this GPT-2's attention: cover that form in FUSED_FORMS"
    )
    return saved(optimized.model, folder / "gpt2.onnx")


def test_ort_optimized_gpt2_becomes_recurrent(decoder_exports, ort_optimized_gpt2, tmp_path):
    """Its shapes, lost at the fused layer norms, come from onnxruntime's symbolic shape inference
    (io.infer_shapes)."""
    out_path = tmp_path / "out.onnx"
    code, out, _ = cli_output(str(ort_optimized_gpt2), "--to", "hedgehog", "--recurrent", "-o", str(out_path))
    assert code == 0 and f"{LAYERS} of {LAYERS} attention sites replaced by hedgehog" in out
    uncached = decoder_exported(decoder_exports, "gpt2", "legacy", cache=False)
    assert_steps_equal_the_parallel_rewrite(onnx.load(ort_optimized_gpt2), uncached, "hedgehog", "plain")


# --- GroupQueryAttention's rotation, against the operator's own ------------------------------------

GQA_HEADS, GQA_KV_HEADS, GQA_HEAD, GQA_POSITIONS = 4, 2, 32, 64


def _rotary_tables(rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(GQA_POSITIONS), 10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _operator_keys(query, past, seqlens, rotary_dim: int, interleaved: int) -> np.ndarray:
    """present_key of onnxruntime's GroupQueryAttention (do_rotary=1) on packed ``query``."""
    cos, sin = _rotary_tables(rotary_dim)
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=GQA_HEADS,
        kv_num_heads=GQA_KV_HEADS,
        do_rotary=1,
        rotary_interleaved=interleaved,
    )
    graph = helper.make_graph(
        [node],
        "gqa",
        [
            helper.make_tensor_value_info("query", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("past_value", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
            helper.make_tensor_value_info("total", TensorProto.INT32, None),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output],
        [onnx.numpy_helper.from_array(cos, "cos"), onnx.numpy_helper.from_array(sin, "sin")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    total = np.array(past.shape[2] + query.shape[1], np.int32)
    feeds = {"query": query, "past_key": past, "past_value": past, "seqlens_k": seqlens, "total": total}
    return session(model).run(["present_key"], feeds)[0]


def _our_keys(query, mask, rotary_dim: int, interleaved: int) -> np.ndarray:
    """The rotated keys [B, kv_heads, N, D] grouped_query.py builds for the same operator."""
    from attnrewrite.onnx.detect import GroupedQueryPlan
    from attnrewrite.onnx.graph_edit import GraphEditor
    from attnrewrite.onnx.grouped_query import GroupedQueryNodes

    cos, sin = (ir.Value(name=n, const_value=ir.tensor(t)) for n, t in zip(("cos", "sin"), _rotary_tables(rotary_dim)))
    x = ir.Value(name="query", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["b", "n", query.shape[2]]))
    keep = ir.Value(name="mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["b", "t"]))
    graph = ir.Graph([x, keep], [], nodes=[], initializers=[cos, sin], opset_imports={"": 18})
    nodes: list[ir.Node] = []
    plan = GroupedQueryPlan(GQA_HEADS, GQA_KV_HEADS, GQA_HEAD, x, None, None, (cos, sin), rotary_dim, bool(interleaved))
    _, k, _ = GroupedQueryNodes(GraphEditor(graph), keep).heads(plan, nodes)
    graph.extend(nodes)
    k.name = "k"
    graph.outputs.append(k)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    return session(model).run(["k"], {"query": query, "mask": mask})[0]


@pytest.mark.parametrize("interleaved", [0, 1], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [GQA_HEAD, GQA_HEAD // 2], ids=["full", "partial"])
def test_the_unpacked_keys_are_rotated_as_group_query_attention_rotates_them(rotary_dim, interleaved):
    """A prompt of three rows right padded as onnxruntime-genai pads them (lengths 7, 4, 1),
    then a decoding step after them: the keys grouped_query.py rotates are the ones the operator
    writes into its cache, at every real position."""
    rng = np.random.default_rng(0)
    width = (GQA_HEADS + 2 * GQA_KV_HEADS) * GQA_HEAD
    lengths = np.array([7, 4, 1])
    prompt = rng.standard_normal((3, 7, width)).astype(np.float32)
    mask = (np.arange(7) < lengths[:, None]).astype(np.int64)
    empty = np.zeros((3, GQA_KV_HEADS, 0, GQA_HEAD), np.float32)
    cache = _operator_keys(prompt, empty, (lengths - 1).astype(np.int32), rotary_dim, interleaved)
    ours = _our_keys(prompt, mask, rotary_dim, interleaved)
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(ours[row, :, :length], cache[row, :, :length], atol=1e-5)
    step = rng.standard_normal((3, 1, width)).astype(np.float32)
    cache = _operator_keys(step, cache, lengths.astype(np.int32), rotary_dim, interleaved)
    ours = _our_keys(step, np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1), rotary_dim, interleaved)
    for row, length in enumerate(lengths):  # the new key lies right after the row's real tokens
        np.testing.assert_allclose(ours[row, :, 0], cache[row, :, length], atol=1e-5)
