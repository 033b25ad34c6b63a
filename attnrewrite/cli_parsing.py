"""The argument parsing every command line shares (attnrewrite.cli and its subcommands, such as
attnrewrite.generate_cli): a parser whose refusals are one line, and the argument types they
have in common."""

from __future__ import annotations

import argparse
import math

from attnrewrite.errors import AttnRewriteError


class UsageError(AttnRewriteError):
    """A command line argparse refused: one line, exit 2, like every other bad input."""


class CommandParser(argparse.ArgumentParser):
    """argparse whose refusals are one UsageError line (exit 2), for every subcommand."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} -h')")


def parse_positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_positive_number(text: str) -> float:
    """A rate or a temperature: finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
