"""Decoders exported for generation (tests/decoders.py): every attention site is found with its
KV cache, its mask is causal with the past as offset, and inputs follow the model's contract
(past length, a mask over past and new positions, position ids counting on). Until the
recurrent rewrite exists a KV-cache site is refused with the reason. Also the fused forms with a
cache (opset-23 Attention, onnxruntime's contrib operators) and the same contract problem outside
decoders: an nn.TransformerEncoder the legacy exporter baked its traced length into.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from conftest import decoder_exported, read_record
from decoders import (
    DECODERS,
    cache_input_names,
    cache_output_names,
    logits_error,
    next_step_feeds,
    positions_of,
    run,
)
from models import HIDDEN, TorchEncoder, _seeded
from onnx import TensorProto, helper
from torch import nn

import attnrewrite
from attnrewrite import cli
from attnrewrite.errors import InputFails, NothingRewritten
from attnrewrite.onnx.detect import find_onnx_sites
from attnrewrite.onnx.inputs import cache_contract, generate_inputs
from attnrewrite.onnx.io import infer_shapes
from attnrewrite.onnx.limits import PositionLimit, position_limit
from attnrewrite.onnx.masks import classify_keep_matrix
from attnrewrite.onnx.rewrite import PARALLEL_CACHE_NOTE, analyze
from attnrewrite.onnx.validate import validate
from attnrewrite.site import KV_PROBE_PAST, KvCache, MaskKind

EXPORTERS = ("legacy", "dynamo")
# the two exporters on the two shapes that matter most (multi-head; grouped-query with rotary),
# the others through the faster legacy exporter (their dynamo exports are the same spelling)
CASES = [(name, "legacy") for name in DECODERS] + [("gpt2", "dynamo"), ("llama", "dynamo")]


def expected_caches(name: str) -> list[KvCache]:
    spec = DECODERS[name]
    pasts, presents = cache_input_names(spec), cache_output_names(spec)
    return [KvCache(*pasts[2 * i : 2 * i + 2], *presents[2 * i : 2 * i + 2], spec.kv_heads) for i in range(spec.layers)]


@pytest.mark.parametrize("name, exporter", CASES)
def test_every_site_is_found_with_its_cache(decoder_exports, name, exporter):
    export = decoder_exported(decoder_exports, name, exporter)
    model = export.load()
    sites = attnrewrite.find_sites(model)
    assert [s.kv_cache for s in sites] == expected_caches(name)
    assert [(s.layer, s.mask, s.skip_reason) for s in sites] == [
        (layer, MaskKind.CAUSAL_KEY_PADDING, None) for layer in range(export.spec.layers)
    ]
    assert {s.mask_label for s in sites} == {"causal+key_padding (kv cache)"}
    assert sites[0].describe()["kv_cache"]["past_key"] == "past_key_values.0.key"


# q [batch, heads, seq, head_dim] by a head split: through rotary (Llama, Qwen2, Falcon), a
# reshape to the same dims (Falcon's legacy export)
HEADS_KNOWN = [(name, exporter) for name in ("llama", "qwen2", "falcon") for exporter in EXPORTERS]


@pytest.mark.parametrize("name, exporter", HEADS_KNOWN)
def test_a_rotated_query_still_says_its_heads(decoder_exports, name, exporter):
    """What a site knows of its heads decides a grouped-query recurrent window's layout (each
    key/value head kept once) and the heads hydra mixes."""
    export = decoder_exported(decoder_exports, name, exporter)
    assert {s.num_heads for s in attnrewrite.find_sites(export.load())} == {export.spec.heads}


@pytest.mark.parametrize("name, exporter", [("llama", "legacy"), ("llama", "dynamo"), ("falcon", "legacy")])
def test_the_cache_concat_is_recorded_for_the_splice(decoder_exports, name, exporter):
    """The ONNX details of each cache: Concat(past, new) on the sequence axis, the new keys (rotated,
    before grouped heads are repeated: kv_heads of them), the graph input and output."""
    export = decoder_exported(decoder_exports, name, exporter)
    model = infer_shapes(ir.from_proto(export.load()))
    for layer, s in enumerate(find_onnx_sites(model.graph)):
        for cached, kind in ((s.key_cache, "key"), (s.value_cache, "value")):
            assert cached.node.op_type == "Concat"
            assert cached.past.name == f"past_key_values.{layer}.{kind}" and cached.past.is_graph_input()
            assert cached.output.name == f"present.{layer}.{kind}" and cached.output.is_graph_output()
            assert cached.node.inputs[1] is cached.new
            assert cached.kv_heads == export.spec.kv_heads
        rotary = s.key_cache.new.producer()
        assert rotary.op_type == "Add"  # k * cos + rotate_half(k) * sin: rotated before the cache


class RepeatInterleaved(nn.Module):
    """One attention over a KV cache whose 2 key/value heads reach the 4 query heads by
    repeat_interleave (Tile in the legacy export, Expand in the dynamo one) rather than repeat_kv."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x, past_key, past_value):
        batch, new, _ = x.shape
        q = self.q(x).view(batch, new, 4, 4).transpose(1, 2)
        k = torch.cat([past_key, self.k(x).view(batch, new, 2, 4).transpose(1, 2)], 2)
        v = torch.cat([past_value, self.v(x).view(batch, new, 2, 4).transpose(1, 2)], 2)
        attended = torch.softmax(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5, -1)
        return attended @ v.repeat_interleave(2, dim=1), k, v


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_key_value_heads_repeated_by_repeat_interleave(tmp_path, exporter):
    module, path = RepeatInterleaved().eval(), str(tmp_path / "model.onnx")
    args = (torch.randn(2, 3, 16), torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 4))
    names, outputs = ["x", "past_key", "past_value"], ["output", "present_key", "present_value"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {"x": {0: "batch", 1: "seq"}, **dict.fromkeys(names[1:], {0: "batch", 2: "past"})}
            torch.onnx.export(
                module, args, path, input_names=names, output_names=outputs, dynamic_axes=axes, dynamo=False
            )
        else:
            batch, seq, past = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
            shapes = ({0: batch, 1: seq}, {0: batch, 2: past}, {0: batch, 2: past})
            program = torch.onnx.export(
                module, args, input_names=names, output_names=outputs, dynamic_shapes=shapes, dynamo=True
            )
            program.save(path)
    (site,) = attnrewrite.find_sites(onnx.load(path))
    assert site.kv_cache == KvCache("past_key", "past_value", "present_key", "present_value", 2)
    assert (site.mask_label, site.skip_reason) == ("none (kv cache)", None)


def test_mask_of_a_cache_is_causal_with_the_past_as_offset():
    queries, past = 4, KV_PROBE_PAST
    keys = queries + past
    triangle = np.tril(np.ones((queries, keys), bool), k=past)  # query i sees keys up to past + i
    padding = np.ones((2, 1, 1, keys), bool)
    padding[1, ..., :2] = False
    assert classify_keep_matrix(triangle, queries, keys, past=past) is MaskKind.CAUSAL
    assert classify_keep_matrix(triangle & padding, queries, keys, past=past) is MaskKind.CAUSAL_KEY_PADDING
    top_left = np.tril(np.ones((queries, keys), bool))  # the past ignored: not a decoder's mask
    with pytest.raises(Exception, match="neither key padding nor causal"):
        classify_keep_matrix(top_left, queries, keys, past=past)
    with pytest.raises(Exception, match="is not a key padding mask"):
        classify_keep_matrix(triangle, queries, keys, past=0)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_generated_inputs_follow_the_cache_contract(decoder_exports, exporter):
    export = decoder_exported(decoder_exports, "llama", exporter)
    graph = ir.from_proto(export.load()).graph
    contract = cache_contract(graph)
    assert contract.past_axes == dict.fromkeys(cache_input_names(export.spec), 2)
    assert [v.name for v in contract.mask_inputs(graph)] == ["attention_mask"]
    assert [v.name for v in contract.position_inputs(graph)] == ["position_ids"]
    feeds = generate_inputs(graph, batch=2, seq=5)
    assert feeds["input_ids"].shape == (2, 5)
    assert feeds["attention_mask"].tolist() == [[1] * 8, [0, 0] + [1] * 6]  # left padding, in the past
    assert feeds["position_ids"].tolist() == [[3, 4, 5, 6, 7], [1, 2, 3, 4, 5]]
    assert {feeds[n].shape for n in cache_input_names(export.spec)} == {(2, 2, KV_PROBE_PAST, 8)}


@pytest.mark.parametrize("name, exporter", [("gpt2", "legacy"), ("llama", "dynamo"), ("opt", "legacy")])
def test_the_original_on_contract_inputs_equals_its_no_cache_export(decoder_exports, name, exporter):
    """No regression: the KV-cache model fed what the probes and gates generate (its past
    replaced by the one it caches for a prefix), then two decoding steps, gives on all P + N + 2
    positions the logits of its own no-cache export."""
    cached = decoder_exported(decoder_exports, name, exporter)
    uncached = decoder_exported(decoder_exports, name, exporter, cache=False)
    spec = cached.spec
    feeds = generate_inputs(ir.from_proto(cached.load()).graph, batch=2, seq=4)
    mask = feeds["attention_mask"]
    prefix = {"input_ids": np.random.default_rng(1).integers(2, spec.vocab, (2, KV_PROBE_PAST))}
    prefix["attention_mask"] = mask[:, :KV_PROBE_PAST]
    if spec.position_ids:
        prefix["position_ids"] = positions_of(prefix["attention_mask"])
        assert feeds["position_ids"].tolist() == positions_of(mask)[:, KV_PROBE_PAST:].tolist()
    empty = np.zeros((2, spec.kv_heads, 0, spec.head_dim), np.float32)
    steps = [(prefix, run(cached, {**prefix, **dict.fromkeys(cache_input_names(spec), empty)}))]
    feeds.update(zip(cache_input_names(spec), (steps[0][1][n] for n in cache_output_names(spec))))
    steps.append((feeds, run(cached, feeds)))
    for token in (7, 11):  # decoding, one token at a time
        step = next_step_feeds(spec, *steps[-1], np.full(2, token))
        steps.append((step, run(cached, step)))

    full = {"input_ids": np.concatenate([step["input_ids"] for step, _ in steps], axis=1)}
    full["attention_mask"] = steps[-1][0]["attention_mask"]
    if spec.position_ids:
        full["position_ids"] = positions_of(full["attention_mask"])
    expected = run(uncached, full)["logits"]
    logits = np.concatenate([outputs["logits"] for _, outputs in steps], axis=1)
    assert logits.shape[1] == KV_PROBE_PAST + 4 + 2
    assert logits_error(logits, expected, full["attention_mask"]) < 1e-5
    assert np.abs(expected).max() > 0.1  # the comparison is not between zeros


def test_the_position_limit_leaves_room_for_the_generated_past(decoder_exports):
    export = decoder_exported(decoder_exports, "gpt2", "legacy")
    limit = position_limit(ir.from_proto(export.load()).graph)
    assert limit == PositionLimit(64 - KV_PROBE_PAST, "/model/transformer/wpe/Gather", past=KV_PROBE_PAST)
    assert limit.describe() == (
        "the model has 64 positions ('/model/transformer/wpe/Gather' cuts a 64-long constant to the sequence), "
        "3 of them taken by the generated KV cache"
    )


def test_a_kv_cache_site_is_rewritten_in_parallel_with_a_note_on_its_cost(decoder_exports):
    export = decoder_exported(decoder_exports, "llama", "legacy")
    out = attnrewrite.rewrite(export.load(), to="linear")
    record = read_record(out)
    assert [(s["status"], s["kv_cache"]["past_key"]) for s in record["sites"]] == [
        ("rewritten", f"past_key_values.{layer}.key") for layer in range(2)
    ]
    assert PARALLEL_CACHE_NOTE in record["notes"]
    assert [i.name for i in out.graph.input] == [i.name for i in export.load().graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in export.load().graph.output]


def cli_output(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_list_shows_the_kv_cache(decoder_exports):
    export = decoder_exported(decoder_exports, "gpt2", "legacy")
    code, out, _ = cli_output(str(export.path), "--list")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:-1]]
    assert [row[0] for row in rows] == [f"/model/transformer/h.{i}/attn/Softmax" for i in range(2)]
    assert all("causal+key_padding (kv cache)" in line for line in out.splitlines()[1:-1])


