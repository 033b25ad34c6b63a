"""The local-softmax + kernel hybrid (``window=W``, passes/window/) shared by
linear, favor and hedgehog: its exact keys (previous, own and, bidirectional, next block, and
the sinks), equal to its definition written as an N x N matrix, exact softmax when the window
covers the sequence, sinks kept from the kernel, ONNX == torch, causal, NaN-free where keys are
missing, the options changing nothing without a window, and refused by the methods it cannot
serve."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_graphs import lowering_session
from models import exact_attention, relative_error, run_pass_module
from windows import windowed, windowed_weights

from attnrewrite.passes import OptionError, favor, get_pass, hedgehog, linear, make_options
from attnrewrite.passes.kernel.chunks import PREFIX_GROUP
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.window import lowering as window_lowering
from attnrewrite.passes.window import torch_form
from attnrewrite.site import AttentionSite, MaskKind

WINDOWED = (linear, favor, hedgehog)
B, H, D, DV = 2, 3, 8, 5
SCALE = D**-0.5
LOWEST = LOWEST_LOG_SCALE
# (window_next, sinks): the exact keys' variants the tests run through
EXACT_KEYS = [(False, 0), (True, 0), (False, 1), (True, 1), (False, 3), (True, 3)]
exact_keys_ids = lambda value: f"next={value[0]}-sinks={value[1]}"  # noqa: E731


def make_site(mask: MaskKind, rank: int = 4) -> AttentionSite:
    heads = H if rank == 4 else None
    return AttentionSite("attn", scale=SCALE, mask=mask, rank=rank, num_heads=heads, head_dim=D, value_dim=DV)


def qkv(n: int, seed: int = 0, std: float = 2.0, lead=(B, H)):
    rng = np.random.default_rng(seed)
    return tuple((rng.standard_normal((*lead, n, d)) * std).astype(np.float32) for d in (D, D, DV))


def padded_keep(n: int, lead_batch: int = B, left: int = 3, right: int = 13) -> np.ndarray:
    """[batch, 1, n, 1]: row 0 full, the others padded at both ends."""
    keep = np.ones((lead_batch, 1, n, 1), np.float32)
    keep[1:, :, :left] = 0.0
    keep[1:, :, n - right :] = 0.0
    return keep


def exact(q, k, v, keep, causal: bool) -> np.ndarray:
    """Softmax attention; a row without any key (left padding under a causal mask) is 0."""
    return np.nan_to_num(exact_attention(q, k, v, keep, SCALE, causal))


def fitted_module(method, site, options, seed: int = 0):
    """The method's module with every fittable value moved off its initial value (as fitting
    would): linear_log_weight per head, and for hedgehog W and b."""
    module = (
        method.torch_module(site, options, learnable=True) if method is hedgehog else method.torch_module(site, options)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return module


# --- the definition, as an N x N matrix ---------------------------------------------------------


def windowed_by_definition(
    phi_q,
    phi_k,
    q,
    k,
    v,
    keep,
    window,
    causal,
    exact_keys,
    log_weight,
    query_log_scale=None,
    key_log_scale=None,
    local_max_weight=None,
):
    """windowed_attention_weights (the N x N definition: exact e^(s_ij - m_i) on the
    previous, own and next block and the sinks, w phi_i.phi_j [e^(a_i + b_j - beta m_i)]
    elsewhere, one normaliser) in float64, times v."""
    as64 = lambda x: None if x is None else torch.as_tensor(x).double()  # noqa: E731
    window_next, sinks = exact_keys
    weights = windowed_weights(
        as64(phi_q),
        as64(phi_k),
        as64(q),
        as64(k),
        scale=SCALE,
        window=window,
        causal=causal,
        window_next=window_next,
        sinks=sinks,
        key_keep=as64(keep),
        linear_log_weight=as64(log_weight),
        query_log_scale=as64(query_log_scale),
        key_log_scale=as64(key_log_scale),
        local_max_weight=as64(local_max_weight),
        eps=0.0,
    )
    return torch.nan_to_num(weights @ as64(v)).numpy()  # a row without any key: 0, as the kernels give


def elu_features(q, k, keep):
    phi = lambda x: torch.nn.functional.elu(torch.from_numpy(x)) + 1  # noqa: E731
    return phi(q), phi(k) * torch.from_numpy(keep)


# N = 7 in windows of 3: blocks {0}, {1, 2, 3}, {4, 5, 6} (the layout pads 5 rows in front).
# Each query's keys in the previous and its own block, and with the next block too.
LOCAL_KEYS = np.array([[1, 0, 0, 0, 0, 0, 0]] + [[1, 1, 1, 1, 0, 0, 0]] * 3 + [[0, 1, 1, 1, 1, 1, 1]] * 3, bool)
# Causal blocks are aligned to the start, {0, 1, 2}, {3, 4, 5}, {6}: no output depends on later tokens.
CAUSAL_LOCAL_KEYS = np.array([[1, 1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 1, 0]] * 3 + [[0, 0, 0, 1, 1, 1, 1]], bool)
WITH_NEXT_KEYS = np.array([[1, 1, 1, 1, 0, 0, 0]] + [[1, 1, 1, 1, 1, 1, 1]] * 3 + [[0, 1, 1, 1, 1, 1, 1]] * 3, bool)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("exact_keys", EXACT_KEYS, ids=exact_keys_ids)
def test_exact_keys_are_the_neighbouring_blocks_and_the_sinks(causal, exact_keys):
    """With a zero kernel part the hybrid is softmax over exactly the exact keys: previous and
    own block, the next one when bidirectional with window_next, and positions < sinks."""
    window_next, sinks = exact_keys
    q, k, v = (torch.from_numpy(x) for x in qkv(7))
    zero = torch.zeros(B, H, 7, 4)
    local = CAUSAL_LOCAL_KEYS.copy() if causal else (WITH_NEXT_KEYS if window_next else LOCAL_KEYS).copy()
    local[:, :sinks] = True
    if causal:
        local &= np.tri(7, dtype=bool)
    options = dict(scale=SCALE, window=3, causal=causal, window_next=window_next, sinks=sinks)
    weights = windowed_weights(zero, zero, q, k, **options)
    np.testing.assert_array_equal(weights.numpy() > 0, np.broadcast_to(local, (B, H, 7, 7)))
    logits = (SCALE * q @ k.transpose(-2, -1)).masked_fill(torch.from_numpy(~local), -math.inf)
    expected = torch.softmax(logits, -1) @ v
    out = windowed(zero, zero, q, k, v, **options)
    assert relative_error(out.numpy(), expected.numpy()) < 3e-6  # float32 rounding


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [16, 7])
@pytest.mark.parametrize("exact_keys", EXACT_KEYS, ids=exact_keys_ids)
def test_kernel_equals_its_definition(causal, window, exact_keys):
    """Key padding at both ends: in the second batch row the first 3 positions, so sinks are
    padded there (sinks=3 straddles two blocks for both windows). Bidirectional N = 100: every
    block has far keys (test_far_sums_rounding_is_bounded takes rows that have almost none)."""
    n = 50 if causal else 100  # bidirectional: every block has far keys
    q, k, v = qkv(n)
    keep = np.broadcast_to(padded_keep(n), (B, H, n, 1)).copy()
    phi_q, phi_k = elu_features(q, k, keep)
    log_weight = torch.randn(H, 1, 1, generator=torch.Generator().manual_seed(1))
    window_next, sinks = exact_keys
    out = windowed(
        phi_q,
        phi_k,
        *map(torch.from_numpy, (q, k, v)),
        scale=SCALE,
        window=window,
        causal=causal,
        window_next=window_next,
        sinks=sinks,
        key_keep=torch.from_numpy(keep),
        linear_log_weight=log_weight,
    )
    expected = windowed_by_definition(phi_q, phi_k, q, k, v, keep, window, causal, exact_keys, log_weight)
    assert relative_error(out.numpy(), expected) < 1e-5


@pytest.mark.parametrize("max_weighted", [False, True], ids=["unit-max", "max-weighted"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [16, 7])
@pytest.mark.parametrize("exact_keys", EXACT_KEYS, ids=exact_keys_ids)
def test_kernel_with_log_scales_equals_its_definition(causal, window, exact_keys, max_weighted):
    """FAVOR+'s form: features stabilised per query row, per head (bidirectional) or per key
    (causal, log scales spread over +-30 so that the carry between blocks matters); hedgehog's
    form also weighs the exact part's row max per head (local_max_weight)."""
    n = 50 if causal else 100  # bidirectional: every block has far keys
    q, k, v = qkv(n)
    keep = np.broadcast_to(padded_keep(n), (B, H, n, 1)).copy()
    generator = torch.Generator().manual_seed(2)
    phi_q, phi_k = (torch.rand(B, H, n, 6, generator=generator) for _ in range(2))
    phi_k = phi_k * torch.from_numpy(keep)
    query_log_scale = torch.randn(B, H, n, 1, generator=generator) * 3
    if causal:
        key_log_scale = torch.where(
            torch.from_numpy(keep) > 0, torch.randn(B, H, n, 1, generator=generator) * 30, LOWEST
        )
        per_key = key_log_scale
    else:
        key_log_scale = torch.randn(B, H, 1, 1, generator=generator) * 3
        per_key = key_log_scale.expand(B, H, n, 1)
    log_weight = torch.randn(H, 1, 1, generator=generator)
    max_weight = torch.rand(H, 1, 1, generator=generator) if max_weighted else None
    window_next, sinks = exact_keys
    out = windowed(
        phi_q,
        phi_k,
        *map(torch.from_numpy, (q, k, v)),
        scale=SCALE,
        window=window,
        causal=causal,
        window_next=window_next,
        sinks=sinks,
        key_keep=torch.from_numpy(keep),
        linear_log_weight=log_weight,
        query_log_scale=query_log_scale,
        key_log_scale=key_log_scale,
        local_max_weight=max_weight,
        eps=favor.EPS,
    )
    expected = windowed_by_definition(
        phi_q, phi_k, q, k, v, keep, window, causal, exact_keys, log_weight, query_log_scale, per_key, max_weight
    )
    assert relative_error(out.numpy(), expected) < 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("exact_keys", [(False, 0), (True, 3)], ids=exact_keys_ids)
