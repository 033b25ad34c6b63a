"""The picture of a benchmark: latency and peak memory over sequence length, log-log."""

from __future__ import annotations

import os
from pathlib import Path

from attnrewrite.bench_results import BenchResult, Measurement
from attnrewrite.errors import AttnRewriteError

IDENTITY_LABEL = "identity bound (attention = v)"


def plot(result: BenchResult, path: str | os.PathLike) -> None:
    """Latency and memory vs N, log-log: original, rewritten, the identity bound (and fused exact)."""
    labels = {
        "original": "original (softmax)",
        "rewritten": result.config.method,
        "identity": IDENTITY_LABEL,
        "fused": "fused exact",
    }
    series = {labels[v]: result.series(v) for v in result.config.variants}
    title = f"{Path(result.config.model).name}: {result.config.method} ({result.config.provider})"
    plot_series(series, path, title, note=f"sweep {result.limit}" if result.limit else None)


def plot_series(
    series: dict[str, list[Measurement]], path: str | os.PathLike, title: str, note: str | None = None
) -> None:
    """draw_series, saved as a picture at ``path``."""
    draw_series(series, title, note).savefig(path, dpi=110)


def draw_series(series: dict[str, list[Measurement]], title: str, note: str | None = None):
    """One line per label on two log-log panels (median latency, peak memory); measured points
    only. A series that stopped (budget, failure) ends in an x at its last measured point,
    labelled with why; ``note`` goes under the panels. Returns the matplotlib figure."""
    try:  # a bare Figure, not pyplot: no global state, no display backend
        import matplotlib  # noqa: F401 - its absence is the error below, not one from deep inside
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        raise AttnRewriteError("--plot needs matplotlib: pip install 'attnrewrite[bench]'") from None
    figure = Figure(figsize=(11, 4.6))
    latency, memory = figure.subplots(1, 2)
    lengths = sorted({m.n for ms in series.values() for m in ms})
    for label, measurements in series.items():
        points = [m for m in measurements if m.status == "ok"]
        stop = next((m for m in measurements if m.status != "ok"), None)
        for axes, value in ((latency, lambda m: m.median_s * 1e3), (memory, lambda m: m.peak_bytes / 2**20)):
            if not points:
                continue
            (line,) = axes.plot([m.n for m in points], [value(m) for m in points], marker="o", label=label)
            if stop is not None:
                last = points[-1]
                axes.plot([last.n], [value(last)], marker="x", markersize=12, color=line.get_color())
                axes.annotate(
                    f"{stop.status.replace('_', ' ')} at N = {stop.n}",
                    (last.n, value(last)),
                    textcoords="offset points",
                    xytext=(6, -12),
                    fontsize="x-small",
                    color=line.get_color(),
                )
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axes, unit in ((latency, "median latency (ms)"), (memory, "peak memory (MiB)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.xaxis.set_major_locator(FixedLocator(lengths))  # the measured lengths, as numbers
        axes.xaxis.set_major_formatter(plain)
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))  # enough labels on short ranges
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(NullFormatter())  # not 2x10^0
        axes.tick_params(axis="x", labelrotation=45 if len(lengths) > 6 else 0)
        axes.set_xlabel("sequence length N")
        axes.set_ylabel(unit)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title)
    if note:
        figure.text(0.5, 0.01, note, ha="center", fontsize="small", wrap=True)
    figure.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))
    return figure
