"""Streaming attention (attnrewrite/passes/streaming.py): the torch module == its definition written
per query == the ONNX lowering, rank 3 and 4, with and without key padding; recent >= N is causal
softmax; a left-padded row is its unpadded twin; the recurrent form stepped (token by token and in
uneven pieces) == the parallel form, torch and onnxruntime, batch 2, grouped heads; a KV-cache
decoder rewritten with --recurrent steps to its parallel rewrite's logits; refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_graphs import lowering_session
from conftest import decoder_exported, read_record
from models import padded_at_both_ends, relative_error, run_pass_module
from test_fx_export import run_onnx, to_onnx, torch_output
from test_fx_transformers import build, exported, model_inputs
from test_recurrent import session_for
from test_recurrent_models import (
    TOLERANCE,
    full_sequence,
    logits_error,
    prefill_then_steps,
    session,
    stepped,
)

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.passes import recurrent, streaming
from attnrewrite.site import AttentionSite, KvCache, MaskKind

B, H, D = 2, 4, 8
OPSET = 20


def make_site(mask=MaskKind.CAUSAL_KEY_PADDING, rank=4, kv_heads=None) -> AttentionSite:
    cache = None if kv_heads is None else KvCache("past_key", "past_value", None, None, kv_heads)
    heads = H if rank == 4 else None
    return AttentionSite(
        "layer0", scale=0.5, mask=mask, rank=rank, num_heads=heads, head_dim=D, value_dim=D, kv_cache=cache
    )


def inputs(n, lead=(B, H), kv_lead=None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*lead, n, D)).astype(np.float32)
    k, v = (rng.standard_normal((*(kv_lead or lead), n, D)).astype(np.float32) for _ in range(2))
    return q, k, v


def definition(q, k, v, keep, scale, sinks, recent) -> np.ndarray:
    """Per query: softmax over the real keys j <= i that are among the first ``sinks`` real keys
    or the last ``recent`` real keys up to i; 0 where there is none. float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    keep = np.broadcast_to(keep, (*k.shape[:-1], 1))[..., 0] > 0
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for index in np.ndindex(*q.shape[:-2]):
        real = keep[index]
        rank = np.cumsum(real) - real  # real keys before each key
        for i in range(q.shape[-2]):
            seen = real[: i + 1].sum()
            chosen = [j for j in range(i + 1) if real[j] and (rank[j] < sinks or seen - rank[j] <= recent)]
            if chosen:
                logits = scale * k[index][chosen] @ q[index][i]
                weights = np.exp(logits - logits.max())
                out[index][i] = weights @ v[index][chosen] / weights.sum()
    return out


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("mask", [MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING], ids=lambda m: m.value)
@pytest.mark.parametrize("sinks, recent", [(0, 3), (2, 3), (4, 1), (1, 20)])
def test_onnx_equals_torch_equals_the_definition(mask, rank, sinks, recent):
    site, options = make_site(mask, rank), streaming.Options(recent=recent, sinks=sinks)
    module = streaming.torch_module(site, options)
    session = lowering_session(streaming.onnx_lowering(site, options, OPSET), rank)
    lead = (B, H) if rank == 4 else (B * H,)
    for n in (1, 3, 7, 12):
        q, k, v = inputs(n, lead)
        keep = (
            padded_at_both_ends(lead, n)
            if mask.key_padding
            else np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
        )
        expected = run_pass_module(module, q, k, v, keep if mask.key_padding else None)
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        assert relative_error(out, expected) < 1e-5, n
        assert relative_error(expected, definition(q, k, v, keep, 0.5, sinks, recent)) < 1e-5, n


def test_recent_at_least_n_is_causal_softmax():
    q, k, v = inputs(9)
    causal = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True, scale=0.5
    )
    for sinks in (0, 4, 30):
        module = streaming.torch_module(make_site(MaskKind.CAUSAL), streaming.Options(recent=9, sinks=sinks))
        assert relative_error(run_pass_module(module, q, k, v, None), causal.numpy()) < 1e-5


def test_a_left_padded_row_is_its_unpadded_twin():
    site, options = make_site(), streaming.Options(recent=3, sinks=2)
    module, session = (
        streaming.torch_module(site, options),
        lowering_session(streaming.onnx_lowering(site, options, OPSET), 4),
    )
    q, k, v = inputs(10, (1, H))
    pad = 4
    padded = [np.concatenate([np.full((1, H, pad, D), 7.0, np.float32), x], axis=-2) for x in (q, k, v)]
    keep = np.ones((1, 1, 10 + pad, 1), np.float32)
    keep[..., :pad, :] = 0.0
    twin = run_pass_module(module, q, k, v, None)
    assert relative_error(run_pass_module(module, *padded, keep)[..., pad:, :], twin) < 1e-6
    onnx_out = session.run(None, dict(q=padded[0], k=padded[1], v=padded[2], key_keep=keep))[0]
    assert relative_error(onnx_out[..., pad:, :], twin) < 1e-5


# --- the recurrent form --------------------------------------------------------------------------


def pieces(schedule):
    start = 0
    for size in schedule:
        yield slice(start, start + size)
        start += size


def zero_state(site, options, kv_heads):
    sizes = {"B": B, "H": H, "Hkv": kv_heads, "G": B * H, "D": D, "Dv": D}
    return recurrent.zero_state(streaming.recurrence(options).state(site), sizes)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["heads", "grouped"])
