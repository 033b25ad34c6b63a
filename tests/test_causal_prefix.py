"""Causal lowerings take no prefix sum along an axis that grows with N, and their hierarchical
sums equal the N x N definitions.

onnxruntime's CUDA CumSum sums each output element's whole prefix, so a
CumSum along an axis of length L costs O(L^2) there (CPU's is a running sum, so CPU benchmarks
hide it). Prefix sums over positions or chunk states go through kernel.chunks' ExclusivePrefixSum and
RescaledPrefixSum (products with triangular matrices, in levels of kernel.chunks.PREFIX_GROUP rows);
a CumSum is left only along an axis whose length is a constant (hydra's chunk of positions),
and no value holds a (chunks x chunks) matrix (the rescaled carry is nested two levels deep).
The torch forms (the FX frontend's, calibration's) keep torch.cumsum but nest their rescaled
carry alike.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_model, lowering_session
from models import relative_error

from attnrewrite.passes import favor, hedgehog, hydra, linear
from attnrewrite.passes.kernel import chunks
from attnrewrite.passes.kernel.chunks import exclusive_prefix_sum_function, rescaled_prefix_functions
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.state import KernelState, chunk_kernel_attention
from attnrewrite.passes.lowering import DOMAIN, with_callees
from attnrewrite.passes.window.reference import feature_map_attention_weights
from attnrewrite.passes.window.settings import KernelScales, Window
from attnrewrite.passes.window.torch_form import windowed_kernel_attention
from attnrewrite.site import AttentionSite, MaskKind

B, H, D = 2, 3, 8
SCALE = D**-0.5
CAUSAL = [
    (linear, {}),
    (hedgehog, {}),
    (favor, {"features": 16}),
    (hydra, {}),
    (linear, {"window": 4}),
    (hedgehog, {"window": 4, "sinks": 2}),
    (favor, {"window": 4, "features": 16}),
]


def config_id(config) -> str:
    method, options = config
    return ":".join([method.NAME, *(f"{k}={v}" for k, v in options.items())])


def causal_site() -> AttentionSite:
    return AttentionSite(
        "attn", scale=SCALE, mask=MaskKind.CAUSAL_KEY_PADDING, rank=4, num_heads=H, head_dim=D, value_dim=D
    )


def options_of(method, options: dict, chunk: int):
    """The method's Options; ``chunk`` for those that have one."""
    if method is hydra:
        return method.Options(**options)
    return method.Options(**options, chunk=chunk)


