"""onnxruntime's fused attention operators (domain com.microsoft) as sites.

Each form is a hand-built one-node model whose q, k, v ([batch, heads, seq, head_dim]), key mask
and causality the test derives from the inputs by the operator's spec (onnxruntime's
docs/ContribOperators.md). First the reading of the spec is checked: exact softmax attention on
those q, k, v is what onnxruntime's own kernel computes. Then the rewritten model must compute
the pass's torch module on the same q, k, v. Last, a small BERT through onnxruntime's
transformer optimizer, in its Attention and its MultiHeadAttention form.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from attention_graphs import expected_refusal
from conftest import exported, read_record
from models import (
    APPROXIMATING_OPTIONS,
    HEADS,
    HIDDEN,
    VOCAB,
    exact_attention,
    op_counts,
    relative_error,
    run_onnx,
    run_pass_module,
    text_feed,
    torch_reference,
)
from onnx import TensorProto, helper

import attnrewrite
from attnrewrite import passes
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.masks import inputs_marking_padding
from attnrewrite.site import KvCache

TOLERANCE = 1e-5  # fp32 relative error: implementation parity (docs/ARCHITECTURE.md)
METHODS = tuple(passes.PASSES)
BATCH, SEQ, NUM_HEADS, HEAD_DIM = 3, 7, 2, 4
FEATURES = NUM_HEADS * HEAD_DIM
CONTRIB_OPS = {("com.microsoft", op) for op in ("Attention", "MultiHeadAttention")}
# the right-padded key lengths every masked case uses (row 0 unpadded)
LENGTHS = np.array([SEQ, SEQ - 2, SEQ - 4], np.int32)

FUSED_ADVICE = (
    "attnrewrite rewrites it neither in parallel nor with --recurrent; rewrite the decoder as exported, before "
    "onnxruntime's fusion (--recurrent takes KV caches appended by Concat, opset-23 Attention or GroupQueryAttention)"
)


@dataclasses.dataclass
class Case:
    """A one-node model and what it computes by the spec: softmax(scale q k^T) v over the kept keys."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    keep: np.ndarray | None  # [batch, 1, keys, 1], 1.0 = attend; None: every key
    causal: bool
    mask: str  # the kind detection must classify
    scale: float = HEAD_DIM**-0.5
    cpu_kernel: bool = True  # onnxruntime's CPU provider implements this form


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _heads(x: np.ndarray) -> np.ndarray:
    """[batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]"""
    return x.reshape(x.shape[0], x.shape[1], NUM_HEADS, -1).transpose(0, 2, 1, 3)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def _keep_from_lengths(lengths: np.ndarray) -> np.ndarray:
    return (np.arange(SEQ) < lengths[:, None]).astype(np.float32)[:, None, :, None]


