"""Graph-level rough edges: additive attention is reported as what it is, a single query (a
decoder step) stays exact unless asked, and constants the replacements store (Linformer's
projections) are stored once per content, with the record and the CLI saying how many bytes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from conftest import read_record
from models import SAMPLE_BERT, relative_error, run_onnx, run_pass_module
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import attnrewrite
from attnrewrite import passes
from attnrewrite.cli import main
from attnrewrite.decision import SINGLE_QUERY
from attnrewrite.fx import find_fx_sites

TOLERANCE = 1e-5


# --- additive (Bahdanau) attention ---------------------------------------------------------------


def additive_attention_model(dim: int = 8) -> onnx.ModelProto:
    """softmax(w^T tanh(Wq q_i + Uk k_j)) over j, then the weighted sum of the values."""
    rng = np.random.default_rng(0)
    weights = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in (("Wq", (dim, dim)), ("Uk", (dim, dim)), ("w", (dim, 1)))
    }
    nodes = [
        helper.make_node("MatMul", ["q", "Wq"], ["q_proj"]),
        helper.make_node("MatMul", ["k", "Uk"], ["k_proj"]),
        helper.make_node("Unsqueeze", ["q_proj", "axis_2"], ["q_rows"]),  # [B, Nq, 1, D]
        helper.make_node("Unsqueeze", ["k_proj", "axis_1"], ["k_columns"]),  # [B, 1, Nk, D]
        helper.make_node("Add", ["q_rows", "k_columns"], ["summed"]),
        helper.make_node("Tanh", ["summed"], ["energy"]),
        helper.make_node("MatMul", ["energy", "w"], ["scores_1"]),  # [B, Nq, Nk, 1]
        helper.make_node("Squeeze", ["scores_1", "axis_last"], ["scores"], name="scores"),
        helper.make_node("Softmax", ["scores"], ["probabilities"], axis=-1),
        helper.make_node("MatMul", ["probabilities", "v"], ["output"]),
    ]
    initializers = [numpy_helper.from_array(a, name) for name, a in weights.items()] + [
        numpy_helper.from_array(np.array([axis], np.int64), name)
        for name, axis in (("axis_1", 1), ("axis_2", 2), ("axis_last", -1))
    ]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", length, dim])
        for n, length in (("q", "Nq"), ("k", "Nk"), ("v", "Nk"))
    ]
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", "Nq", dim])
    graph = helper.make_graph(nodes, "additive_attention", inputs, [output], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_additive_attention_is_reported_as_not_a_dot_product():
    model = additive_attention_model()
    reason = (
        "the attention scores are not a dot product q @ k^T (additive attention?): "
        "no MatMul of two activations computes Squeeze 'scores'"
    )
    assert [s.skip_reason for s in attnrewrite.find_sites(model)] == [reason]
    out = attnrewrite.rewrite(model, to="linear")
    assert out.graph.SerializeToString() == model.graph.SerializeToString()
    assert [(s["status"], s["reason"]) for s in read_record(out)["sites"]] == [("skipped", reason)]


# --- a single query ------------------------------------------------------------------------------


def single_query_model(heads: int = 2, dim: int = 8) -> onnx.ModelProto:
    """softmax(q k^T / sqrt(d)) v with one query: q [B, H, 1, D], k and v [B, H, N, D]."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["logits"]),
        helper.make_node("Mul", ["logits", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probabilities"], axis=-1),
        helper.make_node("MatMul", ["probabilities", "v"], ["output"]),
    ]
    scale = numpy_helper.from_array(np.array(dim**-0.5, np.float32), "scale")
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", heads, length, dim])
        for n, length in (("q", 1), ("k", "N"), ("v", "N"))
    ]
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", heads, 1, dim])
    graph = helper.make_graph(nodes, "decoder_step", inputs, [output], [scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def step_inputs(heads: int = 2, dim: int = 8, keys: int = 7):
    generator = torch.Generator().manual_seed(keys)
    return [torch.randn(2, heads, length, dim, generator=generator) for length in (1, keys, keys)]


def test_a_single_query_stays_exact_unless_included():
    model = single_query_model()
    (site,) = attnrewrite.find_sites(model)
    assert (site.query_length, site.skip_reason) == (1, None)

    kept = attnrewrite.rewrite(model, to="hydra")
    assert kept.graph.SerializeToString() == model.graph.SerializeToString()
    assert [(s["status"], s["reason"]) for s in read_record(kept)["sites"]] == [("skipped", SINGLE_QUERY)]

    included = attnrewrite.rewrite(model, to="hydra", include_single_query=True)
    assert [s["status"] for s in read_record(included)["sites"]] == ["rewritten"]
    q, k, v = step_inputs()
    expected = run_pass_module(
        passes.hydra.torch_module(site, passes.hydra.Options()), q.numpy(), k.numpy(), v.numpy(), None
    )
    assert relative_error(run_onnx(included, {"q": q, "k": k, "v": v}), expected) < TOLERANCE


def test_cli_include_single_query(tmp_path, capsys):
    path = tmp_path / "step.onnx"
    onnx.save(single_query_model(), path)
    assert main([str(path), "--to", "linear", "-o", str(tmp_path / "kept.onnx")]) == 1
    out, err = capsys.readouterr()
    assert f"skipped: {SINGLE_QUERY}" in out
    assert "nothing written" in err and not (tmp_path / "kept.onnx").exists()

    assert main([str(path), "--to", "linear", "-o", str(tmp_path / "out.onnx"), "--include-single-query"]) == 0
    assert "1 of 1 attention sites replaced by linear" in capsys.readouterr().out


class DecoderStep(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_fx_single_query_stays_exact_unless_included():
    q, k, v = step_inputs()
    kept = attnrewrite.rewrite(DecoderStep(), to="linear", example_inputs=(q, k, v))
    assert [(s["status"], s["reason"]) for s in kept.meta["attnrewrite"]["sites"]] == [("skipped", SINGLE_QUERY)]

    included = attnrewrite.rewrite(DecoderStep(), to="linear", example_inputs=(q, k, v), include_single_query=True)
    assert [s["status"] for s in included.meta["attnrewrite"]["sites"]] == ["rewritten"]
    (site,) = find_fx_sites(DecoderStep(), example_inputs=(q, k, v))
    expected = run_pass_module(
        passes.linear.torch_module(site, passes.linear.Options()), q.numpy(), k.numpy(), v.numpy(), None
    )
    with torch.no_grad():
        assert relative_error(included(q, k, v).numpy(), expected) < TOLERANCE


# --- constants stored once -----------------------------------------------------------------------


def test_identical_projections_are_stored_once_and_counted(tmp_path, capsys):
    """Both layers of the sample draw the same E and F (same shapes, same seed): one copy each."""
    options = {"proj_dim": 16, "max_len": 512}
    original = onnx.load(SAMPLE_BERT)
    model = attnrewrite.rewrite(original, to="linformer", **options)
    record = read_record(model)
    assert record["sites_rewritten"] == 2

    site = attnrewrite.find_sites(original)[0]
    method = passes.get_pass("linformer")
    constants = method.onnx_lowering(site, passes.make_options(method, **options), 18).constants
    one_site = sum(a.nbytes for a in constants.values())
    assert constants["E"].nbytes == constants["F"].nbytes == 512 * 16 * 4
    assert record["bytes_added"] == one_site  # not 2 * one_site
    added = {i.name for i in model.graph.initializer} - {i.name for i in original.graph.initializer}
    assert len(added) == len(constants)
    users = [n for n in model.graph.node if n.domain == "attnrewrite"]
    assert [n.input[4:] for n in users][0] == [n.input[4:] for n in users][1]  # the same initializers

    output = tmp_path / "out.onnx"
    assert (
        main([str(SAMPLE_BERT), "--to", "linformer", "-o", str(output), "-O", "proj_dim=16", "-O", "max_len=512"]) == 0
    )
    assert "2 of 2 attention sites replaced by linformer, adding 65.5 kB of constants" in capsys.readouterr().out
    assert (
        json.loads({p.key: p.value for p in onnx.load(output).metadata_props}["attnrewrite"])["bytes_added"] == one_site
    )
