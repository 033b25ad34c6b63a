"""Latency and peak memory over sequence length: the original model, the rewritten one, and the
identity-attention bound.

The bound is the same model with every rewritten attention replaced by its values v. It is
spliced like a real replacement (same sites, same q/k/v plumbing), so it costs what the rest of
the model costs, q, k and v projections included: every replacement needs those. What it does
not keep is q's and k's head transposes: onnxruntime runs nodes nobody reads (it does not remove
dead code), and a replacement whose body its transpose optimizer can push the head transposes
through (hydra) does not pay for them, so with them the bound sat above hydra (by ~1% of a
BERT-base layer: 8 ms of 750 at N = 2048, one thread). Fresh processes still differ by several
percent, so a single measurement can put a replacement at or just below the bound: compare
within the spread, as the crossover does.

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
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.fused import fused_exact_attention
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.limits import position_limit
from attnrewrite.onnx.rewrite import analyze, rewrite_model
from attnrewrite.onnx.splice import Splicer
from attnrewrite.onnx.validate import validate
from attnrewrite.passes.lowering import DOMAIN, MIN_OPSET, OnnxLowering
from attnrewrite.record import format_table

DEFAULT_LENGTHS = [128 * 2**i for i in range(8)]  # 128 .. 16384
DEFAULT_BUDGET_SECONDS = 10.0
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1
SCHEMA = "attnrewrite.bench/1"
WORKER = Path(__file__).with_name("bench_worker.py")
VARIANTS = ("original", "rewritten", "identity", "fused")
# A run that sends no sign of life for this long past the time budget is killed.
WATCHDOG_SLACK_SECONDS = 30.0
_POLL_SECONDS = 0.02


@dataclasses.dataclass
class BenchConfig:
    model: str
    method: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    lengths: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_LENGTHS))
    batch: int = 1
    budget_seconds: float = DEFAULT_BUDGET_SECONDS
    budget_gb: float | None = None  # None: 3/4 of physical memory
    provider: str = "cpu"
    fp16: bool = False
    threads: int | None = None
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    # Fresh processes per (model, N), their runs pooled: one process's speed varies by several
    # percent with where its memory lands, more than the differences some comparisons need.
    trials: int = 1
    # the fused-exact column; None: on for CUDA, where unfused exact attention is a straw man
    fused: bool | None = None

    def __post_init__(self):
        if self.repeats < 1 or self.warmup < 0 or self.batch < 1 or self.trials < 1 or self.budget_seconds <= 0:
            raise AttnRewriteError(
                "bench needs repeats >= 1, warmup >= 0, batch >= 1, trials >= 1 and a positive time budget"
            )
        if self.budget_gb is not None and self.budget_gb <= 0:
            raise AttnRewriteError("--budget-gb must be positive")
        if not self.lengths or min(self.lengths) < 1:
            raise AttnRewriteError("bench needs at least one positive length")

    @property
    def with_fused(self) -> bool:
        return self.provider == "cuda" if self.fused is None else self.fused

    @property
    def variants(self) -> tuple[str, ...]:
        return VARIANTS if self.with_fused else VARIANTS[:-1]

    @property
    def budget_bytes(self) -> int:
        gb = self.budget_gb if self.budget_gb is not None else 0.75 * physical_memory_bytes() / 2**30
        return int(gb * 2**30)


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


# --- the sweep ----------------------------------------------------------------------------------


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
        result.limit = f"stopped at N = {failed.n}: the original model fails there: {_short(failed.detail)}"
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
    progress = progress or Progress(sys.stderr)
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
        return f"N = {m.n}: {_gb(m.peak_bytes)} > memory budget {_gb(config.budget_bytes)}"
    if m.status == "failed":
        return f"N = {m.n}: failed: {_short(m.detail)}"
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


def identity_attention(model: ir.Model, site_names: list[str]) -> ir.Model:
    """The model with each named attention site replaced by its values v."""
    if onnx_io.default_opset(model) < MIN_OPSET:  # as rewrite_model does, so the graphs match
        model = onnx_io.upgrade_opset(model)
    model = onnx_io.infer_shapes(model)
    wanted = set(site_names)
    sites = [s for s in analyze(model) if s.site.name in wanted]
    splicer = Splicer(model)
    lowering = identity_lowering(onnx_io.default_opset(model))
    for s in sites:
        splicer.check(s)
        splicer.splice(s, lowering)
    _read_values_directly(model)
    return model


# Nodes that only move data: a replacement's choice of layout can make them unnecessary.
_LAYOUT_ONLY = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _read_values_directly(model: ir.Model) -> None:
    """Each identity call becomes Identity(v); the layout nodes that then feed nothing (q's and
    k's head split and transpose) go, their projections stay (see the module docstring)."""
    graph = model.graph
    for call in [n for n in graph if n.domain == DOMAIN and n.op_type == IDENTITY_FUNCTION]:
        q, k, v, *rest = call.inputs
        identity = ir.Node("", "Identity", [v], name=call.name, num_outputs=1)
        graph.insert_before(call, identity)
        old, new = call.outputs[0], identity.outputs[0]
        new.type, new.shape = old.type, old.shape
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(call, safe=True)
        new.name = name
        _remove_dead_layout_nodes(graph, [q.producer(), k.producer()])
        for value in rest:  # the keep-all key_keep the splicer added, if nothing else reads it
            if value is not None and value.is_initializer() and not value.uses():
                graph.initializers.pop(value.name, None)
    for key in [key for key, f in model.functions.items() if f.name == IDENTITY_FUNCTION]:
        del model.functions[key]


def _remove_dead_layout_nodes(graph: ir.Graph, seeds: list[ir.Node | None]) -> None:
    work = [node for node in seeds if node is not None]
    while work:
        node = work.pop()
        if node.graph is not graph or node.op_type not in _LAYOUT_ONLY or node.domain not in ("", "ai.onnx"):
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        producers = [v.producer() for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        work += producers


IDENTITY_FUNCTION = "IdentityAttention"


def identity_lowering(opset: int) -> OnnxLowering:
    """A replacement with the interface of every pass's (q, k, v, key_keep) that returns v."""
    body = onnx.helper.make_node("Identity", ["v"], ["out"])
    function = onnx.helper.make_function(
        DOMAIN,
        IDENTITY_FUNCTION,
        ["q", "k", "v", "key_keep"],
        ["out"],
        [body],
        [onnx.helper.make_opsetid("", opset)],
    )
    return OnnxLowering([function])


def to_fp16(model: ir.Model) -> ir.Model:
    """float16 weights, activations, inputs and outputs, in place. What an attnrewrite node
    reads besides q, k and v (key_keep, random features, projections) stays float32: the
    bodies compute in float32 (sums and normalisers overflow in fp16) and cast back to v's type.
    Written here rather than with onnxruntime's float16 tool, which mis-orders and duplicates
    the casts it inserts around function nodes."""
    graph = model.graph
    keep = _float32_only(graph)
    values = [*graph.inputs, *graph.initializers.values(), *(o for node in graph for o in node.outputs)]
    for value in values:
        if value.dtype != ir.DataType.FLOAT or value in keep:
            continue
        value.dtype = ir.DataType.FLOAT16
        if value.const_value is not None:
            value.const_value = ir.tensor(_as_fp16(value.const_value.numpy()), name=value.name)
    for node in graph:
        if node.outputs[0] not in keep:
            _node_to_fp16(node)
    return model


def _float32_only(graph: ir.Graph) -> set[ir.Value]:
    """The attnrewrite nodes' extra inputs and the float values they are computed from (up to
    the Cast that makes them float)."""
    frontier = [v for node in graph if node.domain == DOMAIN for v in node.inputs[3:] if v is not None]
    keep: set[ir.Value] = set()
    while frontier:
        value = frontier.pop()
        if value in keep or value.dtype not in (ir.DataType.FLOAT, None):  # spliced values are untyped
            continue
        keep.add(value)
        producer = value.producer()
        if producer is not None and producer.op_type != "Cast":
            frontier.extend(v for v in producer.inputs if v is not None)
    return keep


def _as_fp16(array: np.ndarray) -> np.ndarray:
    """Saturating: a mask fill of float32's minimum becomes float16's, not -inf (which turns a
    fully masked row into NaN)."""
    limit = np.finfo(np.float16).max
    return np.clip(array, -limit, limit).astype(np.float16)


def _node_to_fp16(node: ir.Node) -> None:
    """Attributes that create float32 tensors: Cast targets and constants."""
    if node.domain not in ("", "ai.onnx"):
        return
    if node.op_type == "Cast" and node.attributes["to"].as_int() == ir.DataType.FLOAT:
        node.attributes["to"] = ir.AttrInt64("to", ir.DataType.FLOAT16)
    elif node.op_type in ("Constant", "ConstantOfShape"):
        name = "value" if "value" in node.attributes else "value_float"
        if name not in node.attributes:
            return
        if name == "value_float":
            array = _as_fp16(np.array(node.attributes.pop(name).as_float(), dtype=np.float32))
        else:
            array = node.attributes[name].as_tensor().numpy()
            if array.dtype != np.float32:
                return
            array = _as_fp16(array)
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))


