"""The command line on the shipped sample: what it prints, writes and refuses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import attnrewrite
from attnrewrite import passes
from attnrewrite.cli import EXIT_BROKEN_PIPE, format_layers, main, parse_layers
from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes.options import describe_options

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_reports_both_layers(capsys):
    code, out, _ = run(capsys, SAMPLE, "--list")
    assert code == 0
    assert "2 attention sites, 2 rewritable" in out
    assert out.count("key_padding") == 2


@pytest.mark.parametrize("method,op_type", [("hydra", "Hydra"), ("linear", "LinearAttention")])
def test_rewrite_writes_a_model_that_runs(tmp_path, capsys, method, op_type):
    output = tmp_path / "out.onnx"
    report = tmp_path / "report.json"
    code, out, _ = run(capsys, SAMPLE, "--to", method, "-o", output, "--report", report)
    assert code == 0, out
    assert f"2 of 2 attention sites replaced by {method}" in out
    model = onnx.load(output)
    assert [n.op_type for n in model.graph.node].count(op_type) == 2
    assert "Softmax" not in {n.op_type for n in model.graph.node}
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnrewrite"])
    assert record["method"] == method and record["sites_rewritten"] == 2
    assert json.loads(report.read_text())["sites_found"] == 2
    session = ort.InferenceSession(str(output))
    feeds = {"input_ids": np.arange(20).reshape(2, 10), "attention_mask": np.ones((2, 10), np.int64)}
    assert np.isfinite(session.run(None, feeds)[0]).all()


def test_layers_selects_sites(tmp_path, capsys):
    report = tmp_path / "report.json"
    code, out, _ = run(capsys, SAMPLE, "--to", "hydra", "-o", tmp_path / "o.onnx", "--layers", "1", "--report", report)
    assert code == 0
    assert "skipped: layer 0 is not among the selected layers" in out
    assert "1 of 2 attention sites" in out
    # one answer to "why not" per site, no second field that could disagree with it
    sites = json.loads(report.read_text())["sites"]
    assert [(s["status"], s["reason"]) for s in sites] == [
        ("skipped", "layer 0 is not among the selected layers"),
        ("rewritten", None),
    ]
    assert not any("skip_reason" in s for s in sites)


@pytest.mark.parametrize(
    "layers,message",
    [
        ("0,6-7", "--layers: no attention site in layers 6-7; this model's sites are in layers 0-1"),
        ("99", "--layers: no attention site in layer 99; this model's sites are in layers 0-1"),
        ("5-2", "argument --layers: reversed range '5-2' (write 2-5) (see 'attnrewrite -h')"),
        ("1,x", "argument --layers: invalid layer list '1,x' (expected e.g. 0,2,5-7) (see 'attnrewrite -h')"),
    ],
)
def test_layers_that_do_not_exist_are_refused(tmp_path, capsys, layers, message):
    output = tmp_path / "o.onnx"
    code, out, err = run(capsys, SAMPLE, "--to", "hydra", "-o", output, "--layers", layers)
    assert (code, out, err) == (2, "", f"attnrewrite: error: {message}\n")
    assert not output.exists()


def test_parse_layers_merges_and_sorts():
    assert parse_layers("5-7,0, 6,2") == [0, 2, 5, 6, 7]
    assert format_layers([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_list_options_needs_no_model_and_says_what_each_option_means(capsys):
    code, out, err = run(capsys, "--to", "Hydra", "--list-options")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "options of hydra (set with -O NAME=VALUE):",
        "name  type   default  valid  meaning",
        "eps   float  1e-06    > 0    added to the L2 norms so that an all-zero vector normalizes to zero",
        "seed  int    0        >= 0   unused: the method draws nothing at random; accepted for a uniform interface",
    ]


def test_list_options_needs_a_method(capsys):
    code, out, err = run(capsys, "--list-options")
    assert (code, out) == (2, "")
    assert (
        err
        == "attnrewrite: error: --list-options needs --to METHOD (one of: linear, hydra, favor, linformer, lsh, hedgehog, nystrom, aft, efficient, streaming)\n"
    )


def test_every_option_of_every_method_is_described():
    for method in passes.PASSES.values():
        for option in describe_options(method.Options):
            assert option.help, f"{method.NAME}.{option.name} has no help"
    favor_variant = next(o for o in describe_options(passes.favor.Options) if o.name == "variant")
    assert (favor_variant.type, favor_variant.default, favor_variant.valid) == (
        "str",
        "positive",
        "positive | hyperbolic",
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--to", "foo", "m.onnx"],
            "argument --to: invalid choice: 'foo' (choose from 'linear', 'hydra', 'favor', 'linformer', 'lsh', 'hedgehog', 'nystrom', 'aft', 'efficient', 'streaming')",
        ),
        (["--to", "hydra"], "the following arguments are required: model"),
        (["bench", "m.onnx"], "the following arguments are required: --to"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    prog = "attnrewrite bench" if argv[0] == "bench" else "attnrewrite"
    assert (code, out, err) == (2, "", f"attnrewrite: error: {message} (see '{prog} -h')\n")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"attnrewrite {attnrewrite.__version__}\n"


def test_closed_stdout_stops_quietly_with_the_sigpipe_status():
    """`attnrewrite M --list | head -1`: the reader is gone before the output is written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "attnrewrite", str(SAMPLE), "--list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parents[1],
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert (process.wait(timeout=60), stderr) == (EXIT_BROKEN_PIPE, "")