def qkv_keep(n: int, seed: int = 0):
    """q, k, v [B, H, n, D] and key_keep [B, 1, n, 1]: batch row 1 padded at both ends."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(np.float32) for _ in range(3))
    keep = np.ones((B, 1, n, 1), np.float32)
    keep[1, :, :3] = 0.0
    keep[1, :, n - 5 :] = 0.0
    return q, k, v, keep


# --- no CumSum along N --------------------------------------------------------------------------


def cumsum_axis_lengths(lowering, n: int) -> list[int]:
    """The length of every CumSum's summed axis, in node order, when the lowering (functions
    inlined) runs at sequence length n: read from the CumSum inputs themselves."""
    model = onnx.inliner.inline_local_functions(lowering_model(lowering, 4))
    cumsums = [node for node in model.graph.node if node.op_type == "CumSum"]
    for node in cumsums:
        for name in node.input[:2]:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v, keep = qkv_keep(n)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(q=q, k=k, v=v, key_keep=keep))))
    return [values[node.input[0]].shape[int(values[node.input[1]])] for node in cumsums]


@pytest.mark.parametrize("config", CAUSAL, ids=config_id)
def test_no_cumsum_axis_grows_with_the_sequence(config):
    """Every CumSum's axis has the same length at N = 37 and N = 1100 (chunk 2: 550 chunks,
    every level of the hierarchy in use)."""
    method, options = config
    lowering = method.onnx_lowering(causal_site(), options_of(method, options, chunk=2), 20)
    short, long = cumsum_axis_lengths(lowering, 37), cumsum_axis_lengths(lowering, 1100)
    assert short == long
    if method is hydra:
        assert long == [hydra.CAUSAL_CHUNK]  # the chunk's positions, whatever N


def largest_intermediate(lowering, n: int) -> int:
    """The most elements any value of the lowering (functions inlined) holds at length n."""
    model = onnx.inliner.inline_local_functions(lowering_model(lowering, 4))
    known = {output.name for output in model.graph.output}
    for name in (name for node in model.graph.node for name in node.output if name and name not in known):
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        known.add(name)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v, keep = qkv_keep(n)
    return max(np.asarray(value).size for value in session.run(None, dict(q=q, k=k, v=v, key_keep=keep)))


@pytest.mark.parametrize("config", CAUSAL, ids=config_id)
def test_no_value_grows_faster_than_the_sequence(config):
    """No (chunks x chunks) carry or mask: from N = 300 to 1100 (chunk 2) the largest value
    grows as N does (one level over 550 chunk states held a 550 x 550 carry: 3.7x more)."""
    method, options = config
    lowering = method.onnx_lowering(causal_site(), options_of(method, options, chunk=2), 20)
    growth = (largest_intermediate(lowering, 1100) / 1100) / (largest_intermediate(lowering, 300) / 300)
    assert growth < 1.2


# --- the hierarchical sums equal the N x N definitions ------------------------------------------


def by_definition(method, module, q, k, v, keep) -> np.ndarray:
    """The module's attention as its N x N weights times v, in float64 (hedgehog's and favor's
    weights come from their modules, which compute in float32: no sum over N in them)."""
    q, k, v, keep = (torch.from_numpy(x).double() for x in (q, k, v, keep))
    with torch.no_grad():
        if method is hydra:
            q_hat, k_hat = module.normalize(q), module.normalize(k) * keep
            return (q_hat * (torch.ones(q.shape[-2], q.shape[-2], dtype=torch.float64).tril() @ (k_hat * v))).numpy()
        if method is linear:
            features = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
            weights = feature_map_attention_weights(module.double(), *features, q, k, keep)
        else:
            weights = module.attention_weights(q.float(), k.float(), keep.float()).double()
    has_keys = keep.cumsum(-2) > 0  # a row before every kept key is 0 (favor's softmax: uniform)
    return (weights @ v * has_keys).numpy()


@pytest.mark.parametrize("chunk, n", [(1, 301), (5, 163)])
@pytest.mark.parametrize("config", [c for c in CAUSAL if not (c[0] is favor and "window" in c[1])], ids=config_id)
def test_causal_lowering_equals_its_definition(config, chunk, n):
    """N not a multiple of the chunk, padded keys at both ends of one batch row; hydra at
    N = 1093 (18 of its chunks of 64, two groups)."""
    method, options = config
    n = 17 * hydra.CAUSAL_CHUNK + 5 if method is hydra else n
    site, options = causal_site(), options_of(method, options, chunk)
    module = method.torch_module(site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()} or None
    session = lowering_session(method.onnx_lowering(site, options, 20, weights), 4)
    q, k, v, keep = qkv_keep(n, seed=chunk)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert relative_error(out, by_definition(method, module, q, k, v, keep)) < 2e-5


@pytest.mark.parametrize("chunk, n", [(1, 301), (5, 163)])
def test_causal_favor_window_lowering_equals_torch(chunk, n):
    """favor's window has no N x N weights (favor.WINDOWED_WEIGHTS): its ONNX form's
    hierarchical carry against the torch module's."""
    site, options = causal_site(), favor.Options(window=4, features=16, chunk=chunk)
    module = favor.torch_module(site, options)
    weights = {name: value.numpy() for name, value in module.state_dict().items()}
    session = lowering_session(favor.onnx_lowering(site, options, 20, weights), 4)
    q, k, v, keep = qkv_keep(n, seed=chunk)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    with torch.no_grad():
        expected = module(*(torch.from_numpy(x) for x in (q, k, v, keep))).numpy()
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 256, 300])
def test_prefix_sums_and_running_maxima_over_every_level(length, skip):
    """ExclusivePrefixSum, ChunkRunningMax and RescaledPrefixSum (``skip`` = 1: the sums over
    rows <= c-2) against numpy at lengths that fill one group, spill into a second, and need
    the top level (> PREFIX_GROUP^2 rows)."""
    rng = np.random.default_rng(length)
    x = rng.standard_normal((3, length, 7)).astype(np.float32)
    m = (rng.standard_normal((3, length)) * 5).astype(np.float32)
    m[:, ::7] = LOWEST_LOG_SCALE  # masked keys
    summed = np.tri(length, k=-1 - skip)  # [row c, row c']
    prefix = run_function(exclusive_prefix_sum_function(18, skip), x)
    assert np.abs(prefix - summed @ x.astype(np.float64)).max() < 1e-4
    running_max, rescaled_prefix_sum = rescaled_prefix_functions(18, skip)
    upto = np.maximum.accumulate(m, axis=1)
    assert np.array_equal(run_function(running_max, m), upto)
    before = np.concatenate([np.full((3, 1), LOWEST_LOG_SCALE, np.float32), upto[:, :-1]], axis=1)
    reference = before + np.abs(rng.standard_normal((3, length))).astype(np.float32)  # >= every earlier m
    factors = np.exp(np.minimum(upto[:, None, :].astype(np.float64) - reference[:, :, None], 0.0))
    expected = (factors * summed) @ x.astype(np.float64)
    got = run_function(rescaled_prefix_sum, x, upto, reference)
    assert np.abs(got - expected).max() <= 1e-5 * max(np.abs(expected).max(), 1.0)
    if not skip:  # the torch form: one group's product up to PREFIX_GROUP rows, the levels beyond
        tensors = (torch.from_numpy(a) for a in (x, upto, reference))
        got = chunks.rescaled_prefix_sum(*tensors, chunks.prefix_groups(length, 1)).numpy()
        assert np.abs(got - expected).max() <= 1e-5 * max(np.abs(expected).max(), 1.0)


