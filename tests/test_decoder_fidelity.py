"""bench/decoder_fidelity.py at a tiny setting: its tokenizer, packing, cached training and export,
a CLI rewrite to a recurrent model, and the next-token figures it reports."""

from __future__ import annotations

import dataclasses
import math

import decoders  # noqa: F401  (first: the bench script's ``import decoders`` must find tests/models.py's)
import numpy as np
import pytest
from models import load_bench_module

script = load_bench_module("decoder_fidelity")
corpus = load_bench_module("corpus")

TINY = script.Settings(
    layers=1,
    hidden=32,
    heads=4,
    kv_heads=2,
    intermediate=64,
    vocab=320,
    length=64,
    batch=4,
    steps=20,
    lr=1e-2,
    warmup=1,
)
MAX_TOKENS = 160  # past FAR_FROM (128): some positions have keys beyond a window of 64


@pytest.fixture(scope="module")
def text():
    built = corpus.build_corpus()
    return built.calibration[:12], built.heldout[:3]


@pytest.fixture(scope="module")
def trained(text, tmp_path_factory) -> script.Trained:
    return script.prepare(TINY, text[0], tmp_path_factory.mktemp("cache"), log=lambda line: None)


@pytest.fixture(scope="module")
def heldout(text, trained) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(trained.folder / script.TOKENIZER))
    return script.encode(text[1], tokenizer, MAX_TOKENS)


def test_the_tokenizer_is_learnt_deterministically_and_starts_every_text_with_bos(text):
    first, again = (script.train_tokenizer(text[0], TINY.vocab) for _ in range(2))
    assert first.to_str() == again.to_str()
    assert first.get_vocab_size() == TINY.vocab
    sentence = "Return the value of the named attribute of object."
    encoded = first.encode(sentence)
    assert encoded.tokens[0] == script.BOS
    assert first.decode(encoded.ids) == sentence


def test_pack_cuts_the_passages_one_after_another_into_full_rows():
    rows = script.pack([np.arange(5), np.arange(10, 17)], 4)
    assert rows.tolist() == [[0, 1, 2, 3], [4, 10, 11, 12], [13, 14, 15, 16]]


def test_next_token_scores_the_true_next_tokens():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [1 / 3, 1 / 3, 1 / 3]], np.float32))
    argmax, nll = script.next_token(logits, np.array([0, 1, 2]))
    assert argmax.tolist() == [0, 2]
    assert nll == pytest.approx([-math.log(0.25), -math.log(0.7)], rel=1e-6)


def test_training_and_export_are_cached_by_settings_and_text(trained, text, monkeypatch):
    assert (trained.folder / script.ORIGINAL).is_file()
    assert (trained.folder / script.CALIBRATION).read_text().splitlines() == text[0]
    assert trained.record["key"] == trained.folder.name == TINY.key(text[0])
    assert math.isfinite(trained.record["final_train_loss"]) and math.isfinite(trained.record["calibration_loss"])
    monkeypatch.setattr(script, "train", lambda *args, **kwargs: pytest.fail("trained again"))
    assert script.prepare(TINY, text[0], trained.folder.parent, log=lambda line: None) == trained
    assert TINY.key(text[0][:-1]) != trained.record["key"]
    assert dataclasses.replace(TINY, steps=4).key(text[0]) != trained.record["key"]


def test_the_recurrent_rewrite_is_measured_against_the_original(trained, heldout):
    row = script.rewrite(trained, "hedgehog", "zero-shot", log=lambda line: None)
    assert row["command"] == "attnrewrite decoder.onnx --to hedgehog --recurrent -o hedgehog-zero-shot.onnx"
    assert "refused" not in row, row
    original = trained.folder / script.ORIGINAL
    paths = {"original": original, "original again": original, "hedgehog": row["path"]}
    rows = script.evaluate(paths, heldout)
    assert rows["original"]["agreement"] == rows["original again"]["agreement"] == 1.0
    assert rows["original"]["agreement_far"] == rows["original"]["perplexity_ratio_far"] == 1.0
    assert rows["original again"]["perplexity"] == rows["original"]["perplexity"]
    assert 1.0 < rows["original"]["perplexity"] < TINY.vocab  # trained a little: better than a uniform guess
    assert 0.0 <= rows["hedgehog"]["agreement"] <= 1.0 and 0.0 <= rows["hedgehog"]["agreement_far"] <= 1.0
    assert math.isfinite(rows["hedgehog"]["perplexity"])
    assert rows["hedgehog"]["perplexity_ratio"] == pytest.approx(
        rows["hedgehog"]["perplexity"] / rows["original"]["perplexity"]
    )
    checks = script.decode_check({"original": original, "hedgehog": row["path"]}, heldout[:2])
    for check in checks.values():
        assert check["max_abs_logit_difference"] < 1e-4
        assert check["argmax_differs"] == 0.0


def test_the_section_is_appended_then_replaced_keeping_the_rest_and_its_notes(tmp_path):
    path = tmp_path / "FIDELITY.md"
    path.write_text("# Encoders\n\nkept\n")
    script.write_section(path, "## Decoders\n\nfirst")
    written = path.read_text()
    assert written.startswith("# Encoders\n\nkept\n\n<!-- DECODERS -->\n## Decoders\n\nfirst\n")
    path.write_text(written.replace("<!-- /DECODERS NOTES -->", "my note\n<!-- /DECODERS NOTES -->") + "after\n")
    script.write_section(path, "## Decoders\n\nsecond")
    assert path.read_text() == (
        "# Encoders\n\nkept\n\n<!-- DECODERS -->\n## Decoders\n\nsecond\n\n"
        "<!-- DECODERS NOTES -->\nmy note\n<!-- /DECODERS NOTES -->\n<!-- /DECODERS -->\nafter\n"
    )