def test_rewriting_a_decoder_on_the_command_line_notes_what_its_cache_costs(decoder_exports, tmp_path):
    export = decoder_exported(decoder_exports, "qwen2", "legacy")
    code, out, _ = cli_output(str(export.path), "--to", "hedgehog", "-o", str(tmp_path / "out.onnx"))
    assert code == 0 and (tmp_path / "out.onnx").exists()
    assert f"note: {PARALLEL_CACHE_NOTE}" in out.splitlines()


# --- fused attention with a cache ---------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _fused_model(nodes: list[onnx.NodeProto], inputs: dict, outputs: dict, opsets: dict) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "fused_with_cache",
        [helper.make_tensor_value_info(n, elem, shape) for n, (elem, shape) in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in outputs.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], ir_version=10)


def _heads(name: str, heads: int, length: str) -> tuple[str, tuple]:
    return name, (TensorProto.FLOAT, ["batch", heads, length, HEAD_DIM])


def attention_with_past(with_mask: bool) -> onnx.ModelProto:
    """Attention (opset 23) with past_key/past_value, grouped key/value heads, is_causal (aligned
    to the last key); ``with_mask``: a key padding mask from an attention_mask over past + new."""
    inputs = dict([_heads("q", HEADS, "seq"), _heads("k", KV_HEADS, "seq"), _heads("v", KV_HEADS, "seq")])
    nodes, mask = [], ""
    if with_mask:
        inputs["attention_mask"] = (TensorProto.INT64, ["batch", "past + seq"])
        nodes = [
            helper.make_node(
                "Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
            ),
            helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["keep", "axes"], ["attn_mask"]),
        ]
        mask = "attn_mask"
    inputs.update([_heads("past_key", KV_HEADS, "past"), _heads("past_value", KV_HEADS, "past")])
    node = helper.make_node(
        "Attention",
        ["q", "k", "v", mask, "past_key", "past_value"],
        ["output", "present_key", "present_value"],
        name="attention",
        is_causal=1,
    )
    total = ["batch", KV_HEADS, "past + seq", HEAD_DIM]
    outputs = {"output": ["batch", HEADS, "seq", HEAD_DIM], "present_key": total, "present_value": total}
    model = _fused_model([*nodes, node], inputs, outputs, {"": 23})
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "causal+padding"])
def test_opset23_attention_with_past_is_understood(with_mask):
    (site,) = attnrewrite.find_sites(attention_with_past(with_mask))
    assert site.kv_cache == KvCache("past_key", "past_value", "present_key", "present_value", KV_HEADS)
    assert site.mask is (MaskKind.CAUSAL_KEY_PADDING if with_mask else MaskKind.CAUSAL)
    assert (site.skip_reason, site.num_heads) == (None, HEADS)
    with pytest.warns(NothingRewritten):
        out = attnrewrite.rewrite(attention_with_past(with_mask), to="linear")
    assert [s["reason"] for s in read_record(out)["sites"]] == [
        "the KV cache is appended inside Attention node 'attention', whose present keys a parallel rewrite would "
        "have to write itself; rewrite it with --recurrent"
    ]


