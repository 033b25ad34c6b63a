"""--layers auto --min-cosine X: what each site costs alone, which are replaced, and the budget
the result keeps (the search on known costs; the CLI and the API on the shipped 2-layer BERT)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import SAMPLE_BERT

import attnrewrite
from attnrewrite.check import check
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError, NothingRewritten
from attnrewrite.layer_selection import NOT_TRIED, Measurement, select_layers
from attnrewrite.record import METADATA_KEY

SAMPLE = SAMPLE_BERT


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def additive_costs(alone_loss: dict[int, float], min_cosine: float):
    """measure() of a model whose cosine loses each replaced site's loss, additively; logs calls."""
    calls = []

    def measure(layers):
        calls.append(list(layers))
        cosine = 1.0 - sum(alone_loss[layer] for layer in layers)
        return Measurement(cosine, passes=cosine >= min_cosine)

    return measure, calls


def test_sites_are_tried_least_harmful_first_and_the_prefix_stops_at_the_budget():
    loss = {0: 0.004, 1: 0.001, 2: math.nan, 3: 0.002}
    measure, calls = additive_costs(loss, min_cosine=0.9965)
    selection = select_layers({layer: f"site{layer}" for layer in loss}, measure, 0.9965, "given")
    # alone: 1 (0.999), 3 (0.998), 0 (0.996), NaN last
    assert [c.layer for c in selection.choices] == [1, 3, 0, 2]
    assert selection.chosen == [1, 3]
    assert selection.final_cosine == pytest.approx(0.997)
    assert selection.choices[2].together == pytest.approx(0.993)  # 1 + 3 + 0: over budget, stop
    assert selection.choices[3].together is None and selection.choices[3].why_kept(0.9965) == NOT_TRIED
    # each site alone once, then the growing prefix (its first step is the first site alone, reused)
    assert calls == [[0], [1], [2], [3], [1, 3], [0, 1, 3]]


def test_search_extremes():
    loss = {0: 0.01, 1: 0.02}
    everything = select_layers({0: "a", 1: "b"}, additive_costs(loss, -1.0)[0], -1.0, "given")
    assert everything.chosen == [0, 1] and everything.final_cosine == pytest.approx(0.97)
    nothing = select_layers({0: "a", 1: "b"}, additive_costs(loss, 1.0)[0], 1.0, "given")
    assert nothing.chosen == [] and nothing.final_cosine is None
    assert "with it the model's cosine is 0.990000 < 1" in nothing.table()


def _selection(path: Path) -> dict:
    model = onnx.load(path)
    return json.loads({p.key: p.value for p in model.metadata_props}[METADATA_KEY])


@pytest.fixture(scope="module")
def replaced_all(tmp_path_factory):
    """The sample through --layers auto --min-cosine -1: (the output, what the CLI printed)."""
    output = tmp_path_factory.mktemp("select") / "all.onnx"
    code = main([str(SAMPLE), "--to", "hydra", "--layers", "auto", "--min-cosine", "-1", "-o", str(output)])
    assert code == 0
    return output


def test_cli_budget_of_minus_one_replaces_every_site(replaced_all):
    record = _selection(replaced_all)
    assert record["sites_rewritten"] == 2 and record["selection"]["min_cosine"] == -1
    assert sorted(record["selection"]["chosen"]) == [0, 1]
    assert [s["replaced"] for s in record["selection"]["sites"]] == [True, True]


def test_cli_budget_of_one_replaces_nothing_and_writes_nothing(tmp_path, capsys):
    output = tmp_path / "out.onnx"
    code, out, err = run(capsys, SAMPLE, "--to", "hydra", "--layers", "auto", "--min-cosine", "1", "-o", output)
    assert code == 1
    assert err.startswith(
        "attnrewrite: error: layer selection: no site can be replaced keeping cosine >= 1 (the least harmful, layer "
    )
    assert err.endswith("; nothing written\n") and err.count("\n") == 1
    assert "0 of 2 sites replaced" in out
    assert not output.exists()


