"""The CUDA sweep of issue 12, one command: bench/RESULTS_CUDA.md, results_cuda.json, plots.

    python bench/run_cuda_benchmarks.py --output-dir /tmp/cuda-results      # on the GPU machine
    python bench/run_cuda_benchmarks.py --output-dir /tmp/cuda-results --resume   # continue it
    python bench/run_cuda_benchmarks.py --smoke --output-dir /tmp/smoke    # CPU, tiny N: try it

For fp16 and fp32, on onnxruntime's CUDA provider (IOBinding, see attnrewrite/bench.py):

1. attention only, q, k, v of [1, 12, N, 64]: the exported softmax graph, fused exact attention
   (opset-23 Attention), every method's ONNX graph; beside them, in torch on the same GPU, every
   method's torch module (attnrewrite/passes/*.torch_module, what the FX frontend swaps in) and
   F.scaled_dot_product_attention;
2. causal attention only (decoder prefill), the same shapes: the exported causal softmax graph,
   fused exact causal attention (opset-23 Attention, is_causal) and every causal method;
3. one BERT-base encoder layer (d = 768, 12 heads, FFN 3072): the exported softmax model, the
   model fused by onnxruntime.transformers.optimizer (com.microsoft.Attention), the
   identity-attention bound and every method;
   in 1-3 also the window configurations (WINDOWS: exact softmax nearby, the kernel beyond);
4. decoding (bench/decode.py's Llama-shaped decoder, fp32): per-token latency and the bytes of the
   carried KV cache or recurrent state at contexts 1k-64k, batch 1 and 16, for the KV-cache
   export and attnrewrite's recurrent hedgehog rewrites (window=64 included);
5. node placement: for every ONNX model, which nodes ran off the CUDA provider (float-producing
   nodes on CPU, and the Memcpy nodes onnxruntime inserted), from onnxruntime's profiler.

Every ONNX series (one model, every length) runs in one process, bench/cuda_series_worker.py, a torch
cell in its own (bench.sweep); a series stops at its first run over
``--budget-seconds``, a GPU out-of-memory (recorded as such) or a failure (a crashed provider is
a failed cell, not a dead run). Each finished cell is written to results_cuda.json at once;
``--resume`` takes the cells already there, and ``--deadline-minutes`` stops starting cells in
time to write the report, so a sweep longer than one command of the GPU machine finishes over
several. ``--smoke`` runs it all on the CPU provider at N = 256 (fp16 included: onnxruntime's CPU
provider and torch run float16 models), so a GPU session spends no device time on its bugs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # models.py, peers.py, run_benchmarks.py; this tree's attnrewrite

import models
import numpy as np
import run_benchmarks as standard  # the CPU sweep: its model building
import torch
from common import table

from attnrewrite import bench, passes
from attnrewrite.errors import AttnRewriteError
from attnrewrite.fused import fused_exact_attention
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import analyze

LENGTHS = [1024, 4096, 16384, 32768, 65536]
SMOKE_LENGTHS = [256]  # >= linformer's k (256), its projection's shortest max_len
DTYPES = ("fp16", "fp32")
SECTIONS = {
    "attention": "attention only, q, k, v of [1, 12, N, 64]",
    "causal": "causal attention only (decoder prefill), q, k, v of [1, 12, N, 64]",
    "layer": "one BERT-base encoder layer (d = 768, 12 heads, FFN 3072)",
}
# The window hybrid: exact softmax over the nearest keys, the method's kernel beyond.
WINDOWS = ("hedgehog:window=32", "hedgehog:window=64", "favor:window=32")
DECODE_CONTEXTS = [1024, 4096, 16384, 65536]
DECODE_BATCHES = (1, 16)
SMOKE_DECODE_CONTEXTS = [64, 128]
SMOKE_DECODE_BATCHES = (1, 2)
JSON_NAME, REPORT_NAME = "results_cuda.json", "RESULTS_CUDA.md"
SERIES_WORKER = HERE / "cuda_series_worker.py"
SCHEMA = "attnrewrite.cuda-bench/1"
NOT_REACHED = "not_reached"  # a cell the deadline left out
OUT_OF_MEMORY = re.compile(
    r"out of memory|Failed to allocate|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|OutOfMemoryError", re.I
)


# --- what is measured ---------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """Per (section, dtype): the runner keys in column order, their titles, the ONNX model files
    (for placement) and notes (how the fused model was made, methods that refused)."""

    provider: str
    lengths: list[int]
    columns: dict[tuple[str, str], dict[str, str]] = dataclasses.field(default_factory=dict)
    onnx: dict[tuple[str, str], dict[str, Path]] = dataclasses.field(default_factory=dict)
    notes: dict[tuple[str, str], list[str]] = dataclasses.field(default_factory=dict)


def build_models(
    folder: Path, lengths: list[int], methods: list[str], dtypes: list[str]
) -> tuple[dict[str, Path], dict[tuple[str, str], dict[str, Path]], dict[tuple[str, str], list[str]]]:
    """(originals, {(section, dtype): {key: model}}, {(section, dtype): notes}). fp16 models are
    rewritten from the fp16 original, so the passes see float16 sites and lower them as they
    would for a user's fp16 model (hydra's float16 body, for one)."""
    originals = {
        "attention": models.export_attention(folder / "attention.onnx", **standard.ATTENTION),
        "causal": export_causal_attention(folder / "causal.onnx", **standard.ATTENTION),
        "layer": models.export_encoder(folder / "layer.onnx", **standard.LAYER),
    }
    windows = tuple(w for w in WINDOWS if standard.parse_variant(w)[0] in methods)
    paths, notes = {}, {}
    for section, original in originals.items():
        for dtype in dtypes:
            source = as_fp16(original) if dtype == "fp16" else original
            variants, refused = standard.rewritten_variants(
                source, folder, lengths, with_bound=section == "layer", extra=windows, methods=methods
            )
            notes[section, dtype] = [f"{method} not measured: {why}" for method, why in refused.items()]
            paths[section, dtype] = variants
    return originals, paths, notes


def fused_model(original: Path, fp16: bool, folder: Path) -> tuple[Path | None, str]:
    """The fused-exact model for ``original`` (attnrewrite/fused.py), or None and why not."""
    model = onnx_io.load_model(original)
    sites = [s.site.name for s in analyze(onnx_io.infer_shapes(model)) if s.site.skip_reason is None]
    try:
        fused = fused_exact_attention(onnx_io.load_model(original), sites, fp16)
    except AttnRewriteError as error:
        return None, f"fused exact not measured: {error}"
    path = folder / f"{original.stem}.fused{'.fp16' if fp16 else ''}.onnx"
    onnx_io.save_model(fused.model if fused.already_fp16 or not fp16 else bench.to_fp16(fused.model), path)
    return path, f"fused exact: {fused.how}"


class CausalSoftmaxAttention(models.SoftmaxAttention):
    """softmax(q k^T / sqrt(d) with later keys hidden) v: the decoder-prefill attention."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        return torch.matmul(torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1), v)


