"""AFT (attnrewrite/passes/aft.py): ONNX lowering == torch module == the paper's formula written
densely, on every mask kind, for AFT-simple and AFT-local; the PyPI aft-pytorch package's
AFTSimple and AFTLocal on the same q, k, v; the recurrent form of causal AFT-simple stepped
token by token == the parallel form; refusals with their reasons; calibration fits; both
frontends on exported models."""

from __future__ import annotations

import aft_pytorch
import numpy as np
import pytest
import torch
from attention_graphs import lowering_model, lowering_session
from conftest import decoder_exported, exported, read_record
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
from test_recurrent import session_for
from test_recurrent_models import assert_steps_equal_the_parallel_rewrite

import attnrewrite
from attnrewrite import passes
from attnrewrite.errors import NothingRewritten
from attnrewrite.passes import aft, fit, recurrent
from attnrewrite.site import AttentionSite, MaskKind

B, H, D = 2, 3, 8
SPAN, CHUNK = 3, 4
OPSET = 20
MASKS = [MaskKind.NONE, MaskKind.KEY_PADDING, MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING]


def make_site(mask=MaskKind.KEY_PADDING, rank=4, scale=0.5, value_dim=D) -> AttentionSite:
    heads = H if rank == 4 else None
    return AttentionSite("layer0", scale=scale, mask=mask, rank=rank, num_heads=heads, head_dim=D, value_dim=value_dim)


def fitted(site, options, seed=0) -> aft.AftAttention:
    return moved_off_initial(aft.torch_module(site, options, learnable=True), seed).eval()


def inputs(n, lead=(B, H), padding=True, seed=0):
    """q, k, v (std 2: the stabiliser matters) and key_keep [B, 1.., n, 1]: the second row's last
    keys padded (and, for n > 4, its first)."""
    rng = np.random.default_rng(seed)
    q, k, v = (2 * rng.standard_normal((*lead, n, D)).astype(np.float32) for _ in range(3))
    keep = padded_at_both_ends(lead, n) if padding else np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    return q, k, v, keep


def paper_formula(module, q, k, v, keep, causal: bool) -> np.ndarray:
    """Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt') over the
    allowed keys, with the whole [N, N] matrix w, in float64 (no stabiliser: the inputs are small)."""
    values = {name: value.detach().double() for name, value in module.state_dict().items()}
    q, k, v = (torch.from_numpy(x).double() for x in (q, k, v))
    n = k.shape[-2]
    offset = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # t - t'
    w = torch.zeros(1, n, n, dtype=torch.float64)
    if "position_bias" in values:
        index = (offset + SPAN - 1).clamp(0, 2 * SPAN - 2)
        w = torch.where(offset.abs() < SPAN, values["position_bias"][:, index], 0.0)  # [heads, N, N]
    key_q = torch.sigmoid(q * values["gate_scale"] + values["gate_bias"])
    weights = torch.exp(w)[..., None] * torch.exp(k * values["key_scale"]).unsqueeze(-3)  # [.., t, t', d]
    if keep is not None:
        weights = weights * torch.from_numpy(keep).double().unsqueeze(-3)
    if causal:
        weights = weights * (offset >= 0).double()[..., None]
    # a query with no allowed key (causal, its only key padded) gives 0
    return (key_q * (weights * v.unsqueeze(-3)).sum(-2) / weights.sum(-2).clamp_min(1e-300)).numpy()


# --- implementation parity ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("variant", aft.VARIANTS)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_onnx_equals_torch_equals_the_formula(mask, variant, rank):
    # lengths below, at and past the span's blocks and the causal chunk; fitted-looking values
    site, options = make_site(mask, rank), aft.Options(variant=variant, span=SPAN, chunk=CHUNK)
    module = fitted(site, options)
    session = lowering_session(aft.onnx_lowering(site, options, OPSET, module_state(module)), rank)
    lead = (B, H) if rank == 4 else (B * H,)
    for n in (1, 3, 5, 11, 12):
        q, k, v, keep = inputs(n, lead, padding=mask.key_padding)
        keep_or_none = keep if mask.key_padding else None
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        expected = run_pass_module(module, q, k, v, keep_or_none)
        assert relative_error(out, expected) < 1e-5, n
        assert relative_error(expected, paper_formula(module, q, k, v, keep_or_none, mask.causal)) < 1e-5, n