@pytest.mark.parametrize("command", ["rewrite", "check"])
def test_check_longer_than_the_models_positions_is_one_clear_line(tmp_path, capsys, command):
    output = tmp_path / "o.onnx"
    argv = [SAMPLE, "--to", "hydra", "-o", output, "--check"] if command == "rewrite" else ["check", SAMPLE, SAMPLE]
    code, out, err = run(capsys, *argv, "--seq", "1024")
    assert (code, out) == (2, "")
    assert err == (
        "attnrewrite: error: --seq 1024 is too long: the model has 512 positions "
        "('/model/embeddings/Slice' cuts a 512-long constant to the sequence); use --seq 512 or less\n"
    )
    assert not output.exists()


def test_already_rewritten_model_is_refused_and_nothing_written(tmp_path, capsys):
    first = tmp_path / "first.onnx"
    assert run(capsys, SAMPLE, "--to", "hydra", "-o", first)[0] == 0
    second = tmp_path / "second.onnx"
    code, _, err = run(capsys, first, "--to", "hydra", "-o", second)
    assert code == 1
    assert err.strip() == (
        "attnrewrite: error: no softmax attention left: 2 sites were already rewritten; nothing written"
    )
    assert not second.exists()


@pytest.mark.parametrize(
    "make_input,message",
    [
        (lambda d: d / "missing.onnx", "{p}: no such file"),
        (
            lambda d: d,
            "{p}: is a directory, not an ONNX file (nor a model folder: no genai_config.json, no model.onnx)",
        ),
        (lambda d: _write(d / "empty.onnx", b""), "{p}: is empty"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, make_input, message):
    path = make_input(tmp_path)
    code, out, err = run(capsys, path, "--to", "hydra", "-o", tmp_path / "out.onnx")
    assert code == 2
    assert err.strip() == "attnrewrite: error: " + message.format(p=path)
    assert "Traceback" not in err + out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--calibrate", "{d}"], "{d}: is a directory, not calibration data (an .npz archive or a text file)"),
        (["--calibrate", "{d}/missing.txt"], "{d}/missing.txt: no such file"),
        (["--calibrate", "{d}/texts.txt", "--tokenizer", "{d}"], "{d}: is a directory, not a tokenizer.json"),
        (["--calibrate", "{d}/texts.txt", "--tokenizer", "{d}/tokenizer.json"], "{d}/tokenizer.json: no such file"),
        (["--inputs", "{d}", "--check"], "{d}: is a directory, not an .npz archive of inputs"),
    ],
)
def test_a_folder_or_a_missing_file_given_for_data_is_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "texts.txt").write_text("One line of text to calibrate on.\n")
    output = tmp_path / "out.onnx"
    code, out, err = run(capsys, SAMPLE, "--to", "hedgehog", *(f.format(d=tmp_path) for f in flags), "-o", output)
    assert (code, err.strip()) == (2, "attnrewrite: error: " + message.format(d=tmp_path))
    assert "Traceback" not in err + out
    assert not output.exists()


@pytest.mark.parametrize(
    "make_model,message",
    [
        (lambda d: d, "{p}: is a directory, not an ONNX file"),
        (lambda d: _write(d / "empty.onnx", b""), "{p}: is empty"),
    ],
)
def test_check_of_a_folder_or_an_empty_file_is_one_line(tmp_path, capsys, make_model, message):
    path = make_model(tmp_path)
    code, _, err = run(capsys, "check", SAMPLE, path)
    assert (code, err.strip()) == (2, "attnrewrite: error: " + message.format(p=path))


def test_random_bytes_are_not_a_model(tmp_path, capsys):
    path = _write(tmp_path / "noise.onnx", np.random.default_rng(0).bytes(4096))
    code, _, err = run(capsys, path, "--list")
    assert code == 2
    assert err.startswith(f"attnrewrite: error: {path}: not an ONNX model")
    assert len(err.strip().splitlines()) == 1


