"""Calibration's end-to-end stage: the ONNX graph evaluated in torch (attnrewrite.onnx.torch_graph)
and passes.fit.fit_end_to_end, which fits all replacements together on the model's outputs,
through both frontends."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from conftest import read_record
from models import SAMPLE_BERT, ExportUnsupported, onnx_outputs, relative_error, text_args
from onnx import helper, numpy_helper
from test_calibration import calibration_npz

import attnrewrite
from attnrewrite.calibration import split_batch
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.rewrite import rewrite_model, rewritten_sites
from attnrewrite.onnx.torch_graph import TorchGraph
from attnrewrite.passes import fit

# Families whose exports (both exporters) the evaluator must cover: encoders with padding masks,
# causal decoders, a vision encoder, relative position bias, multi-query heads, audio.
COVERED = [
    "bert-eager",
    "bert-sdpa",
    "distilbert",
    "vit",
    "gpt2",
    "t5-encoder-eager",
    "falcon-multi-query",
    "llama",
    "wav2vec2",
    "minilm",
]


def onnxruntime_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """The floating-point outputs, as the end-to-end stage compares them."""
    return [o for o in onnx_outputs(model, feeds) if np.issubdtype(o.dtype, np.floating)]


def numpy_feeds(export) -> dict[str, np.ndarray]:
    return {name: x.numpy() for name, x in export.parity_inputs().items()}


def export_or_skip(exports, name: str, exporter: str):
    try:
        return exports.get(name, exporter)
    except ExportUnsupported as reason:  # this torch cannot export it: nothing to evaluate
        pytest.skip(f"{exporter} cannot export {name}: {reason}")


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", COVERED)
def test_torch_graph_computes_what_onnxruntime_computes(exports, name, exporter):
    export = export_or_skip(exports, name, exporter)
    feeds = numpy_feeds(export)
    expected = onnxruntime_outputs(export.load(), feeds)
    with torch.no_grad():
        got = TorchGraph(ir.load(export.path).graph, []).run(feeds, {})
    assert len(got) == len(expected)
    for actual, wanted in zip(got, expected):
        assert actual.shape == wanted.shape
        assert relative_error(actual.numpy(), wanted) < 1e-5


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name, options", [("bert-eager", {"window": 4}), ("gpt2", {"window": 4}), ("bert-sdpa", {})])
def test_exact_stand_ins_give_the_original_models_outputs(exports, name, exporter, options):
    """The end-to-end targets: the rewritten graph with every replacement computing exact
    attention on its inputs is the original model (causal masks included) at every real
    position; padded positions' outputs are zeroed on purpose (passes.fit.zero_padded_queries)."""
    export = export_or_skip(exports, name, exporter)
    model, record = rewrite_model(ir.load(export.path), "hedgehog", **options)
    sites = {o.site.name: o.site for o in record.rewritten}
    calls = rewritten_sites(model)
    assert len(calls) == len(sites) > 0
    exact = {}
    for call in calls:
        site = sites[call.name.rpartition("/")[0]]
        exact[call] = fit.exact_stand_in(site.scale, site.mask.causal)
    feeds = numpy_feeds(export)
    with torch.no_grad():
        got = TorchGraph(model.graph, calls).run(feeds, exact)
    real = feeds["attention_mask"].astype(bool)
    assert not real.all()  # the parity inputs are padded: the test sees padding handled
    for actual, wanted in zip(got, onnxruntime_outputs(export.load(), feeds)):
        if wanted.shape[:2] == real.shape:  # per position: padded rows are not the model's
            actual, wanted = actual[torch.from_numpy(real)], wanted[real]
        assert relative_error(actual.numpy(), wanted) < 1e-5


def rewritten_error(model: onnx.ModelProto, arrays: dict) -> float:
    """The end-to-end loss (passes.fit) of a written model, on onnxruntime, over ``arrays`` in
    the stage's steps of fit.EXAMPLES_PER_STEP examples: the mean of their losses."""
    errors = []
    for step in split_batch(arrays, fit.EXAMPLES_PER_STEP):
        original = onnxruntime_outputs(onnx.load(SAMPLE_BERT), step)
        rewritten = onnxruntime_outputs(model, step)
        errors.append(np.mean([((r - o) ** 2).sum() / (o**2).sum() for r, o in zip(rewritten, original)]))
    return float(np.mean(errors))


def test_onnx_end_to_end_stage_cuts_the_output_error_and_writes_what_it_fitted(tmp_path, capsys):
    # one batch of 8 (the stage steps on its two halves), unpadded (padded queries are zeroed in
    # the stage's runs)
    arrays = calibration_npz(tmp_path / "data.npz", examples=8)
    arrays["attention_mask"][:] = 1
    np.savez(tmp_path / "data.npz", **arrays)
    settings = dict(to="hedgehog", window=4, calibrate=str(tmp_path / "data.npz"), calibrate_steps=20)
    per_site = attnrewrite.rewrite(str(SAMPLE_BERT), **settings)
    together = attnrewrite.rewrite(str(SAMPLE_BERT), **settings, calibrate_end_to_end=25)
    progress = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"calibrating all 2 sites end to end: output error \S+ -> \S+ \(on 2 of 2 batches; steps 25, [\d.]+ s\)",
        progress[-1],
    )
    stage = read_record(together)["end_to_end"]
    assert "end_to_end" not in read_record(per_site)
    assert stage["steps"] == 25 and stage["examples"] == 8 and len(stage["data_sha256"]) == 64
    sites = read_record(together)["sites"]
    # the stage starts from the per-site fit: its loss before is that model's, measured by onnxruntime
    assert rewritten_error(per_site, arrays) == pytest.approx(stage["loss_before"], rel=1e-3)
    # and what it wrote is what it fitted, to a lower error
    assert rewritten_error(together, arrays) == pytest.approx(stage["loss_after"], rel=1e-3)
    assert stage["loss_after"] < 0.9 * stage["loss_before"]
    fitted = {t.name: numpy_helper.to_array(t) for t in together.graph.initializer}
    assert stage["parameters"] == sum(fitted[n].size for n in fitted if n.startswith(tuple(s["name"] for s in sites)))