def _contrib_model(
    op: str, inputs: list[str], graph_inputs: dict, initializers: dict, before=(), **attributes
) -> onnx.ModelProto:
    """One com.microsoft node (after the nodes ``before``); ``graph_inputs``: name -> (elem_type,
    declared shape). An Identity follows, so a splice must hand its output to a consumer."""
    node = helper.make_node(op, inputs, ["attended"], name="fused", domain="com.microsoft", **attributes)
    graph = helper.make_graph(
        [*before, node, helper.make_node("Identity", ["attended"], ["output"], name="output")],
        f"contrib_{op}",
        [helper.make_tensor_value_info(name, elem, shape) for name, (elem, shape) in graph_inputs.items()],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", "features"])],
        [onnx.numpy_helper.from_array(array, name) for name, array in initializers.items()],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


HIDDEN_STATES = (TensorProto.FLOAT, ["batch", "seq", FEATURES])


def attention_case(
    mask: str = "none", unidirectional: bool = False, v_size: int = FEATURES, scale: float | None = None
) -> Case:
    """com.microsoft.Attention: q | k | v = input @ weights + bias. ``mask``: none, lengths
    (mask_index [batch]), ranges ([2 * batch], left padding), raw ([batch, keys]),
    raw3d ([batch, queries, keys])."""
    rng = _rng(len(mask) + unidirectional)
    x = rng.standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32)
    weights = (rng.standard_normal((FEATURES, 2 * FEATURES + v_size)) / FEATURES**0.5).astype(np.float32)
    bias = rng.standard_normal(2 * FEATURES + v_size).astype(np.float32)
    projected = x @ weights + bias
    q, k, v = (_heads(p) for p in np.split(projected, [FEATURES, 2 * FEATURES], axis=-1))
    graph_inputs, feeds, inputs = {"x": HIDDEN_STATES}, {"x": x}, ["x", "weights", "bias"]
    keep, kind = None, "none"
    if mask != "none":
        mask_index, declared, keep = _mask_index(mask)
        graph_inputs["mask_index"] = (TensorProto.INT32, declared)
        feeds["mask_index"], inputs, kind = mask_index, [*inputs, "mask_index"], "key_padding"
    if mask == "ranges":  # [2 * batch] is told from [batch] by a fixed batch
        graph_inputs["x"] = (TensorProto.FLOAT, [BATCH, "seq", FEATURES])
    attributes = {"num_heads": NUM_HEADS, "unidirectional": int(unidirectional)}
    if v_size != FEATURES:
        attributes["qkv_hidden_sizes"] = [FEATURES, FEATURES, v_size]
    if scale is not None:
        attributes["scale"] = scale
    model = _contrib_model("Attention", inputs, graph_inputs, {"weights": weights, "bias": bias}, **attributes)
    kind = {"none": "causal", "key_padding": "causal+key_padding"}[kind] if unidirectional else kind
    return Case(model, feeds, q, k, v, keep, unidirectional, kind, scale=scale or HEAD_DIM**-0.5)


def _mask_index(form: str) -> tuple[np.ndarray, list, np.ndarray]:
    """(mask, its declared shape, keep [batch, 1, keys, 1]) for onnxruntime's mask forms."""
    keep = _keep_from_lengths(LENGTHS)
    if form == "lengths":
        return LENGTHS, ["batch"], keep
    if form == "ranges":  # exclusive ends, then starts: rows 1 and 2 padded on both sides
        ends, starts = np.array([SEQ, SEQ - 1, SEQ - 2], np.int32), np.array([0, 2, 3], np.int32)
        positions = np.arange(SEQ)
        keep = ((positions >= starts[:, None]) & (positions < ends[:, None])).astype(np.float32)[:, None, :, None]
        return np.concatenate([ends, starts]), [2 * BATCH], keep
    raw = keep[:, 0, :, 0].astype(np.int32)
    if form == "raw":
        return raw, ["batch", "seq"], keep
    if form == "raw3d":
        return np.repeat(raw[:, None, :], SEQ, axis=1), ["batch", "seq", "seq"], keep
    raise ValueError(form)