def test_opset23_attention_cache_must_come_from_the_graph_inputs():
    model = attention_with_past(False)
    model.graph.node.insert(0, helper.make_node("Neg", ["past_key_input"], ["past_key"]))
    model.graph.input[3].name = "past_key_input"
    (site,) = attnrewrite.find_sites(model)
    assert site.skip_reason == "Attention's past cache 'past_key' is computed in the graph, not a graph input"


FUSED_ADVICE = (
    "attnrewrite rewrites it neither in parallel nor with --recurrent; rewrite the decoder as exported, before "
    "onnxruntime's fusion (--recurrent takes KV caches appended by Concat, opset-23 Attention or GroupQueryAttention)"
)
CONTRIB_CASES = {
    "MultiHeadAttention": (
        ["query", "key", "value", "", "", "", "past_key", "past_value"],
        {"num_heads": HEADS},
        KvCache("past_key", "past_value", "present_key", "present_value", HEADS),
        "com.microsoft.MultiHeadAttention keeps its KV cache inside the operator (past_key, past_value): "
        + FUSED_ADVICE,
    ),
    "Attention": (
        ["input", "weights", "", "", "past"],
        {"num_heads": HEADS},
        KvCache("past", "past", "present", "present", HEADS),
        "com.microsoft.Attention keeps its KV cache inside the operator (past): " + FUSED_ADVICE,
    ),
}


