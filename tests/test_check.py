"""attnrewrite check / --check / --min-cosine: the fidelity numbers on models whose difference
is known, and the gate's exit code and refusal to write."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from attention_graphs import AttentionSpec, build_attention_model
from onnx import TensorProto, helper, numpy_helper

from attnrewrite.check import check, compare_outputs, cosine_similarity, is_logits_like, prepare_inputs
from attnrewrite.cli import main
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.masks import inputs_marking_padding

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def linear_model(path: Path, weight: np.ndarray) -> Path:
    """logits = x @ W: a model whose output difference under a weight change is known exactly."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, weight.shape[0]])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 8, weight.shape[1]])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])],
        "linear",
        [x],
        [y],
        [numpy_helper.from_array(weight.astype(np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10  # what the installed onnxruntime loads
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def hydra_sample(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("hydra") / "tiny_bert.hydra.onnx"
    assert main([str(SAMPLE), "--to", "hydra", "-o", str(output)]) == 0
    return output


def test_a_rewrite_compared_with_itself_is_exact(hydra_sample):
    report = check(hydra_sample, hydra_sample)
    [output] = report.outputs
    assert output.name == "last_hidden_state" and output.shape == (2, 64, 64)
    assert output.max_abs_error == 0 and output.relative_error == 0
    assert output.cosine_min == pytest.approx(1.0, abs=1e-12) and output.cosine_mean == pytest.approx(1.0, abs=1e-12)
    assert not output.logits_like and output.argmax_agreement is None  # a hidden state, not logits
    assert report.input_source == "generated (batch 2, seq 64, seed 0)"


def test_perturbed_weight_gives_the_expected_error(tmp_path):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((16, 10)).astype(np.float32)
    delta = np.zeros_like(weight)
    delta[3, 7] = 0.5  # one weight moved: only logits column 7 changes, by 0.5 * x[..., 3]
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", x=x)
    original = linear_model(tmp_path / "a.onnx", weight)
    perturbed = linear_model(tmp_path / "b.onnx", weight + delta)

    report = check(original, perturbed, tmp_path / "inputs.npz")

    a, b = x.astype(np.float64) @ weight, x.astype(np.float64) @ (weight + delta)
    [out] = report.outputs
    assert out.max_abs_error == pytest.approx(0.5 * np.abs(x[..., 3]).max(), rel=1e-5)
    assert out.relative_error == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(a), rel=1e-5)
    cosines = [np.sum(p * q) / np.linalg.norm(p) / np.linalg.norm(q) for p, q in zip(a, b)]  # per batch row
    assert out.cosine_min == pytest.approx(min(cosines), abs=1e-6)
    assert out.cosine_mean == pytest.approx(np.mean(cosines), abs=1e-6)
    assert out.cosine_p5 == pytest.approx(np.percentile(cosines, 5), abs=1e-6)
    assert out.logits_like  # by its name
    assert out.argmax_agreement == pytest.approx(np.mean(a.argmax(-1) == b.argmax(-1)))
    log_p, log_q = (z - np.log(np.exp(z).sum(-1, keepdims=True)) for z in (a, b))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    assert out.kl_mean == pytest.approx(kl.mean(), rel=1e-5) and out.kl_max == pytest.approx(kl.max(), rel=1e-5)
    top5 = [
        len(set(np.argsort(-p)[:5]) & set(np.argsort(-q)[:5])) / 5 for p, q in zip(a.reshape(-1, 10), b.reshape(-1, 10))
    ]
    assert out.top5_overlap == pytest.approx(np.mean(top5))
    assert out.cosine_min < 0.9999  # the change is large enough to be seen
    assert report.input_source.endswith("inputs.npz")


def test_metric_edge_cases():
    assert cosine_similarity(np.zeros(4), np.zeros(4)) == 1.0
    assert cosine_similarity(np.zeros(4), np.ones(4)) == 0.0
    assert cosine_similarity(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
    assert cosine_similarity(np.array([1.0, 2.0]), np.array([-1.0, -2.0])) == pytest.approx(-1.0)
    nan = compare_outputs("y", np.ones((2, 3), np.float32), np.full((2, 3), np.nan, np.float32))
    assert nan.nonfinite == 6 and math.isnan(nan.cosine_min)


def test_which_outputs_are_logits():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 4, 10)).astype(np.float32)
    log_probs = values - np.log(np.exp(values).sum(-1, keepdims=True))
    assert is_logits_like("logits", values) and is_logits_like("start_scores", values)
    assert is_logits_like("output", log_probs)  # logsumexp 0: log-probabilities, whatever the name
    assert is_logits_like("output", np.exp(log_probs))  # rows sum to 1: probabilities
    assert not is_logits_like("output", values)  # nothing says so
    assert not is_logits_like("last_hidden_state", log_probs)  # hidden states never are
    assert not is_logits_like("pooler_output", np.exp(log_probs))
    assert not is_logits_like("logits", values[..., :1])  # one class: nothing to choose between
    assert not is_logits_like("logits", values.astype(np.int64))


def test_check_command_writes_json_and_gates(tmp_path, capsys, hydra_sample):
    report_path = tmp_path / "check.json"
    code, out, err = run(capsys, "check", SAMPLE, hydra_sample, "--json", report_path, "--min-cosine", "0.5")
    assert code == 0, err
    assert "last_hidden_state" in out and "cos_min" in out
    report = json.loads(report_path.read_text())
    [output] = report["outputs"]
    assert set(output) == {
        "name",
        "shape",
        "max_abs_error",
        "relative_error",
        "cosine_mean",
        "cosine_min",
        "cosine_p5",
        "logits_like",
        "argmax_agreement",
        "top5_overlap",
        "kl_mean",
        "kl_max",
        "nonfinite",
    }
    assert (
        0.5 < output["cosine_min"] <= output["cosine_p5"] <= output["cosine_mean"] < 1.0 and output["max_abs_error"] > 0
    )
    assert output["logits_like"] is False and output["argmax_agreement"] is None
    assert report["inputs"] == {"input_ids": [2, 64], "attention_mask": [2, 64]}
    # the thresholds asked for, apart from the figures observed
    assert report["thresholds"] == {"min_cosine": 0.5, "min_agreement": None, "allow_exact": False}
    assert report["observed"] == {"cosine_min": output["cosine_min"], "argmax_agreement_min": None}
    assert "argmax_agree" not in out  # hidden states alone: no logits columns

    code, _, err = run(capsys, "check", SAMPLE, hydra_sample, "--min-cosine", "1", "--json", report_path)
    assert code == 1
    written = json.loads(report_path.read_text())  # the report is still written
    worst = written["observed"]["cosine_min"]
    assert written["thresholds"]["min_cosine"] == 1 and worst < 1
    assert (
        err
        == f"attnrewrite: error: fidelity gate failed: output 'last_hidden_state' has per-example cosine min {worst:.6f} < --min-cosine 1\n"
    )


def test_rewrite_with_check_prints_the_table_and_writes(tmp_path, capsys):
    output = tmp_path / "out.onnx"
    code, out, _ = run(capsys, SAMPLE, "--to", "hydra", "-o", output, "--check", "--seq", "32")
    assert code == 0
    assert "cos_min" in out and "argmax_agree" not in out and "generated (batch 2, seq 32, seed 0)" in out
    assert output.exists()


def test_min_cosine_gate_fails_and_writes_nothing(tmp_path, capsys):
    output = tmp_path / "out.onnx"
    output.write_bytes(b"precious")
    code, out, err = run(capsys, SAMPLE, "--to", "hydra", "-o", output, "--min-cosine", "0.999999")
    assert code == 1
    assert "cos_min" in out  # the table is shown before the verdict
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "attnrewrite: error: fidelity gate failed: output 'last_hidden_state' has per-example cosine min 0."
    )
    assert lines[0].endswith("< --min-cosine 0.999999; nothing written")
    assert output.read_bytes() == b"precious"


def test_inputs_npz_is_used_and_checked(tmp_path, capsys, hydra_sample):
    ids = np.arange(24, dtype=np.int32).reshape(1, 24)  # int32 ids for an int64 input: cast
    np.savez(tmp_path / "ok.npz", input_ids=ids, attention_mask=np.ones((1, 24), np.int64))
    code, out, _ = run(capsys, "check", SAMPLE, hydra_sample, "--inputs", tmp_path / "ok.npz")
    assert code == 0 and "1x24x64" in out

    np.savez(tmp_path / "floats.npz", input_ids=ids, attention_mask=np.ones((1, 24)))
    code, _, err = run(capsys, "check", SAMPLE, hydra_sample, "--inputs", tmp_path / "floats.npz")
    assert code == 2
    assert err.strip().endswith("input 'attention_mask' is float64, the model wants int64")

    np.savez(tmp_path / "missing.npz", input_ids=ids)
    code, _, err = run(capsys, "check", SAMPLE, hydra_sample, "--inputs", tmp_path / "missing.npz")
    assert code == 2 and err.strip().endswith("no array for input 'attention_mask'")

    np.savez(tmp_path / "typo.npz", input_ids=ids, attention_mask=ids, attn_mask=ids)
    code, _, err = run(capsys, "check", SAMPLE, hydra_sample, "--inputs", tmp_path / "typo.npz")
    assert code == 2 and "'attn_mask' is not an input of the model" in err


def test_check_errors_are_one_line(tmp_path, capsys, hydra_sample):
    code, out, err = run(capsys, "check", SAMPLE, tmp_path / "missing.onnx")
    assert code == 2
    assert err.strip() == f"attnrewrite: error: {tmp_path / 'missing.onnx'}: no such file"
    other = linear_model(tmp_path / "other.onnx", np.ones((16, 10)))
    code, _, err = run(capsys, "check", SAMPLE, other)
    assert code == 2 and "the rewritten model has no input 'attention_mask': the models' signatures differ" in err
    assert "Traceback" not in out + err


# --- logits: cosine can stay high while the argmax flips ---------------------------------------

CLASSES = 8


def attention_with_logits_head(path: Path) -> Path:
    """A peaked attention (scale 4: near one-hot softmax, which elu+1 linear attention cannot
    follow) under a classifier head whose bias ties four classes far above the rest: the bias
    dominates the logits, so cosine stays near 1, while the attention output alone picks among
    the tied four, so the argmax follows the attention."""
    model = build_attention_model(AttentionSpec(heads=1, scale=4.0))
    graph = model.graph
    attention_out = graph.output[0].name
    rng = np.random.default_rng(0)
    bias = np.where(np.arange(CLASSES) < 4, 30.0, -30.0).astype(np.float32)
    graph.initializer.extend(
        [
            numpy_helper.from_array(rng.standard_normal((8, CLASSES)).astype(np.float32), "head_weight"),
            numpy_helper.from_array(bias, "head_bias"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("MatMul", [attention_out, "head_weight"], ["head"]),
            helper.make_node("Add", ["head", "head_bias"], ["logits"]),
        ]
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, "sequence", CLASSES]))
    onnx.save(model, path)
    return path


