"""Hedgehog (attnrewrite/passes/hedgehog.py): the feature map's fittable values, the attention against its
definition, ONNX == torch with fitted (non-identity) values, and real exports rewritten to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_graphs import lowering_session
from conftest import exported, read_record
from models import (
    module_state,
    moved_off_initial,
    relative_error,
    run_onnx,
    run_pass_module,
    text_args,
    torch_reference,
)

import attnrewrite
from attnrewrite.passes import get_pass, hedgehog, make_options
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.site import AttentionSite, MaskKind

H, D, DV = 3, 8, 5
SCALE = 0.3
MASKS = list(MaskKind)[:4]  # none, key_padding, causal, causal+key_padding


def make_site(mask=MaskKind.NONE, rank=4, heads=H, **kw) -> AttentionSite:
    return AttentionSite(
        "attn",
        scale=SCALE,
        mask=mask,
        rank=rank,
        num_heads=heads if rank == 4 else None,
        head_dim=D,
        value_dim=DV,
        **kw,
    )


def inputs(n: int, lead=(2, H), seed: int = 0):
    """q, k, v and a key_keep [batch, 1.., n, 1] with batch row 1 padded at both ends."""
    rng = np.random.default_rng(seed)
    q, k, v = ((rng.standard_normal((*lead, n, d)) * 2).astype(np.float32) for d in (D, D, DV))
    keep = np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    keep[1, ..., :2, :] = keep[1, ..., n - 9 :, :] = 0.0
    return q, k, v, keep


def fitted(site, options, seed: int = 0) -> hedgehog.HedgehogAttention:
    """A learnable module whose W, b (and linear_log_weight) are moved off their initial values."""
    return moved_off_initial(hedgehog.torch_module(site, options, learnable=True), seed, spread=0.5)


# --- what is fitted -----------------------------------------------------------------------------


def test_feature_map_starts_at_identity_per_head_and_is_learnable_on_request():
    site = make_site()
    fixed = hedgehog.torch_module(site, hedgehog.Options())
    learnable = hedgehog.torch_module(site, hedgehog.Options(), learnable=True)
    assert dict(fixed.named_parameters()) == {}
    assert set(dict(fixed.named_buffers())) == {"weight", "bias"}
    assert set(dict(learnable.named_parameters())) == {"weight", "bias"}
    assert torch.equal(learnable.weight, torch.eye(D).repeat(H, 1, 1))
    assert torch.equal(learnable.bias, torch.zeros(H, 1, D))
    # the lowering's constants are the module's state, by name
    lowering = hedgehog.onnx_lowering(site, hedgehog.Options(), 18)
    assert lowering.constants.keys() == fixed.state_dict().keys()
    for name, value in fixed.state_dict().items():
        np.testing.assert_array_equal(lowering.constants[name], value.numpy())
    # heads unknown ([batch * heads, N, d]): one map shared by all
    shared = hedgehog.torch_module(make_site(rank=3), hedgehog.Options(window=8), learnable=True)
    assert {n: tuple(p.shape) for n, p in shared.named_parameters()} == {
        "weight": (1, D, D),
        "bias": (1, 1, D),
        "linear_log_weight": (1, 1, 1),
        "query_log_scale": (1, D, 1),
        "key_log_scale": (1, D, 1),
        "local_max_weight": (1, 1, 1),
    }
    initial = {n: p.detach() for n, p in shared.named_parameters()}
    assert float(initial["local_max_weight"]) == 0.5
    assert not initial["query_log_scale"].any() and not initial["key_log_scale"].any()


def test_fitted_weights_reach_the_onnx_constants_and_wrong_shapes_are_refused():
    site = make_site(MaskKind.CAUSAL)
    options = hedgehog.Options(window=4)
    module = fitted(site, options)
    lowering = hedgehog.onnx_lowering(site, options, 18, module_state(module))
    assert set(lowering.constants) == {"weight", "bias", *hedgehog.WINDOW_VALUES}
    for name, value in module_state(module).items():
        np.testing.assert_array_equal(lowering.constants[name], value)
    with pytest.raises(ValueError, match=r"^weight 'weight' has shape \[1, 8, 8\], the lowering's \[3, 8, 8\]$"):
        hedgehog.onnx_lowering(site, options, 18, {"weight": np.eye(D, dtype=np.float32)[None]})


def test_supports_refuses_what_it_cannot_express():
    options = hedgehog.Options()
    assert hedgehog.supports(make_site(MaskKind.CAUSAL_KEY_PADDING), options) is None
    assert hedgehog.supports(make_site(MaskKind.BIAS), options) == (
        "an additive attention bias cannot be expressed by a kernel feature map"
    )
    assert hedgehog.supports(AttentionSite("a", scale=0.5), options) == (
        "the head dimension is unknown, and the feature map W [d, d] is sized at rewrite time"
    )
    negative = AttentionSite("a", scale=-1.0, head_dim=D)
    assert hedgehog.supports(negative, options) == (
        "Hedgehog folds scale^(1/2) into q and k and needs a positive scale, not -1.0"
    )
    assert make_options(get_pass("hedgehog"), chunk="16", window="32") == hedgehog.Options(chunk=16, window=32)


# --- the math ---------------------------------------------------------------------------------


def by_definition(module, q, k, v, keep, causal):
    """phi(x) = [softmax(W x' + b), softmax(-(W x' + b))], x' = x * scale^(1/2), per head;
    weights phi(q_i).phi(k_j) over kept (and, if causal, earlier) keys; float64, N x N."""
    w, b = module.weight.detach().double(), module.bias.detach().double()

    def phi(x):
        z = (torch.from_numpy(x).double() * SCALE**0.5) @ w.transpose(-2, -1) + b
        return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)

    weights = phi(q) @ phi(k).transpose(-2, -1) * torch.from_numpy(keep).double().transpose(-2, -1)
    if causal:
        weights = weights.tril()
    return (weights @ torch.from_numpy(v).double() / (weights.sum(-1, keepdim=True) + 1e-6)).numpy()


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_attention_equals_its_definition(mask):
    module = fitted(make_site(mask), hedgehog.Options(chunk=16))
    q, k, v, keep = inputs(45)
    keep = keep if mask.key_padding else np.ones_like(keep)
    expected = by_definition(module, q, k, v, keep, mask.causal)
    assert relative_error(run_pass_module(module, q, k, v, keep), expected) < 1e-5


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_onnx_equals_torch_with_fitted_values(mask, window):
    """45 positions: chunks (and windows) of 16 with a partial last one."""
    site = make_site(mask)
    options = hedgehog.Options(chunk=16, window=window)
    module = fitted(site, options)
    session = lowering_session(hedgehog.onnx_lowering(site, options, 20, module_state(module)), 4)
    q, k, v, keep = inputs(45, seed=1)
    feed_keep = keep if mask.key_padding else np.ones((1, 1, 1, 1), np.float32)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=feed_keep))[0]
    expected = run_pass_module(module, q, k, v, keep if mask.key_padding else None)
    assert out.shape == expected.shape == (2, H, 45, DV)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_window_log_scales_far_beyond_exp_range_stay_exact(mask):
    """Fitted log scales of +-hundreds (e^x overflows float32 past 88): the two parts are each
    scaled to at most 1 and the keys' log scales are bounded, so torch and ONNX stay finite and
    equal the N x N definition."""
    site = make_site(mask)
    options = hedgehog.Options(chunk=16, window=8)
    module = fitted(site, options)
    with torch.no_grad():
        module.query_log_scale.mul_(400.0)
        module.key_log_scale.mul_(-400.0)
    q, k, v, keep = inputs(45, seed=2)
    keep = keep if mask.key_padding else None
    out = run_pass_module(module, q, k, v, keep)
    tq, tk, tv, tkeep = (None if x is None else torch.from_numpy(x) for x in (q, k, v, keep))
    with torch.no_grad():
        query_log_scale, key_log_scale = module.log_scales(tq, tk, tkeep)
        weights = module.attention_weights(tq, tk, tkeep)
    real_keys = key_log_scale[key_log_scale > LOWEST_LOG_SCALE]
    assert float(query_log_scale.abs().max()) > 200
    assert float(real_keys.max() - real_keys.min()) > 1.9 * hedgehog.KEY_LOG_SCALE_BOUND
    assert np.isfinite(out).all()
    assert relative_error(out, (weights @ tv).numpy()) < 1e-5
    session = lowering_session(hedgehog.onnx_lowering(site, options, 20, module_state(module)), 4)
    feed_keep = keep if keep is not None else np.ones((1, 1, 1, 1), np.float32)
    assert relative_error(session.run(None, dict(q=q, k=k, v=v, key_keep=feed_keep))[0], out) < 1e-5


def test_onnx_equals_torch_with_heads_folded_into_the_batch():
    site = make_site(MaskKind.KEY_PADDING, rank=3)
    options = hedgehog.Options()
    module = fitted(site, options)
    session = lowering_session(hedgehog.onnx_lowering(site, options, 20, module_state(module)), 3)
    q, k, v, keep = inputs(21, lead=(2 * H,))
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert relative_error(out, run_pass_module(module, q, k, v, keep)) < 1e-5


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("mask", [MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING], ids=lambda m: m.value)
def test_attention_weights_are_what_the_output_averages_with(mask, window):
    """The N x N weights a cross-entropy loss fits are the ones the blocked computation uses
    (with a window: the fitted log scales and local max weight included)."""
    module = fitted(make_site(mask), hedgehog.Options(chunk=16, window=window))
    q, k, v, keep = (torch.from_numpy(x) for x in inputs(45))
    with torch.no_grad():
        weights = module.attention_weights(q, k, keep)
        out = module(q, k, v, keep)
    assert weights.shape == (2, H, 45, 45)
    assert not (weights * (1 - keep.transpose(-2, -1))).any()
    assert not mask.causal or not weights.triu(1).any()
    assert relative_error(out.numpy(), (weights @ v).numpy()) < 1e-5


def test_gradients_reach_every_fitted_value():
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    module = hedgehog.torch_module(site, hedgehog.Options(window=8), learnable=True)
    q, k, v, keep = (torch.from_numpy(x) for x in inputs(30))
    module(q, k, v, keep).square().sum().backward()
    for name, parameter in module.named_parameters():
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name


# --- real exports ---------------------------------------------------------------------------------

EXPORTS = [
    pytest.param("bert-eager", "legacy", {}, "Hedgehog", id="bert"),
    pytest.param("bert-eager", "legacy", {"window": 4}, "WindowedHedgehog", id="bert-window4"),
    pytest.param("gpt2", "legacy", {}, "CausalHedgehog", id="gpt2"),
    pytest.param("gpt2", "legacy", {"window": 4}, "CausalWindowedHedgehog", id="gpt2-window4"),
]


@pytest.mark.parametrize("name, exporter, options, op_type", EXPORTS)
def test_exported_model_rewrites_and_matches_torch_with_hedgehog_swapped_in(exports, name, exporter, options, op_type):
    export = exported(exports, name, exporter)
    spec = export.spec
    model = attnrewrite.rewrite(export.load(), to="hedgehog", **options)
    record = read_record(model)
    assert record["sites_rewritten"] == spec.layers
    assert [n.op_type for n in model.graph.node if n.domain == "attnrewrite"] == [op_type] * spec.layers
    assert not {n.op_type for n in model.graph.node} & {"Softmax", "Attention"}
    # every call reads its W, b (and the window's values) as initializers; identical initial
    # values are stored once
    initializers = {i.name for i in model.graph.initializer}
    constants = 2 + len(hedgehog.WINDOW_VALUES) * bool(options)  # after q, k, v, key_keep
    calls = [n for n in model.graph.node if n.domain == "attnrewrite"]
    assert all(len(n.input) == 4 + constants and set(n.input[4:]) <= initializers for n in calls)
    assert len({tuple(n.input[4:]) for n in calls}) == 1

    inputs = export.parity_inputs()  # 11 tokens: windows of 4 leave keys to the kernel part
    expected, state_ = torch_reference(export, "hedgehog", inputs, options=make_options(hedgehog, **options))
    assert state_["calls"] == spec.layers
    error = relative_error(run_onnx(model, inputs), expected)
    assert error < 1e-5
    with torch.no_grad():
        original = export.module(*[inputs[n] for n in spec.input_names]).numpy()
    assert relative_error(original, expected) > 100 * error  # the swap is resolved by the comparison


def test_fx_rewrite_of_gpt2_matches_the_swapped_reference(exports):
    export = exported(exports, "gpt2", "legacy")
    program = torch.export.export(export.module, text_args(13))
    rewritten = attnrewrite.rewrite(program, to="hedgehog", window=4)
    assert rewritten.meta["attnrewrite"]["sites_rewritten"] == 2
    args = text_args(13, seed=1)
    inputs = dict(zip(export.spec.input_names, args))
    expected, _ = torch_reference(export, "hedgehog", inputs, options=hedgehog.Options(window=4))
    with torch.no_grad():
        assert relative_error(rewritten(*args).numpy(), expected) < 1e-5