def multi_head_case(form: str = "separate", mask: str = "none", unidirectional: bool = False) -> Case:
    """com.microsoft.MultiHeadAttention. ``form``: separate q, k, v [batch, seq, hidden] with a
    bias, split_kv (k, v as [batch, heads, seq, head_dim]), packed_kv ([batch, seq, heads, 2,
    head_dim]) or packed_qkv ([..., 3, head_dim]).
    ``mask``: none, raw / lengths (key_padding_mask), bias_mask (attention_bias of 0 and
    -10000 computed from an attention_mask input, as exporters write it), learned_bias (an
    attention_bias initializer that is not a mask, like a trained position bias)."""
    rng = _rng(len(form) + len(mask))
    q3, k3, v3 = (rng.standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal(3 * FEATURES).astype(np.float32) if form == "separate" else None
    if bias is not None:
        q, k, v = (_heads(x + b) for x, b in zip((q3, k3, v3), np.split(bias, 3)))
    else:
        q, k, v = (_heads(x) for x in (q3, k3, v3))
    per_head = [x.reshape(BATCH, SEQ, NUM_HEADS, 1, HEAD_DIM) for x in (q3, k3, v3)]
    if form == "separate":
        feeds = {"query": q3, "key": k3, "value": v3}
        inputs = ["query", "key", "value", "bias"]
    elif form == "split_kv":  # cross-attention's precomputed k, v: already [batch, heads, seq, head_dim]
        feeds = {"query": q3, "key": np.ascontiguousarray(k), "value": np.ascontiguousarray(v)}
        inputs = ["query", "key", "value", ""]
    elif form == "packed_kv":
        feeds = {"query": q3, "key": np.concatenate(per_head[1:], axis=3)}
        inputs = ["query", "key", "", ""]
    else:
        feeds = {"query": np.concatenate(per_head, axis=3)}
        inputs = ["query", "", "", ""]
    graph_inputs = {name: (TensorProto.FLOAT, ["batch", *feeds[name].shape[1:]]) for name in feeds}
    for name, array in feeds.items():  # the sequence axis dynamic
        graph_inputs[name][1][2 if array.ndim == 4 else 1] = "seq"
    initializers = {"bias": bias} if bias is not None else {}
    keep, kind, before = None, "none", []
    if mask in ("raw", "lengths"):
        feeds["key_padding_mask"], declared, keep = _mask_index(mask)
        graph_inputs["key_padding_mask"] = (TensorProto.INT32, declared)
        inputs, kind = [*inputs, "key_padding_mask"], "key_padding"
    elif mask == "bias_mask":
        feeds["attention_mask"], declared, keep = _mask_index("raw")
        graph_inputs["attention_mask"] = (TensorProto.INT32, declared)
        before = _additive_mask_nodes("attention_mask", "attention_bias")
        inputs, kind = [*inputs, "", "attention_bias"], "key_padding"
    elif mask == "learned_bias":
        initializers["attention_bias"] = rng.standard_normal((1, NUM_HEADS, SEQ, SEQ)).astype(np.float32)
        inputs, kind = [*inputs, "", "attention_bias"], "bias"
    model = _contrib_model(
        "MultiHeadAttention",
        inputs,
        graph_inputs,
        initializers,
        before,
        num_heads=NUM_HEADS,
        unidirectional=int(unidirectional),
    )
    kind = {"none": "causal", "key_padding": "causal+key_padding"}.get(kind, kind) if unidirectional else kind
    return Case(model, feeds, q, k, v, keep, unidirectional, kind, cpu_kernel=not form.startswith("packed"))


def _additive_mask_nodes(mask: str, output: str) -> list[onnx.NodeProto]:
    """(1 - mask) * -10000 as [batch, 1, queries, keys] (onnxruntime broadcasts attention_bias
    over batch and heads only)."""

    def const(name, value, dtype=TensorProto.INT64):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, [len(value)], value))

    return [
        const("one", [1.0], TensorProto.FLOAT),
        const("fill", [-10000.0], TensorProto.FLOAT),
        const("axes", [1, 2]),
        const("unit", [1]),
        helper.make_node("Cast", [mask], ["keep"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "keep"], ["dropped"]),
        helper.make_node("Mul", ["dropped", "fill"], ["row"]),
        helper.make_node("Unsqueeze", ["row", "axes"], ["row_4d"]),
        helper.make_node("Shape", [mask], ["batch"], start=0, end=1),
        helper.make_node("Shape", [mask], ["keys"], start=1, end=2),
        helper.make_node("Concat", ["batch", "unit", "keys", "keys"], ["bias_shape"], axis=0),
        helper.make_node("Expand", ["row_4d", "bias_shape"], [output]),
    ]


