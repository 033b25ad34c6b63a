"""Streaming without sinks on com.microsoft.GroupQueryAttention (issue 68 part 1): the operator's own
local_window_size W attends to the last W keys up to each query, its own included, which is
streaming's definition with recent=W, sinks=0 (measured here on the installed onnxruntime: prefill
and decoding with a past, and with sliding_window_cache, which onnxruntime 1.32 has: past and
present hold only the window). So a parallel streaming rewrite keeps the operator and sets it,
and the decoder it writes generates what the streaming recurrence does."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from decoders import LAYERS, VOCAB, logits_error
from models import op_counts
from onnx import TensorProto, helper
from test_recurrent_fused import group_query_decoder
from test_recurrent_models import TOLERANCE, session
from test_streaming import definition

import attnrewrite
from attnrewrite.generate import forced_logits
from attnrewrite.passes.lowering import DOMAIN

H, KV_HEADS, D = 4, 2, 8
GQA = ("com.microsoft", "GroupQueryAttention")


def one_operator(window: int, sliding_window_cache: bool) -> ort.InferenceSession:
    """q [1, N, H D], k, v [1, N, Hkv D], past [1, Hkv, P, D], seqlens_k, total -> output, presents."""
    extra = {"sliding_window_cache": 1} if sliding_window_cache else {}
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=KV_HEADS,
        local_window_size=window,
        **extra,
    )
    f = TensorProto.FLOAT
    shapes = {"q": [1, "N", H * D], "k": [1, "N", KV_HEADS * D], "v": [1, "N", KV_HEADS * D]}
    shapes |= {"past_key": [1, KV_HEADS, "P", D], "past_value": [1, KV_HEADS, "P", D]}
    inputs = [helper.make_tensor_value_info(name, f, shape) for name, shape in shapes.items()]
    inputs += [helper.make_tensor_value_info(name, TensorProto.INT32, [1]) for name in ("seqlens_k", "total")]
    outputs = [helper.make_tensor_value_info(name, f, None) for name in node.output]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(*GQA[:1], 1)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def heads(x: np.ndarray, count: int) -> np.ndarray:
    """[1, N, count D] -> [H, N, D], each key/value head repeated for the query heads reading it."""
    split = x[0].reshape(x.shape[1], count, D).transpose(1, 0, 2)
    return np.repeat(split, H // count, axis=0)


@pytest.mark.parametrize("sliding_window_cache", [False, True], ids=["whole-cache", "window-cache"])
@pytest.mark.parametrize("pieces", [(13,), (9, 1, 3), (2, 1, 1, 1, 4, 1, 1, 1, 1)])
@pytest.mark.parametrize("recent", [1, 3, 5])
def test_local_window_size_is_streamings_recent_without_sinks(recent, pieces, sliding_window_cache):
    total = sum(pieces)
    rng = np.random.default_rng(recent)
    q = rng.standard_normal((1, total, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((1, total, KV_HEADS * D)).astype(np.float32) for _ in range(2))
    expected = definition(heads(q, H), heads(k, KV_HEADS), heads(v, KV_HEADS), 1.0, 1 / np.sqrt(D), 0, recent)
    operator = one_operator(recent, sliding_window_cache)
    capacity = recent if sliding_window_cache else 0  # a window cache holds the window, a whole one grows
    past = [np.zeros((1, KV_HEADS, capacity, D), np.float32)] * 2
    outputs, start = [], 0
    for n in pieces:
        end = start + n
        feeds = {"q": q[:, start:end], "k": k[:, start:end], "v": v[:, start:end]}
        feeds |= {"past_key": past[0], "past_value": past[1]}
        feeds |= {"seqlens_k": np.array([end - 1], np.int32), "total": np.array([end], np.int32)}
        out, *past = operator.run(None, feeds)
        outputs.append(out)
        start = end
    assert np.abs(heads(np.concatenate(outputs, axis=1), H) - expected).max() <= 1e-5
    assert past[0].shape[-2] == (recent if sliding_window_cache else total)


def test_a_parallel_rewrite_keeps_the_operator_with_its_window_and_generates_as_the_recurrence():
    recent = 3
    windowed = attnrewrite.rewrite(group_query_decoder(), to="streaming", recent=recent, sinks=0)
    counts = op_counts(windowed)
    assert counts[GQA] == LAYERS and not any(domain == DOMAIN for domain, _ in counts)
    windows = [
        helper.get_attribute_value(a)
        for n in windowed.graph.node
        if n.op_type == "GroupQueryAttention"
        for a in n.attribute
        if a.name == "local_window_size"
    ]
    assert windows == [recent] * LAYERS
    recurrent = attnrewrite.rewrite(group_query_decoder(), to="streaming", recent=recent, sinks=0, recurrent=True)
    assert op_counts(recurrent)[GQA] == 0  # the recurrence's ring of keys (its own definition)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 11)).astype(np.int64)
    mask = np.ones_like(ids)
    for prefill in (11, 6, 1):
        got = forced_logits(session(windowed), "windowed", ids, mask, prefill)
        want = forced_logits(session(recurrent), "recurrent", ids, mask, prefill)
        assert logits_error(got, want, mask) <= TOLERANCE * np.abs(want).max()


def test_sinks_keep_the_masked_softmax_in_the_operators_place():
    rewritten = attnrewrite.rewrite(group_query_decoder(), to="streaming", recent=3, sinks=1)
    assert op_counts(rewritten)[GQA] == 0
    assert isinstance(rewritten, onnx.ModelProto)