def test_log_scales_make_the_kernel_part_estimate_exp_of_the_logits(causal, exact_keys):
    """Features that represent e^(s_ij) exactly (one feature per key: phi_q_i = e^(s_i. - a_i),
    phi_k_j = onehot_j e^(-b_j)) turn the hybrid into exact softmax for every window: the
    kernel part is in the local part's units, whatever the stabilisers a_i and b_j."""
    n = 40
    q, k, v = qkv(n, std=1.0)
    keep = np.broadcast_to(padded_keep(n, right=6), (B, H, n, 1)).copy()
    s = SCALE * torch.from_numpy(q) @ torch.from_numpy(k).transpose(-2, -1)
    query_log_scale = s.amax(-1, keepdim=True) + 5.0
    generator = torch.Generator().manual_seed(3)
    key_log_scale = torch.randn(B, H, n, 1, generator=generator) * 20 if causal else torch.full((B, H, 1, 1), -7.0)
    phi_q = torch.exp(s - query_log_scale)
    phi_k = torch.eye(n).expand(B, H, n, n) * torch.exp(-key_log_scale) * torch.from_numpy(keep)
    window_next, sinks = exact_keys
    for window in (4, 9):
        out = windowed(
            phi_q,
            phi_k,
            *map(torch.from_numpy, (q, k, v)),
            scale=SCALE,
            window=window,
            causal=causal,
            window_next=window_next,
            sinks=sinks,
            key_keep=torch.from_numpy(keep),
            query_log_scale=query_log_scale,
            key_log_scale=key_log_scale,
            eps=favor.EPS,
        )
        assert relative_error(out.numpy(), exact(q, k, v, keep, causal)) < 1e-5, window


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window_next", [False, True], ids=["own", "next"])
def test_sink_keys_never_reach_the_kernel_part(causal, window_next):
    """A sink's features and log scale (huge, so it would raise every running max) change
    nothing, in the blocked form and in the N x N definition; a later key's features do."""
    n, sinks, window = 40, 3, 4
    q, k, v = map(torch.from_numpy, qkv(n))
    generator = torch.Generator().manual_seed(4)
    phi_q, phi_k = (torch.rand(B, H, n, 6, generator=generator) for _ in range(2))
    query_log_scale = torch.randn(B, H, n, 1, generator=generator)
    key_log_scale = torch.randn(B, H, n, 1, generator=generator) if causal else torch.zeros(B, H, 1, 1)
    changed_phi_k, changed_log_scale = phi_k.clone(), key_log_scale.clone()
    changed_phi_k[..., :sinks, :] *= 1e3
    if causal:
        changed_log_scale[..., :sinks, :] = 80.0
    options = dict(scale=SCALE, window=window, causal=causal, window_next=window_next, sinks=sinks, eps=favor.EPS)

    def both(phi_k, key_log_scale):
        scales = dict(query_log_scale=query_log_scale, key_log_scale=key_log_scale)
        out = windowed(phi_q, phi_k, q, k, v, **options, **scales)
        if not causal:  # the definition takes the head's log scale per key
            scales["key_log_scale"] = key_log_scale.expand(B, H, n, 1)
        return out, windowed_weights(phi_q, phi_k, q, k, **options, **scales)

    out, weights = both(phi_k, key_log_scale)
    changed_out, changed_weights = both(changed_phi_k, changed_log_scale)
    np.testing.assert_array_equal(changed_out.numpy(), out.numpy())
    np.testing.assert_array_equal(changed_weights.numpy(), weights.numpy())
    later_phi_k = phi_k.clone()
    later_phi_k[..., sinks, :] *= 1e3  # the first key after the sinks: far for the last queries
    assert np.abs(both(later_phi_k, key_log_scale)[0].numpy() - out.numpy())[..., -1, :].max() > 1e-3


