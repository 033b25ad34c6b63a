"""``attnrewrite check ORIGINAL REWRITTEN``: run both on the same inputs, report how far the
second is from the first, and fail below the fidelity gates given (attnrewrite.check)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnrewrite import check as check_mod
from attnrewrite.check_window import check_against_window
from attnrewrite.cli_parsing import CommandParser, add_settings, check_length_fits
from attnrewrite.cli_rewrite import check_fidelity_arguments
from attnrewrite.onnx import io as onnx_io
from attnrewrite.record import CHECKED, stage, state_memory_line
from attnrewrite.settings import GateSettings


def build_check_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="attnrewrite check",
        description="Run two models on the same inputs and report, per output, how far the second is from the first.",
    )
    parser.add_argument("original", help="the reference model")
    parser.add_argument("rewritten", help="the model to compare with it")
    add_settings(parser, GateSettings, gate="fail (exit 1)")
    parser.add_argument(
        "--against-window",
        action="store_true",
        help="also score, on the same inputs, the original cut to a window of exact keys (streaming, 4 sinks) "
        "whose KV cache costs the bytes of the rewritten model's state (docs/checking.md)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    parser.add_argument(
        "--report",
        metavar="FILE.json",
        help="write the run's report as JSON, failed or not: how it ended and the comparison (docs/report.md)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks")
    return parser


def check_command(args, run) -> int:
    """``run``: the command line's (cli.py), its report filled in."""
    report = run.report
    report.input, report.compared = args.original, args.rewritten
    report.thresholds = {
        "min_cosine": args.min_cosine,
        "min_agreement": args.min_agreement,
        "allow_exact": args.allow_exact,
    }
    run.report_to(args.report, keep=[args.original, args.rewritten])
    check_fidelity_arguments(args)
    if args.json:
        onnx_io.check_output_path(args.json, args.original, what="report")
    if args.report:
        for model in (args.original, args.rewritten):
            onnx_io.check_output_path(args.report, model, what="report")
    with stage("load"):
        original = onnx_io.load_model(args.original)
    check_length_fits(original.graph, args, from_empty_cache=check_mod.is_recurrent(args.rewritten))
    compare = check_against_window if args.against_window else check_mod.check
    fidelity = report.fidelity = compare(args.original, args.rewritten, args.inputs, seq=args.seq)
    print(fidelity.table())
    report.state_memory = (check_mod.model_record(args.rewritten) or {}).get("state_memory")
    if report.state_memory is not None:
        print(state_memory_line(report.state_memory))
    if args.json:
        Path(args.json).write_text(json.dumps(fidelity.as_dict(**report.thresholds), indent=2) + "\n")
    with stage("check"):
        fidelity.gate(args.min_cosine, args.min_agreement, args.allow_exact)
    report.end(CHECKED, 0)
    return 0
