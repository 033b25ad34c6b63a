"""Exact heads inside the replacement (attnrewrite.passes.heads) and head selection under a
budget (attnrewrite.head_selection): the wrapped ONNX lowering equals the wrapped torch module;
its exact heads are softmax attention and its other heads the method's with its values sliced;
the search keeps the fewest costliest heads exact on a model whose sharpened heads resist
linearization; an explicit choice reproduces it; and the refusals say why in one line."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from attention_graphs import AttentionSpec, build_attention_model, lowering_session
from models import SAMPLE_BERT, attention_operator_model, text_feed
from onnx import numpy_helper

import attnrewrite
from attnrewrite import passes
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError, NothingRewritten
from attnrewrite.head_selection import HeadCost, fewest_exact_heads
from attnrewrite.layer_selection import Measurement
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.rewrite import read_record, rewrite_model
from attnrewrite.passes import heads
from attnrewrite.passes.fit import exact_attention
from attnrewrite.site import AttentionSite, MaskKind

OPSET = 20
HEADS, HEAD_DIM, SEQ = 4, 8, 11
TOLERANCE = 2e-5  # fp32, the same math in onnxruntime and torch

VARIANTS = [
    ("hedgehog", {"window": 4}, MaskKind.KEY_PADDING),
    ("hedgehog", {"window": 4}, MaskKind.CAUSAL),
    ("hedgehog", {}, MaskKind.CAUSAL_KEY_PADDING),
    ("favor", {"features": 16}, MaskKind.KEY_PADDING),
    ("favor", {"features": 16, "window": 4}, MaskKind.CAUSAL),
    ("linear", {}, MaskKind.NONE),
    ("linear", {"window": 4}, MaskKind.CAUSAL_KEY_PADDING),
]


def variant_id(variant) -> str:
    method, options, mask = variant
    return "-".join([method, *(f"{k}={v}" for k, v in options.items()), mask.value])


def site(mask: MaskKind) -> AttentionSite:
    return AttentionSite(
        "s", scale=HEAD_DIM**-0.5, mask=mask, rank=4, num_heads=HEADS, head_dim=HEAD_DIM, value_dim=HEAD_DIM
    )


def inputs(mask: MaskKind, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=g) * 1.5 for _ in range(3))
    keep = torch.ones(2, 1, SEQ, 1)
    if mask.key_padding:
        keep[1, :, SEQ - 4 :] = 0.0
    return q, k, v, keep


def fitted_like(method, s, options):
    """The method's learnable module with every value perturbed per head, so that a head
    reading another head's values would show."""
    module = method.torch_module(s, options, learnable=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for value in module.state_dict().values():
            if value.is_floating_point():
                value.add_(0.1 * torch.randn(value.shape, generator=g))
    return module


def run_lowering(lowering, q, k, v, keep) -> np.ndarray:
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "key_keep": keep.numpy()}
    return lowering_session(lowering, 4).run(None, feeds)[0]


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_exact_head_is_softmax_and_the_others_are_the_method_with_sliced_values(variant):
    name, options, mask = variant
    method = passes.get_pass(name)
    s, opts = site(mask), passes.make_options(method, **options)
    full = fitted_like(method, s, opts)
    q, k, v, keep = inputs(mask)
    exact = [2]

    wrapped = heads.torch_module(method, s, opts, exact, full=full)
    weights = {key: t.numpy() for key, t in full.state_dict().items()}
    onnx_out = run_lowering(heads.onnx_lowering(method, s, opts, OPSET, exact, weights), q, k, v, keep)
    with torch.no_grad():
        torch_out, plain = wrapped(q, k, v, keep).numpy(), full(q, k, v, keep).numpy()
    softmax = exact_attention(q, k, v, s.scale, keep, mask.causal).numpy()

    np.testing.assert_allclose(onnx_out, torch_out, atol=TOLERANCE)  # one math, two lowerings
    np.testing.assert_allclose(onnx_out[:, 2], softmax[:, 2], atol=1e-6)
    others = [0, 1, 3]
    np.testing.assert_allclose(onnx_out[:, others], plain[:, others], atol=TOLERANCE)
    assert np.abs(plain[:, 2] - softmax[:, 2]).max() > 1e-3  # the exact head is not what the method gives


