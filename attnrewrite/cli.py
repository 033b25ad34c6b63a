"""Command line: ``attnrewrite model.onnx --to hydra -o out.onnx`` and ``attnrewrite model.onnx --list``,
plus the subcommands ``attnrewrite check ORIGINAL REWRITTEN``, ``attnrewrite bench MODEL --to M`` and
``attnrewrite generate MODEL [REWRITTEN] --tokenizer T --prompt TEXT`` (attnrewrite.generate_cli)
(chosen by the first argument; a model file literally named ``check`` or ``bench`` is ``./check``).
The rewrite runs attnrewrite.pipeline, the stages the Python API runs too: this module reads the
arguments, prints what the stages found and moves the output into place once its gates passed.

Every failure is one line on stderr and a non-zero exit (2: bad input or usage; 1: nothing
could be rewritten or the output failed a validation gate); the output file is written only
after the gates pass, so a failed run leaves whatever was there untouched. ``-v`` adds the
traceback for bug reports. When the reader of stdout goes away (``attnrewrite M --list | head -1``)
the run stops quietly with 141, the status of a tool killed by SIGPIPE, as coreutils report it.
``--report FILE`` is written at the end of every run, failed or not, with how it ended
(record.Report, docs/report.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import sys
import traceback
import warnings
from pathlib import Path

from attnrewrite import __version__, calibration, genai_folder, passes, pipeline
from attnrewrite import check as check_mod
from attnrewrite.cli_parsing import CommandParser, UsageError, number_parser, parse_positive, parse_positive_number
from attnrewrite.data import load_inputs
from attnrewrite.distributed import process_group
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.limits import position_limit
from attnrewrite.onnx.masks import probe_note
from attnrewrite.onnx.rewrite import analyze
from attnrewrite.passes import fit
from attnrewrite.pipeline import EXIT_BAD_INPUT
from attnrewrite.record import (
    CHECKED,
    ERROR,
    LISTED,
    WRITTEN,
    Report,
    RewriteRecord,
    SiteOutcome,
    format_bytes,
    format_table,
    stage,
)

EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE: what a shell reports for a tool SIGPIPE killed


def method_name(text: str) -> str:
    """--to is case-insensitive: Hydra, HYDRA and hydra are one method."""
    return text.lower()


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
        "where the installed onnxruntime runs it)",
    )
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
    _add_calibration_arguments(parser)
    parser.add_argument(
        "--check", action="store_true", help="compare the rewritten outputs with the original's before writing"
    )
    _add_fidelity_arguments(parser, gate="with --check: write nothing and fail")
    parser.add_argument("-v", "--verbose", action="store_true", help="details and tracebacks")
    parser.add_argument("--version", action="version", version=f"attnrewrite {__version__}")
    return parser


def _add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """--calibrate and the settings of the fit it runs (attnrewrite.calibration)."""
    parser.add_argument(
        "--calibrate",
        metavar="DATA",
        help="fit each replacement to the attention it replaces on DATA: an .npz of model inputs by name "
        "(batch axis stacked) or a text file, one text per line (with --tokenizer)",
    )
    parser.add_argument(
        "--calibrate-steps",
        type=parse_positive,
        metavar="N",
        help=f"optimizer steps per site (default: {calibration.DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--calibrate-lr",
        type=parse_positive_number,
        metavar="LR",
        help=f"Adam learning rate of calibration (default: the method's, {fit.DEFAULT_LR:g}; "
        f"linformer {passes.linformer.LinformerAttention.CALIBRATION_LR:g})",
    )
    parser.add_argument(
        "--calibrate-ce",
        type=parse_nonnegative,
        metavar="W",
        help="add W times Hedgehog's cross-entropy between the softmax weights and the replacement's "
        "(linear, favor without a window, hedgehog; default: 0, output error only)",
    )
    parser.add_argument(
        "--calibrate-seed",
        type=int,
        metavar="N",
        help="seed of the minibatches calibration draws (default: 0)",
    )
    parser.add_argument(
        "--calibrate-end-to-end",
        type=parse_positive,
        default=0,
        metavar="N",
        help="after fitting site by site, fit all sites together on the model's outputs for N steps "
        "(one batch each; default: off)",
    )
    parser.add_argument(
        "--finetune",
        type=parse_positive,
        nargs="?",
        const=calibration.FINETUNE_STEPS,
        default=0,
        metavar="STEPS",
        help="after calibrating, fine-tune: low-rank adapters on the replaced sites' query, key, value and output "
        "projections, trained with the replacements on the calibration data against the original model "
        "(a decoder's next-token distribution), then merged into the weights (kept beside quantized ones) "
        "(default steps: %(const)s)",
    )
    parser.add_argument(
        "--finetune-rank",
        type=parse_positive,
        metavar="R",
        help=f"with --finetune: the adapters' rank (default: {calibration.DEFAULT_RANK})",
    )
    parser.add_argument(
        "--finetune-lr",
        type=parse_positive_number,
        metavar="LR",
        help=f"with --finetune: Adam's learning rate (default: {calibration.FINETUNE_LR})",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="tokenizer.json",
        help="with a text --calibrate file: the tokenizer that makes the model's inputs",
    )
    parser.add_argument(
        "--max-length",
        type=parse_positive,
        metavar="N",
        help="with --tokenizer: the length of a calibration example in tokens; a longer text is cut (and counted "
        f"in the record) (default: {calibration.DEFAULT_MAX_LENGTH})",
    )
    parser.add_argument(
        "--calibrate-pack",
        choices=("on", "off"),
        help="with --tokenizer: join consecutive texts into passages of --max-length tokens, framed as the "
        "tokenizer frames a pair ([CLS] a [SEP] b [SEP]); off: one text per example (default: on)",
    )


def _add_fidelity_arguments(parser: argparse.ArgumentParser, gate: str) -> None:
    parser.add_argument(
        "--min-cosine",
        type=parse_cosine,
        metavar="X",
        help=f"{gate} if an output's cosine similarity is below X for any example (batch row): "
        "the gate uses the per-example minimum",
    )
    parser.add_argument(
        "--min-agreement",
        type=parse_fraction,
        metavar="X",
        help=f"{gate} if the fraction of rows whose argmax agrees is below X for a logits-like output "
        "(logits, log-probabilities, probabilities)",
    )
    parser.add_argument(
        "--allow-exact",
        action="store_true",
        help="let the gates pass although some replaced sites are exact at the length compared (a window, "
        "linformer's k, one lsh chunk), which the comparison then does not measure",
    )
    parser.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="inputs to compare on, by input name (default: generated from the signature)",
    )
    parser.add_argument(
        "--seq",
        type=parse_positive,
        default=None,
        help=f"sequence length of generated inputs (default for the comparison: {check_mod.PAST_REACH} times the "
        f"longest reach of a replaced site's exact part, else {check_mod.DEFAULT_SEQ}, at most the model's positions; "
        "the rewrite's mask probe and run gate start short and double it until the model runs)",
    )


def build_check_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="attnrewrite check",
        description="Run two models on the same inputs and report, per output, how far the second is from the first.",
    )
    parser.add_argument("original", help="the reference model")
    parser.add_argument("rewritten", help="the model to compare with it")
    _add_fidelity_arguments(parser, gate="fail (exit 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    parser.add_argument(
        "--report",
        metavar="FILE.json",
        help="write the run's report as JSON, failed or not: how it ended and the comparison (docs/report.md)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks")
    return parser


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


parse_nonnegative = number_parser(lambda x: 0 <= x < math.inf, "expected a number >= 0")
parse_cosine = number_parser(lambda x: -1 <= x <= 1, "a cosine similarity is between -1 and 1")
parse_fraction = number_parser(lambda x: 0 <= x <= 1, "an agreement is a fraction between 0 and 1")


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"invalid length list {text!r} (expected e.g. 128,256,512)")
    return lengths


def parse_layers(text: str) -> list[int] | str:
    """0,2,5-7 -> [0, 2, 5, 6, 7]; "auto" is layer selection (attnrewrite.layer_selection). Whether the
    model has those layers is checked against its sites (check_layers_exist)."""
    if text == "auto":
        return text
    layers: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start = int(first)
            end = int(last) if dash else start
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid layer list {text!r} (expected e.g. 0,2,5-7)") from None
        if end < start:
            raise argparse.ArgumentTypeError(f"reversed range {part.strip()!r} (write {end}-{start})")
        layers.update(range(start, end + 1))
    return sorted(layers)


def parse_heads(text: str) -> dict[int, list[int]] | str:
    """3:0,7 -> {3: [0, 7]}; "auto" is head selection (attnrewrite.head_selection)."""
    if text == "auto":
        return text
    layer, colon, heads = text.partition(":")
    try:
        chosen = sorted({int(h) for h in heads.split(",")}) if colon else None
        return {int(layer): chosen} if chosen and min(chosen) >= 0 else _bad_heads(text)
    except ValueError:
        return _bad_heads(text)


def _bad_heads(text: str):
    raise argparse.ArgumentTypeError(f"invalid heads {text!r} (expected auto, or LAYER:HEAD,HEAD such as 3:0,7)")


def merged_heads(given: list | None) -> dict[int, list[int]] | str | None:
    """The --heads flags as one setting: "auto" alone, or every LAYER:H,H together."""
    if not given:
        return None
    if "auto" in given:
        if len(given) > 1:
            raise AttnRewriteError("--heads auto chooses every site's heads: give it alone")
        return "auto"
    merged: dict[int, list[int]] = {}
    for entry in given:
        for layer, heads in entry.items():
            merged[layer] = sorted({*merged.get(layer, []), *heads})
    return merged


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


def parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AttnRewriteError(f"option {pair!r} is not KEY=VALUE")
        options[key.strip()] = value.strip()
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv or "--verbose" in argv
    run = _Run(argv)
    try:
        with process_group() as rank, _quiet_libraries(verbose), run.report.times.measuring():
            if rank:  # under torchrun the first process speaks and writes: the others fine-tune with it
                run.writes = False
                return _silently(_dispatch, argv, run)
            code = _dispatch(argv, run)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            run.save_report()
        return code
    except BrokenPipeError:
        code = _reader_went_away()
        run.fail(pipeline.Ending(ERROR, code, "the reader of stdout went away"))
        return code
    except (Exception, KeyboardInterrupt) as error:
        ending = pipeline.ending(error, run.report.times.stage_of(error))
        run.fail(ending, error)
        return _fail(ending.reason, ending.exit_code, verbose)


@dataclasses.dataclass
class _Run:
    """One command line: the report its stages fill in, and where ``--report`` writes it (None:
    not asked for, or not known yet) but never over a file it must keep: the model, its external
    data, the output (a failed run leaves them as they were)."""

    argv: list[str]
    report: Report = dataclasses.field(init=False)
    report_path: str | None = None
    keep: list[str] = dataclasses.field(default_factory=list)
    writes: bool = True  # False: a torchrun process other than the first, which stops after the rewrite

    def __post_init__(self):
        self.report = Report("check" if self.argv[:1] == ["check"] else "rewrite")

    @property
    def takes_report(self) -> bool:
        """Whether the command has --report: the rewrite (and --list) and check do."""
        return self.argv[:1] not in (["bench"], ["generate"])

    def report_to(self, path: str | None, keep) -> None:
        self.report_path, self.keep = path, [os.fspath(k) for k in keep if k]

    def save_report(self) -> None:
        if self.report_path is not None and not any(_same_file(self.report_path, k) for k in self.keep):
            with stage("write"):  # a report that cannot be written fails the run as the environment's fault
                onnx_io.write_text(self.report_path, self.report.to_json())

    def fail(self, ending: pipeline.Ending, error: BaseException | None = None) -> None:
        """End the report as ``ending`` says and write it if it can be: the run's own error line
        is the one thing said, whatever happens to the report."""
        if isinstance(error, UsageError) and self.report_path is None and self.takes_report:
            self.report_to(*_report_asked_in(self.argv[1:] if self.report.command == "check" else self.argv))
        self.report.end(ending.outcome, ending.exit_code, ending.reason, failed_stage=ending.failed_stage)
        with contextlib.suppress(AttnRewriteError, OSError):
            self.save_report()


def _report_asked_in(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--report``'s file in a command line argparse refused, and every other argument in each
    spelling argparse reads (``-oFILE``, ``--output=FILE``): which one is the model or the
    output is not known, so the report may replace none of them."""
    path, others = None, []
    tokens = iter(argv)
    for token in tokens:
        name, equals, value = token.partition("=")
        if len(name) > 2 and "--report".startswith(name):  # argparse takes unambiguous prefixes
            path = value if equals else next(tokens, None)
            continue
        others += [token, value, token[2:] if token[:1] == "-" and token[1:2] != "-" else ""]
    return path, others


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def _quiet_libraries(verbose: bool):
    """The libraries' warnings and log lines (onnx_ir, onnxruntime, numpy) are detail: without
    -v a failure is exactly one line on stderr, and a success prints only our own output."""
    if verbose:
        yield
        return
    import onnxruntime

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    onnxruntime.set_default_logger_severity(4)  # its errors come back as exceptions too
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _silently(function, *args) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return function(*args)


