"""Audio encoders (wav2vec2, HuBERT, WavLM; tiny configs, random weights) by both exporters.

Their convolutional feature encoder takes no input shorter than its receptive field (here 20
samples; 400 for the real models), so the mask probe and the run gate grow their generated
inputs until the original model runs, and say so. The attention runs over frames, not samples:
the mask probe reads the attention's length from the mask. What the sites must be:

- wav2vec2 with feat_extract_norm="layer" (wav2vec2-large-lv60 style, whose processor returns
  an attention_mask) and HuBERT given an attention_mask: every site key_padding (the frame mask
  computed from the samples' lengths);
- wav2vec2 with feat_extract_norm="group" (wav2vec2-base style: its processor returns no
  attention_mask, padding is zeros in the audio) exported without one: mask none;
- WavLM: a gated relative position bias on the logits, every site refused as a bias.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import exported, read_record
from models import (
    APPROXIMATING_OPTIONS,
    AUDIO_MODELS,
    BIDIRECTIONAL_REFUSED,
    EXPORTERS,
    op_counts,
    relative_error,
    run_onnx,
    torch_reference,
)
from onnx import TensorProto, helper
from test_hardening import one_line, run
from test_onnx_exports import TOLERANCE
from test_onnx_negative import BIAS

import attnrewrite
from attnrewrite import passes
from attnrewrite.site import MaskKind

REWRITABLE = [name for name, spec in AUDIO_MODELS.items() if spec.mask != "bias"]
# the dynamo exports take most of the time (several seconds each): marked slow, still run in CI
EXPORTER_PARAMS = [pytest.param(e, marks=[pytest.mark.slow] if e == "dynamo" else []) for e in EXPORTERS]
# the probe starts at 6 and 9 samples; the tiny feature encoder needs 20 for one frame, 40 for a
# mask over more than one key: 6 doubles to 48, 9 to 36
PROBE_NOTE = "mask probe: the mask subgraph does not run on inputs of length 6 and 9; probed at 48 and 36"
GATE_NOTE = "the original model does not run on generated inputs of length 16; validated at length 32"


@pytest.mark.parametrize("exporter", EXPORTER_PARAMS)
@pytest.mark.parametrize("name", AUDIO_MODELS)
def test_sites_and_their_masks(exports, name, exporter):
    export = exported(exports, name, exporter)
    spec = export.spec
    sites = attnrewrite.find_sites(export.load())

    assert [s.layer for s in sites] == list(range(spec.layers))
    assert {s.mask.value for s in sites} == {spec.mask}
    assert [s.skip_reason for s in sites] == [BIAS if spec.mask == "bias" else None] * spec.layers
    for site in sites:
        assert site.scale == pytest.approx(spec.head_dim**-0.5, rel=1e-6)
    if spec.mask != "bias":
        assert {(s.num_heads, s.head_dim, s.value_dim) for s in sites} == {(spec.heads, spec.head_dim, spec.head_dim)}
    # the legacy export without an attention_mask has no mask subgraph to probe
    no_mask_subgraph = (name, exporter) == ("wav2vec2-group", "legacy")
    probed = None if no_mask_subgraph else {"asked": [6, 9], "ran": [48, 36]}
    assert [s.provenance.get("mask_probe_lengths") for s in sites] == [probed] * spec.layers


@pytest.mark.parametrize("method", [m for m in passes.PASSES if m not in BIDIRECTIONAL_REFUSED])  # encoders
@pytest.mark.parametrize("exporter", EXPORTER_PARAMS)
@pytest.mark.parametrize("name", REWRITABLE)
def test_rewrite_matches_torch_with_the_same_attention(exports, name, exporter, method):
    export = exported(exports, name, exporter)
    spec = export.spec
    options = APPROXIMATING_OPTIONS.get(method, {})
    model = attnrewrite.rewrite(export.load(), to=method, **options)
    record = read_record(model)

    assert record["sites_rewritten"] == spec.layers
    assert op_counts(onnx.ModelProto(graph=model.graph))[("", "Softmax")] == 0
    # the gate needed longer inputs than its default 16 samples, and the record says so
    assert record["notes"][-1] == GATE_NOTE
    inputs = export.parity_inputs()
    expected, state = torch_reference(
        export, method, inputs, options=passes.make_options(passes.get_pass(method), **options)
    )
    assert state["calls"] == spec.layers
    assert relative_error(run_onnx(model, inputs), expected) < TOLERANCE


@pytest.mark.parametrize("exporter", EXPORTER_PARAMS)
def test_padded_frames_are_left_out(exports, rewritten, exporter):
    """Key padding is real: the frames the attention_mask pads are removed from every attention,
    and the rewrite differs from one attending to them."""
    export = exported(exports, "wav2vec2", exporter)
    model, _ = rewritten(export, "hydra")
    inputs = export.parity_inputs()
    expected, state = torch_reference(export, "hydra", inputs)
    frames = expected.shape[1]
    padded_frames = [
        int(k[row, ..., 0].reshape(-1, frames)[0].eq(0).sum()) for k in state["key_keep"] for row in range(len(k))
    ]
    assert padded_frames == [0, 3, 0] * export.spec.layers  # row 1 loses 30 of 120 samples: 3 of 11 frames
    attending_to_padding, _ = torch_reference(export, "hydra", inputs, attend_to_padding=True)
    actual = run_onnx(model, inputs)
    assert relative_error(actual, attending_to_padding) > 100 * relative_error(actual, expected)


# --- the CLI: notes, and --seq / --inputs driving the probe and the gate --------------------------


def test_cli_says_it_needed_longer_inputs(exports, tmp_path, capsys):
    path = exported(exports, "wav2vec2", "legacy").path
    code, out, _ = run(capsys, path, "--list")
    assert code == 0
    assert out.splitlines()[-2:] == ["2 attention sites, 2 rewritable", f"note: {PROBE_NOTE}"]

    code, out, _ = run(capsys, path, "--to", "hydra", "-o", tmp_path / "out.onnx")
    assert code == 0
    assert f"note: {PROBE_NOTE}" in out.splitlines()
    assert f"note: {GATE_NOTE}" in out.splitlines()
    assert out.splitlines()[-1] == f"wrote {tmp_path / 'out.onnx'}: 2 of 2 attention sites replaced by hydra"


def test_cli_seq_drives_the_probe_and_the_gate(exports, tmp_path, capsys):
    """At --seq 400 both run at once: no note; the comparison runs at 400 samples too."""
    path = exported(exports, "wav2vec2", "legacy").path
    code, out, _ = run(capsys, path, "--to", "linear", "-o", tmp_path / "out.onnx", "--seq", "400", "--check")
    assert code == 0
    assert "note:" not in out
    assert "inputs: generated (batch 2, seq 400, seed 0)" in out.splitlines()
    assert read_record(onnx.load(tmp_path / "out.onnx"))["sites"][0]["mask"] == "key_padding"


def test_cli_inputs_drive_the_probe_and_the_gate(exports, tmp_path, capsys):
    """--inputs (say, real audio): the gate runs the rewritten model on them, the probe starts at their length."""
    export = exported(exports, "wav2vec2", "legacy")
    feeds = {k: v.numpy() for k, v in export.spec.inputs(2, 30).items()}
    np.savez(tmp_path / "audio.npz", **feeds)
    code, out, _ = run(
        capsys, export.path, "--to", "favor", "-o", tmp_path / "out.onnx", "--inputs", tmp_path / "audio.npz"
    )
    assert code == 0
    assert "note:" not in out
    assert f"inputs: {tmp_path / 'audio.npz'}" in out.splitlines()


def test_cli_check_grows_generated_inputs_the_original_does_not_take(exports, tmp_path, capsys):
    path = exported(exports, "wav2vec2-group", "legacy").path
    code, out, _ = run(capsys, path, "--to", "hydra", "-o", tmp_path / "out.onnx", "--check", "--seq", "8")
    assert code == 0
    assert "inputs: generated (batch 2, seq 32, seed 0); the original model does not run at seq 8" in out.splitlines()
    assert (
        "note: the original model does not run on generated inputs of length 8; validated at length 32"
        in out.splitlines()
    )


def test_inputs_too_short_for_any_searched_length_are_bad_input(exports, tmp_path, capsys):
    """Given arrays are not grown: too short for the feature encoder is the input's fault."""
    export = exported(exports, "wav2vec2-group", "legacy")
    np.savez(tmp_path / "short.npz", input_values=np.zeros((1, 12), np.float32))
    code, _, err = run(
        capsys, export.path, "--to", "hydra", "-o", tmp_path / "out.onnx", "--inputs", tmp_path / "short.npz"
    )
    assert code == 2
    assert one_line(err).startswith(f"{export.path}: the input model itself fails on the given inputs: ")
    assert not (tmp_path / "out.onnx").exists()