def test_all_heads_but_one_exact_are_softmax_to_float_precision():
    method, mask = passes.get_pass("hedgehog"), MaskKind.CAUSAL_KEY_PADDING
    s, opts = site(mask), passes.make_options(method, window=4)
    q, k, v, keep = inputs(mask, seed=3)
    out = run_lowering(heads.onnx_lowering(method, s, opts, OPSET, [0, 1, 3]), q, k, v, keep)
    softmax = exact_attention(q, k, v, s.scale, keep, causal=True).numpy()
    np.testing.assert_allclose(out[:, [0, 1, 3]], softmax[:, [0, 1, 3]], atol=1e-6)


def test_head_axes_are_found_by_building_the_method_for_fewer_heads():
    s = site(MaskKind.KEY_PADDING)
    hedgehog = passes.get_pass("hedgehog")
    axes = heads.head_axes(hedgehog, s, passes.make_options(hedgehog, window=4), [1], OPSET)
    assert axes == {
        "weight": 0,
        "bias": 0,
        "linear_log_weight": 0,
        "query_log_scale": 0,
        "key_log_scale": 0,
        "local_max_weight": 0,
    }
    linformer = passes.get_pass("linformer")  # projections shared by every head
    assert set(heads.head_axes(linformer, s, passes.make_options(linformer), [1], OPSET).values()) == {None}


# --- in a model --------------------------------------------------------------------------------


def sharpened_bert(tmp_path, sharp: dict[int, list[int]], factor: float = 10.0):
    """The sample BERT (4 heads of 16 per layer) with the heads ``sharp`` made spiky (their q and
    k weights scaled by ``factor``) and every attention's output projection by 4, so that the
    attention weighs in the output: the heads a linear kernel cannot follow, as a trained model has."""
    model = onnx.load(SAMPLE_BERT)
    initializers = {t.name: t for t in model.graph.initializer}

    def scale(name: str, factor: float, heads=None):
        weight = numpy_helper.to_array(initializers[name]).copy()
        for h in range(4) if heads is None else heads:
            weight[:, h * 16 : (h + 1) * 16] *= factor
        initializers[name].CopyFrom(numpy_helper.from_array(weight, name))

    for node in model.graph.node:
        for layer, chosen in sharp.items():
            if node.op_type == "MatMul" and any(
                f"layer.{layer}/attention/self/{p}/" in node.name for p in ("query", "key")
            ):
                scale(node.input[1], factor, chosen)
            if node.op_type == "MatMul" and f"layer.{layer}/attention/output/dense" in node.name:
                scale(node.input[1], 4.0)
    path = tmp_path / "sharpened.onnx"
    onnx.save(model, path)
    return path


SHARP = {0: [2], 1: [1, 3]}


@pytest.fixture(scope="module")
def sharpened(tmp_path_factory):
    return sharpened_bert(tmp_path_factory.mktemp("heads"), SHARP)


