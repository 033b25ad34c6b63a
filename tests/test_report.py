"""The run report (docs/report.md): every exit path of the command line leaves a report that
says what happened. For each: the report's outcome and exit code are the process's, the output
exists exactly when the outcome is ``written``, nothing else is left in the folder, and the
error line on stderr and the report's reason are the same words. The Python API raises and
returns the same record."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import pytest
from attention_graphs import AttentionSpec, build_attention_model
from onnx import TensorProto, helper, numpy_helper

import attnrewrite
from attnrewrite import pipeline
from attnrewrite.check import FidelityBelowThreshold
from attnrewrite.cli import main
from attnrewrite.errors import NothingRewritten
from attnrewrite.record import REPORT_SCHEMA

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
ERROR_PREFIX = "attnrewrite: error: "
EXIT_CODES = {"written": 0, "listed": 0, "checked": 0, "refused": 1, "gate_failed": 1, "input_failed": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The inputs of every exit path, in a folder of their own (the run's folder holds only
    what the run writes)."""
    folder = tmp_path_factory.mktemp("inputs")
    paths = {"sample": SAMPLE, "missing": folder / "missing.onnx", "not_onnx": folder / "notes.onnx"}
    paths["not_onnx"].write_text("these are notes, not a model\n")
    paths["causal"] = folder / "causal.onnx"  # one causal site: linformer cannot express it
    onnx.save(build_attention_model(AttentionSpec(mask="causal")), paths["causal"])
    paths["no_attention"] = folder / "relu.onnx"
    onnx.save(_relu_model(), paths["no_attention"])
    paths["fails_alone"] = folder / "fixed.onnx"
    onnx.save(_runs_on_no_generated_inputs(), paths["fails_alone"])
    return paths


def _relu_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _runs_on_no_generated_inputs() -> onnx.ModelProto:
    """An attention followed by a Reshape to 11 values, which no [batch, sequence, 8] output
    holds: the original fails on any generated inputs just as the rewritten model does, so the
    input is to blame."""
    model = build_attention_model(AttentionSpec(mask="key_padding", layout="3d"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 11], np.int64), "fixed_shape"))
    model.graph.node.append(helper.make_node("Reshape", [model.graph.output[0].name, "fixed_shape"], ["fixed"]))
    model.graph.output.append(helper.make_tensor_value_info("fixed", TensorProto.FLOAT, [1, 1, 11]))
    return model


@dataclasses.dataclass
class Run:
    code: int
    out: str
    err: str
    folder: Path
    report: dict | None

    @property
    def output(self) -> Path:
        return self.folder / "out.onnx"


def run(capsys, folder: Path, *argv) -> Run:
    folder.mkdir(exist_ok=True)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    path = folder / "r.json"
    return Run(code, out, err, folder, json.loads(path.read_text()) if path.exists() else None)


def assert_truthful(result: Run) -> dict:
    """What every run with --report must hold; returns the report."""
    report = result.report
    assert report is not None, result.err
    assert report["schema"] == REPORT_SCHEMA
    assert report["exit_code"] == result.code
    assert EXIT_CODES.get(report["outcome"], result.code) == result.code
    written = report["outcome"] == "written"
    assert result.output.exists() == written
    assert report["output"] == (str(result.output) if written else None)
    left = sorted(p.name for p in result.folder.iterdir())
    assert left == sorted(["r.json", *(["out.onnx"] if written else [])])  # no staging, no temporary report
    if result.code == 0:
        assert report["reason"] is None and ERROR_PREFIX not in result.err
    else:
        assert result.err == f"{ERROR_PREFIX}{report['reason']}\n"  # one line, the report's words
    if not written:  # a site is rewritten only in a model that was written
        assert report["sites_rewritten"] == 0
        assert "rewritten" not in {site["status"] for site in report["sites"]}
    return report


@dataclasses.dataclass
class Case:
    name: str
    argv: Callable[[dict[str, Path]], list]  # from the models; "-o" and "--report" are added
    outcome: str
    code: int
    reason: str | Callable[[dict[str, Path]], str] | None  # exact, or ending with "..." for a prefix
    failed_stage: str | None = None
    statuses: tuple[str, ...] = ()


