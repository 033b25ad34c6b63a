"""Loading ONNX models with clear errors, and writing them only whole (temp folder + rename).

Users point the tool at models they did not write. Every way a file can fail to be a model the
tool can handle ends in one AttnRewriteError whose message names the file and the problem:
not a file, empty, not a protobuf, a protobuf that is not a model, versions the libraries
cannot handle, a model the ONNX checker rejects, and external data that is missing, truncated
or outside the model's folder. External data locations are checked before anything opens
them: a location is any string the model's author chose, and reading ``../../etc/passwd`` or
a symlink out of the folder is how CVE-2024-27318/27319 leaked files through ONNX itself.

Weights stay where they are: the model is parsed without its external data, which onnx_ir
memory-maps on first use (only the small tensors detection reads are ever touched), and saving
copies external tensors file to file, so a multi-GiB model is never held in memory.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from attnrewrite.errors import AttnRewriteError, RewriteFailed
from attnrewrite.passes.lowering import MIN_OPSET

OLDEST_CONVERTIBLE_OPSET = 7  # onnx's version converter starts there
TWO_GIB = 2**31  # protobuf's limit for one serialized message
# Big tensors at 64 KiB offsets in the data file: onnxruntime then memory-maps them instead of
# reading them into its own buffers (and 64 KiB is also Windows' mapping granularity).
EXTERNAL_DATA_ALIGNMENT = 65536
# Versions of onnxruntime that fail on an IR version only do so above this one.
_IR_VERSION_SURELY_LOADABLE = 10

_SUB_BYTE_TYPES = {"int4", "uint4", "float4e2m1", "int2", "uint2", "float6e2m3", "float6e3m2"}


# --- loading ---------------------------------------------------------------------------------


def load_model(path: str | os.PathLike) -> ir.Model:
    """The model at `path`, its external data checked and mapped lazily, or AttnRewriteError."""
    path = Path(path)
    check_input_file(path)
    proto = _parse(path)
    check_external_data(proto, path)
    _check_versions(proto, path)
    _check_with_onnx_checker(proto, path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as error:  # the checker passed it: a form onnx_ir cannot represent
        raise AttnRewriteError(f"{path}: cannot read the model's graph ({_short(error)})") from error
    del proto
    # External tensors resolve against the model's folder, absolute so a later chdir is harmless.
    ir.external_data.set_base_dir(model.graph, os.path.abspath(path.parent))
    return model


def check_input_file(path: Path) -> None:
    """One line where ``path`` is no ONNX file to read: missing, a directory, empty, over 2 GiB, unreadable."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise AttnRewriteError(f"{path}: no such file") from None
    except OSError as error:
        raise AttnRewriteError(f"{path}: cannot read it ({error.strerror or error})") from error
    if stat.S_ISDIR(info.st_mode):
        raise AttnRewriteError(f"{path}: is a directory, not an ONNX file")
    if not stat.S_ISREG(info.st_mode):
        raise AttnRewriteError(f"{path}: not a regular file")
    if info.st_size == 0:
        raise AttnRewriteError(f"{path}: is empty")
    if info.st_size >= TWO_GIB:
        raise AttnRewriteError(
            f"{path}: is {info.st_size / 2**30:.1f} GiB; one ONNX protobuf cannot exceed 2 GiB "
            "(save the weights as external data)"
        )
    if not _access(path, os.R_OK):
        raise AttnRewriteError(f"{path}: permission denied")


def _parse(path: Path) -> onnx.ModelProto:
    try:
        proto = onnx.load_model(str(path), load_external_data=False)
    except OSError as error:
        raise AttnRewriteError(f"{path}: cannot read it ({error.strerror or error})") from error
    except Exception as error:  # DecodeError, RuntimeWarning, text-format errors...
        raise AttnRewriteError(
            f"{path}: not an ONNX model (it does not parse as an ONNX protobuf: truncated or another format)"
        ) from error
    # Protobuf parses many byte strings, other ONNX messages among them (a TensorProto, a
    # GraphProto), as a ModelProto with unknown fields; a model has at least these two.
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise AttnRewriteError(f"{path}: not an ONNX model (a protobuf message without an IR version and a graph)")
    return proto


