"""Command line: ``attnrewrite model.onnx --to hydra -o out.onnx`` and ``attnrewrite model.onnx --list``,
plus the subcommands ``attnrewrite check ORIGINAL REWRITTEN``, ``attnrewrite bench MODEL --to M`` and
``attnrewrite generate MODEL [REWRITTEN] --tokenizer T --prompt TEXT`` (attnrewrite.generate_cli)
(chosen by the first argument; a model file literally named ``check`` or ``bench`` is ``./check``).
The rewrite runs attnrewrite.pipeline, the stages the Python API runs too. This module is the
entry: it chooses the command, one module each (cli_rewrite.py the rewrite, cli_list.py its
listings, cli_check.py, cli_bench.py and generate_cli.py the subcommands; cli_parsing.py what they
share), and ends every run the same way.

Every failure is one line on stderr and a non-zero exit (2: bad input or usage; 1: nothing
could be rewritten or the output failed a validation gate); the output file is written only
after the gates pass, so a failed run leaves whatever was there untouched. ``-v`` adds the
traceback for bug reports. When the reader of stdout goes away (``attnrewrite M --list | head -1``)
the run stops quietly with 141, the status of a tool killed by SIGPIPE, as coreutils report it.
``--report FILE`` is written at the end of every run, failed or not, with how it ended
(record.Report, docs/report.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import traceback
import warnings

from attnrewrite import pipeline
from attnrewrite.cli_bench import LengthsNotRun, bench_command, build_bench_parser
from attnrewrite.cli_check import build_check_parser, check_command
from attnrewrite.cli_parsing import UsageError, parse_layers
from attnrewrite.cli_rewrite import build_parser, format_layers, run_rewrite
from attnrewrite.distributed import process_group
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.pipeline import EXIT_BAD_INPUT
from attnrewrite.record import ERROR, Report, stage

# the names callers of the command line take from here (tests, scripts)
__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "build_parser", "format_layers", "main", "parse_layers"]

EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE: what a shell reports for a tool SIGPIPE killed


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
        return check_command(build_check_parser().parse_args(argv[1:]), run)
    if argv and argv[0] == "bench":
        return _bench(build_bench_parser().parse_args(argv[1:]))
    if argv and argv[0] == "generate":
        from attnrewrite.generate_cli import build_generate_parser, generate_command

        return generate_command(build_generate_parser().parse_args(argv[1:]))
    return run_rewrite(argv, run)


def _bench(args) -> int:
    try:
        return bench_command(args)
    except LengthsNotRun as error:  # the sweep is printed and saved: only its line here, with exit 2
        return _fail(str(error), EXIT_BAD_INPUT, verbose=False)


if __name__ == "__main__":
    sys.exit(main())
