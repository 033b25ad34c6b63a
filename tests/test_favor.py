"""FAVOR+ (attnrewrite/passes/favor.py): exactness of both lowerings, the estimator's statistics, causality,
padding, determinism of W, parity with performer-pytorch, and numerical safety."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import attnrewrite
from attnrewrite.passes import OptionError, favor, get_pass, make_options
from attnrewrite.passes.lowering import DOMAIN, DOMAIN_VERSION
from attnrewrite.site import AttentionSite, MaskKind

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
MASKS = [MaskKind.NONE, MaskKind.KEY_PADDING, MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING]


def make_site(mask=MaskKind.NONE, head_dim=16, scale=None, **kw) -> AttentionSite:
    scale = head_dim**-0.5 if scale is None else scale
    return AttentionSite("attn", scale=scale, mask=mask, head_dim=head_dim, **kw)


def randn(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def with_norm(x, norm):
    return x * (norm / x.norm(dim=-1, keepdim=True))


def key_keep_for(mask: MaskKind, batch: int, n: int, kept: list[int]):
    """[batch, 1, n, 1] with the first kept[b] keys of batch b kept, or None without padding."""
    if not mask.key_padding:
        return None
    keep = torch.zeros(batch, 1, n, 1)
    for b, count in enumerate(kept):
        keep[b, :, :count] = 1.0
    return keep


def rel_err(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


# --- running the ONNX lowering ----------------------------------------------------------------


def favor_model(lowering, ranks, dtype=TensorProto.FLOAT, opset=18) -> onnx.ModelProto:
    """One call of the lowering's entry function, wired as the frontend splices it."""
    names = ["q", "k", "v", "key_keep"]
    types = [dtype, dtype, dtype, TensorProto.FLOAT]
    inputs = [
        helper.make_tensor_value_info(name, t, [f"{name}{i}" for i in range(rank)])
        for name, t, rank in zip(names, types, ranks)
    ]
    output = helper.make_tensor_value_info("out", dtype, [f"out{i}" for i in range(ranks[0])])
    node = helper.make_node(lowering.op_type, [*names, *lowering.constants], ["out"], domain=DOMAIN)
    constants = [numpy_helper.from_array(a, name) for name, a in lowering.constants.items()]
    graph = helper.make_graph([node], "favor", inputs, [output], constants)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=lowering.functions,
        ir_version=10,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def run_onnx(site, options, q, k, v, key_keep=None, opset=18):
    if key_keep is None:
        key_keep = torch.ones(1, 1)  # what the frontend passes when nothing is padded
    lowering = favor.onnx_lowering(site, options, opset)
    dtype = TensorProto.FLOAT16 if q.dtype == torch.float16 else TensorProto.FLOAT
    model = favor_model(lowering, [q.ndim, k.ndim, v.ndim, key_keep.ndim], dtype, opset)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": key_keep.numpy()}
    return torch.from_numpy(session.run(None, feeds)[0])


# --- references ---------------------------------------------------------------------------------


def softmax_attention(q, k, v, scale):
    logits = scale * q.double() @ k.double().transpose(-2, -1)
    return torch.softmax(logits, dim=-1) @ v.double()


def unstabilized_favor(q, k, v, projection, scale, causal=False, key_keep=None):
    """FAVOR+ by its definition in float64: phi = exp(Wx - |x|^2/2)/sqrt(m), no stabilizer."""
    w = projection.double()
    root = math.sqrt(scale)
    phi_q = torch.exp(favor.log_features(q.double() * root, w)) / math.sqrt(w.shape[0])
    phi_k = torch.exp(favor.log_features(k.double() * root, w)) / math.sqrt(w.shape[0])
    if key_keep is not None:
        phi_k = phi_k * key_keep.double()
    weights = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        weights = weights.tril()
    return (weights @ v.double()) / weights.sum(-1, keepdim=True)


def positive_features(x, projection):
    """The pass's own feature map, unstabilized: an unbiased estimator of exp(x . y)."""
    return torch.exp(favor.log_features(x, projection)) / math.sqrt(projection.shape[0])


def trig_features(x, projection):
    """Baseline (test only): exp(|x|^2/2) [cos Wx, sin Wx] / sqrt(m), also unbiased for
    exp(x . y), since cos(w.x)cos(w.y) + sin(w.x)sin(w.y) = cos(w.(x - y))."""
    wx = x @ projection.transpose(0, 1)
    scale = torch.exp(x.square().sum(-1, keepdim=True) / 2) / math.sqrt(projection.shape[0])
    return scale * torch.cat([torch.cos(wx), torch.sin(wx)], dim=-1)


