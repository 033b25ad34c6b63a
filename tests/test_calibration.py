"""Calibration (passes/fit.py and both frontends): fitting learnable replacements to the exact
softmax attention they replace, the learnable lowerings' ONNX-vs-torch parity, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_graphs import lowering_session
from models import relative_error

import passes
from attnrewrite.site import AttentionSite, MaskKind
from passes import fit, kernels

HEADS, HEAD_DIM = 2, 16


def clustered_site_samples(seed: int = 0, batches: int = 3, batch: int = 4, n: int = 64, clusters: int = 4):
    """A peaked, trained-like site: each token belongs to one of a few clusters per head; q and
    k sit near their cluster's centre (norm 8, so softmax attends almost only inside the
    cluster) and v near the cluster's value, as a trained head that groups tokens does."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(HEADS, clusters, HEAD_DIM, generator=g), dim=-1) * 8
    values = torch.randn(HEADS, clusters, HEAD_DIM, generator=g)
    samples = fit.SiteSamples()
    for _ in range(batches):
        cluster = torch.randint(clusters, (batch, HEADS, n), generator=g)

        def near(table):
            chosen = torch.stack([table[h][cluster[:, h]] for h in range(HEADS)], 1)
            return chosen + 0.3 * torch.randn(chosen.shape, generator=g)

        samples.add(near(centres), near(centres), near(values), None)
    return samples


def site(mask=MaskKind.NONE, heads=HEADS) -> AttentionSite:
    return AttentionSite(
        "attn", scale=HEAD_DIM**-0.5, mask=mask, rank=4 if heads else 3, num_heads=heads,
        head_dim=HEAD_DIM, value_dim=HEAD_DIM,
    )


def test_calibration_cuts_the_attention_error_tenfold_and_is_seeded():
    samples = clustered_site_samples()
    s = site()
    results, states = [], []
    for _ in range(2):
        module = passes.linear.torch_module(s, passes.linear.Options(), learnable=True)
        results.append(fit.fit_site(module, samples, scale=s.scale, causal=False, steps=200, lr=1e-2, seed=0))
        states.append(module.state_dict())
    first = results[0]
    assert first.loss_before / first.loss_after >= 10, first
    assert first.steps == 200 and first.examples == 12 and first.query_rows == 12 * HEADS * 64
    assert results[1].loss_after == first.loss_after
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    # the loss before is the uncalibrated module's: identity maps change nothing
    plain = passes.linear.torch_module(s, passes.linear.Options())
    q, k, v, _ = samples.batch(0)
    with torch.no_grad():
        expected = ((plain(q, k, v) - fit.exact_attention(q, k, v, s.scale)) ** 2).mean()
    fresh = passes.linear.torch_module(s, passes.linear.Options(), learnable=True)
    with torch.no_grad():
        assert torch.equal(fresh(q, k, v), plain(q, k, v))
    assert expected > first.loss_after * 10


# --- learnable lowerings: the ONNX function reads the fitted values -------------------------

LEARNABLE = [
    ("linear", {}, MaskKind.NONE, HEADS),
    ("linear", {}, MaskKind.KEY_PADDING, None),
    ("linear", {"chunk": 8}, MaskKind.CAUSAL, HEADS),
    ("linear", {"chunk": 8}, MaskKind.CAUSAL_KEY_PADDING, HEADS),
    ("hydra", {}, MaskKind.NONE, HEADS),
    ("hydra", {}, MaskKind.KEY_PADDING, HEADS),
    ("hydra", {}, MaskKind.CAUSAL, None),
    ("favor", {"features": 24}, MaskKind.NONE, HEADS),
    ("favor", {"features": 24}, MaskKind.KEY_PADDING, HEADS),
    ("favor", {"features": 24, "chunk": 8}, MaskKind.CAUSAL, HEADS),
    ("favor", {"features": 24, "chunk": 8, "variant": "hyperbolic"}, MaskKind.CAUSAL_KEY_PADDING, None),
    ("linformer", {"proj_dim": 8, "max_len": 32}, MaskKind.NONE, HEADS),
    ("linformer", {"proj_dim": 8, "max_len": 32, "projection": "learned"}, MaskKind.KEY_PADDING, HEADS),
    ("linformer", {"proj_dim": 8, "max_len": 32, "share_kv": True}, MaskKind.KEY_PADDING, None),
]


