"""``attnrewrite bench MODEL --to M``: its arguments, and the sweep (attnrewrite.bench) printed,
saved and plotted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnrewrite import passes
from attnrewrite.cli_parsing import (
    CommandParser,
    merged_heads,
    method_name,
    parse_heads,
    parse_lengths,
    parse_options,
    parse_positive,
)
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io


class LengthsNotRun(AttnRewriteError):
    """Lengths --lengths asked for by name that the sweep did not run: after its table is
    printed and saved, the command fails (exit 2, cli.py) with this one line."""


def build_bench_parser() -> argparse.ArgumentParser:
    from attnrewrite import bench

    parser = CommandParser(
        prog="attnrewrite bench",
        description="Latency and peak memory over sequence length: the original model, the rewritten one, "
        "and the identity-attention bound (each attention replaced by its values). "
        "Each configuration runs in a fresh process.",
    )
    parser.add_argument("model", help="the ONNX model (never modified)")
    parser.add_argument(
        "--to", required=True, type=method_name, choices=list(passes.PASSES), help="the replacement method"
    )
    parser.add_argument("-O", "--option", action="append", default=[], metavar="KEY=VALUE", help="a method option")
    parser.add_argument(
        "--heads",
        type=parse_heads,
        action="append",
        metavar="LAYER:H,H",
        help="heads the rewritten model keeps exact softmax (repeatable), as the rewrite's --heads: their cost",
    )
    parser.add_argument(
        "--lengths",
        type=parse_lengths,
        default=None,
        help="sequence lengths, e.g. 128,256,512 (default: 128 to 16384, doubling, "
        "up to the model's own length limit); a length given here that cannot run fails the command",
    )
    parser.add_argument("--batch", type=parse_positive, default=1, help="batch size (default: 1)")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=bench.DEFAULT_BUDGET_SECONDS,
        help="stop a series once one run takes longer (default: %(default)s)",
    )
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="stop a series once a process's peak memory exceeds this (default: 3/4 of RAM)",
    )
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime execution provider")
    parser.add_argument("--fp16", action="store_true", help="convert the models to float16 (CUDA only)")
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the original with its attention fused (onnxruntime's transformers optimizer, "
        "else opset-23 Attention): the best exact alternative (default: on with --provider cuda)",
    )
    parser.add_argument("--threads", type=parse_positive, default=None, help="onnxruntime intra-op threads")
    parser.add_argument(
        "--repeats",
        type=parse_positive,
        default=bench.DEFAULT_REPEATS,
        help="timed runs after warm-up (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup", type=int, default=bench.DEFAULT_WARMUP, help="untimed runs first (default: %(default)s)"
    )
    parser.add_argument(
        "--trials", type=parse_positive, default=1, help="fresh processes per configuration, runs pooled (default: 1)"
    )
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw latency and memory vs length (needs matplotlib)")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks")
    return parser


def bench_command(args) -> int:
    from attnrewrite import bench

    for path in (args.json, args.plot):  # refused now, not after a long sweep
        if path:
            onnx_io.check_output_path(path, args.model, what="report")
    config = bench.BenchConfig(
        model=args.model,
        method=args.to,
        options={**parse_options(args.option), **_bench_heads(args.heads)},
        lengths=args.lengths or bench.DEFAULT_LENGTHS,
        batch=args.batch,
        budget_seconds=args.budget_seconds,
        budget_gb=args.budget_gb,
        provider=args.provider,
        fp16=args.fp16,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        trials=args.trials,
        fused=args.fused,
    )
    result = bench.run(config)
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if args.plot:
        bench.plot(result, args.plot)
    if args.lengths and result.not_run:  # asked for by name, so not running them is a failure
        lengths = ",".join(map(str, result.not_run))
        raise LengthsNotRun(f"--lengths {lengths} not run: sweep {result.limit}")
    return 0


def _bench_heads(given: list | None) -> dict:
    """The rewrite's exact heads (rewrite_model's ``exact_heads``), where --heads gives some."""
    heads = merged_heads(given)
    if heads == "auto":
        raise AttnRewriteError("bench --heads takes LAYER:H,H: 'auto' measures fidelity, not speed")
    return {"exact_heads": heads} if heads else {}