def test_output_equal_to_input_is_refused(tmp_path, capsys):
    model = shutil.copy(SAMPLE, tmp_path / "m.onnx")
    before = Path(model).read_bytes()
    code, _, err = run(capsys, model, "--to", "hydra", "-o", model)
    assert code == 2
    assert "the output would overwrite the input model" in err
    assert Path(model).read_bytes() == before


def test_failed_run_leaves_existing_output_untouched(tmp_path, capsys):
    output = _write(tmp_path / "out.onnx", b"precious")
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "-o", output, "-O", "features=3")
    assert code == 2
    assert err.strip() == "attnrewrite: error: method 'hydra' has no option 'features' (options: eps, seed)"
    assert output.read_bytes() == b"precious"


def test_missing_output_folder(tmp_path, capsys):
    target = tmp_path / "nope" / "out.onnx"
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "-o", target)
    assert code == 2
    assert err.strip() == f"attnrewrite: error: {target}: folder {target.parent} does not exist"


def test_a_file_where_the_output_folder_should_be_is_refused(tmp_path, capsys):
    """-o DIR/ makes a missing folder, but never over a file (nor under one)."""
    output = _write(tmp_path / "out", b"precious")
    assert run(capsys, SAMPLE, "--to", "hydra", "-o", f"{output}/") == (
        2,
        "",
        f"attnrewrite: error: {output}/: is a file, not a folder\n",
    )
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "-o", f"{output}/genai/")
    assert (code, err) == (2, f"attnrewrite: error: {output}/genai/: cannot make the folder (Not a directory)\n")
    assert output.read_bytes() == b"precious"


def test_standard_ops_without_recurrent_is_refused(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "--standard-ops", "-o", out)
    assert (code, err) == (
        2,
        "attnrewrite: error: --standard-ops is for --recurrent's decoding steps; give --recurrent too\n",
    )
    assert not out.exists()
    with pytest.raises(
        AttnRewriteError, match=r"^standard_ops is for recurrent=True's decoding steps; give recurrent=True too$"
    ):
        attnrewrite.rewrite(str(SAMPLE), to="hydra", standard_ops=True)


@pytest.mark.parametrize(
    "stage,message",
    [
        ({"finetune": 2}, "finetune trains on the calibration data: give calibrate too"),
        ({"calibrate_end_to_end": 2}, "calibrate_end_to_end is a stage of calibration: give calibrate too"),
    ],
)
def test_calibrations_later_stages_need_its_data_in_either_frontend(stage, message):
    import torch

    encoder = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)
    for model, capture in ((str(SAMPLE), {}), (encoder, {"example_inputs": (torch.randn(1, 8, 16),)})):
        with pytest.raises(AttnRewriteError) as refused:
            attnrewrite.rewrite(model, to="hedgehog", **stage, **capture)
        assert str(refused.value) == message