def test_argmax_gate_refuses_what_the_cosine_gate_passes(tmp_path, capsys):
    original = attention_with_logits_head(tmp_path / "classifier.onnx")
    output = tmp_path / "out.onnx"
    code, out, err = run(capsys, original, "--to", "linear", "-o", output, "--min-cosine", "0.98")
    assert code == 0, err  # cosine sees nothing wrong
    report = check(original, output)
    [logits] = report.outputs
    assert logits.logits_like and logits.cosine_min > 0.98
    assert logits.argmax_agreement < 0.5  # ... yet most predictions changed
    assert 0 < logits.top5_overlap < 1 and 0 < logits.kl_mean <= logits.kl_max
    assert "argmax_agree" in out and "top5" in out and "kl_mean" in out

    output.write_bytes(b"precious")
    code, out, err = run(
        capsys, original, "--to", "linear", "-o", output, "--min-cosine", "0.98", "--min-agreement", "0.9"
    )
    assert code == 1
    assert err == (
        "attnrewrite: error: fidelity gate failed: output 'logits' has argmax agreement "
        f"{logits.argmax_agreement:.4f} < --min-agreement 0.9; nothing written\n"
    )
    assert output.read_bytes() == b"precious"

    code, out, err = run(capsys, "check", original, original, "--min-agreement", "1", "--json", tmp_path / "r.json")
    assert code == 0, err
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["thresholds"] == {"min_cosine": None, "min_agreement": 1.0, "allow_exact": False}
    assert written["observed"] == {"cosine_min": pytest.approx(1.0), "argmax_agreement_min": 1.0}
    assert written["outputs"][0]["logits_like"] is True and written["outputs"][0]["kl_max"] == pytest.approx(
        0, abs=1e-9
    )


