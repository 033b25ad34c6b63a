"""The two frontends decide alike: a torch model rewritten through torch.fx and its ONNX export
rewritten through the ONNX frontend give the same sites (layer numbers and mask kinds), the same
statuses and the same reasons, refusals included: a method that cannot express the mask, a
layer selection, a single query, an attention bias. attnrewrite.decision makes the decisions;
this checks that both frontends hand it the same sites and report what it says unchanged.

Exports are TorchScript (legacy) ones, the fastest; nn.TransformerEncoder's at its traced shape,
the only one that exporter writes for it (tests/test_corpus.py "nn-transformer").
"""

from __future__ import annotations

import warnings

import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from conftest import exported
from models import EXPORT_SEQ, HEADS
from torch import nn

from attnrewrite.decision import SINGLE_QUERY
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.onnx.rewrite import rewrite_model
from attnrewrite.site import ATTENTION_BIAS

LINFORMER_CAUSAL = "Linformer mixes every position into each projected key, so a causal mask cannot be expressed"


def not_selected(layer: int) -> str:
    return f"layer {layer} is not among the selected layers"


def decisions(record: dict) -> list[tuple]:
    return [(s["layer"], s["mask"], s["status"], s["reason"]) for s in record["sites"]]


def through_onnx(path, method: str, **kwargs) -> list[tuple]:
    _, record = rewrite_model(ir.load(str(path)), method, **kwargs)
    return decisions(record.as_dict())


def through_fx(module: nn.Module, args: tuple, method: str, **kwargs) -> list[tuple]:
    with warnings.catch_warnings():  # torch.export's deprecation notes on transformers models
        warnings.simplefilter("ignore")
        gm = rewrite_graph_module(module, method, example_inputs=args, **kwargs)
    return decisions(gm.meta["attnrewrite"])


def every_layer(mask: str, status: str, reason: str | None = None, layers: int = 2) -> list[tuple]:
    return [(layer, mask, status, reason) for layer in range(layers)]


# (model in tests/models.py, export with dynamic axes, method, rewrite arguments, what both must say)
CASES = [
    ("bert-eager", True, "hydra", {}, every_layer("key_padding", "rewritten")),
    (
        "bert-sdpa",
        True,
        "linear",
        {"layers": [1]},
        [(0, "key_padding", "skipped", not_selected(0)), (1, "key_padding", "rewritten", None)],
    ),
    ("vit", True, "favor", {"features": 16}, every_layer("none", "rewritten")),
    ("gpt2", True, "linformer", {}, every_layer("causal+key_padding", "skipped", LINFORMER_CAUSAL)),
    (
        "gpt2-eager",
        True,
        "hydra",
        {"layers": [0]},
        [(0, "causal+key_padding", "rewritten", None), (1, "causal+key_padding", "skipped", not_selected(1))],
    ),
    ("torch-encoder-causal", False, "linformer", {}, every_layer("causal", "skipped", LINFORMER_CAUSAL)),
    ("torch-encoder-padded", False, "linear", {}, every_layer("key_padding", "rewritten")),
    # a relative position bias on the logits: refused whatever the method
    ("t5-encoder-eager", True, "hydra", {}, every_layer("bias", "skipped", ATTENTION_BIAS)),
    # encoder self-attention, then per decoder layer self-attention (causal) and cross-attention:
    # both number sites in graph order, so one selection means the same sites
    (
        "bart",
        True,
        "hydra",
        {"layers": [1, 3]},
        [
            (0, "key_padding", "skipped", not_selected(0)),
            (1, "key_padding", "rewritten", None),
            (2, "causal", "skipped", not_selected(2)),
            (3, "key_padding", "rewritten", None),
            (4, "causal", "skipped", not_selected(4)),
            (5, "key_padding", "skipped", not_selected(5)),
        ],
    ),
]


@pytest.mark.parametrize(("name", "dynamic", "method", "kwargs", "expected"), CASES, ids=[case[0] for case in CASES])
def test_same_sites_statuses_and_reasons(exports, name, dynamic, method, kwargs, expected):
    export = exported(exports, name, "legacy", dynamic)
    args = tuple(export.spec.inputs()[n] for n in export.spec.input_names)
    assert through_onnx(export.path, method, **kwargs) == expected
    assert through_fx(export.module, args, method, **kwargs) == expected


class DecoderStep(nn.Module):
    """One query attending to the keys and values so far (a decoder step with a cache)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_a_single_query_is_left_exact_unless_included(tmp_path):
    generator = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(2, HEADS, n, 8, generator=generator) for n in (1, EXPORT_SEQ, EXPORT_SEQ))
    path = tmp_path / "step.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(DecoderStep(), args, str(path), input_names=["q", "k", "v"], dynamo=False)

    kept = [(0, "none", "skipped", SINGLE_QUERY)]
    assert through_onnx(path, "linear") == through_fx(DecoderStep(), args, "linear") == kept
    included = [(0, "none", "rewritten", None)]
    assert through_onnx(path, "linear", include_single_query=True) == included
    assert through_fx(DecoderStep(), args, "linear", include_single_query=True) == included


def test_layer_numbers_hold_when_a_model_is_rewritten_in_steps(exports):
    """Sites an earlier run replaced still count, so the second run's selection means the same."""
    export = exported(exports, "gpt2-eager", "legacy", True)
    args = tuple(export.spec.inputs()[n] for n in export.spec.input_names)
    first, _ = rewrite_model(ir.load(str(export.path)), "hydra", layers=[0])
    _, second = rewrite_model(first, "linear", layers=[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = rewrite_graph_module(export.module, "hydra", layers=[0], example_inputs=args)
    again = rewrite_graph_module(gm, "linear", layers=[0, 1])
    expected = [(1, "causal+key_padding", "rewritten", None)]
    assert decisions(second.as_dict()) == decisions(again.meta["attnrewrite"]) == expected