def export_causal_attention(path: Path, heads: int = 12, head_dim: int = 64) -> Path:
    example = tuple(torch.randn(1, heads, 16, head_dim) for _ in range(3))
    models.export(CausalSoftmaxAttention(head_dim), example, list("qkv"), {x: {2: "sequence"} for x in "qkv"}, path)
    return path


def as_fp16(path: Path) -> Path:
    target = path.with_name(f"{path.stem}.fp16.onnx")
    onnx_io.save_model(bench.to_fp16(onnx_io.load_model(path)), target)
    return target


def column_title(key: str) -> str:
    if key.startswith("torch:"):
        name = key.split(":", 1)[1]
        return "torch SDPA" if name == "sdpa" else f"torch {name}"
    fixed = {"softmax": "softmax (ORT)", "fused": "fused exact (ORT)", "identity": "identity bound"}
    return fixed.get(key) or standard.variant_label(key)


def plan_sweep(args, folder: Path) -> tuple[Plan, dict[str, Path]]:
    originals, built, refused = build_models(folder, args.lengths, args.methods, args.dtypes)
    plan = Plan(args.provider, args.lengths)
    for section, original in originals.items():
        for dtype in args.dtypes:
            paths = built[section, dtype]
            fused, how = fused_model(original, dtype == "fp16", folder)
            if fused is not None:
                paths = {
                    "softmax": paths["softmax"],
                    "fused": fused,
                    **{k: p for k, p in paths.items() if k != "softmax"},
                }
            keys = list(paths)
            if section == "attention":
                keys += [f"torch:{m}" for m in args.methods] + ["torch:sdpa"]
            plan.columns[(section, dtype)] = {k: column_title(k) for k in keys}
            plan.onnx[(section, dtype)] = paths
            plan.notes[(section, dtype)] = [how, *refused[section, dtype]]
    return plan, originals


