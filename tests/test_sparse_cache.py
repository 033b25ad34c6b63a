"""The causal window's sparse exact cache (``sparse=G``, attnrewrite/passes/window/sparse_cache.py):
the block-sequential parallel form equals its plain sequential definition (reference.py, float64)
for linear, hedgehog and favor, with sinks, left padding and grouped heads; sparse=0 is today's
hybrid, bit for bit; a cache as large as the sequence is causal softmax; gradients flow; the
recurrent form stepped (token by token, in uneven pieces) equals the parallel form, its state
holding the cache per key/value head and counted in the state's bytes; padded keys never enter;
the ONNX forms (parallel, and the recurrent entry stepped) equal the torch forms; both frontends
rewrite a model with it; what it does not do (bidirectional sites, attention weights) it refuses
with a reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from models import relative_error
from test_fx_export import to_onnx, torch_output
from test_fx_transformers import SEQ, build, exported, model_inputs
from test_recurrent import (
    DV,
    OPSET,
    SCHEDULES,
    B,
    D,
    H,
    fitted_parallel,
    grouped_site,
    make_site,
    pieces,
    recurrent_form,
    recurrent_model,
    rows,
    run_onnx_steps,
    sequence,
    session_for,
    state_dict,
)

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.passes import favor, hedgehog, linear, recurrent
from attnrewrite.passes.options import OptionError
from attnrewrite.passes.window import torch_form
from attnrewrite.passes.window.reference import sparse_windowed_reference
from attnrewrite.passes.window.settings import Window
from attnrewrite.site import MaskKind

METHODS = {m.NAME: m for m in (linear, hedgehog, favor)}
LENGTH = 23  # blocks of 4: five leave the window


def options_of(method, **values):
    extra = {"features": 16} if method is favor else {}
    return passes.make_options(method, chunk=4, window=4, **values, **extra)


def site_of(grouping: str):
    """A KV-cache site of 6 query heads over 2 key/value heads, or 3 heads ungrouped."""
    return grouped_site(2) if grouping == "grouped" else make_site()


def query_key_values(site, padding: bool, length: int = LENGTH):
    """q [B, H, N, D], k and v with q's heads (each key/value head repeated for its group) and as
    kept (their key/value heads), key_keep."""
    heads = site.num_heads
    kv_heads = site.kv_cache.kv_heads if site.kv_cache is not None else heads
    q, _, _, keep = sequence(padding, length, lead=(B, heads))
    _, k, v, _ = sequence(padding, length, seed=2, lead=(B, kv_heads))
    repeated = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    return q, *repeated, k, v, keep


@pytest.fixture
def with_reference(monkeypatch):
    """Every sparse parallel call also runs the reference on the same inputs; yields the list of
    (output, reference) pairs."""
    calls = []
    blocked = torch_form.sparse_windowed_causal

    def both(phi_q, phi_k, q, k, v, keep, scales, window, *, scale, eps):
        out = blocked(phi_q, phi_k, q, k, v, keep, scales, window, scale=scale, eps=eps)
        unweighted = scales._replace(linear_log_weight=None)  # phi_q comes weighted
        expected = sparse_windowed_reference(
            phi_q, phi_k, q, k, v, window, scale=scale, key_keep=keep, scales=unweighted, eps=eps
        )
        calls.append((out.reshape(expected.shape), expected))
        return out

    monkeypatch.setattr(torch_form, "sparse_windowed_causal", both)
    return calls


@pytest.mark.parametrize("grouping", ["ungrouped", "grouped"])
@pytest.mark.parametrize("sparse,sinks", [(1, 0), (3, 1), (6, 2)])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_form_equals_the_definition(with_reference, method, padding, sparse, sinks, grouping):
    method, site = METHODS[method], site_of(grouping)
    options = options_of(method, sinks=sinks, sparse=sparse)
    module = fitted_parallel(method, site, options)
    q, k, v, _, _, keep = query_key_values(site, padding)
    with torch.no_grad():
        out = module(q, k, v, keep)
        plain = fitted_parallel(method, site, dataclasses.replace(options, sparse=0))(q, k, v, keep)
    ((blocked, expected),) = with_reference
    assert relative_error(blocked.numpy(), expected.numpy()) < 1e-5
    assert relative_error(out.numpy(), plain.numpy()) > 1e-3  # the cache changes what is exact


@pytest.mark.parametrize("method", METHODS)
def test_sparse_zero_is_the_window_as_it_was(method):
    method, site = METHODS[method], make_site()
    q, k, v, _, _, keep = query_key_values(site, True)
    given, default = options_of(method, sinks=1, sparse=0), options_of(method, sinks=1)
    assert Window.of(given, site) == Window.of(default, site) == Window(4, True, 1)
    assert str(Window.of(given)) == "window=4, window_next=True, sinks=1"
    with torch.no_grad():
        assert torch.equal(
            fitted_parallel(method, site, given)(q, k, v, keep), fitted_parallel(method, site, default)(q, k, v, keep)
        )


@pytest.mark.parametrize("method", METHODS)
def test_a_cache_as_large_as_the_sequence_is_causal_softmax(method):
    """Every key that leaves the window stays exact: nothing is folded, the kernel part is empty."""
    method, site = METHODS[method], make_site()
    q, k, v, _, _, keep = query_key_values(site, True)
    module = method.torch_module(site, options_of(method, sinks=1, sparse=LENGTH))
    with torch.no_grad():
        out = module(q, k, v, keep)
    logits = site.scale * q @ k.transpose(-2, -1)
    visible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() & (keep.transpose(-2, -1) > 0)
    expected = torch.softmax(torch.where(visible, logits, -torch.inf), dim=-1) @ v
    real = keep[:, 0, :, 0] > 0  # padded queries see no key
    assert (
        relative_error(
            out[real.unsqueeze(1).expand(-1, out.shape[1], -1)],
            expected[real.unsqueeze(1).expand(-1, out.shape[1], -1)],
        )
        < 1e-5
    )
    assert passes.exact_part(method, options_of(method, sinks=1, sparse=5), True) == passes.ExactPart(
        12, 14, "window=4, sparse=5"
    )


@pytest.mark.parametrize("method", METHODS)
def test_gradients_flow_through_the_kept_pairs_and_the_state(method):
    method, site = METHODS[method], site_of("grouped")
    module = method.torch_module(site, options_of(method, sinks=1, sparse=3), learnable=True)
    q, k, v, _, _, keep = query_key_values(site, True)
    k.requires_grad_(True)
    module(q, k, v, keep).square().sum().backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert torch.isfinite(k.grad).all() and k.grad[0, :, :4].abs().sum() > 0  # keys that left the window


# --- the recurrent form ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("grouping", ["ungrouped", "grouped"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_torch_steps_equal_the_parallel_form(method, padding, grouping, schedule):
    method, site = METHODS[method], site_of(grouping)
    options = options_of(method, sinks=1, sparse=3)
    parallel = fitted_parallel(method, site, options)
    q, k, v, kept_k, kept_v, keep = query_key_values(site, padding)
    schedule = [*SCHEDULES[schedule], LENGTH - sum(SCHEDULES[schedule])]  # the whole sequence
    with torch.no_grad():
        expected = parallel(q, k, v, keep)
        module = recurrent_form(site, options).torch_module(site, parallel)
        state = module.initial_state(q, kept_v)
        for piece in pieces(schedule):
            out, *state = module(rows(q, piece), rows(kept_k, piece), rows(kept_v, piece), rows(keep, piece), *state)
            assert relative_error(out.numpy(), expected[..., piece, :].numpy()) < 1e-5, piece
    names = [t.name for t in recurrent_form(site, options).state(site)]
    cache_keep = state[names.index("cache_keep")]
    assert cache_keep.shape == (B, kept_k.shape[1], 3, 1) and cache_keep.sum() == cache_keep.numel()


@pytest.mark.parametrize("grouping", ["ungrouped", "grouped"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_onnx_parallel_form_equals_the_torch_form(method, padding, grouping):
    method, site = METHODS[method], site_of(grouping)
    options = options_of(method, sinks=1, sparse=3)
    parallel = fitted_parallel(method, site, options)
    q, k, v, _, _, keep = query_key_values(site, padding)
    keep = torch.ones(B, 1, LENGTH, 1) if keep is None else keep
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    session = lowering_session(method.onnx_lowering(site, options, OPSET, state_dict(parallel)), rank=4)
    (out,) = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": keep.numpy()})
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("grouping", ["ungrouped", "grouped"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_equal_the_parallel_form_and_the_torch_state(method, padding, grouping, schedule):
    """The recurrent entry, stepped: the parallel form's outputs, and the torch module's state
    after the whole sequence (the pairs compared where a slot holds one)."""
    method, site = METHODS[method], site_of(grouping)
    options = options_of(method, sinks=1, sparse=3)
    parallel = fitted_parallel(method, site, options)
    q, k, v, kept_k, kept_v, keep = query_key_values(site, padding)
    schedule = [*SCHEDULES[schedule], LENGTH - sum(SCHEDULES[schedule])]
    form = recurrent_form(site, options)
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
        module = form.torch_module(site, parallel)
        state = module(q, kept_k, kept_v, keep, *module.initial_state(q, kept_v))[1:]
    steps = run_onnx_steps(
        session_for(site, options, state_dict(parallel)), site, options, schedule, (q, kept_k, kept_v, keep)
    )
    for piece, (out, *_) in zip(pieces(schedule), steps):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece
    found = dict(zip((t.name for t in form.state(site)), steps[-1][1:]))
    wanted = {t.name: x.numpy() for t, x in zip(form.state(site), state)}
    np.testing.assert_array_equal(found["cache_keep"], wanted["cache_keep"])
    held = wanted["cache_keep"] > 0
    assert held.all()  # every slot holds a pair by the end: the comparison is not of empty slots
    for name in ("cache_keys", "cache_values"):
        np.testing.assert_array_equal(found[name] * held, wanted[name] * held, err_msg=name)
    assert relative_error(found["kernel_state"], wanted["kernel_state"]) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_with_heads_folded_into_the_batch(method):
    """A [batch * heads, N, d] site (no head axis), left-padded, stepped token by token: the
    parallel form's outputs."""
    method, site = METHODS[method], make_site(rank=3)
    options = options_of(method, sinks=1, sparse=3)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(True, LENGTH, lead=(B * H,))
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    form = recurrent_form(site, options)
    lowering = form.onnx_lowering(site, OPSET, state_dict(parallel))
    model = recurrent_model(lowering, form.state(site), rank=3)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    schedule = [1] * LENGTH
    for piece, (out, *_) in zip(pieces(schedule), run_onnx_steps(session, site, options, schedule, (q, k, v, keep))):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece


