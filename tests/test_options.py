"""Method options: every numeric option declares the range it accepts, and every way in refuses
what the declaration does not accept with one line naming the method, the option and the range.

The out-of-range values are derived from the declarations (``option(valid=...)``), so an option
added later is walked too: through ``make_options`` for every value, and through the command
line (exit 2, exactly one line on stderr, nothing on stdout, no output file) on a model the
method would otherwise rewrite: a causal one, and for linformer (which refuses causal sites) a
bidirectional one; the shipped two-layer BERT (key padding) for the first value of each option.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import onnx
import pytest
from attention_graphs import AttentionSpec, build_attention_model

from attnrewrite import passes
from attnrewrite.cli import main
from attnrewrite.passes import OptionError, make_options
from attnrewrite.passes.options import ONE_OR_EVEN, Above, AtLeast, describe_options
from attnrewrite.passes.window.settings import SparseCacheSize

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"

# What --list-options says each numeric option accepts: the declarations, written out.
RANGES = {
    ("linear", "chunk"): ">= 1",
    ("linear", "seed"): ">= 0",
    ("linear", "window"): ">= 0",
    ("linear", "sinks"): ">= 0",
    ("linear", "sparse"): ">= 0, and 0 without window",
    ("hydra", "eps"): "> 0",
    ("hydra", "seed"): ">= 0",
    ("favor", "features"): ">= 1",
    ("favor", "seed"): ">= 0",
    ("favor", "chunk"): ">= 1",
    ("favor", "window"): ">= 0",
    ("favor", "sinks"): ">= 0",
    ("favor", "sparse"): ">= 0, and 0 without window",
    ("linformer", "proj_dim"): ">= 1",
    ("linformer", "max_len"): ">= proj_dim",
    ("linformer", "seed"): ">= 0",
    ("lsh", "n_buckets"): "1 or even",
    ("lsh", "n_hashes"): ">= 1",
    ("lsh", "chunk"): ">= 1",
    ("lsh", "seed"): ">= 0",
    ("hedgehog", "chunk"): ">= 1",
    ("hedgehog", "window"): ">= 0",
    ("hedgehog", "sinks"): ">= 0",
    ("hedgehog", "sparse"): ">= 0, and 0 without window",
    ("hedgehog", "seed"): ">= 0",
    ("nystrom", "landmarks"): ">= 1",
    ("nystrom", "pinv_iterations"): ">= 1",
    ("nystrom", "seed"): ">= 0",
    ("aft", "span"): ">= 1",
    ("aft", "chunk"): ">= 1",
    ("aft", "seed"): ">= 0",
    ("efficient", "chunk"): ">= 1",
    ("efficient", "seed"): ">= 0",
    ("streaming", "recent"): ">= 1",
    ("streaming", "sinks"): ">= 0",
    ("streaming", "seed"): ">= 0",
}


@dataclasses.dataclass(frozen=True)
class Bad:
    """One refused setting: the -O values (the option last) and what the error says after
    "<method> option <name> must be "."""

    settings: tuple[str, ...]
    says: str


def numeric_options():
    """(method, field, the type a value must have, whether None is accepted) for every int or
    float option of every method."""
    for method in passes.PASSES.values():
        hints = typing.get_type_hints(method.Options)
        for field in dataclasses.fields(method.Options):
            args = typing.get_args(hints[field.name]) or (hints[field.name],)
            target = next(t for t in args if t is not type(None))
            if target in (int, float):
                yield method, field, target, type(None) in args


def bad_values(field: dataclasses.Field, target: type, optional: bool) -> list[Bad]:
    """Values below the range, and text that is not a number of the option's type."""
    valid = field.metadata["valid"]
    name = field.name
    if valid is None:
        return []  # test_every_numeric_option_declares_its_range says so
    if isinstance(valid, AtLeast) and isinstance(valid.bound, str):  # the bound is another option
        below = [Bad((f"{valid.bound}=8", f"{name}=7"), f"{valid} (8), got 7")]
    elif isinstance(valid, AtLeast):
        below = [Bad((f"{name}={n}",), f"{valid}, got {n}") for n in (valid.bound - 1, valid.bound - 3)]
    elif isinstance(valid, Above):
        texts = (str(valid.bound), str(valid.bound - 1), "nan")
        below = [Bad((f"{name}={text}",), f"{valid}, got {float(text)!r}") for text in texts]
    elif valid is ONE_OR_EVEN:
        below = [Bad((f"{name}={n}",), f"1 or even, got {n}") for n in (3, 0, -2)]
    elif isinstance(valid, SparseCacheSize):  # the window's cache: none without a window
        below = [
            Bad((f"{name}=2",), "0 without window (window=0), got 2"),
            Bad(("window=4", f"{name}=-1"), ">= 0, got -1"),
        ]
    else:
        raise AssertionError(f"no out-of-range values known for {field.name}'s range {valid!r}: add them here")
    of_type = "1 or an even int" if valid is ONE_OR_EVEN else f"{'an int' if target is int else 'a float'} {valid}"
    none = " or None" if optional else ""
    not_numbers = ["1.5", "ten"] if target is int else ["ten"]
    return below + [Bad((f"{name}={text}",), f"{of_type}{none}, got {text!r}") for text in not_numbers]


CASES = [
    pytest.param(method, bad, id=f"{method.NAME}-{'-'.join(bad.settings)}")
    for method, field, target, optional in numeric_options()
    for bad in bad_values(field, target, optional)
]
FIRST_CASE_PER_OPTION = [
    pytest.param(method, bad, id=f"{method.NAME}-{field.name}")
    for method, field, target, optional in numeric_options()
    for bad in bad_values(field, target, optional)[:1]
]