# --- running it ---------------------------------------------------------------------------------


class Store:
    """Every finished cell, written through to the JSON file (so a later run can resume)."""

    def __init__(self, path: Path, resume: bool, header: dict):
        self.path = path
        self.data = {"schema": SCHEMA, **header, "cells": {}, "placement": {}}
        if resume and path.exists():
            previous = json.loads(path.read_text())
            if previous.get("schema") == SCHEMA:
                self.data["cells"] = {k: v for k, v in previous.get("cells", {}).items() if v["status"] != NOT_REACHED}
                self.data["placement"] = previous.get("placement", {})
                self.data["runs"] = previous.get("runs", []) + header.get("runs", [])

    def cell(self, key: str) -> bench.Measurement | None:
        found = self.data["cells"].get(key)
        if found is None:
            return None
        found = {k: v for k, v in found.items() if k != "median_s"}
        return bench.Measurement(**found)

    def put(self, key: str, m: bench.Measurement) -> None:
        self.data["cells"][key] = m.as_dict()
        self.save()

    def save(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1) + "\n")
        temporary.replace(self.path)


def cell_key(section: str, dtype: str, column: str, n: int) -> str:
    return f"{section}/{dtype}/{column}/{n}"


def stored(runner, store: Store, section: str, dtype: str, column: str, deadline: float):
    """The runner, but a cell already in the store is not measured again, no cell starts past
    the deadline, and a GPU out-of-memory counts as over the memory budget."""

    def run(n: int, inputs: Path) -> bench.Measurement:
        key = cell_key(section, dtype, column, n)
        previous = store.cell(key)
        if previous is not None:
            return previous
        if time.monotonic() > deadline:
            m = late_cell(column, n)
            store.put(key, m)
            return m
        m = runner(n, inputs)
        if m.status == "failed" and OUT_OF_MEMORY.search(m.detail or ""):
            m.status = "over_memory"
        m.variant = column
        store.put(key, m)
        return m

    return run


def needed_inputs(write, folder: Path, store: Store, section: str, dtype: str, columns: list[str], deadline: float):
    """The inputs for length n, written only when some cell will be measured at n: the inputs
    at N = 65536 take seconds to write, which a resumed or timed-out run should not spend."""

    def inputs_for(n: int) -> Path:
        if time.monotonic() > deadline or all(store.cell(cell_key(section, dtype, c, n)) for c in columns):
            return folder / f"inputs-not-written-{n}.npz"  # nothing reads it; sweep's unlink finds nothing
        return write(n)

    return inputs_for


def torch_runner(method: str, config: bench.BenchConfig, device: str, dtype: str):
    """A pass's torch module, or torch SDPA for "sdpa", in bench/peers.py's process."""

    def run(n: int, inputs: Path) -> bench.Measurement:
        spec = {
            "peer": "sdpa" if method == "sdpa" else "module",
            "method": method,
            "n": n,
            "options": standard.method_options(method, config.lengths),
            "features": standard.FEATURES,
            "threads": config.threads,
            "device": device,
            "dtype": "float16" if dtype == "fp16" else "float32",
            "warmup": config.warmup,
            "repeats": config.repeats,
            "budget_seconds": config.budget_seconds,
            **standard.ATTENTION,
        }
        return bench.measure_worker([sys.executable, str(HERE / "peers.py"), json.dumps(spec)], config, n)

    return run


def sweep_all(plan: Plan, originals: dict[str, Path], args, store: Store, folder: Path, deadline: float) -> None:
    """Each ONNX model's series in one process (cuda_series_worker.py); the torch columns
    through bench.sweep, a process per cell (bench/peers.py measures one configuration)."""
    device = "cuda" if plan.provider == "cuda" else "cpu"
    for (section, dtype), columns in plan.columns.items():
        config = bench.BenchConfig(
            model="",
            method="",
            lengths=plan.lengths,
            provider=plan.provider,
            budget_seconds=args.budget_seconds,
            budget_gb=args.budget_gb,
            threads=args.threads,
            repeats=args.repeats,
            warmup=args.warmup,
        )
        print(f"== {SECTIONS[section]}, {dtype}", file=sys.stderr)
        write = standard.inputs_writer(originals[section], folder)
        onnx_columns = [c for c in columns if not c.startswith("torch:")]
        inputs = series_inputs(write, store, section, dtype, onnx_columns, plan.lengths, deadline)
        for column in onnx_columns:
            run_series(plan.onnx[(section, dtype)][column], config, store, (section, dtype, column), inputs, deadline)
        for path in inputs.values():
            path.unlink(missing_ok=True)
        runners = {
            c: stored(torch_runner(c.split(":", 1)[1], config, device, dtype), store, section, dtype, c, deadline)
            for c in columns
            if c.startswith("torch:")
        }
        if runners:
            bench.sweep(runners, config, needed_inputs(write, folder, store, section, dtype, list(runners), deadline))


