"""How a pass declares its options: a dataclass field that also says what it means.

``--list-options`` and the documentation read the help, choices and valid range from the
fields' metadata, so the Options class is the one place a setting is described.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

UNUSED_SEED = "unused: the method draws nothing at random; accepted for a uniform interface"


def option(default: Any, help: str, *, choices: tuple | None = None, valid: str | None = None) -> Any:
    """A field of a pass's Options. ``choices``: the accepted values (the class's own check
    enforces them); ``valid``: the accepted range in words, e.g. ">= 1"."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "valid": valid})


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    name: str
    type: str
    default: Any
    valid: str  # choices or range; "" when any value of the type is accepted
    help: str


def describe_options(options_class: type) -> list[OptionInfo]:
    hints = typing.get_type_hints(options_class)
    return [
        OptionInfo(
            field.name,
            _type_name(hints[field.name]),
            field.default,
            _valid(field.metadata, hints[field.name]),
            field.metadata.get("help", ""),
        )
        for field in dataclasses.fields(options_class)
    ]


def _type_name(hint) -> str:
    args = typing.get_args(hint)
    if not args:
        return hint.__name__
    names = [t.__name__ for t in args if t is not type(None)]
    return " | ".join(names) + (" | None" if type(None) in args else "")


def _valid(metadata, hint) -> str:
    if hint is bool:
        return "true | false"
    if metadata.get("choices"):
        return " | ".join(str(c) for c in metadata["choices"])
    return metadata.get("valid") or ""
