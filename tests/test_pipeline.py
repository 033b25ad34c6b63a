"""The CLI and the API are two doors to one pipeline (attnrewrite.pipeline): the same scenario
through both writes the same model and record, and fails with the same words."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from conftest import read_record
from models import SAMPLE_BERT
from onnx import TensorProto, helper, numpy_helper

import attnrewrite
from attnrewrite import pipeline
from attnrewrite.check import FidelityBelowThreshold
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError, NothingRewritten

CLASSES = 8
AUTO = dict(to="hydra", layers="auto", min_cosine=-1.0)  # layer selection whose cosine budget takes every site


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """samples/tiny_bert.onnx under a token classifier: a logits output, so that the argmax
    agreement gate has something to look at."""
    model = onnx.load(SAMPLE_BERT)
    graph = model.graph
    weight = np.random.default_rng(0).standard_normal((64, CLASSES)).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(weight, "head_weight"))
    graph.node.append(helper.make_node("MatMul", [graph.output[0].name, "head_weight"], ["logits"], name="head"))
    graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", CLASSES]))
    path = tmp_path_factory.mktemp("classifier") / "classifier.onnx"
    onnx.save(model, path)
    return path


def agreement(model, method: str, layers: list[int]) -> float:
    result = pipeline.run(str(model), pipeline.Settings(method=method, layers=layers, check=True))
    return result.fidelity.min_agreement


def same_model(written, returned: onnx.ModelProto) -> None:
    """The CLI's file and the API's model: one record, one graph, the same constants."""
    written = onnx.load(written)
    assert read_record(written) == read_record(returned)
    nodes = [(n.op_type, list(n.input)) for n in returned.graph.node]
    assert [(n.op_type, list(n.input)) for n in written.graph.node] == nodes
    constants = {t.name: numpy_helper.to_array(t).tobytes() for t in returned.graph.initializer}
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in written.graph.initializer} == constants


def test_a_failed_fidelity_gate_fails_both_in_the_same_words(tmp_path, capsys):
    with pytest.raises(FidelityBelowThreshold) as failed:
        attnrewrite.rewrite(str(SAMPLE_BERT), to="hydra", min_cosine=0.999999)
    message = str(failed.value)
    assert message.startswith("fidelity gate failed: output 'last_hidden_state' has per-example cosine min 0.")
    assert message.endswith(" < --min-cosine 0.999999")
    output = tmp_path / "out.onnx"
    code, out, err = run(capsys, SAMPLE_BERT, "--to", "hydra", "--min-cosine", "0.999999", "-o", output)
    assert (code, err) == (1, f"attnrewrite: error: {message}; nothing written\n")
    assert "cos_min" in out and not output.exists()


def test_a_passed_gate_gives_both_the_same_model(tmp_path, capsys):
    output = tmp_path / "out.onnx"
    assert run(capsys, SAMPLE_BERT, "--to", "hydra", "--min-cosine", "0.9", "-o", output)[0] == 0
    same_model(output, attnrewrite.rewrite(str(SAMPLE_BERT), to="hydra", min_cosine=0.9))


def test_min_agreement_without_logits_is_refused_by_both(tmp_path, capsys):
    with pytest.raises(AttnRewriteError) as refused:
        attnrewrite.rewrite(str(SAMPLE_BERT), to="hydra", min_agreement=0.5)
    assert not isinstance(refused.value, FidelityBelowThreshold)  # the gate cannot apply: bad input, not a failure
    message = "--min-agreement needs a logits-like output; none of the model's outputs (last_hidden_state) is one"
    assert str(refused.value) == message
    code, _, err = run(capsys, SAMPLE_BERT, "--to", "hydra", "--min-agreement", "0.5", "-o", tmp_path / "out.onnx")
    assert (code, err) == (2, f"attnrewrite: error: {message}; nothing written\n")


def test_min_agreement_gates_the_api_as_it_gates_the_cli(tmp_path, capsys, classifier):
    both = agreement(classifier, "hydra", [0, 1])
    threshold = (both + 1.0) / 2
    assert both < threshold < 1.0
    with pytest.raises(FidelityBelowThreshold) as failed:
        attnrewrite.rewrite(str(classifier), to="hydra", min_agreement=threshold)
    assert str(failed.value) == (
        f"fidelity gate failed: output 'logits' has argmax agreement {both:.4f} < --min-agreement {threshold:g}"
    )
    code, _, err = run(capsys, classifier, "--to", "hydra", "--min-agreement", threshold, "-o", tmp_path / "out.onnx")
    assert (code, err) == (1, f"attnrewrite: error: {failed.value}; nothing written\n")


def test_layer_selection_under_min_agreement_chooses_the_same_through_both(tmp_path, capsys, classifier):
    alone = min(agreement(classifier, "hydra", [layer]) for layer in (0, 1))
    both = agreement(classifier, "hydra", [0, 1])
    assert both < alone  # each site alone keeps more predictions than both together
    threshold = (both + alone) / 2
    everything = read_record(attnrewrite.rewrite(str(classifier), **AUTO))["selection"]
    assert sorted(everything["chosen"]) == [0, 1]  # the cosine budget alone takes both
    returned = attnrewrite.rewrite(str(classifier), **AUTO, min_agreement=threshold)
    selection = read_record(returned)["selection"]
    first, second = everything["sites"]  # the order tried: least harmful (by cosine) first
    assert selection["chosen"] == [first["layer"]] and selection["min_agreement"] == threshold
    kept = next(s for s in read_record(returned)["sites"] if s["layer"] == second["layer"])
    assert kept["reason"] == f"layer selection: with it the model's argmax agreement is {both:.4f} < {threshold:g}"

    output = tmp_path / "out.onnx"
    argv = ["--to", "hydra", "--layers", "auto", "--min-cosine", "-1", "--min-agreement", threshold, "-o", output]
    code, out, err = run(capsys, classifier, *argv)
    assert code == 0, err
    assert f"layer selection (--min-cosine -1, --min-agreement {threshold:g}, inputs: generated " in out
    same_model(output, returned)


def test_no_site_within_the_agreement_budget_is_said_by_both(tmp_path, capsys, classifier):
    alone = max(agreement(classifier, "hydra", [layer]) for layer in (0, 1))
    threshold = (alone + 1.0) / 2
    assert alone < threshold
    budget = f"cosine >= -1 and argmax agreement >= {threshold:g}"
    with pytest.warns(NothingRewritten, match=re.escape(f"attnrewrite: layer selection: no site keeps the {budget}; ")):
        unchanged = attnrewrite.rewrite(str(classifier), **AUTO, min_agreement=threshold)
    best = read_record(unchanged)["selection"]["sites"][0]
    output = tmp_path / "out.onnx"
    argv = ["--to", "hydra", "--layers", "auto", "--min-cosine", "-1", "--min-agreement", threshold, "-o", output]
    code, _, err = run(capsys, classifier, *argv)
    assert (code, err) == (
        1,
        f"attnrewrite: error: layer selection: no site can be replaced keeping {budget} (the least harmful, "
        f"layer {best['layer']} alone, gives {best['alone_cosine']:.6f}); nothing written\n",
    )
    assert not output.exists()


def test_layer_selection_on_calibration_data_fits_the_same_through_both(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(0, 1000, (12, 10))
    data = tmp_path / "data.npz"
    np.savez(data, input_ids=ids, attention_mask=np.ones_like(ids))
    output = tmp_path / "out.onnx"
    argv = ["--to", "favor", "--layers", "auto", "--min-cosine", "-1", "--calibrate", data, "--calibrate-steps", "3"]
    code, _, err = run(capsys, SAMPLE_BERT, *argv, "-o", output)
    assert code == 0, err
    returned = attnrewrite.rewrite(
        str(SAMPLE_BERT), to="favor", layers="auto", min_cosine=-1.0, calibrate=str(data), calibrate_steps=3
    )
    assert read_record(returned)["selection"]["inputs"].endswith("calibration examples (not fitted on)")
    same_model(output, returned)


def test_the_report_the_cli_prints_is_the_pipeline_s(tmp_path, capsys):
    ids = np.arange(24).reshape(2, 12)
    inputs, output = tmp_path / "inputs.npz", tmp_path / "out.onnx"
    np.savez(inputs, input_ids=ids, attention_mask=np.ones_like(ids))
    code, out, err = run(capsys, SAMPLE_BERT, "--to", "linear", "--check", "--inputs", inputs, "-o", output)
    assert code == 0, err
    result = pipeline.run(str(SAMPLE_BERT), pipeline.Settings(method="linear", check=True, inputs=str(inputs)))
    assert result.fidelity.table() in out and f"inputs: {inputs}" in out
    assert result.fidelity.inputs == {"input_ids": [2, 12], "attention_mask": [2, 12]}
    same_model(output, ir.serde.serialize_model(result.model))


def test_every_form_of_an_onnx_model_is_compared_with_its_original(tmp_path):
    """A path, a ModelProto and an onnx_ir.Model (rewritten in place: the check runs a copy taken
    before) give the same report."""
    settings = pipeline.Settings(method="hydra", check=True)
    forms = [str(SAMPLE_BERT), onnx.load(SAMPLE_BERT), ir.load(SAMPLE_BERT)]
    reports = [pipeline.run(form, settings).fidelity.as_dict() for form in forms]
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]["observed"]["cosine_min"] < 1


def test_fidelity_gates_take_an_onnx_model():
    with pytest.raises(AttnRewriteError) as refused:
        attnrewrite.rewrite(torch.nn.Linear(2, 2), to="hydra", min_agreement=0.9)
    assert str(refused.value) == (
        "min_cosine, min_agreement and inputs measure fidelity with onnxruntime: they take an ONNX model"
    )