def test_agreement_gate_without_logits_says_so(capsys, hydra_sample):
    code, _, err = run(capsys, "check", SAMPLE, hydra_sample, "--min-agreement", "0.9")
    assert code == 2
    assert (
        err
        == "attnrewrite: error: --min-agreement needs a logits-like output; none of the model's outputs (last_hidden_state) is one\n"
    )


# --- generated inputs ----------------------------------------------------------------------------


def test_true_means_padding_mask_gets_padding_not_a_masked_row(tmp_path):
    spec = AttentionSpec(mask="key_padding", mask_form="where_fill", fill="-inf", mask_input="key_padding_mask")
    path = tmp_path / "padding.onnx"
    onnx.save(build_attention_model(spec), path)
    model = onnx_io.load_model(path)
    assert inputs_marking_padding(model) == {"key_padding_mask"}

    pad = prepare_inputs(model, batch=3, seq=16).feeds["key_padding_mask"]
    assert pad.dtype == bool and pad.shape == (3, 16)
    assert not pad.all(axis=-1).any()  # no fully masked row
    assert not pad[0].any() and pad[1:, -1].all() and not pad[1:, 1:-2].any()  # padding at the ends only
    # a fully masked row would be softmax(-inf everywhere) = NaN: the figures would say nothing
    [out] = check(path, path).outputs
    assert out.nonfinite == 0 and out.cosine_min == pytest.approx(1.0)


