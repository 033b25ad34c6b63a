"""``--state-budget SIZE``: the settings of a recurrent method that fit its state into SIZE per
sequence (bytes, or the KV cache of so many tokens), chosen before the rewrite and said.

What a budget can buy depends on the method: a windowed kernel method (linear, hedgehog, favor)
keeps a fixed kernel state per layer plus the exact window's keys and values, so the budget
sets the window (the widest that fits: more keys exact); streaming keeps only exact keys, so it
sets how many recent keys follow its sinks. Settings the user gave (``-O``) stay as given: the
budget chooses only among the others, and a budget that cannot be met with them is refused in
one line that says the least it would take. The bytes are the ones the rewrite's summary and
``check`` report (passes.recurrent.rewrite_memory), over the sites the rewrite replaces."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from attnrewrite import decision, passes
from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes.recurrent import StateMemory, rewrite_memory
from attnrewrite.record import format_bytes
from attnrewrite.site import AttentionSite

UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
TOKENS = "tok"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
WIDEST_WINDOW = 1 << 16  # the search's bound: far past any window a decoder runs


@dataclasses.dataclass(frozen=True)
class Budget:
    """A state budget as the user wrote it: ``amount`` of ``unit`` (a byte unit or tokens)."""

    text: str
    amount: float
    unit: str

    @classmethod
    def parse(cls, text: str) -> Budget:
        match = _SIZE.fullmatch(text)
        unit = match and (match.group(2) or "B")
        if not match or (unit not in UNITS and unit != TOKENS) or float(match.group(1)) <= 0:
            raise AttnRewriteError(
                f"--state-budget {text!r}: not a size; give bytes (16MB, 512kB, 1.5GiB) "
                f"or the KV cache of a number of tokens (322tok)"
            )
        return cls(text, float(match.group(1)), unit)

    def bytes_for(self, kv_bytes_per_token: int | None) -> int:
        """The budget in bytes; in tokens, the KV cache of that many tokens at these sites."""
        if self.unit != TOKENS:
            return int(self.amount * UNITS[self.unit])
        if not kv_bytes_per_token:
            raise AttnRewriteError(f"--state-budget {self.text}: the KV cache's bytes per token are not known here")
        return int(self.amount * kv_bytes_per_token)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a budget chose: the method's ``options`` (the given ones and the chosen ones), the
    ``chosen`` names among them, and the state they keep."""

    options: dict[str, Any]
    chosen: tuple[str, ...]
    memory: StateMemory
    budget: Budget
    budget_bytes: int

    def describe(self) -> str:
        settings = ", ".join(f"{name}={self.options[name]}" for name in self.chosen)
        return (
            f"state budget {self.budget.text} ({format_bytes(self.budget_bytes)}): chose {settings}, a state of "
            f"{format_bytes(self.memory.state_bytes)} per sequence "
            f"(the KV cache of {self.memory.kv_tokens_equivalent} tokens)"
        )


def choose(method_name: str, given: dict[str, Any], sites: list[AttentionSite], budget: Budget) -> Choice:
    """The settings of ``method_name`` (beside the ``given`` ones) whose recurrent state over
    ``sites`` fits ``budget``, or one line saying why none does."""
    method = passes.get_pass(method_name)
    knob = _KNOBS.get(method.NAME)
    if knob is None:
        raise AttnRewriteError(
            f"--state-budget: {method.NAME} has no setting that sizes its state "
            f"(methods with one: {', '.join(sorted(_KNOBS))})"
        )
    name, search = knob
    if not sites:
        raise AttnRewriteError(f"--state-budget: no attention site here becomes a recurrence of {method.NAME}")
    if name in given:
        raise AttnRewriteError(
            f"--state-budget chooses {name}: give one or the other (-O {name}={given[name]} was given)"
        )

    def memory(value: int) -> StateMemory:
        _, options = passes.method_and_options(method_name, **{**given, name: value})
        return _known(rewrite_memory(method, options, sites))

    smallest = memory(search.least)
    limit = budget.bytes_for(smallest.kv_bytes_per_token)
    value = search.largest_fitting(lambda v: memory(v).state_bytes <= limit)
    if value is None:
        raise AttnRewriteError(
            f"--state-budget {budget.text} ({format_bytes(limit)}): {method.NAME}'s smallest state here is "
            f"{format_bytes(smallest.state_bytes)} ({name}={search.least}{search.at_least_note})"
        )
    return Choice({**given, name: value}, (name,), memory(value), budget, limit)


def fit(method_name: str, given: dict[str, Any], sites: list[AttentionSite], text: str, layers=None) -> Choice:
    """``choose`` over the ``sites`` found that a recurrent rewrite with ``given`` (and
    ``layers``) replaces, for the budget ``text`` (the CLI's and the API's one entry)."""
    knob = _KNOBS.get(passes.get_pass(method_name).NAME)
    # the sites replaced, with the chosen setting at its least (another option may need it set)
    least = {knob[0]: knob[1].least} if knob and knob[0] not in given else {}
    plan = decision.RunPlan.of(method_name, recurrent=True, layers=layers, **given, **least)
    replaced = [site for site in sites if decision.refusal(site, plan) is None]
    return choose(method_name, given, replaced, Budget.parse(text))


@dataclasses.dataclass(frozen=True)
class IntegerSearch:
    """The values a setting may take, [least, most]; a state grows with the setting."""

    least: int
    most: int
    at_least_note: str = ""

    def largest_fitting(self, fits: Callable[[int], bool]) -> int | None:
        """The largest value that ``fits`` (monotone: a fitting value's smaller ones fit)."""
        if not fits(self.least):
            return None
        low, high = self.least, self.most
        while low < high:  # fits(low), and nothing above high fits
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low


_KERNEL_WINDOW = ("window", IntegerSearch(1, WIDEST_WINDOW, ": the kernel state alone, whatever the window"))
_KNOBS: dict[str, tuple[str, IntegerSearch]] = {
    "linear": _KERNEL_WINDOW,
    "hedgehog": _KERNEL_WINDOW,
    "favor": _KERNEL_WINDOW,
    "streaming": ("recent", IntegerSearch(1, WIDEST_WINDOW, ": one recent key besides the sinks")),
}


def _known(memory: StateMemory) -> StateMemory:
    if memory.state_bytes is None:
        raise AttnRewriteError(f"--state-budget: the state's size is not known here ({'; '.join(memory.unknown)})")
    return memory