# --- the passes -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mask", [MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING], ids=lambda m: m.value)
@pytest.mark.parametrize("exact_keys", [(False, 0), (True, 1), (True, 3)], ids=exact_keys_ids)
def test_window_covering_the_sequence_is_exact_softmax_attention(method, mask, exact_keys):
    site = make_site(mask)
    q, k, v = qkv(50)
    keep = padded_keep(50)
    window_next, sinks = exact_keys
    for window in (50, 64):
        module = fitted_module(method, site, method.Options(window=window, window_next=window_next, sinks=sinks))
        expected = exact(q, k, v, keep, mask.causal)
        assert relative_error(run_pass_module(module, q, k, v, keep), expected) < 1e-5, window


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mask", list(MaskKind)[:4], ids=lambda m: m.value)
@pytest.mark.parametrize("exact_keys", EXACT_KEYS, ids=exact_keys_ids)
def test_onnx_equals_torch(method, mask, exact_keys):
    """N = 50 (causal) or 100 in windows of 16 (partial blocks), fitted values written through
    ``weights``; with key padding the first 3 positions of the second batch row are padded
    (sinks too)."""
    n = 50 if mask.causal else 100  # bidirectional: every block has far keys
    site = make_site(mask)
    window_next, sinks = exact_keys
    options = method.Options(window=16, window_next=window_next, sinks=sinks)
    module = fitted_module(method, site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    lowering = method.onnx_lowering(site, options, 20, weights)
    assert lowering.constants.keys() == weights.keys()  # the module's state, by name
    session = lowering_session(lowering, 4)
    q, k, v = qkv(n, seed=1)
    keep = padded_keep(n) if mask.key_padding else None
    feed_keep = keep if keep is not None else np.ones((1, 1, 1, 1), np.float32)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=feed_keep))[0]
    expected = run_pass_module(module, q, k, v, keep)
    assert out.shape == (B, H, n, DV)
    assert relative_error(out, expected) < 1e-5
    # the window is not the whole attention: the kernel part is really there
    all_kept = np.ones((B, 1, n, 1), np.float32)
    assert relative_error(expected, exact(q, k, v, all_kept if keep is None else keep, mask.causal)) > 1e-2


