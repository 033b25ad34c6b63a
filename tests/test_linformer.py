"""Linformer: ONNX lowering == torch reference, exact where it must be, masking, limits."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from conftest import read_record
from models import SAMPLE_BERT, exact_attention, run_pass_module, text_args, text_feed
from models import relative_error as rel_err

import attnrewrite
from attnrewrite.passes import OptionError, get_pass, linformer, make_options
from attnrewrite.site import AttentionSite, MaskKind

SCALE = 0.3
D, DV = 8, 6


def inputs(n: int, lead=(2, 3), nq=None, pad=True, seed=0):
    rng = np.random.default_rng(seed)
    nq = n if nq is None else nq
    q = rng.standard_normal((*lead, nq, D)).astype(np.float32)
    k = rng.standard_normal((*lead, n, D)).astype(np.float32)
    v = rng.standard_normal((*lead, n, DV)).astype(np.float32)
    keep = np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    if pad:  # right padding of a different length per batch row
        for b in range(lead[0]):
            keep[b, ..., n - 1 - 3 * b :, :] = 0.0
    return q, k, v, keep


def site(rank=4, mask=MaskKind.KEY_PADDING):
    return AttentionSite("layer0", scale=SCALE, mask=mask, rank=rank, head_dim=D, value_dim=DV)


@pytest.mark.parametrize("projection", linformer.PROJECTIONS)
@pytest.mark.parametrize("share_kv", [False, True])
@pytest.mark.parametrize("rank", [3, 4])
def test_onnx_matches_torch_for_every_length(projection, share_kv, rank):
    # One session, sequence lengths below, at and above k (the exact shortcut and the projection).
    options = linformer.Options(proj_dim=16, projection=projection, share_kv=share_kv, max_len=64)
    s = site(rank)
    session = lowering_session(linformer.onnx_lowering(s, options, 20), rank)
    module = linformer.torch_module(s, options)
    lead = (2, 3) if rank == 4 else (4,)
    for n in (5, 16, 17, 40, 64):
        q, k, v, keep = inputs(n, lead, nq=n + 3)
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        assert out.shape == (*lead, n + 3, DV)
        assert rel_err(out, run_pass_module(module, q, k, v, keep)) < 1e-5, n


@pytest.mark.parametrize("projection", linformer.PROJECTIONS)
def test_onnx_without_key_padding_reads_no_keep_and_selects_nothing(projection):
    # The frontend passes a [1, 1] ones tensor for sites without a key padding mask; their
    # lowering is the unmasked one: no product with key_keep, no Where on the logits.
    options = linformer.Options(proj_dim=8, projection=projection, max_len=64)
    s = site(mask=MaskKind.NONE)
    lowering = linformer.onnx_lowering(s, options, 20)
    names = [f.name for f in lowering.functions]
    assert "LowRank" in names and not {"KeyKeep", "Project", "AttendProjected", "KeptLowRank"} & set(names)
    assert not [n for f in lowering.functions for n in f.node if n.op_type == "Where"]
    masked = [f.name for f in linformer.onnx_lowering(site(), options, 20).functions]
    assert "AttendProjected" in masked and "LowRank" not in masked
    session = lowering_session(lowering, 4, keep_rank=2)
    module = linformer.torch_module(s, options)
    for n in (5, 8, 9, 20, 64):
        q, k, v, _ = inputs(n, pad=False)
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.ones((1, 1), np.float32)))[0]
        assert rel_err(out, run_pass_module(module, q, k, v, None)) < 1e-5, n


def test_identity_projection_with_k_equal_n_is_softmax_attention():
    # The projection path itself (shortcut off) with E = F = I and k = N: exactly softmax
    # attention, key padding included (padded keys' projected columns hold no kept key).
    n = 24
    options = linformer.Options(proj_dim=n, projection="identity", max_len=n, exact_if_short=False)
    q, k, v, keep = inputs(n)
    expected = exact_attention(q, k, v, keep, SCALE)
    assert rel_err(run_pass_module(linformer.torch_module(site(), options), q, k, v, keep), expected) < 1e-6
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    assert rel_err(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0], expected) < 1e-6


def test_pool_with_k_equal_n_is_softmax_attention():
    n = 24  # one key per segment; padded keys' segments are left out of the softmax
    options = linformer.Options(proj_dim=n, projection="pool")
    q, k, v, keep = inputs(n)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    assert (
        rel_err(
            session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0],
            exact_attention(q, k, v, keep, SCALE),
        )
        < 1e-6
    )


@pytest.mark.parametrize("projection", ["gaussian", "learned", "pool"])
def test_short_sequences_are_exact_and_longer_ones_are_not(projection):
    options = linformer.Options(proj_dim=16, projection=projection, max_len=64)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    for n in (3, 16):
        q, k, v, keep = inputs(n)
        assert (
            rel_err(
                session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0],
                exact_attention(q, k, v, keep, SCALE),
            )
            < 1e-6
        )
    q, k, v, keep = inputs(17)  # one past k: a real projection, no longer softmax attention
    assert (
        rel_err(
            session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0],
            exact_attention(q, k, v, keep, SCALE),
        )
        > 1e-2
    )


@pytest.mark.parametrize("projection", linformer.PROJECTIONS)
def test_padded_keys_do_not_contribute(projection):
    options = linformer.Options(proj_dim=8, projection=projection, max_len=64)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    q, k, v, keep = inputs(40)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    garbage = np.random.default_rng(1).standard_normal(k.shape).astype(np.float32) * 100
    k2 = np.where(keep == 0, garbage, k)
    v2 = np.where(keep[..., :1] == 0, garbage[..., :DV], v)
    assert np.array_equal(session.run(None, dict(q=q, k=k2, v=v2, key_keep=keep))[0], out)


@pytest.mark.parametrize("projection", ["gaussian", "learned"])
def test_right_padding_gives_the_unpadded_result(projection):
    # Kept keys meet the same rows of E whether or not padding follows them.
    options = linformer.Options(proj_dim=8, projection=projection, max_len=64)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    q, k, v, _ = inputs(30, lead=(1, 2), pad=False)
    keep_all = np.ones((1, 1, 30, 1), np.float32)
    unpadded = session.run(None, dict(q=q, k=k, v=v, key_keep=keep_all))[0]

    def pad(x):  # 10 more positions of junk
        return np.concatenate([x, np.full((1, 2, 10, x.shape[-1]), 7.0, np.float32)], axis=2)

    keep = np.concatenate([keep_all, np.zeros((1, 1, 10, 1), np.float32)], axis=2)
    padded = session.run(None, dict(q=q, k=pad(k), v=pad(v), key_keep=keep))[0]
    assert rel_err(padded, unpadded) < 1e-5


def test_pool_averages_kept_keys_per_segment():
    # N = 6 keys in k = 3 segments {0,1} {2,3} {4,5}; keys 3, 4, 5 padded: the second segment is
    # key 2 alone and the third, with no kept key, is out of the softmax.
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, n, D)).astype(np.float32) for n in (4, 6, 6))
    keep = np.array([1, 1, 1, 0, 0, 0], np.float32).reshape(1, 1, 6, 1)
    keys = np.stack([k[0, 0, :2].mean(0), k[0, 0, 2]])
    values = np.stack([v[0, 0, :2].mean(0), v[0, 0, 2]])
    logits = SCALE * q[0, 0] @ keys.T
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ values
    options = linformer.Options(proj_dim=3, projection="pool")
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    assert rel_err(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0][0, 0], expected) < 1e-6


def test_all_keys_padded_gives_zeros_not_nan():
    options = linformer.Options(proj_dim=4, projection="gaussian", max_len=64)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    q, k, v, keep = inputs(10)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.zeros_like(keep)))[0]
    assert np.array_equal(out, np.zeros_like(out))


def test_sequence_past_max_len_fails_with_a_readable_message():
    options = linformer.Options(proj_dim=4, projection="gaussian", max_len=12)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    q, k, v, keep = inputs(12)
    session.run(None, dict(q=q, k=k, v=v, key_keep=keep))  # max_len itself runs
    q, k, v, keep = inputs(13)
    with pytest.raises(Exception, match="sequence_longer_than_max_len_12"):
        session.run(None, dict(q=q, k=k, v=v, key_keep=keep))
    with pytest.raises(ValueError, match="max_len 12"):
        run_pass_module(linformer.torch_module(site(), options), q, k, v, keep)


def test_pool_runs_for_any_length():
    options = linformer.Options(proj_dim=8, projection="pool")
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4)
    module = linformer.torch_module(site(), options)
    for n in (1, 9, 31, 100):  # k does not divide N
        q, k, v, _ = inputs(n, pad=False)
        keep = np.ones((2, 1, n, 1), np.float32)
        assert (
            rel_err(
                session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0],
                run_pass_module(module, q, k, v, keep),
            )
            < 1e-5
        )


def test_fp16_inputs_compute_in_fp32_and_return_fp16():
    options = linformer.Options(proj_dim=8, projection="gaussian", max_len=64)
    session = lowering_session(linformer.onnx_lowering(site(), options, 20), 4, dtype=onnx.TensorProto.FLOAT16)
    q, k, v, keep = inputs(30)
    out = session.run(
        None,
        dict(q=q.astype(np.float16), k=k.astype(np.float16), v=v.astype(np.float16), key_keep=keep),
    )[0]
    assert out.dtype == np.float16
    expected = run_pass_module(linformer.torch_module(site(), options), q, k, v, keep)
    assert rel_err(out.astype(np.float32), expected) < 1e-2


def test_causal_and_bias_sites_are_refused_with_a_reason():
    options = linformer.Options()
    for mask in (MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING):
        assert "causal" in linformer.supports(site(mask=mask), options)
    assert "bias" in linformer.supports(site(mask=MaskKind.BIAS), options)
    assert linformer.supports(site(mask=MaskKind.KEY_PADDING), options) is None


def test_learned_projections_are_parameters_that_train():
    module = linformer.torch_module(site(), linformer.Options(proj_dim=4, projection="learned", max_len=32))
    assert {name for name, _ in module.named_parameters()} == {"E", "F"}
    q, k, v, keep = (torch.from_numpy(x) for x in inputs(20))
    module(q, k, v, keep).square().sum().backward()
    assert module.E.grad.abs().sum() > 0 and module.F.grad.abs().sum() > 0
    assert module.E.grad[20:].abs().sum() == 0  # rows past N are not used
    shared = linformer.torch_module(
        site(), linformer.Options(proj_dim=4, projection="learned", share_kv=True, max_len=32)
    )
    assert len(list(shared.parameters())) == 1


def test_gaussian_projection_is_seeded_with_jl_scale():
    e, f = linformer.projection_matrices(linformer.Options(proj_dim=64, max_len=512, seed=3))
    e2, _ = linformer.projection_matrices(linformer.Options(proj_dim=64, max_len=512, seed=3))
    e3, _ = linformer.projection_matrices(linformer.Options(proj_dim=64, max_len=512, seed=4))
    assert np.array_equal(e, e2) and not np.array_equal(e, e3) and not np.array_equal(e, f)
    assert abs(e.std() - 1 / 8) < 0.005 and abs(e.mean()) < 0.005
    shared_e, shared_f = linformer.projection_matrices(linformer.Options(proj_dim=64, max_len=512, share_kv=True))
    assert shared_e is shared_f


def test_lowering_stores_the_drawn_matrices_and_shares_bodies_across_scales():
    options = linformer.Options(proj_dim=4, max_len=16)
    a = linformer.onnx_lowering(site(), options, 20)
    b = linformer.onnx_lowering(AttentionSite("layer1", scale=0.9, mask=MaskKind.KEY_PADDING, rank=4), options, 20)
    assert np.array_equal(a.constants["E"], linformer.projection_matrices(options)[0])
    assert a.constants["scale"] == np.float32(SCALE) and b.constants["scale"] == np.float32(0.9)
    assert [f.SerializeToString() for f in a.functions] == [f.SerializeToString() for f in b.functions]
    shared = linformer.onnx_lowering(site(), linformer.Options(proj_dim=4, max_len=16, share_kv=True), 20)
    assert "F" not in shared.constants and shared.op_type == "LinformerSharedKV"


def test_registered_and_options_parse_from_strings():
    assert get_pass("linformer") is linformer
    options = make_options(linformer, proj_dim="32", projection="pool", share_kv="true")
    assert (options.proj_dim, options.projection, options.share_kv) == (32, "pool", True)
    with pytest.raises(OptionError, match="projection"):  # a user error, not a crash
        make_options(linformer, projection="random")
    with pytest.raises(OptionError, match=r"^linformer option max_len must be >= proj_dim \(64\), got 32$"):
        linformer.Options(proj_dim=64, max_len=32)


# --- whole models, through the ONNX frontend -------------------------------------------------


@pytest.mark.parametrize(
    "options, op_type",
    [
        ({"proj_dim": 16}, "attnrewrite.Linformer"),
        ({"proj_dim": 16, "projection": "pool"}, "attnrewrite.LinformerPool"),
    ],
)
def test_exported_bert_rewrites_and_runs(options, op_type):
    original = onnx.load(SAMPLE_BERT)
    model = attnrewrite.rewrite(original, to="linformer", **options)
    sites = read_record(model)["sites"]
    assert len(sites) == 2 and all(s["status"] == "rewritten" and s["replacement"] == op_type for s in sites)
    before = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (5, 16, 40):
        feed = text_feed(n, 1000, seed=n)
        expected, out = before.run(None, feed)[0], after.run(None, feed)[0]
        assert out.shape == expected.shape and np.isfinite(out).all()
        if n <= 16:  # N <= proj_dim: exact attention, so the whole model is unchanged
            assert np.abs(out - expected).max() < 1e-5, n
        else:
            assert np.abs(out - expected).max() > 1e-4, n


def test_exported_gpt2_causal_sites_are_skipped_with_the_reason(exports):
    original = exports.get("gpt2-eager", "legacy").load()
    model = attnrewrite.rewrite(original, to="linformer")
    sites = read_record(model)["sites"]
    assert len(sites) == 2
    for s in sites:
        assert s["mask"].startswith("causal") and s["status"] == "skipped"
        assert s["reason"] == linformer.supports(AttentionSite("x", mask=MaskKind(s["mask"])), linformer.Options())
    assert not any(node.domain == "attnrewrite" for node in model.graph.node)


def test_fx_rewrite_of_bert(exports):
    model = exports.module("bert-eager")  # 2 layers of eager attention, traced at 24 tokens
    program = torch.export.export(model, text_args(24))
    args = text_args(24, seed=1)
    with torch.no_grad():
        expected = model(*args)
        exact = attnrewrite.rewrite(program, to="linformer", proj_dim=24)  # N <= k
        assert exact.meta["attnrewrite"]["sites_rewritten"] == 2
        assert (exact(*args) - expected).abs().max() < 1e-5
        learned = attnrewrite.rewrite(program, to="linformer", proj_dim=8, projection="learned")
        assert (learned(*args) - expected).abs().max() > 1e-4
    projections = [name for name, _ in learned.named_parameters() if name.endswith((".E", ".F"))]
    assert len(projections) == 4  # E and F of both layers, trainable


def test_calibrating_on_inputs_it_is_exact_on_fits_nothing_and_keeps_the_draw():
    """Every calibration sequence (8 tokens) is within proj_dim = 8: the replacement is softmax
    attention itself there, no fitted value reaches the loss, and the drawn projections stay."""
    plain = attnrewrite.rewrite(str(SAMPLE_BERT), "linformer", proj_dim=8, validate=False)
    fitted = attnrewrite.rewrite(
        str(SAMPLE_BERT), "linformer", proj_dim=8, validate=False, calibrate=text_feed(8, 100), calibrate_steps=2
    )
    drawn = {t.name: onnx.numpy_helper.to_array(t) for t in plain.graph.initializer}
    kept = {t.name: onnx.numpy_helper.to_array(t) for t in fitted.graph.initializer}
    assert [s["calibration"]["loss_after"] for s in read_record(fitted)["sites"]] == [
        s["calibration"]["loss_before"] for s in read_record(fitted)["sites"]
    ]
    for name, array in drawn.items():
        np.testing.assert_array_equal(kept[name], array)