def test_torch_end_to_end_stage_fits_only_the_replacements(exports):
    export = exports.get("bert-eager", "legacy")
    args = text_args(12)
    program = torch.export.export(export.module, args)
    own = {name: p.detach().clone() for name, p in program.module().named_parameters()}
    examples = [text_args(12, seed=s) for s in range(3)]
    gm = attnrewrite.rewrite(
        program, to="hedgehog", window=4, calibrate=examples, calibrate_steps=10, calibrate_end_to_end=15
    )
    stage = gm.meta["attnrewrite"]["end_to_end"]
    assert stage["steps"] == 15 and stage["examples"] == 3
    assert stage["loss_after"] < stage["loss_before"]
    replacements = {entry["replacement"].split(" at ")[1] for entry in gm.meta["attnrewrite"]["sites"]}
    params = dict(gm.named_parameters())
    assert stage["parameters"] == sum(p.numel() for n, p in params.items() if n.startswith(tuple(replacements)))
    # the model's own weights are as they were, and trainable again
    for name, value in own.items():
        assert params[name].requires_grad and torch.equal(params[name], value)


def model_with_uncovered_op(path) -> str:
    """samples/tiny_bert.onnx with one more output, made by an op the evaluator does not cover."""
    model = onnx.load(SAMPLE_BERT)
    first = model.graph.output[0]
    model.graph.node.append(helper.make_node("HardSwish", [first.name], ["swished"], name="extra"))
    swished = model.graph.output.add()
    swished.CopyFrom(first)
    swished.name = "swished"
    onnx.save(model, path)
    return str(path)


def test_a_graph_the_evaluator_cannot_run_is_refused_before_any_fitting(tmp_path, capsys):
    calibration_npz(tmp_path / "data.npz")
    model = model_with_uncovered_op(tmp_path / "m.onnx")
    with pytest.raises(AttnRewriteError) as error:
        attnrewrite.rewrite(model, to="linear", calibrate=str(tmp_path / "data.npz"), calibrate_end_to_end=5)
    assert str(error.value) == "cannot fit end to end: HardSwish (node 'extra') has no torch evaluation in attnrewrite"
    assert "calibrating" not in capsys.readouterr().err


def test_onnxruntimes_simplified_layer_norms_are_evaluated_as_onnxruntime_computes_them():
    """onnxruntime-genai's builder normalises with SimplifiedLayerNormalization (default domain)
    and com.microsoft.SkipSimplifiedLayerNormalization (the normalised sum, and the sum itself)."""
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
              (("x", (2, 5, 8)), ("skip", (2, 5, 8)), ("gamma", (8,)), ("bias", (8,)))}  # fmt: skip
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["norm"], epsilon=1e-5, axis=-1, stash_type=1),
        helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"], ["skip_norm", "", "", "total"],
            domain="com.microsoft", epsilon=1e-6,
        ),
    ]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, a.shape) for n, a in arrays.items()]
    outputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("norm", "skip_norm", "total")]
    graph = helper.make_graph(nodes, "norms", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    expected = onnxruntime_outputs(model, arrays)
    got = TorchGraph(ir.from_proto(model).graph, []).run(arrays, {})
    for actual, wanted in zip(got, expected, strict=True):
        assert np.abs(actual.numpy() - wanted).max() < 1e-5


def test_an_op_setting_the_evaluator_does_not_implement_is_refused_up_front():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], name="scatter", reduction="add")
    indices = numpy_helper.from_array(np.zeros((1, 1), np.int64), "i")
    updates = numpy_helper.from_array(np.ones(1, np.float32), "u")
    graph = helper.make_graph(
        [node], "g", [x], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])], [indices, updates]
    )
    with pytest.raises(AttnRewriteError) as error:
        TorchGraph(ir.from_proto(helper.make_model(graph)).graph, [])
    assert str(error.value) == (
        "cannot fit end to end: ScatterND node 'scatter' reduces, which attnrewrite does not evaluate in torch"
    )


def test_cli_end_to_end_needs_calibration(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main([str(SAMPLE_BERT), "--to", "linear", "--calibrate-end-to-end", "5", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "attnrewrite: error: --calibrate-end-to-end is a stage of calibration; give --calibrate too"
    )
    assert not out.exists()
    calibration_npz(tmp_path / "data.npz")
    argv = ["--calibrate", str(tmp_path / "data.npz"), "--calibrate-steps", "5", "--calibrate-end-to-end", "5"]
    assert main([str(SAMPLE_BERT), "--to", "linear", *argv, "-o", str(out)]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("calibrating all 2 sites end to end: output error ")
    assert read_record(onnx.load(out))["end_to_end"]["steps"] == 5