CASES = {
    "attention": lambda: attention_case(),
    "attention-mask-lengths": lambda: attention_case("lengths"),
    "attention-mask-ranges": lambda: attention_case("ranges"),
    "attention-mask-raw": lambda: attention_case("raw"),
    "attention-mask-raw3d": lambda: attention_case("raw3d"),
    "attention-unidirectional": lambda: attention_case(unidirectional=True),
    "attention-unidirectional-lengths": lambda: attention_case("lengths", unidirectional=True),
    "attention-v-size-scale": lambda: attention_case("raw", v_size=FEATURES // 2, scale=0.5),
    "mha-separate-raw": lambda: multi_head_case("separate", "raw"),
    "mha-separate-lengths": lambda: multi_head_case("separate", "lengths"),
    "mha-separate-unidirectional": lambda: multi_head_case("separate", unidirectional=True),
    "mha-attention-bias-mask": lambda: multi_head_case("separate", "bias_mask"),
    "mha-split-kv-lengths": lambda: multi_head_case("split_kv", "lengths"),
    "mha-packed-kv-raw": lambda: multi_head_case("packed_kv", "raw"),
    "mha-packed-qkv": lambda: multi_head_case("packed_qkv"),
}


def _expected_attention(case: Case) -> np.ndarray:
    keep = case.keep if case.keep is not None else np.ones((1, 1, case.k.shape[2], 1), np.float32)
    return _merge_heads(exact_attention(case.q, case.k, case.v, keep, case.scale, case.causal))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]().cpu_kernel])
def test_onnxruntime_kernel_is_the_softmax_attention_the_spec_describes(name):
    """The test's reading of each form (q, k, v, key mask, causality) against onnxruntime's own
    kernel. (The CPU provider has no kernel for packed kv / qkv: those forms rest on the spec.)"""
    case = CASES[name]()
    assert relative_error(run_onnx(case.model, case.feeds), _expected_attention(case)) < TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_sites_are_found_with_their_mask_kind(name):
    case = CASES[name]()
    sites = attnrewrite.find_sites(case.model)
    value_dim = case.v.shape[-1]
    assert [(s.mask.value, s.num_heads, s.head_dim, s.value_dim, s.skip_reason) for s in sites] == [
        (case.mask, NUM_HEADS, HEAD_DIM, value_dim, None)
    ]
    assert sites[0].scale == pytest.approx(case.scale)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", CASES)
def test_rewrite_matches_the_pass_on_the_unpacked_q_k_v(name, method):
    case = CASES[name]()
    method_pass = passes.get_pass(method)
    options = passes.make_options(method_pass, **APPROXIMATING_OPTIONS.get(method, {}))
    (site,) = attnrewrite.find_sites(case.model)
    out = attnrewrite.rewrite(case.model, to=method, **APPROXIMATING_OPTIONS.get(method, {}))
    outcomes = [(s["status"], s["reason"]) for s in read_record(out)["sites"]]
    refusal = expected_refusal(method, case.mask, HEAD_DIM, case.v.shape[-1])
    if refusal is not None:  # linformer and causal, hydra and a value size unlike the head size
        assert outcomes == [("skipped", refusal)]
        return
    assert outcomes == [("rewritten", None)]
    ops = op_counts(out)
    assert not CONTRIB_OPS & set(ops)
    assert len([n for n in out.graph.node if n.domain == "attnrewrite"]) == 1

    expected = _merge_heads(run_pass_module(method_pass.torch_module(site, options), case.q, case.k, case.v, case.keep))
    assert relative_error(run_onnx(out, case.feeds), expected) < TOLERANCE


# --- what is refused, and why -------------------------------------------------------------------


def _refusal(model: onnx.ModelProto) -> tuple[str, str]:
    (site,) = attnrewrite.find_sites(model)
    return site.mask.value, site.skip_reason


def test_attention_bias_that_is_not_a_mask_is_refused():
    case = multi_head_case("separate", "learned_bias")
    assert _refusal(case.model) == (
        "bias",
        "the additive term on the logits is an attention bias, not a mask (values other than 0 and large negatives)",
    )
    out = attnrewrite.rewrite(case.model, to="linear")
    assert op_counts(out)[("com.microsoft", "MultiHeadAttention")] == 1
    assert [s["status"] for s in read_record(out)["sites"]] == ["skipped"]