def perturbed_state(module, seed: int = 1) -> dict[str, np.ndarray]:
    """The module's parameters moved well away from their start (as a fit would move them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g) * param.abs().mean())
    return {name: value.numpy() for name, value in module.state_dict().items()}


def attention_inputs(heads, mask: MaskKind, batch: int = 2, n: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = (batch, heads) if heads else (batch * HEADS,)
    q, k, v = (torch.randn(*lead, n, HEAD_DIM, generator=g) for _ in range(3))
    keep = torch.ones(*lead, n, 1)
    if mask.key_padding:
        keep[-1, ..., n - 5 :, :] = 0.0
    return q, k, v, keep


@pytest.mark.parametrize("method, options, mask, heads", LEARNABLE)
def test_learnable_lowering_with_fitted_values_equals_the_torch_module(method, options, mask, heads):
    method_pass = passes.get_pass(method)
    s = site(mask, heads)
    opts = passes.make_options(method_pass, **options)
    module = method_pass.torch_module(s, opts, learnable=True)
    weights = perturbed_state(module)
    lowering = method_pass.onnx_lowering(s, opts, 20, weights=weights)
    for name, value in weights.items():  # state_dict names are the constants' names
        if name in lowering.constants:
            np.testing.assert_array_equal(lowering.constants[name], value)
    assert set(lowering.constants) >= set(weights) - {"F"}  # share_kv: F is E
    q, k, v, keep = attention_inputs(heads, mask)
    with torch.no_grad():
        expected = module(q, k, v, keep if mask.key_padding else None).numpy()
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": keep.numpy()}
    actual = lowering_session(lowering, q.dim()).run(None, feeds)[0]
    assert relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("method", ["linear", "hydra"])
def test_query_key_maps_exist_only_when_learnable(method):
    method_pass = passes.get_pass(method)
    opts = passes.make_options(method_pass)
    assert not list(method_pass.torch_module(site(), opts).parameters())
    learnable = method_pass.torch_module(site(), opts, learnable=True)
    assert {n: tuple(p.shape) for n, p in learnable.named_parameters()} == {
        "query_map": (HEADS, HEAD_DIM, HEAD_DIM), "key_map": (HEADS, HEAD_DIM, HEAD_DIM),
    }
    folded = method_pass.torch_module(site(heads=None), opts, learnable=True)
    assert folded.query_map.shape == (1, HEAD_DIM, HEAD_DIM)
    plain = method_pass.onnx_lowering(site(), opts, 18)
    assert plain.op_type == method_pass.onnx_lowering(site(), opts, 18).op_type
    assert "query_map" not in plain.constants
    fitted = method_pass.onnx_lowering(site(), opts, 18, weights=perturbed_state(learnable))
    assert fitted.op_type == f"Learned{plain.op_type}"


def test_lsh_and_unfittable_linformer_say_why():
    assert "lsh has nothing to fit" in passes.lsh.nothing_to_fit(passes.lsh.Options())
    with pytest.raises(ValueError, match="nothing to fit"):
        passes.lsh.torch_module(site(), passes.lsh.Options(), learnable=True)
    pool = passes.linformer.Options(projection="pool")
    assert "'pool' projection has nothing to fit" in passes.linformer.nothing_to_fit(pool)
    for method in ("linear", "hydra", "favor", "linformer"):
        assert passes.get_pass(method).nothing_to_fit(passes.make_options(passes.get_pass(method))) is None
