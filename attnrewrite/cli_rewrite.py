"""The rewrite command, ``attnrewrite MODEL --to M -o OUT``: its arguments (the declared run
settings' generated from attnrewrite.settings), the checks of what they ask for together, the
run of attnrewrite.pipeline, and the output moved into place once its gates passed. ``--list``
and ``--list-options`` are answered by cli_list.py."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from attnrewrite import __version__, genai_folder, passes, pipeline
from attnrewrite import settings as run_settings
from attnrewrite.cli_list import list_sites, print_options
from attnrewrite.cli_parsing import (
    CommandParser,
    add_settings,
    check_length_fits,
    given_settings,
    merged_heads,
    method_name,
    parse_heads,
    parse_layers,
    parse_options,
)
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.passes.options import Flag
from attnrewrite.record import WRITTEN, RewriteRecord, format_bytes, stage, state_memory_line
from attnrewrite.settings import GateSettings


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="attnrewrite",
        description="Find softmax attention in an ONNX model and replace it with linearized attention.",
        epilog="subcommands: 'attnrewrite check ORIGINAL REWRITTEN' compares outputs, "
        "'attnrewrite bench MODEL --to METHOD' sweeps latency and memory over sequence length, "
        "'attnrewrite generate MODEL [REWRITTEN] --tokenizer T --prompt TEXT' continues text with a decoder "
        "(each with -h for its options)",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="the ONNX model to read, or a folder holding one (an onnxruntime-genai folder: its genai_config.json names it); never modified",
    )
    parser.add_argument("--to", type=method_name, choices=list(passes.PASSES), help="the replacement method")
    parser.add_argument(
        "-o",
        "--output",
        help="where to write the rewritten model; DIR/ (trailing slash): a folder onnxruntime-genai opens, with "
        "genai_config.json and the tokenizer beside model.onnx",
    )
    parser.add_argument("--list", action="store_true", help="only report the attention sites found")
    parser.add_argument(
        "--layers",
        type=parse_layers,
        help="sites to rewrite, by index: 0,2,5-7 (default: all); 'auto' with --min-cosine X: measure what each "
        "site costs alone and replace the least harmful while the model's cosine stays >= X",
    )
    parser.add_argument(
        "--heads",
        type=parse_heads,
        action="append",
        metavar="auto|LAYER:H,H",
        help="heads kept exact softmax inside the replacement: LAYER:H,H (repeatable, e.g. --heads 3:0,7 "
        "--heads 5:2); 'auto' with --min-cosine and/or --min-agreement: measure what each head costs and keep "
        "the fewest costliest exact that meet them (with --layers auto too: a site with every head exact is kept)",
    )
    parser.add_argument(
        "--include-single-query",
        action="store_true",
        help="also rewrite sites with one query (a decoder step), which stay exact by default: linearizing them saves nothing",
    )
    _add_recurrent_arguments(parser)
    parser.add_argument(
        "-O",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method option, e.g. -O features=256 -O seed=1 (see --list-options)",
    )
    parser.add_argument("--list-options", action="store_true", help="print the options of --to METHOD and exit")
    parser.add_argument(
        "--report",
        metavar="FILE.json",
        help="write the run's report as JSON, failed or not: how it ended, every site, the check's figures "
        "(docs/report.md)",
    )
    add_settings(parser, *run_settings.FITTING)  # --calibrate and the settings of the fit it runs
    parser.add_argument(
        "--check", action="store_true", help="compare the rewritten outputs with the original's before writing"
    )
    add_settings(parser, GateSettings, gate="with --check: write nothing and fail")
    parser.add_argument("-v", "--verbose", action="store_true", help="details and tracebacks")
    parser.add_argument("--version", action="version", version=f"attnrewrite {__version__}")
    return parser


def _add_recurrent_arguments(parser: argparse.ArgumentParser) -> None:
    """--recurrent and the flags that shape the recurrence it makes."""
    parser.add_argument(
        "--recurrent",
        action="store_true",
        help="for a decoder exported with a KV cache: each cache becomes the fixed-size state of a recurrence "
        "(linear, hedgehog, favor, with or without a window), inputs past_key_values.{i}.<part>, "
        "outputs present.{i}.<part>",
    )
    parser.add_argument(
        "--standard-ops",
        action="store_true",
        help="with --recurrent: standard ONNX operators only, for runtimes without onnxruntime's contrib "
        "operators (a decoding step otherwise updates the kernel state with com.microsoft.LinearAttention "
        "where the installed onnxruntime runs it, and a GroupQueryAttention's rotation stays "
        "com.microsoft.RotaryEmbedding)",
    )
    parser.add_argument(
        "--state-budget",
        metavar="SIZE",
        help="with --recurrent: size the method's state to fit SIZE per sequence, in bytes (16MB, 512kB, 1.5GiB) "
        "or as the KV cache of so many tokens (322tok): the widest window (linear, hedgehog, favor) or the "
        "most recent keys (streaming) that fit; says what it chose",
    )


def run_rewrite(argv: list[str], run) -> int:
    """The rewrite (or a listing); ``run``: the command line's (cli.py), its report filled in."""
    parser = build_parser()
    args = parser.parse_args(argv)
    report = run.report
    run.report_to(args.report, keep=[args.model, args.output])
    report.method = args.to
    if args.list or args.list_options:
        report.command = "list"
    if args.list_options:
        _refuse_unused_arguments(parser, args, "--list-options prints a method's options", _LIST_OPTIONS_READS)
        return print_options(args, report)
    if args.model is None:
        parser.error("the following arguments are required: model")
    if args.list:
        # --to METHOD --recurrent: and what the method's state would cost
        reads = _LIST_READS | (_LIST_STATE_READS if args.to and args.recurrent else set())
        _refuse_unused_arguments(parser, args, "--list only reports the sites", reads)
    check_fidelity_arguments(args)
    args.model, source = genai_folder.input_model(args.model)
    genai_output = None
    if args.output:
        args.output, genai_output = genai_folder.output_model(args.output, args.model)
    report.input = args.model
    with stage("load"):
        model = onnx_io.load_model(args.model)
    run.keep += onnx_io.files_read_by(model)
    _check_report_argument(args, model)
    if args.list:
        return list_sites(model, args, report)
    _check_rewrite_arguments(args, model)
    _check_calibration_arguments(args, genai_output is not None)
    settings = _settings(args)
    if settings.compares:
        check_length_fits(model.graph, args, from_empty_cache=settings.recurrent)
    result = pipeline.rewrite(pipeline.Source(args.model, loaded=model), settings, report)
    if not run.writes:
        return 0
    if args.layers != "auto":
        check_layers_exist(args.layers, result.record)
    if result.record.outcomes:
        print(result.record.table())
    if result.selection is not None:
        print(result.selection.table())
    if not result.record.rewritten:
        raise pipeline.refusal(result)
    with stage("write"):
        beside = source or Path(args.model).parent
        folder = genai_folder.folder_files(result.model, beside, args.tokenizer) if genai_output else None
        _write_proved(result, args.output)
        written = folder.write(genai_output) if folder else None
    record = result.record
    print(
        f"wrote {args.output}: {len(record.rewritten)} of {len(record.outcomes)} attention sites replaced by {args.to}"
        + (f", adding {format_bytes(record.bytes_added)} of constants" if record.bytes_added else "")
    )
    if record.state_memory is not None:
        print(state_memory_line(record.state_memory))
    if written:
        print(f"wrote {', '.join(written)} beside it: {genai_output} is a folder onnxruntime-genai opens")
    report.end(WRITTEN, 0, output=args.output)
    return 0