def test_cli_intermediate_budget_replaces_a_prefix_and_keeps_it(tmp_path, capsys, replaced_all):
    sites = _selection(replaced_all)["selection"]["sites"]
    first, both = sites[0]["cumulative_cosine"], sites[1]["cumulative_cosine"]
    assert first > both  # the budget below sits between them: only the least harmful site fits
    budget = (first + both) / 2
    output, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, out, err = run(
        capsys,
        SAMPLE,
        "--to",
        "hydra",
        "--layers",
        "auto",
        "--min-cosine",
        f"{budget:.9f}",
        "-o",
        output,
        "--report",
        report,
    )
    assert code == 0, err
    record = _selection(output)
    assert record["selection"]["chosen"] == [sites[0]["layer"]]
    assert record["sites_rewritten"] == 1
    kept = next(s for s in record["sites"] if s["layer"] == sites[1]["layer"])
    assert kept["reason"].startswith("layer selection: with it the model's cosine is ")
    assert json.loads(report.read_text())["selection"] == record["selection"]
    # the written model, measured afresh the way --check does, keeps the budget
    assert check(SAMPLE, output).min_cosine >= budget
    assert "1 of 2 sites replaced" in out


def test_cli_auto_needs_a_budget(tmp_path, capsys):
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "--layers", "auto", "-o", tmp_path / "o.onnx")
    assert code == 2
    assert err == "attnrewrite: error: --layers auto needs --min-cosine X: the cosine the rewritten model must keep\n"


def test_api_auto(tmp_path):
    model = attnrewrite.rewrite(str(SAMPLE), to="hydra", layers="auto", min_cosine=-1.0)
    record = json.loads({p.key: p.value for p in model.metadata_props}[METADATA_KEY])
    assert record["sites_rewritten"] == 2 and len(record["selection"]["sites"]) == 2
    with pytest.warns(
        NothingRewritten, match="layer selection: no site keeps the cosine >= 1; the model is returned unchanged"
    ):
        unchanged = attnrewrite.rewrite(onnx.load(SAMPLE), to="hydra", layers="auto", min_cosine=1.0)
    assert [n.op_type for n in unchanged.graph.node] == [n.op_type for n in onnx.load(SAMPLE).graph.node]
    with pytest.raises(AttnRewriteError, match="layers='auto' needs min_cosine"):
        attnrewrite.rewrite(str(SAMPLE), to="hydra", layers="auto")


@pytest.mark.parametrize("end_to_end", [0, 2])
def test_cli_auto_with_calibration_measures_on_examples_it_does_not_fit(tmp_path, capsys, end_to_end):
    """With --calibrate-end-to-end the model written has that stage too (layer selection without
    --inputs used to drop it)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (12, 10))
    data = tmp_path / "data.npz"
    np.savez(data, input_ids=ids, attention_mask=np.ones_like(ids))
    output = tmp_path / "out.onnx"
    code, out, err = run(
        capsys,
        SAMPLE,
        "--to",
        "favor",
        "--layers",
        "auto",
        "--min-cosine",
        "-1",
        "--calibrate",
        data,
        "--calibrate-steps",
        "3",
        *(["--calibrate-end-to-end", end_to_end] if end_to_end else []),
        "-o",
        output,
    )
    assert code == 0, err
    record = _selection(output)
    assert record.get("end_to_end", {}).get("steps") == (end_to_end or None)
    held = int(record["selection"]["inputs"].split()[2])  # "the last N calibration examples (not fitted on)"
    assert record["selection"]["inputs"] == f"the last {held} calibration examples (not fitted on)" and 0 < held < 12
    assert record["sites_rewritten"] == 2
    assert [s["calibration"]["examples"] for s in record["sites"]] == [12 - held] * 2
    assert err.count("calibrating site") == 2  # the final fit reports; the trials' fits are silent


def test_auto_with_calibration_of_one_batch_is_refused(tmp_path):
    ids = np.arange(40).reshape(4, 10)
    with pytest.raises(AttnRewriteError, match="4 examples make one batch; give more, or inputs to measure on"):
        attnrewrite.rewrite(
            str(SAMPLE),
            to="favor",
            layers="auto",
            min_cosine=-1.0,
            calibrate={"input_ids": ids, "attention_mask": np.ones_like(ids)},
            calibrate_steps=1,
        )
