"""Fine-tuning around the new attention (issue 48, ``--finetune``): low-rank adapters on the replaced
sites' projections, trained with the replacements against the original as teacher and merged into
the weights. The projections are found in real exports (separate, packed, rotary, grouped heads;
both exporters); merging is exact in every weight layout and dtype and never changes a weight
under another reader; the record says what was trained; the guard keeps the calibrated values
where fine-tuning does no better on held-out data; a recurrent model fine-tuned equals its
fine-tuned parallel twin stepped token by token; two processes under torchrun fit what one does;
a quantized projection (MatMulNBits, a DequantizeLinear weight) keeps its adapter beside it, and
one that quantizes its activations too is refused in one line."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from conftest import decoder_exported, exported, read_record
from decoders import DECODERS, logits_error
from models import SAMPLE_BERT
from test_recurrent_fidelity import session, tokens, with_positions

import attnrewrite
from attnrewrite.calibration import OriginalModel
from attnrewrite.cli import main
from attnrewrite.generate import forced_logits
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.finetune import add_beside, merge, teacher_of
from attnrewrite.onnx.projections import Projection, QuantizedProjection, projection_of, site_projections
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.onnx.torch_graph import TorchGraph
from attnrewrite.passes import finetune
from attnrewrite.passes.fit import exact_stand_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12  # calibration and fine-tuning steps: enough to move every value


def rewritten_calls(model) -> list[ir.Node]:
    return [node for node in model.graph if node.domain == "attnrewrite"]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def save_tokens(path, spec, examples: int, length: int = 20, seed: int = 1, positions: bool = True) -> str:
    data = tokens(spec.vocab, examples, length, seed)
    np.savez(path, **(with_positions(spec, data) if positions else data))
    return str(path)


# --- the projections ------------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name, per_site", [("llama", 4), ("qwen2", 4), ("gpt2", 2), ("opt", 4)])
def test_projections_of_real_decoders(decoder_exports, name, per_site, exporter):
    """q, k, v and output projections of every site: separate (llama: rotary, grouped heads) or
    packed into one qkv MatMul (gpt2's c_attn)."""
    export = decoder_exported(decoder_exports, name, exporter, cache=False)
    model, record = rewrite_model(onnx_io.load_model(export.path), "hedgehog")
    calls = rewritten_calls(model)
    assert len(calls) == DECODERS[name].layers
    for call in calls:
        projections = site_projections(call)
        assert len(projections.all) == per_site, call.name
        assert projections.output is not None
        assert all(p.shape[0] == DECODERS[name].heads * DECODERS[name].head_dim for p in projections.inputs)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_projections_of_a_bert(exports, exporter):
    model, _ = rewrite_model(onnx_io.load_model(exported(exports, "bert-eager", exporter).path), "hedgehog")
    for call in rewritten_calls(model):
        names = [p.node.name for p in site_projections(call).all]
        assert len(names) == 4 and len(set(names)) == 4, names


# --- merging --------------------------------------------------------------------------------------


def weight_model(stored: np.ndarray, layout: str, shared: bool) -> ir.Model:
    """y = x W_eff ([2, 3] x [3, 4]) as a MatMul on W, a Gemm with transB, or a MatMul on W's
    Transpose; ``shared``: W is also read by an Identity (output w), another reader."""
    dtype = onnx.helper.np_dtype_to_tensor_dtype(stored.dtype)
    x = onnx.helper.make_tensor_value_info("x", dtype, [2, 3])
    outputs = [onnx.helper.make_tensor_value_info("y", dtype, [2, 4])]
    if layout == "matmul":
        nodes = [onnx.helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")]
    elif layout == "gemm":
        nodes = [onnx.helper.make_node("Gemm", ["x", "W"], ["y"], name="proj", transB=1)]
    else:
        nodes = [
            onnx.helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
            onnx.helper.make_node("MatMul", ["x", "Wt"], ["y"], name="proj"),
        ]
    if shared:
        nodes.append(onnx.helper.make_node("Identity", ["W"], ["w"]))
        outputs.append(onnx.helper.make_tensor_value_info("w", dtype, list(stored.shape)))
    initializer = onnx.numpy_helper.from_array(stored, "W")
    graph = onnx.helper.make_graph(nodes, "g", [x], outputs, [initializer])
    return onnx_io.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]))


