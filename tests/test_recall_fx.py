"""bench/recall_fx.py's pure parts: when a greedy continuation's verdict on the pass key is
decided (so stopping early gives what decoding every token would), and the state bytes each row
states; nothing of SmolLM2 is read."""

from __future__ import annotations

import pytest
from models import load_bench_module

recall_fx = load_bench_module("recall_fx")
KEY = 12345


@pytest.mark.parametrize(
    ("text", "missing"),
    [(" 12345", 0), (" 12345.", 0), ("", 5), (" ", 5), (" 1", 4), (" 1234", 1), (" 9", 5), (" 123456", 5)],
)
def test_the_digits_missing_are_those_after_the_keys_first_ones_the_text_ends_in(text, missing):
    assert recall_fx.digits_missing(text, KEY) == missing


def test_a_continuation_is_decided_once_the_key_is_written_or_cannot_be():
    assert recall_fx.decided(" 12345", KEY, tokens_left=7, digits_per_token=1)
    assert not recall_fx.decided(" 9", KEY, tokens_left=5, digits_per_token=1)  # " 12345" still fits
    assert recall_fx.decided(" 9", KEY, tokens_left=4, digits_per_token=1)
    assert not recall_fx.decided(" 9", KEY, tokens_left=3, digits_per_token=2)
    assert recall_fx.decided(" 123", KEY, tokens_left=1, digits_per_token=1)


def test_the_state_bytes_grow_by_the_sparse_cache_of_every_key_value_head():
    window = recall_fx.state_bytes({"window": 64, "sparse": 0}, recall_fx.KV_HEADS)
    cached = recall_fx.state_bytes({"window": 64, "sparse": 64}, recall_fx.KV_HEADS)
    pair = 2 * recall_fx.HEAD_DIM * 4 + 4  # a float32 key and value and a float32 keep flag
    assert cached - window == recall_fx.LAYERS * recall_fx.KV_HEADS * 64 * pair
    as_run = recall_fx.row_entry("hedgehog window=64 sparse=64", {"hedgehog window=64 sparse=64": 0.0})
    assert as_run["state_bytes_as_run"] - window == recall_fx.LAYERS * recall_fx.HEADS * 64 * pair


def test_the_calibrated_rows_fit_on_the_calibration_texts_packed_as_the_cli_packs_them(tmp_path):
    from test_calibration import word_tokenizer

    word_tokenizer(tmp_path / "tokenizer.json")
    texts = [" ".join(f"w{(i + j) % 997}" for j in range(200)) for i in range(3)]
    (tmp_path / "calibration.txt").write_text("\n".join(texts) + "\n\n")
    examples = recall_fx.calibration_examples(tmp_path)
    # 200 words a text: the first two share a passage of at most 512 tokens, the third its own
    assert [tuple(ids.shape) for (ids,) in examples] == [(1, 400), (1, 200)]
    assert examples[0][0][0, :3].tolist() == [3, 4, 5] and examples[1][0][0, 0].item() == 5  # "w0 w1 w2", "w2"


def test_the_page_says_how_the_rows_were_fitted():
    zero_shot = {"hedgehog window=64": {}, "hedgehog window=64 sparse=64": {}}
    assert recall_fx.fitting_said({recall_fx.ORIGINAL: {}, **zero_shot}) == "zero-shot"
    assert recall_fx.fitting_said({"hedgehog window=64 sparse=64, calibrated": {}}) == "calibrated"
    both = {**zero_shot, "hedgehog window=64, calibrated": {}}
    assert recall_fx.fitting_said(both) == "zero-shot and calibrated"
    assert recall_fx.calibration_said({}) == ", nothing calibrated"
    assert "the first 16 packed passages of 512 tokens" in recall_fx.calibration_said({"calibration_passages": 16})
