"""The argument parsing every command line shares (attnrewrite.cli and its subcommands, such as
attnrewrite.generate_cli): a parser whose refusals are one line, and the argument types they
have in common."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from attnrewrite.errors import AttnRewriteError


class UsageError(AttnRewriteError):
    """A command line argparse refused: one line, exit 2, like every other bad input."""


class CommandParser(argparse.ArgumentParser):
    """argparse whose refusals are one UsageError line (exit 2), for every subcommand."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} -h')")

    def given(self, args: argparse.Namespace) -> dict[str, str]:
        """The arguments ``args`` sets to other than their defaults, by destination: their long
        flag, or a positional's name as the usage line writes it."""
        return {
            action.dest: action.option_strings[-1] if action.option_strings else action.dest.upper()
            for action in self._actions
            if action.default is not argparse.SUPPRESS and getattr(args, action.dest) != action.default
        }


def parse_positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def number_parser(within: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: the number ``text`` says, where ``within`` holds for it (never for
    text that is not a number: NaN), else refused as "``expected``, got 'text'"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not within(value):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    return parse


parse_positive_number = number_parser(lambda x: 0 < x < math.inf, "expected a positive number")  # rates, temperature