@pytest.mark.parametrize("state_blocks", [torch_form.STATE_BLOCKS, 0], ids=["block-states", "one-state"])
@pytest.mark.parametrize("exact_keys", EXACT_KEYS, ids=exact_keys_ids)
def test_bidirectional_pairs_at_every_length(exact_keys, state_blocks, monkeypatch):
    """The bidirectional window in pairs of blocks (window.blocks.BlockPairs, the ONNX PairedWindow): at
    every N from 1 to 5 windows of 3 (odd and even block counts, the last pair's padding blocks,
    the neighbours wrapped onto padding at both ends), the torch form equals the N x N
    definition and the ONNX form the torch one, with key padding and fitted hedgehog (both
    parts' units, beta_h). Both torch far parts: from per-block states (up to STATE_BLOCKS
    blocks) and from one state less the local kernel terms (the ONNX form's sums)."""
    monkeypatch.setattr(torch_form, "STATE_BLOCKS", state_blocks)
    window_next, sinks = exact_keys
    site = make_site(MaskKind.KEY_PADDING)
    options = hedgehog.Options(window=3, window_next=window_next, sinks=sinks)
    module = fitted_module(hedgehog, site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(hedgehog.onnx_lowering(site, options, 20, weights), 4)
    for n in range(1, 16):
        q, k, v = qkv(n, seed=n)
        keep = padded_keep(n, left=min(2, n - 1), right=0)
        out = run_pass_module(module, q, k, v, keep)
        with torch.no_grad():
            attention = module.attention_weights(*map(torch.from_numpy, (q, k, keep)))
        # 5e-5: N near 3W, rows with few far keys keep the local kernel terms' cancellation
        # (passes/window's package docstring; the form before the pairs measured 1e-5 at N = 12 too)
        assert relative_error(out, (attention @ torch.from_numpy(v)).numpy()) < 5e-5, n
        onnx_out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        # block states leave the ONNX form's cancellation out: then the two differ by up to it;
        # with one state the same cancellation magnifies what is rounded differently (the ONNX
        # form takes w_h into the units' log ratio, torch multiplies phi_q by it; 1.1e-5 at N = 11)
        assert relative_error(onnx_out, out) < (5e-5 if state_blocks else 2e-5), n


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("far_chunk", [2, 4, 6, 8], ids=lambda c: f"blocks={c // 2}")
def test_causal_far_part_in_chunks_at_every_length(method, far_chunk, monkeypatch):
    """The ONNX causal window's far part by chunks of P blocks (window.onnx_causal._chunked_far_sums_functions:
    P = 1, the pair form P = 2, the masked [PW, PW] form P >= 3) equals the torch form (by chunks
    of 32 blocks of 2) at every N up to 4 chunks and more, with key padding at both ends and
    sinks=3: in hedgehog and favor the sinks' features are not zero, only their log scale keeps
    them out, also where a whole key chunk holds sinks and padding only."""
    monkeypatch.setitem(window_lowering.windowed_kernel_attention_functions.__kwdefaults__, "far_chunk", far_chunk)
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    options = method.Options(window=2, sinks=3)
    module = fitted_module(method, site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(method.onnx_lowering(site, options, 20, weights), 4)
    for n in range(1, 4 * far_chunk + 6):
        q, k, v = qkv(n, seed=n)
        keep = padded_keep(n, left=min(2, n - 1), right=min(2, n - 1))
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        assert relative_error(out, run_pass_module(module, q, k, v, keep)) < 1e-5, n


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mask", [MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING], ids=lambda m: m.value)
def test_fewer_positions_than_sinks(method, mask):
    """N = 1, 2 with sinks=3 (the sink rows beyond N are zero keys, masked): exact softmax in
    both lowerings."""
    site = make_site(mask)
    options = method.Options(window=4, sinks=3)
    module = fitted_module(method, site, options)
    session = lowering_session(
        method.onnx_lowering(site, options, 20, {n: p.numpy() for n, p in module.state_dict().items()}), 4
    )
    for n in (1, 2):
        q, k, v = qkv(n, seed=n)
        keep = np.ones((B, 1, n, 1), np.float32)
        expected = exact(q, k, v, keep, mask.causal)
        assert relative_error(run_pass_module(module, q, k, v, keep), expected) < 1e-5, n
        assert relative_error(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0], expected) < 1e-5, n


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
def test_onnx_equals_torch_with_heads_folded_into_the_batch(method):
    """[batch * heads, N, d] with heads unknown: one linear_log_weight shared by every head."""
    site = make_site(MaskKind.CAUSAL, rank=3)
    options = method.Options(window=8)
    module = fitted_module(method, site, options)
    assert module.linear_log_weight.shape == (1, 1, 1)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(method.onnx_lowering(site, options, 20, weights), 3, keep_rank=2)
    q, k, v = qkv(29, lead=(B * H,))
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.ones((1, 1), np.float32)))[0]
    assert relative_error(out, run_pass_module(module, q, k, v, None)) < 1e-5


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("sinks", [0, 3])
def test_causal_outputs_ignore_later_positions(method, sinks):
    """Also with sinks; window_next changes nothing at a causal site."""
    site = make_site(MaskKind.CAUSAL)
    module = fitted_module(method, site, method.Options(window=8, sinks=sinks))
    without_next = fitted_module(method, site, method.Options(window=8, window_next=False, sinks=sinks))
    q, k, v = qkv(45)
    np.testing.assert_array_equal(run_pass_module(without_next, q, k, v, None), run_pass_module(module, q, k, v, None))
    t = 30
    later = [x.copy() for x in (q, k, v)]
    for x in later:
        x[..., t + 1 :, :] = np.random.default_rng(5).standard_normal(x[..., t + 1 :, :].shape) * 10
    before, after = run_pass_module(module, q, k, v, None), run_pass_module(module, *later, None)
    np.testing.assert_array_equal(before[..., : t + 1, :], after[..., : t + 1, :])
    assert np.abs(before[..., t + 1 :, :] - after[..., t + 1 :, :]).max() > 1e-2


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mask", [MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING], ids=lambda m: m.value)
@pytest.mark.parametrize("exact_keys", [(False, 0), (True, 2)], ids=exact_keys_ids)
def test_rows_without_exact_keys_are_finite(method, mask, exact_keys):
    """Left padding of 20 keys with windows of 4: early queries have no kept exact key (the
    sinks are padded too). They take the kernel part alone (bidirectional), or have no key at
    all and give 0 (causal)."""
    site = make_site(mask)
    window_next, sinks = exact_keys
    options = method.Options(window=4, window_next=window_next, sinks=sinks)
    module = fitted_module(method, site, options)
    q, k, v = qkv(40)
    keep = np.ones((B, 1, 40, 1), np.float32)
    keep[1, :, :20] = 0.0
    out = run_pass_module(module, q, k, v, keep)
    session = lowering_session(
        method.onnx_lowering(site, options, 20, {n: p.numpy() for n, p in module.state_dict().items()}), 4
    )
    onnx_out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert np.isfinite(out).all() and np.isfinite(onnx_out).all()
    assert relative_error(onnx_out, out) < 1e-5
    early = out[1, :, :12]
    if mask.causal:
        assert np.abs(early).max() == 0.0
    else:
        assert np.abs(early).max(axis=-1).min() > 0.0  # every early row attends to far keys