def test_group_query_attention_over_its_cache_is_the_pass_on_past_and_new_keys():
    """Given seqlens_k and total_sequence_length (no attention mask), each row's new tokens
    follow its real ones in the cache: the parallel rewrite is the pass's causal module over
    those keys, each new query at its row (onnxruntime runs the operator at head sizes that are
    multiples of 8)."""
    kv_heads, past, new, head_dim = 1, 5, 1, 8  # onnxruntime takes a past with one new token per row
    features = NUM_HEADS * head_dim
    graph_inputs = {
        "query": (TensorProto.FLOAT, ["batch", "seq", features]),
        "key": (TensorProto.FLOAT, ["batch", "seq", kv_heads * head_dim]),
        "value": (TensorProto.FLOAT, ["batch", "seq", kv_heads * head_dim]),
        "past_key": (TensorProto.FLOAT, ["batch", kv_heads, past, head_dim]),
        "past_value": (TensorProto.FLOAT, ["batch", kv_heads, past, head_dim]),
        "seqlens_k": (TensorProto.INT32, ["batch"]),
        "total_sequence_length": (TensorProto.INT32, []),
    }
    model = _contrib_model(
        "GroupQueryAttention", list(graph_inputs), graph_inputs, {}, num_heads=NUM_HEADS, kv_num_heads=kv_heads
    )
    (site,) = attnrewrite.find_sites(model)
    assert (site.kv_cache, site.skip_reason, site.mask_label) == (
        KvCache("past_key", "past_value", None, None, kv_heads),
        None,
        "causal+key_padding (kv cache)",
    )
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal([BATCH, new, width]).astype(np.float32)
             for name, width in (("query", features), ("key", head_dim), ("value", head_dim))}  # fmt: skip
    feeds |= {name: rng.standard_normal([BATCH, kv_heads, past, head_dim]).astype(np.float32) for name in ("past_key", "past_value")}  # fmt: skip
    real = np.array([past, past - 2, 1])  # each row's cached tokens: the rest of its cache is padding
    feeds |= {"seqlens_k": (real + new - 1).astype(np.int32), "total_sequence_length": np.array(past + new, np.int32)}
    out = attnrewrite.rewrite(model, to="linear", inputs=feeds)  # random seqlens_k would not run
    assert [s["status"] for s in read_record(out)["sites"]] == ["rewritten"]
    keys = np.zeros([BATCH, NUM_HEADS, past + new, head_dim], np.float32)
    values, queries, keep = keys.copy(), keys.copy(), np.zeros([BATCH, 1, past + new, 1], np.float32)
    for row, cached in enumerate(real):  # the row's cached tokens, its new ones after them
        heads = lambda x: x.reshape(new, -1, head_dim).transpose(1, 0, 2)  # noqa: E731
        keys[row, :, :cached], values[row, :, :cached] = (
            feeds["past_key"][row, :, :cached],
            feeds["past_value"][row, :, :cached],
        )
        keys[row, :, cached : cached + new] = heads(feeds["key"][row])
        values[row, :, cached : cached + new] = heads(feeds["value"][row])
        queries[row, :, cached : cached + new] = heads(feeds["query"][row])
        keep[row, 0, : cached + new] = 1.0
    module = passes.linear.torch_module(site, passes.make_options(passes.linear))
    everywhere = run_pass_module(module, queries, keys, values, keep)
    expected = np.stack([everywhere[row, :, cached : cached + new] for row, cached in enumerate(real)])
    assert relative_error(run_onnx(out, feeds), _merge_heads(expected)) < TOLERANCE


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"past": True}, "com.microsoft.Attention keeps its KV cache inside the operator (past): " + FUSED_ADVICE),
        ({"do_rotary": 1}, "Attention applies rotary embeddings inside the operator (do_rotary=1)"),
        (
            {"mask_filter_value": -1.0},
            "Attention masks with mask_filter_value=-1, which leaves masked keys a weight: a bias, not a mask",
        ),
        (
            {"mask_declared": ["batch", 1, "seq", "seq"]},
            "a 4-D mask_index ([batch, 1, max_sequence_length, max_sequence_length]) is not supported",
        ),
        (
            {"mask_declared": ["keys"]},
            "the 1-D mask index 'mask_index' is declared [keys] for a batch of batch: "
            "cannot tell key lengths [batch] from end and start positions [2 * batch]",
        ),
    ],
    ids=["past", "rotary", "mild-mask-filter", "mask-4d", "undeclared-index"],
)
def test_attention_forms_it_cannot_express_are_refused_with_the_reason(change, reason):
    change = dict(change)
    graph_inputs = {"x": HIDDEN_STATES, "mask_index": (TensorProto.INT32, change.pop("mask_declared", ["batch"]))}
    inputs = ["x", "weights", "bias", "mask_index"]
    if change.pop("past", False):
        graph_inputs["past"] = (TensorProto.FLOAT, [2, "batch", NUM_HEADS, "past", HEAD_DIM])
        inputs.append("past")
    initializers = {
        "weights": np.zeros((FEATURES, 3 * FEATURES), np.float32),
        "bias": np.zeros(3 * FEATURES, np.float32),
    }
    model = _contrib_model("Attention", inputs, graph_inputs, initializers, num_heads=NUM_HEADS, **change)
    assert _refusal(model)[1] == reason