def merged(layout: str, shared: bool, dtype) -> tuple[ir.Model, np.ndarray, np.ndarray, np.ndarray]:
    """(the model after merging delta into its projection, W_eff, delta, W as stored)."""
    rng = np.random.default_rng(0)
    effective = rng.standard_normal((3, 4)).astype(np.float32)
    transposed = layout != "matmul"
    stored = (effective.T if transposed else effective).astype(dtype)
    model = weight_model(stored, layout, shared)
    delta = rng.standard_normal((3, 4)).astype(np.float32)
    node = next(n for n in model.graph if n.name == "proj")
    merge(Projection(node, model.graph.initializers["W"], transposed), delta)
    return model, stored.astype(np.float32).T if transposed else stored.astype(np.float32), delta, stored


@pytest.mark.parametrize("shared", [False, True], ids=["own-weight", "shared-weight"])
@pytest.mark.parametrize("layout", ["matmul", "gemm", "transposed"])
def test_merging_adds_the_change_and_leaves_another_reader_alone(layout, shared):
    model, effective, delta, stored = merged(layout, shared, np.float32)
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    outputs = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(outputs[0], x @ (effective + delta), rtol=1e-5, atol=1e-5)
    if shared:  # copied for the projection: the other reader sees W as it was
        assert outputs[1].tobytes() == stored.tobytes()
        assert len(model.graph.initializers) == 2
    else:  # merged in place: no copy
        assert list(model.graph.initializers) == ["W"]


def test_a_step_takes_about_1024_tokens_and_at_most_4_examples():
    assert [finetune.examples_per_step(n) for n in (1, 16, 256, 257, 512, 600, 4096)] == [4, 4, 4, 3, 2, 1, 1]


def test_each_step_is_reported_as_it_is_taken():
    """Stage 2 says after each step how many of its steps are done (a terminal's bar and its
    estimate of the time left, calibration.Calibration.finetune_step_done)."""
    weight = torch.nn.Parameter(torch.zeros(3))
    batches = [{"x": np.full((2, 3), float(i), np.float32)} for i in range(3)]

    def student(feeds):
        return [torch.from_numpy(feeds["x"]) * weight]

    def teacher(feeds):
        return [torch.from_numpy(feeds["x"]) * 2.0]

    done = []
    objective = finetune.Objective(finetune.OUTPUT_ERROR)
    finetune.finetune(
        student, teacher, [weight], batches, objective, steps=5, lr=0.1, step_done=lambda *d: done.append(d)
    )
    assert done == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["matmul", "transposed"])
def test_merging_keeps_the_weights_dtype(layout, dtype):
    """W + delta computed in float32 and stored in W's own dtype, in W's own layout."""
    model, effective, delta, stored = merged(layout, True, dtype)
    node = next(n for n in model.graph if n.name == "proj")
    reader = node if layout == "matmul" else node.inputs[1].producer()
    written = reader.inputs[1 if layout == "matmul" else 0].const_value.numpy()
    expected = effective + delta
    assert written.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(written, (expected.T if layout != "matmul" else expected).astype(dtype))
    assert model.graph.initializers["W"].const_value.numpy().tobytes() == stored.tobytes()


# --- the stage, as users run it -------------------------------------------------------------------


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_finetuned_decoder_has_its_record_and_no_new_op(decoder_exports, tmp_path, capsys):
    spec = DECODERS["llama"]
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", spec, 16)
    common = [export.path, "--to", "hedgehog", "-O", "window=4", "--calibrate", data, "--calibrate-steps", STEPS]
    assert cli(capsys, *common, "-o", tmp_path / "calibrated.onnx")[0] == 0
    code, _, err = cli(capsys, *common, "--finetune", STEPS, "--finetune-rank", 4, "-o", tmp_path / "tuned.onnx")
    assert code == 0
    assert "fine-tuning 8 adapters (rank 4) on 2 sites with their replacements: next-token-kl" in err
    tuned, calibrated = onnx.load(tmp_path / "tuned.onnx"), onnx.load(tmp_path / "calibrated.onnx")
    entry = read_record(tuned)["finetune"]
    assert (entry["rank"], entry["alpha"], entry["steps"], entry["objective"]) == (4, 8.0, STEPS, "next_token_kl")
    assert entry["examples"] == 16 and entry["processes"] == 1 and "held_out" not in entry  # 16 < the guard's 20
    assert entry["data_sha256"] == read_record(calibrated)["sites"][0]["calibration"]["data_sha256"]
    assert entry["loss_after"] < entry["loss_before"]
    assert [len(site["projections"]) for site in entry["adapted"]] == [4, 4]
    # merged into the weights: the graph is the calibrated one's, its projection weights moved
    assert [n.op_type for n in tuned.graph.node] == [n.op_type for n in calibrated.graph.node]
    before, after = initializers(calibrated), initializers(tuned)
    assert set(before) == set(after)
    changed = {name for name in before if before[name].tobytes() != after[name].tobytes()}
    projections = {p for site in entry["adapted"] for p in site["projections"]}
    weights_of = {n.name: n.input[1] for n in tuned.graph.node if n.name in projections}
    assert set(weights_of.values()) <= changed


