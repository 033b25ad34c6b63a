"""The fused-exact baseline of attnrewrite bench (attnrewrite/fused.py): onnxruntime's
transformers optimizer where it fuses every site, opset-23 Attention otherwise, each equal to
the original model; and the bench column it makes, measured on the CPU provider."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from attention_graphs import AttentionSpec, build_attention_model
from models import load_bench_module, relative_error

from attnrewrite import fused as fused_module
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.rewrite import analyze

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"


def _sites(model) -> list[str]:
    return [s.site.name for s in analyze(onnx_io.infer_shapes(model)) if s.site.skip_reason is None]


def _fuse(path: Path, fp16: bool = False) -> fused_module.FusedModel:
    return fused_module.fused_exact_attention(onnx_io.load_model(path), _sites(onnx_io.load_model(path)), fp16)


def _outputs(path: Path, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_equal_to_original(original: Path, fused: fused_module.FusedModel, tmp_path: Path, seq: int = 24):
    onnx_io.save_model(fused.model, tmp_path / "fused.onnx")
    feeds = generate_inputs(onnx_io.load_model(original).graph, seq=seq, seed=1)
    for want, got in zip(_outputs(original, feeds), _outputs(tmp_path / "fused.onnx", feeds)):
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(),
        AttentionSpec(mask="causal"),
        AttentionSpec(mask="key_padding"),
        AttentionSpec(layout="3d", mask="key_padding", scale_op="Div"),
        AttentionSpec(layout="3d", mask="causal"),
    ],
    ids=["plain", "causal", "key_padding", "3d-key_padding", "3d-causal"],
)
def test_attention23_equals_the_softmax_graph(spec, tmp_path):
    path = tmp_path / "attention.onnx"
    onnx.save(build_attention_model(spec), path)
    fused = _fuse(path)
    assert fused.how.startswith("opset-23 Attention x1 (onnxruntime.transformers.optimizer: ")
    ops = [n.op_type for n in fused.model.graph]
    assert "Softmax" not in ops and sum(op.startswith("ExactAttention") for op in ops) == 1
    [body] = fused.model.functions.values()
    assert [n.op_type for n in body if n.op_type == "Attention"] == ["Attention"]
    _assert_equal_to_original(path, fused, tmp_path)


@pytest.fixture(scope="module")
def bert_layer(tmp_path_factory) -> Path:
    """bench/models.py's BERT encoder (what the benchmark measures), 2 small layers."""
    return load_bench_module("models").export_encoder(
        tmp_path_factory.mktemp("layer") / "layer.onnx", hidden=32, heads=4, layers=2
    )


def test_the_optimizer_fuses_a_bert_layer(bert_layer, tmp_path):
    fused = _fuse(bert_layer)
    assert fused.how == "onnxruntime.transformers.optimizer: com.microsoft.Attention x2"
    ops = {(n.domain, n.op_type) for n in fused.model.graph}
    assert ("com.microsoft", "Attention") in ops and ("", "Softmax") not in ops
    _assert_equal_to_original(bert_layer, fused, tmp_path)


def test_the_optimizers_fp16_model_is_float16_throughout(bert_layer):
    fused = _fuse(bert_layer, fp16=True)
    assert fused.already_fp16 and fused.how.endswith(", float16 by onnxruntime's converter")
    assert [v.dtype.name for v in (*fused.model.graph.inputs, *fused.model.graph.outputs)] == ["FLOAT16", "FLOAT16"]


def test_a_fusion_that_changes_the_outputs_is_not_used(tmp_path):
    """The optimizer's fusion of the sample reads the mask as lengths (right padding); the
    generated inputs pad on both sides, so its model is refused and Attention-23 taken."""
    fused = _fuse(SAMPLE)
    assert fused.how.startswith(
        "opset-23 Attention x2 (onnxruntime.transformers.optimizer: its fused model disagrees with the original (relative error"
    )
    _assert_equal_to_original(SAMPLE, fused, tmp_path, seq=16)


def test_no_fusion_is_a_clear_error(monkeypatch):
    def unsupported(model, names):
        raise fused_module.Unsupported("a reason")

    monkeypatch.setattr(fused_module, "_attention23", unsupported)
    with pytest.raises(
        AttnRewriteError,
        match=r"^no fused exact attention for this model: a reason; onnxruntime.transformers.optimizer: ",
    ):
        _fuse(SAMPLE)


def test_bench_fused_column_on_cpu(tmp_path, capsys):
    path = tmp_path / "attention.onnx"
    onnx.save(build_attention_model(AttentionSpec()), path)
    report = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            str(path),
            "--to",
            "linear",
            "--fused",
            "--lengths",
            "16",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            str(report),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(report.read_text())
    assert set(data["series"]) == {"original", "rewritten", "identity", "fused"}
    [m] = data["series"]["fused"]
    assert m["status"] == "ok" and m["median_s"] > 0
    assert data["fused"].startswith("opset-23 Attention x1")
    assert data["crossover_fused"] in (None, 16)
    assert "fused exact ms" in out and "vs fused" in out
    assert (
        "crossover: linear is faster than fused exact attention from N = 16 on" in out
        or "crossover: linear is not faster than fused exact attention beyond the measured spread at any length" in out
    )


def test_an_opset_23_model_is_left_untouched_and_checked_against(tmp_path):
    path = tmp_path / "attention.onnx"
    onnx.save(build_attention_model(AttentionSpec(opset=23)), path)
    original = onnx_io.load_model(path)
    fused = fused_module.fused_exact_attention(original, _sites(onnx_io.load_model(path)))
    assert fused.model is not original
    assert "Softmax" in [n.op_type for n in original.graph] and "Softmax" not in [n.op_type for n in fused.model.graph]
    _assert_equal_to_original(path, fused, tmp_path)