def test_linear_log_weight_is_a_per_head_parameter_that_gets_gradients():
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    for method in WINDOWED:
        module = method.torch_module(site, method.Options(window=8))
        assert isinstance(module.linear_log_weight, torch.nn.Parameter)
        assert module.linear_log_weight.shape == (H, 1, 1) and not module.linear_log_weight.any()
        q, k, v = (torch.from_numpy(x) for x in qkv(30))
        module(q, k, v, torch.from_numpy(padded_keep(30))).square().sum().backward()
        grad = module.linear_log_weight.grad
        assert torch.isfinite(grad).all() and (grad != 0).all(), method.NAME
        no_window = method.torch_module(site, method.Options())
        assert "linear_log_weight" not in dict(no_window.named_parameters())


@pytest.mark.parametrize("method", ["hydra", "linformer", "lsh"])
def test_methods_without_per_key_kernel_weights_refuse_a_window(method):
    reasons = {
        "hydra": "its cosine kernel folds all keys into one feature vector, with no per-key weights "
        "to share a normaliser with the window's softmax",
        "linformer": "every projected key mixes all positions, so no keys are left over for a window to split off",
        "lsh": "it is already a softmax over a few keys per query (its bucket), with no kernel part to mix in",
    }
    with pytest.raises(OptionError) as error:
        make_options(get_pass(method), window="32")
    assert str(error.value) == (
        f"method {method!r} cannot take window=32: {reasons[method]} (window is for linear, favor, hedgehog)"
    )
    assert make_options(get_pass(method), window="0") == get_pass(method).Options()  # 0 is off