def _reader_went_away() -> int:
    """stdout's reader closed it (``| head -1``): nothing more to say to anyone. stdout now
    points at /dev/null so the interpreter's own final flush does not complain either."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def _fail(message: str, code: int, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    print(f"attnrewrite: error: {message}", file=sys.stderr)
    return code


def _dispatch(argv: list[str], run: _Run) -> int:
    if argv and argv[0] == "check":
        return _check_command(build_check_parser().parse_args(argv[1:]), run)
    if argv and argv[0] == "bench":
        return _bench_command(build_bench_parser().parse_args(argv[1:]))
    if argv and argv[0] == "generate":
        from attnrewrite.generate_cli import build_generate_parser, generate_command

        return generate_command(build_generate_parser().parse_args(argv[1:]))
    return _run(argv, run)


def _run(argv: list[str], run: _Run) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    report = run.report
    run.report_to(args.report, keep=[args.model, args.output])
    report.method = args.to
    if args.list or args.list_options:
        report.command = "list"
    if args.list_options:
        _refuse_unused_arguments(parser, args, "--list-options prints a method's options", _LIST_OPTIONS_READS)
        return _print_options(args, report)
    if args.model is None:
        parser.error("the following arguments are required: model")
    if args.list:
        _refuse_unused_arguments(parser, args, "--list only reports the sites", _LIST_READS)
    _check_fidelity_arguments(args)
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
        return _list_sites(model, args, report)
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
    if written:
        print(f"wrote {', '.join(written)} beside it: {genai_output} is a folder onnxruntime-genai opens")
    report.end(WRITTEN, 0, output=args.output)
    return 0


def _settings(args) -> pipeline.Settings:
    """The pipeline's settings, one per flag."""
    return pipeline.Settings(
        method=args.to,
        options=parse_options(args.option),
        layers=args.layers,
        heads=merged_heads(args.heads),
        include_single_query=args.include_single_query,
        recurrent=args.recurrent,
        standard_ops=args.standard_ops,
        seq=args.seq,
        check=args.check,
        min_cosine=args.min_cosine,
        min_agreement=args.min_agreement,
        allow_exact=args.allow_exact,
        inputs=args.inputs,
        calibrate=args.calibrate or None,
        calibrate_end_to_end=args.calibrate_end_to_end,
        finetune=args.finetune,
        tokenizer=args.tokenizer,
        calibrate_pack=args.calibrate_pack != "off",
        **{name: value for name, (_, value) in _fitting_settings(args).items() if value is not None},
    )