def test_search_keeps_the_fewest_costliest_heads_exact(sharpened, capsys):
    # measured: linear with 0, 1, 2 of the sharpened heads exact: cosine 0.99953, 0.99966, 0.99985;
    # with all 3: 0.9999998
    code = main(
        [
            str(sharpened),
            "--to",
            "linear",
            "--heads",
            "auto",
            "--min-cosine",
            "0.99999",
            "-o",
            str(sharpened.parent / "auto.onnx"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    record = read_record(onnx_io.load_model(sharpened.parent / "auto.onnx"))
    assert {s["layer"]: s.get("exact_heads") for s in record["sites"]} == SHARP
    selection = record["selection"]
    assert selection["unit"] == "head" and selection["exact_heads"] == 3 and selection["heads"] == 8
    trials = {t["exact_heads"]: t["passes"] for t in selection["trials"]}
    assert trials[2] is False and trials[3] is True  # both ends of the answer measured
    costs = {s["layer"]: s["head_costs"] for s in selection["sites"]}
    assert min(costs[0][2], costs[1][1], costs[1][3]) > 10 * max(costs[0][0], costs[0][1], costs[0][3], costs[1][0])
    assert "replaced, 2 of 4 heads exact" in out and "3 of 8 heads kept exact" in out
    assert "attnrewrite.ExactHeadsLinearAttention (heads 1,3 exact)" in out


def test_an_explicit_choice_reproduces_the_selection(sharpened):
    chosen = attnrewrite.rewrite(str(sharpened), "linear", heads="auto", min_cosine=0.99999, validate=False)
    given = attnrewrite.rewrite(str(sharpened), "linear", heads={0: [2], 1: [3, 1]}, validate=False)
    feeds = text_feed(2, 100)
    np.testing.assert_array_equal(run(chosen, feeds), run(given, feeds))


def test_every_head_exact_leaves_the_site_as_it_was(sharpened):
    model, record = rewrite_model(onnx_io.load_model(sharpened), "favor", exact_heads={0: [0, 1, 2, 3], 1: [0]})
    first, second = record.outcomes
    assert not first.rewritten
    assert first.reason == "every head kept exact (4 of 4): the attention is left as it was"
    assert second.rewritten and second.exact_heads == [0]


def test_calibrated_exact_heads_hold_the_all_heads_fit_sliced(sharpened):
    data = text_feed(8, 100)
    calibration = dict(calibrate=data, calibrate_steps=3)
    every = attnrewrite.rewrite(str(sharpened), "hedgehog", window=4, validate=False, **calibration)
    some = attnrewrite.rewrite(str(sharpened), "hedgehog", window=4, heads={1: [1, 3]}, validate=False, **calibration)
    every_values = {t.name: numpy_helper.to_array(t) for t in every.graph.initializer}
    some_values = {t.name: numpy_helper.to_array(t) for t in some.graph.initializer}
    name = "/model/encoder/layer.1/attention/self/Softmax/weight"
    assert every_values[name].shape[0] == 4 and some_values[name].shape[0] == 2
    np.testing.assert_array_equal(some_values[name], every_values[name][[0, 2]])
    site = next(s for s in read_record(onnx_io.from_proto(some))["sites"] if s["layer"] == 1)
    assert site["exact_heads"] == [1, 3] and "calibration" in site


def test_calibrated_search_fits_once_and_measures_on_examples_it_does_not_fit(sharpened, capsys):
    ids = np.random.default_rng(0).integers(0, 100, (12, 16))
    out = attnrewrite.rewrite(
        str(sharpened),
        "linear",
        heads="auto",
        min_cosine=0.99999,
        calibrate={"input_ids": ids, "attention_mask": np.ones_like(ids)},
        calibrate_steps=3,
        validate=False,
    )
    record = read_record(onnx_io.from_proto(out))
    held = int(record["selection"]["inputs"].split()[2])
    assert record["selection"]["inputs"] == f"the last {held} calibration examples (not fitted on)" and 0 < held < 12
    assert capsys.readouterr().err.count("calibrating site") == 2  # every head fitted once; the trials never refit
    chosen = {s["layer"]: s["exact_heads"] for s in record["selection"]["sites"] if s["exact_heads"]}
    assert {s["layer"]: s["exact_heads"] for s in record["sites"] if "exact_heads" in s} == chosen
    assert all(s["calibration"]["examples"] == 12 - held for s in record["sites"] if s["status"] == "rewritten")


def test_grouped_key_value_heads_are_gathered_per_query_head():
    model = attention_operator_model(heads=4, kv_heads=2)
    out = attnrewrite.rewrite(model, to="linear", heads={0: [1, 2]})
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 9, 8)).astype(np.float32) for _ in range(2))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    feeds = {"q": q, "k": k, "v": v, "attention_mask": mask}
    rewritten, original = (run(m, feeds) for m in (out, model))
    np.testing.assert_allclose(rewritten[:, [1, 2]], original[:, [1, 2]], atol=1e-5)
    assert np.abs(rewritten[:, [0, 3]] - original[:, [0, 3]]).max() > 1e-3


