"""Hardening (issue 7): every bad input is one clear line, a non-zero exit and no output; external
data is checked before it is read; big, fp16 and bf16 models; dynamic shapes; byte-identical
output for the same input, options and seed; the JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.inliner
import onnx.reference
import onnxruntime as ort
import pytest
import torch
from attention_graphs import AttentionSpec, build_attention_model, lowering_model, make_feeds, reference_qkv
from onnx import TensorProto, helper, numpy_helper

from attnrewrite import passes
from attnrewrite.cli import main
from attnrewrite.onnx import bfloat16
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.passes import hydra
from attnrewrite.record import METADATA_KEY
from attnrewrite.site import AttentionSite, MaskKind

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
PRECIOUS = b"precious: written by someone else"
METHODS = sorted(passes.PASSES)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnrewrite: error: "), err
    return lines[0][len("attnrewrite: error: ") :]


@pytest.fixture
def output(tmp_path) -> Path:
    """An existing output (and data file) that a failed run must leave byte for byte."""
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "out.onnx"
    path.write_bytes(PRECIOUS)
    (folder / "out.onnx.data").write_bytes(PRECIOUS)
    return path


def assert_untouched(output: Path) -> None:
    assert output.read_bytes() == PRECIOUS
    assert (output.parent / "out.onnx.data").read_bytes() == PRECIOUS
    assert sorted(p.name for p in output.parent.iterdir()) == ["out.onnx", "out.onnx.data"]  # no staging left


def refused(capsys, model, output, message: str, code: int = 2, *extra) -> None:
    """Both --list and a rewrite refuse `model` with exactly `message`; `output` is untouched."""
    for argv in ([model, "--list"], [model, "--to", "hydra", "-o", output, *extra]):
        got, out, err = run(capsys, *argv)
        assert (got, one_line(err)) == (code, message), argv
        assert "Traceback" not in out + err
    assert_untouched(output)


# --- not a model -----------------------------------------------------------------------------


def test_truncated_protobuf(tmp_path, capsys, output):
    data = SAMPLE.read_bytes()
    for keep in (len(data) // 2, len(data) - 5, 40):
        path = tmp_path / f"cut{keep}.onnx"
        path.write_bytes(data[:keep])
        refused(
            capsys,
            path,
            output,
            f"{path}: not an ONNX model (it does not parse as an ONNX protobuf: truncated or another format)",
        )


def test_other_onnx_messages_are_not_models(tmp_path, capsys, output):
    tensor = tmp_path / "tensor.onnx"
    tensor.write_bytes(numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w").SerializeToString())
    refused(
        capsys,
        tensor,
        output,
        f"{tensor}: not an ONNX model (it does not parse as an ONNX protobuf: truncated or another format)",
    )
    graph = tmp_path / "graph.onnx"
    graph.write_bytes(onnx.load(SAMPLE).graph.SerializeToString())
    refused(capsys, graph, output, f"{graph}: not an ONNX model (a protobuf message without an IR version and a graph)")


def test_fifo_is_not_a_regular_file(tmp_path, capsys, output):
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    refused(capsys, fifo, output, f"{fifo}: not a regular file")


def test_model_failing_the_checker(tmp_path, capsys, output):
    undefined = onnx.load(SAMPLE)
    undefined.graph.node[3].input[0] = "nowhere"
    path = tmp_path / "undefined.onnx"
    onnx.save(undefined, path)
    for argv in ([path, "--list"], [path, "--to", "linear", "-o", output]):
        code, _, err = run(capsys, *argv)
        assert code == 2
        assert one_line(err).startswith(f"{path}: fails the ONNX checker: ")
        assert "nowhere" in err
    # a type error only the full check (strict shape inference) sees
    mistyped = build_attention_model(AttentionSpec())
    mistyped.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64
    path = tmp_path / "mistyped.onnx"
    onnx.save(mistyped, path)
    code, _, err = run(capsys, path, "--list")
    assert code == 2 and one_line(err).startswith(f"{path}: fails the ONNX checker: ")
    assert_untouched(output)


def test_what_onnxruntime_runs_is_not_refused_by_the_checker_alone(tmp_path, capsys, output):
    """onnxruntime's SimplifiedLayerNormalization in the default domain (onnxruntime-genai's
    builder writes it) and a value_info declaring a constant's rank wrongly: the ONNX checker
    refuses both, onnxruntime runs them, and so the tool reads and rewrites the model."""
    model = build_attention_model(AttentionSpec())
    first = model.graph.input[0].name
    model.graph.initializer.append(numpy_helper.from_array(np.ones(AttentionSpec().head_dim, np.float32), "norm_w"))
    model.graph.node.insert(
        0, helper.make_node("SimplifiedLayerNormalization", [f"{first}_raw", "norm_w"], [first], axis=-1)
    )
    model.graph.input[0].name = f"{first}_raw"
    model.graph.node.insert(0, helper.make_node("Constant", [], ["unused_one"], value_ints=[1]))
    model.graph.value_info.append(helper.make_tensor_value_info("unused_one", TensorProto.INT64, []))
    path = tmp_path / "runtime_ops.onnx"
    onnx.save(model, path)
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(path), full_check=True)
    code, out, err = run(capsys, path, "--to", "linear", "-o", output)
    assert (code, err) == (0, "")
    assert "1 of 1 attention sites replaced by linear" in out
    ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])


def _attention_at(tmp_path, name: str, opset: int | None = None, ir_version: int | None = None) -> Path:
    model = build_attention_model(AttentionSpec(mask="key_padding"))
    if opset is not None:
        model.opset_import[0].version = opset
    if ir_version is not None:
        model.ir_version = ir_version
    path = tmp_path / name
    onnx.save(model, path)
    return path


def test_versions_it_cannot_handle(tmp_path, capsys, output):
    old = _attention_at(tmp_path, "old.onnx", opset=6)
    refused(capsys, old, output, f"{old}: opset 6 is too old to handle (need 7 or newer)")
    future = _attention_at(tmp_path, "future.onnx", opset=99)
    newest = onnx.defs.onnx_opset_version()
    refused(capsys, future, output, f"{future}: opset 99 is newer than onnx {onnx.__version__} knows ({newest})")
    ir99 = _attention_at(tmp_path, "ir99.onnx", ir_version=99)
    refused(
        capsys, ir99, output, f"{ir99}: IR version 99 is newer than onnx {onnx.__version__} knows ({onnx.IR_VERSION})"
    )


def test_ir_version_the_runtime_cannot_load(tmp_path, capsys, output):
    newest = _attention_at(tmp_path, "newest.onnx", ir_version=onnx.IR_VERSION)
    loadable = onnx_io._runtime_max_ir_version(onnx.IR_VERSION)
    if loadable is None:
        pytest.skip(f"onnxruntime {ort.__version__} loads IR version {onnx.IR_VERSION}")
    refused(
        capsys,
        newest,
        output,
        f"{newest}: IR version {onnx.IR_VERSION} is newer than onnxruntime {ort.__version__} can load ({loadable} at most)",
    )


def test_old_opset_with_attention_is_converted(tmp_path, capsys):
    """Opset 11 (Softmax over the last axis spelled explicitly) converts to 18 and rewrites."""
    model = build_attention_model(AttentionSpec(mask="key_padding", opset=11))
    path = tmp_path / "opset11.onnx"
    onnx.save(model, path)
    code, out, err = run(capsys, path, "--to", "linear", "-o", tmp_path / "out.onnx")
    assert code == 0, err
    assert {o.domain or "": o.version for o in onnx.load(tmp_path / "out.onnx").opset_import}[""] == 18


def test_opset_12_softmax_default_axis_is_not_the_key_axis(tmp_path, capsys):
    """Softmax without an axis means axis 1 before opset 13 (over heads, queries and keys of a
    [B, H, N, N] input, flattened): not attention, whatever the rest looks like."""
    model = build_attention_model(AttentionSpec(opset=12))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    del softmax.attribute[:]
    path = tmp_path / "opset12.onnx"
    onnx.save(model, path)
    code, out, _ = run(capsys, path, "--list")
    assert code == 0
    assert "unsupported: softmax over axis 1 of a rank-4 tensor, not the key axis (the last)" in out
    softmax.attribute.append(helper.make_attribute("axis", 3))  # spelled out: the last axis
    onnx.save(model, path)
    assert "1 attention sites, 1 rewritable" in run(capsys, path, "--list")[1]


def test_verbose_gives_the_traceback(tmp_path, capsys):
    path = tmp_path / "cut.onnx"
    path.write_bytes(SAMPLE.read_bytes()[:1000])
    code, _, err = run(capsys, path, "--list", "-v")
    assert code == 2
    assert "Traceback" in err and "DecodeError" in err  # the parser's own words, for bug reports
    assert err.strip().splitlines()[-1] == (
        f"attnrewrite: error: {path}: not an ONNX model (it does not parse as an ONNX protobuf: truncated or another format)"
    )


def test_foreign_attnrewrite_metadata_is_kept_not_parsed(tmp_path, capsys):
    model = onnx.load(SAMPLE)
    helper.set_model_props(model, {METADATA_KEY: "{written by another tool"})
    path = tmp_path / "meta.onnx"
    onnx.save(model, path)
    out = tmp_path / "out.onnx"
    code, _, err = run(capsys, path, "--to", "linear", "-o", out)
    assert code == 0, err
    record = json.loads({p.key: p.value for p in onnx.load(out).metadata_props}[METADATA_KEY])
    assert record["previous"] == "{written by another tool" and record["sites_rewritten"] == 2


# --- external data ---------------------------------------------------------------------------


def external_copy(folder: Path, name: str = "bert.onnx", data: str | None = None) -> tuple[Path, onnx.ModelProto]:
    """The sample with its weights in `<name>.data` (or `data`) beside it; returns the path
    and the proto without its data (external_data fields as written)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save_model(
        onnx.load(SAMPLE),
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data or f"{name}.data",
        size_threshold=1024,
    )
    return path, onnx.load(path, load_external_data=False)


