"""The standard sweep: every registered method on a BERT-base shaped encoder layer, the peers on
the same attention shapes, and a long-sequence memory check. Writes bench/RESULTS.md.

    python bench/run_benchmarks.py                     # the full run (tens of minutes on 2 cores)
    python bench/run_benchmarks.py --quick             # 128..1024, 2 repeats: to try the script
    python bench/run_benchmarks.py --lengths 4096 --attention-rows softmax,hedgehog,hedgehog:window=32
                                                       # a few attention-only rows, printed
    python bench/run_benchmarks.py --lengths 4096 --attention-rows causal:softmax,causal:hedgehog:window=32
                                                       # causal rows: "causal:" before any row
    python bench/run_benchmarks.py --decode            # decoding: KV cache vs recurrent (bench/decode.py)

Everything runs on CPU, fp32, batch 1, ``--threads`` intra-op threads (2), each configuration
in a fresh process (see attnrewrite/bench.py for why and how memory is measured):

1. one BERT-base encoder layer (d = 768, 12 heads, FFN 3072, Q/K/V/output projections) on hidden
   states: softmax (as exported), the identity-attention bound, and each method in passes.PASSES;
2. attention only, q, k, v of [1, 12, N, 64]: our ONNX graphs (softmax, each method, and the
   ATTENTION_VARIANTS: linear and hedgehog with window=32) beside
   performer-pytorch FastAttention (FAVOR+), fast-transformers LinearAttention (elu + 1) and
   torch's scaled_dot_product_attention;
   causal attention only (decoder prefill), the same shapes: a causally masked softmax export and
   the CAUSAL_ROWS rewrites of it (keys and labels "causal:<row>");
3. a 6-layer, 384-wide encoder rewritten with hydra at N = 32768 (and its softmax original),
   peak memory against an 8 GB budget.

Where a target of the issue is missed, the configuration is profiled with onnxruntime's
profiler and the nodes that take the time are listed. A hand-written analysis between the
ANALYSIS markers of an existing RESULTS.md is kept when the file is regenerated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # models.py, peers.py, common.py

import models
from common import DECODING_MARKERS, GENAI_MARKERS, Target, cpu_seconds, machine_state, others_cores, table

from attnrewrite import bench, passes
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.rewrite import rewrite_model

LAYER = dict(hidden=768, heads=12, layers=1)
ATTENTION = dict(heads=12, head_dim=64)
STACK = dict(hidden=384, heads=12, layers=6)
STACK_N = 32768
STACK_BUDGET_GB = 8.0
FEATURES = 256  # favor's m, performer's nb_features, linformer's k
# Attention-only rows beyond one per method: "method:option=value,...", labelled as such.
ATTENTION_VARIANTS = ("linear:window=32", "hedgehog:window=32")
# The causal attention-only rows, rewrites of a causally masked softmax export ("softmax": the export).
CAUSAL = "causal:"
CAUSAL_ROWS = ("softmax", "linear", "hydra", "hedgehog", "hedgehog:window=32", "favor", "favor:window=32")

ANALYSIS_START, ANALYSIS_END = "<!-- ANALYSIS -->", "<!-- /ANALYSIS -->"


def method_options(method: str, lengths: list[int]) -> dict:
    """The settings the issue's targets name; a Linformer projection must cover the longest N."""
    return {
        "favor": {"features": FEATURES},
        "linformer": {"proj_dim": FEATURES, "max_len": max(lengths)},
    }.get(method, {})


# --- building what is measured ------------------------------------------------------------------


def parse_variant(variant: str) -> tuple[str, dict[str, str]]:
    """ "hedgehog:window=32" -> ("hedgehog", {"window": "32"}); a plain method name has no options."""
    method, _, options = variant.partition(":")
    return method, dict(item.split("=", 1) for item in options.split(",") if item)