# --- end to end: a BERT through onnxruntime's transformer optimizer ------------------------------


@pytest.fixture(scope="module", params=["Attention", "MultiHeadAttention"])
def optimized_bert(request, exports, tmp_path_factory):
    """The legacy export of tests/models.py's BERT, fused by onnxruntime's optimizer into
    ``Attention`` or (use_multi_head_attention) ``MultiHeadAttention`` nodes."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    export = exported(exports, "bert-eager", "legacy")
    options = FusionOptions("bert")
    options.use_multi_head_attention = request.param == "MultiHeadAttention"
    fused = optimize_model(
        str(export.path), model_type="bert", num_heads=HEADS, hidden_size=HIDDEN, optimization_options=options
    )
    assert op_counts(fused.model)[("com.microsoft", request.param)] == export.spec.layers
    return export, fused.model


@pytest.mark.parametrize("method", METHODS)
def test_optimized_bert_rewrites_and_matches_the_torch_model_with_the_pass(optimized_bert, method):
    """Whole-model parity: the fused, rewritten model against the torch BERT whose attention
    runs the pass's torch module. The optimizer reads the attention mask as key lengths
    (EmbedLayerNormalization's mask_index: right padding), so the inputs are right padded."""
    export, model = optimized_bert
    sites = attnrewrite.find_sites(model)
    assert [(s.layer, s.mask.value, s.num_heads, s.head_dim, s.skip_reason) for s in sites] == [
        (layer, "key_padding", HEADS, HIDDEN // HEADS, None) for layer in range(export.spec.layers)
    ]
    options = APPROXIMATING_OPTIONS.get(method, {})
    refusal = expected_refusal(method, "key_padding", HIDDEN // HEADS, HIDDEN // HEADS)
    if refusal is not None:  # streaming: BERT is bidirectional
        assert passes.get_pass(method).supports(sites[0], passes.make_options(passes.get_pass(method))) == refusal
        return
    out = attnrewrite.rewrite(model, to=method, **options)
    assert read_record(out)["sites_rewritten"] == export.spec.layers
    assert not CONTRIB_OPS & set(op_counts(out))

    feeds = text_feed(11, VOCAB)
    inputs = {name: torch.from_numpy(array) for name, array in feeds.items()}
    method_pass = passes.get_pass(method)
    expected, state = torch_reference(
        export, method, inputs, options=passes.make_options(method_pass, **options), sites=sites
    )
    assert state["calls"] == export.spec.layers
    assert relative_error(run_onnx(out, feeds), expected) < TOLERANCE


def test_optimized_bert_attention_mask_is_read_as_one_means_token(optimized_bert):
    """The check's generated inputs pad where the mask input is 0: reaching the sites through
    mask_index (key lengths), attention_mask must not pass for an input whose 1 marks padding."""
    _, model = optimized_bert
    assert inputs_marking_padding(onnx_io.infer_shapes(onnx_io.from_proto(model))) == set()
