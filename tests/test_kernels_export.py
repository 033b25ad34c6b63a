"""The kernel family's torch lowerings (attnrewrite/passes/kernel/, window/) under torch.export with a dynamic
sequence length: no shape guard on N (a guard silently fixes the shapes torch.onnx.export
writes), the exported program equal to eager at lengths the example did not have, the
dynamo ONNX export of causal FAVOR (torch.cummax had no conversion) running on onnxruntime,
as a module and in an FX-rewritten model, and the torch kernels equal to their ONNX functions.

Exports take seconds each: every test here exports as little as it can.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from test_fx_spellings import Attention, causal_and_padding_where, inputs
from torch.utils._sympy.numbers import int_oo

from attnrewrite.fx import rewrite_graph_module
from attnrewrite.passes import favor, linear
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.kernel.parallel import (
    causal_linear_attention_functions,
    causal_rescaled_linear_attention_functions,
)
from attnrewrite.passes.kernel.state import chunk_kernel_attention
from attnrewrite.passes.lowering import DOMAIN, DOMAIN_VERSION
from attnrewrite.passes.window import torch_form
from attnrewrite.site import AttentionSite, MaskKind

CHUNK = 16
# Shorter than a chunk, exactly one, one more, and several with a partial last chunk.
LENGTHS = (1, 5, CHUNK, CHUNK + 1, 100)


def rel_err(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def randn(*shape, seed: int):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def causal_module(pass_module, mask: MaskKind, **options):
    site = AttentionSite("attn", scale=16**-0.5, mask=mask, head_dim=16, rank=4, num_heads=2)
    options = pass_module.Options(chunk=CHUNK, seed=3, **options)
    return pass_module.torch_module(site, options).eval()


def attention_inputs(n: int, mask: MaskKind, seed: int = 0) -> tuple:
    """q, k, v [2, 2, n, 16] (large enough that FAVOR's stabilizers matter), plus key_keep
    [2, 1, n, 1] with the second batch's last third padded when the mask has padding."""
    q, k, v = (randn(2, 2, n, 16, seed=seed + i) * 2 for i in range(3))
    if not mask.key_padding:
        return q, k, v
    keep = torch.ones(2, 1, n, 1)
    keep[1, :, n - n // 3 :] = 0.0
    return q, k, v, keep


def dynamic_shapes(args: tuple) -> tuple:
    """Batch and sequence both dynamic, each down to 1."""
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1)
    return tuple({0: batch, 2: seq} for _ in args)


# Example lengths on both sides of the chunk: each once specialized the export its own way.
EXPORTS = [
    pytest.param(linear, MaskKind.CAUSAL, 40, {}, id="linear-causal-40"),
    pytest.param(linear, MaskKind.CAUSAL, 5, {}, id="linear-causal-5"),
    pytest.param(favor, MaskKind.CAUSAL, 40, {}, id="favor-causal-40"),
    pytest.param(favor, MaskKind.CAUSAL_KEY_PADDING, 5, {}, id="favor-causal-padding-5"),
    # the window hybrid (its block layout is ChunkLayout's), in its most involved form
    pytest.param(favor, MaskKind.CAUSAL_KEY_PADDING, 40, {"window": 8}, id="favor-causal-padding-window8-40"),
    # bidirectional: the next block and sinks, more of them than the shortest lengths have keys
    pytest.param(linear, MaskKind.KEY_PADDING, 40, {"window": 8, "sinks": 3}, id="linear-padding-window8-sinks3-40"),
]


@pytest.mark.parametrize(("pass_module", "mask", "example", "options"), EXPORTS)
def test_export_leaves_sequence_length_free_and_matches_eager(pass_module, mask, example, options, monkeypatch):
    # At a free length a bidirectional window takes its far part from one state; eager, at a
    # given one, from block states up to torch_form.STATE_BLOCKS blocks: compare like with like.
    monkeypatch.setattr(torch_form, "STATE_BLOCKS", 0)
    module = causal_module(pass_module, mask, **options)
    args = attention_inputs(example, mask)
    program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(args))

    for symbol, bounds in program.range_constraints.items():
        assert bounds.lower <= 1 and bounds.upper == int_oo, (symbol, bounds)
    exported = program.module()
    for n in LENGTHS:
        for batch in (1, 2):
            args = [a[:batch] for a in attention_inputs(n, mask, seed=n)]
            with torch.no_grad():
                assert rel_err(exported(*args), module(*args)) < 1e-6, (n, batch)