def _fitting_settings(args) -> dict[str, tuple[str, object]]:
    """Calibration's and fine-tuning's own settings, by Settings' name: (flag, value), None where
    not given (Settings' default then): given, each needs its stage (_check_calibration_arguments)."""
    return {
        "calibrate_steps": ("--calibrate-steps", args.calibrate_steps),
        "calibrate_lr": ("--calibrate-lr", args.calibrate_lr),
        "calibrate_ce_weight": ("--calibrate-ce", args.calibrate_ce),
        "calibrate_seed": ("--calibrate-seed", args.calibrate_seed),
        "max_length": ("--max-length", args.max_length),
        "finetune_rank": ("--finetune-rank", args.finetune_rank),
        "finetune_lr": ("--finetune-lr", args.finetune_lr),
    }


# What the two listings read; any other argument given with them would be ignored.
_LIST_READS = {"model", "list", "seq", "inputs", "report", "verbose"}
_LIST_OPTIONS_READS = {"to", "list_options", "report", "verbose"}


def _refuse_unused_arguments(parser: CommandParser, args, what: str, reads: set[str]) -> None:
    unused = [flag for dest, flag in parser.given(args).items() if dest not in reads]
    if unused:
        raise AttnRewriteError(f"{what}: {unused[0]} would do nothing there")