def contrib_model(op: str) -> onnx.ModelProto:
    names, attributes, _, _ = CONTRIB_CASES[op]
    features = ["batch", "seq", HEADS * HEAD_DIM]
    declared = {
        "query": features,
        "key": features,
        "value": features,
        "input": features,
        "weights": [HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM],
        "past_key": ["batch", attributes.get("kv_num_heads", HEADS), "past", HEAD_DIM],
        "past_value": ["batch", attributes.get("kv_num_heads", HEADS), "past", HEAD_DIM],
        "past": [2, "batch", HEADS, "past", HEAD_DIM],
    }
    inputs = {n: (TensorProto.FLOAT, declared[n]) for n in names if n in declared}
    inputs.update({n: (TensorProto.INT32, ["batch"] if n == "seqlens_k" else []) for n in names if "len" in n})
    presents = ["present"] if op == "Attention" else ["present_key", "present_value"]
    node = helper.make_node(op, names, ["output", *presents], name="fused", domain="com.microsoft", **attributes)
    outputs = {"output": features, **dict.fromkeys(presents, None)}
    return _fused_model([node], inputs, outputs, {"": 18, "com.microsoft": 1})


@pytest.mark.parametrize("op", list(CONTRIB_CASES))
def test_contrib_attention_with_a_cache_is_listed_with_it_and_refused(op):
    _, _, cache, reason = CONTRIB_CASES[op]
    (site,) = attnrewrite.find_sites(contrib_model(op))
    assert (site.kv_cache, site.skip_reason, site.mask_label) == (cache, reason, "unknown (kv cache)")