@pytest.mark.parametrize(
    "schedule", [[1] * 15, [3, 1, 5, 2, 4], [9, 1, 1, 1, 1, 1, 1]], ids=["tokens", "uneven", "prefill"]
)
def test_recurrent_steps_equal_the_parallel_form_in_torch_and_onnx(schedule, kv_heads, sinks):
    site, options = make_site(kv_heads=kv_heads), streaming.Options(recent=4, sinks=sinks)
    groups = recurrent.key_value_groups(site)
    q, k, v = inputs(15, kv_lead=(B, H // groups), seed=1)
    keep = np.ones((B, 1, 15, 1), np.float32)
    keep[1, :, :4] = 0.0  # left padding
    parallel = streaming.torch_module(site, options)
    expected = run_pass_module(parallel, q, np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1), keep)
    form = streaming.recurrence(options)
    module, names = form.torch_module(site, parallel), [t.name for t in form.state(site)]
    onnx = session_for(site, options, None)
    torch_state = [torch.from_numpy(x) for x in zero_state(site, options, H // groups)]
    onnx_state = zero_state(site, options, H // groups)
    for piece in pieces(schedule):
        step = [x[..., piece, :] for x in (q, k, v, keep)]
        with torch.no_grad():
            out, *torch_state = module(*(torch.from_numpy(x) for x in step), *torch_state)
        onnx_out, *onnx_state = onnx.run(None, dict(zip(["q", "k", "v", "key_keep", *names], [*step, *onnx_state])))
        assert relative_error(out.numpy(), expected[..., piece, :]) < 1e-5, piece
        assert relative_error(onnx_out, expected[..., piece, :]) < 1e-5, piece
        assert [s.shape for s in onnx_state] == [tuple(s.shape) for s in torch_state]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(onnx_state, torch_state))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoders_prefill_then_decode_as_their_parallel_rewrite(decoder_exports, name):
    """--to streaming --recurrent on a KV-cache export, recent=4 sinks=1 over 14 tokens (keys
    leave the window), stepped: the logits of the parallel rewrite of the no-cache export."""
    cached = decoder_exported(decoder_exports, name, "legacy")
    uncached = decoder_exported(decoder_exports, name, "legacy", cache=False)
    full = full_sequence(cached.spec)
    options = {"recent": 4, "sinks": 1}
    expected = session(attnrewrite.rewrite(str(uncached.path), "streaming", **options)).run(["logits"], full)[0]
    scale = np.abs(expected).max()
    recurrent_model = attnrewrite.rewrite(str(cached.path), "streaming", recurrent=True, **options)
    assert read_record(recurrent_model)["sites_rewritten"] == cached.spec.layers
    recurrent_session = session(recurrent_model)
    for (start, end), (logits, _) in zip(prefill_then_steps(), stepped(recurrent_session, full, prefill_then_steps())):
        error = logits_error(logits, expected[:, :end], full["attention_mask"][:, :end])
        assert error <= TOLERANCE * scale, (start, end, error)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_both_frontends_rewrite_gpt2_alike(attention):
    """torch.fx and ONNX, recent=2 sinks=1 (keys dropped), on GPT-2 with a right-padded row:
    the same outputs, unlike the original's."""
    names, args = ["input_ids", "attention_mask"], model_inputs("gpt2")
    fx = rewrite_graph_module(exported("gpt2", attention), streaming.Options(recent=2, sinks=1))
    from_fx = torch_output(fx, args)
    onnx_rewritten = attnrewrite.rewrite(
        to_onnx(build("gpt2", attention), args, names), to="streaming", recent=2, sinks=1
    )
    assert read_record(onnx_rewritten)["sites_rewritten"] == fx.meta["attnrewrite"]["sites_rewritten"] > 0
    assert relative_error(run_onnx(onnx_rewritten, names, args), from_fx) < 1e-5
    assert relative_error(torch_output(build("gpt2", attention), args), from_fx) > 1e-3


# --- refusals, options ---------------------------------------------------------------------------


def test_refusals_say_why():
    options = streaming.Options()
    assert streaming.supports(make_site(MaskKind.BIAS), options) == (
        "an additive attention bias cannot be expressed by keeping or dropping keys"
    )
    assert streaming.supports(make_site(MaskKind.KEY_PADDING), options) == (
        "the most recent keys are a decoder's cache: a bidirectional site has no last keys to keep"
    )
    assert streaming.supports(make_site(MaskKind.CAUSAL), options) is None
    assert passes.nothing_to_fit(streaming, options) == (
        "streaming has nothing to fit (the keys it keeps are attended to exactly)"
    )
    assert passes.exact_part(streaming, options, True) == passes.ExactPart(128, 128, "recent=124, sinks=4")


def test_registered_and_options_parse_from_strings():
    assert passes.get_pass("streaming") is streaming
    options = passes.make_options(streaming, recent="16", sinks="0")
    assert (options.recent, options.sinks) == (16, 0)
    with pytest.raises(passes.OptionError, match="recent"):
        passes.make_options(streaming, recent="0")
    with pytest.raises(passes.OptionError, match="cannot take window=4"):
        passes.make_options(streaming, window="4")