# --- a mask the probe cannot run at any length is "unknown", not "none" --------------------------


def mask_fixed_at_length(length: int) -> onnx.ModelProto:
    """softmax(q k^T / sqrt(8) + m) v, the additive mask m computed from an attention_mask input
    and reshaped to a fixed [2, 1, 1, length]: it runs only at that length."""
    shape = ["batch", 2, "seq", 8]
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "keep"], ["dropped"]),
        helper.make_node("Mul", ["dropped", "minus_big"], ["additive"]),
        helper.make_node("Reshape", ["additive", "fixed_shape"], ["mask"]),
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["logits"]),
        helper.make_node("Add", ["logits", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probabilities"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probabilities", "v"], ["output"]),
    ]
    initializers = [
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("minus_big", TensorProto.FLOAT, [], [-1e4]),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [8**-0.5]),
        helper.make_tensor("fixed_shape", TensorProto.INT64, [4], [2, 1, 1, length]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]))
    graph = helper.make_graph(
        nodes, "fixed_mask", inputs, [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)], initializers
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_mask_that_runs_at_one_length_is_probed_there():
    """6 and 9 doubled never reach 7, but the probe also tries the lengths the graph's Reshapes
    hold: at 7, the only length the model runs at, the mask is classified."""
    (site,) = attnrewrite.find_sites(mask_fixed_at_length(7))
    assert (site.mask, site.skip_reason) == (MaskKind.KEY_PADDING, None)


def test_a_mask_that_runs_at_no_length_is_unknown():
    """The mask reshaped to 3 x 1 x 1 x 7: a probe batch of 2 masks 2N keys, never 21, at any
    length: the site is refused, and its mask is unknown, not none."""
    model = mask_fixed_at_length(7)
    model.graph.initializer[-1].CopyFrom(helper.make_tensor("fixed_shape", TensorProto.INT64, [4], [3, 1, 1, 7]))
    (site,) = attnrewrite.find_sites(model)
    assert site.mask is MaskKind.UNKNOWN
    assert site.skip_reason.startswith("could not evaluate the attention mask to classify it ([ONNXRuntimeError]")
    assert "Reshape" in site.skip_reason
