"""The delta rule as the causal kernel state's update (``update=delta``, passes/kernel/delta.py):
the chunked (WY) form against the sequential reference, whole and in pieces through the state;
its ONNX body on onnxruntime; the methods' parallel lowerings (torch against ONNX), their
recurrent forms stepped token by token and in pieces against the parallel form (torch, ONNX with
standard operators, onnxruntime's com.microsoft.LinearAttention), left padding, folded heads;
the refusals (bidirectional sites, a window); exported tiny decoders; a calibration through it."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from conftest import decoder_exported, read_record
from decoders import DECODERS, logits_error
from models import relative_error
from onnx import TensorProto, helper
from test_fx_export import run_onnx, to_onnx, torch_output
from test_fx_transformers import build, exported, model_inputs
from test_recurrent import (
    OPSET,
    SCHEDULES,
    fitted_parallel,
    lowering_nodes,
    make_site,
    pieces,
    recurrent_form,
    recurrent_model,
    rows,
    run_onnx_steps,
    sequence,
    state_dict,
)
from test_recurrent_fidelity import tokens, with_positions
from test_recurrent_models import TOLERANCE, full_sequence, prefill_then_steps, stepped

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.generate import forced_logits
from attnrewrite.onnx.validate import runs_linear_attention
from attnrewrite.passes import favor, hedgehog, linear
from attnrewrite.passes.kernel import delta
from attnrewrite.passes.kernel.delta_onnx import delta_rule_from_state_functions
from attnrewrite.passes.kernel.state import KernelState
from attnrewrite.passes.options import OptionError
from attnrewrite.site import MaskKind

G, F, DV = 4, 6, 5
SPLITS = [1, 2, 3, 20, 21, 53]  # pieces of 1, 1, 1, 17, 1, 32 and the rest positions
METHODS = {m.NAME: m for m in (linear, hedgehog, favor)}


def features(n: int, seed: int, dtype=torch.float64):
    """Positive phi_q, phi_k [G, n, F] (one key in five padded: zero) and v [G, n, Dv]."""
    generator = torch.Generator().manual_seed(seed)
    phi_q, phi_k = (torch.rand(G, n, F, generator=generator, dtype=dtype) for _ in range(2))
    v = torch.randn(G, n, DV, generator=generator, dtype=dtype)
    padded = torch.rand(G, n, 1, generator=generator) < 0.2
    return phi_q, phi_k.masked_fill(padded, 0.0), v


def some_state(seed: int, dtype=torch.float64) -> KernelState:
    generator = torch.Generator().manual_seed(seed)
    s = torch.randn(G, F, DV + 1, generator=generator, dtype=dtype) * 0.3
    return KernelState(s[..., :-1], s[..., -1] + 1.0)


# --- the math -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("initial", [False, True], ids=["from-zero", "from-a-state"])
def test_chunked_form_equals_the_reference(chunk, dtype, initial):
    phi_q, phi_k, v = features(67, 0)
    state = some_state(1) if initial else None
    expected, expected_state = delta.naive_delta_attention(phi_q, phi_k, v, state, True)
    cast = (lambda x: x.to(dtype)) if dtype is torch.float32 else (lambda x: x)
    start = None if state is None else KernelState(cast(state.kv), cast(state.key_sum))
    out, final = delta.chunk_delta_attention(cast(phi_q), cast(phi_k), cast(v), start, True, chunk=chunk)
    assert relative_error(out.double().numpy(), expected.numpy()) < 1e-5
    assert relative_error(final.kv.double().numpy(), expected_state.kv.numpy()) < 1e-5
    assert relative_error(final.key_sum.double().numpy(), expected_state.key_sum.numpy()) < 1e-5


@pytest.mark.parametrize("chunk", [4, 16])
def test_pieces_through_the_state_equal_the_whole(chunk):
    phi_q, phi_k, v = features(80, 2)
    whole, whole_state = delta.chunk_delta_attention(phi_q, phi_k, v, None, True, chunk=chunk)
    outs, state, start = [], None, 0
    for end in [*SPLITS, 80]:
        piece = slice(start, end)
        out, state = delta.chunk_delta_attention(
            phi_q[:, piece], phi_k[:, piece], v[:, piece], state, True, chunk=chunk
        )
        outs.append(out)
        start = end
    assert relative_error(torch.cat(outs, dim=1).numpy(), whole.numpy()) < 1e-10
    assert relative_error(state.kv.numpy(), whole_state.kv.numpy()) < 1e-10


def test_padded_keys_write_nothing():
    phi_q, phi_k, v = features(30, 3)
    phi_k[:, 5:9] = 0.0
    junk = v.clone()
    junk[:, 5:9] = 1e3
    first = delta.chunk_delta_attention(phi_q, phi_k, v, None, True, chunk=4)
    second = delta.chunk_delta_attention(phi_q, phi_k, junk, None, True, chunk=4)
    assert torch.equal(first[1].kv, second[1].kv)
    assert torch.allclose(first[0][:, 9:], second[0][:, 9:])


def test_block_doubling_inverse_where_the_neumann_product_cancels():
    """Keys of cosine 0.8 (positive features are alike): the doubling's inverse is exact to
    float32's rounding, the product (I - A)(I + A^2)(I + A^4)... of the same matrix is not."""
    a = torch.tril(torch.full((64, 64), 0.8), -1)
    exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + a.double())
    assert (delta.unit_lower_inverse(a).double() - exact).abs().max() < 1e-6
    product, power = torch.eye(64) - a, a @ a
    for _ in range(5):
        product, power = product @ (torch.eye(64) + power), power @ power
    assert (product.double() - exact).abs().max() > 1.0


