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
