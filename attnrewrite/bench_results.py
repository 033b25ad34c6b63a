"""What an ``attnrewrite bench`` sweep measured: one Measurement per (variant, length), the
BenchResult that compares the series (the crossover, within the measured spread), its table and
its JSON (``attnrewrite.bench/1``)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from attnrewrite.bench_config import BenchConfig
from attnrewrite.record import format_table

SCHEMA = "attnrewrite.bench/1"


@dataclasses.dataclass
class Measurement:
    """One (model, length) in its own process. status: ok | over_time | over_memory | failed."""

    variant: str
    n: int
    status: str
    times_s: list[float] = dataclasses.field(default_factory=list)
    peak_rss_bytes: int | None = None
    loaded_rss_bytes: int | None = None  # after loading the model and inputs, before the first run
    gpu_memory_bytes: int | None = None
    detail: str | None = None

    @classmethod
    def from_worker(cls, variant: str, n: int, result: dict) -> Measurement:
        """A worker process's result (bench_worker's protocol) as a Measurement."""
        return cls(
            variant,
            n,
            result.get("status", "failed"),
            result.get("times_s", []),
            result.get("peak_rss_bytes"),
            result.get("loaded_rss_bytes"),
            result.get("gpu_memory_bytes"),
            result.get("error") or result.get("detail"),
        )

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def peak_bytes(self) -> int | None:
        """The memory the run needed on its device: GPU memory on CUDA, peak RSS on CPU."""
        return self.gpu_memory_bytes if self.gpu_memory_bytes is not None else self.peak_rss_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "median_s": self.median_s}


@dataclasses.dataclass
class BenchResult:
    config: BenchConfig
    measurements: list[Measurement]
    stopped: dict[str, str]  # variant -> why its series stopped early
    sites: int
    machine: dict[str, Any]
    # Why the sweep stopped before the last length for every variant (the model's own limit)
    # and the lengths it did not run.
    limit: str | None = None
    not_run: list[int] = dataclasses.field(default_factory=list)
    fused: str | None = None  # how the fused-exact model was made, or why there is none

    def series(self, variant: str) -> list[Measurement]:
        return [m for m in self.measurements if m.variant == variant]

    def comparisons(self, baseline: str = "original") -> dict[int, str]:
        return compare_series(self.series("rewritten"), self.series(baseline), self.config.lengths)

    def crossover(self, baseline: str = "original") -> int | None:
        return crossover_length(self.comparisons(baseline))

    def within_noise(self, baseline: str = "original") -> list[int]:
        return [n for n, verdict in self.comparisons(baseline).items() if verdict == "noise"]

    def crossover_line(self, baseline: str = "original") -> str:
        name = {"original": "the original", "fused": "fused exact attention"}[baseline]
        method, crossover, noise = self.config.method, self.crossover(baseline), self.within_noise(baseline)
        if crossover:
            line = f"crossover: {method} is faster than {name} from N = {crossover} on"
            noise = [n for n in noise if n < crossover]
        else:
            line = f"crossover: {method} is not faster than {name} beyond the measured spread at any length"
        if noise:
            line += f"; within noise at N = {', '.join(map(str, noise))}"
        return line

    def table(self) -> str:
        label = {
            "original": "original",
            "rewritten": self.config.method,
            "identity": "identity",
            "fused": "fused exact",
        }
        variants = self.config.variants
        header = (
            "N",
            *[f"{label[v]} ms" for v in variants],
            *[f"{label[v]} MB" for v in variants],
            "speedup",
            "vs bound",
        )
        if self.config.with_fused:
            header += ("vs fused",)
        cells = {(m.variant, m.n): m for m in self.measurements}
        rows = []
        for n in self.config.lengths:
            got = [cells.get((v, n)) for v in variants]
            if not any(got):
                continue
            median = {v: _median(m) for v, m in zip(variants, got)}
            row = (
                str(n),
                *[_time_cell(m) for m in got],
                *[_memory_cell(m) for m in got],
                _ratio(median["original"], median["rewritten"], "x"),
                _ratio(median["rewritten"], median["identity"], "x"),
            )
            if self.config.with_fused:
                row += (_ratio(median["fused"], median["rewritten"], "x"),)
            rows.append(row)
        lines = [
            f"{self.config.model}: {self.sites} attention sites -> {self.config.method}; "
            f"{self.config.provider}{' fp16' if self.config.fp16 else ''}, batch {self.config.batch}, "
            f"threads {self.config.threads or 'default'}, median of {self.config.repeats * self.config.trials} runs "
            f"({self.config.trials} process{'es' if self.config.trials > 1 else ''} x {self.config.repeats} after {self.config.warmup} warm-up)",
            format_table(header, rows),
        ]
        lines += [f"{label[v]}: stopped: {why}" for v, why in self.stopped.items()]
        if self.limit:
            lines.append(f"sweep {self.limit}")
        if self.fused is not None:
            lines.append(f"fused exact: {self.fused}")
        lines.append(self.crossover_line())
        if self.config.with_fused:
            lines.append(self.crossover_line("fused"))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "config": dataclasses.asdict(self.config) | {"budget_bytes": self.config.budget_bytes},
            "machine": self.machine,
            "sites": self.sites,
            "series": {v: [m.as_dict() for m in self.series(v)] for v in self.config.variants},
            "stopped": self.stopped,
            "limit": self.limit,
            "not_run": self.not_run,
            "crossover": self.crossover(),
            "within_noise": self.within_noise(),
        } | (
            {
                "fused": self.fused,
                "crossover_fused": self.crossover("fused"),
                "within_noise_fused": self.within_noise("fused"),
            }
            if self.config.with_fused
            else {}
        )


def compare_series(rewritten: list[Measurement], baseline: list[Measurement], lengths: list[int]) -> dict[int, str]:
    """Per length both answered: "faster", "slower" or "noise" for ``rewritten`` against
    ``baseline``. Faster or slower only beyond the measured spread: one's upper quartile of run
    times below the other's lower quartile. A length the baseline could not finish within its
    budget counts as faster."""
    original = {m.n: m for m in baseline}
    answered = {m.n: m for m in rewritten if m.status == "ok"}
    original_over_budget = any(m.status in ("over_time", "over_memory") for m in original.values())
    verdicts = {}
    for n in lengths:
        if n not in answered:
            continue
        base = original.get(n)
        if base is not None and base.status == "ok":
            verdicts[n] = _compare_runs(answered[n].times_s, base.times_s)
        elif original_over_budget and (base is None or base.status != "failed"):
            verdicts[n] = "faster"  # the baseline ran out of budget by this length
    return verdicts


def crossover_length(verdicts: dict[int, str]) -> int | None:
    """The smallest length from which on every verdict is "faster"; None if there is none."""
    answer = None
    for n, verdict in verdicts.items():
        answer = (answer or n) if verdict == "faster" else None
    return answer


def _compare_runs(runs: list[float], baseline: list[float]) -> str:
    """ "faster", "slower" or "noise": whether runs beat baseline beyond their spread (the
    interquartile ranges of the two sets of run times do not overlap)."""
    low, high = np.percentile(runs, [25, 75])
    base_low, base_high = np.percentile(baseline, [25, 75])
    if high < base_low:
        return "faster"
    if low > base_high:
        return "slower"
    return "noise"


def _median(m: Measurement | None) -> float | None:
    return m.median_s if m is not None and m.status == "ok" else None


def _time_cell(m: Measurement | None) -> str:
    if m is None:
        return "-"
    if m.status == "ok":
        return f"{m.median_s * 1e3:.1f}"
    if m.status == "over_time" and m.times_s:
        return f">{m.times_s[-1] * 1e3:.0f} (budget)"
    return m.status.replace("_", " ")


def _memory_cell(m: Measurement | None) -> str:
    if m is None or m.peak_bytes is None:
        return "-"
    return f"{m.peak_bytes / 2**20:.0f}" + ("" if m.status == "ok" else "+")


def _ratio(numerator: float | None, denominator: float | None, unit: str) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return "-"
    return f"{numerator / denominator:.2f}{unit}"


def shortened(text: str | None, limit: int = 160) -> str:
    text = (text or "no message").replace("[ONNXRuntimeError] : ", "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gigabytes(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GB"