def _calibration_data(folder: Path) -> Path:
    """The sample's inputs for calibration: 4 rows of 8 token ids."""
    ids = np.random.default_rng(0).integers(0, 50, (4, 8))
    np.savez(folder / "data.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    return folder / "data.npz"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--calibrate-steps", "5"], "--calibrate-steps is a setting of calibration; give --calibrate too"),
        (["--calibrate-lr", "0.01"], "--calibrate-lr is a setting of calibration; give --calibrate too"),
        (["--calibrate-seed", "1"], "--calibrate-seed is a setting of calibration; give --calibrate too"),
        (["--max-length", "64"], "--max-length is a setting of calibration; give --calibrate too"),
        (
            ["--calibrate", "DATA", "--finetune-rank", "4"],
            "--finetune-rank is a setting of fine-tuning; give --finetune too",
        ),
        (
            ["--calibrate", "DATA", "--finetune-lr", "1e-3"],
            "--finetune-lr is a setting of fine-tuning; give --finetune too",
        ),
        (
            ["--calibrate", "DATA", "--calibrate-lr", "-1"],
            "argument --calibrate-lr: expected a positive number, got '-1' (see 'attnrewrite -h')",
        ),
        (
            ["--calibrate", "DATA", "--finetune", "2", "--finetune-lr", "inf"],
            "argument --finetune-lr: expected a positive number, got 'inf' (see 'attnrewrite -h')",
        ),
        (
            ["--calibrate", "DATA", "--calibrate-ce", "inf"],
            "argument --calibrate-ce: expected a number >= 0, got 'inf' (see 'attnrewrite -h')",
        ),
    ],
)
def test_fitting_flags_without_their_stage_or_out_of_range_are_refused(tmp_path, capsys, flags, message):
    """Refused before any work, not ignored: a bad rate once failed only after calibrating."""
    data = _calibration_data(tmp_path)
    out = tmp_path / "out.onnx"
    code, _, err = run(capsys, SAMPLE, "--to", "hedgehog", *[data if f == "DATA" else f for f in flags], "-o", out)
    assert (code, err) == (2, f"attnrewrite: error: {message}\n")
    assert not out.exists()


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"finetune": 2, "finetune_lr": -1.0}, "finetune_lr must be a positive number, got -1.0"),
        ({"calibrate_lr": float("nan")}, "calibrate_lr must be a positive number, got nan"),
        ({"finetune": 2, "finetune_rank": 0}, "finetune_rank must be an integer >= 1, got 0"),
        ({"finetune": -1}, "finetune must be an integer >= 0, got -1"),
        ({"max_length": 2.5}, "max_length must be an integer >= 1, got 2.5"),
    ],
)
def test_the_apis_fitting_numbers_are_refused_before_calibrating(tmp_path, capsys, settings, message):
    data = _calibration_data(tmp_path)
    with pytest.raises(AttnRewriteError) as refused:
        attnrewrite.rewrite(str(SAMPLE), to="hedgehog", calibrate=str(data), **settings)
    assert str(refused.value) == message
    assert "calibrating" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        ([SAMPLE, "--list", "-o", "sites.txt"], "--list only reports the sites: --output would do nothing there"),
        ([SAMPLE, "--list", "--to", "hydra"], "--list only reports the sites: --to would do nothing there"),
        ([SAMPLE, "--list", "--check"], "--list only reports the sites: --check would do nothing there"),
        (
            [SAMPLE, "--to", "hydra", "--list-options"],
            "--list-options prints a method's options: MODEL would do nothing there",
        ),
        (
            ["--to", "hydra", "--list-options", "-O", "seed=1"],
            "--list-options prints a method's options: --option would do nothing there",
        ),
    ],
)
def test_listings_refuse_the_arguments_they_would_ignore(tmp_path, capsys, argv, message):
    """--list once took -o and wrote nothing, without a word; a listing reads only what it lists."""
    code, out, err = run(capsys, *argv, "--report", tmp_path / "r.json")
    assert (code, out, err) == (2, "", f"attnrewrite: error: {message}\n")


def test_list_takes_the_arguments_it_reads(tmp_path, capsys):
    code, out, _ = run(capsys, SAMPLE, "--list", "--seq", "16", "--report", tmp_path / "r.json", "-v")
    assert code == 0 and "2 attention sites, 2 rewritable" in out


ALLOW_EXACT_ALONE = "--allow-exact lets a gate pass: give --min-cosine or --min-agreement too"
SEQ_AND_INPUTS = "--seq is the length of generated inputs, and --inputs gives yours: give one of them"


@pytest.mark.parametrize("command", ["rewrite", "check"])
@pytest.mark.parametrize(
    "refused,accepted,message",
    [
        (["--allow-exact"], ["--allow-exact", "--min-cosine", "0.5"], ALLOW_EXACT_ALONE),
        (["--seq", "32", "--inputs", "IN"], ["--inputs", "IN"], SEQ_AND_INPUTS),
    ],
)
def test_comparison_flags_that_would_do_nothing_are_refused(tmp_path, capsys, command, refused, accepted, message):
    """`check --seq 32 --inputs F` compared on F's length and `--allow-exact` without a gate
    loosened nothing: both were silently ignored."""
    inputs = tmp_path / "in.npz"
    np.savez(inputs, input_ids=np.ones((1, 8), np.int64), attention_mask=np.ones((1, 8), np.int64))
    output = tmp_path / "o.onnx"
    argv = [SAMPLE, "--to", "hydra", "-o", output, "--check"] if command == "rewrite" else ["check", SAMPLE, SAMPLE]
    code, out, err = run(capsys, *argv, *[inputs if f == "IN" else f for f in refused])
    assert (code, out, err) == (2, "", f"attnrewrite: error: {message}\n")
    assert not output.exists()
    assert run(capsys, *argv, *[inputs if f == "IN" else f for f in accepted])[0] == 0


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"allow_exact": True}, "allow_exact lets a gate pass: give min_cosine or min_agreement too"),
        ({"seq": 32, "inputs": {}}, "seq is the length of generated inputs, and inputs gives yours: give one of them"),
    ],
)
def test_the_apis_comparison_settings_that_would_do_nothing_are_refused(settings, message):
    with pytest.raises(AttnRewriteError) as refused:
        attnrewrite.rewrite(str(SAMPLE), to="hydra", **settings)
    assert str(refused.value) == message


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