def test_a_key_written_twice_keeps_its_last_value():
    """What the rule is for: an association overwritten, not piled up."""
    key = torch.tensor([[[1.0, 2.0, 0.5]]]).double()
    phi_k = key.repeat(1, 2, 1)
    v = torch.tensor([[[3.0], [-1.0]]]).double()
    out, _ = delta.naive_delta_attention(phi_k, phi_k, v)
    assert torch.allclose(out[0, -1], torch.tensor([-1.0]).double())


# --- ONNX body ------------------------------------------------------------------------------------


def from_state_session(chunk: int) -> ort.InferenceSession:
    functions = delta_rule_from_state_functions(OPSET, chunk)
    names = ["phi_q", "phi_k", "v", "kv_state", "key_sum"]
    node = helper.make_node(functions[-1].name, names, ["out", "kv", "normaliser"], domain="attnrewrite")
    ranks = [3, 3, 3, 3, 2]

    def value(name, rank):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}{i}" for i in range(rank)])

    inputs = [value(n, r) for n, r in zip(names, ranks)]
    outputs = [value(n, r) for n, r in zip(("out", "kv", "normaliser"), (3, 3, 2))]
    graph = helper.make_graph([node], "delta", inputs, outputs)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("attnrewrite", 1)]
    model = helper.make_model(graph, functions=functions, ir_version=10, opset_imports=opsets)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("n", [1, 3, 16, 37])
@pytest.mark.parametrize("chunk", [1, 8, 16])
def test_onnx_body_equals_the_reference(chunk, n):
    phi_q, phi_k, v = features(n, 4)
    state = some_state(5)
    expected, expected_state = delta.naive_delta_attention(phi_q, phi_k, v, state, True)
    arrays = [x.float().numpy() for x in (phi_q, phi_k, v, state.kv, state.key_sum)]
    out, kv, normaliser = from_state_session(chunk).run(
        None, dict(zip(["phi_q", "phi_k", "v", "kv_state", "key_sum"], arrays))
    )
    assert relative_error(out, expected.numpy()) < 1e-5
    assert relative_error(kv, expected_state.kv.numpy()) < 1e-5
    assert relative_error(normaliser, expected_state.key_sum.numpy()) < 1e-5


# --- the methods ----------------------------------------------------------------------------------


def delta_options(method, **extra):
    more = {"features": 16} if method is favor else {}
    return passes.make_options(method, chunk=4, update="delta", **more, **extra)