# --- implementation parity ----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["positive", "hyperbolic"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_onnx_lowering_equals_torch_reference(mask, variant):
    site = make_site(mask, rank=4, num_heads=3)
    options = favor.Options(seed=7, variant=variant, chunk=16)
    # 45 positions: three chunks, the last one partial.
    q, k, v = randn(2, 3, 45, 16, seed=1), randn(2, 3, 45, 16, seed=2), randn(2, 3, 45, 8, seed=3)
    keep = key_keep_for(mask, 2, 45, [45, 29])
    expected = favor.torch_module(site, options)(q, k, v, keep)
    actual = run_onnx(site, options, q, k, v, keep)
    assert actual.shape == expected.shape == (2, 3, 45, 8)
    assert rel_err(actual, expected) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_onnx_lowering_is_rank_agnostic_and_keeps_fp16(causal):
    """[batch*heads, N, D] fp16 in, fp16 out; the body computes in float32 either way."""
    site = make_site(MaskKind.CAUSAL if causal else MaskKind.NONE, rank=3)
    options = favor.Options(seed=3, chunk=8)
    q, k, v = (randn(4, 21, 16, seed=s).half() for s in (1, 2, 3))
    expected = favor.torch_module(site, options)(q, k, v)
    actual = run_onnx(site, options, q, k, v, opset=21)
    assert actual.dtype == expected.dtype == torch.float16
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=2e-3, atol=1e-4)


def test_lowering_is_one_readable_function_over_standard_ops():
    for mask, name in [(MaskKind.KEY_PADDING, "Favor"), (MaskKind.CAUSAL, "CausalFavor")]:
        site = make_site(mask)
        lowering = favor.onnx_lowering(site, favor.Options(seed=5), 18)
        assert lowering.op_type == name
        assert list(lowering.functions[-1].input) == ["q", "k", "v", "key_keep", "projection"]
        local = {f.name for f in lowering.functions}
        for function in lowering.functions:
            for node in function.node:
                assert node.domain == "" or (node.domain == DOMAIN and node.op_type in local)
        # The constant the frontend stores as an initializer is the torch module's buffer.
        projection = lowering.constants["projection"]
        assert projection.dtype == np.float32 and projection.shape == (44, 16)
        buffer = favor.torch_module(site, favor.Options(seed=5)).projection
        assert buffer.numpy().tobytes() == projection.tobytes()


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_stabilizers_cancel_exactly(mask):
    """The stabilized float32 computation equals FAVOR+ by definition (no stabilizer, float64):
    the per-query max, the head-wide key max and the causal running max all cancel."""
    site = make_site(mask)
    module = favor.torch_module(site, favor.Options(seed=11, chunk=16))
    # Norms ~6 (3 once scaled): exponents span -20..+6, yet float64 needs no stabilizer.
    q, k = randn(2, 1, 70, 16, seed=4, std=1.5), randn(2, 1, 70, 16, seed=5, std=1.5)
    v = randn(2, 1, 70, 8)
    keep = key_keep_for(mask, 2, 70, [70, 41])
    expected = unstabilized_favor(q, k, v, module.projection, site.scale, mask.causal, keep)
    assert rel_err(module(q, k, v, keep), expected) < 1e-5


# --- the estimator ------------------------------------------------------------------------------


@pytest.mark.parametrize("orthogonal", [True, False])
def test_kernel_estimate_is_unbiased(orthogonal):
    """Averaged over independent draws of W, phi(x).phi(y) converges to exp(x . y); rows of fixed
    length sqrt(d) (the regularized kernel) are biased, and this test sees it."""
    d, draws = 16, 400
    x, y = with_norm(randn(6, d, seed=1), 1.0), with_norm(randn(6, d, seed=2), 1.0)
    exact = torch.exp((x * y).sum(-1))

    def z_scores(norms):
        estimates = []
        for seed in range(draws):
            w = torch.from_numpy(favor.draw_projection(d, 64, seed, orthogonal, norms))
            estimates.append((positive_features(x, w) * positive_features(y, w)).sum(-1))
        estimates = torch.stack(estimates)
        standard_error = estimates.std(0) / math.sqrt(draws)
        assert (standard_error < 0.05 * exact).all()  # power: a 20% bias would be caught
        return (estimates.mean(0) - exact) / standard_error

    assert z_scores("chi").abs().max() < 4  # measured <= 1.4
    assert z_scores("fixed").abs().max() > 4  # measured 5.0 (iid), 7.3 (orthogonal)