CASES = [
    Case(
        "written",
        lambda m: [m["sample"], "--to", "hydra", "--check", "--min-cosine", "0.9"],
        "written",
        0,
        None,
        statuses=("rewritten", "rewritten"),
    ),
    Case(
        "missing model",
        lambda m: [m["missing"], "--to", "hydra"],
        "input_failed",
        2,
        lambda m: f"{m['missing']}: no such file",
        failed_stage="load",
    ),
    Case(
        "not an ONNX file",
        lambda m: [m["not_onnx"], "--to", "hydra"],
        "input_failed",
        2,
        lambda m: (
            f"{m['not_onnx']}: not an ONNX model (it does not parse as an ONNX protobuf: truncated or another format)"
        ),
        failed_stage="load",
    ),
    Case(
        "option out of range",
        lambda m: [m["sample"], "--to", "linear", "-O", "chunk=0"],
        "input_failed",
        2,
        "linear option chunk must be >= 1, got 0",
        failed_stage="rewrite",
    ),
    Case(
        "argument argparse refuses",
        lambda m: [m["sample"], "--to", "hydra", "--seq", "0"],
        "input_failed",
        2,
        "argument --seq: expected a positive integer, got '0' (see 'attnrewrite -h')",
    ),
    Case(
        "no method", lambda m: [m["sample"]], "input_failed", 2, "choose a method with --to (or --list to only report)"
    ),
    Case(
        "method refuses every site",
        lambda m: [m["causal"], "--to", "linformer"],
        "refused",
        1,
        "none of the 1 attention sites could be rewritten; nothing written",
        statuses=("skipped",),
    ),
    Case(
        "no attention",
        lambda m: [m["no_attention"], "--to", "hydra"],
        "refused",
        1,
        "no softmax attention found; nothing written",
    ),
    Case(
        "fidelity gate",
        lambda m: [m["sample"], "--to", "hydra", "--check", "--min-cosine", "0.99999"],
        "gate_failed",
        1,
        "fidelity gate failed: output 'last_hidden_state' has per-example cosine min 0.9...",
        failed_stage="check",
        statuses=("not_written", "not_written"),
    ),
    Case(
        "model fails on its own inputs",
        lambda m: [m["fails_alone"], "--to", "linear"],
        "input_failed",
        2,
        lambda m: f"{m['fails_alone']}: the input model itself fails on generated inputs...",
        failed_stage="validate",
        statuses=("not_written",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_exit_path_leaves_a_truthful_report(tmp_path, capsys, models, case):
    folder = tmp_path / "run"
    result = run(capsys, folder, *case.argv(models), "-o", folder / "out.onnx", "--report", folder / "r.json")
    report = assert_truthful(result)
    assert (report["outcome"], result.code) == (case.outcome, case.code)
    reason = case.reason(models) if callable(case.reason) else case.reason
    if reason is not None and reason.endswith("..."):
        assert report["reason"].startswith(reason[:-3])
    else:
        assert report["reason"] == reason
    assert report["failed_stage"] == case.failed_stage
    assert tuple(site["status"] for site in report["sites"]) == case.statuses
    assert report["sites_found"] == (len(case.statuses) if case.statuses or case.outcome == "refused" else None)


def test_a_failed_fidelity_gate_reports_its_figures_and_thresholds(tmp_path, capsys):
    """The issue's run: exit 1, no model, and the report says so, with the figures the gate read."""
    folder = tmp_path / "run"
    argv = [SAMPLE, "--to", "hydra", "-o", folder / "out.onnx", "--check", "--min-cosine", "0.99999"]
    report = assert_truthful(run(capsys, folder, *argv, "--report", folder / "r.json"))
    check = report["check"]
    assert check["thresholds"] == {"min_cosine": 0.99999, "min_agreement": None, "allow_exact": False}
    [output] = check["outputs"]
    assert output["name"] == "last_hidden_state" and check["observed"]["cosine_min"] == output["cosine_min"]
    assert output["cosine_min"] < 0.99999 and f"cosine min {output['cosine_min']:.6f} <" in report["reason"]
    assert set(report["seconds"]) >= {"load", "rewrite", "validate", "check", "total"}
    assert sum(v for k, v in report["seconds"].items() if k != "total") <= report["seconds"]["total"]
    assert (report["method"], report["sites_found"], report["sites_rewritten"]) == ("hydra", 2, 0)


def test_a_written_model_and_its_report_agree(tmp_path, capsys):
    folder = tmp_path / "run"
    argv = [SAMPLE, "--to", "hydra", "-o", folder / "out.onnx", "--check", "--min-cosine", "0.9"]
    report = assert_truthful(run(capsys, folder, *argv, "--report", folder / "r.json"))
    stored = json.loads({p.key: p.value for p in onnx.load(folder / "out.onnx").metadata_props}["attnrewrite"])
    assert {key: report[key] for key in stored} == stored  # the report holds the record the model carries
    assert report["sites_rewritten"] == 2 and report["check"]["observed"]["cosine_min"] >= 0.9
    assert report["input"] == str(SAMPLE) and report["command"] == "rewrite"


def test_a_failed_validation_gate_is_gate_failed(tmp_path, capsys, monkeypatch):
    """The run gate fails on the rewritten model while the original runs: the rewrite's fault."""

    def rewritten_model_fails(path, graph, seq, original, feeds):
        raise attnrewrite.errors.RewriteFailed("the rewritten model fails to run on generated inputs: boom")

    monkeypatch.setattr(pipeline, "validate_saved", rewritten_model_fails)
    folder = tmp_path / "run"
    result = run(capsys, folder, SAMPLE, "--to", "hydra", "-o", folder / "out.onnx", "--report", folder / "r.json")
    report = assert_truthful(result)
    assert (report["outcome"], report["failed_stage"], result.code) == ("gate_failed", "validate", 1)
    assert report["reason"] == "the rewritten model fails to run on generated inputs: boom"


@pytest.mark.parametrize(
    "raised,code,reason",
    [
        (RuntimeError("boom"), 3, "internal error: RuntimeError: boom (run with -v for the traceback)"),
        (KeyboardInterrupt(), 1, "interrupted"),
    ],
    ids=["bug", "interrupted"],
)
def test_an_internal_error_or_an_interruption_is_error(tmp_path, capsys, monkeypatch, raised, code, reason):
    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(pipeline, "validate_saved", fails)
    folder = tmp_path / "run"
    result = run(capsys, folder, SAMPLE, "--to", "hydra", "-o", folder / "out.onnx", "--report", folder / "r.json")
    report = assert_truthful(result)
    assert (report["outcome"], report["exit_code"], report["reason"]) == ("error", code, reason)
    assert report["failed_stage"] == "validate"
    assert [site["status"] for site in report["sites"]] == ["not_written", "not_written"]


def test_an_output_that_cannot_be_written_is_error_not_a_failed_gate(tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_ir, "save", disk_full)
    folder = tmp_path / "run"
    output = folder / "out.onnx"
    report = assert_truthful(run(capsys, folder, SAMPLE, "--to", "hydra", "-o", output, "--report", folder / "r.json"))
    assert (report["outcome"], report["exit_code"], report["failed_stage"]) == ("error", 1, "write")
    assert report["reason"] == f"{output}: cannot write it (No space left on device)"


def test_list_reports_what_it_found(tmp_path, capsys):
    folder = tmp_path / "run"
    report = assert_truthful(run(capsys, folder, SAMPLE, "--list", "--report", folder / "r.json"))
    assert (report["outcome"], report["command"], report["sites_found"]) == ("listed", "list", 2)
    assert [site["status"] for site in report["sites"]] == ["rewritable", "rewritable"]
    assert "detect" in report["seconds"]


def test_no_report_over_the_model_or_the_output(tmp_path, capsys):
    """A --report path refused up front is not written on the way out either."""
    folder = tmp_path / "run"
    folder.mkdir()
    output = folder / "out.onnx"
    result = run(capsys, folder, SAMPLE, "--to", "hydra", "-o", output, "--report", output)
    assert (result.code, result.err) == (2, f"{ERROR_PREFIX}{output}: the report and the output are the same file\n")
    assert list(folder.iterdir()) == []
    # argparse refused the command line: the output named there is not replaced by the report
    output.write_bytes(b"an earlier model")
    result = run(capsys, folder, SAMPLE, "--to", "hydra", "--seq", "0", f"--output={output}", "--report", output)
    assert result.code == 2 and output.read_bytes() == b"an earlier model"
    assert [p.name for p in folder.iterdir()] == ["out.onnx"]


@pytest.fixture(scope="module")
def hydra_sample(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hydra") / "hydra.onnx"
    onnx.save(attnrewrite.rewrite(str(SAMPLE), to="hydra"), path)
    return path


@pytest.mark.parametrize(
    "threshold,outcome,code", [("0.5", "checked", 0), ("1", "gate_failed", 1)], ids=["passed", "failed"]
)
def test_check_reports_in_the_same_schema(tmp_path, capsys, hydra_sample, threshold, outcome, code):
    folder = tmp_path / "run"
    result = run(
        capsys, folder, "check", SAMPLE, hydra_sample, "--min-cosine", threshold, "--report", folder / "r.json"
    )
    report = assert_truthful(result)
    assert (report["command"], report["outcome"], result.code) == ("check", outcome, code)
    assert (report["input"], report["compared"]) == (str(SAMPLE), str(hydra_sample))
    assert report["check"]["thresholds"] == {
        "min_cosine": float(threshold),
        "min_agreement": None,
        "allow_exact": False,
    }
    assert report["check"]["observed"]["cosine_min"] < 1 and report["sites"] == []


def test_check_of_a_missing_model_is_input_failed(tmp_path, capsys):
    folder = tmp_path / "run"
    missing = tmp_path / "missing.onnx"
    report = assert_truthful(run(capsys, folder, "check", SAMPLE, missing, "--report", folder / "r.json"))
    assert (report["outcome"], report["reason"]) == ("input_failed", f"{missing}: no such file")
    assert report["check"] is None


# --- the Python API -------------------------------------------------------------------------


def test_the_api_raises_with_the_report_the_cli_writes(tmp_path, capsys):
    with pytest.raises(FidelityBelowThreshold) as failed:
        attnrewrite.rewrite(str(SAMPLE), to="hydra", min_cosine=0.99999)
    api = failed.value.report.as_dict()
    assert (api["outcome"], api["exit_code"], api["reason"]) == ("gate_failed", 1, str(failed.value))
    folder = tmp_path / "run"
    argv = [SAMPLE, "--to", "hydra", "-o", folder / "out.onnx", "--min-cosine", "0.99999"]
    cli = assert_truthful(run(capsys, folder, *argv, "--report", folder / "r.json"))
    assert cli["reason"] == f"{api['reason']}; nothing written"
    same = ("outcome", "exit_code", "failed_stage", "input", "method", "options", "sites", "sites_rewritten", "check")
    assert {key: api[key] for key in same} == {key: cli[key] for key in same}


def test_the_api_returns_the_report_with_the_model(tmp_path):
    result = pipeline.run(str(SAMPLE), pipeline.Settings(method="hydra", check=True))
    report = result.report.as_dict()
    assert (report["outcome"], report["exit_code"], report["reason"], report["output"]) == ("returned", 0, None, None)
    assert [site["status"] for site in report["sites"]] == ["rewritten", "rewritten"]
    assert report["check"] == result.fidelity.as_dict()
    assert json.loads(result.report.to_json()) == report


def test_the_api_attaches_the_report_to_bad_input_and_to_a_refusal(models):
    with pytest.raises(attnrewrite.errors.AttnRewriteError) as refused:
        attnrewrite.rewrite(str(models["missing"]), to="hydra")
    report = refused.value.report.as_dict()
    assert (report["outcome"], report["exit_code"], report["sites"]) == ("input_failed", 2, [])
    assert report["reason"] == f"{models['missing']}: no such file"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attnrewrite.rewrite(str(models["causal"]), to="linformer")
    [warning] = [w.message for w in caught if isinstance(w.message, NothingRewritten)]
    report = warning.report.as_dict()
    assert (report["outcome"], report["exit_code"]) == ("refused", 1)
    assert report["reason"] == "none of the 1 attention sites could be rewritten; nothing written"
    assert [site["status"] for site in report["sites"]] == ["skipped"]


def test_stages_nested_in_another_count_once():
    """Layer selection checks inside its rewrite: that time is "check", not "rewrite" too."""
    result = pipeline.run(str(SAMPLE), pipeline.Settings(method="hydra", layers="auto", min_cosine=-1.0))
    seconds = result.report.as_dict()["seconds"]
    assert seconds["check"] > 0 and seconds["rewrite"] > 0
    assert sum(v for k, v in seconds.items() if k != "total") <= seconds["total"]