def test_the_guard_keeps_the_calibrated_model_where_finetuning_does_no_better(decoder_exports, tmp_path, capsys):
    """A rate so high that fine-tuning only makes things worse: it is undone, the held-out part
    cannot tell the two apart, and the model written is the calibrated one, byte for byte."""
    spec = DECODERS["gpt2"]
    export = decoder_exported(decoder_exports, "gpt2", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", spec, 24)  # from 20 examples a part is held out
    common = [export.path, "--to", "linear", "--calibrate", data, "--calibrate-steps", STEPS]
    assert cli(capsys, *common, "-o", tmp_path / "calibrated.onnx")[0] == 0
    code, _, err = cli(capsys, *common, "--finetune", 4, "--finetune-lr", 10, "-o", tmp_path / "tuned.onnx")
    assert code == 0
    entry = read_record(onnx.load(tmp_path / "tuned.onnx"))["finetune"]
    assert entry["held_out"]["kept"] == "calibrated" and entry["held_out"]["examples"] == 8  # the last batch
    assert "kept calibrated: held-out next-token-kl" in err
    assert (
        initializers(onnx.load(tmp_path / "tuned.onnx")).keys()
        == initializers(onnx.load(tmp_path / "calibrated.onnx")).keys()
    )
    for name, value in initializers(onnx.load(tmp_path / "calibrated.onnx")).items():
        assert initializers(onnx.load(tmp_path / "tuned.onnx"))[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("int4, sparse", [(False, 0), (True, 0), (False, 3)], ids=["fp32", "int4", "sparse-cache"])
def test_a_finetuned_recurrent_model_equals_its_finetuned_parallel_twin(decoder_exports, int4, sparse, tmp_path):
    """The same tokens fine-tune both alike (each batch a prefill from nothing): the recurrent
    model, a prefill then one token per call, gives the parallel model's logits. Llama: rotary
    embeddings and grouped heads between the projections and the site; at int4 (MatMulNBits)
    the adapters beside the projections; with a sparse cache, fitted through its block loop."""
    name = "llama"
    spec = DECODERS[name]
    cached = str(decoder_exported(decoder_exports, name, "legacy").path)
    uncached = str(decoder_exported(decoder_exports, name, "legacy", cache=False).path)
    if int4:
        cached, uncached = int4_copy(cached, tmp_path / "cached.onnx"), int4_copy(uncached, tmp_path / "uncached.onnx")
    data = tokens(spec.vocab, 16, 20, seed=1)
    settings = {"calibrate_steps": STEPS, "finetune": STEPS, "finetune_lr": 1e-4, "window": 4, "sinks": 1}
    settings |= {"sparse": sparse} if sparse else {}
    recurrent_model = attnrewrite.rewrite(cached, "hedgehog", recurrent=True, calibrate=data, **settings)
    parallel = attnrewrite.rewrite(uncached, "hedgehog", calibrate=with_positions(spec, data), **settings)
    entry = read_record(recurrent_model)["finetune"]
    assert entry["loss_after"] < entry["loss_before"]
    beside = [site["beside"] for site in entry["adapted"]]
    assert beside == ([site["projections"] for site in entry["adapted"]] if int4 else [[], []])
    sequence = tokens(spec.vocab, 2, 14, seed=2)
    expected = session(parallel).run(["logits"], with_positions(spec, sequence))[0]
    actual = forced_logits(session(recurrent_model), "recurrent", sequence["input_ids"], sequence["attention_mask"], 9)
    assert logits_error(actual, expected, sequence["attention_mask"]) <= 1e-5 * np.abs(expected).max()


def test_an_encoder_is_finetuned_on_its_outputs(tmp_path, capsys):
    """No next-token logits: the objective is the outputs' relative error (the end-to-end stage's)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (12, 16)).astype(np.int64)
    np.savez(tmp_path / "data.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    argv = [SAMPLE_BERT, "--to", "hedgehog", "--calibrate", tmp_path / "data.npz", "--calibrate-steps", STEPS]
    code, _, err = cli(capsys, *argv, "--finetune", STEPS, "-o", tmp_path / "tuned.onnx")
    assert code == 0, err
    entry = read_record(onnx.load(tmp_path / "tuned.onnx"))["finetune"]
    assert entry["objective"] == "output_error" and len(entry["adapted"]) == 2
    assert "output-error" in err


def test_shared_layers_are_split_for_their_adapters(exports, tmp_path):
    """ALBERT's layers share one set of weights: each site's projections get their own merged
    copy, so no site's change reaches another's."""
    model = onnx.load(exported(exports, "albert", "legacy").path)
    shared = [t.name for t in model.graph.initializer if sum(t.name in n.input for n in model.graph.node) > 1]
    data = {"input_ids": np.random.default_rng(0).integers(0, 50, (8, 12)).astype(np.int64)}
    data["attention_mask"] = np.ones_like(data["input_ids"])
    tuned = attnrewrite.rewrite(model, "hedgehog", calibrate=data, calibrate_steps=2, finetune=3, finetune_lr=0.05)
    entry = read_record(tuned)["finetune"]
    sites = len(entry["adapted"])
    assert sites >= 2 and shared
    weights = {
        n.name: n.input[1]
        for n in tuned.graph.node
        if n.name in {p for s in entry["adapted"] for p in s["projections"]}
    }
    assert len(set(weights.values())) == len(weights)  # one weight per projection, none shared any more


def test_two_processes_under_torchrun_fit_what_one_does(decoder_exports, tmp_path):
    spec = DECODERS["llama"]
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", spec, 16, length=24)
    argv = [str(export.path), "--to", "hedgehog", "-O", "window=4", "--calibrate", data]
    argv += ["--calibrate-steps", str(STEPS), "--finetune", str(STEPS)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "attnrewrite", *argv, "-o", str(tmp_path / "one.onnx")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533"]
    two = subprocess.run(
        [*torchrun, "-m", "attnrewrite", *argv, "-o", str(tmp_path / "two.onnx")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("wrote ") == 1  # only the first process writes and speaks
    record = read_record(onnx.load(tmp_path / "two.onnx"))["finetune"]
    assert record["processes"] == 2 and read_record(onnx.load(tmp_path / "one.onnx"))["finetune"]["processes"] == 1
    a, b = initializers(onnx.load(tmp_path / "one.onnx")), initializers(onnx.load(tmp_path / "two.onnx"))
    assert a.keys() == b.keys()
    for name, value in a.items():
        if value.dtype.kind == "f":
            assert np.abs(value - b[name]).max() <= 1e-5 * max(np.abs(value).max(), 1e-30), name


# --- quantized projections: the adapter beside ---------------------------------------------------


def int4_copy(path, out, qdq: bool = False) -> str:
    """The model with its MatMuls of weights at 4 bits, in blocks of 32 with zero points, by
    onnxruntime's own quantizer: as MatMulNBits computing in float (accuracy level 0), or
    (``qdq``) as a blocked DequantizeLinear of uint4 under each MatMul."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.load(path), block_size=32, accuracy_level=0, quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator
    )
    quantizer.process()
    onnx.save(quantizer.model.model, out)
    return str(out)


def nbits_model(bits: int, zero_points: bool, k=72, n=40, block=32, seed=0):
    """One MatMulNBits y = a W, its weight's values and zero points drawn at random and packed
    here (low bits first): (the model, W [K, N] as numpy computes it)."""
    rng = np.random.default_rng(seed)
    blocks, per_byte = -(-k // block), 8 // bits

    def packed(values):  # [N, m] -> [N, m / per_byte] uint8
        padded = np.zeros((n, -(-values.shape[1] // per_byte) * per_byte), np.uint8)
        padded[:, : values.shape[1]] = values
        return np.bitwise_or.reduce([padded[:, i::per_byte] << (i * bits) for i in range(per_byte)]).astype(np.uint8)

    values = rng.integers(0, 2**bits, (n, blocks * block)).astype(np.uint8)
    scales = (rng.standard_normal((n, blocks)) * 0.1).astype(np.float32)
    zero = rng.integers(0, 2**bits, (n, blocks)).astype(np.uint8) if zero_points else None
    initializers = [
        onnx.numpy_helper.from_array(packed(values).reshape(n, blocks, -1), "B"),
        onnx.numpy_helper.from_array(scales.reshape(-1), "scales"),
        *([onnx.numpy_helper.from_array(packed(zero).reshape(-1), "zero_points")] if zero_points else []),
    ]
    node = onnx.helper.make_node(
        "MatMulNBits",
        ["a", "B", "scales", *(["zero_points"] if zero_points else [])],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=0,
    )
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["rows", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", n])],
        initializers,
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    )
    centre = zero.astype(np.float32)[..., None] if zero_points else 2.0 ** (bits - 1)
    weight = ((values.reshape(n, blocks, block) - centre) * scales[..., None]).reshape(n, -1)[:, :k]
    return model, weight.T


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_is_evaluated_in_torch_as_onnxruntime_runs_it(bits, zero_points):
    model, weight = nbits_model(bits, zero_points)
    a = np.random.default_rng(1).standard_normal((3, weight.shape[0])).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"a": a})[0]
    np.testing.assert_allclose(a @ weight, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    actual = TorchGraph(onnx_io.from_proto(model).graph, []).run({"a": a}, {})[0].numpy()
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def quantized_projection_model(layout: str, tmp_path) -> ir.Model:
    """x [2, 64] -> a projection to 48 -> y (an output) and its Identity z (a reader): the
    weight as MatMulNBits or a blocked DequantizeLinear of uint4 (onnxruntime's quantizer), or as
    a DequantizeLinear of int8 under a MatMul or a Gemm (transB, alpha 0.5)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 48)).astype(np.float32)
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])
    outputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2, 48]) for name in "yz"]
    gemm = layout == "qdq-gemm"
    stored = weight.T if gemm else weight
    if layout in ("int4", "qdq-int4"):
        initializers, weight_name, nodes = [onnx.numpy_helper.from_array(stored, "W")], "W", []
    else:
        initializers = [
            onnx.numpy_helper.from_array(np.round(stored / 0.05).clip(-127, 127).astype(np.int8), "Wq"),
            onnx.numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
        ]
        weight_name, nodes = "W", [onnx.helper.make_node("DequantizeLinear", ["Wq", "scale"], ["W"])]
    attributes = {"transB": 1, "alpha": 0.5} if gemm else {}
    nodes += [
        onnx.helper.make_node("Gemm" if gemm else "MatMul", ["x", weight_name], ["y"], name="proj", **attributes),
        onnx.helper.make_node("Identity", ["y"], ["z"]),
    ]
    graph = onnx.helper.make_graph(nodes, "g", [x], outputs, initializers)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    if layout in ("int4", "qdq-int4"):
        onnx.save(model, tmp_path / "float.onnx")
        model = onnx.load(int4_copy(tmp_path / "float.onnx", tmp_path / "int4.onnx", qdq=layout == "qdq-int4"))
    return onnx_io.from_proto(model)


def run_ir(model: ir.Model, feeds: dict, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> list[np.ndarray]:
    """Outputs y and z."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options).run(["y", "z"], feeds)


@pytest.mark.parametrize("layout", ["int4", "qdq-int4", "qdq-matmul", "qdq-gemm"])
def test_an_adapter_beside_a_quantized_projection_adds_what_torch_trained(layout, tmp_path):
    """The quantized weight is left as stored; y + (x A^T)(s B^T) reaches the graph output y
    (same name) and the node that read y, and equals the torch evaluation with the adapter on
    the projection (what fine-tuning trained)."""
    model = quantized_projection_model(layout, tmp_path)
    node = next(n for n in model.graph if n.op_type in ("MatMulNBits", "MatMul", "Gemm"))
    projection = projection_of(node)
    assert isinstance(projection, QuantizedProjection) and projection.shape == (64, 48)
    adapter = finetune.LowRankAdapter(64, 48, 4, 8.0, seed=3)
    with torch.no_grad():
        adapter.up.copy_(torch.randn(48, 4, generator=torch.Generator().manual_seed(4)))
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    trained = TorchGraph(model.graph, []).run({"x": x}, {}, {node: adapter})[0].detach().numpy()
    before = run_ir(model, {"x": x})
    stored = {name: v.const_value.numpy().tobytes() for name, v in model.graph.initializers.items()}
    add_beside(projection, *(t.detach().numpy() for t in adapter.factors()))
    after = run_ir(model, {"x": x})
    alpha = 0.5 if layout == "qdq-gemm" else 1.0
    change = alpha * (x @ adapter.delta().detach().numpy())
    for before_output, after_output in zip(before, after):
        np.testing.assert_allclose(after_output, before_output + change, rtol=1e-5, atol=1e-5)
    # the graph's own math: onnxruntime's optimizations compute a DequantizeLinear's MatMul with
    # activations quantized to int8 (1% off here), which the torch evaluation does not
    exact = run_ir(model, {"x": x}, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0]
    np.testing.assert_allclose(exact, trained, rtol=1e-5, atol=1e-5 * np.abs(trained).max())
    assert all(model.graph.initializers[name].const_value.numpy().tobytes() == b for name, b in stored.items())


def op_types(model: onnx.ModelProto) -> set[str]:
    """The op types a runtime meets: the graph's and its functions' nodes."""
    return {n.op_type for n in model.graph.node} | {n.op_type for f in model.functions for n in f.node}


@pytest.mark.parametrize("quantized", [int4_copy, functools.partial(int4_copy, qdq=True)], ids=["int4", "qdq-int4"])
def test_a_quantized_decoder_is_finetuned_with_its_adapters_beside(decoder_exports, quantized, tmp_path, capsys):
    spec = DECODERS["llama"]
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", spec, 16)
    model = quantized(export.path, tmp_path / "quantized.onnx")
    common = [model, "--to", "hedgehog", "-O", "window=4", "--calibrate", data, "--calibrate-steps", STEPS]
    assert cli(capsys, *common, "-o", tmp_path / "calibrated.onnx")[0] == 0
    code, _, err = cli(capsys, *common, "--finetune", STEPS, "--finetune-rank", 4, "-o", tmp_path / "tuned.onnx")
    assert code == 0, err
    assert "fine-tuning 8 adapters (rank 4, 8 of them beside quantized weights) on 2 sites" in err
    tuned, calibrated = onnx.load(tmp_path / "tuned.onnx"), onnx.load(tmp_path / "calibrated.onnx")
    entry = read_record(tuned)["finetune"]
    assert entry["loss_after"] < entry["loss_before"]
    assert [site["beside"] for site in entry["adapted"]] == [site["projections"] for site in entry["adapted"]]
    # each projection gains MatMul, MatMul, Add; no op type the calibrated model's runtime lacks
    added = [n for n in tuned.graph.node if "/adapter/" in n.name]
    assert [n.op_type for n in added] == ["MatMul", "MatMul", "Add"] * 8
    assert len(tuned.graph.node) == len(calibrated.graph.node) + len(added)
    assert op_types(tuned) <= op_types(calibrated)
    before, after = initializers(calibrated), initializers(tuned)
    quantized = {i for n in calibrated.graph.node if n.op_type in ("DequantizeLinear", "MatMulNBits") for i in n.input}
    assert quantized and all(after[name].tobytes() == before[name].tobytes() for name in quantized & before.keys())
    # B starts at zero: every up factor written has moved
    ups = [array for name, array in after.items() if name.endswith("/adapter/up")]
    assert len(ups) == 8 and all(np.abs(up).max() > 0 for up in ups)


def test_projections_quantizing_their_activations_are_refused_in_one_line(decoder_exports, tmp_path, capsys):
    from onnxruntime.quantization import quantize_dynamic

    spec = DECODERS["llama"]
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", spec, 8)
    model = tmp_path / "dynamic.onnx"
    quantize_dynamic(export.path, model)
    out = tmp_path / "out.onnx"
    code, _, err = cli(capsys, model, "--to", "hedgehog", "--calibrate", data, "--finetune", 2, "-o", out)
    assert code == 2 and not out.exists()
    assert err.startswith("attnrewrite: error: cannot fine-tune: the projection ") and err.count("\n") == 1
    assert "quantizes its activations (MatMulInteger), and adapters beside integer MatMuls are not supported yet" in err


def test_finetune_needs_the_calibration_data(decoder_exports, tmp_path, capsys):
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    code, _, err = cli(capsys, export.path, "--to", "hedgehog", "--finetune", "-o", tmp_path / "out.onnx")
    assert (code, err) == (
        2,
        "attnrewrite: error: --finetune trains on the calibration data; give --calibrate DATA too\n",
    )


def test_finetune_is_refused_with_layer_or_head_selection(decoder_exports, tmp_path, capsys):
    """Selection's trials measure stage 1's models; stage 2 would not reach the model written."""
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=False)
    data = save_tokens(tmp_path / "data.npz", DECODERS["llama"], 24)
    for selection in (["--layers", "auto"], ["--heads", "auto"]):
        argv = [export.path, "--to", "hedgehog", *selection, "--min-cosine", 0.5, "--calibrate", data, "--finetune"]
        code, _, err = cli(capsys, *argv, "-o", tmp_path / "out.onnx")
        assert (code, err) == (
            2,
            "attnrewrite: error: finetune with layer or head selection: select first, then fine-tune a "
            "rewrite of the layers or heads it chose\n",
        )
        assert not (tmp_path / "out.onnx").exists()


def teacher_and_student_graph(path: str) -> tuple:
    """(the original in onnxruntime, the hedgehog rewrite in torch, its exact stand-ins)."""
    model, record = rewrite_model(onnx_io.load_model(path), "hedgehog")
    calls = rewritten_calls(model)
    assert len(calls) == len(record.rewritten) == 2
    exact = {call: exact_stand_in(o.site.scale, o.site.mask.causal) for call, o in zip(calls, record.rewritten)}
    return OriginalModel(onnx_io.load_model(path)), TorchGraph(model.graph, calls), exact


@pytest.mark.parametrize("name, exporter", [("llama", "legacy"), ("gpt2", "dynamo")])
def test_a_decoders_teacher_on_the_cpu_is_the_original_in_onnxruntime(decoder_exports, name, exporter):
    """For the next-token KL the teacher is onnxruntime's run of the original model (faster than
    the graph in torch), which gives what the graph in torch gives with exact attention in every
    replacement at every real position, the only ones the KL reads (left-padded rows here)."""
    export = decoder_exported(decoder_exports, name, exporter, cache=False)
    original, whole, exact = teacher_and_student_graph(export.path)
    objective = finetune.Objective(finetune.NEXT_TOKEN_KL, 0, "attention_mask")
    feeds = with_positions(DECODERS[name], tokens(DECODERS[name].vocab, 4, 14, seed=2))
    assert whole.output_names == ["logits"] and feeds["attention_mask"].sum() < feeds["attention_mask"].size
    (taught,) = teacher_of(whole, exact, original, objective)(feeds)
    assert np.array_equal(taught.numpy(), original.run(feeds, ["logits"])[0])
    (in_torch,) = teacher_of(whole, exact, None, objective)(feeds)
    real = torch.as_tensor(feeds["attention_mask"] != 0)
    assert torch.allclose(taught[real], in_torch[real], atol=1e-5 * float(in_torch.abs().max()))


def test_an_encoders_teacher_zeroes_padded_queries_as_its_student_does():
    """The outputs' error reads padded positions too, where the stand-ins zero a padded query's
    attention and the original does not: the teacher stays the graph in torch."""
    original, whole, exact = teacher_and_student_graph(str(SAMPLE_BERT))
    ids = np.random.default_rng(0).integers(0, 100, (2, 16)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": (np.arange(16) < np.array([[16], [9]])).astype(np.int64)}
    taught = teacher_of(whole, exact, original, finetune.Objective(finetune.OUTPUT_ERROR))(feeds)
    in_torch = whole.run(feeds, exact)
    assert all(torch.equal(a, b) for a, b in zip(taught, in_torch))
    by_onnxruntime = original.run(feeds, whole.output_names)
    assert not np.allclose(by_onnxruntime[0][1, 9:], in_torch[0][1, 9:].numpy(), atol=1e-3)  # where they differ