def _check_versions(proto: onnx.ModelProto, path: Path) -> None:
    newest_ir = onnx.IR_VERSION
    if proto.ir_version > newest_ir:
        raise AttnRewriteError(
            f"{path}: IR version {proto.ir_version} is newer than onnx {onnx.__version__} knows ({newest_ir})"
        )
    loadable = _runtime_max_ir_version(proto.ir_version)
    if loadable is not None:
        import onnxruntime

        raise AttnRewriteError(
            f"{path}: IR version {proto.ir_version} is newer than onnxruntime {onnxruntime.__version__} "
            f"can load ({loadable} at most)"
        )
    versions = {o.domain: o.version for o in proto.opset_import}
    opset = versions.get("", versions.get("ai.onnx"))
    if opset is None:
        return  # no standard operators at all: nothing to find, and the checker says if that is wrong
    if opset < OLDEST_CONVERTIBLE_OPSET:
        raise AttnRewriteError(f"{path}: opset {opset} is too old to handle (need {OLDEST_CONVERTIBLE_OPSET} or newer)")
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise AttnRewriteError(f"{path}: opset {opset} is newer than onnx {onnx.__version__} knows ({newest})")


@functools.cache
def _runtime_max_ir_version(ir_version: int) -> int | None:
    """None when onnxruntime loads models of `ir_version`, else the newest IR version it loads.
    Found by loading a one-node model: the runtime has no API that says it."""
    if ir_version <= _IR_VERSION_SURELY_LOADABLE or _runtime_loads(ir_version):
        return None
    lower = ir_version - 1
    while lower > _IR_VERSION_SURELY_LOADABLE and not _runtime_loads(lower):
        lower -= 1
    return lower