def _check_fidelity_arguments(args) -> None:
    """Before any work, in the flags' words (the rewrite's Settings checks the same again)."""
    pipeline.refuse_comparison_settings_that_do_nothing(args, spell=lambda name: "--" + name.replace("_", "-"))


def _check_calibration_arguments(args, genai_output: bool) -> None:
    """Calibration's own flags mean nothing without --calibrate, fine-tuning's without
    --finetune: refused, not ignored (but --tokenizer, whose files a genai folder gets)."""
    given = {name: flag for name, (flag, value) in _fitting_settings(args).items() if value is not None}
    tuning = [flag for name, flag in given.items() if name.startswith("finetune_")]
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
        raise AttnRewriteError(f"{next(iter(given.values()))} is a setting of calibration; give --calibrate too")


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


def _check_command(args, run: _Run) -> int:
    report = run.report
    report.input, report.compared = args.original, args.rewritten
    report.thresholds = {
        "min_cosine": args.min_cosine,
        "min_agreement": args.min_agreement,
        "allow_exact": args.allow_exact,
    }
    run.report_to(args.report, keep=[args.original, args.rewritten])
    _check_fidelity_arguments(args)
    if args.json:
        onnx_io.check_output_path(args.json, args.original, what="report")
    if args.report:
        for model in (args.original, args.rewritten):
            onnx_io.check_output_path(args.report, model, what="report")
    with stage("load"):
        original = onnx_io.load_model(args.original)
    check_length_fits(original.graph, args, from_empty_cache=check_mod.is_recurrent(args.rewritten))
    fidelity = report.fidelity = check_mod.check(args.original, args.rewritten, args.inputs, seq=args.seq)
    print(fidelity.table())
    if args.json:
        Path(args.json).write_text(json.dumps(fidelity.as_dict(**report.thresholds), indent=2) + "\n")
    with stage("check"):
        fidelity.gate(args.min_cosine, args.min_agreement, args.allow_exact)
    report.end(CHECKED, 0)
    return 0


