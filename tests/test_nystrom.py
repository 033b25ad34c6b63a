"""Nyströmformer: ONNX lowering == torch module, == the reference implementations (the PyPI
``nystrom-attention`` package and transformers' Nystromformer attention), exact where it must
be, masking, padding and batch independence, calibration, both frontends."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from conftest import read_record
from einops import rearrange
from models import SAMPLE_BERT, VOCAB, exact_attention, run_pass_module, text_args, text_feed
from models import relative_error as rel_err
from test_linformer import inputs  # the same q, k, v and right padding

import attnrewrite
from attnrewrite.cli import main
from attnrewrite.passes import ExactPart, OptionError, exact_part, fit, get_pass, make_options, nystrom
from attnrewrite.site import AttentionSite, MaskKind

SCALE = 0.3
D, DV, HEADS = 8, 6, 3


def site(rank=4, mask=MaskKind.KEY_PADDING, scale=SCALE, heads=HEADS):
    return AttentionSite(
        "layer0", scale=scale, mask=mask, rank=rank, head_dim=D, value_dim=DV, num_heads=heads if rank == 4 else None
    )


def onnx_and_torch(options, s=None):
    s = s or site()
    return lowering_session(nystrom.onnx_lowering(s, options, 20), s.rank), nystrom.torch_module(s, options)


def run(session, q, k, v, keep):
    return session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]


# --- implementation parity ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.KEY_PADDING])
def test_onnx_matches_torch_for_every_length(rank, mask):
    # Lengths below, at and past M (exact, then landmarks), M not dividing N, past RANK_BLOCK
    # (the blocked ranks), and cross-attention (Nq != Nk: every query counts).
    options = nystrom.Options(landmarks=8)
    session, module = onnx_and_torch(options, site(rank, mask))
    lead = (2, HEADS) if rank == 4 else (4,)
    for n, nq in ((5, 5), (8, 8), (9, 9), (50, 50), (150, 150), (40, 43)):
        q, k, v, keep = inputs(n, lead, nq=nq, pad=mask is MaskKind.KEY_PADDING)
        keep = keep if mask is MaskKind.KEY_PADDING else np.ones([1] * rank, np.float32)
        out = run(session, q, k, v, keep)
        assert out.shape == (*lead, nq, DV)
        assert rel_err(out, run_pass_module(module, q, k, v, keep)) < 1e-5, n


def test_onnx_without_key_padding_reads_no_keep():
    # Sites without a key padding mask get [1, 1] ones: one [1, N, 1] keep row, the segments
    # built once for every head, key_keep never expanded.
    unmasked = [f.name for f in nystrom.onnx_lowering(site(mask=MaskKind.NONE), nystrom.Options(), 20).functions]
    masked = [f.name for f in nystrom.onnx_lowering(site(), nystrom.Options(), 20).functions]
    assert "AllKept" in unmasked and "KeyKeep" not in unmasked
    assert "KeyKeep" in masked and "AllKept" not in masked
    assert unmasked[-1] == masked[-1] == "Nystrom"


def test_onnx_matches_torch_with_fitted_log_scales_per_head():
    # The [3, H, 1, 1] log scales meet the flattened [B * H] rows in the right order.
    scales = np.random.default_rng(3).normal(0, 0.5, (3, HEADS, 1, 1)).astype(np.float32)
    for s in (site(4), site(3)):
        values = scales if s.rank == 4 else scales[:, :1]
        lowering = nystrom.onnx_lowering(s, nystrom.Options(landmarks=8), 20, weights={"log_scales": values})
        module = nystrom.torch_module(s, nystrom.Options(landmarks=8), learnable=True)
        module.load_state_dict({"log_scales": torch.from_numpy(values)})
        q, k, v, keep = inputs(30, (2, HEADS) if s.rank == 4 else (4,))
        out = run(lowering_session(lowering, s.rank), q, k, v, keep)
        assert rel_err(out, run_pass_module(module, q, k, v, keep)) < 1e-5
        assert (
            rel_err(out, run_pass_module(nystrom.torch_module(s, nystrom.Options(landmarks=8)), q, k, v, keep)) > 1e-3
        )


def test_fp16_inputs_compute_in_fp32_and_return_fp16():
    s = site()
    session = lowering_session(
        nystrom.onnx_lowering(s, nystrom.Options(landmarks=8), 20), 4, dtype=onnx.TensorProto.FLOAT16
    )
    q, k, v, keep = inputs(30)
    out = run(session, q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), keep)
    assert out.dtype == np.float16
    expected = run_pass_module(nystrom.torch_module(s, nystrom.Options(landmarks=8)), q, k, v, keep)
    assert rel_err(out.astype(np.float32), expected) < 1e-2


# --- the reference implementations -----------------------------------------------------------
# Both scale Newton's start by a max over the whole batch (and heads); ours is per (example,
# head). Where theirs is global, the comparison uses one example and one head.


def _reference_qkv(attention, x, heads):
    q, k, v = attention.to_qkv(x).chunk(3, dim=-1)
    return (rearrange(t, "b n (h d) -> b h n d", h=heads).numpy() for t in (q, k, v))


@pytest.mark.parametrize("masked", [False, True])
def test_matches_the_nystrom_attention_package(masked):
    from nystrom_attention import NystromAttention

    torch.manual_seed(0)
    n, m, dim_head = 64, 8, 16
    reference = NystromAttention(dim=32, dim_head=dim_head, heads=1, num_landmarks=m, pinv_iterations=6, residual=False)
    reference.to_out = torch.nn.Identity()  # compare the attention itself, [b, n, h * d]
    reference.eval()
    x = torch.randn(1, n, 32)
    mask = None
    if masked:
        # The same count of padded keys in every segment: the package's landmarks (segments of
        # positions) and ours (segments of kept keys) are then the same keys.
        mask = torch.ones(1, n, dtype=torch.bool)
        mask.view(1, m, n // m)[..., -2:] = False
    with torch.no_grad():
        expected = reference(x, mask=mask).numpy()
        q, k, v = _reference_qkv(reference, x, heads=1)
    s = site(mask=MaskKind.KEY_PADDING if masked else MaskKind.NONE, scale=dim_head**-0.5, heads=1)
    keep = None if mask is None else mask.float().reshape(1, 1, n, 1).numpy()
    ours = rearrange(
        run_pass_module(nystrom.torch_module(s, nystrom.Options(landmarks=m)), q, k, v, keep), "b h n d -> b n (h d)"
    )
    real = slice(None) if mask is None else mask[0].numpy()  # the package's padded queries are junk by design
    assert rel_err(ours[:, real], expected[:, real]) < 1e-4
    session = lowering_session(nystrom.onnx_lowering(s, nystrom.Options(landmarks=m), 20), 4)
    keep = np.ones((1, 1, 1, 1), np.float32) if keep is None else keep
    lowered = rearrange(run(session, q, k, v, keep), "b h n d -> b n (h d)")
    assert rel_err(lowered[:, real], expected[:, real]) < 1e-4


@pytest.mark.parametrize("init, batch, heads", [("original", 1, 1), ("exact", 2, 2)])
def test_matches_transformers_nystromformer_attention(init, batch, heads):
    # transformers' masks only its third softmax (its landmarks average padding too), so it is
    # compared without a mask. Its "original" start is a max over batch and heads; its other
    # option is per (example, head), ours.
    from transformers import NystromformerConfig
    from transformers.models.nystromformer.modeling_nystromformer import NystromformerSelfAttention

    torch.manual_seed(1)
    n, m, dim_head = 64, 8, 16
    config = NystromformerConfig(
        hidden_size=dim_head * heads,
        num_attention_heads=heads,
        num_landmarks=m,
        segment_means_seq_len=n,
        attention_probs_dropout_prob=0.0,
    )
    reference = NystromformerSelfAttention(config).eval()
    reference.conv_kernel_size = None  # no depthwise convolution of the values (the config accepts no None)
    reference.init_option = init
    x = torch.randn(batch, n, config.hidden_size)
    with torch.no_grad():
        expected = reference(x)[0].numpy()
        q, k, v = (
            layer(x).view(batch, n, heads, dim_head).transpose(1, 2).numpy()
            for layer in (reference.query, reference.key, reference.value)
        )
    s = site(mask=MaskKind.NONE, scale=dim_head**-0.5, heads=heads)
    ours = run_pass_module(nystrom.torch_module(s, nystrom.Options(landmarks=m)), q, k, v, None)
    assert rel_err(rearrange(ours, "b h n d -> b n (h d)"), expected) < 1e-4


# --- segments, exactness, masking --------------------------------------------------------------


def test_segments_cut_the_kept_keys_into_near_equal_runs():
    # 10 kept keys, M = 4: rank r in segment floor(4 r / 10), runs of 3, 2, 3, 2; padding (the
    # leading two positions here) in none.
    keep = torch.tensor([0, 0] + [1] * 10, dtype=torch.float32).reshape(1, 12, 1)
    one_hot, count = nystrom.segment_matrix(keep, 4)
    assert one_hot[0].argmax(-1)[2:].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert one_hot[0, :2].abs().sum() == 0
    assert count.flatten().tolist() == [3, 2, 3, 2]
    _, few = nystrom.segment_matrix(keep[:, :5], 4)  # 3 kept keys: 3 landmarks of one key, one empty
    assert few.flatten().tolist() == [1, 1, 1, 0]


def test_n_not_a_multiple_of_m_follows_the_segment_rule():
    # Nyströmformer's formula written out with numpy on the documented segments (N = 50, M = 8).
    n, m = 50, 8
    q, k, v, _ = inputs(n, lead=(1, 1), pad=False)
    bounds = [r * m // n for r in range(n)]
    q_marks, k_marks = (np.stack([x[0, 0][np.equal(bounds, i)].mean(0) for i in range(m)]) for x in (q, k))

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    a = softmax(SCALE * q_marks @ k_marks.T)
    z = a.T / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
    for _ in range(6):
        az = a @ z
        z = 0.25 * z @ (13 * np.eye(m) - az @ (15 * np.eye(m) - az @ (7 * np.eye(m) - az)))
    expected = softmax(SCALE * q[0, 0] @ k_marks.T) @ z @ softmax(SCALE * q_marks @ k[0, 0].T) @ v[0, 0]
    module = nystrom.torch_module(site(mask=MaskKind.NONE, heads=1), nystrom.Options(landmarks=m))
    assert rel_err(run_pass_module(module, q, k, v, None)[0, 0], expected) < 1e-4


def test_up_to_m_kept_keys_is_softmax_attention_per_example():
    # Row 0 has 20 kept keys, row 1 only 8 = M: row 1 is exact although the batch is longer.
    options = nystrom.Options(landmarks=8)
    session, module = onnx_and_torch(options)
    for n in (3, 8):
        q, k, v, keep = inputs(n)
        assert rel_err(run(session, q, k, v, keep), exact_attention(q, k, v, keep, SCALE)) < 1e-5
    q, k, v, keep = inputs(20, pad=False)
    keep[1, ..., 8:, :] = 0.0
    expected = exact_attention(q, k, v, keep, SCALE)
    for out in (run(session, q, k, v, keep), run_pass_module(module, q, k, v, keep)):
        assert rel_err(out[1], expected[1]) < 1e-5
        assert rel_err(out[0], expected[0]) > 1e-2  # 20 keys on 8 landmarks: approximated
    assert exact_part(nystrom, options) == ExactPart(8, 8, "landmarks=8")


@pytest.mark.parametrize("where", ["right", "left"])
def test_padding_and_batch_neighbours_do_not_change_a_sequence(where):
    # A sequence of 70 keys alone, and padded to 150 in a batch beside a full one: the same
    # output at its positions (ranks among kept keys, per-example Newton start).
    options = nystrom.Options(landmarks=8)
    session, module = onnx_and_torch(options)
    q, k, v, _ = inputs(70, lead=(1, HEADS), pad=False)
    alone = run(session, q, k, v, np.ones((1, 1, 70, 1), np.float32))
    q2, k2, v2, _ = inputs(150, pad=False, seed=5)
    real = slice(0, 70) if where == "right" else slice(80, 150)
    q2[1:, :, real], k2[1:, :, real], v2[1:, :, real] = q, k, v
    keep = np.ones((2, 1, 150, 1), np.float32)
    keep[1] = 0.0
    keep[1, :, real] = 1.0
    for out in (run(session, q2, k2, v2, keep), run_pass_module(module, q2, k2, v2, keep)):
        assert rel_err(out[1:, :, real], alone) < 1e-5


def test_padded_keys_do_not_contribute_and_all_padding_gives_zeros():
    session, _ = onnx_and_torch(nystrom.Options(landmarks=8))
    q, k, v, keep = inputs(40)
    out = run(session, q, k, v, keep)
    garbage = np.random.default_rng(1).standard_normal(k.shape).astype(np.float32) * 100
    k2 = np.where(keep == 0, garbage, k)
    v2 = np.where(keep[..., :1] == 0, garbage[..., :DV], v)
    real = keep[:, 0, :, 0] > 0
    assert (
        rel_err(run(session, q, k2, v2, keep)[real[:, None].repeat(HEADS, 1)], out[real[:, None].repeat(HEADS, 1)])
        < 1e-6
    )
    nothing = run(session, q, k, v, np.zeros_like(keep))
    assert np.array_equal(nothing, np.zeros_like(nothing))


def test_causal_and_bias_sites_are_refused_with_the_reason():
    options = nystrom.Options()
    for mask in (MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING):
        assert nystrom.supports(site(mask=mask), options) == (
            "Nystromformer's landmarks mix every position of a segment, so a causal mask cannot be expressed"
        )
    assert nystrom.supports(site(mask=MaskKind.BIAS), options) == (
        "an additive attention bias cannot be expressed on segment-mean landmarks"
    )
    assert nystrom.supports(site(mask=MaskKind.KEY_PADDING), options) is None


def test_registered_and_options_parse_from_strings():
    assert get_pass("nystrom") is nystrom
    options = make_options(nystrom, landmarks="32", pinv_iterations="4")
    assert (options.landmarks, options.pinv_iterations) == (32, 4)
    with pytest.raises(OptionError, match=r"^nystrom option landmarks must be >= 1, got 0$"):
        nystrom.Options(landmarks=0)
    with pytest.raises(OptionError, match="cannot take window=8"):
        make_options(nystrom, window="8")


# --- calibration -------------------------------------------------------------------------------


def test_log_scales_are_the_parameters_and_start_at_the_zero_shot_output():
    s = site()
    learnable = nystrom.torch_module(s, nystrom.Options(landmarks=8), learnable=True)
    assert {name: tuple(p.shape) for name, p in learnable.named_parameters()} == {"log_scales": (3, HEADS, 1, 1)}
    assert not list(nystrom.torch_module(s, nystrom.Options(landmarks=8)).parameters())
    q, k, v, keep = (torch.from_numpy(x) for x in inputs(30))
    frozen = nystrom.torch_module(s, nystrom.Options(landmarks=8))
    assert torch.equal(learnable(q, k, v, keep), frozen(q, k, v, keep))
    learnable(q, k, v, keep).square().sum().backward()
    assert (learnable.log_scales.grad.abs().flatten() > 0).all()  # every kernel, every head


def test_fitting_the_log_scales_lowers_the_output_error():
    s = site()
    module = nystrom.torch_module(s, nystrom.Options(landmarks=8), learnable=True)
    samples = fit.SiteSamples()
    for seed in range(2):
        q, k, v, keep = inputs(24, seed=seed)
        samples.add(q * 3, k * 3, v, keep)  # peaked attention: the zero-shot temperatures are off
    result = fit.fit_site(module, samples, scale=SCALE, causal=False, steps=30)
    assert result.loss_after < 0.9 * result.loss_before
    assert module.log_scales.detach().abs().max() > 1e-3


# --- whole models ------------------------------------------------------------------------------


def test_exported_bert_rewrites_through_both_frontends_alike(exports):
    # The ONNX rewrite (the lowering) and the torch.fx rewrite (the module) of one model, at a
    # length past the landmarks, padding included (text_feed pads the second row).
    export = exports.get("bert-eager", "legacy")
    model = attnrewrite.rewrite(export.load(), to="nystrom", landmarks=4)
    sites = read_record(model)["sites"]
    assert len(sites) == 2 and all(s["replacement"] == "attnrewrite.Nystrom" for s in sites)
    feed = text_feed(11, VOCAB, seed=3)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    lowered = session.run(None, feed)[0]
    args = tuple(torch.from_numpy(x) for x in feed.values())
    program = torch.export.export(export.module, text_args(11))
    with torch.no_grad():
        graph = attnrewrite.rewrite(program, to="nystrom", landmarks=4)
        assert graph.meta["attnrewrite"]["sites_rewritten"] == 2
        expected, original = graph(*args).numpy(), export.module(*args).numpy()
    assert rel_err(lowered, expected) < 1e-4
    assert np.abs(expected - original).max() > 1e-4  # 9 and 11 kept keys on 4 landmarks


def test_cli_calibrates_and_checks(tmp_path, capsys):
    rng = np.random.default_rng(0)
    mask = np.ones((6, 24), np.int64)
    mask[::2, 20:] = 0
    np.savez(tmp_path / "data.npz", input_ids=rng.integers(0, 1000, (6, 24)), attention_mask=mask)
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "nystrom", "-O", "landmarks=4", "-o", str(out), "--check", "--seq", "24"]
    assert main([*argv, "--calibrate", str(tmp_path / "data.npz"), "--calibrate-steps", "20"]) == 0
    printed = capsys.readouterr().out
    assert "inputs: generated (batch 2, seq 24, seed 0)" in printed  # the check ran past the 4 landmarks
    model = onnx.load(out)
    record = read_record(model)
    assert [s["replacement"] for s in record["sites"]] == ["attnrewrite.Nystrom"] * 2
    assert [s["calibration"]["steps"] for s in record["sites"]] == [20, 20]
    scales = [t for t in model.graph.initializer if t.name.endswith("/log_scales")]
    assert [tuple(t.dims) for t in scales] == [(3, 4, 1, 1)] * 2  # per head of tiny_bert's 4


# --- bench/nystrom_reference.py: the variants FIDELITY.md compares on MiniLM ------------------


def test_reference_script_formula_is_the_module_and_the_package_and_its_segment_rules():
    from models import load_bench_module

    reference = load_bench_module("nystrom_reference")
    reference.check_the_parts()  # plain at our choices is the module, at the package's the package
    keep = torch.tensor([1.0] * 10 + [0.0] * 2).reshape(1, 12, 1)  # 10 kept keys, then padding
    # the package's rule: 12 positions padded at the front to 15, runs of 3: the first landmark is
    # front padding alone, the last holds one kept key and the two padded ones, which count in none
    one_hot, count = reference.position_segments(keep, 5)
    assert one_hot[0].argmax(-1)[:10].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert count.flatten().tolist() == [0, 3, 3, 3, 1]
    # [CLS] and [SEP] (first and last kept) a landmark each, the 8 between them in 3 runs
    one_hot, count = reference.own_special_segments(keep, 5)
    assert one_hot[0].argmax(-1)[:10].tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    assert count.flatten().tolist() == [1, 3, 3, 2, 1]
    assert reference.without_specials(keep).flatten().tolist() == [0.0] + [1.0] * 8 + [0.0] * 3
