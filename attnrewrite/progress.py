"""What is left of a long stage, on a terminal: a tqdm bar of the parts done (calibration's
sites) with tqdm's estimate of the time left, the stage's lines printed above it. Where stderr
is no terminal (a log, CI) or tqdm is not installed, the lines alone, as they always were."""

from __future__ import annotations

import sys


class TerminalProgress:
    """The stage's lines on stderr; on a terminal, a bar of the ``unit``s done under them."""

    def __init__(self, what: str, unit: str) -> None:
        self.what, self.unit = what, unit
        self._bar = None

    def say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)  # above the bar, which is drawn again under it
        else:
            print(line, file=sys.stderr, flush=True)

    def done(self, count: int, total: int) -> None:
        """``count`` of ``total`` parts done. The bar starts at the first part done, so its
        estimate is the pace of the parts after it; a count that goes back starts a new round
        (layer selection calibrates again)."""
        if self._bar is not None and (count <= self._bar.n or total != self._bar.total):
            self._close()
        if self._bar is None:
            self._bar = _terminal_bar(self.what, self.unit, total, count)
        else:
            self._bar.update(count - self._bar.n)
        if self._bar is not None and count >= total:
            self._close()

    def _close(self) -> None:
        self._bar.close()
        self._bar = None


def _terminal_bar(what: str, unit: str, total: int, done: int):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety: the lines say the same
        return None
    return tqdm(total=total, initial=done, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