def _settings(args) -> pipeline.Settings:
    """The pipeline's settings, one per flag (a declared setting not given: its default)."""
    return pipeline.Settings(
        method=args.to,
        options=parse_options(args.option),
        layers=args.layers,
        heads=merged_heads(args.heads),
        include_single_query=args.include_single_query,
        recurrent=args.recurrent,
        standard_ops=args.standard_ops,
        state_budget=args.state_budget,
        check=args.check,
        **given_settings(args, run_settings.GROUPS),
    )


# What the two listings read; any other argument given with them would be ignored.
_LIST_READS = {"model", "list", "seq", "inputs", "report", "verbose"}
_LIST_STATE_READS = {"to", "option", "recurrent", "state_budget"}
_LIST_OPTIONS_READS = {"to", "list_options", "report", "verbose"}


def check_fidelity_arguments(args) -> None:
    """Before any work, in the flags' words (the rewrite's Settings checks the same again)."""
    flags = {field.name: field.metadata["flag"].name for field in dataclasses.fields(GateSettings)}
    pipeline.refuse_comparison_settings_that_do_nothing(args, spell=flags.get)


def _refuse_unused_arguments(parser: CommandParser, args, what: str, reads: set[str]) -> None:
    unused = [flag for dest, flag in parser.given(args).items() if dest not in reads]
    if unused:
        raise AttnRewriteError(f"{what}: {unused[0]} would do nothing there")