def _bench_command(args) -> int:
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
        return _fail(f"--lengths {lengths} not run: sweep {result.limit}", EXIT_BAD_INPUT, verbose=False)
    return 0


def _bench_heads(given: list | None) -> dict:
    """The rewrite's exact heads (rewrite_model's ``exact_heads``), where --heads gives some."""
    heads = merged_heads(given)
    if heads == "auto":
        raise AttnRewriteError("bench --heads takes LAYER:H,H: 'auto' measures fidelity, not speed")
    return {"exact_heads": heads} if heads else {}


def check_length_fits(graph, args, from_empty_cache: bool = False) -> None:
    """Generated inputs of --seq tokens must fit the model's positions: said here in one line,
    instead of onnxruntime's message from deep inside the embeddings (the default length is
    capped there: check.default_length). A decoder checked against its recurrent rewrite starts
    ``from_empty_cache`` (check.prepare_decoder_inputs)."""
    if args.inputs is not None or args.seq is None:
        return  # the user's own arrays: their length is theirs
    limit = position_limit(graph, from_empty_cache)
    if limit is not None and args.seq > limit.positions:
        raise AttnRewriteError(f"--seq {args.seq} is too long: {limit.describe()}; use --seq {limit.positions} or less")


def _check_rewrite_arguments(args, model) -> None:
    if not args.to:
        raise AttnRewriteError("choose a method with --to (or --list to only report)")
    if not args.output:
        raise AttnRewriteError("give the output path with -o")
    _check_heads_arguments(args)
    if args.standard_ops and not args.recurrent:
        raise AttnRewriteError("--standard-ops is for --recurrent's decoding steps; give --recurrent too")
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


def _list_sites(model, args, report: Report) -> int:
    given = load_inputs(args.inputs, model.graph) if args.inputs else None
    with stage("detect"):
        sites = analyze(onnx_io.infer_shapes(model), seq=pipeline.probe_seq(args.seq, model.graph, given))
    record = RewriteRecord("none", {}, [SiteOutcome(s.site, rewritten=False, reason=s.site.skip_reason) for s in sites])
    report.record = record
    header = ("site", "layer", "heads", "head_dim", "mask", "scale", "status")
    rows = [
        (
            s.site.name,
            str(s.site.layer),
            "-" if s.site.num_heads is None else str(s.site.num_heads),
            "-" if s.site.head_dim is None else str(s.site.head_dim),
            s.site.mask_label,
            f"{s.site.scale:.4g}",
            "rewritable" if s.site.skip_reason is None else f"unsupported: {s.site.skip_reason}",
        )
        for s in sites
    ]
    print(format_table(header, rows))
    print(f"{len(sites)} attention sites, {sum(s.site.skip_reason is None for s in sites)} rewritable")
    note = probe_note([s.site for s in sites])
    if note:
        print(f"note: {note}")
    report.end(LISTED, 0)
    return 0


def _print_options(args, report: Report) -> int:
    from attnrewrite.passes.options import describe_options

    if not args.to:
        raise AttnRewriteError(f"--list-options needs --to METHOD (one of: {', '.join(passes.PASSES)})")
    method = passes.get_pass(args.to)
    rows = [(o.name, o.type, str(o.default), o.valid or "-", o.help) for o in describe_options(method.Options)]
    print(f"options of {method.NAME} (set with -O NAME=VALUE):")
    print(format_table(("name", "type", "default", "valid", "meaning"), rows))
    report.end(LISTED, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
