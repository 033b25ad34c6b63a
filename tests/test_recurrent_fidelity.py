"""--calibrate and the fidelity check with --recurrent (issue 26): a decoder is calibrated on its
tokens, each batch a prefill from nothing (empty caches, zero states, positions from the mask);
the fitted values land in the recurrent model's own initializers, so it equals the parallel
rewrite of the no-cache export calibrated on the same tokens; the check runs the original and
the recurrent model as they generate (a prefill, then one token per call) and compares the
logits of every real token."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import decoder_exported, read_record
from decoders import DECODERS, left_padded_mask, logits_error, positions_of

import attnrewrite
from attnrewrite import check, cli, pipeline
from attnrewrite.generate import forced_logits
from attnrewrite.onnx.io import load_model

CONFIGS = {"plain": {}, "window": {"window": 4, "sinks": 1}, "sparse": {"window": 4, "sinks": 1, "sparse": 3}}
STEPS = 20  # calibration steps: enough to move every fitted value
TOLERANCE = 1e-5  # relative to the logits' largest magnitude
LENGTH, PREFILL = 14, 9  # the sequence compared on: 9 tokens at once, then 5 one at a time


def tokens(vocab: int, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(2, vocab, (batch, length)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": left_padded_mask(batch, length)}


def with_positions(spec, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The no-cache export's inputs for ``feeds``: it takes position ids where the model does."""
    return {**feeds, "position_ids": positions_of(feeds["attention_mask"])} if spec.position_ids else feeds


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def fitted_initializers(model: onnx.ModelProto, suffix: str) -> list[str]:
    return sorted(t.name for t in model.graph.initializer if t.name.endswith(suffix))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_calibrated_recurrent_model_equals_the_calibrated_parallel_rewrite(decoder_exports, name, config):
    spec = DECODERS[name]
    cached = decoder_exported(decoder_exports, name, "legacy")
    uncached = decoder_exported(decoder_exports, name, "legacy", cache=False)
    data = tokens(spec.vocab, 16, 20, seed=1)  # the caches and positions are filled, not given
    settings = {"calibrate_steps": STEPS, **CONFIGS[config]}
    recurrent_model = attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True, calibrate=data, **settings)
    parallel = attnrewrite.rewrite(str(uncached.path), "hedgehog", calibrate=with_positions(spec, data), **settings)

    record = read_record(recurrent_model)
    assert [site["calibration"]["examples"] for site in record["sites"]] == [16] * spec.layers
    assert all(site["calibration"]["loss_after"] < site["calibration"]["loss_before"] for site in record["sites"])
    # every site fits its own values, though they start equal (shared, one fit would overwrite another)
    assert len(fitted_initializers(recurrent_model, "Softmax/weight")) == spec.layers

    sequence = tokens(spec.vocab, 2, LENGTH, seed=2)
    expected = session(parallel).run(["logits"], with_positions(spec, sequence))[0]
    actual = forced_logits(
        session(recurrent_model), "recurrent", sequence["input_ids"], sequence["attention_mask"], PREFILL
    )
    assert logits_error(actual, expected, sequence["attention_mask"]) <= TOLERANCE * np.abs(expected).max()
    uncalibrated = attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True, **CONFIGS[config])
    before = forced_logits(session(uncalibrated), "before", sequence["input_ids"], sequence["attention_mask"], PREFILL)
    assert logits_error(before, expected, sequence["attention_mask"]) > 10 * TOLERANCE * np.abs(expected).max()


def test_end_to_end_calibration_fits_a_recurrent_model_on_its_logits(decoder_exports):
    spec = DECODERS["gpt2"]
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    uncached = decoder_exported(decoder_exports, "gpt2", "legacy", cache=False)
    data = tokens(spec.vocab, 16, 20, seed=1)
    settings = {"calibrate_steps": 5, "calibrate_end_to_end": 5}
    recurrent_model = attnrewrite.rewrite(str(cached.path), "linear", recurrent=True, calibrate=data, **settings)
    parallel = attnrewrite.rewrite(str(uncached.path), "linear", calibrate=with_positions(spec, data), **settings)

    end_to_end = read_record(recurrent_model)["end_to_end"]
    assert end_to_end["steps"] == 5 and end_to_end["batches"] == read_record(parallel)["end_to_end"]["batches"] == 4
    sequence = tokens(spec.vocab, 2, LENGTH, seed=2)
    expected = session(parallel).run(["logits"], with_positions(spec, sequence))[0]
    actual = forced_logits(
        session(recurrent_model), "recurrent", sequence["input_ids"], sequence["attention_mask"], PREFILL
    )
    assert logits_error(actual, expected, sequence["attention_mask"]) <= TOLERANCE * np.abs(expected).max()