def _runtime_loads(ir_version: int) -> bool:
    import onnxruntime as ort

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, ir_version=ir_version, opset_imports=[onnx.helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:
        return "IR version" not in str(error)  # only a version refusal counts
    return True


def _check_with_onnx_checker(proto: onnx.ModelProto, path: Path) -> None:
    try:
        check_graph(proto)
    except Exception as error:  # ValidationError, InferenceError, or anything the C++ side raises
        raise AttnRewriteError(f"{path}: fails the ONNX checker: {_short(error)}") from error


def check_graph(proto: onnx.ModelProto) -> None:
    """The ONNX checker (full check) on ``proto``'s graph, its weights and its external data
    left unread. Operators onnxruntime registers in the default domain beside the standard
    ones (SimplifiedLayerNormalization, written by onnxruntime-genai's model builder) are
    checked as the custom operators they are, and the declared shapes of intermediate values
    (value_info, hints onnxruntime infers again: the builder declares some constants with the
    wrong rank) are not held against the graph. Everything else keeps the checker's full
    strength, and onnxruntime loading the model is the gate that proves the rest."""
    checkable = _without_weights(proto)
    del checkable.graph.value_info[:]
    runtime_only = runtime_default_domain_ops()
    relabelled = False
    for node in _graphs_and_nodes(checkable)[1]:
        if node.domain in ("", "ai.onnx") and node.op_type in runtime_only:
            node.domain, relabelled = _RUNTIME_DEFAULT_DOMAIN, True
    if relabelled:
        checkable.opset_import.append(onnx.helper.make_opsetid(_RUNTIME_DEFAULT_DOMAIN, 1))
    onnx.checker.check_model(checkable, full_check=True)


# the private domain a check moves onnxruntime's default-domain operators into
_RUNTIME_DEFAULT_DOMAIN = "attnrewrite.onnxruntime-default-domain"


@functools.cache
def runtime_default_domain_ops() -> frozenset[str]:
    """Operators onnxruntime registers in the default domain that no ONNX opset defines."""
    from onnxruntime.capi import onnxruntime_pybind11_state as runtime

    standard = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
    registered = {s.name for s in runtime.get_all_operator_schema() if s.domain in ("", "ai.onnx")}
    return frozenset(registered - standard)


_WEIGHT_BYTES = 1024  # initializers above this are weights: typed, never read by the checks


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every weight initializer turned into a typed graph input, built field by
    field so no weight is copied: the checker serializes what it is given (a second copy of
    an inline model's weights), and given a proto it looks for external data in the working
    directory, given the path it refuses every symlink, even one inside the model's folder.
    check_external_data checks the files; the checker checks the graph."""
    copy = onnx.ModelProto()
    for field, value in proto.ListFields():
        if field.name != "graph":
            _copy_field(copy, field, value)
    for field, value in proto.graph.ListFields():
        if field.name != "initializer":
            _copy_field(copy.graph, field, value)
    inputs = {i.name for i in proto.graph.input}
    for tensor in proto.graph.initializer:
        # from type and shape: upb's ByteSize() serializes the tensor to measure it
        if tensor.data_location != onnx.TensorProto.EXTERNAL and (_tensor_nbytes(tensor) or 0) <= _WEIGHT_BYTES:
            copy.graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return copy


def _copy_field(target, field, value) -> None:
    repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
    if repeated:
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


# --- external data ---------------------------------------------------------------------------


def check_external_data(proto: onnx.ModelProto, model_path: str | os.PathLike) -> list[str]:
    """Check every tensor stored outside `model_path` before anything reads it; returns the
    resolved paths of the data files. Refuses absolute locations, locations that leave the
    model's folder by ``..`` or through a symlink, files with other hard links (a hard link can
    alias a file outside the folder, and onnx_ir refuses them too), missing files, and files too
    short for the tensor."""
    model_path = Path(model_path)
    folder = os.path.abspath(model_path.parent)
    real_folder = os.path.realpath(folder)
    files: dict[str, int] = {}
    for tensor in _tensor_protos(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        what = f"{model_path}: external data of tensor {tensor.name!r}"
        if not location:
            raise AttnRewriteError(f"{what} names no file")
        if "\0" in location:
            raise AttnRewriteError(f"{what} names an invalid file ({location!r})")
        if os.path.isabs(location) or location.startswith(("/", "\\")) or location[1:2] == ":":
            raise AttnRewriteError(
                f"{what} is at an absolute path ({location}); only files in the model's folder are read"
            )
        joined = os.path.normpath(os.path.join(folder, location))
        if not _inside(joined, folder):
            raise AttnRewriteError(f"{what} ({location}) is outside the model's folder")
        real = os.path.realpath(joined)
        if not _inside(real, real_folder):
            raise AttnRewriteError(f"{what} ({location}) is a link to {real}, outside the model's folder")
        try:
            info_stat = os.stat(real)
        except FileNotFoundError:
            raise AttnRewriteError(f"{what}: file {location} not found beside the model") from None
        except OSError as error:
            raise AttnRewriteError(f"{what}: cannot read {location} ({error.strerror or error})") from error
        if not stat.S_ISREG(info_stat.st_mode):
            raise AttnRewriteError(f"{what}: {location} is not a regular file")
        if info_stat.st_nlink > 1:
            raise AttnRewriteError(
                f"{what}: {location} has {info_stat.st_nlink} hard links; refusing it, as a hard link "
                "can alias a file outside the model's folder"
            )
        _check_extent(tensor, info, what, location, info_stat.st_size)
        files[real] = info_stat.st_size
    return sorted(files)


def _check_extent(tensor: onnx.TensorProto, info: dict[str, str], what: str, location: str, size: int) -> None:
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise AttnRewriteError(f"{what} has an offset or length that is not an integer") from None
    if offset < 0 or (length is not None and length < 0):
        raise AttnRewriteError(f"{what} has a negative offset or length")
    expected = _tensor_nbytes(tensor)
    if length is not None and expected is not None and length != expected:
        raise AttnRewriteError(f"{what} is {length} bytes long, but its type and shape take {expected}")
    needed = length if length is not None else expected
    if needed is not None and offset + needed > size:
        raise AttnRewriteError(
            f"{what} lies past the end of {location} (bytes {offset}..{offset + needed} of a {size}-byte file)"
        )


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    if any(d < 0 for d in tensor.dims):
        return None
    try:
        dtype = ir.DataType(tensor.data_type)
        bits = dtype.bitwidth
    except Exception:  # strings, unknown types: no fixed size
        return None
    count = math.prod(tensor.dims)
    if dtype.name.lower() in _SUB_BYTE_TYPES:
        return (count * bits + 7) // 8
    return count * (bits // 8)


def _inside(path: str, folder: str) -> bool:
    folder = folder.rstrip(os.sep) + os.sep
    return path.startswith(folder)


def _tensor_protos(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers, sparse ones, tensor attributes, in the main
    graph, its subgraphs, the model's functions and training graphs."""
    graphs, nodes = _graphs_and_nodes(proto)
    for graph in graphs:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [attr.sparse_tensor, *attr.sparse_tensors]:
                yield sparse.values
                yield sparse.indices


def _graphs_and_nodes(proto: onnx.ModelProto) -> tuple[list[onnx.GraphProto], list[onnx.NodeProto]]:
    """Every graph (the main one, the training graphs, every subgraph) and every node (theirs
    and the model's functions')."""
    pending = [proto.graph, *(g for info in proto.training_info for g in (info.initialization, info.algorithm))]
    node_lists = [f.node for f in proto.functions]
    graphs, nodes = [], []
    while pending or node_lists:
        if pending:
            graphs.append(pending.pop())
            node_lists.append(graphs[-1].node)
            continue
        for node in node_lists.pop():
            nodes.append(node)
            for attr in node.attribute:
                pending += [attr.g] if attr.HasField("g") else []
                pending.extend(attr.graphs)
    return graphs, nodes


def files_read_by(model: ir.Model) -> list[str]:
    """Resolved paths of the external data files the model's tensors read."""
    return sorted({os.path.realpath(t.path) for t in _external_tensors(model)})


def _external_tensors(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    for tensor in _all_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            yield tensor


def _all_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and attr.value is not None:
                    yield attr.value
                elif attr.type == ir.AttributeType.TENSORS:
                    yield from (t for t in attr.value or () if t is not None)


# --- shapes and opsets -----------------------------------------------------------------------


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def infer_shapes(model: ir.Model) -> ir.Model:
    """Shapes let detection know ranks and head counts; a model ONNX cannot infer still works.
    Strict inference stops at the first node it cannot type and infers nothing; the lenient
    pass after it still infers the rest. The outputs keep the shapes the model declares:
    onnxruntime's inference names a GroupQueryAttention's present cache by its past's length."""
    declared = {v.name: v.shape.copy() for v in model.graph.outputs if v.shape is not None}
    model = _inferred(model)
    for value in model.graph.outputs:
        if value.name in declared:
            value.shape = declared[value.name]
    return model


def _inferred(model: ir.Model) -> ir.Model:
    quiet = logging.getLogger(common_passes.ShapeInferencePass.__module__)
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # it logs a traceback when inference fails; advisory here
    try:
        result = common_passes.ShapeInferencePass()(model)
        if not result.modified:
            result = common_passes.ShapeInferencePass(strict_mode=False)(model)
        model = result.model
    except Exception:
        pass
    finally:
        quiet.setLevel(level)
    return _with_contrib_shapes(model) if any(node.domain == "com.microsoft" for node in model.graph) else model


# onnxruntime's SymbolicShapeInference.infer_shapes() saves the model into the working directory
# where some shape stays unknown, and raises; its loop, run here through these private methods,
# keeps what it found and writes nothing. They are there in the releases from the first one this
# package supports to the newest it was tested with; another release is not trusted with them.
SYMBOLIC_INFERENCE_METHODS = ("_preprocess", "_infer_impl", "_update_output_from_vi")
SYMBOLIC_INFERENCE_RELEASES = ((1, 20), (1, 32))  # (major, minor), first and last
_SHAPE_NOTE = "attnrewrite.shape_inference_note"  # in model.meta: why the fallback, for the record


def shape_notes(model: ir.Model) -> list[str]:
    """What infer_shapes had to do without: its note, for the rewrite's record."""
    return [model.meta[_SHAPE_NOTE]] if _SHAPE_NOTE in model.meta else []


def _with_contrib_shapes(model: ir.Model) -> ir.Model:
    """ONNX shape inference cannot type onnxruntime's com.microsoft operators (a transformer
    optimizer's fused layer norms and GELUs): every shape after the first is lost. onnxruntime's
    symbolic shape inference types them; where it cannot run here or fails, the model is kept as
    ONNX shape inference left it, and a note (shape_notes) says why."""
    inferred = _symbolic_shapes(model)
    if isinstance(inferred, ir.Model):
        return _keeping_base_dir(model, inferred)
    model.meta[_SHAPE_NOTE] = (
        f"shape inference: onnxruntime's symbolic shape inference {inferred}; the shapes past "
        "com.microsoft operators are ONNX shape inference's (some may be unknown)"
    )
    return model


def _symbolic_shapes(model: ir.Model) -> ir.Model | str:
    """The model typed by onnxruntime's symbolic shape inference, or why it is not."""
    import onnxruntime

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError as error:
        return f"cannot be imported ({_short(error)})"
    unusable = _symbolic_inference_unusable(onnxruntime.__version__, SymbolicShapeInference)
    if unusable is not None:
        return unusable
    try:
        inference = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
        with contextlib.redirect_stdout(None):
            inference._preprocess(ir.serde.serialize_model(model))
            while inference.run_:
                inference._infer_impl()
            inference._update_output_from_vi()
        return from_proto(inference.out_mp_)
    except Exception as error:  # its own errors on a graph it cannot type: advisory, as ONNX's
        return f"failed ({_short(error)})"


def _symbolic_inference_unusable(version: str, inference: type) -> str | None:
    """Why SymbolicShapeInference's private loop is not to be run on this onnxruntime; None
    when it is."""
    first, last = SYMBOLIC_INFERENCE_RELEASES
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if len(release) != 2 or not first <= release <= last:
        known = f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"
        return f"is not used with onnxruntime {version} (its private methods are known in {known})"
    missing = [name for name in SYMBOLIC_INFERENCE_METHODS if not hasattr(inference, name)]
    if missing:
        return f"is not used: onnxruntime {version}'s SymbolicShapeInference has no {', '.join(missing)}"
    return None


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
        converted = from_proto(version_converter.convert_version(ir.serde.serialize_model(model), MIN_OPSET))
    except Exception as error:
        raise AttnRewriteError(f"could not convert opset {version} to {MIN_OPSET}: {_short(error)}") from error
    return _keeping_base_dir(model, converted)


def _keeping_base_dir(model: ir.Model, converted: ir.Model) -> ir.Model:
    """Serialized external tensors keep their locations but not the folder they are relative to."""
    folders = {t.base_dir for t in _external_tensors(model)}
    if len(folders) == 1:
        ir.external_data.set_base_dir(converted.graph, folders.pop())
    return converted


# --- writing ---------------------------------------------------------------------------------


def check_output_path(
    path: str | os.PathLike, model_path: str | os.PathLike, reads: Iterable[str] = (), what: str = "output"
) -> None:
    """Refuse, before any work, an output that cannot be written or would destroy an input:
    the model itself (under any spelling, symlink or hard link) or the data files it reads."""
    path = Path(path)
    if path.is_dir():
        raise AttnRewriteError(f"{path}: is a directory")
    folder = path.parent
    if not folder.is_dir():
        raise AttnRewriteError(f"{path}: folder {folder} does not exist")
    if _same_file(path, model_path):
        raise AttnRewriteError(f"{path}: the {what} would overwrite the input model")
    data_file = path.with_name(f"{path.name}.data")
    if what == "output" and data_file.is_dir():
        raise AttnRewriteError(f"{path}: its external data file {data_file.name} is a directory")
    for source in reads:
        if _same_file(path, source):
            raise AttnRewriteError(f"{path}: the {what} would overwrite the input model's external data")
        if what == "output" and _same_file(data_file, source):
            raise AttnRewriteError(f"{path}: its external data file {data_file.name} would overwrite the input model's")
    if not _can_create_in(folder):
        raise AttnRewriteError(f"{path}: folder {folder} is not writable")
    if path.exists() and not _access(path, os.W_OK):
        raise AttnRewriteError(f"{path}: not writable")


def _access(path: Path, mode: int) -> bool:
    """Whether this process (its effective ids, as for opening) may read or write `path`."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def _can_create_in(folder: Path) -> bool:
    """Try it: permission bits do not tell (root, read-only mounts, ACLs)."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".attnrewrite-probe-"):
            return True
    except OSError:
        return False


def save_model(model: ir.Model, path: str | os.PathLike) -> None:
    """Write `path` (and `<name>.data` for weights too large for one protobuf) atomically."""
    with staged_save(model, path):
        pass


@contextlib.contextmanager
def staged_save(model: ir.Model, path: str | os.PathLike) -> Iterator[Path]:
    """Write the model into a temporary folder beside `path` and yield the staged file; when
    the with-block ends without an exception, rename it (and its `<name>.data`) into place.
    On any failure `path` is left as it was. Validating the staged file rather than another
    copy means a multi-GiB model is written once."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise AttnRewriteError(f"{path}: folder {folder} does not exist")
    data_name = f"{path.name}.data" if _needs_external_data(model) else None
    try:
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=".attnrewrite-"))
    except OSError as error:
        raise AttnRewriteError(f"{path}: folder {folder} is not writable ({error.strerror or error})") from error
    try:
        staged = staging / path.name
        _write(model, staged, data_name, path)
        yield staged
        try:
            if data_name:
                os.replace(staging / data_name, folder / data_name)
            os.replace(staged, path)
        except OSError as error:
            raise RewriteFailed(f"{path}: cannot write it ({error.strerror or error})") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def saved_copy(model: ir.Model) -> Iterator[Path]:
    """The model saved to a temporary folder (for tools that need a path, like >2 GiB checks)."""
    with tempfile.TemporaryDirectory(prefix="attnrewrite-") as folder:
        path = Path(folder) / "model.onnx"
        _write(model, path, "model.onnx.data" if _needs_external_data(model) else None, path)
        yield path


def _write(model: ir.Model, path: Path, data_name: str | None, shown: Path) -> None:
    _inline_external_attributes(model)
    try:
        if data_name is None:
            ir.save(model, path)
        else:
            ir.save(model, path, external_data=data_name, **_ALIGNED)
    except OSError as error:
        raise RewriteFailed(f"{shown}: cannot write it ({error.strerror or error})") from error


# onnx_ir >= 1.1 packs external data densely unless asked to align; older versions align big
# tensors by default and have no such argument.
_ALIGNED = {"alignment": EXTERNAL_DATA_ALIGNMENT} if "alignment" in inspect.signature(ir.save).parameters else {}


def _inline_external_attributes(model: ir.Model) -> None:
    """ir.save moves initializers to the new data file but leaves tensor attributes (Constant
    nodes) pointing at the input's files, relative to a folder the output is not in; such
    attributes are small, so they go into the protobuf."""
    for graph in model.graphs():
        for node in graph:
            for name, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    node.attributes[name] = ir.AttrTensor(
                        name, ir.tensor(attr.value.numpy().copy(), name=attr.value.name)
                    )


def _needs_external_data(model: ir.Model) -> bool:
    total = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
                if isinstance(value.const_value, ir.ExternalTensor) or total > TWO_GIB // 2:
                    return True
    return False


def write_text(path: str | os.PathLike, text: str) -> None:
    """A small text file (the JSON report), written whole or not at all."""
    path = Path(path)
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".attnrewrite-", delete=False) as file:
            file.write(text)
        os.chmod(file.name, 0o666 & ~_umask())  # a temporary file is private; a report is not
        os.replace(file.name, path)
    except OSError as error:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(file.name)
        raise RewriteFailed(f"{path}: cannot write it ({error.strerror or error})") from error


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