@pytest.mark.parametrize("method", METHODS)
def test_refusals(method):
    method = METHODS[method]
    bidirectional = dataclasses.replace(make_site(), mask=MaskKind.KEY_PADDING)
    assert method.supports(bidirectional, delta_options(method)) == delta.CAUSAL_ONLY
    assert method.supports(make_site(), delta_options(method)) is None
    with pytest.raises(OptionError, match="window"):
        delta_options(method, window=4)
    assert method.attention_weights_unavailable(delta_options(method)) == delta.NO_WEIGHTS


@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_onnx_equals_torch(method, padding):
    method = METHODS[method]
    site, options = make_site(), delta_options(method)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(padding)
    keep = torch.ones(*k.shape[:-1], 1) if keep is None else keep
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    lowering = method.onnx_lowering(site, options, OPSET, state_dict(parallel))
    assert lowering.op_type.startswith(("CausalDeltaRule", "LearnedCausalDeltaRule"))
    session = lowering_session(lowering, rank=4)
    out = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": keep.numpy()})[0]
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_torch_steps_equal_the_parallel_form(method, padding, schedule):
    method = METHODS[method]
    site, options = make_site(), delta_options(method)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(padding)
    module = recurrent_form(site, options).torch_module(site, parallel)
    assert [t.name for t in module.description] == ["kernel_state"]  # no log scale, favor's neither
    with torch.no_grad():
        expected = parallel(q, k, v, keep)
        state = module.initial_state(q, v)
        for piece in pieces(SCHEDULES[schedule]):
            out, *state = module(rows(q, piece), rows(k, piece), rows(v, piece), rows(keep, piece), *state)
            assert relative_error(out.numpy(), expected[..., piece, :].numpy()) < 1e-5, piece


def onnx_steps(method, padding, schedule, contrib_ops: bool, rank: int = 4):
    site, options = make_site(rank), delta_options(method)
    parallel = fitted_parallel(method, site, options)
    lead = (sequence(padding)[0].shape[0],) if rank == 4 else (6,)
    q, k, v, keep = sequence(padding) if rank == 4 else sequence(padding, lead=lead)
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    form = recurrent_form(site, options)
    lowering = form.onnx_lowering(site, OPSET, state_dict(parallel), contrib_ops=contrib_ops)
    operators = [n for n in lowering_nodes(lowering) if n.op_type == "LinearAttention"]
    assert len(operators) == (2 if contrib_ops else 0)  # the prefill's and the step's
    assert all(a.s == b"delta" for n in operators for a in n.attribute if a.name == "update_rule")
    model = recurrent_model(lowering, form.state(site), rank=rank)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    steps = run_onnx_steps(session, site, options, SCHEDULES[schedule], (q, k, v, keep))
    for piece, (out, *_) in zip(pieces(SCHEDULES[schedule]), steps):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_equal_the_parallel_form(method, padding, schedule):
    onnx_steps(METHODS[method], padding, schedule, contrib_ops=False)


