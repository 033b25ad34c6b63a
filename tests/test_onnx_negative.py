"""What the ONNX frontend must not do: rewrite attention it does not fully understand (each such
site is left untouched and reported with its reason), change a model it already rewrote, or
rewrite layers it was not asked to; and the record it leaves in the model must say all of that."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from conftest import exported, read_record
from models import EXPORTERS, op_counts, relative_error, run_onnx, softmax_attention_model, torch_reference

import attnrewrite
from attnrewrite import passes

METHODS = ("hydra", "linear")
TOLERANCE = 1e-5
BIAS = "the additive term on the logits is an attention bias, not a mask (values other than 0 and large negatives)"


def assert_left_untouched(model: onnx.ModelProto, method: str, reasons: list[str]) -> dict:
    """Rewriting changes nothing but the record, which lists every site as skipped, with why."""
    out = attnrewrite.rewrite(model, to=method)
    assert out.graph.SerializeToString() == model.graph.SerializeToString()
    assert list(out.functions) == list(model.functions)
    record = read_record(out)
    assert record["method"] == method
    assert record["sites_found"] == len(reasons)
    assert record["sites_rewritten"] == 0
    assert [(s["status"], s["reason"]) for s in record["sites"]] == [("skipped", r) for r in reasons]
    return record


# --- sites that must be left alone -----------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "variant, reason",
    [
        pytest.param(
            dict(probabilities_output=True),
            "attention probabilities are a graph output ('probabilities')",
            id="probabilities-output",
        ),
        pytest.param(
            dict(probabilities_summed=True),
            "attention probabilities are used by MatMul 'attend', ReduceSum 'probability_mass', not only by the V MatMul",
            id="probabilities-read-elsewhere",
        ),
        pytest.param(
            dict(softmax_axis=2),
            "softmax over axis 2 of a rank-4 tensor, not the key axis (the last)",
            id="softmax-axis-2",
        ),
        pytest.param(
            dict(softmax_axis=-2),
            "softmax over axis -2 of a rank-4 tensor, not the key axis (the last)",
            id="softmax-axis-minus-2",
        ),
        pytest.param(dict(learned_bias=True, seq=6), BIAS, id="learned-bias"),
    ],
)
def test_hand_built_attention_that_must_not_be_rewritten(variant, reason, method):
    assert_left_untouched(softmax_attention_model(**variant), method, [reason])


def test_the_plain_hand_built_attention_is_rewritten():
    """The negative variants above differ from this only in what makes them negative."""
    out = attnrewrite.rewrite(softmax_attention_model(), to="hydra")
    assert [n.op_type for n in out.graph.node] == ["Hydra"]


def test_learned_bias_is_classified_as_a_bias():
    (site,) = attnrewrite.find_sites(softmax_attention_model(learned_bias=True, seq=6))
    assert (site.mask.value, site.skip_reason) == ("bias", BIAS)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_bert_returning_its_attention_probabilities(exports, exporter, method):
    """output_attentions=True: the probabilities of every layer are graph outputs."""
    model = exported(exports, "bert-attentions-output", exporter, True).load()
    probabilities = [output.name for output in model.graph.output[1:]]
    assert len(probabilities) == 2
    assert_left_untouched(
        model, method, [f"attention probabilities are a graph output ({name!r})" for name in probabilities]
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_t5_relative_position_bias(exports, attention, exporter, method):
    """T5's learned relative position bias (plus its padding mask) is added to the logits."""
    model = exported(exports, f"t5-encoder-{attention}", exporter, True).load()
    record = assert_left_untouched(model, method, [BIAS, BIAS])
    assert [s["mask"] for s in record["sites"]] == ["bias", "bias"]


# --- rewriting is idempotent ------------------------------------------------------------------


@pytest.mark.parametrize("second", METHODS)
@pytest.mark.parametrize("first", METHODS)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_rewriting_a_rewritten_model_changes_nothing(exports, rewritten, exporter, first, second):
    model, _ = rewritten(exported(exports, "bert-eager", exporter, True), first)
    again = attnrewrite.rewrite(model, to=second)
    assert again.SerializeToString() == model.SerializeToString()