def test_local_with_a_zero_bias_is_simple_and_the_initial_values_are_the_papers_gate():
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    simple = aft.torch_module(site, aft.Options())
    local = aft.torch_module(site, aft.Options(variant="local", span=SPAN))
    q, k, v, keep = inputs(9)
    assert relative_error(run_pass_module(local, q, k, v, keep), run_pass_module(simple, q, k, v, keep)) < 1e-6
    # zero-shot: sigmoid(q) gates exp(scale * k)-weighted means of v
    assert torch.equal(simple.key_scale, torch.full((H, 1, D), 0.5))
    assert (simple.gate_scale == 1).all() and (simple.gate_bias == 0).all()
    assert [name for name, _ in local.named_parameters()] == ["position_bias"]
    assert local.position_bias.shape == (H, 2 * SPAN - 1) and not local.position_bias.any()


def test_padded_keys_do_not_contribute_and_all_padded_rows_are_zero_not_nan():
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    options = aft.Options(variant="local", span=SPAN, chunk=CHUNK)
    module = fitted(site, options)
    session = lowering_session(aft.onnx_lowering(site, options, OPSET, module_state(module)), 4)
    q, k, v, keep = inputs(10)
    changed_k, changed_v = k.copy(), v.copy()
    changed_k[keep[:, :, :, 0].repeat(H, 1) == 0] = 1e4  # exp(1e4) overflows, were it read
    changed_v[keep[:, :, :, 0].repeat(H, 1) == 0] = -7.0
    for run in (
        lambda *x: run_pass_module(module, *x),
        lambda *x: session.run(None, dict(zip(["q", "k", "v", "key_keep"], x)))[0],
    ):
        out = run(q, k, v, keep)
        assert np.array_equal(out, run(q, changed_k, changed_v, keep))
        # causal: the second row's first query sees only its padded first key
        assert np.isfinite(out).all() and not out[1, :, 0].any()


def test_the_stabiliser_keeps_large_logits_finite():
    site = make_site(MaskKind.NONE, scale=1.0)
    module = aft.torch_module(site, aft.Options())
    q, k, v, _ = inputs(6, padding=False)
    out = run_pass_module(module, q, k * 100, v, None)  # exp(800) would overflow unstabilised
    assert np.isfinite(out).all()
    assert relative_error(out, run_pass_module(module, q, k * 100 + 50, v, None)) < 1e-5


# --- the reference package ---------------------------------------------------------------------


def through_aft_pytorch(reference: torch.nn.Module, q, k, v) -> np.ndarray:
    """The package's forward on our q, k, v [B, N, d]: its projections replaced by these."""
    given = dict(to_q=q, to_k=k, to_v=v)
    for name, value in given.items():
        setattr(reference, name, _Constant(torch.from_numpy(value)))
    reference.project = torch.nn.Identity()
    with torch.no_grad():
        return reference(torch.zeros(q.shape[0], q.shape[1], reference.dim)).numpy()


class _Constant(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value


def test_simple_equals_aft_pytorchs_aftsimple():
    n = 12
    site = make_site(MaskKind.NONE, rank=3, scale=1.0)  # key_scale 1: the package's exp(K)
    module = aft.torch_module(site, aft.Options())
    session = lowering_session(aft.onnx_lowering(site, aft.Options(), OPSET), 3)
    q, k, v, keep = inputs(n, lead=(B,), padding=False)
    expected = through_aft_pytorch(aft_pytorch.AFTSimple(max_seqlen=n, dim=D, hidden_dim=D), q, k, v)
    assert relative_error(run_pass_module(module, q, k, v, None), expected) < 1e-5
    assert relative_error(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0], expected) < 1e-5