def test_state_holds_the_cache_per_key_value_head_and_counts_its_bytes():
    site = site_of("grouped")
    form = recurrent_form(site, options_of(hedgehog, sinks=1, sparse=5))
    described = {t.name: (t.shape, t.dtype) for t in form.state(site)}
    assert described["cache_keys"] == (("B", "Hkv", 5, "D"), "model")
    assert described["cache_values"] == (("B", "Hkv", 5, "Dv"), "model")
    assert described["cache_keep"] == (("B", "Hkv", 5, 1), "float32")
    assert list(described)[-1] == "position"
    plain = recurrent_form(site, options_of(hedgehog, sinks=1)).state(site)
    kv_heads, element = site.kv_cache.kv_heads, 4  # float32 model dtype
    more = recurrent.sized_bytes(form.state(site), site) - recurrent.sized_bytes(plain, site)
    assert more == kv_heads * 5 * ((D + DV) * element + 4)


def test_padded_keys_never_enter_the_cache_or_the_state():
    """Whatever the padded positions hold, the outputs, the kernel state and the pairs held are the same."""
    site, options = make_site(), options_of(favor, sinks=1, sparse=3)
    module = recurrent_form(site, options).torch_module(site, fitted_parallel(favor, site, options))
    q, k, v, _, _, keep = query_key_values(site, True, length=15)
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[1, :, :4], junk_v[1, :, :4] = 1e3, -7.0
    names = ["out", *(t.name for t in recurrent_form(site, options).state(site))]
    with torch.no_grad():
        first = dict(zip(names, module(q, k, v, keep, *module.initial_state(q, v))))
        second = dict(zip(names, module(q, junk_k, junk_v, keep, *module.initial_state(q, v))))
    for name in ("out", "kernel_state", "log_scale", "cache_keep"):
        np.testing.assert_array_equal(first[name].numpy(), second[name].numpy(), err_msg=name)
    held = first["cache_keep"] > 0
    for name in ("cache_keys", "cache_values"):
        torch.testing.assert_close(first[name] * held, second[name] * held, rtol=0, atol=0)