def run_function(function, *inputs: np.ndarray) -> np.ndarray:
    """One call of a kernel ONNX function on float32 inputs."""
    names = list(function.to_function_proto().input)
    node = onnx.helper.make_node(function.name, names, ["y"], domain=DOMAIN)
    values = [
        onnx.helper.make_tensor_value_info(a, onnx.TensorProto.FLOAT, [None] * x.ndim) for a, x in zip(names, inputs)
    ]
    graph = onnx.helper.make_graph(
        [node], "f", values, [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid(DOMAIN, 1)],
        functions=[f.to_function_proto() for f in with_callees(function)],
        ir_version=10,
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))[0]


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements any tensor an op returns holds."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def largest_torch_value(attention, n: int) -> int:
    """The most elements any value of ``attention`` holds on [6, n, *] inputs with per-key log
    scales (features 8, values 5)."""
    generator = torch.Generator().manual_seed(n)
    phi_q, phi_k = (torch.rand(6, n, 8, generator=generator) for _ in range(2))
    v, log_scale = torch.randn(6, n, 5, generator=generator), torch.randn(6, n, 1, generator=generator)
    with LargestTensor() as recorder:
        attention(phi_q, phi_k, v, log_scale)
    return recorder.largest


def causal_favor(phi_q, phi_k, v, log_scale):
    return chunk_kernel_attention(phi_q, phi_k, v, log_scale, chunk=2)[0]


def causal_favor_from_state(phi_q, phi_k, v, log_scale):
    """The same after an absorbed state: the running max and the carry start from its log scale."""
    state = KernelState(torch.ones(6, 8, 5), torch.ones(6, 8), torch.zeros(6))
    return chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, chunk=2)[0]


def causal_favor_window(phi_q, phi_k, v, log_scale):
    """Windows of 2, its far part in chunks of 1 block (far_chunk=2): the most chunks per position."""
    q, k = phi_q - 0.5, phi_k - 0.5
    scales = KernelScales(query_log_scale=torch.zeros_like(log_scale), key_log_scale=log_scale)
    window = Window(2, following=False, sinks=0)
    return windowed_kernel_attention(phi_q, phi_k, q, k, v, window, scale=1.0, causal=True, scales=scales, far_chunk=2)


@pytest.mark.parametrize(
    "attention", [causal_favor, causal_favor_from_state, causal_favor_window], ids=lambda f: f.__name__
)
def test_no_torch_value_grows_faster_than_the_sequence(attention):
    """The torch causal forms with per-key log scales: from N = 300 to 1100 (550 chunks, or
    551 blocks and 553 chunks of one block) the largest value grows as N does (a (chunks x
    chunks) carry held 3.7x more at 1100)."""
    growth = (largest_torch_value(attention, 1100) / 1100) / (largest_torch_value(attention, 300) / 300)
    assert growth < 1.2