def to_onnx(model, args: tuple, names: list[str], shapes):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, args, input_names=names, dynamic_shapes=shapes, dynamo=True)
    return program.model_proto


def onnx_session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_causal_favor_module_exports_to_onnx_and_runs_on_onnxruntime():
    module = causal_module(favor, MaskKind.CAUSAL)
    names = ["q", "k", "v"]
    args = attention_inputs(40, MaskKind.CAUSAL)
    model = to_onnx(module, args, names, dynamic_shapes(args))
    seq_dims = [i.type.tensor_type.shape.dim[2] for i in model.graph.input]
    assert all(d.dim_param and not d.HasField("dim_value") for d in seq_dims)  # not fixed at 40

    session = onnx_session(model)
    for n in (7, 33):
        args = attention_inputs(n, MaskKind.CAUSAL, seed=n)
        got = session.run(None, {name: a.numpy() for name, a in zip(names, args)})[0]
        with torch.no_grad():
            assert rel_err(got, module(*args)) < 1e-5, n


def test_fx_rewritten_causal_model_exports_with_favor():
    """What users do: rewrite in FX (default chunk 64), then export with dynamic shapes."""
    gm = rewrite_graph_module(Attention(causal_and_padding_where, "keep").eval(), "favor")
    assert any(isinstance(m, favor.FavorAttention) and m.causal for m in gm.modules())
    names = ["x", "mask"]
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1)
    shapes = {"x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}
    session = onnx_session(to_onnx(gm, inputs("keep"), names, shapes))
    for batch_size, length in ((2, 5), (3, 70)):  # within one chunk; across two
        args = inputs("keep", batch=batch_size, seq=length)
        got = session.run(None, {name: a.numpy() for name, a in zip(names, args)})[0]
        with torch.no_grad():
            assert rel_err(got, gm(*args)) < 1e-5, length


# --- torch kernels against their ONNX functions -------------------------------------------------


def run_kernel_function(functions, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """One call of the last of `functions` (the others are its callees), on rank-3 inputs."""
    values = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}{i}" for i in range(3)]) for name in inputs
    ]
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    node = helper.make_node(functions[-1].name, list(inputs), ["out"], domain=DOMAIN)
    model = helper.make_model(
        helper.make_graph([node], "kernel", values, [output]),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=functions,
        ir_version=10,
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def kernel_inputs(n: int):
    """Positive features of 6 heads and log scales spread over +-30, one head's keys after the
    first masked the way FAVOR masks them (zero features, the lowest log scale)."""
    phi_q, phi_k = (randn(6, n, 8, seed=n + i).exp() for i in range(2))
    v = randn(6, n, 5, seed=n + 2)
    log_scale = randn(6, n, 1, seed=n + 3) * 30
    phi_k[0, 1:] = 0.0
    log_scale[0, 1:] = LOWEST_LOG_SCALE
    return phi_q, phi_k, log_scale, v


@pytest.mark.parametrize("n", LENGTHS)
def test_causal_kernels_equal_their_onnx_functions(n):
    phi_q, phi_k, log_scale, v = kernel_inputs(n)
    feeds = {"phi_q": phi_q.numpy(), "phi_k": phi_k.numpy(), "v": v.numpy()}

    plain = chunk_kernel_attention(phi_q, phi_k, v, chunk=CHUNK)[0]
    functions = causal_linear_attention_functions(18, CHUNK)
    assert rel_err(plain, run_kernel_function([f.to_function_proto() for f in functions], feeds)) < 1e-5

    rescaled = chunk_kernel_attention(phi_q, phi_k, v, log_scale, chunk=CHUNK)[0]
    functions = causal_rescaled_linear_attention_functions(18, CHUNK)
    feeds = {**feeds, "key_log_scale": log_scale.numpy()}
    feeds = {name: feeds[name] for name in ("phi_q", "phi_k", "key_log_scale", "v")}
    expected = run_kernel_function([f.to_function_proto() for f in functions], feeds)
    assert rel_err(rescaled, expected) < 1e-5