def series_inputs(write, store: Store, section: str, dtype: str, columns: list[str], lengths: list[int], deadline):
    """{N: inputs file} for the lengths some column still has to measure (a resumed run skips
    the others: 65536's inputs take seconds to write)."""
    if time.monotonic() > deadline:
        return {}
    return {n: write(n) for n in lengths if any(store.cell(cell_key(section, dtype, c, n)) is None for c in columns)}


def run_series(model: Path, config: bench.BenchConfig, store: Store, where: tuple, inputs: dict, deadline: float):
    """One model's lengths not yet in the store, in one worker; each finished length is stored.
    The length the worker died at (killed over memory or time, or crashed) takes its verdict and
    ends the series, as bench.sweep ends one; the lengths the deadline left out are marked."""
    section, dtype, column = where
    todo = [n for n in config.lengths if store.cell(cell_key(section, dtype, column, n)) is None]
    if not todo:
        return
    if time.monotonic() > deadline:
        for n in todo:
            store.put(cell_key(section, dtype, column, n), late_cell(column, n))
        return
    results = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    spec = {
        "model": str(model),
        "provider": config.provider,
        "threads": config.threads,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "budget_seconds": config.budget_seconds,
        "inputs": [[n, str(inputs[n])] for n in todo if n in inputs],
        "results": str(results),
        "deadline": time.time() + max(0.0, deadline - time.monotonic()),
    }
    print(f"   {column}: N = {', '.join(map(str, todo))}", file=sys.stderr)
    argv = [sys.executable, str(SERIES_WORKER), json.dumps(spec)]
    outcome = bench.run_worker(argv, config.budget_bytes, config.budget_seconds)
    done = {r.pop("n"): r for r in map(json.loads, results.read_text().splitlines())}
    results.unlink()
    for n in todo:
        if n in done:
            m = measurement(column, n, done[n])
        elif outcome.get("status") != "ok":
            m = measurement(column, n, outcome)  # the length it died at
        else:
            m = late_cell(column, n)
        store.put(cell_key(section, dtype, column, n), m)
        if m.status not in ("ok", NOT_REACHED) or bench.stop_reason(m, config):
            break


def late_cell(column: str, n: int) -> bench.Measurement:
    return bench.Measurement(column, n, NOT_REACHED, detail="the deadline passed before this cell")


def measurement(column: str, n: int, result: dict) -> bench.Measurement:
    """A worker's result as the store's Measurement; a GPU out-of-memory counts as over memory."""
    m = bench.Measurement.from_worker(column, n, result)
    if m.status == "failed" and OUT_OF_MEMORY.search(m.detail or ""):
        m.status = "over_memory"
    return m


def place_all(plan: Plan, originals: dict[str, Path], store: Store, folder: Path, deadline: float) -> None:
    """Where each ONNX model's nodes ran, at the first length, one fresh process each."""
    n = plan.lengths[0]
    for (section, dtype), paths in plan.onnx.items():
        inputs = standard.inputs_writer(originals[section], folder)(n)
        for column, path in paths.items():
            key = f"{section}/{dtype}/{column}"
            if key in store.data["placement"] or time.monotonic() > deadline:
                continue
            spec = {"model": str(path), "inputs": str(inputs), "provider": plan.provider, "placement": True}
            outcome = bench.run_worker([sys.executable, str(bench.WORKER), json.dumps(spec)], 2**62, 600.0)
            store.data["placement"][key] = outcome.get("placement") or {
                "error": outcome.get("error") or outcome.get("detail")
            }
            store.save()


# --- decoding -----------------------------------------------------------------------------------


def decode_key(batch: int, variant: str, context: int) -> str:
    return f"decode/b{batch}/{variant}/{context}"