def run(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_the_bisection_measures_both_ends_of_its_answer():
    cosine = {n: 0.9 + 0.02 * n for n in range(9)}  # passes from 5 on
    measured = []

    def measure(count):
        measured.append(count)
        return Measurement(cosine[count], passes=cosine[count] >= 0.999)

    count, trials = fewest_exact_heads(8, measure)
    assert count == 5 and not trials[4].passes and trials[5].passes
    assert measured == [0, 8, 4, 6, 5]
    assert fewest_exact_heads(8, lambda n: Measurement(1.0, passes=True))[0] == 0
    assert HeadCost(0, 1, 0.5).cost == 0.5


# --- refusals -----------------------------------------------------------------------------------


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--heads", "0:1", "--recurrent"],
            "heads with recurrent: exact heads cannot be recurrent: an exact head would need its KV cache",
        ),
        (
            ["--heads", "auto"],
            "--heads auto needs --min-cosine X and/or --min-agreement Y: the fidelity the rewritten model must keep",
        ),
        (["--heads", "0:7"], "--heads: layer 0 has heads 0-3, not 7"),
        (["--heads", "5:0"], "--heads: no attention site in layer 5"),
        (
            ["--heads", "0:1", "--layers", "auto", "--min-cosine", "0.9"],
            "--layers auto chooses whole sites: give --heads auto to choose heads with it",
        ),
        (
            ["--heads", "auto", "--heads", "0:1", "--min-cosine", "0.9"],
            "--heads auto chooses every site's heads: give it alone",
        ),
    ],
)
def test_cli_refusals_are_one_line(capsys, tmp_path, argv, message):
    code, captured = cli(capsys, SAMPLE_BERT, "--to", "linear", "-o", tmp_path / "out.onnx", *argv)
    assert code == 2
    assert captured.err.strip().splitlines() == [f"attnrewrite: error: {message}"]
    assert not (tmp_path / "out.onnx").exists()


def test_cli_refuses_a_malformed_heads_list(capsys, tmp_path):
    code, captured = cli(capsys, SAMPLE_BERT, "--to", "linear", "-o", tmp_path / "out.onnx", "--heads", "3")
    assert code == 2
    assert "invalid heads '3' (expected auto, or LAYER:HEAD,HEAD such as 3:0,7)" in captured.err


def test_a_site_without_a_head_layout_cannot_keep_heads_exact():
    model = build_attention_model(AttentionSpec(layout="3d"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NothingRewritten)
        out = attnrewrite.rewrite(model, to="linear", heads={0: [0]})
    (entry,) = read_record(onnx_io.from_proto(out))["sites"]
    assert entry["status"] == "skipped" and entry["reason"] == heads.NEEDS_HEAD_LAYOUT


def test_api_refusals():
    with pytest.raises(AttnRewriteError, match=r"^heads='auto' needs min_cosine and/or min_agreement"):
        attnrewrite.rewrite(str(SAMPLE_BERT), "linear", heads="auto")
    with pytest.raises(
        AttnRewriteError, match=r"^heads keeps heads exact inside ONNX replacements: it takes an ONNX model$"
    ):
        attnrewrite.rewrite(torch.nn.Linear(2, 2), "linear", heads={0: [0]})


def test_calibrated_exact_heads_of_a_method_with_unfitted_constants(sharpened):
    """nystrom's lowering holds the site's scale beside its fitted log scales: only the fitted
    values are carried from the every-head fit to the sliced rewrite."""
    model = attnrewrite.rewrite(
        str(sharpened),
        "nystrom",
        landmarks=4,
        heads={1: [1]},
        validate=False,
        calibrate=text_feed(8, 100),
        calibrate_steps=2,
    )
    assert [s.get("exact_heads") for s in read_record(onnx_io.from_proto(model))["sites"]] == [None, [1]]
