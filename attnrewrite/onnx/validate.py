"""Validation gates every rewritten model passes before it is written (DESIGN.md):
the full ONNX check, an onnxruntime session, and a run on inputs of the original signature."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from attnrewrite.errors import RewriteFailed
from attnrewrite.onnx import bfloat16
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.io import saved_copy


def validate(model: ir.Model, seq: int = 16) -> list[np.ndarray]:
    """Raise RewriteFailed naming the failed gate; return the outputs of the test run."""
    with saved_copy(model) as path:
        return validate_saved(path, model.graph, seq)


def validate_saved(path, graph: ir.Graph, seq: int = 16) -> list[np.ndarray]:
    """The gates on a model already written to `path` (the CLI's staged output: checking the
    file that will be renamed into place, and writing big weights only once); `graph` is the
    in-memory graph it was written from, for the input signature."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:
        raise RewriteFailed(f"rewritten model fails the ONNX checker: {_first_line(error)}") from error
    try:
        session = make_session(str(path))
    except Exception as error:
        raise RewriteFailed(f"onnxruntime cannot load the rewritten model: {_first_line(error)}") from error
    try:
        return bfloat16.run(session, generate_inputs(graph, seq=seq))
    except Exception as error:
        raise RewriteFailed(f"the rewritten model fails to run on generated inputs: {_first_line(error)}") from error


def input_fails(path, graph: ir.Graph, seq: int = 16) -> str | None:
    """Why the input model itself cannot load or run on the inputs the gates generate, or None.
    Asked when the rewritten model fails them: a model that never ran is bad input, and the
    rewrite must not take the blame."""
    try:
        bfloat16.run(make_session(str(path)), generate_inputs(graph, seq=seq))
    except Exception as error:
        return _first_line(error)
    return None


def make_session(model_or_path, providers=("CPUExecutionProvider",), threads: int | None = None):
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures come back as exceptions with the same text
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model_or_path, options, providers=list(providers))


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
