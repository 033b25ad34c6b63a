"""The kernel family's chunk forms against the naive one (kernel.naive): the torch chunk form
(kernel.state.chunk_kernel_attention) and its ONNX functions (on onnxruntime), over whole
sequences and in pieces fed through the state (steps of one position included), with and
without per-key log scales (large ones, far outside exp's range), some keys padded."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from models import relative_error

from attnrewrite.passes.kernel import state as kernel_state
from attnrewrite.passes.kernel.naive import naive_kernel_attention
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.parallel import (
    causal_linear_attention_functions,
    causal_rescaled_linear_attention_functions,
    linear_attention,
)
from attnrewrite.passes.kernel.state import (
    KernelState,
    causal_linear_attention_from_state_functions,
    causal_rescaled_linear_attention_from_state_functions,
    chunk_kernel_attention,
)
from attnrewrite.passes.lowering import DOMAIN, with_callees

B, H, F, DV = 2, 2, 6, 5
TOLERANCE = 1e-5  # float32 forms against the float64 reference
SPLITS = [1, 2, 3, 20, 21, 53]  # pieces of 1, 1, 1, 17, 1, 32 and the rest positions


def sequence(n: int, seed: int):
    """phi_q, phi_k, v [B, H, n, *] and key log scales [B, H, n, 1] (standard deviation 50), one
    key in five padded (features 0, log scale the lowest)."""
    rng = np.random.default_rng(seed)
    phi_q, phi_k = (torch.from_numpy(rng.random((B, H, n, F), dtype=np.float32)) for _ in range(2))
    v = torch.from_numpy(rng.standard_normal((B, H, n, DV)).astype(np.float32))
    log_scale = torch.from_numpy((rng.standard_normal((B, H, n, 1)) * 50).astype(np.float32))
    padded = torch.from_numpy(rng.random((B, 1, n, 1)) < 0.2)
    return phi_q, phi_k.masked_fill(padded, 0.0), v, log_scale.masked_fill(padded, LOWEST_LOG_SCALE)


def some_state(rescaled: bool, seed: int) -> KernelState:
    """Keys absorbed earlier: positive sums, log scales of standard deviation 50 (one head's the
    lowest: nothing absorbed)."""
    rng = np.random.default_rng(seed)
    kv = torch.from_numpy(rng.random((B, H, F, DV), dtype=np.float32))
    key_sum = torch.from_numpy(rng.random((B, H, F), dtype=np.float32) * 3)
    if not rescaled:
        return KernelState(kv, key_sum)
    log_scale = torch.from_numpy((rng.standard_normal((B, H)) * 50).astype(np.float32))
    return KernelState(
        kv, key_sum, log_scale.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(LOWEST_LOG_SCALE))
    )


def naive(phi_q, phi_k, v, log_scale, state):
    """The reference: (out in float64, the final state, float32 as every KernelState)."""
    double = [None if x is None else x.double() for x in (phi_q, phi_k, v, log_scale)]
    double_state = None if state is None else KernelState(*(None if x is None else x.double() for x in state))
    out = naive_kernel_attention(*double, double_state)[0]
    return out, naive_kernel_attention(phi_q, phi_k, v, log_scale, state, True)[1]


def assert_states_close(state: KernelState, expected: KernelState):
    for got, want in zip(state, expected):
        if want is not None:
            assert relative_error(np.asarray(got), want.numpy()) < TOLERANCE


@pytest.mark.parametrize("from_state", [False, True])
@pytest.mark.parametrize("rescaled", [False, True])
@pytest.mark.parametrize("n, chunk", [(1, 4), (7, 1), (37, 4), (70, 16)])
def test_chunk_form_equals_naive(n, chunk, rescaled, from_state):
    phi_q, phi_k, v, log_scale = sequence(n, seed=n)
    log_scale = log_scale if rescaled else None
    state = some_state(rescaled, seed=n) if from_state else None
    out, final = chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, True, chunk=chunk)
    expected, expected_final = naive(phi_q, phi_k, v, log_scale, state)
    assert relative_error(out, expected) < TOLERANCE
    assert_states_close(final, expected_final)


@pytest.mark.parametrize("rescaled", [False, True])
def test_pieces_through_the_state_equal_the_whole_sequence(rescaled):
    phi_q, phi_k, v, log_scale = sequence(70, seed=1)
    log_scale = log_scale if rescaled else None
    state, outs = some_state(rescaled, seed=1), []
    expected, expected_final = naive(phi_q, phi_k, v, log_scale, state)
    for piece in np.split(np.arange(70), SPLITS):
        rows = (slice(None),) * 2 + (slice(piece[0], piece[-1] + 1),)
        out, state = chunk_kernel_attention(
            phi_q[rows], phi_k[rows], v[rows], None if log_scale is None else log_scale[rows], state, True, chunk=4
        )
        outs.append(out)
    assert relative_error(torch.cat(outs, dim=-2), expected) < TOLERANCE
    assert_states_close(state, expected_final)


@pytest.mark.parametrize("from_state", [False, True])
@pytest.mark.parametrize("rescaled", [False, True])
def test_a_long_sequence_runs_in_passes_equal_to_one(monkeypatch, rescaled, from_state):
    """Past PASS_POSITIONS the form runs pass by pass through its own state (8 positions here,
    two chunks of 4; 37 positions: 5 passes, the last short)."""
    monkeypatch.setattr(kernel_state, "PASS_POSITIONS", 8)
    phi_q, phi_k, v, log_scale = sequence(37, seed=3)
    log_scale = log_scale if rescaled else None
    state = some_state(rescaled, seed=3) if from_state else None
    out, final = chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, True, chunk=4)
    expected, expected_final = naive(phi_q, phi_k, v, log_scale, state)
    assert relative_error(out, expected) < TOLERANCE
    assert_states_close(final, expected_final)
    assert chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, chunk=4)[1] is None


def test_bidirectional_naive_is_linear_attention():
    phi_q, phi_k, v, _ = sequence(9, seed=2)
    expected, _ = naive_kernel_attention(phi_q.double(), phi_k.double(), v.double(), causal=False)
    assert relative_error(linear_attention(phi_q, phi_k, v), expected) < TOLERANCE


@functools.cache
def session(function):
    """An onnxruntime session of one call of a kernel ONNX function on float32 [G, ...] inputs,
    every output a graph output."""
    proto = function.to_function_proto()
    node = onnx.helper.make_node(function.name, list(proto.input), list(proto.output), domain=DOMAIN)
    graph = onnx.helper.make_graph(
        [node],
        "f",
        [onnx.helper.make_tensor_value_info(a, onnx.TensorProto.FLOAT, None) for a in proto.input],
        [onnx.helper.make_tensor_value_info(a, onnx.TensorProto.FLOAT, None) for a in proto.output],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid(DOMAIN, 1)],
        functions=[f.to_function_proto() for f in with_callees(function)],
        ir_version=10,
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_onnx(function, *inputs) -> list[np.ndarray]:
    """``function`` on torch tensors [B, H, ...], flattened to [G, ...] (log scales of the
    state to [G, 1]); its outputs unflattened to [B, H, ...]."""
    names = [i.name for i in session(function).get_inputs()]
    flat = [x.reshape(B * H, *x.shape[2:]).numpy() for x in inputs]
    flat = [x.reshape(-1, 1) if x.ndim == 1 else x for x in flat]
    outs = session(function).run(None, dict(zip(names, flat)))
    return [out.reshape(B, H, *out.shape[1:]) for out in outs]


@pytest.mark.parametrize("rescaled", [False, True])
@pytest.mark.parametrize("n", [1, 37])
def test_onnx_whole_sequence_equals_naive(n, rescaled):
    phi_q, phi_k, v, log_scale = sequence(n, seed=3)
    if rescaled:
        out = run_onnx(causal_rescaled_linear_attention_functions(18, 4)[-1], phi_q, phi_k, log_scale, v)[0]
    else:
        out = run_onnx(causal_linear_attention_functions(18, 4)[-1], phi_q, phi_k, v)[0]
    assert relative_error(out, naive(phi_q, phi_k, v, log_scale if rescaled else None, None)[0]) < TOLERANCE


@pytest.mark.parametrize("rescaled", [False, True])
def test_onnx_pieces_through_the_state_equal_naive(rescaled):
    phi_q, phi_k, v, log_scale = sequence(70, seed=4)
    state, outs = some_state(rescaled, seed=4), []
    expected, expected_final = naive(phi_q, phi_k, v, log_scale if rescaled else None, state)
    if rescaled:
        function = causal_rescaled_linear_attention_from_state_functions(18, 4)[-1]
    else:
        function = causal_linear_attention_from_state_functions(18, 4)[-1]
    for piece in np.split(np.arange(70), SPLITS):
        rows = (slice(None),) * 2 + (slice(piece[0], piece[-1] + 1),)
        keys = (phi_k[rows], log_scale[rows]) if rescaled else (phi_k[rows],)
        out, *parts = run_onnx(function, phi_q[rows], *keys, v[rows], *(x for x in state if x is not None))
        outs.append(out)
        state = KernelState(
            *(torch.from_numpy(x) for x in parts[:2]), torch.from_numpy(parts[2][..., 0]) if rescaled else None
        )
    assert relative_error(np.concatenate(outs, axis=-2), expected) < TOLERANCE
    assert_states_close(state, expected_final)