@pytest.mark.skipif(not runs_linear_attention(), reason="this onnxruntime has no com.microsoft.LinearAttention")
@pytest.mark.parametrize("schedule", ["prefill-then-tokens", "uneven-pieces"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_through_linear_attention_equal_the_parallel_form(method, padding, schedule):
    onnx_steps(METHODS[method], padding, schedule, contrib_ops=True)


@pytest.mark.parametrize("contrib_ops", [False, True], ids=["standard-ops", "linear-attention"])
def test_steps_with_heads_folded_into_the_batch(contrib_ops):
    if contrib_ops and not runs_linear_attention():
        pytest.skip("this onnxruntime has no com.microsoft.LinearAttention")
    onnx_steps(hedgehog, True, "uneven-pieces", contrib_ops, rank=3)


# --- decoders -------------------------------------------------------------------------------------


def decoder_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    ("name", "exporter", "method"),
    [
        ("gpt2", "legacy", "hedgehog"),
        ("gpt2", "dynamo", "linear"),
        ("llama", "legacy", "favor"),
        ("llama", "dynamo", "hedgehog"),
    ],
)
def test_decoder_steps_equal_the_parallel_rewrite(decoder_exports, name, exporter, method):
    """A KV-cache export with --recurrent and update=delta, prefilled then stepped through a
    left-padded batch, equals the parallel update=delta rewrite of its no-cache export."""
    cached = decoder_exported(decoder_exports, name, exporter)
    uncached = decoder_exported(decoder_exports, name, exporter, cache=False)
    full = full_sequence(cached.spec)
    parallel = attnrewrite.rewrite(str(uncached.path), method, update="delta", chunk=4)
    expected = decoder_session(parallel).run(["logits"], full)[0]
    model = attnrewrite.rewrite(str(cached.path), method, recurrent=True, update="delta", chunk=4)
    assert {"past_key_values.0.recurrent_state"} <= {i.name for i in model.graph.input}
    schedule = prefill_then_steps()
    for (start, end), (logits, _) in zip(schedule, stepped(decoder_session(model), full, schedule)):
        error = logits_error(logits, expected[:, :end], full["attention_mask"][:, :end])
        assert error <= TOLERANCE * np.abs(expected).max(), (start, end, error)
    additive = attnrewrite.rewrite(str(uncached.path), method, chunk=4)
    assert logits_error(decoder_session(additive).run(["logits"], full)[0], expected, full["attention_mask"]) > 1e-3


def test_fx_rewrite_equals_the_onnx_rewrite_of_its_export():
    """Both frontends: GPT-2 rewritten through torch.fx with update=delta gives the ONNX
    frontend's rewrite of its export, and the rewritten GraphModule exports as it runs."""
    names, args = ["input_ids", "attention_mask"], model_inputs("gpt2")
    fx = rewrite_graph_module(exported("gpt2", "eager"), "linear", update="delta", chunk=4)
    from_fx = torch_output(fx, args)
    assert relative_error(run_onnx(to_onnx(fx, args, names), names, args), from_fx) < 1e-5
    onnx_rewritten = attnrewrite.rewrite(
        to_onnx(build("gpt2", "eager"), args, names), to="linear", update="delta", chunk=4
    )
    assert relative_error(run_onnx(onnx_rewritten, names, args), from_fx) < 1e-5


def test_calibration_fits_through_the_delta_rule(decoder_exports):
    """Calibration fits hedgehog's feature map through the delta rule (its torch form): every
    site's loss falls, and the calibrated recurrent model equals the calibrated parallel one."""
    spec = DECODERS["gpt2"]
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    uncached = decoder_exported(decoder_exports, "gpt2", "legacy", cache=False)
    data = tokens(spec.vocab, 16, 20, seed=1)
    settings = {"calibrate_steps": 20, "update": "delta", "chunk": 4}
    recurrent_model = attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True, calibrate=data, **settings)
    parallel = attnrewrite.rewrite(str(uncached.path), "hedgehog", calibrate=with_positions(spec, data), **settings)
    sites = read_record(recurrent_model)["sites"]
    assert all(site["calibration"]["loss_after"] < site["calibration"]["loss_before"] for site in sites)
    sequence = tokens(spec.vocab, 2, 14, seed=2)
    expected = decoder_session(parallel).run(["logits"], with_positions(spec, sequence))[0]
    actual = forced_logits(
        decoder_session(recurrent_model), "recurrent", sequence["input_ids"], sequence["attention_mask"], 9
    )
    assert logits_error(actual, expected, sequence["attention_mask"]) <= TOLERANCE * np.abs(expected).max()


def test_recent_pairs_are_recalled_where_the_additive_state_has_lost_them():
    """The rule's purpose (delta.py's measurement): after 1024 keys, the last 8 values read back
    with their keys' own features are near, the additive state's average of everything is not."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1024, 32, generator=generator) * 2
    phi = torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)  # hedgehog's, W = I
    v = torch.randn(1, 1024, 16, generator=generator)
    _, state = delta.chunk_delta_attention(phi, phi, v, None, True, chunk=64)
    additive = KernelState(phi[0].T @ v[0], phi[0].sum(0))

    def recall_error(s: KernelState) -> float:
        read = phi[0, -8:] @ s.kv.reshape(64, 16) / (phi[0, -8:] @ s.key_sum.reshape(64, 1))
        return float(((read - v[0, -8:]).norm(dim=-1) / v[0, -8:].norm(dim=-1)).mean())

    assert recall_error(state) < 0.5 < 0.9 < recall_error(additive)