# --- frontends, refusals -----------------------------------------------------------------------------


def test_fx_rewrites_gpt2_with_a_cache():
    """torch.fx, window=2: a cache of every key is the original model; a small one is neither
    the original nor the window without it."""
    args = model_inputs("gpt2")
    original = torch_output(build("gpt2", "eager"), args)

    def rewritten(sparse):
        return torch_output(
            rewrite_graph_module(exported("gpt2", "eager"), linear.Options(window=2, sparse=sparse)), args
        )

    real = args[1].numpy() > 0
    assert relative_error(rewritten(SEQ)[real], original[real]) < 1e-5
    small, none = rewritten(1), rewritten(0)
    assert relative_error(small, none) > 1e-4 and relative_error(small[real], original[real]) > 1e-4


def test_fx_calibration_fits_through_the_cache():
    """Calibration's forward and backward run the block loop: every site's loss goes down."""
    calibration = [model_inputs("gpt2", seed=seed) for seed in range(3)]
    gm = attnrewrite.rewrite(
        exported("gpt2", "eager"), to="hedgehog", window=2, sparse=2, calibrate=calibration, calibrate_steps=10
    )
    fitted = [entry["calibration"] for entry in gm.meta["attnrewrite"]["sites"]]
    assert fitted and all(c["loss_after"] < c["loss_before"] for c in fitted)


