"""Where a replacement is softmax attention itself: what every method with such a part says
(passes.exact_part), and what the fidelity check reads to look past it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExactPart:
    """Where a replacement is softmax attention itself, so that a fidelity check can look past it.

    ``exact_up_to``: on sequences this long or shorter, every query attends exactly to every key
    (the replacement is the original). ``reach``: the most keys one query attends to exactly;
    on longer sequences every query's output is approximated. ``said``: what sets them
    (``window=32``)."""

    exact_up_to: int
    reach: int
    said: str