def test_local_equals_aft_pytorchs_aftlocal_with_our_bias_as_its_matrix():
    n, span = 12, 4
    site = make_site(MaskKind.NONE, rank=3, scale=1.0)
    options = aft.Options(variant="local", span=span)
    module = aft.torch_module(site, options)
    with torch.no_grad():
        module.position_bias.copy_(torch.randn(1, 2 * span - 1, generator=torch.Generator().manual_seed(3)))
    session = lowering_session(aft.onnx_lowering(site, options, OPSET, module_state(module)), 3)
    reference = aft_pytorch.AFTLocal(max_seqlen=n, dim=D, hidden_dim=D, s=span)
    offset = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    with torch.no_grad():  # w[t, t'] = position_bias[t - t'] (the package zeroes |t - t'| >= s itself)
        reference.wbias.copy_(module.position_bias[0, (offset + span - 1).clamp(0, 2 * span - 2)])
    q, k, v, keep = inputs(n, lead=(B,), padding=False)
    expected = through_aft_pytorch(reference, q, k, v)
    assert relative_error(run_pass_module(module, q, k, v, None), expected) < 1e-4
    assert relative_error(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0], expected) < 1e-4


# --- the recurrent form --------------------------------------------------------------------------


def left_padded(n=15):
    q, k, v, _ = inputs(n, padding=False, seed=1)
    keep = np.ones((B, 1, n, 1), np.float32)
    keep[1, :, :4] = 0.0
    return q, k, v, keep


def recurrent_form(site, options):
    """The method's recurrent form at ``site`` (passes.recurrent.form_for)."""
    return recurrent.form_for(passes.get_pass(options.method_name), site, options)


def pieces(schedule):
    start = 0
    for size in schedule:
        yield slice(start, start + size)
        start += size


@pytest.mark.parametrize("schedule", [[9, 1, 1, 1, 1, 1, 1], [3, 1, 5, 2, 4]], ids=["prefill-then-tokens", "uneven"])
def test_recurrent_steps_equal_the_parallel_form_in_torch_and_onnx(schedule):
    site, options = make_site(MaskKind.CAUSAL_KEY_PADDING), aft.Options(chunk=CHUNK)
    parallel = fitted(site, options)
    q, k, v, keep = left_padded()
    expected = run_pass_module(parallel, q, k, v, keep)
    module = recurrent_form(site, options).torch_module(site, parallel)
    session = session_for(site, options, module_state(parallel))
    names = [t.name for t in recurrent_form(site, options).state(site)]
    assert names == ["numerator", "denominator", "key_max"]
    torch_state = module.initial_state(torch.from_numpy(q), torch.from_numpy(v))
    onnx_state = [np.zeros((B, H, D), np.float32) for _ in names]  # all zero: also the empty state
    for piece in pieces(schedule):
        step = [x[..., piece, :] for x in (q, k, v, keep)]
        with torch.no_grad():
            out, *torch_state = module(*(torch.from_numpy(x) for x in step), *torch_state)
        onnx_out, *onnx_state = session.run(None, dict(zip(["q", "k", "v", "key_keep", *names], [*step, *onnx_state])))
        assert relative_error(out.numpy(), expected[..., piece, :]) < 1e-5, piece
        assert relative_error(onnx_out, expected[..., piece, :]) < 1e-5, piece
        assert all(s.shape == (B, H, D) for s in onnx_state)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoders_prefill_then_decode_as_their_parallel_rewrite(decoder_exports, name):
    """--recurrent on a KV-cache export: the state [B, H, D] x 3 per layer, stepped token by token,
    gives the logits of the parallel causal rewrite of the no-cache export."""
    assert_steps_equal_the_parallel_rewrite(decoder_exports, name, "legacy", "aft", "plain")


def test_decoders_refuse_aft_local_as_a_recurrence_with_the_reason(decoder_exports):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    with pytest.warns(NothingRewritten):
        model = attnrewrite.rewrite(cached.load(), "aft", recurrent=True, variant="local")
    assert [site["reason"] for site in read_record(model)["sites"]] == [aft.LOCAL_REFUSAL] * 2