def decode_all(args, store: Store, folder: Path, deadline: float) -> None:
    """bench/decode.py's decoders, one token per step after ``context`` tokens, on the provider:
    a cache of that length or a state of fixed size (zeros: a step's time does not depend on
    them), bound to the device once. A series (variant, batch) stops at its first failure."""
    try:
        import decode  # bench/decode.py: exports with transformers, tests/decoders.py

        shape = decode.Shape(**SMOKE_DECODER) if args.smoke else decode.Shape()
        paths = decode.model_files(shape, decode.CACHE, folder)  # exports kept between runs, not in the output
    except Exception as error:  # transformers missing on the GPU machine: the other sections stand
        store.data["decode_note"] = f"decoding not measured: {type(error).__name__}: {str(error)[:300]}"
        return
    store.data["decode_shape"] = shape.describe()
    store.data["decode_labels"] = {v.key: v.label for v in decode.VARIANTS if v.decodes}
    for variant in (v for v in decode.VARIANTS if v.decodes):
        for batch in args.decode_batches:
            for context in args.decode_contexts:
                key = decode_key(batch, variant.key, context)
                if store.cell(key) is None and time.monotonic() < deadline:
                    print(f"== decoding: {variant.label}, batch {batch}, context {context}", file=sys.stderr)
                    m, carried = decode_step(paths[variant.key], variant.label, batch, context, args)
                    store.data.setdefault("decode_bytes", {})[key] = carried
                    store.put(key, m)
                if store.cell(key) is not None and store.cell(key).status != "ok":
                    break


SMOKE_DECODER = dict(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=100, max_positions=512)


def decode_step(path: Path, label: str, batch: int, context: int, args) -> tuple[bench.Measurement, int | None]:
    """(the step's times, the bytes it carries to the next step)."""
    import onnxruntime as ort

    from attnrewrite.generate import Decoder

    try:
        provider = {"cuda": ("CUDAExecutionProvider", {"use_tf32": "0"})}.get(args.provider, "CPUExecutionProvider")
        session = ort.InferenceSession(str(path), providers=[provider])
        decoder = Decoder.of(session, label)
        feeds = decoder.feeds(np.zeros((batch, 1), np.int64), np.ones((batch, context + 1), np.int64), step=1)
        for carried in decoder.carried:
            if carried.input.endswith(".position"):  # a windowed state's position counter
                feeds[carried.input] = np.array(context, carried.dtype)
                continue
            dims = [
                batch if axis == 0 else d if isinstance(d, int) else context for axis, d in enumerate(carried.shape)
            ]
            feeds[carried.input] = np.zeros(dims, carried.dtype)
        device = "cuda" if args.provider == "cuda" else "cpu"
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, 0))
        del feeds
        for output in session.get_outputs():
            binding.bind_output(output.name, device)
        times = []
        for run in range(args.warmup + args.repeats):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            if run >= args.warmup:
                times.append(time.perf_counter() - start)
        outputs = dict(zip((o.name for o in session.get_outputs()), binding.get_outputs()))
        carried_bytes = sum(
            int(np.prod(outputs[c.output].shape())) * np.dtype(c.dtype).itemsize for c in decoder.carried
        )
    except Exception as error:  # out of memory at 64k, batch 16: the series stops, the run goes on
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        status = "over_memory" if OUT_OF_MEMORY.search(detail) else "failed"
        return bench.Measurement(label, context, status, detail=detail), None
    return bench.Measurement(label, context, "ok", times), carried_bytes


def decode_report(store: Store, args) -> list[str]:
    note = store.data.get("decode_note")
    if note:
        return ["### decoding, one token per step", "", f"- {note}", ""]
    labels = store.data.get("decode_labels", {})
    keys = [k for k in labels if any(c.startswith("decode/") and c.split("/")[2] == k for c in store.data["cells"])]
    if not keys:
        return []
    sizes = store.data.get("decode_bytes", {})
    out = []
    for batch in args.decode_batches:
        rows = []
        for context in args.decode_contexts:
            row = [str(context)]
            for variant in keys:
                m = store.cell(decode_key(batch, variant, context))
                carried = sizes.get(decode_key(batch, variant, context))
                size = f" ({bytes_text(carried)})" if carried is not None else ""
                row.append(cell_text(m, None) + (size if m is not None and m.status == "ok" else ""))
            rows.append(row)
        out += [
            f"### decoding, one token per step, batch {batch} (fp32)",
            "",
            f"- {store.data.get('decode_shape', '')}; ms per step (in parentheses: the cache or state it carries)",
            "",
            table(["context", *(labels[k] for k in keys)], rows, numeric=False),
            "",
        ]
    return out