def test_attention_error_falls_with_features_and_orthogonal_beats_iid():
    """Performer Fig. 4 setting, at CI size: d = 16, L = 1024 (not 4096), MSE of FAVOR+ attention
    against exact softmax attention, averaged over 24 draws of W per (m, orthogonal)."""
    d, length, draws = 16, 1024, 24
    site = make_site(head_dim=d)
    q, k = randn(2, length, d, seed=1, std=0.5), randn(2, length, d, seed=2, std=0.5)
    v = k  # values = keys: the output is a kernel smoother with real signal (not ~mean(v))
    exact = softmax_attention(q, k, v, site.scale).float()
    uniform_mse = ((v.mean(-2, keepdim=True) - exact) ** 2).mean().item()

    def mse(m, orthogonal):
        errors = []
        for seed in range(draws):
            options = favor.Options(features=m, seed=seed, orthogonal=orthogonal)
            errors.append(((favor.torch_module(site, options)(q, k, v) - exact) ** 2).mean().item())
        return float(np.mean(errors))

    orth = {m: mse(m, True) for m in (16, 64, 256)}
    iid = {m: mse(m, False) for m in (16, 64, 256)}
    # Measured: orth 1.9e-3, 6.0e-4, 1.9e-4; iid 2.3e-3, 7.5e-4, 2.3e-4; uniform 1.0e-3.
    for mses in (orth, iid):
        assert mses[64] < 0.6 * mses[16] and mses[256] < 0.6 * mses[64]
    assert orth[256] < 0.5 * uniform_mse  # the approximation carries the attention pattern
    for m in (16, 64, 256):
        assert orth[m] < 0.93 * iid[m]  # measured ratios 0.79-0.87 over several input draws


def test_positive_features_beat_trig_features_where_the_kernel_is_small():
    """Lemma 1 of the paper: the positive estimator's MSE scales with SM(x,y)^2, the sin/cos one
    with SM(x,y)^-2, so for nearly opposite x, y (SM ~ e^-2) positive features win by far."""
    d, m, draws = 16, 64, 64
    x = with_norm(randn(8, d, seed=1), 1.4)
    y = -x + 0.2 * randn(8, d, seed=2)
    exact = torch.exp((x * y).sum(-1))
    assert (exact < 0.2).all()
    positive_se, trig_se = 0.0, 0.0
    for seed in range(draws):
        w = torch.from_numpy(favor.draw_projection(d, m, seed))
        positive = (positive_features(x, w) * positive_features(y, w)).sum(-1)
        trig = (trig_features(x, w) * trig_features(y, w)).sum(-1)
        positive_se += ((positive - exact) ** 2).mean().item()
        trig_se += ((trig - exact) ** 2).mean().item()
    assert positive_se < 0.01 * trig_se


# --- masks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowering", ["torch", "onnx"])
def test_causal_output_does_not_depend_on_the_future(lowering):
    """Perturb positions >= 37 (mid-chunk) with huge keys: a key stabilizer that looked ahead
    would change the earlier rows (measured 6e-2 for a head-wide key max)."""
    site, options, t = make_site(MaskKind.CAUSAL), favor.Options(seed=2, chunk=16), 37
    q, k, v = randn(2, 2, 90, 16, seed=1), randn(2, 2, 90, 16, seed=2), randn(2, 2, 90, 16, seed=3)

    def perturbed(x, seed):
        x = x.clone()
        x[..., t:, :] = with_norm(randn(*x[..., t:, :].shape, seed=seed), 30.0)
        return x

    run = favor.torch_module(site, options) if lowering == "torch" else functools.partial(run_onnx, site, options)
    before = run(q, k, v)
    after = run(perturbed(q, 10), perturbed(k, 11), perturbed(v, 12))
    assert (before[..., t:, :] - after[..., t:, :]).abs().max() > 1e-2  # the future did change
    torch.testing.assert_close(after[..., :t, :], before[..., :t, :], rtol=1e-6, atol=0)


