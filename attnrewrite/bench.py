"""``attnrewrite bench``: latency and peak memory over sequence length of the original model,
the rewritten one, the identity-attention bound (bench_identity.py: the same model with every
rewritten attention replaced by its values v) and, where asked, fused exact attention.

This module is the sweep (``run``, ``sweep``: every runner at every length, interleaved, each
series stopped at its budget). The other jobs live beside it: bench_config.py (what a sweep is
asked), bench_results.py (what it measured, compared and tabulated), bench_identity.py (the
bound's graph surgery), bench_fp16.py (``--fp16``), bench_watchdog.py (one configuration in its
own process, watched), bench_worker.py (that process), bench_machine.py and bench_plot.py. Their
public names are this module's too, as ``attnrewrite.bench`` has always offered them.

A model with learned positions stops the sweep at its length limit (attnrewrite.onnx.limits),
or, when the graph does not show it, at the first length the original model fails.

The fused-exact column (on by default on CUDA, ``--fused`` elsewhere) is the other bound: the
same model with its softmax attention fused as onnxruntime would run it in production
(attnrewrite/fused.py), the best exact alternative a rewrite has to beat.

Every (model, length) runs in a fresh process (bench_worker.py). Memory is that process's peak
resident set (VmHWM): it counts everything the run needs — onnxruntime's arena,
allocations outside it, the weights — and it is the same measure for the torch peers in bench/,
which onnxruntime's arena statistics would not be. A fresh process per configuration is what
makes a peak per configuration honest: allocators never give back all they took, so a process
reused across lengths would report the largest length so far. On CUDA the device memory is read
with nvidia-smi after the runs (the CUDA arena keeps its high-water mark).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnrewrite.bench_config import (
    DEFAULT_BUDGET_SECONDS,
    DEFAULT_LENGTHS,
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    VARIANTS,
    BenchConfig,
)
from attnrewrite.bench_fp16 import to_fp16
from attnrewrite.bench_identity import IDENTITY_FUNCTION, identity_attention, identity_lowering
from attnrewrite.bench_machine import cpu_model, machine_description, physical_memory_bytes
from attnrewrite.bench_plot import IDENTITY_LABEL, draw_series, plot, plot_series
from attnrewrite.bench_results import (
    SCHEMA,
    BenchResult,
    Measurement,
    compare_series,
    crossover_length,
    gigabytes,
    shortened,
)
from attnrewrite.bench_watchdog import WATCHDOG_SLACK_SECONDS, measure_worker, run_worker
from attnrewrite.errors import AttnRewriteError
from attnrewrite.fused import fused_exact_attention
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.limits import position_limit
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.onnx.validate import validate
from attnrewrite.progress import TerminalProgress

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_LENGTHS",
    "DEFAULT_REPEATS",
    "DEFAULT_WARMUP",
    "IDENTITY_FUNCTION",
    "IDENTITY_LABEL",
    "SCHEMA",
    "VARIANTS",
    "WATCHDOG_SLACK_SECONDS",
    "WORKER",
    "BenchConfig",
    "BenchResult",
    "Measurement",
    "Progress",
    "Runner",
    "check_provider",
    "compare_series",
    "cpu_model",
    "crossover_length",
    "draw_series",
    "identity_attention",
    "identity_lowering",
    "machine_description",
    "measure_worker",
    "onnx_runner",
    "physical_memory_bytes",
    "plot",
    "plot_series",
    "pool",
    "prepare_models",
    "run",
    "run_worker",
    "stop_reason",
    "sweep",
    "to_fp16",
]

WORKER = Path(__file__).with_name("bench_worker.py")


def run(config: BenchConfig, progress=None) -> BenchResult:
    """Sweep ``config.lengths`` for the original, rewritten and identity-bound models."""
    check_provider(config)
    original_graph = onnx_io.load_model(config.model).graph
    limit = position_limit(original_graph)
    runnable = [n for n in config.lengths if limit is None or n <= limit.positions]
    if not runnable:
        raise AttnRewriteError(f"{config.model}: no requested length can run: {limit.describe()}")
    with tempfile.TemporaryDirectory(prefix="attnrewrite-bench-") as folder:
        models, sites, fused = prepare_models(config, Path(folder))

        def inputs_for(n: int) -> Path:
            path = Path(folder) / f"inputs-{n}.npz"
            np.savez(path, **generate_inputs(original_graph, batch=config.batch, seq=n))
            return path

        runners = {variant: onnx_runner(path, config) for variant, path in models.items()}
        measurements, stopped = sweep(
            runners, dataclasses.replace(config, lengths=runnable), inputs_for, progress, reference="original"
        )
    result = BenchResult(config, measurements, stopped, sites, machine_description(config.threads), fused=fused)
    failed = next((m for m in result.series("original") if m.status == "failed"), None)
    if failed is not None:  # the model's own limit, whatever the method: one line, not three
        stopped.pop("original", None)
        result.limit = f"stopped at N = {failed.n}: the original model fails there: {shortened(failed.detail)}"
        result.not_run = [n for n in config.lengths if n >= failed.n]
    elif len(runnable) < len(config.lengths):
        result.not_run = [n for n in config.lengths if n not in runnable]
        result.limit = f"stopped before N = {result.not_run[0]}: {limit.describe()}"
    return result


Runner = Callable[[int, Path], Measurement]  # (N, inputs file) -> one measurement


def sweep(
    runners: dict[str, Runner],
    config: BenchConfig,
    inputs_for: Callable[[int], Path],
    progress=None,
    reference: str | None = None,
) -> tuple[list[Measurement], dict[str, str]]:
    """Measure every runner at every length, interleaved by length so that all of them see the
    same machine conditions; a runner's series stops at its first length over budget (or that
    fails). When the ``reference`` runner fails (not over budget) at a length, the model cannot
    take that length: the whole sweep stops there. ``inputs_for(n)`` writes the inputs for
    length n (removed after that length)."""
    progress = progress or Progress()
    measurements: list[Measurement] = []
    stopped: dict[str, str] = {}
    total = len(config.lengths) * len(runners) * config.trials
    step = 0
    for n in config.lengths:
        inputs = inputs_for(n)
        trials: dict[str, list[Measurement]] = defaultdict(list)
        for trial in range(config.trials):  # round-robin, so drifts hit every runner alike
            for label, runner in runners.items():
                step += 1
                if label in stopped or _failed(trials.get(reference)):
                    continue
                progress.step(
                    step - 1, total, f"{label} N={n}" + (f" (trial {trial + 1})" if config.trials > 1 else "")
                )
                m = runner(n, inputs)
                m.variant = label
                trials[label].append(m)
                why = stop_reason(m, config)
                if why:
                    stopped[label] = why
                    progress.note(f"{label}: series stopped: {why}")
        measurements += [pool(ms) for ms in trials.values()]
        inputs.unlink(missing_ok=True)
        if _failed(trials.get(reference)):
            break
    progress.done(total)
    return measurements, stopped


def _failed(trials: list[Measurement] | None) -> bool:
    return bool(trials) and trials[-1].status == "failed"


def pool(trials: list[Measurement]) -> Measurement:
    """One measurement from several processes: every timed run, the largest peak; a trial that
    went over budget or failed stands for the whole."""
    bad = next((m for m in trials if m.status != "ok"), None)
    if bad is not None:
        return bad
    first = trials[0]
    return dataclasses.replace(
        first,
        times_s=[t for m in trials for t in m.times_s],
        peak_rss_bytes=max((m.peak_rss_bytes for m in trials if m.peak_rss_bytes is not None), default=None),
        loaded_rss_bytes=min((m.loaded_rss_bytes for m in trials if m.loaded_rss_bytes is not None), default=None),
        gpu_memory_bytes=max((m.gpu_memory_bytes for m in trials if m.gpu_memory_bytes is not None), default=None),
    )


def onnx_runner(model: Path, config: BenchConfig) -> Runner:
    def run_onnx(n: int, inputs: Path) -> Measurement:
        spec = {
            "model": str(model),
            "inputs": str(inputs),
            "provider": config.provider,
            "threads": config.threads,
            "warmup": config.warmup,
            "repeats": config.repeats,
            "budget_seconds": config.budget_seconds,
        }
        return measure_worker([sys.executable, str(WORKER), json.dumps(spec)], config, n)

    return run_onnx


def stop_reason(m: Measurement, config: BenchConfig) -> str | None:
    if m.status == "over_time":
        return f"N = {m.n}: a run took {m.times_s[-1]:.2f} s > budget {config.budget_seconds:g} s"
    if m.status == "over_memory" or (m.peak_bytes or 0) > config.budget_bytes:
        return f"N = {m.n}: {gigabytes(m.peak_bytes)} > memory budget {gigabytes(config.budget_bytes)}"
    if m.status == "failed":
        return f"N = {m.n}: failed: {shortened(m.detail)}"
    return None


def check_provider(config: BenchConfig) -> None:
    import onnxruntime as ort

    if config.fp16 and config.provider != "cuda":
        raise AttnRewriteError("--fp16 needs --provider cuda (onnxruntime's CPU kernels are float32)")
    if config.provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise AttnRewriteError(
            "--provider cuda: this onnxruntime has no CUDA execution provider "
            f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"
        )


def prepare_models(config: BenchConfig, folder: Path) -> tuple[dict[str, Path], int, str | None]:
    """Write the original, rewritten, identity-bound and (when asked for) fused-exact models
    into ``folder``; also says how the fused model was made, or why there is none."""
    rewritten, record = rewrite_model(onnx_io.load_model(config.model), config.method, **config.options)
    if not record.rewritten:
        raise AttnRewriteError(
            f"{config.model}: no attention site can be rewritten by {config.method}; nothing to benchmark"
        )
    validate(rewritten)
    sites = [o.site.name for o in record.rewritten]
    models = {
        "original": onnx_io.load_model(config.model),
        "rewritten": rewritten,
        "identity": identity_attention(onnx_io.load_model(config.model), sites),
    }
    fused_how, already_fp16 = None, set()
    if config.with_fused:
        try:
            fused = fused_exact_attention(onnx_io.load_model(config.model), sites, config.fp16)
            models["fused"], fused_how = fused.model, fused.how
            if fused.already_fp16:
                already_fp16.add("fused")
        except AttnRewriteError as error:  # the column stays empty, with the reason
            fused_how = f"not measured: {error}"
    paths = {}
    for variant, model in models.items():
        if config.fp16 and variant not in already_fp16:
            model = to_fp16(model)
        paths[variant] = folder / f"{variant}.onnx"
        onnx_io.save_model(model, paths[variant])
    return paths, len(sites), fused_how


class Progress:
    """The sweep's configurations as lines (a log, CI: one per configuration, as they start); on a
    terminal, under them, a bar of the configurations done with the time left (progress.py)."""

    def __init__(self):
        self.started = time.monotonic()
        self._bar = TerminalProgress("bench", "run")

    def step(self, i: int, total: int, label: str) -> None:
        """Configuration ``i`` (from 0) of ``total`` starts; the ``i`` before it are done."""
        if i:
            self._bar.done(i, total)
        self._bar.say(f"bench: {i + 1}/{total} {label} ({time.monotonic() - self.started:.0f} s)")

    def note(self, text: str) -> None:
        self._bar.say(f"bench: {text}")

    def done(self, total: int) -> None:
        self._bar.done(total, total)
        self._bar.say(f"bench: {total} configurations in {time.monotonic() - self.started:.0f} s")