def test_no_cumsum_along_positions():
    for mask in (MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING):
        for variant in aft.VARIANTS:
            lowering = aft.onnx_lowering(make_site(mask), aft.Options(variant=variant, span=SPAN), OPSET)
            assert not [n for f in lowering_model(lowering, 4).functions for n in f.node if n.op_type == "CumSum"]
    lowering = recurrent_form(make_site(MaskKind.CAUSAL), aft.Options()).onnx_lowering(
        make_site(MaskKind.CAUSAL), OPSET
    )
    assert not [n for f in lowering.functions for n in f.node if n.op_type == "CumSum"]


# --- refusals, options ---------------------------------------------------------------------------


def test_refusals_say_why():
    options = aft.Options()
    assert aft.supports(make_site(MaskKind.BIAS), options) == (
        "an additive attention bias cannot be expressed by AFT's per-feature key weights"
    )
    assert aft.supports(make_site(value_dim=6), options) == (
        "AFT weighs each value feature by its key feature: key dim 8 != value dim 6"
    )
    assert aft.supports(make_site(MaskKind.CAUSAL), options) is None
    local = aft.Options(variant="local")
    assert recurrent.recurrent_refusal(aft, local) == aft.LOCAL_REFUSAL
    assert recurrent.recurrent_refusal(aft, options) is None
    with pytest.raises(ValueError, match="only a causal attention is a recurrence"):
        recurrent_form(make_site(MaskKind.KEY_PADDING), options).torch_module(
            make_site(), aft.torch_module(make_site(), options)
        )


def test_registered_and_options_parse_from_strings():
    assert passes.get_pass("aft") is aft
    options = passes.make_options(aft, variant="local", span="8", chunk="32")
    assert (options.variant, options.span, options.chunk) == ("local", 8, 32)
    with pytest.raises(passes.OptionError, match=r"^aft option variant must be one of simple \| local, got 'full'$"):
        passes.make_options(aft, variant="full")
    with pytest.raises(passes.OptionError, match="cannot take window=4"):
        passes.make_options(aft, window="4")


# --- calibration --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", aft.VARIANTS)
def test_calibration_lowers_the_error_to_softmax_attention(variant):
    site, options = make_site(MaskKind.KEY_PADDING, scale=D**-0.5), aft.Options(variant=variant, span=SPAN)
    samples = fit.SiteSamples()
    for seed in range(4):
        q, k, v, keep = inputs(12, seed=seed)
        samples.add(q, k, v, keep)
    module = aft.torch_module(site, options, learnable=True)
    result = fit.fit_site(module, samples, scale=site.scale, causal=False, steps=60)
    assert result.loss_after < 0.95 * result.loss_before  # random inputs: softmax is far from any AFT
    lowering = aft.onnx_lowering(site, options, OPSET, module_state(module))
    q, k, v, keep = inputs(12, seed=9)
    out = lowering_session(lowering, 4).run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert relative_error(out, run_pass_module(module, q, k, v, keep)) < 1e-5


# --- whole models, both frontends -----------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"variant": "local", "span": 4}], ids=["simple", "local"])
@pytest.mark.parametrize("name", ["bert-eager", "gpt2-eager"])
def test_exported_models_rewrite_and_match_their_torch_reference(exports, name, options):
    export = exported(exports, name, "legacy")
    model = attnrewrite.rewrite(export.load(), to="aft", **options)
    record = read_record(model)
    assert record["sites_rewritten"] == export.spec.layers
    causal = "causal" in export.spec.mask
    entry = ("Causal" if causal else "") + ("AftLocal" if options else "AftSimple")
    assert {s["replacement"] for s in record["sites"]} == {f"attnrewrite.{entry}"}
    inputs = export.parity_inputs()
    expected, _ = torch_reference(export, "aft", inputs, options=passes.make_options(aft, **options))
    assert relative_error(run_onnx(model, inputs), expected) < 1e-4


def test_fx_rewrite_of_bert(exports):
    rewritten, out, expected = fx_rewrite_of_bert(exports, "aft", variant="local", span=4)
    assert rewritten.meta["attnrewrite"]["sites_rewritten"] == 2
    assert torch.isfinite(out).all() and (out - expected).abs().max() > 1e-4
    assert len([name for name, _ in rewritten.named_parameters() if name.endswith(".position_bias")]) == 2