def test_keep_mask_keeps_its_polarity(tmp_path):
    path = tmp_path / "keep.onnx"
    onnx.save(build_attention_model(AttentionSpec(mask="causal+key_padding", mask_form="where_keep")), path)
    model = onnx_io.load_model(path)
    assert inputs_marking_padding(model) == set()
    keep = prepare_inputs(model, seq=16).feeds["attention_mask"]
    assert keep[0].all() and keep[1, 1:-2].all() and not keep[1, -1]


def dequantized_embedding(path: Path, vocab: int, batch=1) -> Path:
    """input_ids [batch, sequence] -> Gather(Cast(int8 table) * scale): the table exists only at run time."""
    rng = np.random.default_rng(0)
    table = rng.integers(-127, 128, size=(vocab, 4), dtype=np.int8)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["table_int8"], ["table_float"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["table_float", "table_scale"], ["table"]),
            helper.make_node("Gather", ["table", "input_ids"], ["embeddings"]),
        ],
        "dequantized",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, "sequence"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [batch, "sequence", 4])],
        [
            numpy_helper.from_array(table, "table_int8"),
            numpy_helper.from_array(np.array(0.01, np.float32), "table_scale"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    return path


def test_token_ids_span_a_dequantized_vocabulary(tmp_path):
    model = onnx_io.load_model(dequantized_embedding(tmp_path / "int8.onnx", vocab=1000))
    for graph_of in (model, onnx_io.infer_shapes(model)):  # table shape unknown, then inferred
        ids = prepare_inputs(graph_of, seq=256).feeds["input_ids"]
        assert ids.min() >= 0 and ids.max() < 1000
        assert ids.max() > 900 and len(np.unique(ids)) > 200  # the whole table, not 0/1 padding


def test_a_table_shape_inference_cannot_follow_is_computed(tmp_path, monkeypatch):
    model = onnx_io.load_model(dequantized_embedding(tmp_path / "int8.onnx", vocab=300))
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda proto, **_: proto)  # inference learns nothing
    ids = prepare_inputs(model, seq=256).feeds["input_ids"]
    assert ids.max() < 300 and ids.max() > 250


def test_batch_fixed_at_one_is_reported_as_one(tmp_path, capsys):
    path = dequantized_embedding(tmp_path / "one.onnx", vocab=50, batch=1)
    code, out, err = run(capsys, "check", path, path, "--seq", "8")
    assert code == 0, err
    assert "inputs: generated (batch 1, seq 8, seed 0)" in out and "1x8x4" in out
