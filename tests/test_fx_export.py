"""A rewritten GraphModule exports with torch.onnx.export(dynamo=True) and runs on onnxruntime
with the outputs it has in torch; and the two frontends agree: rewriting in FX then exporting
gives what exporting then rewriting the ONNX model gives, for the same model and options.

ONNX exports take seconds each: every test here exports as little as it can.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import numpy as np
import pytest
import torch
from test_fx_spellings import Attention, causal_and_padding_where, inputs
from test_fx_torch_modules import Encoder, padding, sequence
from test_fx_transformers import build, exported, model_inputs

import attnrewrite
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.record import METADATA_KEY

onnxruntime = pytest.importorskip("onnxruntime")


def to_onnx(model: torch.nn.Module, args: tuple, names: list[str], dynamic_shapes=None):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, args, input_names=names, dynamic_shapes=dynamic_shapes, dynamo=True, verbose=False
        )
    return program.model_proto


def run_onnx(model, names: list[str], args: tuple) -> np.ndarray:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {name: a.numpy() for name, a in zip(names, args)})[0]


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def torch_output(gm, args) -> np.ndarray:
    with torch.no_grad():
        return gm(*args).numpy()


def test_hand_written_attention_exports_with_dynamic_shapes():
    """The key_keep computed in the graph and the causal prefix sums follow the input sizes.
    (hydra: linear's chunked causal kernel specialises on its number of chunks under export.)"""
    gm = rewrite_graph_module(Attention(causal_and_padding_where, "keep").eval(), "hydra")
    names = ["x", "mask"]
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    shapes = {"x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}
    model = to_onnx(gm, inputs("keep"), names, dynamic_shapes=shapes)
    for batch_size, length in ((2, 7), (3, 12)):
        args = inputs("keep", batch=batch_size, seq=length)
        assert relative_error(run_onnx(model, names, args), torch_output(gm, args)) < 1e-5


def test_transformer_encoder_exports():
    """nn.TransformerEncoder as rewritten (its slow path, the causal mask proven at rewrite time)
    exports, where the original with is_causal=None cannot be traced by torch.export."""
    gm = rewrite_graph_module(Encoder("detected", padded=True).eval(), "hydra")
    args = (sequence(), padding())
    model = to_onnx(gm, args, ["x", "padding"])
    assert relative_error(run_onnx(model, ["x", "padding"], args), torch_output(gm, args)) < 1e-5


@pytest.mark.parametrize(("name", "attention", "method"), [("bert", "sdpa", "hydra"), ("gpt2", "eager", "linear")])
def test_fx_then_export_equals_export_then_onnx_rewrite(name, attention, method):
    names = ["input_ids", "attention_mask"]
    args = model_inputs(name)
    fx = rewrite_graph_module(exported(name, attention), method)
    fx_onnx = to_onnx(fx, args, names)
    from_fx = run_onnx(fx_onnx, names, args)
    assert relative_error(from_fx, torch_output(fx, args)) < 1e-5  # export parity

    onnx_rewritten = attnrewrite.rewrite(to_onnx(build(name, attention), args, names), to=method)
    from_onnx = run_onnx(onnx_rewritten, names, args)
    assert relative_error(from_fx, from_onnx) < 1e-5  # cross-frontend parity

    onnx_record = json.loads({p.key: p.value for p in onnx_rewritten.metadata_props}[METADATA_KEY])

    def summary(record):
        return [(s["status"], s["mask"], s["num_heads"], round(s["scale"], 6)) for s in record["sites"]]

    assert summary(fx.meta[METADATA_KEY]) == summary(onnx_record)
    assert fx.meta[METADATA_KEY]["options"] == onnx_record["options"]


def test_mask_threshold_is_one_for_both_frontends():
    from attnrewrite import site
    from attnrewrite.fx import masks as fx_masks
    from attnrewrite.onnx import masks as onnx_masks

    assert fx_masks.MASKED_BELOW is onnx_masks.MASKED_BELOW is site.MASKED_BELOW
