"""How a pass declares its options: a dataclass field that also says what it accepts.

``--list-options`` and the documentation read the help, choices and range from the fields'
metadata, and ``MethodOptions`` enforces the same declarations when an Options is built, so the
Options class is the one place a setting is described and checked.

A run's own settings (calibration's, fine-tuning's, the fidelity gates': attnrewrite.settings)
are declared the same way, on ``RunSettings``, each field with its command-line ``flag``: the
CLI generates its arguments from them and the API checks its keywords against them.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from typing import Any

from attnrewrite.errors import AttnRewriteError

UNUSED_SEED = "unused: the method draws nothing at random; accepted for a uniform interface"


class OptionError(ValueError):
    """A method option that does not exist or that its declaration refuses: a usage error."""


class Range(abc.ABC):
    """The values a numeric option accepts. ``str()`` is the wording ``--list-options`` prints;
    ``requirement`` the wording an error gives, with any other option's value filled in."""

    @abc.abstractmethod
    def __str__(self) -> str: ...

    @abc.abstractmethod
    def admits(self, value, options) -> bool:
        """Whether ``value`` is in the range; ``options``: the Options it is a field of."""

    def requirement(self, options) -> str:
        return str(self)

    def of_type(self, noun: str) -> str:
        """The range said of a type, for a value that is not even of it: "an int >= 1"."""
        return f"{_article(noun)} {noun} {self}"


@dataclasses.dataclass(frozen=True)
class AtLeast(Range):
    """value >= bound. ``bound``: a number, or the name of an option declared earlier.
    ``when``: the name of a boolean attribute of the options; the range holds only where it is
    true (a length that bounds a stored matrix, say, is unused where nothing is stored)."""

    bound: int | float | str
    when: str | None = None

    def __str__(self) -> str:
        return f">= {self.bound}"

    def admits(self, value, options) -> bool:
        if self.when is not None and not getattr(options, self.when):
            return True
        return value >= self._bound(options)

    def requirement(self, options) -> str:
        return f">= {self.bound} ({self._bound(options)})" if isinstance(self.bound, str) else str(self)

    def _bound(self, options):
        return getattr(options, self.bound) if isinstance(self.bound, str) else self.bound


@dataclasses.dataclass(frozen=True)
class Above(Range):
    """value > bound (a float that divides or normalises, say)."""

    bound: int | float

    def __str__(self) -> str:
        return f"> {self.bound:g}"

    def admits(self, value, options) -> bool:
        return value > self.bound


class _OneOrEven(Range):
    def __str__(self) -> str:
        return "1 or even"

    def admits(self, value, options) -> bool:
        return value == 1 or (value >= 2 and value % 2 == 0)

    def of_type(self, noun: str) -> str:
        return f"1 or an even {noun}"


ONE_OR_EVEN = _OneOrEven()  # LSH buckets: a hash is the argmax over [xR, -xR], so 2 per rotation


class _Positive(Range):
    def __str__(self) -> str:
        return "> 0, finite"

    def admits(self, value, options) -> bool:
        return 0 < value < math.inf

    def of_type(self, noun: str) -> str:
        return f"a positive {noun}"


POSITIVE = _Positive()  # a rate: NaN and infinity are no rate either


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a run setting is spelled on the command line: the flag, argparse's other keywords
    (type, metavar, nargs, const, default, choices, action), ``read``: what turns the parsed
    value into the setting's (``None``, not given, stays unset), and ``needs``: the stage the
    setting means nothing without ("calibration"), which the CLI then asks for."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    read: Callable[[Any], Any] | None = None
    needs: str | None = None


def flag(name: str, *, read: Callable | None = None, needs: str | None = None, **arguments) -> Flag:
    return Flag(name, arguments, read, needs)