def test_rewriting_a_rewritten_file_changes_nothing(exports, rewritten, tmp_path):
    model, _ = rewritten(exported(exports, "bert-eager", "legacy", True), "hydra")
    path = tmp_path / "rewritten.onnx"
    onnx.save(model, path)
    again = attnrewrite.rewrite(str(path), to="hydra")
    assert again.SerializeToString() == path.read_bytes()


# --- layer selection and the record --------------------------------------------------------


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_layer_selection_rewrites_only_the_selected_sites(exports, exporter):
    export = exported(exports, "bert-eager", exporter, True)
    inputs = export.parity_inputs()

    first = attnrewrite.rewrite(export.load(), to="hydra", layers=[0])
    ops = op_counts(first)
    assert ops[("", "Softmax")] == 1
    assert [n.op_type for n in first.graph.node if n.domain == "attnrewrite"] == ["Hydra"]
    record = read_record(first)
    assert [(s["layer"], s["status"], s["reason"]) for s in record["sites"]] == [
        (0, "rewritten", None),
        (1, "skipped", "layer 1 is not among the selected layers"),
    ]
    # layer 0 is Hydra, layer 1 still softmax attention
    expected, _ = torch_reference(export, "hydra", inputs, swap_layers={0})
    assert relative_error(run_onnx(first, inputs), expected) < TOLERANCE

    # the remaining site keeps its layer number, so a second run can select it
    (remaining,) = attnrewrite.find_sites(first)
    assert remaining.layer == 1
    second = attnrewrite.rewrite(first, to="linear", layers=[1])
    assert [n.op_type for n in second.graph.node if n.domain == "attnrewrite"] == ["Hydra", "LinearAttention"]
    record = read_record(second)
    assert [(s["layer"], s["status"]) for s in record["sites"]] == [(1, "rewritten")]
    assert record["previous"]["method"] == "hydra"
    assert [(s["layer"], s["status"]) for s in record["previous"]["sites"]] == [(0, "rewritten"), (1, "skipped")]


def test_record_lists_method_options_seed_and_every_site(exports):
    export = exported(exports, "gpt2", "dynamo", True)
    out = attnrewrite.rewrite(export.load(), to="linear", layers=[1], chunk=4, seed=7)
    record = read_record(out)

    options = passes.make_options(passes.get_pass("linear"), chunk=4, seed=7)
    assert record["method"] == "linear"
    assert record["options"] == dataclasses.asdict(options)
    assert record["seed"] == 7
    assert (record["sites_found"], record["sites_rewritten"]) == (2, 1)
    sites = record["sites"]
    assert [(s["layer"], s["status"], s["reason"], s["replacement"]) for s in sites] == [
        (0, "skipped", "layer 0 is not among the selected layers", None),
        (1, "rewritten", None, "attnrewrite.CausalLinearAttention"),
    ]
    for site in sites:
        assert site["name"]
        assert (site["mask"], site["num_heads"], site["head_dim"]) == ("causal+key_padding", 4, 8)
        assert site["scale"] == pytest.approx(8**-0.5)
    # and the options are the ones used: chunk 4 is not the default, and parity still holds.
    # Compared at real tokens only: layer 0 is still softmax attention, and on a left-padded
    # row's first queries (no key to see under the causal mask) the dynamo export of GPT-2's
    # sdpa (NaN guard: zeros) and torch disagree, before any rewrite; padded keys are removed
    # from layer 1, so real tokens do not see that.
    inputs = export.parity_inputs()
    expected, _ = torch_reference(export, "linear", inputs, options=options, swap_layers={1})
    real = inputs["attention_mask"].numpy() == 1
    assert relative_error(run_onnx(out, inputs)[real], expected[real]) < TOLERANCE


def test_nothing_to_rewrite_returns_the_input_with_the_record():
    model = softmax_attention_model(probabilities_output=True)
    out = attnrewrite.rewrite(model, to="hydra")
    assert not any(p.key == "attnrewrite" for p in model.metadata_props)  # the input is not modified
    stripped = onnx.ModelProto()
    stripped.CopyFrom(out)
    del stripped.metadata_props[:]
    assert stripped.SerializeToString() == model.SerializeToString()
    assert np.array_equal(
        run_onnx(out, {n: torch.ones(1, 4, 5, 8) for n in "qkv"}),
        run_onnx(model, {n: torch.ones(1, 4, 5, 8) for n in "qkv"}),
    )
