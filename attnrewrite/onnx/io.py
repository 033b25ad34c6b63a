"""Loading ONNX models with clear errors, and writing them only whole (temp file + rename)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from google.protobuf.message import DecodeError

from attnrewrite.errors import AttnRewriteError
from passes._onnx import MIN_OPSET

OLDEST_CONVERTIBLE_OPSET = 7
TWO_GIB = 2**31


def load_model(path: str | os.PathLike) -> ir.Model:
    path = Path(path)
    if not path.exists():
        raise AttnRewriteError(f"{path}: no such file")
    if path.is_dir():
        raise AttnRewriteError(f"{path}: is a directory, not an ONNX file")
    if path.stat().st_size == 0:
        raise AttnRewriteError(f"{path}: is empty")
    try:
        model = ir.load(path)
    except (DecodeError, RuntimeWarning, ValueError, TypeError) as error:
        raise AttnRewriteError(f"{path}: not an ONNX model ({_short(error)})") from error
    if model.graph.num_nodes() == 0 and not model.graph.outputs:
        raise AttnRewriteError(f"{path}: not an ONNX model (no graph)")
    return model


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def infer_shapes(model: ir.Model) -> ir.Model:
    """Shapes let detection know ranks and head counts; a model ONNX cannot infer still works."""
    try:
        return common_passes.ShapeInferencePass()(model).model
    except Exception:  # shape inference is advisory here
        return model


def default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


def upgrade_opset(model: ir.Model) -> ir.Model:
    """Replacement bodies need opset >= MIN_OPSET; older models are converted first."""
    version = default_opset(model)
    if version >= MIN_OPSET:
        return model
    if version < OLDEST_CONVERTIBLE_OPSET:
        raise AttnRewriteError(f"opset {version} is too old to handle (need {OLDEST_CONVERTIBLE_OPSET} or newer)")
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(ir.serde.serialize_model(model), MIN_OPSET)
    except Exception as error:
        raise AttnRewriteError(f"could not convert opset {version} to {MIN_OPSET}: {_short(error)}") from error
    return from_proto(converted)


def save_model(model: ir.Model, path: str | os.PathLike) -> None:
    """Write `path` (and `<name>.data` for weights too large for one protobuf) atomically:
    everything goes to temporary files in the same folder, renamed into place only when
    complete, so a failure leaves whatever was at `path` untouched."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise AttnRewriteError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise AttnRewriteError(f"{path}: folder {folder} is not writable")
    data_name = f"{path.name}.data" if _needs_external_data(model) else None
    with tempfile.TemporaryDirectory(dir=folder, prefix=".attnrewrite-") as staging:
        staged = Path(staging) / path.name
        ir.save(model, staged, external_data=data_name)
        if data_name:
            os.replace(Path(staging) / data_name, folder / data_name)
        os.replace(staged, path)


def _needs_external_data(model: ir.Model) -> bool:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
            if isinstance(value.const_value, ir.ExternalTensor) or total > TWO_GIB // 2:
                return True
    return False


@contextlib.contextmanager
def saved_copy(model: ir.Model):
    """The model saved to a temporary folder (for tools that need a path, like >2 GiB checks)."""
    with tempfile.TemporaryDirectory(prefix="attnrewrite-") as folder:
        path = Path(folder) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data" if _needs_external_data(model) else None)
        yield path


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
