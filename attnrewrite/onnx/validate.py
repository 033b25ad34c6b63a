"""Validation gates every rewritten model passes before it is written (docs/ARCHITECTURE.md, "Gates and records"):
the full ONNX check, an onnxruntime session, and a run on inputs of the original signature."""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from attnrewrite.errors import InputFails, RewriteFailed
from attnrewrite.onnx import bfloat16
from attnrewrite.onnx.inputs import first_that_runs, generate_inputs, searched_lengths
from attnrewrite.onnx.io import check_graph, saved_copy
from attnrewrite.passes.lowering import MICROSOFT

DEFAULT_SEQ = 16  # generated inputs' length when the user gives none
GATE_BATCH = 2  # generate_inputs' batch


@dataclasses.dataclass
class GateRun:
    outputs: list[np.ndarray]  # of the rewritten model's test run
    note: str | None = None  # set when the run needed longer inputs than asked for


def validate(
    model: ir.Model, seq: int = DEFAULT_SEQ, original=None, feeds: dict[str, np.ndarray] | None = None
) -> GateRun:
    """Raise RewriteFailed naming the failed gate (InputFails when ``original`` itself fails
    the run); see validate_saved."""
    with saved_copy(model) as path:
        return validate_saved(path, model.graph, seq, original, feeds)


def validate_saved(
    path, graph: ir.Graph, seq: int = DEFAULT_SEQ, original=None, feeds: dict[str, np.ndarray] | None = None
) -> GateRun:
    """The gates on a model already written to `path` (the CLI's staged output: checking the
    file that will be renamed into place, and writing big weights only once); `graph` is the
    in-memory graph it was written from, for the input signature.

    The run gate uses ``feeds``, or inputs generated at length ``seq``. ``original`` (the input
    model: a path, a ModelProto or its bytes) is run only when the rewritten model fails: if it fails
    too, the input is to blame (InputFails); if it runs only on longer generated inputs (a
    convolutional front end), the rewritten model is run on the shortest of those instead."""
    try:
        check_graph(onnx.load_model(str(path), load_external_data=False))
    except Exception as error:
        raise RewriteFailed(f"rewritten model fails the ONNX checker: {_first_line(error)}") from error
    try:
        session = make_session(str(path))
    except Exception as error:
        raise RewriteFailed(f"onnxruntime cannot load the rewritten model: {_first_line(error)}") from error
    which = "the given inputs" if feeds is not None else "generated inputs"
    try:
        return GateRun(
            bfloat16.run(session, feeds if feeds is not None else generate_inputs(graph, batch=GATE_BATCH, seq=seq))
        )
    except Exception as error:
        failure = RewriteFailed(f"the rewritten model fails to run on {which}: {_first_line(error)}")
        failure.__cause__ = error
    if original is None:
        raise failure
    length = _length_the_original_runs_at(original, graph, seq, feeds)
    if length == seq or feeds is not None:
        raise failure
    try:
        outputs = bfloat16.run(session, generate_inputs(graph, batch=GATE_BATCH, seq=length))
    except Exception as error:
        raise RewriteFailed(
            f"the rewritten model fails to run on generated inputs of length {length}: {_first_line(error)}"
        ) from error
    return GateRun(
        outputs, f"the original model does not run on generated inputs of length {seq}; validated at length {length}"
    )


def _length_the_original_runs_at(original, graph: ir.Graph, seq: int, feeds) -> int:
    """The first searched length (``seq`` doubled, then the lengths the rewritten ``graph``'s
    constants hold) of inputs generated for ``original``'s own signature (a recurrent rewrite
    carries other values) that it runs on, or ``seq`` when it runs on ``feeds``; InputFails when
    there is none, naming the shapes tried."""
    shown = f"{os.fspath(original)}: " if isinstance(original, (str, os.PathLike)) else ""
    if isinstance(original, onnx.ModelProto):
        original = original.SerializeToString()
    try:
        session = make_session(os.fspath(original) if isinstance(original, os.PathLike) else original)
        if feeds is not None:
            bfloat16.run(session, feeds)
            return seq
        own = _graph_of(original)
        return first_that_runs(
            lambda n: bfloat16.run(session, generate_inputs(own, batch=GATE_BATCH, seq=n)), seq, graph
        )[0]
    except Exception as error:
        if feeds is not None:
            raise InputFails(
                f"{shown}the input model itself fails on the given inputs: {_first_line(error)}"
            ) from error
        raise InputFails(
            f"{shown}the input model itself fails on generated inputs of batch {GATE_BATCH} and every length tried "
            f"({_lengths_tried(seq, graph)}): {_first_line(error)}; "
            "give inputs it runs on with --inputs, or their length with --seq"
        ) from error


def _graph_of(original: str | os.PathLike | bytes) -> ir.Graph:
    """The graph of a model file or its bytes, its weights left where they are."""
    if isinstance(original, bytes):
        return ir.serde.deserialize_model(onnx.load_model_from_string(original)).graph
    return ir.serde.deserialize_model(onnx.load_model(os.fspath(original), load_external_data=False)).graph


def _lengths_tried(seq: int, graph: ir.Graph) -> str:
    doubled = searched_lengths(seq)
    constants = searched_lengths(seq, graph)[len(doubled) :]
    said = f"{seq} to {doubled[-1]}, doubling" if len(doubled) > 2 else ", ".join(map(str, doubled))
    return f"{said}, then {', '.join(map(str, constants))}" if constants else said


@functools.cache
def runs_linear_attention() -> bool:
    """Whether the installed onnxruntime runs ``com.microsoft.LinearAttention`` (1.25 and later):
    a recurrent decoding step then updates and reads its kernel state with that one node."""
    q = onnx.helper.make_tensor_value_info("q", onnx.TensorProto.FLOAT, [1, 1, 2])
    state = onnx.helper.make_tensor_value_info("state", onnx.TensorProto.FLOAT, [1, 1, 2, 2])
    out = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("out", "present")]
    node = onnx.helper.make_node(
        "LinearAttention",
        ["q", "q", "q", "state"],
        ["out", "present"],
        domain=MICROSOFT,
        q_num_heads=1,
        kv_num_heads=1,
        update_rule="linear",
        scale=1.0,
    )
    graph = onnx.helper.make_graph([node], "linear_attention", [q, state], out)
    opsets = [onnx.helper.make_opsetid("", 20), onnx.helper.make_opsetid(MICROSOFT, 1)]
    try:
        session = make_session(onnx.helper.make_model(graph, opset_imports=opsets).SerializeToString())
        session.run(None, {"q": np.ones((1, 1, 2), np.float32), "state": np.zeros((1, 1, 2, 2), np.float32)})
    except Exception:  # an older onnxruntime, or one built without contrib operators
        return False
    return True


def make_session(model_or_path, providers=("CPUExecutionProvider",), threads: int | None = None, arena: bool = True):
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures come back as exceptions with the same text
    options.enable_cpu_mem_arena = arena
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model_or_path, options, providers=list(providers))


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