def first_external(proto: onnx.ModelProto) -> onnx.TensorProto:
    return next(t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL)


def relocate(path: Path, proto: onnx.ModelProto, location: str) -> str:
    """Point the first external tensor at `location`; returns its name."""
    tensor = first_external(proto)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(proto, path)  # the proto only: its data stays where it is
    return tensor.name


def test_external_data_model_round_trip(tmp_path, capsys):
    path, _ = external_copy(tmp_path / "in")
    out = tmp_path / "o" / "bert.linear.onnx"
    out.parent.mkdir()
    code, _, err = run(capsys, path, "--to", "linear", "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in out.parent.iterdir()) == ["bert.linear.onnx", "bert.linear.onnx.data"]
    written = onnx.load(out, load_external_data=False)
    locations = {e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"bert.linear.onnx.data"}  # beside the output, not the input's file
    feeds = {"input_ids": np.arange(14).reshape(2, 7), "attention_mask": np.ones((2, 7), np.int64)}
    assert np.isfinite(ort.InferenceSession(str(out)).run(None, feeds)[0]).all()


def test_external_data_with_an_old_opset_keeps_its_folder(tmp_path, capsys):
    """The opset conversion re-creates the tensors; they must still read the input's data."""
    model = onnx.load(SAMPLE)
    model = onnx.version_converter.convert_version(model, 17)
    folder = tmp_path / "in"
    folder.mkdir()
    onnx.save_model(model, folder / "m17.onnx", save_as_external_data=True, location="m17.data", size_threshold=1024)
    code, _, err = run(capsys, folder / "m17.onnx", "--to", "hydra", "-o", tmp_path / "out.onnx")
    assert code == 0, err


@pytest.mark.parametrize("kind", ["parent", "absolute", "symlink", "symlinked_folder"])
def test_external_data_outside_the_folder_is_refused(tmp_path, capsys, output, kind):
    path, proto = external_copy(tmp_path / "model")
    outside = tmp_path / "secret"
    outside.mkdir()
    secret = outside / "weights.bin"
    shutil.copy(path.parent / "bert.onnx.data", secret)  # valid data: only the location is wrong
    if kind == "parent":
        location = "../secret/weights.bin"
        expected = "({loc}) is outside the model's folder"
    elif kind == "absolute":
        location = str(secret)
        expected = "is at an absolute path ({loc}); only files in the model's folder are read"
    elif kind == "symlink":
        location = "weights.bin"
        (path.parent / location).symlink_to(secret)
        expected = f"({{loc}}) is a link to {os.path.realpath(secret)}, outside the model's folder"
    else:
        (path.parent / "shared").symlink_to(outside, target_is_directory=True)
        location = "shared/weights.bin"
        expected = f"({{loc}}) is a link to {os.path.realpath(secret)}, outside the model's folder"
    name = relocate(path, proto, location)
    refused(capsys, path, output, f"{path}: external data of tensor {name!r} " + expected.format(loc=location))


def test_symlink_inside_the_folder_is_followed(tmp_path, capsys):
    path, proto = external_copy(tmp_path / "model")
    (path.parent / "blobs").mkdir()
    shutil.move(path.parent / "bert.onnx.data", path.parent / "blobs" / "real.data")
    (path.parent / "bert.onnx.data").symlink_to(path.parent / "blobs" / "real.data")
    code, out, err = run(capsys, path, "--list")
    assert code == 0, err
    assert "2 attention sites, 2 rewritable" in out


def test_missing_truncated_and_hard_linked_external_data(tmp_path, capsys, output):
    path, proto = external_copy(tmp_path / "model")
    data = path.parent / "bert.onnx.data"
    tensor = first_external(proto)
    what = f"{path}: external data of tensor {tensor.name!r}"

    link = tmp_path / "elsewhere.bin"
    os.link(data, link)  # the same file, reachable from outside the folder
    refused(
        capsys,
        path,
        output,
        f"{what}: bert.onnx.data has 2 hard links; refusing it, as a hard link can alias a file outside the model's folder",
    )
    link.unlink()

    size = data.stat().st_size
    with open(data, "r+b") as file:
        file.truncate(size // 2)
    short = next(
        t
        for t in proto.graph.initializer
        if t.data_location == TensorProto.EXTERNAL and _extent(t)[0] + _extent(t)[1] > size // 2
    )
    offset, length = _extent(short)
    refused(
        capsys,
        path,
        output,
        f"{path}: external data of tensor {short.name!r} lies past the end of bert.onnx.data "
        f"(bytes {offset}..{offset + length} of a {size // 2}-byte file)",
    )

    data.unlink()
    refused(capsys, path, output, f"{what}: file bert.onnx.data not found beside the model")


def _extent(tensor: onnx.TensorProto) -> tuple[int, int]:
    info = {e.key: e.value for e in tensor.external_data}
    return int(info.get("offset", 0)), int(info["length"])


def test_external_data_outside_is_refused_before_it_is_read(tmp_path):
    """The target outside is a FIFO: opening it for reading would block until the timeout.
    Run in a subprocess so a regression hangs that process, not the test session."""
    outside = tmp_path / "outside"
    outside.mkdir()
    fifo = outside / "fifo"
    os.mkfifo(fifo)
    models = []
    for i, location in enumerate(["../outside/fifo", str(fifo), "link"]):
        path, proto = external_copy(tmp_path / f"m{i}")
        if location == "link":
            (path.parent / "link").symlink_to(fifo)
        relocate(path, proto, location)
        models.append(str(path))
    script = textwrap.dedent(
        """
        import sys
        from attnrewrite.cli import main
        print([main([m, "--list"]) for m in sys.argv[1:]])
        """
    )
    result = subprocess.run([sys.executable, "-c", script, *models], capture_output=True, text=True, timeout=240)
    assert result.stdout.strip() == "[2, 2, 2]", result.stderr
    assert len(result.stderr.strip().splitlines()) == 3


# --- outputs that cannot be written or would destroy an input -------------------------------


def test_output_that_is_the_input_under_another_name(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    model = folder / "m.onnx"
    shutil.copy(SAMPLE, model)
    (tmp_path / "alias.onnx").symlink_to(model)
    os.link(model, tmp_path / "hard.onnx")
    before = model.read_bytes()
    spellings = [
        folder / "." / "m.onnx",
        folder / ".." / "m" / "m.onnx",
        tmp_path / "alias.onnx",
        tmp_path / "hard.onnx",
    ]
    for spelling in spellings:
        code, _, err = run(capsys, model, "--to", "hydra", "-o", spelling)
        assert (code, one_line(err)) == (2, f"{spelling}: the output would overwrite the input model")
    # and the other way round: the input given through the symlink
    code, _, err = run(capsys, tmp_path / "alias.onnx", "--to", "hydra", "-o", model)
    assert (code, one_line(err)) == (2, f"{model}: the output would overwrite the input model")
    assert model.read_bytes() == before


def test_output_that_would_replace_the_inputs_external_data(tmp_path, capsys):
    path, _ = external_copy(tmp_path / "model")
    data = path.parent / "bert.onnx.data"
    before = data.read_bytes()
    code, _, err = run(capsys, path, "--to", "hydra", "-o", data)
    assert (code, one_line(err)) == (2, f"{data}: the output would overwrite the input model's external data")
    # the output's own data file, <out>.data, would be the input's
    shared, _ = external_copy(tmp_path / "shared", name="in.onnx", data="out.onnx.data")
    target = shared.parent / "out.onnx"
    code, _, err = run(capsys, shared, "--to", "hydra", "-o", target)
    assert (code, one_line(err)) == (
        2,
        f"{target}: its external data file out.onnx.data would overwrite the input model's",
    )
    assert data.read_bytes() == before and not target.exists()


def test_output_is_a_directory(tmp_path, capsys):
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "-o", tmp_path)
    assert (code, one_line(err)) == (2, f"{tmp_path}: is a directory")
    (tmp_path / "out.onnx.data").mkdir()
    code, _, err = run(capsys, SAMPLE, "--to", "hydra", "-o", tmp_path / "out.onnx")
    assert (code, one_line(err)) == (2, f"{tmp_path / 'out.onnx'}: its external data file out.onnx.data is a directory")


@contextlib.contextmanager
def unprivileged():
    """Permission bits bind root only through another effective user: become `nobody` for the
    duration (root keeps its real uid, so it can come back)."""
    if os.geteuid() != 0:
        yield
        return
    # as `nobody` nothing more can be imported from root's Python: import it all now
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        main([str(SAMPLE), "--list"])
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def public(tmp_path_factory):
    """A folder `nobody` can reach (pytest's tmp_path is private to its user), with the
    sample in it."""
    folder = Path(tempfile.mkdtemp(prefix="attnrewrite-public-"))
    folder.chmod(0o755)
    shutil.copy(SAMPLE, folder / "m.onnx")
    (folder / "m.onnx").chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_output_folder_not_writable(public, capsys):
    model = public / "m.onnx"
    locked = public / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    target = locked / "out.onnx"
    try:
        with unprivileged():
            code, _, err = run(capsys, model, "--to", "hydra", "-o", target)
    finally:
        locked.chmod(0o755)
    assert (code, one_line(err)) == (2, f"{target}: folder {locked} is not writable")
    assert list(locked.iterdir()) == []


def test_existing_read_only_output(public, capsys):
    model = public / "m.onnx"
    folder = public / "open"
    folder.mkdir()
    folder.chmod(0o777)
    target = folder / "out.onnx"
    target.write_bytes(PRECIOUS)
    target.chmod(0o444)
    with unprivileged():
        code, _, err = run(capsys, model, "--to", "hydra", "-o", target)
    assert (code, one_line(err)) == (2, f"{target}: not writable")
    assert target.read_bytes() == PRECIOUS


def test_report_paths_are_checked_before_any_work(tmp_path, capsys, output):
    model = tmp_path / "m.onnx"
    shutil.copy(SAMPLE, model)
    missing = tmp_path / "nope" / "r.json"
    cases = [
        (missing, f"{missing}: folder {missing.parent} does not exist"),
        (model, f"{model}: the report would overwrite the input model"),
        (output, f"{output}: the report and the output are the same file"),
    ]
    for report, message in cases:
        code, out, err = run(capsys, model, "--to", "hydra", "-o", output, "--report", report)
        assert (code, one_line(err)) == (2, message)
        assert out == ""  # refused before the rewrite ran
    code, _, err = run(capsys, model, "--list", "--report", missing)
    assert (code, one_line(err)) == (2, cases[0][1])
    assert_untouched(output)
    assert model.read_bytes() == SAMPLE.read_bytes()


def test_failed_validation_writes_nothing(tmp_path, capsys, output):
    """Linformer with projections stored for 8 positions fails the run gate at the gate's
    sequence length (16) while the input model runs there: exit 1 (the result failed, not
    the input), the existing output and its data file untouched, no temporary files left
    beside them. The input's weights are external, so the staged output had a data file."""
    if "linformer" not in passes.PASSES:
        pytest.skip("needs the linformer pass")
    path, _ = external_copy(tmp_path / "in")
    code, _, err = run(capsys, path, "--to", "linformer", "-O", "proj_dim=4", "-O", "max_len=8", "-o", output)
    assert code == 1
    assert one_line(err).startswith("the rewritten model fails to run on generated inputs: ")
    assert "sequence_longer_than_max_len_8" in err
    assert_untouched(output)


def test_input_that_fails_on_its_own_is_bad_input(tmp_path, capsys, output):
    """A model that runs at no shape (the attention's [2, N, 8] output reshaped to 15 elements)
    fails the run gate after the rewrite; the input fails the same way at every length tried, so
    it is the input that is reported (exit 2), not the rewrite, with the lengths tried."""
    model = build_attention_model(AttentionSpec(mask="key_padding", layout="3d"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([15], np.int64), "fixed_shape"))
    model.graph.node.append(helper.make_node("Reshape", [model.graph.output[0].name, "fixed_shape"], ["fixed"]))
    model.graph.output.append(helper.make_tensor_value_info("fixed", TensorProto.FLOAT, [15]))
    path = tmp_path / "fixed.onnx"
    onnx.save(model, path)
    code, _, err = run(capsys, path, "--to", "linear", "-o", output)
    assert code == 2
    assert one_line(err).startswith(
        f"{path}: the input model itself fails on generated inputs of batch 2 and every length tried ("
    )
    assert "Reshape" in err and one_line(err).endswith(
        "give inputs it runs on with --inputs, or their length with --seq"
    )
    assert_untouched(output)


# --- a model over 2 GiB ----------------------------------------------------------------------

BIG_ROWS, BIG_COLS, BIG_TABLES = 196608, 1024, 3  # three 768 MiB float32 tables: 2.25 GiB
MARKED_ROW = 7


def build_big_model(folder: Path) -> Path:
    """A small two-layer attention (key padding; causal from a triangle buffer stored as
    external data) beside three embedding tables of 768 MiB read by Gather. The data file is
    sparse: a hole but for one marked row per table, so building it costs neither time nor
    disk, and the output's copy of it can be checked."""
    d = 16
    data_name = "big.onnx.data"
    rng = np.random.default_rng(0)
    initializers, offset = [], 0
    with open(folder / data_name, "wb") as data:

        def external(name: str, dtype: int, shape, length: int, array: np.ndarray | None = None, at: int = 0):
            nonlocal offset
            if array is not None:
                data.seek(offset + at)
                data.write(array.tobytes())
            tensor = TensorProto(name=name, data_type=dtype, dims=shape, data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
            initializers.append(tensor)
            offset = -(-(offset + length) // 4096) * 4096

        for name in ("Wq", "Wk", "Wv"):
            weight = (rng.standard_normal((d, d)) * 0.3).astype(np.float32)
            external(name, TensorProto.FLOAT, [d, d], weight.nbytes, weight)
        external("triangle", TensorProto.BOOL, [64, 64], 64 * 64, np.tril(np.ones((64, 64), bool)))
        for i in range(BIG_TABLES):
            row = np.arange(BIG_COLS, dtype=np.float32) + i
            external(
                f"table{i}",
                TensorProto.FLOAT,
                [BIG_ROWS, BIG_COLS],
                BIG_ROWS * BIG_COLS * 4,
                row,
                at=MARKED_ROW * BIG_COLS * 4,
            )
        data.truncate(offset)

    def const(name, value):
        initializers.append(numpy_helper.from_array(np.asarray(value), name))

    const("scale", np.float32(0.25))
    const("neg", np.float32(-10000.0))
    const("one", np.float32(1.0))
    const("axis1", np.array([1], np.int64))
    const("last", np.array([-1], np.int64))
    const("zeros", np.array([0, 0], np.int64))
    const("axes01", np.array([0, 1], np.int64))
    const("fill", np.float32(-np.inf))
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "Wq"], ["q"]),
        node("MatMul", ["x", "Wk"], ["k"]),
        node("MatMul", ["x", "Wv"], ["v"]),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["qk"]),
        node("Mul", ["qk", "scale"], ["logits"]),
        node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        node("Sub", ["one", "mask_f"], ["dropped"]),
        node("Mul", ["dropped", "neg"], ["bias2"]),
        node("Unsqueeze", ["bias2", "axis1"], ["bias"]),
        node("Add", ["logits", "bias"], ["masked"]),
        node("Softmax", ["masked"], ["p"], axis=-1),
        node("MatMul", ["p", "v"], ["h"]),
        # layer 2 reads layer 1's output directly as its queries
        node("MatMul", ["h", "kt"], ["qk2"]),
        node("Shape", ["x"], ["n"], start=1, end=2),
        node("Concat", ["n", "n"], ["nn"], axis=0),
        node("Slice", ["triangle", "zeros", "nn", "axes01"], ["causal"]),
        node("Where", ["causal", "qk2", "fill"], ["masked2"]),
        node("Softmax", ["masked2"], ["p2"], axis=-1),
        node("MatMul", ["p2", "v"], ["attention"]),
    ]
    for i in range(BIG_TABLES):
        nodes += [
            node("Gather", [f"table{i}", "ids"], [f"rows{i}"]),
            node("ReduceSum", [f"rows{i}", "last"], [f"sum{i}"], keepdims=0),
        ]
    nodes.append(node("Sum", [f"sum{i}" for i in range(BIG_TABLES)], ["table_sum"]))
    dims = ["batch", "sequence"]
    graph = helper.make_graph(
        nodes,
        "big",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, d]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, dims),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims),
        ],
        [
            helper.make_tensor_value_info("attention", TensorProto.FLOAT, [*dims, d]),
            helper.make_tensor_value_info("table_sum", TensorProto.FLOAT, dims),
        ],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())
    return path