# --- one configuration in its own process -------------------------------------------------------


def measure_worker(argv: list[str], config: BenchConfig, n: int, env: dict | None = None) -> Measurement:
    """One configuration: a worker process speaking bench_worker's protocol."""
    outcome = run_worker(argv, config.budget_bytes, config.budget_seconds, env)
    return Measurement.from_worker("", n, outcome)


def run_worker(argv: list[str], budget_bytes: int, budget_seconds: float, env: dict | None = None) -> dict:
    """Run a worker speaking bench_worker's protocol; kill it when its resident memory passes
    ``budget_bytes`` or when it goes quiet for longer than a run may take. Returns its result
    dict (status over_memory / over_time / failed when it had to be stopped or died)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    last_sign = [time.monotonic()]
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines, last_sign), daemon=True)
    reader.start()
    peak, verdict = 0, None
    try:
        while process.poll() is None:
            rss = _process_rss(process.pid)
            peak = max(peak, rss)
            if rss > budget_bytes:
                verdict = {"status": "over_memory", "peak_rss_bytes": peak, "detail": f"killed at {_gb(rss)}"}
            elif time.monotonic() - last_sign[0] > budget_seconds + WATCHDOG_SLACK_SECONDS and any(
                line.startswith("ready") for line in lines
            ):
                quiet = time.monotonic() - last_sign[0]
                verdict = {
                    "status": "over_time",
                    "times_s": [quiet],
                    "peak_rss_bytes": peak,
                    "detail": f"killed after {quiet:.0f} s in one run",
                }
            if verdict:
                process.kill()
                break
            time.sleep(_POLL_SECONDS)
    finally:
        process.wait()
        reader.join(timeout=5)
        stderr = process.stderr.read()
        process.stderr.close()
    if verdict:
        return verdict
    result = next((line[len("result ") :] for line in reversed(lines) if line.startswith("result ")), None)
    if result is None:
        return {"status": "failed", "detail": _death(process.returncode, stderr, peak)}
    return json.loads(result)


def _read_lines(stream, lines: list[str], last_sign: list[float]) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        last_sign[0] = time.monotonic()


def _death(code: int, stderr: str, peak: int) -> str:
    if code in (-9, 137):
        return f"killed by the system (out of memory?) at {_gb(peak)}"
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"worker exited with {code}: {tail[-1][:200] if tail else 'no message'}"


def _process_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


# --- what the machine is ------------------------------------------------------------------------


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(threads: int | None) -> dict[str, Any]:
    import onnxruntime as ort

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(physical_memory_bytes() / 2**30, 1),
        "load_average": list(os.getloadavg()),
        "threads": threads,
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "providers": ort.get_available_providers(),
    }


# --- progress, formatting, plot -----------------------------------------------------------------


class Progress:
    """A one-line bar on a terminal; one line per step otherwise (logs stay readable)."""

    WIDTH = 24

    def __init__(self, stream):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.started = time.monotonic()

    def step(self, i: int, total: int, label: str) -> None:
        filled = self.WIDTH * i // max(total, 1)
        elapsed = time.monotonic() - self.started
        text = f"bench [{'#' * filled}{'.' * (self.WIDTH - filled)}] {i + 1}/{total} {label} ({elapsed:.0f} s)"
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(("\r\033[K" if self.tty else "") + f"bench: {text}\n")
        self.stream.flush()

    def done(self, total: int) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"bench: {total} configurations in {time.monotonic() - self.started:.0f} s\n")
        self.stream.flush()


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


def _short(text: str | None, limit: int = 160) -> str:
    text = (text or "no message").replace("[ONNXRuntimeError] : ", "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gb(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GB"