def bytes_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# --- the machine --------------------------------------------------------------------------------


def environment(provider: str) -> dict:
    """GPU, driver, CUDA, cuDNN and library versions, as facts for the report."""
    import numpy
    import onnx
    import onnxruntime
    import torch

    facts = {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": bench.cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(bench.physical_memory_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "provider": provider,
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_providers": onnxruntime.get_available_providers(),
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "numpy": numpy.__version__,
        "gpu": gpu_facts(),
    }
    return facts


def gpu_facts() -> list[dict] | str:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        cuda = re.search(
            r"CUDA Version:\s*([\d.]+)",
            subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"no GPU seen ({type(error).__name__}: nvidia-smi)"
    fields = ("name", "driver", "memory", "max_sm_clock", "power_limit")
    return [
        dict(zip(fields, (x.strip() for x in line.split(","))), driver_cuda=cuda.group(1) if cuda else None)
        for line in out.strip().splitlines()
    ]


# --- the report ---------------------------------------------------------------------------------


def measurements(
    store: Store, section: str, dtype: str, columns: dict[str, str], lengths: list[int]
) -> dict[str, list[bench.Measurement]]:
    found = {}
    for column in columns:
        found[column] = [m for n in lengths if (m := store.cell(cell_key(section, dtype, column, n))) is not None]
    return found


def cell_text(m: bench.Measurement | None, base_ms: float | None) -> str:
    if m is None:
        return ""
    if m.status == "ok":
        ms = m.median_s * 1e3
        return f"{ms:.2f}" + (f" ({base_ms / ms:.2f}x)" if base_ms else "")
    if m.status == "over_time" and m.times_s:
        return f">{m.times_s[-1] * 1e3:.0f} (over budget)"
    if m.status == "over_memory":
        return "GPU OOM" if OUT_OF_MEMORY.search(m.detail or "") else "over memory"
    if m.status == "failed":
        return "crashed" if "worker exited with -" in (m.detail or "") else "failed"
    return m.status.replace("_", " ")


def memory_text(m: bench.Measurement | None, provider: str) -> str:
    if m is None or m.status != "ok":
        return ""
    if provider == "cuda" and m.gpu_memory_bytes is None:
        return "n/a"  # nvidia-smi did not show this process; its host RSS would be a wrong answer
    return f"{m.peak_bytes / 2**20:.0f}" if m.peak_bytes is not None else ""


def section_report(store: Store, plan: Plan, section: str, dtype: str) -> list[str]:
    columns = plan.columns[(section, dtype)]
    series = measurements(store, section, dtype, columns, plan.lengths)
    at = {(c, m.n): m for c, ms in series.items() for m in ms}
    baseline = "fused" if "fused" in columns else "softmax"
    header = ["N", *columns.values()]
    times, memory = [], []
    for n in plan.lengths:
        base = at.get((baseline, n))
        base_ms = base.median_s * 1e3 if base is not None and base.status == "ok" else None
        times.append([str(n), *[cell_text(at.get((c, n)), base_ms if c != baseline else None) for c in columns]])
        memory.append([str(n), *[memory_text(at.get((c, n)), plan.provider) for c in columns]])
    memory_kind = (
        "GPU memory of the process (nvidia-smi, CUDA context included)"
        if plan.provider == "cuda"
        else "peak RSS of the process"
    )
    out = [
        f"### {SECTIONS[section]}, {dtype}",
        "",
        *[f"- {note}" for note in plan.notes[(section, dtype)]],
        "",
        f"Median latency, ms (in parentheses: speedup over {columns[baseline]})",
        "",
        table(header, times),
        "",
        f"Memory, MiB: {memory_kind}",
        "",
        table(header, memory),
        "",
    ]
    out += crossovers(series, columns, plan.lengths)
    problems = [
        (columns[c], m) for c, ms in series.items() for m in ms if m.status not in ("ok", NOT_REACHED) and m.detail
    ]
    if problems:
        out += (
            ["Cells that did not finish:", ""]
            + [f"- {title}, N = {m.n}: {m.status.replace('_', ' ')}: {m.detail}" for title, m in problems]
            + [""]
        )
    return out


def crossovers(series: dict[str, list[bench.Measurement]], columns: dict[str, str], lengths: list[int]) -> list[str]:
    rows = []
    for method in passes.PASSES:
        if method not in series:
            continue
        cells = [method]
        for baseline in ("softmax", "fused"):
            if baseline in series:
                n = bench.crossover_length(bench.compare_series(series[method], series[baseline], lengths))
                cells.append(f"N = {n}" if n else "never")
            else:
                cells.append("-")
        rows.append(cells)
    if not rows:
        return []
    return [
        "Crossover: the smallest N from which the method is faster at every longer N measured, beyond the spread of the runs (interquartile ranges apart)",
        "",
        table(["method", "vs softmax (ORT)", "vs fused exact (ORT)"], rows, numeric=False),
        "",
    ]


def placement_report(store: Store, plan: Plan) -> list[str]:
    rows = []
    for (section, dtype), paths in plan.onnx.items():
        for column in paths:
            found = store.data["placement"].get(f"{section}/{dtype}/{column}")
            if found is None:
                continue
            if "error" in found:
                rows.append([section, dtype, column, "", "", f"placement failed: {found['error']}"])
                continue
            data = found["data_elsewhere"]
            shown = "; ".join(data[:4]) + (f"; ... ({len(data)} in all)" if len(data) > 4 else "")
            rows.append([section, dtype, column, str(found["nodes"]), str(len(found["memcpy"])), shown or "none"])
    if not rows:
        return []
    expected = bench_worker_provider(plan.provider)
    return [
        "## Node placement",
        "",
        f"Nodes that ran off {expected} and make float tensors (shape arithmetic on CPU is left out: onnxruntime",
        f"puts it there on purpose), and the copies between devices, at N = {plan.lengths[0]}; from onnxruntime's profiler.",
        "",
        table(["section", "dtype", "model", "nodes", "Memcpy", "float-producing nodes elsewhere"], rows, numeric=False),
        "",
    ]


def bench_worker_provider(provider: str) -> str:
    return {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[provider]


def render(store: Store, plan: Plan, args, plots: list[str], analysis: str | None) -> str:
    env = store.data["environment"]
    gpu = env["gpu"]
    gpu_line = (
        gpu
        if isinstance(gpu, str)
        else "; ".join(
            f"{g['name']} ({g['memory']}, driver {g['driver']}, CUDA {g['driver_cuda']}, max SM clock {g['max_sm_clock']}, power limit {g['power_limit']})"
            for g in gpu
        )
    )
    missing = sum(1 for c in store.data["cells"].values() if c["status"] == NOT_REACHED)
    out = [
        "# CUDA benchmark results" + (" (SMOKE RUN: CPU provider, tiny N; not a measurement)" if args.smoke else ""),
        "",
        f"Written by `python bench/run_cuda_benchmarks.py {' '.join(args.argv)}` "
        f"({', '.join(r['started'] for r in store.data['runs'])}; {len(store.data['runs'])} run(s)).",
        "",
        "## Machine",
        "",
        f"- GPU: {gpu_line}",
        f"- CPU: {env['cpu']}, {env['cores']} cores, {env['memory_gb']} GB; Python {env['python']}",
        f"- onnxruntime {env['onnxruntime']} ({', '.join(env['onnxruntime_providers'])}), onnx {env['onnx']}, "
        f"torch {env['torch']} (CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}), numpy {env['numpy']}",
        f"- provider {plan.provider}; batch 1; median of {args.repeats} runs after {args.warmup} warm-up; each ONNX "
        f"model's lengths in one process, ascending (its memory: the process's peak so far), each torch cell in a "
        f"fresh process; onnxruntime with IOBinding on CUDA (inputs on the device, no copies timed); torch runs "
        f"synchronized; a series stops at its first run over {args.budget_seconds:g} s, GPU out-of-memory or failure.",
        "- options: "
        + ", ".join(
            f"{m} {standard.method_options(m, plan.lengths)}"
            for m in passes.PASSES
            if standard.method_options(m, plan.lengths)
        ),
        "",
    ]
    if missing:
        out += [
            f"**{missing} cells were not reached before the deadline**: rerun with `--resume` to complete them.",
            "",
        ]
    out += ["## Results", ""]
    for section, dtype in plan.columns:
        out += section_report(store, plan, section, dtype)
    out += decode_report(store, args)
    out += placement_report(store, plan)
    out += [
        "## Analysis",
        "",
        analysis or f"{standard.ANALYSIS_START}\n(to be written after a full run)\n{standard.ANALYSIS_END}",
        "",
    ]
    out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out)


def draw(store: Store, plan: Plan, folder: Path) -> list[str]:
    names = []
    for (section, dtype), columns in plan.columns.items():
        series = measurements(store, section, dtype, columns, plan.lengths)
        name = f"cuda_{section}_{dtype}.png" if plan.provider == "cuda" else f"smoke_{section}_{dtype}.png"
        bench.plot_series(
            {columns[c]: ms for c, ms in series.items()},
            folder / name,
            f"{SECTIONS[section]}, {dtype}, {plan.provider}",
        )
        names.append(name)
    return names


# --- main ---------------------------------------------------------------------------------------


def methods_list(text: str) -> list[str]:
    methods = [m for m in text.split(",") if m]
    unknown = [m for m in methods if m not in passes.PASSES]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"methods are among {', '.join(passes.PASSES)}; got {text!r}")
    return methods


