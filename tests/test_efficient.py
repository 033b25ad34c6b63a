"""Efficient Attention (attnrewrite/passes/efficient.py): ONNX lowering == torch module == the
paper's formula written densely (softmax over each query's features times softmax over the
keys' sequence, per feature), on every mask kind; padded keys out of the key softmax; the
causal form's running normaliser; refusals; calibration; both frontends on exported models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_graphs import lowering_model, lowering_session
from conftest import exported, read_record
from models import (
    fx_rewrite_of_bert,
    module_state,
    moved_off_initial,
    padded_at_both_ends,
    relative_error,
    run_onnx,
    run_pass_module,
    torch_reference,
)

import attnrewrite
from attnrewrite import passes
from attnrewrite.passes import efficient, fit, recurrent
from attnrewrite.site import AttentionSite, MaskKind

B, H, D, DV = 2, 3, 8, 6
CHUNK = 4
OPSET = 20
MASKS = [MaskKind.NONE, MaskKind.KEY_PADDING, MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING]


def make_site(mask=MaskKind.KEY_PADDING, rank=4, scale=0.5) -> AttentionSite:
    heads = H if rank == 4 else None
    return AttentionSite("layer0", scale=scale, mask=mask, rank=rank, num_heads=heads, head_dim=D, value_dim=DV)


def fitted(site, options, seed=0) -> efficient.EfficientAttention:
    return moved_off_initial(efficient.torch_module(site, options, learnable=True), seed).eval()


def inputs(n, lead=(B, H), padding=True, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (2 * rng.standard_normal((*lead, n, D)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((*lead, n, DV)).astype(np.float32)
    keep = padded_at_both_ends(lead, n) if padding else np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    return q, k, v, keep


def paper_formula(module, q, k, v, keep, causal: bool) -> np.ndarray:
    """weights[i, j] = sum_c softmax(query_scale * q_i)_c * softmax over allowed j of
    exp(key_scale * k_jc), then weights @ v: the N x N form, float64."""
    values = {name: value.detach().double() for name, value in module.state_dict().items()}
    q, k, v = (torch.from_numpy(x).double() for x in (q, k, v))
    n = k.shape[-2]
    query_softmax = torch.softmax(q * values["query_scale"], dim=-1)
    allowed = torch.tril(torch.ones(n, n)) if causal else torch.ones(n, n)
    key_terms = allowed.double()[..., None] * torch.exp(k * values["key_scale"]).unsqueeze(-3)  # [.., i, j, c]
    if keep is not None:
        key_terms = key_terms * torch.from_numpy(keep).double().unsqueeze(-3)
    key_softmax = key_terms / key_terms.sum(-2, keepdim=True).clamp_min(1e-300)  # a row without keys: 0
    weights = (query_softmax.unsqueeze(-2) * key_softmax).sum(-1)  # [.., i, j]
    return (weights @ v).numpy()


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_onnx_equals_torch_equals_the_formula(mask, rank):
    site, options = make_site(mask, rank), efficient.Options(chunk=CHUNK)
    module = fitted(site, options)
    session = lowering_session(efficient.onnx_lowering(site, options, OPSET, module_state(module)), rank)
    lead = (B, H) if rank == 4 else (B * H,)
    for n in (1, 3, 5, 11, 12):
        q, k, v, keep = inputs(n, lead, padding=mask.key_padding)
        keep_or_none = keep if mask.key_padding else None
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        expected = run_pass_module(module, q, k, v, keep_or_none)
        assert out.shape == (*lead, n, DV)
        assert relative_error(out, expected) < 1e-5, n
        assert relative_error(expected, paper_formula(module, q, k, v, keep_or_none, mask.causal)) < 1e-5, n


def test_weights_over_keys_sum_to_one_and_padded_keys_get_none():
    # v = identity rows: the output is the weights themselves
    n = 7
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    module = efficient.torch_module(site, efficient.Options(chunk=CHUNK))
    q, k, _, keep = inputs(n)
    v = np.broadcast_to(np.eye(n, dtype=np.float32), (B, H, n, n)).copy()
    with torch.no_grad():
        weights = module(*(torch.from_numpy(x) for x in (q, k, v, keep))).numpy()
    np.testing.assert_allclose(weights[0].sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(weights[1, :, 1:].sum(-1), 1.0, rtol=1e-6)
    assert not weights[1, :, 0].any()  # its only key so far is padded
    assert not weights[1, :, :, keep[1, 0, :, 0] == 0].any()
    assert not np.triu(weights, 1).any()  # causal


def test_large_logits_stay_finite_and_the_stabiliser_cancels():
    site = make_site(MaskKind.CAUSAL, scale=1.0)
    module = efficient.torch_module(site, efficient.Options(chunk=CHUNK))
    q, k, v, _ = inputs(9, padding=False)
    out = run_pass_module(module, q, k * 100, v, None)
    assert np.isfinite(out).all()
    assert relative_error(out, run_pass_module(module, q, k * 100 + 50, v, None)) < 1e-5


def test_no_cumsum_along_positions():
    lowering = efficient.onnx_lowering(make_site(MaskKind.CAUSAL_KEY_PADDING), efficient.Options(), OPSET)
    assert not [n for f in lowering_model(lowering, 4).functions for n in f.node if n.op_type == "CumSum"]


def test_refusals_and_options():
    options = efficient.Options()
    assert efficient.supports(make_site(MaskKind.BIAS), options) == (
        "an additive attention bias cannot be expressed by Efficient Attention's two softmaxes"
    )
    assert efficient.supports(make_site(MaskKind.CAUSAL), options) is None
    assert recurrent.recurrent_refusal(efficient, options) == efficient.NO_RECURRENCE
    assert passes.get_pass("efficient") is efficient
    assert passes.make_options(efficient, chunk="16").chunk == 16
    with pytest.raises(passes.OptionError, match="cannot take window=8"):
        passes.make_options(efficient, window="8")
    module = efficient.torch_module(make_site(scale=D**-0.5), options)  # the usual scale: temperature 2
    assert torch.allclose(module.query_scale, torch.full((H, 1, D), 2.0))
    assert torch.equal(module.key_scale, module.query_scale)


def test_calibration_lowers_the_error_to_softmax_attention():
    site, options = make_site(MaskKind.KEY_PADDING, scale=D**-0.5), efficient.Options()
    samples = fit.SiteSamples()
    for seed in range(4):
        q, k, v, keep = inputs(12, seed=seed)
        samples.add(q, k, v, keep)
    module = efficient.torch_module(site, options, learnable=True)
    result = fit.fit_site(module, samples, scale=site.scale, causal=False, steps=60)
    assert result.loss_after < 0.95 * result.loss_before  # random inputs: softmax is far from it
    q, k, v, keep = inputs(12, seed=9)
    lowering = efficient.onnx_lowering(site, options, OPSET, module_state(module))
    out = lowering_session(lowering, 4).run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert relative_error(out, run_pass_module(module, q, k, v, keep)) < 1e-5


@pytest.mark.parametrize("name", ["bert-eager", "gpt2-eager"])
def test_exported_models_rewrite_and_match_their_torch_reference(exports, name):
    export = exported(exports, name, "legacy")
    model = attnrewrite.rewrite(export.load(), to="efficient")
    record = read_record(model)
    assert record["sites_rewritten"] == export.spec.layers
    entry = "CausalEfficientAttention" if "causal" in export.spec.mask else "EfficientAttention"
    assert {s["replacement"] for s in record["sites"]} == {f"attnrewrite.{entry}"}
    inputs = export.parity_inputs()
    expected, _ = torch_reference(export, "efficient", inputs, options=efficient.Options())
    assert relative_error(run_onnx(model, inputs), expected) < 1e-4


def test_fx_rewrite_of_bert(exports):
    rewritten, out, expected = fx_rewrite_of_bert(exports, "efficient")
    assert rewritten.meta["attnrewrite"]["sites_rewritten"] == 2
    assert torch.isfinite(out).all() and (out - expected).abs().max() > 1e-4