def test_a_cache_written_in_place_is_refused_in_words():
    """A fixed-size cache that ScatterND writes the new keys into: not Concat(past, new)."""
    shape = ["batch", HEADS, "max", HEAD_DIM]
    inputs = dict([_heads("q", HEADS, "seq"), _heads("k", HEADS, "seq"), _heads("v", HEADS, "max")])
    inputs["cache"], inputs["slots"] = (TensorProto.FLOAT, shape), (TensorProto.INT64, ["batch", HEADS, "seq", 3])
    nodes = [
        helper.make_node("ScatterND", ["cache", "slots", "k"], ["keys"], name="write_cache"),
        helper.make_node("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "keys_t"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "static_cache",
        [helper.make_tensor_value_info(n, e, s) for n, (e, s) in inputs.items()],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", HEADS, "seq", HEAD_DIM])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    (site,) = attnrewrite.find_sites(model)
    assert site.skip_reason == (
        "the keys or values are written into the graph input 'cache' by ScatterND 'write_cache': "
        "a fixed-size KV cache updated in place, not Concat(past, new), is not understood"
    )


# --- a model that runs at its traced length only ------------------------------------------------

TRACED_LENGTH = 10


@pytest.fixture(scope="module")
def baked_encoders(tmp_path_factory) -> dict[str, str]:
    """nn.TransformerEncoder, plain and causal, exported by the legacy exporter at batch 2 and
    length 10 with both axes declared dynamic: Reshape targets hold the 10."""
    folder, paths = tmp_path_factory.mktemp("baked"), {}
    for causal in (False, True):
        module = _seeded(lambda causal=causal: TorchEncoder(causal))()
        path = str(folder / f"encoder{'-causal' if causal else ''}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (torch.randn(2, TRACED_LENGTH, HIDDEN),),
                path,
                input_names=["x"],
                output_names=["output"],
                dynamic_axes={"x": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}},
                dynamo=False,
            )
        paths["causal" if causal else "plain"] = path
    return paths


def test_the_gate_finds_the_length_a_baked_model_runs_at(baked_encoders, tmp_path):
    code, out, err = cli_output(baked_encoders["plain"], "--to", "hydra", "-o", str(tmp_path / "out.onnx"))
    assert (code, err) == (0, "")
    assert "note: the original model does not run on generated inputs of length 16; validated at length 10" in out


@pytest.mark.parametrize("seq", [None, TRACED_LENGTH])
def test_the_mask_probe_finds_the_length_a_baked_model_runs_at(baked_encoders, seq):
    model = infer_shapes(ir.load(baked_encoders["causal"]))
    sites = analyze(model, seq)
    assert [(s.site.mask, s.site.skip_reason) for s in sites] == [(MaskKind.CAUSAL, None)] * 2
    asked = [6, 9] if seq is None else [10, 15]
    assert sites[0].site.provenance["mask_probe_lengths"] == {"asked": asked, "ran": [10]}


def test_seq_drives_the_mask_probe_of_a_baked_model(baked_encoders, tmp_path):
    args = (baked_encoders["causal"], "--to", "hydra", "--seq", "10", "-o", str(tmp_path / "out.onnx"))
    code, out, err = cli_output(*args)
    assert (code, err) == (0, "")
    assert "note: mask probe: the mask subgraph does not run on inputs of length 15; probed at 10" in out
    assert "wrote" in out and out.count("CausalHydra") == 2


def test_when_no_length_runs_the_error_names_the_shapes_tried():
    """A graph that takes 14 elements only: no batch 2 input of any length gives them."""
    graph = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["shape"], value=helper.make_tensor("shape", TensorProto.INT64, [1], [14])
            ),
            helper.make_node("Reshape", ["x", "shape"], ["output"]),
        ],
        "fourteen",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [14])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(InputFails) as failure:
        validate(ir.from_proto(model), seq=16, original=model)
    message = str(failure.value)
    assert message.startswith(
        "the input model itself fails on generated inputs of batch 2 and every length tried (16 to 4096, doubling, "
        "then 14): [ONNXRuntimeError]"
    )
    assert message.endswith("; give inputs it runs on with --inputs, or their length with --seq")
