"""bench/profile_step.py's reading of onnxruntime's profile: what a step runs, where its kernel
time goes (the builder's nodes or the attention's) and what it writes, on a profile written by
onnxruntime for a small model and on hand-made events."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("profile_step", ROOT / "bench" / "profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def event(name: str, op: str, ts: int, dur: int, output_size: int) -> dict:
    args = {"op_name": op, "output_size": str(output_size)}
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": args}


def test_a_step_is_split_between_the_builders_nodes_and_the_attentions():
    events = [
        event("/model/layers.0/mlp/up_proj/MatMul", "MatMul", 10, 300, 4096),
        event("/model/layers.1/mlp/up_proj/MatMul", "MatMul", 20, 500, 4096),
        event("/model/layers.0/attn/GroupQueryAttention", "GroupQueryAttention", 30, 100, 2048),
        event("node_Concat_141", "Concat", 40, 60, 200_000),
        event("node_Reshape_7", "Reshape", 50, 5, 200_000),  # a view: nothing written
        event("If_3", "If", 60, 900, 0),  # its branch's nodes are listed themselves
    ]
    summary = profile_step.summarise(profile_step.node_events(events, 0), calls=2)
    assert summary["nodes"] == 5 / 2
    assert summary["builder_ms"] == 0.8 / 2 and summary["attention_ms"] == 0.165 / 2
    assert summary["bytes_written"] == (4096 * 2 + 2048 + 200_000) / 2
    assert summary["large_writes"] == 1 / 2
    first = summary["by_time"][0]
    assert (first["op"], first["node"], first["per_call"]) == ("MatMul", "/model/layers.L/mlp/up_proj/MatMul", 1.0)
    assert summary["by_bytes"][0]["node"] == "node_Concat_#"
    assert profile_step.node_events(events, 45) == [events[4]]


def test_a_profile_onnxruntime_writes_is_read_per_call(tmp_path):
    """Three calls of a two-node model: two nodes a call, each writing its [4, 256] output."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])
    nodes = [
        helper.make_node("Add", ["x", "x"], ["t"], name="add"),
        helper.make_node("Mul", ["t", "x"], ["y"], name="mul"),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(3):
        session.run(None, {"x": np.ones((4, 256), np.float32)})
    events = json.loads(Path(session.end_profiling()).read_text())
    summary = profile_step.summarise(profile_step.node_events(events, 0), calls=3)
    assert summary["nodes"] == 2
    assert summary["bytes_written"] == 2 * 4 * 256 * 4
    assert summary["builder_ms"] == 0 and summary["attention_ms"] > 0
    assert {row["node"] for row in summary["by_time"]} == {"add", "mul"}