def test_cli_calibrates_a_decoder_on_text(decoder_exports, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    spec = DECODERS["llama"]
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    words = {f"w{i}": i for i in range(spec.vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(2, spec.vocab, rng.integers(5, 15))) for _ in range(12)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "out.onnx"
    argv = [str(cached.path), "--to", "hedgehog", "--recurrent", "--check", "-o", str(out)]
    argv += ["--calibrate", str(tmp_path / "texts.txt"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert cli.main([*argv, "--calibrate-steps", "5"]) == 0
    sites = read_record(onnx.load(out))["sites"]
    assert [s["calibration"]["tokens"] for s in sites] == [sum(len(t.split()) for t in texts)] * spec.layers
    assert "a prefill of 56 tokens, then 8 one at a time" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_check_of_a_recurrent_rewrite_compares_the_models_as_they_generate(decoder_exports, name):
    spec = DECODERS[name]
    cached = decoder_exported(decoder_exports, name, "legacy")
    uncached = decoder_exported(decoder_exports, name, "legacy", cache=False)
    result = pipeline.run(str(cached.path), pipeline.Settings("hedgehog", recurrent=True, check=True, seq=20))
    fidelity = result.fidelity
    assert fidelity.input_source == "generated (batch 2, seq 20, seed 0); a prefill of 12 tokens, then 8 one at a time"
    assert fidelity.inputs == {"input_ids": [2, 20], "attention_mask": [2, 20]}

    # what it reports is what the no-cache export and its parallel rewrite give on the same tokens
    feeds = check.prepare_decoder_inputs(load_model(cached.path), seq=20).feeds
    real = feeds["attention_mask"] != 0
    original = session(onnx.load(uncached.path)).run(["logits"], with_positions(spec, feeds))[0]
    rewritten = session(attnrewrite.rewrite(str(uncached.path), "hedgehog")).run(
        ["logits"], with_positions(spec, feeds)
    )
    expected = check.compare_outputs("logits", original[real], rewritten[0][real])
    (output,) = fidelity.outputs
    assert output.shape == (int(real.sum()), spec.vocab)
    assert output.cosine_min == pytest.approx(expected.cosine_min, abs=1e-5)
    assert output.argmax_agreement == expected.argmax_agreement
    assert output.max_abs_error == pytest.approx(expected.max_abs_error, abs=1e-5)
    assert output.max_abs_error > 1e-4  # the check sees the approximation: not a model compared with itself


def test_the_gates_apply_to_a_recurrent_rewrite(decoder_exports):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    with pytest.raises(check.FidelityBelowThreshold, match="output 'logits' has per-example cosine min 0.9"):
        attnrewrite.rewrite(str(cached.path), "linear", recurrent=True, min_cosine=0.99999, seq=20)
    model = attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True, min_agreement=0.5, seq=20)
    assert read_record(model)["options"]["recurrent"] is True


def test_the_tokens_to_check_on_can_be_given_but_not_a_cache(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    given = tokens(DECODERS["gpt2"].vocab, 3, 12, seed=4)
    result = pipeline.run(str(cached.path), pipeline.Settings("linear", recurrent=True, inputs=given))
    assert result.fidelity.input_source == "given arrays; a prefill of 4 tokens, then 8 one at a time"
    assert result.fidelity.outputs[0].shape == (int(given["attention_mask"].sum()), DECODERS["gpt2"].vocab)

    inputs, out = tmp_path / "inputs.npz", tmp_path / "out.onnx"
    np.savez(inputs, **given, **{"past_key_values.0.key": np.zeros((3, 4, 0, 8), np.float32)})
    argv = [str(cached.path), "--to", "linear", "--recurrent", "--inputs", str(inputs), "-o", str(out)]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == (
        f"attnrewrite: error: {inputs}: 'past_key_values.0.key': a decoder is checked from an empty cache, "
        "on input_ids and attention_mask"
    )
    assert not out.exists()


def test_check_command_compares_a_decoder_with_its_recurrent_rewrite(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    rewritten = tmp_path / "recurrent.onnx"
    onnx.save(attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True), rewritten)
    capsys.readouterr()
    # 64 tokens fit GPT-2's 64 positions: the check starts from an empty cache
    assert cli.main(["check", str(cached.path), str(rewritten), "--min-agreement", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["logits", "126x100"]  # 2 x 64 tokens but row 1's 2 pads
    assert lines[2] == "inputs: generated (batch 2, seq 64, seed 0); a prefill of 56 tokens, then 8 one at a time"