def as_keywords(settings: tuple[str, ...]) -> dict[str, str]:
    return dict(setting.split("=", 1) for setting in settings)


def test_every_numeric_option_declares_its_range():
    """As --list-options prints it ("" where none is declared)."""
    printed = {(m.NAME, info.name): info.valid for m in passes.PASSES.values() for info in describe_options(m.Options)}
    numeric = [(method.NAME, field.name) for method, field, *_ in numeric_options()]
    assert {key: printed[key] for key in numeric} == RANGES


@pytest.mark.parametrize("method,bad", CASES)
def test_make_options_refuses_an_out_of_range_value_in_one_line(method, bad):
    with pytest.raises(OptionError) as error:
        make_options(method, **as_keywords(bad.settings))
    name = bad.settings[-1].split("=")[0]
    assert str(error.value) == f"{method.NAME} option {name} must be {bad.says}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A causal model for the methods that take causal sites, a bidirectional one for linformer."""
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for kind, mask in (("causal", "causal+key_padding"), ("bidirectional", "key_padding")):
        paths[kind] = folder / f"{kind}.onnx"
        onnx.save(build_attention_model(AttentionSpec(mask=mask)), paths[kind])
    return paths


def model_for(method, models) -> Path:
    return models["bidirectional" if method.NAME == "linformer" else "causal"]


def run_refused(capsys, tmp_path, model: Path, method, bad: Bad) -> None:
    output = tmp_path / "out.onnx"
    options = [arg for setting in bad.settings for arg in ("-O", setting)]
    code = main([str(model), "--to", method.NAME, *options, "-o", str(output)])
    out, err = capsys.readouterr()
    name = bad.settings[-1].split("=")[0]
    assert (code, out) == (2, "")
    assert err == f"attnrewrite: error: {method.NAME} option {name} must be {bad.says}\n"
    assert list(tmp_path.iterdir()) == []  # no output, no staged file


@pytest.mark.parametrize("method,bad", CASES)
def test_the_cli_refuses_an_out_of_range_value_with_exit_2_and_writes_nothing(method, bad, models, tmp_path, capsys):
    run_refused(capsys, tmp_path, model_for(method, models), method, bad)


@pytest.mark.parametrize("method,bad", FIRST_CASE_PER_OPTION)
def test_the_cli_refuses_it_on_the_shipped_bert_too(method, bad, tmp_path, capsys):
    run_refused(capsys, tmp_path, SAMPLE, method, bad)


@pytest.mark.parametrize(
    "method,values",
    [
        ("linear", {"chunk": 1, "seed": 0, "window": 0, "sinks": 0}),
        ("hydra", {"eps": 1e-30, "seed": 0}),
        ("favor", {"features": 1, "chunk": 1, "window": 0, "sinks": 0, "seed": 0}),
        ("favor", {"features": None}),
        ("linformer", {"proj_dim": 1, "max_len": 1, "seed": 0}),
        ("linformer", {"proj_dim": 8, "max_len": 7, "projection": "pool"}),  # nothing stored: unbounded
        ("lsh", {"n_buckets": 1, "n_hashes": 1, "chunk": 1, "seed": 0}),
        ("lsh", {"n_buckets": 2}),
        ("hedgehog", {"chunk": 1, "window": 0, "sinks": 0, "seed": 0}),
    ],
)
def test_make_options_accepts_the_boundary(method, values):
    options = make_options(passes.get_pass(method), **{name: str(value) for name, value in values.items()})
    assert {name: getattr(options, name) for name in values} == values


@pytest.mark.parametrize(
    "method,values,message",
    [
        ("linear", {"chunk": 2.0}, "linear option chunk must be an int >= 1, got 2.0"),
        ("linear", {"chunk": True}, "linear option chunk must be an int >= 1, got True"),
        ("lsh", {"n_hashes": "2"}, "lsh option n_hashes must be an int >= 1, got '2'"),
        ("favor", {"orthogonal": "yes"}, "favor option orthogonal must be true | false, got 'yes'"),
        ("favor", {"variant": "trig"}, "favor option variant must be one of positive | hyperbolic, got 'trig'"),
        (
            "linformer",
            {"projection": "random"},
            "linformer option projection must be one of gaussian | learned | pool | identity, got 'random'",
        ),
    ],
)
def test_options_built_directly_are_checked_as_strictly(method, values, message):
    """Values that are not strings are not converted (the API's keywords, Options(...) itself):
    the same declarations refuse them."""
    with pytest.raises(OptionError) as error:
        passes.get_pass(method).Options(**values)
    assert str(error.value) == message


def test_choices_from_the_cli_are_one_line_too(models, tmp_path, capsys):
    output = tmp_path / "out.onnx"
    code = main([str(models["causal"]), "--to", "favor", "-O", "norms=unit", "-o", str(output)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == "attnrewrite: error: favor option norms must be one of chi | fixed, got 'unit'\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["linear", "favor", "hedgehog", "lsh"])
def test_the_smallest_chunk_rewrites_a_causal_model(method, models, tmp_path, capsys):
    """chunk=0 once reached the lowering (linear: an integer division by zero when the rewritten
    model loaded); its boundary, 1, runs through every gate."""
    output = tmp_path / "out.onnx"
    code = main([str(models["causal"]), "--to", method, "-O", "chunk=1", "-o", str(output)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    assert f"wrote {output}: 1 of 1 attention sites replaced by {method}" in out
    assert output.exists()