def rewritten_variants(
    original: Path,
    folder: Path,
    lengths: list[int],
    with_bound: bool = True,
    extra: tuple[str, ...] = (),
    methods: list[str] | None = None,
) -> tuple[dict[str, Path], dict[str, str]]:
    """softmax, the identity bound, one model per method (default: every registered one) and one
    per ``extra`` variant (parse_variant); variants that cannot rewrite this model are reported,
    not fatal."""
    paths, refused, sites = {"softmax": original}, {}, None
    for variant in [*(methods or passes.PASSES), *extra]:
        method, options = parse_variant(variant)
        try:
            model, record = rewrite_model(
                onnx_io.load_model(original), method, **{**method_options(method, lengths), **options}
            )
        except (AttnRewriteError, passes.OptionError, ValueError) as error:
            refused[variant] = str(error)
            continue
        except Exception as error:  # a pass still being written must not stop the other methods
            refused[variant] = (
                f"the rewrite failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
            )
            continue
        if not record.rewritten:
            refused[variant] = "; ".join(sorted({o.reason for o in record.skipped})) or "no site"
            continue
        sites = [o.site.name for o in record.rewritten]
        paths[variant] = folder / f"{original.stem}.{variant.replace(':', '.').replace('=', '').replace(',', '.')}.onnx"
        onnx_io.save_model(model, paths[variant])
    if sites and with_bound:
        paths["identity"] = folder / f"{original.stem}.identity.onnx"
        onnx_io.save_model(bench.identity_attention(onnx_io.load_model(original), sites), paths["identity"])
    order = ["softmax", "identity", *passes.PASSES, *extra]
    return {k: paths[k] for k in order if k in paths}, refused


def variant_label(key: str) -> str:
    causal = key.startswith(CAUSAL)
    method, options = parse_variant(key.removeprefix(CAUSAL))
    if method == "softmax":
        return "causal softmax (ORT)" if causal else "softmax (ORT)"
    return " ".join(["causal"] * causal + [method, *(f"{name}={value}" for name, value in options.items())])


class CausalSoftmaxAttention(models.SoftmaxAttention):
    """softmax(q k^T / sqrt(d) + causal mask) v: what a decoder's prefill computes."""

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        later = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        return torch.matmul(torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1), v)


def causal_variants(folder: Path, lengths: list[int], rows) -> tuple[Path, dict[str, Path], dict[str, str]]:
    """The causal export and its rewrites for ``rows`` (CAUSAL_ROWS' form), keyed "causal:<row>"."""
    path = folder / "causal_attention.onnx"
    example = tuple(torch.randn(1, ATTENTION["heads"], 16, ATTENTION["head_dim"]) for _ in range(3))
    models.export(  # the same inputs and dynamic axes as models.export_attention
        CausalSoftmaxAttention(ATTENTION["head_dim"]), example, list("qkv"), {x: {2: "sequence"} for x in "qkv"}, path
    )
    methods = [row for row in rows if row in passes.PASSES]
    extra = tuple(row for row in rows if row != "softmax" and row not in passes.PASSES)
    paths, refused = rewritten_variants(path, folder, lengths, with_bound=False, extra=extra, methods=methods)
    prefixed = lambda d: {CAUSAL + k: v for k, v in d.items() if k in rows}  # noqa: E731
    return path, prefixed(paths), prefixed(refused)


def inputs_writer(model: Path, folder: Path, batch: int = 1):
    graph = onnx_io.load_model(model).graph

    def inputs_for(n: int) -> Path:
        path = folder / f"inputs-{model.stem}-{n}.npz"
        np.savez(path, **generate_inputs(graph, batch=batch, seq=n))
        return path

    return inputs_for


def peer_runner(peer: str, config: bench.BenchConfig):
    def run_peer(n: int, inputs: Path) -> bench.Measurement:
        spec = {
            "peer": peer,
            "n": n,
            "features": FEATURES,
            "threads": config.threads,
            "warmup": config.warmup,
            "repeats": config.repeats,
            "budget_seconds": config.budget_seconds,
            **ATTENTION,
        }
        return bench.measure_worker([sys.executable, str(HERE / "peers.py"), json.dumps(spec)], config, n)

    return run_peer


def peer_availability() -> dict[str, str | None]:
    """None when the peer can run here, else why not."""
    status = {}
    for peer, module in (("performer", "performer_pytorch"), ("fast_transformers", "fast_transformers.attention")):
        try:
            __import__(module)
            status[peer] = None
        except Exception as error:  # an ImportError, or a build that imports but cannot load
            status[peer] = f"{type(error).__name__}: {error}"
    status["sdpa"] = None
    return status


