"""io.infer_shapes past onnxruntime's com.microsoft operators: onnxruntime's symbolic shape
inference runs through private methods of SymbolicShapeInference, only on the releases where
they are known and present; elsewhere the rewrite goes on with ONNX shape inference's shapes and
its record notes why."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import read_record
from onnx import TensorProto, helper
from onnxruntime.tools import symbolic_shape_infer

import attnrewrite
from attnrewrite.onnx import io

BATCH, SEQ, HIDDEN = 2, 5, 8


def attention_then_contrib_gelu() -> onnx.ModelProto:
    """One softmax attention over x (shapes ONNX infers), its output through com.microsoft.Gelu
    (a shape ONNX cannot infer)."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), name)
        for name in ("wq", "wk", "wv")
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["attended"]),
        helper.make_node("Gelu", ["attended"], ["y"], domain="com.microsoft"),
    ]
    scale = onnx.numpy_helper.from_array(np.array(HIDDEN**-0.5, np.float32), "scale")
    graph = helper.make_graph(
        nodes,
        "attention_then_gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [*weights, scale],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def rewritten_notes(model: onnx.ModelProto) -> list[str]:
    record = read_record(attnrewrite.rewrite(model, to="linear"))
    assert [site["status"] for site in record["sites"]] == ["rewritten"], record["sites"]
    return [note for note in record.get("notes", []) if note.startswith("shape inference:")]


def test_symbolic_shape_inference_types_the_contrib_operator_and_notes_nothing():
    inferred = io.infer_shapes(io.from_proto(attention_then_contrib_gelu()))
    gelu = next(node for node in inferred.graph if node.op_type == "Gelu")
    assert gelu.outputs[0].shape is not None
    assert io.shape_notes(inferred) == []
    assert rewritten_notes(attention_then_contrib_gelu()) == []


def test_without_the_private_methods_the_rewrite_goes_on_and_its_record_says_why(monkeypatch):
    monkeypatch.delattr(symbolic_shape_infer.SymbolicShapeInference, "_infer_impl")
    (note,) = rewritten_notes(attention_then_contrib_gelu())
    assert "SymbolicShapeInference has no _infer_impl" in note
    assert "the shapes past com.microsoft operators are ONNX shape inference's" in note


@pytest.mark.parametrize("version", ["1.19.2", "1.99.0", "2.0.0.dev20300101"])
def test_an_onnxruntime_release_outside_the_known_ones_is_not_trusted_with_them(monkeypatch, version):
    monkeypatch.setattr("onnxruntime.__version__", version)
    (note,) = rewritten_notes(attention_then_contrib_gelu())
    first, last = io.SYMBOLIC_INFERENCE_RELEASES
    assert f"is not used with onnxruntime {version}" in note
    assert f"known in {first[0]}.{first[1]} to {last[0]}.{last[1]}" in note


def test_a_failing_symbolic_inference_is_noted(monkeypatch):
    def fails(self):
        raise RuntimeError("cannot infer Gelu")

    monkeypatch.setattr(symbolic_shape_infer.SymbolicShapeInference, "_infer_impl", fails)
    (note,) = rewritten_notes(attention_then_contrib_gelu())
    assert "symbolic shape inference failed (cannot infer Gelu)" in note