def _check_calibration_arguments(args, genai_output: bool) -> None:
    """Calibration's own flags mean nothing without --calibrate, fine-tuning's without
    --finetune: refused, not ignored (but --tokenizer, whose files a genai folder gets)."""
    given = _stage_settings_given(args)
    tuning = [flag.name for flag in given if flag.needs == "fine-tuning"]
    if tuning and not args.finetune:
        raise AttnRewriteError(f"{tuning[0]} is a setting of fine-tuning; give --finetune too")
    if args.calibrate:
        return
    if args.tokenizer and not genai_output:
        raise AttnRewriteError("--tokenizer is for a text --calibrate file; give --calibrate too")
    if args.calibrate_pack:
        raise AttnRewriteError("--calibrate-pack is for a text --calibrate file; give --calibrate too")
    if args.calibrate_end_to_end:
        raise AttnRewriteError("--calibrate-end-to-end is a stage of calibration; give --calibrate too")
    if args.finetune:
        raise AttnRewriteError("--finetune trains on the calibration data; give --calibrate DATA too")
    if given:
        raise AttnRewriteError(f"{given[0].name} is a setting of {given[0].needs}; give --calibrate too")


def _stage_settings_given(args) -> list[Flag]:
    """The flags given of the fitting settings that mean nothing without their stage
    (Flag.needs): given, each needs it (_check_calibration_arguments)."""
    flags = [
        (field.name, field.metadata["flag"]) for group in run_settings.FITTING for field in dataclasses.fields(group)
    ]
    return [flag for name, flag in flags if flag.needs and getattr(args, name) is not None]


def _write_proved(result: pipeline.Result, output: str) -> None:
    """The gates run on the staged file itself, renamed into place only when all pass."""
    with onnx_io.staged_save(result.model, output) as staged:
        pipeline.validate(result, staged)
        if result.note:
            print(f"note: {result.note}")
        report = pipeline.compare(result, staged)  # the very file to be renamed into place
        if report is None:
            return
        print(report.table())
        try:
            pipeline.gate(result)
        except AttnRewriteError as error:  # a gate failed (exit 1) or cannot apply (exit 2)
            raise type(error)(f"{error}; nothing written") from None


def _check_rewrite_arguments(args, model) -> None:
    if not args.to:
        raise AttnRewriteError("choose a method with --to (or --list to only report)")
    if not args.output:
        raise AttnRewriteError("give the output path with -o")
    _check_heads_arguments(args)
    if args.standard_ops and not args.recurrent:
        raise AttnRewriteError("--standard-ops is for --recurrent's decoding steps; give --recurrent too")
    if args.state_budget is not None and not args.recurrent:
        raise AttnRewriteError("--state-budget sizes a recurrent state; give --recurrent too")
    if args.layers == "auto" and args.min_cosine is None and args.heads != ["auto"]:
        raise AttnRewriteError("--layers auto needs --min-cosine X: the cosine the rewritten model must keep")
    onnx_io.check_output_path(args.output, args.model, reads=onnx_io.files_read_by(model))


def _check_heads_arguments(args) -> None:
    if args.heads == ["auto"] and args.min_cosine is None and args.min_agreement is None:
        raise AttnRewriteError(
            "--heads auto needs --min-cosine X and/or --min-agreement Y: the fidelity the rewritten model must keep"
        )
    if args.heads and args.heads != ["auto"] and args.layers == "auto":
        raise AttnRewriteError("--layers auto chooses whole sites: give --heads auto to choose heads with it")


def _check_report_argument(args, model) -> None:
    """Before any work: a report path that cannot be written, or would replace an input or
    the output, fails the run as bad input."""
    if not args.report:
        return
    onnx_io.check_output_path(args.report, args.model, reads=onnx_io.files_read_by(model), what="report")
    if args.output and os.path.realpath(args.report) == os.path.realpath(args.output):
        raise AttnRewriteError(f"{args.report}: the report and the output are the same file")


def check_layers_exist(requested: list[int] | None, record: RewriteRecord) -> None:
    """Every requested layer index must be one of the model's sites: a typo would otherwise
    rewrite less than asked, or nothing, without saying so."""
    present = sorted({o.site.layer for o in record.outcomes if o.site.layer is not None})
    missing = [layer for layer in requested or () if layer not in present]
    if missing and record.outcomes:
        raise AttnRewriteError(
            f"--layers: no attention site in layer{'s' if len(missing) > 1 else ''} {format_layers(missing)}; "
            f"this model's sites are in layers {format_layers(present) or '(none with an index)'}"
        )


def format_layers(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