# The peak of anonymous memory (RssAnon, sampled every 5 ms): a copy of the weights would be
# there. Not the peak RSS, which counts the memory-mapped weights' file pages as the page cache
# holds them (under load, the whole file: seen at 2.37 GB inside the full suite, 0.35 GB alone).
MEASURE = """
import json, sys, threading, time
from attnrewrite.cli import main

def anonymous():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

peak = [anonymous()]
def sample():
    while True:
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.005)

threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - start
peak[0] = max(peak[0], anonymous())
print(json.dumps({"code": code, "seconds": seconds, "peak_anonymous": peak[0]}))
"""


@pytest.mark.slow
def test_model_over_2_gib_is_rewritten_without_copying_its_weights_into_memory(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    path = build_big_model(folder)
    weights = (folder / "big.onnx.data").stat().st_size
    assert weights > 2 * 2**30
    if shutil.disk_usage(tmp_path).free < 2 * weights:
        pytest.skip("not enough disk for a copy of 2.25 GiB")
    out = tmp_path / "out" / "big.linear.onnx"
    out.parent.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), "--to", "linear", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    peak = measured["peak_anonymous"]
    print(f"\n2.25 GiB model: rewrite {measured['seconds']:.1f} s, peak anonymous memory {peak / 2**20:.0f} MiB")
    assert measured["code"] == 0
    assert peak < weights / 2, measured  # no copy of the weights was made (let alone two)
    assert sorted(p.name for p in out.parent.iterdir()) == ["big.linear.onnx", "big.linear.onnx.data"]
    assert out.stat().st_size < 1 << 20  # the protobuf holds no weights

    rewritten = onnx.load(out, load_external_data=False)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Softmax" not in ops and ops.count("LinearAttention") + ops.count("CausalLinearAttention") == 2
    locations = {e.value for t in rewritten.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"big.linear.onnx.data"}
    tables = {t.name: _extent(t) for t in rewritten.graph.initializer if t.name.startswith("table")}
    with open(out.parent / "big.linear.onnx.data", "rb") as data:
        for i in range(BIG_TABLES):
            offset, length = tables[f"table{i}"]
            assert length == BIG_ROWS * BIG_COLS * 4
            data.seek(offset + MARKED_ROW * BIG_COLS * 4)
            assert np.array_equal(np.frombuffer(data.read(BIG_COLS * 4), np.float32), np.arange(BIG_COLS) + i)
    ids = np.array([[MARKED_ROW, 0, 1], [2, MARKED_ROW, 3]])
    feeds = {
        "x": np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32),
        "ids": ids,
        "attention_mask": np.ones((2, 3), np.int64),
    }
    got = ort.InferenceSession(str(out)).run(None, feeds)
    marked_sum = sum((np.arange(BIG_COLS) + i).sum() for i in range(BIG_TABLES))
    assert np.allclose(got[1], np.where(ids == MARKED_ROW, marked_sum, 0.0))
    assert np.isfinite(got[0]).all()


