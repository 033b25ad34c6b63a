"""Key/value heads shared by several query heads: multi-query attention (Falcon: one key/value
head that the attention's MatMuls broadcast) and grouped-query attention (Llama: repeat_kv, or
SDPA's enable_gqa in torch.fx). Every method gets one key/value head per query head (the
splices expand them, passes.layout.expand_to_query_heads in torch), so every method rewrites these
sites (Linformer refuses them as causal, with its reason) and matches its torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import exported, read_record
from models import (
    APPROXIMATING_OPTIONS,
    CAUSAL_REFUSED,
    EXPORTERS,
    GROUPED_HEAD_MODELS,
    attention_operator_model,
    relative_error,
    run_onnx,
    run_pass_module,
    torch_reference,
)
from test_onnx_exports import attention_inputs
from torch import nn

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import find_fx_sites

TOLERANCE = 1e-5
METHODS = {"hydra": {}, "linear": {}, **APPROXIMATING_OPTIONS}
CASES = [
    pytest.param(name, exporter, id=f"{name}-{exporter}") for name in GROUPED_HEAD_MODELS for exporter in EXPORTERS
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name, exporter", CASES)
def test_every_method_rewrites_shared_key_value_heads_and_matches_torch(exports, name, exporter, method):
    export = exported(exports, name, exporter)
    spec = export.spec
    method_pass = passes.get_pass(method)
    options = passes.make_options(method_pass, **METHODS[method])
    model = attnrewrite.rewrite(export.load(), to=method, **METHODS[method])
    record = read_record(model)

    if method in CAUSAL_REFUSED:  # causal: refused up front, with the method's own reason
        reason = method_pass.supports(attnrewrite.find_sites(export.load())[0], options)
        assert "causal" in reason
        assert [(s["status"], s["reason"]) for s in record["sites"]] == [("skipped", reason)] * spec.layers
        return
    assert [(s["status"], s["mask"]) for s in record["sites"]] == [("rewritten", spec.mask)] * spec.layers

    inputs = export.parity_inputs()
    expected, state = torch_reference(export, method, inputs, options=options)
    assert state["calls"] == spec.layers
    assert relative_error(run_onnx(model, inputs), expected) < TOLERANCE


class GroupedQuerySdpa(nn.Module):
    """4 query heads over 2 key/value heads, by SDPA's enable_gqa; causal."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("method", ["hydra", "linear", "lsh"])
def test_fx_sdpa_with_enable_gqa_is_rewritten_with_repeated_key_value_heads(method):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=generator)
    k, v = (torch.randn(2, 2, 9, 8, generator=generator) for _ in range(2))
    options = {"lsh": {"n_buckets": 4, "chunk": 4}}.get(method, {})
    gm = attnrewrite.rewrite(GroupedQuerySdpa(), to=method, example_inputs=(q, k, v), **options)
    record = gm.meta["attnrewrite"]
    assert [(s["status"], s["mask"]) for s in record["sites"]] == [("rewritten", "causal")]

    site = find_fx_sites(GroupedQuerySdpa(), example_inputs=(q, k, v))[0]
    method_pass = passes.get_pass(method)
    module = method_pass.torch_module(site, passes.make_options(method_pass, **options))
    # query head h reads key/value head h // 2
    repeated = [x.repeat_interleave(2, dim=1).numpy() for x in (k, v)]
    expected = run_pass_module(module, q.numpy(), *repeated, None)
    with torch.no_grad():
        assert relative_error(gm(q, k, v).numpy(), expected) < TOLERANCE


@pytest.mark.parametrize("causal", [False, True], ids=["key_padding", "causal+key_padding"])
@pytest.mark.parametrize("method", ["hydra", "linear", "favor", "lsh"])
def test_attention_operator_with_grouped_key_value_heads(method, causal):
    """The ONNX Attention op with kv_num_heads 2 < q_num_heads 4."""
    model = attention_operator_model(heads=4, kv_heads=2, causal=causal)
    options = {"favor": {"features": 32}, "lsh": {"n_buckets": 4, "chunk": 4}}.get(method, {})
    out = attnrewrite.rewrite(model, to=method, **options)
    assert [s["status"] for s in read_record(out)["sites"]] == ["rewritten"]

    q, k, v, attention_mask = attention_inputs(heads=4)
    k, v = k[:, :2], v[:, :2]
    (site,) = attnrewrite.find_sites(model)
    method_pass = passes.get_pass(method)
    module = method_pass.torch_module(site, passes.make_options(method_pass, **options))
    keep = attention_mask[:, None, :, None].float().numpy()
    expected = run_pass_module(module, q.numpy(), *(x.repeat_interleave(2, dim=1).numpy() for x in (k, v)), keep)
    feeds = {"q": q, "k": k, "v": v, "attention_mask": attention_mask}
    assert relative_error(run_onnx(out, feeds), expected) < TOLERANCE


def test_grouped_heads_are_the_ones_the_attention_operator_reads():
    """Linformer with every key kept (9 keys <= proj_dim) is exact attention: equal to what
    onnxruntime's Attention computes, so the repeated heads are grouped as the operator groups them."""
    model = attention_operator_model(heads=4, kv_heads=2)
    out = attnrewrite.rewrite(model, to="linformer")
    assert [s["status"] for s in read_record(out)["sites"]] == ["rewritten"]
    q, k, v, attention_mask = attention_inputs(heads=4, seq=9)
    feeds = {"q": q, "k": k[:, :2], "v": v[:, :2], "attention_mask": attention_mask}
    assert relative_error(run_onnx(out, feeds), run_onnx(model, feeds)) < TOLERANCE