def test_refusals_say_why():
    options = options_of(linear, sparse=2)
    assert linear.supports(make_site(), options) is None
    bidirectional = dataclasses.replace(make_site(), mask=MaskKind.KEY_PADDING)
    assert hedgehog.supports(bidirectional, options_of(hedgehog, sparse=2)) == (
        "sparse=2 keeps keys as they leave a causal window: this site is bidirectional"
    )
    with pytest.raises(OptionError, match="linear option sparse must be 0 without window"):
        passes.make_options(linear, sparse="2")
    assert passes.attention_weights_unavailable(linear, options).startswith("sparse=2: which keys the cache keeps")


def test_onnx_rewrites_gpt2_with_a_cache():
    """The ONNX frontend, window=2: a cache of every key is the original model; a small one is
    neither the original nor the window without it."""
    args = model_inputs("gpt2")
    model = to_onnx(build("gpt2", "eager"), args, ["input_ids", "attention_mask"])
    feeds = {"input_ids": args[0].numpy(), "attention_mask": args[1].numpy()}

    def rewritten(sparse):
        result = attnrewrite.rewrite(model, to="linear", window=2, sparse=sparse)
        assert sum(node.domain == "attnrewrite" for node in result.graph.node) == 2  # both layers
        session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0]

    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    real = args[1].numpy() > 0
    assert relative_error(rewritten(SEQ)[real], original[real]) < 1e-5
    small, none = rewritten(1), rewritten(0)
    assert relative_error(small, none) > 1e-4 and relative_error(small[real], original[real]) > 1e-4