@pytest.mark.parametrize("mask", [m for m in MASKS if m.key_padding], ids=lambda m: m.value)
def test_padded_keys_leave_numerator_and_denominator(mask):
    """With the last keys padded, the output is FAVOR+ over the kept keys alone, whatever the
    padded keys and values hold (zeroing V instead would leave them in the denominator)."""
    site, options, kept = make_site(mask), favor.Options(seed=4, chunk=16), 33
    q, k, v = randn(1, 2, 50, 16, seed=1), randn(1, 2, 50, 16, seed=2), randn(1, 2, 50, 8, seed=3)
    k[..., kept:, :] = q[..., kept:, :]  # padded keys the queries would attend to most
    v[..., kept:, :] = 1e4  # and values that would show any leak
    keep = key_keep_for(mask, 1, 50, [kept])
    module = favor.torch_module(site, options)
    padded = module(q, k, v, keep)
    if mask.causal:  # rows before the padding see only kept keys
        alone = module(q[..., :kept, :], k[..., :kept, :], v[..., :kept, :])
        padded = padded[..., :kept, :]
    else:
        alone = module(q, k[..., :kept, :], v[..., :kept, :])
    assert rel_err(padded, alone) < 1e-5
    assert rel_err(run_onnx(site, options, q, k, v, keep), module(q, k, v, keep)) < 1e-5


# --- W ------------------------------------------------------------------------------------------


def test_projection_is_fixed_by_the_seed():
    def draw(seed, **kw):
        return favor.draw_projection(16, 44, seed, **kw).tobytes()

    assert draw(0) == draw(0) and draw(0, orthogonal=False) == draw(0, orthogonal=False)
    assert draw(0) != draw(1) and draw(0, orthogonal=False) != draw(1, orthogonal=False)
    module = favor.torch_module(make_site(), favor.Options(seed=9))
    assert "projection" in module.state_dict()  # a persistent buffer, saved with the model
    q = randn(1, 5, 16)
    first = module(q, q, q)
    assert torch.equal(module(q, q, q), first)  # never redrawn between calls
    assert module.projection.numpy().tobytes() == draw(9)


@pytest.mark.parametrize("norms", ["chi", "fixed"])
def test_projection_rows_are_orthogonal_in_blocks(norms):
    d, m = 16, 40  # two full blocks and a partial one
    w = favor.draw_projection(d, m, seed=0, norms=norms).astype(np.float64)
    lengths = np.linalg.norm(w, axis=1)
    for start in range(0, m, d):
        block = w[start : start + d]
        gram = block @ block.T
        np.testing.assert_allclose(gram, np.diag(np.diag(gram)), atol=1e-5)
    if norms == "fixed":
        np.testing.assert_allclose(lengths, math.sqrt(d), rtol=1e-6)
    else:
        assert lengths.std() > 0.3 and abs(lengths.mean() - math.sqrt(d)) < 0.5
    iid = favor.draw_projection(d, m, seed=0, orthogonal=False, norms=norms)[:d].astype(np.float64)
    assert np.abs(np.triu(iid @ iid.T, 1)).max() > 1.0  # independent rows are not orthogonal


def test_feature_count_options_and_refusals():
    assert favor.default_features(64) == 266 and favor.default_features(16) == 44
    assert favor.torch_module(make_site(head_dim=64), favor.Options()).projection.shape == (266, 64)
    options = favor.Options(features=8, variant="hyperbolic")
    hyperbolic = favor.onnx_lowering(make_site(), options, 18)
    assert hyperbolic.constants["projection"].shape == (8, 16)
    assert favor.supports(make_site(MaskKind.CAUSAL_KEY_PADDING), favor.Options()) is None
    assert "bias" in favor.supports(make_site(MaskKind.BIAS), favor.Options())
    unknown = make_site(head_dim=None, scale=0.125)
    assert "head dimension" in favor.supports(unknown, favor.Options(features=64))
    assert "scale" in favor.supports(make_site(scale=0.0), favor.Options())
    assert get_pass("favor") is favor
    options = make_options(favor, features="32", orthogonal="false", variant="hyperbolic", seed="3")
    assert options == favor.Options(features=32, seed=3, variant="hyperbolic", orthogonal=False)
    with pytest.raises(OptionError, match=r"^favor option variant must be one of positive \| hyperbolic, got 'trig'$"):
        favor.Options(variant="trig")
    with pytest.raises(OptionError, match=r"^favor option norms must be one of chi \| fixed, got 'unit'$"):
        favor.Options(norms="unit")


# --- parity with an independent implementation ---------------------------------------------------


