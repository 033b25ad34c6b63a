"""Property-based: hypothesis draws attention subgraphs across the spellings exporters use
(tests/attention_graphs.py: scale on q, k^T, the logits or split as sqrt on both, by Mul or
Div, either operand order; additive, Where-keep and masked_fill masks for key padding, causal
(Trilu or a sliced constant) and both, computed in the graph from an attention_mask input; 3-D
and 4-D layouts; k transposed in the graph or given pre-transposed; heads split by Transpose;
the dynamo NaN guard; extra consumers of the probabilities; head and feature counts; opsets
that need converting) and a method, and asserts:

- nothing raises, ever;
- a site with an extra consumer of its probabilities is skipped, with the reason;
- every other site is found with the right mask kind, scale and sizes; the method either
  refuses it with exactly the reason written out in ``expected_refusal``, or the rewritten graph computes
  what the pass's torch module computes on the same q, k, v and key_keep (rel. error < 1e-5).
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from attention_graphs import FILLS, AttentionSpec, build_attention_model, expected_refusal, make_feeds, reference_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnrewrite import passes
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import find_sites, rewrite_model

METHODS = sorted(passes.PASSES)
TOLERANCE = 1e-5
MAX_EXAMPLES = int(os.environ.get("ATTNREWRITE_EXAMPLES", 200))  # more for a long local hunt

PROPERTY = settings(
    max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)


@st.composite
def attention_specs(draw) -> AttentionSpec:
    layout = draw(st.sampled_from(["4d", "3d"]))
    mask = draw(st.sampled_from(["none", "key_padding", "causal", "causal+key_padding"]))
    return AttentionSpec(
        layout=layout,
        heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        value_dim=draw(st.sampled_from([None, None, 4, 12])),
        scale=draw(st.sampled_from([None, 0.125, 0.7, 1.0])),
        scale_at=draw(st.sampled_from(["logits", "q", "k", "split", "none"])),
        scale_op=draw(st.sampled_from(["Mul", "Div"])),
        scale_first=draw(st.booleans()),
        mask=mask,
        mask_form=draw(st.sampled_from(["additive", "where_keep", "where_fill"])),
        mask_first=draw(st.booleans()),
        fill=draw(st.sampled_from(sorted(FILLS))),
        causal_from=draw(st.sampled_from(["trilu", "constant"])),
        k_input=draw(st.sampled_from(["k", "kt"])),
        split_heads=layout == "4d" and draw(st.booleans()),
        nan_guard=draw(st.booleans()),
        extra_consumer=draw(st.sampled_from([False, False, False, True])),
        opset=draw(st.sampled_from([15, 17, 18, 18, 21])),
    )


@PROPERTY
@given(spec=attention_specs(), method=st.sampled_from(METHODS), batch=st.integers(1, 3), seq=st.integers(1, 24))
def test_found_and_rewritten_exactly_or_skipped_with_a_reason(spec, method, batch, seq):
    model = build_attention_model(spec)
    module = passes.get_pass(method)
    options = passes.make_options(module)
    rewritten, record = rewrite_model(onnx_io.from_proto(model), method)
    (outcome,) = record.outcomes
    site = outcome.site
    if spec.extra_consumer:
        assert not outcome.rewritten
        assert outcome.reason.startswith("attention probabilities are")
        return
    assert site.skip_reason is None, site.skip_reason
    assert site.mask.value == spec.mask
    assert site.scale == pytest.approx(spec.expected_scale, rel=1e-6)
    assert (site.head_dim, site.value_dim) == (spec.head_dim, spec.dv)
    assert site.num_heads == (spec.heads if spec.split_heads else None)
    refusal = expected_refusal(method, spec.mask, spec.head_dim, spec.dv)
    if refusal is not None:
        assert (outcome.rewritten, outcome.reason) == (False, refusal)
        return
    assert outcome.rewritten, outcome.reason

    proto = ir.serde.serialize_model(rewritten)
    assert "Softmax" not in {n.op_type for n in proto.graph.node}
    feeds = make_feeds(spec, batch, seq, seed=seq)
    (got,) = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    q, k, v, key_keep = (None if a is None else torch.tensor(a) for a in reference_qkv(spec, feeds))
    with torch.no_grad():
        expected = module.torch_module(site, options)(q, k, v, key_keep).numpy()
    assert got.shape == expected.shape
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() <= TOLERANCE * max(np.abs(expected).max(), 1e-6)


@PROPERTY
@given(
    spec=attention_specs(),
    drop=st.sampled_from(["Transpose", "Mul", "Div", "Where", "Add", "Cast", "Unsqueeze", "IsNaN"]),
)
def test_broken_spellings_are_skipped_or_found_never_raise(spec, drop):
    """The same graphs with one node of a kind bypassed (its first input takes its place):
    whatever that leaves, listing and rewriting finish, and a site that is not rewritable
    says why."""
    model = build_attention_model(spec)
    victims = [n for n in model.graph.node if n.op_type == drop]
    if victims:
        victim = victims[0]
        for node in model.graph.node:
            node.input[:] = [victim.input[0] if name == victim.output[0] else name for name in node.input]
        for output in model.graph.output:
            if output.name == victim.output[0]:
                output.name = victim.input[0]
        model.graph.node.remove(victim)
    sites = find_sites(onnx_io.from_proto(model))
    for site in sites:
        assert site.skip_reason is None or site.skip_reason.strip()
    _, record = rewrite_model(onnx_io.from_proto(model), "linear")
    for outcome in record.outcomes:
        assert outcome.rewritten or outcome.reason