# --- fp16 and bf16 ---------------------------------------------------------------------------

ARITHMETIC = {
    "MatMul",
    "Gemm",
    "Einsum",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Sqrt",
    "Exp",
    "Log",
    "Elu",
    "Relu",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceL2",
    "CumSum",
    "Sum",
    "Max",
    "Min",
    "Softmax",
    "LpNormalization",
    "Reciprocal",
    "Neg",
    "Abs",
    "Sin",
    "Cos",
    "Tanh",
    "Sigmoid",
}
LOW_PRECISION = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def replacement_arithmetic_types(proto: onnx.ModelProto) -> dict[str, set[int]]:
    """op type -> element types of the inputs it computes on, over the nodes of the replacement
    functions only (inlined, typed by shape inference)."""
    outside = {n.name for n in proto.graph.node}
    inlined = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(proto), strict_mode=True)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inlined.graph.input, *inlined.graph.value_info, *inlined.graph.output]
    }
    types.update({t.name: t.data_type for t in inlined.graph.initializer})
    found: dict[str, set[int]] = {}
    for node in inlined.graph.node:
        if node.name in outside or node.op_type not in ARITHMETIC:
            continue
        found.setdefault(node.op_type, set()).update(types.get(i, 0) for i in node.input if i)
    return found


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION))
@pytest.mark.parametrize("method", METHODS)
def test_low_precision_models(dtype, method):
    """fp16 / bf16 attention: the interface keeps its type, every arithmetic node of the
    replacement computes in float32, and the output equals the pass's torch module (which
    computes in float32) up to the output's rounding."""
    for mask, form in (("key_padding", "additive"), ("causal", "where_fill"), ("causal+key_padding", "where_keep")):
        spec = AttentionSpec(mask=mask, mask_form=form, dtype=dtype, fill="min", split_heads=True)
        original = build_attention_model(spec)
        model, record = rewrite_model(onnx_io.from_proto(original), method)
        (outcome,) = record.outcomes
        reason = passes.get_pass(method).supports(outcome.site, passes.make_options(passes.get_pass(method)))
        if reason is not None:
            assert outcome.reason == reason
            continue
        assert outcome.rewritten, outcome.reason
        proto = __import__("onnx_ir").serde.serialize_model(model)
        interface = lambda m: [(v.name, v.type.tensor_type.elem_type) for v in [*m.graph.input, *m.graph.output]]  # noqa: E731
        assert interface(proto) == interface(original)
        computed_on = replacement_arithmetic_types(proto)
        allowed = {TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL}
        if method == "hydra" and dtype == TensorProto.FLOAT16:
            # normalisation and products in float16; the sums over positions in float32
            assert TensorProto.FLOAT16 not in computed_on["MatMul" if mask == "key_padding" else "CumSum"]
            allowed.add(TensorProto.FLOAT16)
        assert computed_on and all(types <= allowed for types in computed_on.values()), computed_on
        if dtype == TensorProto.BFLOAT16 and form == "additive":
            continue  # the mask's own bf16 arithmetic (outside the replacement) has no CPU kernel
        feeds = make_feeds(spec, 2, 70)
        (got,) = bfloat16.run(ort.InferenceSession(proto.SerializeToString()), feeds)
        assert got.dtype == (np.float16 if dtype == TensorProto.FLOAT16 else ml_dtypes.bfloat16)
        got = got.astype(np.float32)
        assert np.isfinite(got).all()
        expected = _reference(method, outcome.site, spec, feeds)
        tolerance = 2**-10 if dtype == TensorProto.FLOAT16 else 2**-7  # one rounding of the output
        if method == "hydra" and dtype == TensorProto.FLOAT16:
            tolerance = 2**-8  # and the float16 roundings of q_hat, k_hat * v and the product
        assert np.allclose(got, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


def _reference(method: str, site, spec: AttentionSpec, feeds) -> np.ndarray:
    module = passes.get_pass(method)
    q, k, v, key_keep = (None if a is None else torch.tensor(a) for a in reference_qkv(spec, feeds))
    with torch.no_grad():
        out = module.torch_module(site, passes.make_options(module))(q, k, v, key_keep)
    return out.numpy().astype(np.float32)


def test_fp16_sums_that_would_overflow_stay_finite():
    """2048 keys with values ~ 40: the key-value sum of linear attention reaches ~1e5, past
    float16's 65504. Computed in float32 inside the replacement, the output is finite and
    matches the float32 reference."""
    spec = AttentionSpec(dtype=TensorProto.FLOAT16, heads=1, mask="key_padding")
    model, record = rewrite_model(onnx_io.from_proto(build_attention_model(spec)), "linear")
    feeds = make_feeds(spec, 2, 2048)
    feeds["v"] = (np.abs(feeds["v"].astype(np.float32)) * 40).astype(np.float16)
    proto = __import__("onnx_ir").serde.serialize_model(model)
    (got,) = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    kv_sum = np.abs(feeds["v"].astype(np.float32)).sum(-2).max()
    assert kv_sum > np.finfo(np.float16).max  # the overflow this guards against is real
    assert np.isfinite(got).all()
    expected = _reference("linear", record.outcomes[0].site, spec, feeds)
    assert np.allclose(got.astype(np.float32), expected, rtol=2**-10, atol=2**-10 * np.abs(expected).max())


@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.KEY_PADDING, MaskKind.CAUSAL])
def test_hydra_fp16_body_stays_finite_and_accurate_for_large_inputs(mask):
    """Hydra's float16 body normalises and multiplies in float16: |x| ~ 200 over 12 heads of 64
    features squares to ~3e7 and the key-value sum over 8192 positive keys reaches ~1e5, both
    past float16's 65504, yet the output equals the float64 reference to float16 precision.
    onnxruntime's CPU provider computes float16 nodes in float32, so the float16 arithmetic
    CUDA does is checked with onnx's reference evaluator, which keeps every tensor float16."""
    n, heads, d = 8192, 12, 64
    rng = np.random.default_rng(0)
    q = (200 * rng.standard_normal((1, heads, n, d))).astype(np.float16)
    k, v = ((np.abs(200 * rng.standard_normal((1, heads, n, d))) + 200 * i).astype(np.float16) for i in range(2))
    keep = (rng.random((1, 1, n, 1)) > 0.1).astype(np.float32) if mask.key_padding else np.ones((1, 1), np.float32)
    site = AttentionSite("s", scale=0.125, mask=mask, rank=4, num_heads=heads, head_dim=d, value_dim=d, dtype="float16")
    lowering = hydra.onnx_lowering(site, hydra.Options(), 20)
    assert "HalfHydraNormalize" in [f.name for f in lowering.functions]
    model = lowering_model(lowering, 4, TensorProto.FLOAT16, keep_rank=keep.ndim)
    feeds = {"q": q, "k": k, "v": v, "key_keep": keep}
    (on_cpu,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    (in_float16,) = onnx.reference.ReferenceEvaluator(model).run(None, feeds)
    q64, k64, v64 = (torch.from_numpy(x.astype(np.float64)) for x in (q, k, v))
    module = hydra.torch_module(site, hydra.Options())
    with torch.no_grad():
        expected = module(q64, k64, v64, torch.from_numpy(keep).double() if mask.key_padding else None).numpy()
        assert (q64.square().sum((1, 3)) > np.finfo(np.float16).max).all()  # squares overflow float16
        if not mask.causal:
            assert (module.normalize(k64) * v64).sum(-2).max() > np.finfo(np.float16).max  # so does the sum
    for got in (on_cpu, in_float16):  # a few float16 roundings (q_hat, kv, the product, the output)
        assert got.dtype == np.float16 and np.isfinite(got).all()
        assert np.abs(got.astype(np.float64) - expected).max() < 2**-8 * np.abs(expected).max()


# --- dynamic dimensions ----------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_dynamic_dims_keep_their_names_and_other_sizes_run(tmp_path, capsys, method):
    out = tmp_path / "out.onnx"
    code, _, err = run(capsys, SAMPLE, "--to", method, "-o", out)
    if code == 1:  # the method refuses this model's sites: that is reported, not tested here
        pytest.skip(one_line(err))
    assert code == 0, err

    def dims(m):
        return [
            [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*m.graph.input, *m.graph.output]
        ]

    assert dims(onnx.load(out)) == dims(onnx.load(SAMPLE)) == [["batch", "sequence"]] * 2 + [["batch", "sequence", 64]]
    session = ort.InferenceSession(str(out))
    for batch, seq in ((1, 1), (3, 5), (2, 37), (4, 130)):
        ids = np.random.default_rng(seq).integers(0, 1000, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2 + 1 :] = 0
        (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        assert hidden.shape == (batch, seq, 64) and np.isfinite(hidden).all()


@pytest.mark.parametrize("method", METHODS)
def test_causal_rewrite_matches_its_reference_at_unseen_lengths(method):
    """Causal methods work in chunks (prefix sums): lengths across chunk edges, batches other
    than any used to build the graph."""
    spec = AttentionSpec(mask="causal+key_padding", split_heads=True)
    model, record = rewrite_model(onnx_io.from_proto(build_attention_model(spec)), method)
    (outcome,) = record.outcomes
    if not outcome.rewritten:
        assert outcome.reason == passes.get_pass(method).supports(
            outcome.site, passes.make_options(passes.get_pass(method))
        )
        return
    proto = __import__("onnx_ir").serde.serialize_model(model)
    assert [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim[:2]] == ["batch", "sequence"]
    session = ort.InferenceSession(proto.SerializeToString())
    for batch, seq in ((1, 1), (3, 63), (2, 65), (1, 200)):
        feeds = make_feeds(spec, batch, seq, seed=seq)
        (got,) = session.run(None, feeds)
        expected = _reference(method, outcome.site, spec, feeds)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-5 * max(np.abs(expected).max(), 1e-6), (batch, seq)


# --- determinism -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_same_input_options_and_seed_give_identical_bytes(tmp_path, capsys, method):
    outputs = []
    for i in range(2):
        out = tmp_path / f"out{i}.onnx"
        code, _, err = run(capsys, SAMPLE, "--to", method, "-o", out, "-O", "seed=7")
        if code == 1:
            pytest.skip(one_line(err))
        assert code == 0, err
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_identical_bytes_with_external_data(tmp_path, capsys):
    path, _ = external_copy(tmp_path / "in")
    written = []
    for i in range(2):
        out = tmp_path / f"o{i}" / "out.onnx"
        out.parent.mkdir()
        assert run(capsys, path, "--to", "linear", "-o", out)[0] == 0
        written.append((out.read_bytes(), (out.parent / "out.onnx.data").read_bytes()))
    assert written[0] == written[1]


def test_identical_bytes_across_processes(tmp_path, capsys):
    """Another process with another hash seed (set and dict orders) writes the same bytes."""
    method = "favor" if "favor" in passes.PASSES else "linear"
    here = tmp_path / "here.onnx"
    assert run(capsys, SAMPLE, "--to", method, "-o", here, "-O", "seed=3")[0] == 0
    there = tmp_path / "there.onnx"
    script = "import sys; from attnrewrite.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(SAMPLE), "--to", method, "-o", str(there), "-O", "seed=3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert here.read_bytes() == there.read_bytes()


# --- the JSON report -------------------------------------------------------------------------


def three_sites_model() -> onnx.ModelProto:
    """Three attentions over the same q, k, v: a plain one, one whose probabilities are also a
    graph output, and one with a learned additive bias (not a mask)."""
    node = helper.make_node
    nodes, outputs = [], []
    dims = ["batch", 2, "sequence"]
    inits = [numpy_helper.from_array(np.float32(0.25), "scale")]
    for i in range(3):
        nodes += [
            node("Transpose", ["k"], [f"kt{i}"], perm=[0, 1, 3, 2], name=f"/layer{i}/Transpose"),
            node("MatMul", ["q", f"kt{i}"], [f"qk{i}"], name=f"/layer{i}/MatMul"),
            node("Mul", [f"qk{i}", "scale"], [f"logits{i}"], name=f"/layer{i}/Mul"),
        ]
        logits = f"logits{i}"
        if i == 2:
            nodes.append(node("Add", [logits, "bias"], ["biased"], name="/layer2/Add"))
            logits = "biased"
        nodes += [
            node("Softmax", [logits], [f"p{i}"], axis=-1, name=f"/layer{i}/Softmax"),
            node("MatMul", [f"p{i}", "v"], [f"out{i}"], name=f"/layer{i}/MatMul_1"),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, [*dims, 8]))
    outputs.append(helper.make_tensor_value_info("p1", TensorProto.FLOAT, [*dims, "sequence"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [*dims, 8]) for n in ("q", "k", "v")]
    inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 2, "sequence", "sequence"]))
    graph = helper.make_graph(nodes, "three", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_report_records_rewritten_and_skipped_sites(tmp_path, capsys):
    path = tmp_path / "three.onnx"
    onnx.save(three_sites_model(), path)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, _, err = run(capsys, path, "--to", "linear", "-o", out, "--report", report, "-O", "chunk=32")
    assert code == 0, err
    written = json.loads(report.read_text())
    stored = json.loads({p.key: p.value for p in onnx.load(out).metadata_props}[METADATA_KEY])
    assert (written["outcome"], written["output"]) == ("written", str(out))
    assert {key: written[key] for key in stored} == stored  # the report holds the record the model carries
    assert (written["method"], written["sites_found"], written["sites_rewritten"]) == ("linear", 3, 1)
    assert written["options"] == {
        "chunk": 32,
        "window": 0,
        "window_next": True,
        "sinks": 1,
        "sparse": 0,
        "update": "additive",
        "seed": 0,
    }
    sites = {s["name"]: s for s in written["sites"]}
    assert set(sites) == {"/layer0/Softmax", "/layer1/Softmax", "/layer2/Softmax"}
    assert sites["/layer0/Softmax"]["status"] == "rewritten"
    assert sites["/layer0/Softmax"]["replacement"] == "attnrewrite.LinearAttention"
    assert sites["/layer0/Softmax"]["reason"] is None and sites["/layer0/Softmax"]["scale"] == 0.25
    assert sites["/layer1/Softmax"]["status"] == "skipped"
    assert sites["/layer1/Softmax"]["reason"] == "attention probabilities are a graph output ('p1')"
    assert sites["/layer2/Softmax"]["status"] == "skipped" and sites["/layer2/Softmax"]["mask"] == "bias"
    assert sites["/layer2/Softmax"]["reason"].startswith("the additive term on the logits is an attention bias")
    assert all(s["replacement"] is None for name, s in sites.items() if name != "/layer0/Softmax")

    listed = tmp_path / "listed.json"
    assert run(capsys, path, "--list", "--report", listed)[0] == 0
    statuses = {s["name"]: (s["status"], s["reason"]) for s in json.loads(listed.read_text())["sites"]}
    assert statuses["/layer0/Softmax"] == ("rewritable", None)  # --list rewrites nothing
    assert statuses["/layer1/Softmax"] == ("skipped", sites["/layer1/Softmax"]["reason"])
