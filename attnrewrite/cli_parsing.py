"""The argument parsing every command line shares (attnrewrite.cli and its subcommands, such as
attnrewrite.generate_cli): a parser whose refusals are one line, the argument types they have
in common, the arguments of declared run settings (attnrewrite.settings: add_settings,
given_settings) and the check of --seq against the model the rewrite and check both make."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.limits import position_limit


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
parse_nonnegative = number_parser(lambda x: 0 <= x < math.inf, "expected a number >= 0")
parse_cosine = number_parser(lambda x: -1 <= x <= 1, "a cosine similarity is between -1 and 1")
parse_fraction = number_parser(lambda x: 0 <= x <= 1, "an agreement is a fraction between 0 and 1")


def method_name(text: str) -> str:
    """--to is case-insensitive: Hydra, HYDRA and hydra are one method."""
    return text.lower()


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


def parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AttnRewriteError(f"option {pair!r} is not KEY=VALUE")
        options[key.strip()] = value.strip()
    return options


def add_settings(parser: argparse.ArgumentParser, *groups: type, **words: str) -> None:
    """One argument per setting of ``groups`` (attnrewrite.settings), as its declaration says:
    its flag and argparse keywords, its help with ``words`` filled in (the gate's, say); the
    value lands under the setting's name."""
    for field in (field for group in groups for field in dataclasses.fields(group)):
        flag = field.metadata["flag"]
        parser.add_argument(flag.name, dest=field.name, help=field.metadata["help"].format(**words), **flag.arguments)


def given_settings(args: argparse.Namespace, groups) -> dict[str, Any]:
    """The settings of ``groups`` the command line gives, as the settings take them (each
    flag's ``read``); one not given is left out, to its default."""
    values = {}
    for group in groups:
        for field in dataclasses.fields(group):
            given, read = getattr(args, field.name), field.metadata["flag"].read
            if given is not None:
                values[field.name] = read(given) if read else given
    return values


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
