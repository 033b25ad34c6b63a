"""README's "Which method?" table is bench/readme_table.py's rendering of one fidelity run and one
speed run (issue 70): its cells come from the files, a fidelity file of several runs is refused,
and README.md holds exactly what the committed files give."""

from __future__ import annotations

import json

import pytest
from models import load_bench_module

readme_table = load_bench_module("readme_table")


def fidelity(**commits) -> dict:
    rows = {
        "hydra/zero-shot": {"mean_cosine": 0.32994, "nn_agreement": 0.4258, "commit": commits.get("hydra", "abc1234")},
        "hydra/calibrated": {"mean_cosine": 0.7267, "nn_agreement": 0.40625, "commit": "abc1234"},
        "lsh/zero-shot": {"mean_cosine": 0.9745, "nn_agreement": 0.773, "commit": "abc1234"},
    }
    return {
        "rows": rows,
        "not_run": {"lsh/calibrated": "lsh has nothing to fit (its buckets come from random rotations)"},
        "heldout_passages": 256,
        "date": "2026-12-02 03:00 UTC",
    }


SPEED = {
    "command": "python bench/run_benchmarks.py --attention-rows softmax,hydra",
    "machine": {"time": "2026-12-02T05:00:00", "cpu": "Intel Xeon", "cores": 2, "versions": {"onnxruntime": "1.32.0"}},
    "threads": 2,
    "rows": {
        "softmax": {"1024": {"median_ms": 12.0}, "4096": {"median_ms": 180.0}},
        "hydra": {"1024": {"median_ms": 1.5}, "4096": {"median_ms": 4.5}},
    },
}


def test_each_cell_comes_from_the_runs_files():
    lines = readme_table.section(fidelity(), SPEED).splitlines()
    assert "| `hydra` | 0.330 / 0.43 | 0.727 / 0.41 | 8.00x / 40.00x |" in lines
    assert "| `lsh` | 0.975 / 0.77 | nothing to fit | not in this run |" in lines
    assert "| `linear` | not measured | not measured | not in this run |" in lines
    assert (
        "commit abc1234" in lines[0] and "`python bench/run_benchmarks.py --attention-rows softmax,hydra`" in lines[0]
    )
    assert "(2026-12-02, Intel Xeon, 2 cores, onnxruntime 1.32.0;" in lines[0]


def test_a_fidelity_file_of_several_runs_is_refused():
    with pytest.raises(SystemExit, match="holds rows of 2 commits: README's table takes one run"):
        readme_table.section(fidelity(hydra="def5678"), SPEED)


def test_the_readme_holds_what_the_committed_runs_give(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_table.MARKERS[0]}\nold\n{readme_table.MARKERS[1]}\nafter\n")
    files = tmp_path / "fidelity.json", tmp_path / "speed.json"
    files[0].write_text(json.dumps(fidelity()))
    files[1].write_text(json.dumps(SPEED))
    paths = ["--fidelity", str(files[0]), "--speed", str(files[1]), "--readme", str(readme)]
    assert readme_table.main([*paths, "--check"]) == 1
    assert readme_table.main(paths) == 0 and readme_table.main([*paths, "--check"]) == 0
    assert readme.read_text().startswith("intro\n<!-- WHICH METHOD -->\nMeasured") and readme.read_text().endswith(
        "after\n"
    )
    assert readme_table.main(["--check"]) == 0  # the repository's README and files