def test_matches_performer_pytorch(monkeypatch):
    """performer-pytorch's FastAttention, given our W, computes the same bidirectional attention.

    Where the definitions differ: (1) its data normalizer d^-1/4 is our scale^(1/2) for the
    usual scale d^-1/2 (set here); (2) it stabilizes queries by their max over features of w.x
    (ours: of w.x - |x|^2/2) and keys by one max of w.x over all keys and features of a head
    (ours: of w.x - |x|^2/2, padded keys excluded): different constants, but each one shared by
    everything it multiplies, so both cancel; (3) it adds eps = 1e-4 to every feature after the
    max, which does not cancel: keys far below the head's max get a floor that flattens attention
    (measured: rel. difference 1.9 with it, on these inputs), so it is set to 0 here; (4) its
    denominator has no eps, ours 1e-30 (negligible).
    """
    performer = pytest.importorskip("performer_pytorch.performer_pytorch")
    d, m = 32, 111
    site = make_site(head_dim=d)
    assert math.isclose(site.scale**0.5, d**-0.25)
    ours = favor.torch_module(site, favor.Options(features=m, seed=3))
    theirs = performer.FastAttention(dim_heads=d, nb_features=m)
    assert theirs.projection_matrix.shape == ours.projection.shape
    theirs.projection_matrix.copy_(ours.projection)
    monkeypatch.setattr(performer, "softmax_kernel", functools.partial(performer.softmax_kernel, eps=0.0))
    q, k, v = randn(2, 4, 256, d, seed=1), randn(2, 4, 256, d, seed=2), randn(2, 4, 256, d, seed=3)
    with torch.no_grad():
        assert rel_err(ours(q, k, v), theirs(q, k, v)) < 1e-5


# --- numerical safety ---------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_inputs_of_norm_30_stay_finite_and_convex(mask, head_dim):
    """Logits up to 900 * scale: exp(w.x - |x|^2/2) alone under- or overflows float32. Positive
    weights make every output row a weighted mean of the values, so it must lie in their range."""
    site, options = make_site(mask, head_dim=head_dim), favor.Options(seed=1, chunk=16)
    q = with_norm(randn(2, 2, 40, head_dim, seed=1), 30.0)
    k = with_norm(randn(2, 2, 40, head_dim, seed=2), 30.0)
    v = randn(2, 2, 40, 8, seed=3)
    keep = key_keep_for(mask, 2, 40, [40, 25])
    module = favor.torch_module(site, options)
    for out in (module(q, k, v, keep), run_onnx(site, options, q, k, v, keep)):
        assert torch.isfinite(out).all()
        assert (out <= v.amax(-2, keepdim=True) + 1e-5).all()
        assert (out >= v.amin(-2, keepdim=True) - 1e-5).all()
    half = module(q.half(), k.half(), v.half(), keep)
    assert half.dtype == torch.float16 and torch.isfinite(half).all()


@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL], ids=lambda m: m.value)
def test_fp16_inputs_give_finite_fp16_outputs(mask):
    """Features and sums stay float32 inside (fp16 features would flush everything below e^-17 to
    zero and round key sums to 3 digits): the result is the float32 one, rounded once."""
    site, options = make_site(mask), favor.Options(seed=6, chunk=64)
    q, k, v = (randn(1, 2, 512, 16, seed=s, std=2.0) for s in (1, 2, 3))
    module = favor.torch_module(site, options)
    half = module(q.half(), k.half(), v.half())
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    full = module(q.half().float(), k.half().float(), v.half().float())
    torch.testing.assert_close(half.float(), full, rtol=1e-3, atol=1e-3)


# --- a whole model --------------------------------------------------------------------------------


def test_tiny_bert_rewrites_to_favor_and_runs():
    """The shipped 2-layer BERT (legacy export, key padding): both attentions become Favor nodes
    reading W (the same draw for both, stored once), the model runs, and padded tokens cannot
    reach the others."""
    model = attnrewrite.rewrite(onnx.load(SAMPLE), to="favor", features=32, seed=1)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Favor") == 2 and "Softmax" not in ops
    (projection,) = [i for i in model.graph.initializer if i.name.endswith("/projection")]
    assert [projection.name in n.input for n in model.graph.node if n.op_type == "Favor"] == [True, True]
    assert numpy_helper.to_array(projection).tobytes() == favor.draw_projection(16, 32, seed=1).tobytes()

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (2, 40))
    mask = np.ones((2, 40), np.int64)
    mask[1, 25:] = 0
    out = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert out.shape == (2, 40, 64) and np.isfinite(out).all()
    ids[1, 25:] = rng.integers(0, 1000, 15)  # other padding tokens
    again = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_array_equal(again[1, :25], out[1, :25])
    assert np.abs(again[1, 25:] - out[1, 25:]).max() > 1e-2  # the padded rows themselves did change
