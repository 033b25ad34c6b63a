"""Long stages on a terminal: calibration's sites done and tqdm's estimate of the time left under
its lines (attnrewrite/progress.py); in a log or CI the lines alone, as they always were."""

from __future__ import annotations

import io

import pytest

from attnrewrite.progress import TerminalProgress

LINES = [f"calibrating site {i}/3 (layer {i - 1}): loss 0.5 -> 0.25 (200 steps)" for i in (1, 2, 3)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_stage(progress: TerminalProgress) -> None:
    for done, line in enumerate(LINES, 1):
        progress.say(line)
        progress.done(done, len(LINES))
    progress.say("kept calibrated")


def test_a_log_gets_the_lines_and_nothing_else(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    run_stage(TerminalProgress("calibrating", "site"))
    assert log.getvalue() == "\n".join([*LINES, "kept calibrated"]) + "\n"


def test_a_terminal_gets_the_lines_above_a_bar_of_the_sites_left(monkeypatch):
    pytest.importorskip("tqdm")
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    progress = TerminalProgress("calibrating", "site")
    run_stage(progress)
    shown = terminal.getvalue()
    assert all(line in shown for line in [*LINES, "kept calibrated"])
    assert "calibrating:  33%" in shown and "1/3" in shown and "2/3" in shown and "<" in shown  # the time left
    assert progress._bar is None  # closed with the last site: nothing left on the terminal


def test_a_new_round_starts_a_new_bar(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr("sys.stderr", Terminal())
    progress = TerminalProgress("calibrating", "site")
    progress.done(1, 3)
    first = progress._bar
    progress.done(1, 3)  # layer selection calibrates again from the first site
    assert progress._bar is not first and progress._bar.n == 1


def test_the_benchmark_sweep_shows_the_runs_left_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    from attnrewrite.bench import Progress

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    progress = Progress()
    for i, label in enumerate(["original N=16", "hydra N=16", "original N=32"]):
        progress.step(i, 3, label)
    progress.done(3)
    shown = terminal.getvalue()
    assert "bench: 1/3 original N=16 (0 s)" in shown and "bench: 3/3 original N=32" in shown
    assert "bench:  33%" in shown and "2/3" in shown and "<" in shown  # runs done and the time left
    assert "bench: 3 configurations in 0 s" in shown


def test_the_benchmark_sweep_logs_one_line_per_run(monkeypatch):
    from attnrewrite.bench import Progress

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    progress = Progress()
    progress.step(0, 2, "original N=16")
    progress.note("hydra: series stopped: over budget")
    progress.step(1, 2, "original N=32")
    progress.done(2)
    assert log.getvalue().splitlines() == [
        "bench: 1/2 original N=16 (0 s)",
        "bench: hydra: series stopped: over budget",
        "bench: 2/2 original N=32 (0 s)",
        "bench: 2 configurations in 0 s",
    ]