def dtypes_list(text: str) -> list[str]:
    dtypes = [d for d in text.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise argparse.ArgumentTypeError(f"dtypes are among {', '.join(DTYPES)}; got {text!r}")
    return dtypes


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="CPU provider, N = 64, 1 repeat: the whole script in about a minute"
    )
    parser.add_argument("--lengths", type=lambda t: sorted(int(x) for x in t.split(",")), default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 5; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2; smoke 0)")
    parser.add_argument("--budget-seconds", type=float, default=2.0, help="a series stops at a run slower than this")
    parser.add_argument("--budget-gb", type=float, default=None, help="host memory per cell (default: 3/4 of RAM)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (onnxruntime intra-op and torch)")
    parser.add_argument(
        "--deadline-minutes", type=float, default=9.0, help="start no cell after this; then write the report"
    )
    parser.add_argument("--resume", action="store_true", help="keep the cells already in OUTPUT_DIR/results_cuda.json")
    parser.add_argument("--no-placement", action="store_true", help="leave out the node placement check")
    parser.add_argument("--no-decode", action="store_true", help="leave out the decoding section")
    parser.add_argument(
        "--methods", type=methods_list, default=list(passes.PASSES), help="a subset, e.g. hydra,lsh (default: all)"
    )
    parser.add_argument("--dtypes", type=dtypes_list, default=list(DTYPES), help="fp16,fp32 (default) or one of them")
    parser.add_argument("--output-dir", type=Path, default=HERE)
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    args.argv = raw
    args.provider = "cpu" if args.smoke else "cuda"
    args.lengths = args.lengths or (SMOKE_LENGTHS if args.smoke else LENGTHS)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 2)
    args.decode_contexts = SMOKE_DECODE_CONTEXTS if args.smoke else DECODE_CONTEXTS
    args.decode_batches = SMOKE_DECODE_BATCHES if args.smoke else DECODE_BATCHES
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    deadline = started + 60 * args.deadline_minutes
    if args.provider == "cuda":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            print(
                f"run_cuda_benchmarks: this onnxruntime ({onnxruntime.__version__}) has no CUDA execution provider "
                "(see docs/GPU.md); --smoke runs the script on CPU",
                file=sys.stderr,
            )
            return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "environment": environment(args.provider),
        "runs": [{"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": args.argv}],
    }
    store = Store(args.output_dir / JSON_NAME, args.resume, header)
    with tempfile.TemporaryDirectory(prefix="attnrewrite-cuda-") as tmp:
        folder = Path(tmp)
        plan, originals = plan_sweep(args, folder)
        store.data["plan"] = {"/".join(k): list(v) for k, v in plan.columns.items()} | {"lengths": plan.lengths}
        store.save()
        if not args.no_placement:
            print("== node placement", file=sys.stderr)
            place_all(plan, originals, store, folder, deadline)
        sweep_all(plan, originals, args, store, folder, deadline)
        if not args.no_decode:
            decode_all(args, store, folder, deadline)
    plots = draw(store, plan, args.output_dir)
    report = args.output_dir / REPORT_NAME
    report.write_text(render(store, plan, args, plots, standard.previous_analysis(report)))
    print(f"wrote {report} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