@pytest.mark.parametrize("method", ["linear", "favor", "hedgehog"])
def test_negative_window_or_sinks_is_an_option_error(method):
    with pytest.raises(OptionError, match=rf"^{method} option window must be >= 0, got -1$"):
        make_options(get_pass(method), window="-1")
    with pytest.raises(OptionError, match=rf"^{method} option sinks must be >= 0, got -1$"):
        make_options(get_pass(method), window="8", sinks="-1")


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
def test_the_next_block_and_one_sink_are_exact_by_default(method):
    options = make_options(method, window="8")
    assert (options.window_next, options.sinks) == (True, 1)


@pytest.mark.parametrize("method", WINDOWED, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mask", list(MaskKind)[:4], ids=lambda m: m.value)
def test_without_a_window_its_options_change_nothing(method, mask):
    """window=0: the same ONNX functions and constants, byte for byte, and the same module."""
    site = make_site(mask)
    plain, other = method.Options(), method.Options(window_next=False, sinks=3)
    serialized = lambda lowering: [f.SerializeToString() for f in lowering.functions]  # noqa: E731
    lowerings = [method.onnx_lowering(site, options, 20) for options in (plain, other)]
    assert serialized(lowerings[0]) == serialized(lowerings[1])
    assert lowerings[0].constants.keys() == lowerings[1].constants.keys()
    for name, value in lowerings[0].constants.items():
        np.testing.assert_array_equal(lowerings[1].constants[name], value)
    q, k, v = qkv(30)
    modules = [method.torch_module(site, options) for options in (plain, other)]
    np.testing.assert_array_equal(*(run_pass_module(module, q, k, v, padded_keep(30)) for module in modules))


# --- the bidirectional far sums: the whole sequence's state less the local terms --------------


def local_kernel_rounding(phi_q, phi_k, q, k, v, keep, window, exact_keys, log_weight) -> np.ndarray:
    """Per row (bidirectional, no log scales), eps32 * sum_local K_ij max|v_j| / D_i, in float64:
    the rounding passes/window's docstring bounds the far sums by, with K_ij = w phi_i.phi_j (zero on
    the sinks, which the kernel never sees) over the row's exact keys and D_i the definition's
    normaliser (its exact part e^(s_ij - m_i), its far part K_ij)."""
    phi_q, phi_k, q, k, v, keep = (torch.as_tensor(x).double() for x in (phi_q, phi_k, q, k, v, keep))
    window_next, sinks = exact_keys
    zero = torch.zeros_like(phi_q[..., :1])
    options = dict(scale=SCALE, window=window, causal=False, window_next=window_next, sinks=sinks, key_keep=keep)
    exact = windowed_weights(zero, zero, q, k, **options) > 0  # exact and kept
    far = ~exact & (keep.transpose(-2, -1) > 0)
    logits = SCALE * q @ k.transpose(-2, -1)
    row_max = torch.where(exact, logits, -math.inf).amax(-1, keepdim=True)
    exact_weights = torch.where(exact, torch.exp(logits - row_max), 0.0)
    without_sinks = torch.where(torch.arange(phi_k.shape[-2]).unsqueeze(-1) < sinks, 0.0, phi_k)
    kernel = torch.exp(log_weight.double()) * phi_q @ without_sinks.transpose(-2, -1)
    denominator = exact_weights.sum(-1) + torch.where(far, kernel, 0.0).sum(-1)
    local = torch.where(exact, kernel, 0.0) @ v.abs().amax(-1, keepdim=True)
    return (np.finfo(np.float32).eps * local[..., 0] / denominator).numpy()


@pytest.mark.parametrize("state_blocks", [torch_form.STATE_BLOCKS, 0], ids=["block-states", "one-state"])
@pytest.mark.parametrize("n", [37, 50, 77])
@pytest.mark.parametrize("exact_keys", [(True, 0), (True, 3), (False, 1)], ids=exact_keys_ids)
def test_far_sums_rounding_is_bounded(n, exact_keys, state_blocks, monkeypatch):
    """N near 3 windows of 16, padding at both ends, elu + 1 features in no unit of the exact
    part's: some rows have (almost) no far key while their local kernel terms outweigh the exact
    part many times, the worst case for taking those terms back out of the whole sequence's
    sums. From one state the error against the float64 definition stays within the bound
    passes/window's docstring gives, which at N = 50 with window_next exceeds the 1e-5 the parity tests
    allow; N = 37 has blocks without any far block (exactly 0 there). From per-block states
    (torch_form.STATE_BLOCKS) nothing cancels: within 2e-6 of the largest output everywhere."""
    monkeypatch.setattr(torch_form, "STATE_BLOCKS", state_blocks)
    window = 16
    q, k, v = qkv(n)
    keep = np.broadcast_to(padded_keep(n), (B, H, n, 1)).copy()
    phi_q, phi_k = elu_features(q, k, keep)
    log_weight = torch.randn(H, 1, 1, generator=torch.Generator().manual_seed(1))
    window_next, sinks = exact_keys
    options = dict(scale=SCALE, window=window, causal=False, window_next=window_next, sinks=sinks)
    torch_q, torch_k, torch_v = map(torch.from_numpy, (q, k, v))
    out = windowed(
        phi_q,
        phi_k,
        torch_q,
        torch_k,
        torch_v,
        **options,
        key_keep=torch.from_numpy(keep),
        linear_log_weight=log_weight,
    )
    expected = windowed_by_definition(phi_q, phi_k, q, k, v, keep, window, False, exact_keys, log_weight)
    bound = local_kernel_rounding(phi_q, phi_k, q, k, v, keep, window, exact_keys, log_weight)
    error = np.abs(out.numpy() - expected).max(-1)
    scale = np.abs(expected).max()
    if state_blocks:  # nothing cancels: float32 rounding (at N = 50 100x below one state's 1.9e-4)
        assert (error <= 2e-6 * scale).all()
    else:
        assert (error <= 4 * bound + 1e-6 * scale).all()
    if n == 50 and window_next:  # rows with 2 or 0 far keys beside 48 local ones
        assert bound.max() > 1e-5 * scale


def test_far_sums_rounding_is_bounded_in_onnx():
    """The same bound for the ONNX lowering (linear: elu + 1, w = 1) at N = 50 with the
    default exact keys (window_next, 1 sink)."""
    n, window = 50, 16
    site = make_site(MaskKind.KEY_PADDING)
    options = linear.Options(window=window)
    module = linear.torch_module(site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(linear.onnx_lowering(site, options, 20, weights), 4)
    q, k, v = qkv(n)
    keep = padded_keep(n)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    keep = np.broadcast_to(keep, (B, H, n, 1)).copy()
    phi_q, phi_k = elu_features(q, k, keep)
    exact_keys, log_weight = (options.window_next, options.sinks), torch.zeros(H, 1, 1)
    expected = windowed_by_definition(phi_q, phi_k, q, k, v, keep, window, False, exact_keys, log_weight)
    bound = local_kernel_rounding(phi_q, phi_k, q, k, v, keep, window, exact_keys, log_weight)
    assert (np.abs(out - expected).max(-1) <= 4 * bound + 1e-6 * np.abs(expected).max()).all()


@pytest.mark.parametrize("rescaled", [False, True], ids=["plain", "log-scales"])
@pytest.mark.parametrize("far_chunk", [2, 4, 6], ids=lambda c: f"blocks={c // 2}")
def test_causal_far_part_by_chunks_equals_its_definition_across_prefix_groups(far_chunk, rescaled):
    """The torch causal window's far part by chunks of P blocks (window.blocks.FarChunks: P = 1, the
    pair form P = 2, the masked form P = 3) equals the N x N definition at N = 300 in windows of
    2: 151 blocks and 52 to 152 chunks, so that the running maxima and the rescaled prefix over
    them take several groups of PREFIX_GROUP rows. Key padding at both ends, 3 sinks,
    and (log scales) per-key log scales spread over +-30, the lowest on padded keys."""
    n, window, exact_keys = 300, 2, (False, 3)
    assert n // (3 * window) > 3 * PREFIX_GROUP
    q, k, v = qkv(n)
    keep = np.broadcast_to(padded_keep(n), (B, H, n, 1)).copy()
    generator = torch.Generator().manual_seed(far_chunk)
    phi_q, phi_k = (torch.rand(B, H, n, 6, generator=generator) for _ in range(2))
    phi_k = phi_k * torch.from_numpy(keep)
    log_scales = {}
    if rescaled:
        key_log_scale = torch.randn(B, H, n, 1, generator=generator) * 30
        log_scales = dict(
            query_log_scale=torch.randn(B, H, n, 1, generator=generator) * 3,
            key_log_scale=torch.where(torch.from_numpy(keep) > 0, key_log_scale, LOWEST),
        )
    out = windowed(
        phi_q,
        phi_k,
        *map(torch.from_numpy, (q, k, v)),
        scale=SCALE,
        window=window,
        causal=True,
        window_next=False,
        sinks=exact_keys[1],
        key_keep=torch.from_numpy(keep),
        eps=favor.EPS,
        far_chunk=far_chunk,
        **log_scales,
    )
    expected = windowed_by_definition(phi_q, phi_k, q, k, v, keep, window, True, exact_keys, None, *log_scales.values())
    assert relative_error(out.numpy(), expected) < 1e-5


@pytest.mark.parametrize("method", [linear, favor], ids=lambda m: m.NAME)
def test_causal_far_part_onnx_equals_torch_across_prefix_groups(method, monkeypatch):
    """Both lowerings' far part in chunks of 2 blocks of 2 (far_chunk=4) at N = 300: 76 chunks,
    their prefix sums and (favor) running maxima and rescaled prefix over several groups of
    PREFIX_GROUP rows, ONNX (the hierarchy of triangular products) against torch."""
    for function in (window_lowering.windowed_kernel_attention_functions, torch_form.windowed_kernel_attention):
        monkeypatch.setitem(function.__kwdefaults__, "far_chunk", 4)
    site = make_site(MaskKind.CAUSAL_KEY_PADDING)
    options = method.Options(window=2, sinks=3)
    module = fitted_module(method, site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(method.onnx_lowering(site, options, 20, weights), 4)
    q, k, v = qkv(300, seed=5)
    keep = padded_keep(300)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert relative_error(out, run_pass_module(module, q, k, v, keep)) < 1e-5