PEER_LABELS = {
    "performer": f"performer FastAttention (m={FEATURES})",
    "fast_transformers": "fast-transformers LinearAttention",
    "sdpa": "torch SDPA (softmax)",
}


# --- profiling ----------------------------------------------------------------------------------


def profile(model: Path, inputs: Path, threads: int, folder: Path) -> list[tuple[str, str, float, float]]:
    """(op type, part, ms per run, share) from onnxruntime's profiler, largest first. part is
    "replacement" for the nodes onnxruntime inlined from an attnrewrite function (it names
    them _inlfunc_*), "rest" for the model around them."""
    runs = 2
    spec = {
        "model": str(model),
        "inputs": str(inputs),
        "provider": "cpu",
        "threads": threads,
        "warmup": 1,
        "repeats": runs,
        "budget_seconds": 1e9,
        "profile": str(folder / f"profile-{model.stem}"),
    }
    outcome = bench.run_worker([sys.executable, str(bench.WORKER), json.dumps(spec)], 2**62, 1e9)
    if outcome.get("status") != "ok":
        return []
    events = json.loads(Path(outcome["profile"]).read_text())
    # the warm-up run (arena growth, first-touch page faults) is left out
    first = min((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"], default=None)
    warm_from = first["ts"] + first["dur"] if first else 0
    times: dict[tuple[str, str], float] = defaultdict(float)
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time") and event["ts"] >= warm_from:
            part = "replacement" if name.startswith("_inlfunc_") else "rest"
            times[(event["args"].get("op_name", "?"), part)] += event["dur"] / 1e3 / runs  # µs -> ms per run
    total = sum(times.values()) or 1.0
    return sorted(((op, part, ms, ms / total) for (op, part), ms in times.items()), key=lambda r: -r[2])


# --- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Section:
    title: str
    lengths: list[int]
    measurements: list[bench.Measurement]
    stopped: dict[str, str]
    labels: dict[str, str]  # runner key -> column title

    def cell(self, key: str, n: int) -> bench.Measurement | None:
        return next((m for m in self.measurements if m.variant == key and m.n == n), None)

    def median_ms(self, key: str, n: int) -> float | None:
        m = self.cell(key, n)
        return m.median_s * 1e3 if m is not None and m.status == "ok" else None


def run_section(title, runners, labels, config, inputs_for) -> Section:
    print(f"== {title}", file=sys.stderr)
    measurements, stopped = bench.sweep(runners, config, inputs_for)
    return Section(title, config.lengths, measurements, stopped, labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128..1024, 2 repeats, no N = 32768 run")
    parser.add_argument("--lengths", type=lambda t: sorted(int(x) for x in t.split(",")), default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3, help="fresh processes per configuration (runs pooled)")
    parser.add_argument("--budget-seconds", type=float, default=60.0)
    parser.add_argument("--budget-gb", type=float, default=14.0)  # softmax at N = 8192 peaks at 12.9 GB
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--skip-stack", action="store_true", help="leave out the 6-layer N = 32768 run")
    parser.add_argument(
        "--attention-rows",
        metavar="VARIANTS",
        help="only the attention-only section, for these comma-separated variants "
        "(softmax, a method, or method:option=value, e.g. hedgehog:window=32; several options joined by +): "
        "print its tables (and, with --rows-json, write them as JSON: bench/readme_table.py reads it)",
    )
    parser.add_argument("--rows-json", type=Path, help="with --attention-rows: also write the rows to this JSON file")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="only the decoding benchmark (bench/decode.py): a Llama-shaped decoder's KV cache against its "
        "recurrent hedgehog rewrites; --lengths are its contexts (default 1024,4096,16384,65536); writes the "
        "Decoding section of --output and decode.png and decode.json beside it",
    )
    args = parser.parse_args(argv)
    if args.decode:
        import decode

        return decode.main(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    lengths = args.lengths or ([128, 256, 512, 1024] if args.quick else bench.DEFAULT_LENGTHS)
    config = bench.BenchConfig(
        model="",
        method="",
        lengths=lengths,
        budget_seconds=args.budget_seconds,
        budget_gb=args.budget_gb,
        threads=args.threads,
        repeats=2 if args.quick else args.repeats,
        trials=1 if args.quick else args.trials,
    )
    if args.attention_rows:
        return attention_rows([v.replace("+", ",") for v in args.attention_rows.split(",")], config, args.rows_json)
    started, cpu_start = machine_state(), cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="attnrewrite-standard-") as tmp:
        folder = Path(tmp)
        layer = models.export_encoder(folder / "layer.onnx", **LAYER)
        attention = models.export_attention(folder / "attention.onnx", **ATTENTION)

        layer_paths, layer_refused = rewritten_variants(layer, folder, lengths)
        layer_labels = {
            k: ("softmax (exported)" if k == "softmax" else "identity bound" if k == "identity" else k)
            for k in layer_paths
        }
        runners = {k: bench.onnx_runner(p, config) for k, p in layer_paths.items()}
        layer_section = run_section(
            "one BERT-base encoder layer", runners, layer_labels, config, inputs_writer(layer, folder)
        )

        # attention only: no bound (it would be zero work)
        attention_paths, attention_refused = rewritten_variants(
            attention, folder, lengths, with_bound=False, extra=ATTENTION_VARIANTS
        )
        peers = peer_availability()
        runners = {k: bench.onnx_runner(p, config) for k, p in attention_paths.items()}
        runners.update({peer: peer_runner(peer, config) for peer, why in peers.items() if why is None})
        labels = {k: ("softmax (ORT)" if k == "softmax" else variant_label(k)) for k in attention_paths} | {
            p: PEER_LABELS[p] for p in peers if peers[p] is None
        }
        attention_section = run_section("attention only", runners, labels, config, inputs_writer(attention, folder))
        causal, causal_paths, causal_refused = causal_variants(folder, lengths, CAUSAL_ROWS)
        runners = {k: bench.onnx_runner(p, config) for k, p in causal_paths.items()}
        labels = {k: variant_label(k) for k in causal_paths}
        causal_section = run_section("causal attention only", runners, labels, config, inputs_writer(causal, folder))

        stack = None if (args.quick or args.skip_stack) else run_stack(folder, config)
        targets = evaluate_targets(layer_section, attention_section, stack) + causal_targets(causal_section)
        profiles = {}
        for target in targets:
            if target.reached is not True and target.profile:
                model_key, n, section_name = target.profile
                model, paths = {
                    "layer": (layer, layer_paths),
                    "attention": (attention, attention_paths),
                    "causal": (causal, causal_paths),
                }[section_name]
                if model_key in paths:
                    writer = inputs_writer(model, folder)
                    print(f"== profiling {model_key} at N = {n} ({section_name})", file=sys.stderr)
                    profiles[(model_key, n, section_name)] = profile(paths[model_key], writer(n), args.threads, folder)
        ended = machine_state()
        ended["others_cores"] = round(others_cores(cpu_start, cpu_seconds()), 2)
        plots = {
            "layer.png": (layer_section, "one BERT-base encoder layer (d=768, 12 heads), CPU, 2 threads"),
            "attention.png": (attention_section, "attention only, [1, 12, N, 64], CPU, 2 threads"),
            "causal.png": (causal_section, "causal attention only, [1, 12, N, 64], CPU, 2 threads"),
        }
        for name, (section, title) in plots.items():
            series = {section.labels[k]: [m for m in section.measurements if m.variant == k] for k in section.labels}
            bench.plot_series(series, args.output.parent / name, title)
        report = render(
            started,
            ended,
            config,
            layer_section,
            attention_section,
            stack,
            targets,
            profiles,
            peers,
            {
                **layer_refused,
                **{f"{k} (attention only)": v for k, v in {**attention_refused, **causal_refused}.items()},
            },
            previous_analysis(args.output),
            list(plots),
            causal=causal_section,
        )
        args.output.write_text(
            report + previous_block(args.output, *DECODING_MARKERS) + previous_block(args.output, *GENAI_MARKERS)
        )
        sections = (layer_section, attention_section, causal_section)
        raw = {
            "machine": {"start": started, "end": ended},
            "config": dataclasses.asdict(config),
            "sections": {s.title: [m.as_dict() for m in s.measurements] for s in sections},
            "stopped": {s.title: s.stopped for s in sections},
            "stack": stack,
            "targets": [dataclasses.asdict(t) for t in targets],
        }
        (args.output.parent / "results.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def attention_rows(variants: list[str], config: bench.BenchConfig, json_path: Path | None = None) -> int:
    """A few attention-only rows (softmax and the given variants) without the whole sweep:
    the tables on stdout, with the machine's state, for RESULTS.md; with ``json_path`` the same
    rows as JSON (the command, the machine, each variant's median ms and peak MiB by N)."""
    cpu_start, started = cpu_seconds(), machine_state()
    with tempfile.TemporaryDirectory(prefix="attnrewrite-rows-") as tmp:
        folder = Path(tmp)
        attention = models.export_attention(folder / "attention.onnx", **ATTENTION)
        plain = [v for v in variants if not v.startswith(CAUSAL)]
        extra = tuple(v for v in plain if v != "softmax" and v not in passes.PASSES)
        paths, refused = rewritten_variants(attention, folder, config.lengths, with_bound=False, extra=extra)
        causal_rows = [v.removeprefix(CAUSAL) for v in variants if v.startswith(CAUSAL)]
        if causal_rows:
            _, causal_paths, causal_refused = causal_variants(folder, config.lengths, causal_rows)
            paths, refused = {**paths, **causal_paths}, {**refused, **causal_refused}
        for variant in variants:
            if variant not in paths:
                raise SystemExit(f"{variant}: {refused.get(variant, 'not a method or variant')}")
        runners = {v: bench.onnx_runner(paths[v], config) for v in variants}
        labels = {v: variant_label(v) for v in variants}
        # q, k, v alike in both exports: one inputs file per N serves every row
        section = run_section("attention only", runners, labels, config, inputs_writer(attention, folder))
    state = machine_state()
    print(
        f"{state['time']}, {state['cpu']}, load average {state['load_average']}, "
        f"other processes' cores during the run {others_cores(cpu_start, cpu_seconds()):.2f}; "
        f"{config.threads} threads, {config.trials} trials x {config.repeats} runs\n"
    )
    print(section_tables(section, next((v for v in ("softmax", CAUSAL + "softmax") if v in variants), None)))
    if json_path is not None:
        rows = {
            key: {
                m.n: {"median_ms": round(m.median_s * 1e3, 2), "peak_mib": round((m.peak_bytes or 0) / 2**20)}
                for m in section.measurements
                if m.variant == key and m.status == "ok"
            }
            for key in variants
        }
        record = {
            "command": "python bench/run_benchmarks.py " + " ".join(sys.argv[1:]),
            "machine": {**started, "others_cores": round(others_cores(cpu_start, cpu_seconds()), 2)},
            "threads": config.threads,
            "trials": config.trials,
            "repeats": config.repeats,
            "attention": ATTENTION,
            "rows": rows,
        }
        json_path.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def run_stack(folder: Path, config: bench.BenchConfig) -> dict:
    """The 6-layer, 384-wide encoder at N = 32768: hydra within 8 GB, and what softmax needs."""
    print(f"== 6-layer 384-wide encoder at N = {STACK_N}", file=sys.stderr)
    original = models.export_encoder(folder / "stack.onnx", **STACK)
    model, record = rewrite_model(onnx_io.load_model(original), "hydra")
    hydra = folder / "stack.hydra.onnx"
    onnx_io.save_model(model, hydra)
    inputs = inputs_writer(original, folder)(STACK_N)
    stack_config = dataclasses.replace(config, budget_gb=STACK_BUDGET_GB, repeats=3, trials=1, budget_seconds=600.0)
    result = {"n": STACK_N, "budget_gb": STACK_BUDGET_GB, "sites_rewritten": len(record.rewritten)}
    for key, path in (("hydra", hydra), ("softmax", original)):
        m = bench.onnx_runner(path, stack_config)(STACK_N, inputs)
        m.variant = key
        result[key] = m.as_dict()
        print(f"   {key}: {m.status}, peak {(m.peak_bytes or 0) / 2**30:.2f} GB", file=sys.stderr)
    return result


# --- targets ------------------------------------------------------------------------------------


def evaluate_targets(layer: Section, attention: Section, stack: dict | None) -> list[Target]:
    targets = []
    for method in ("hydra", "linear"):
        ratios = []
        for n in (n for n in layer.lengths if n >= 4096):
            ours, bound = layer.median_ms(method, n), layer.median_ms("identity", n)
            if ours is not None and bound is not None:
                ratios.append((n, ours, bound, ours / bound))
        measured = "; ".join(f"N={n}: {o:.0f} / {b:.0f} ms = {r:.2f}x" for n, o, b, r in ratios) or "not measured"
        worst = max(ratios, key=lambda r: r[3]) if ratios else None
        targets.append(
            Target(
                f"{method} within 1.1x of the identity bound at N >= 4096 (layer)",
                measured,
                None if not ratios else all(r[3] <= 1.1 for r in ratios),
                (method, worst[0], "layer") if worst else None,
            )
        )
    targets.append(
        speedup_target(
            layer,
            "favor",
            "softmax",
            4096,
            3.0,
            f"favor (m={FEATURES}) >= 3x faster than softmax at N=4096 (layer)",
            "layer",
        )
    )
    targets.append(
        speedup_target(
            layer,
            "linformer",
            "softmax",
            4096,
            3.0,
            f"linformer (k={FEATURES}) >= 3x faster than softmax at N=4096 (layer)",
            "layer",
        )
    )
    targets.append(
        speedup_target(layer, "lsh", "softmax", 8192, 1.5, "lsh >= 1.5x faster than softmax at N=8192 (layer)", "layer")
    )
    targets.append(
        speedup_target(
            attention,
            "favor",
            "performer",
            4096,
            1.5,
            f"our FAVOR+ graph >= 1.5x faster than performer FastAttention at N=4096, m={FEATURES} (attention only)",
            "attention",
        )
    )
    if stack is None:
        targets.append(
            Target(f"6-layer 384-wide encoder, hydra, N={STACK_N} within {STACK_BUDGET_GB:g} GB peak", "not run", None)
        )
    else:
        m = stack["hydra"]
        peak = m["peak_rss_bytes"]
        measured = f"{m['status']}, peak RSS {peak / 2**30:.2f} GB" + (
            f", median {m['median_s']:.1f} s" if m["median_s"] else ""
        )
        targets.append(
            Target(
                f"6-layer 384-wide encoder, hydra, N={STACK_N} within {STACK_BUDGET_GB:g} GB peak",
                measured,
                m["status"] == "ok" and peak <= STACK_BUDGET_GB * 2**30,
            )
        )
    return targets


def causal_targets(causal: Section) -> list[Target]:
    """Issue 28's causal window: hedgehog window=32 within 1.6x of causal hedgehog at N = 4096, 16384."""
    window, plain = CAUSAL + "hedgehog:window=32", CAUSAL + "hedgehog"
    ratios = [
        (n, causal.median_ms(window, n), causal.median_ms(plain, n))
        for n in (4096, 16384)
        if causal.median_ms(window, n) is not None and causal.median_ms(plain, n) is not None
    ]
    measured = "; ".join(f"N={n}: {w:.0f} / {p:.0f} ms = {w / p:.2f}x" for n, w, p in ratios) or "not measured"
    worst = max(ratios, key=lambda r: r[1] / r[2]) if ratios else None
    return [
        Target(
            "causal hedgehog window=32 <= 1.6x causal hedgehog at N = 4096 and 16384 (attention only)",
            measured,
            None if len(ratios) < 2 else all(w / p <= 1.6 for _, w, p in ratios),
            (window, worst[0], "causal") if worst else None,
        )
    ]


def speedup_target(
    section: Section, method: str, baseline: str, n: int, factor: float, text: str, where: str
) -> Target:
    ours, base = section.median_ms(method, n), section.median_ms(baseline, n)
    if ours is None:
        return Target(text, f"{method} not measured at N={n}", None)
    if base is None:
        cell = section.cell(baseline, n)
        why = "not measured" if cell is None else cell.status.replace("_", " ")
        return Target(text, f"{method} {ours:.0f} ms; {baseline} {why} at N={n}", None, (method, n, where))
    speedup = base / ours
    return Target(
        text,
        f"{baseline} {base:.0f} ms / {method} {ours:.0f} ms = {speedup:.2f}x",
        speedup >= factor,
        (method, n, where),
    )


# --- the report ---------------------------------------------------------------------------------


def previous_block(path: Path, start: str, end: str) -> str:
    """The text between ``start`` and ``end`` in ``path`` (markers included, on a line of its
    own), or nothing: another writer's section (--decode's, genai_smollm2.py's) kept when the file is regenerated."""
    text = path.read_text() if path.exists() else ""
    if start not in text or end not in text:
        return ""
    return "\n" + text[text.index(start) : text.index(end) + len(end)] + "\n"


def previous_analysis(path: Path) -> str | None:
    if not path.exists():
        return None
    text = path.read_text()
    if ANALYSIS_START in text and ANALYSIS_END in text:
        return text[text.index(ANALYSIS_START) : text.index(ANALYSIS_END) + len(ANALYSIS_END)]
    return None


def _time(m: bench.Measurement | None) -> str:
    if m is None:
        return ""
    if m.status == "ok":
        return f"{m.median_s * 1e3:.1f}"
    if m.status == "over_time" and m.times_s:
        return f">{m.times_s[-1] * 1e3:.0f} (over budget)"
    return m.status.replace("_", " ")


def _memory(m: bench.Measurement | None) -> str:
    if m is None or m.peak_bytes is None:
        return ""
    return f"{m.peak_bytes / 2**20:.0f}" + (
        "" if m.status == "ok" else " (killed)" if m.status == "over_memory" else ""
    )


def section_tables(section: Section, ratio_to: str | None) -> str:
    keys = list(section.labels)
    header = ["N", *[section.labels[k] for k in keys]]
    rows_time, rows_memory = [], []
    for n in section.lengths:
        cells = [section.cell(k, n) for k in keys]
        if not any(cells):
            continue
        row = [str(n)]
        for k, m in zip(keys, cells):
            text = _time(m)
            base = section.median_ms(ratio_to, n) if ratio_to else None
            if base and m is not None and m.status == "ok" and k != ratio_to:
                text += f" ({base / (m.median_s * 1e3):.2f}x)"
            row.append(text)
        rows_time.append(row)
        rows_memory.append([str(n), *[_memory(m) for m in cells]])
    stopped = "\n".join(f"- {section.labels.get(k, k)}: stopped at {why}" for k, why in section.stopped.items())
    return (
        f"Median latency, ms (in parentheses: speedup over {section.labels.get(ratio_to, ratio_to)})\n\n"
        f"{table(header, rows_time)}\n\nPeak memory (RSS of the process), MiB\n\n{table(header, rows_memory)}\n\n"
        + (f"Series stopped early:\n\n{stopped}\n" if stopped else "")
    )


def render(
    started, ended, config, layer, attention, stack, targets, profiles, peers, refused, analysis, plots, causal=None
) -> str:
    others = ended["others_cores"]
    idle = others < 0.05  # (of all cores) the load average before the run may hold our own earlier work
    versions = started["versions"]
    out = [
        "# Benchmark results",
        "",
        f"Written by `python bench/run_benchmarks.py` ({started['time']} to {ended['time']}). Numbers are",
        "benchmarks, not tests: rerun the script on your machine.",
        "",
        "Which method for an encoder, and how fast on a CPU: the tables below and the Analysis after them",
        "(the methods added since, the window's cost); on CUDA: the Analysis' last part. Decoders, a",
        "decoding step's time and memory: Decoding; a real model through onnxruntime-genai: the last",
        "section. How faithful each method is: [FIDELITY.md](FIDELITY.md). Each table says once when, on",
        "which machine and by which command it was measured.",
        "",
        "## Machine and method",
        "",
        f"- CPU: {started['cpu']}, {started['cores']} cores, {started['memory_gb']} GB memory; Python {started['python']}",
        f"- onnxruntime {versions['onnxruntime']}, torch {versions['torch']}, numpy {versions['numpy']}, "
        f"performer-pytorch {versions['performer-pytorch'] or 'not installed'}, "
        f"pytorch-fast-transformers {versions['pytorch-fast-transformers'] or 'not installed'}",
        f"- load average (1, 5, 15 min) before the run {started['load_average']} (after: {ended['load_average']}, ours included); "
        f"other processes used {others:.2f} of {started['cores']} cores on average during the run: "
        + (
            "the machine was otherwise idle."
            if idle
            else "the machine was NOT idle (shared with other work); timings are noisy."
        ),
        f"- fp32, batch 1, {config.threads} intra-op threads (onnxruntime and torch alike); median of "
        f"{config.trials} fresh processes x {config.repeats} runs after {config.warmup} warm-up each, interleaved across models; memory = that process's peak resident set "
        "(VmHWM), interpreter and weights included; a series stops at its first run over "
        f"{config.budget_seconds:g} s or {config.budget_gb:g} GB.",
        f"- methods as registered: {', '.join(passes.PASSES)}; options: "
        + ", ".join(
            f"{m} {method_options(m, config.lengths)}" for m in passes.PASSES if method_options(m, config.lengths)
        ),
        "",
    ]
    if refused:
        out += ["Not measured (the method refused the model):", ""] + [f"- {k}: {v}" for k, v in refused.items()] + [""]
    unavailable = {p: why for p, why in peers.items() if why}
    if unavailable:
        out += ["Peers not measured:", ""] + [f"- {PEER_LABELS[p]}: {why}" for p, why in unavailable.items()] + [""]
    out += [
        "## Targets",
        "",
        table(
            ["target", "measured", "result"],
            [
                [t.text, t.measured, {True: "**reached**", False: "**missed**", None: "not measured"}[t.reached]]
                for t in targets
            ],
            numeric=False,
        ),
        "",
    ]
    out += [
        "## One BERT-base encoder layer (d = 768, 12 heads, FFN 3072, with projections)",
        "",
        "Hidden states [1, N, 768] in and out. `identity bound`: every attention replaced by its values v,",
        "spliced like a real replacement, q, k and v still computed but not q's and k's head transposes",
        "(attnrewrite/bench.py): the fastest any attention replacement can be.",
        "",
        section_tables(layer, "softmax"),
        "## Attention only, q, k, v of [1, 12, N, 64]",
        "",
        "No projections: these rows compare attention implementations, not layers. Ours are ONNX",
        "graphs on onnxruntime; the peers are torch modules (torch SDPA is exact softmax attention).",
        "",
        section_tables(attention, "softmax"),
    ]
    if causal is not None:
        out += [
            "## Causal attention only, q, k, v of [1, 12, N, 64]",
            "",
            "Decoder prefill: a causally masked softmax export and the causal rewrites of it. No causal",
            "lowering takes a CumSum along an axis that grows with N (onnxruntime's CUDA CumSum is",
            "quadratic in its axis; tests/test_causal_prefix.py).",
            "",
            section_tables(causal, CAUSAL + "softmax"),
        ]
    if stack:
        rows = []
        for key in ("hydra", "softmax"):
            m = stack[key]
            median = f"{m['median_s']:.2f} s" if m["median_s"] else "-"
            rows.append(
                [
                    key,
                    m["status"].replace("_", " "),
                    median,
                    f"{(m['peak_rss_bytes'] or 0) / 2**30:.2f}",
                    m["detail"] or "",
                ]
            )
        out += [
            f"## 6-layer, 384-wide encoder at N = {STACK_N}",
            "",
            f"Budget {STACK_BUDGET_GB:g} GB (the process is killed past it).",
            "",
            table(["model", "status", "median", "peak GB", "detail"], rows, numeric=False),
            "",
        ]
    if profiles:
        out += [
            "## Profiles of missed targets",
            "",
            "onnxruntime's profiler, kernel time per run by op type (top 10); part: the replacement's inlined nodes or the rest of the model.",
            "",
        ]
        for (key, n, where), rows in profiles.items():
            replacement = sum(ms for _, part, ms, _ in rows if part == "replacement")
            total = sum(ms for *_, ms, _ in rows)
            out += [f"### {key} at N = {n} ({where})", ""]
            if not rows:
                out += ["profile failed", ""]
                continue
            out += [
                f"Kernel time {total:.0f} ms per run, of which the replacement {replacement:.0f} ms ({replacement / total:.0%}).",
                "",
            ]
            out += [
                table(
                    ["op", "part", "ms per run", "share"],
                    [[op, part, f"{ms:.1f}", f"{share:.0%}"] for op, part, ms, share in rows[:10]],
                ),
                "",
            ]
    out += ["## Analysis", "", analysis or f"{ANALYSIS_START}\n(to be written after a full run)\n{ANALYSIS_END}", ""]
    out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