def option(
    default: Any, help: str, *, choices: tuple | None = None, valid: Range | None = None, flag: Flag | None = None
) -> Any:
    """A field of a pass's Options, or of a group of run settings (``RunSettings``, with its
    ``flag``). ``choices``: the accepted values; ``valid``: the accepted range of a number. Both
    are enforced by ``MethodOptions`` and printed by --list-options."""
    metadata = {"help": help, "choices": choices, "valid": valid, "flag": flag}
    return dataclasses.field(default=default, metadata=metadata)


class MethodOptions:
    """The base of every method's Options dataclass: ``class Options(MethodOptions, method=NAME)``.
    Building one checks every field against its type hint, choices and range, so an unacceptable
    value is one OptionError naming the method, the option and what it accepts, whichever way it
    came in (the CLI's -O, the API's keywords, Options(...) itself)."""

    method_name: typing.ClassVar[str]

    def __init_subclass__(cls, *, method: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.method_name = method

    def __post_init__(self):
        for field, hint in _declared_fields(type(self)):
            value = getattr(self, field.name)
            requirement = _broken_requirement(value, field.metadata, hint, self)
            if requirement:
                raise OptionError(f"{self.method_name} option {field.name} must be {requirement}, got {value!r}")


class RunSettings:
    """The base of a group of a run's settings (a dataclass of ``option`` fields, each with its
    ``flag``). Building one refuses a value outside a field's declared range, in the API's
    words ("finetune_rank must be an integer >= 1, got 0"); fields without a range are the
    stages' to check."""

    def __post_init__(self):
        for field, hint in _declared_fields(type(self)):
            valid, value = field.metadata.get("valid"), getattr(self, field.name)
            target, optional = _target_type(hint)
            if valid is None or (value is None and optional):
                continue
            if not (_is_a(value, target) and valid.admits(value, self)):
                noun = _SETTING_NOUNS.get(target, target.__name__)
                raise AttnRewriteError(f"{field.name} must be {valid.of_type(noun)}, got {value!r}")


_SETTING_NOUNS = {int: "integer", float: "number"}


def _broken_requirement(value, metadata, hint, options) -> str | None:
    """What a field requires, in words, where ``value`` breaks it; None where it does not."""
    target, optional = _target_type(hint)
    choices, valid = metadata.get("choices"), metadata.get("valid")
    if value is None and optional:
        return None
    if not _is_a(value, target):
        return _type_words(target, choices, valid) + (" or None" if optional else "")
    if choices and value not in choices:
        return f"one of {' | '.join(map(str, choices))}"
    if valid and not valid.admits(value, options):
        return valid.requirement(options)
    return None


@functools.cache
def _declared_fields(options_class: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(options_class)
    return tuple((field, hints[field.name]) for field in dataclasses.fields(options_class))


def _target_type(hint) -> tuple[type, bool]:
    """(the type a value must have, whether None is accepted too) for ``T`` or ``T | None``."""
    args = typing.get_args(hint)
    if not args:
        return hint, False
    return next(t for t in args if t is not type(None)), type(None) in args


def _is_a(value, target: type) -> bool:
    if target is bool or isinstance(value, bool):  # a bool is an int to Python, not to an option
        return target is bool and isinstance(value, bool)
    if target is int:
        return isinstance(value, numbers.Integral)
    if target is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, target)


def _type_words(target: type, choices: tuple | None, valid: Range | None) -> str:
    if target is bool:
        return "true | false"
    if choices:
        return f"one of {' | '.join(map(str, choices))}"
    if valid:
        return valid.of_type(target.__name__)
    return f"{_article(target.__name__)} {target.__name__}"


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    name: str
    type: str
    default: Any
    valid: str  # choices or range; "" when any value of the type is accepted
    help: str


def describe_options(options_class: type) -> list[OptionInfo]:
    return [
        OptionInfo(
            field.name,
            _type_name(hint),
            field.default,
            _valid(field.metadata, hint),
            field.metadata.get("help", ""),
        )
        for field, hint in _declared_fields(options_class)
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
    return str(metadata.get("valid") or "")
