"""bench/recall.py's pure parts: the pass key prompt (its length, the key at the depth asked), the
scores, the rows' arguments and the section; nothing of SmolLM2 is read."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from models import load_bench_module

recall = load_bench_module("recall")
INTRO, FILLER, QUESTION = [1, 2, 3], [10, 11, 12, 13, 14], [7, 8, 9]
NEEDLE = [90, 91, 92, 93]


@pytest.mark.parametrize("length", [100, 512, 2048])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_the_pass_key_prompt_has_the_length_asked_and_the_key_at_its_depth(length, depth):
    ids, start = recall.passkey_prompt(INTRO, FILLER, NEEDLE, QUESTION, length, depth)
    assert len(ids) == length
    assert start == round(depth * length)
    assert ids[start : start + len(NEEDLE)] == NEEDLE and ids.count(90) == 1
    assert ids[: len(INTRO)] == INTRO and ids[-len(QUESTION) :] == QUESTION
    filler = ids[len(INTRO) : start] + ids[start + len(NEEDLE) : -len(QUESTION)]
    assert filler == (FILLER * length)[: len(filler)]  # the filler runs on across the key


def test_the_key_stays_between_the_intro_and_the_question():
    assert recall.passkey_prompt(INTRO, FILLER, NEEDLE, QUESTION, 20, 0.0)[1] == len(INTRO)
    ids, start = recall.passkey_prompt(INTRO, FILLER, NEEDLE, QUESTION, 20, 1.0)
    assert ids[start + len(NEEDLE) :] == QUESTION
    with pytest.raises(ValueError, match="no room"):
        recall.passkey_prompt(INTRO, FILLER, NEEDLE, QUESTION, 9, 0.5)


def test_trials_spread_over_the_depths_and_keys_are_five_digits_the_same_each_time():
    assert recall.depths(5) == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert recall.depths(1) == [0.5]
    keys = recall.pass_keys(10, seed=512)
    assert keys == recall.pass_keys(10, seed=512) and all(10_000 <= k < 100_000 for k in keys)


def test_a_key_counts_when_written_and_not_inside_a_longer_number():
    assert recall.key_found(" 12345. Remember it.", 12345)
    assert recall.key_found("12345", 12345)
    assert not recall.key_found(" 123456", 12345) and not recall.key_found(" 1234", 12345)


def test_the_copy_score_counts_the_second_copys_tokens_after_its_first():
    ids, start = recall.copy_sequence([5, 6, 7, 8], [20, 21, 22])
    assert ids == [5, 6, 7, 8, 20, 21, 22, 5, 6, 7, 8] and start == 7
    perfect = np.array(ids[1:])  # the argmax after each position is the true next token
    assert recall.copy_score(perfect, ids, start) == 1.0
    wrong_last = perfect.copy()
    wrong_last[-1] = 0
    assert recall.copy_score(wrong_last, ids, start) == pytest.approx(2 / 3)
    wrong_first = perfect.copy()
    wrong_first[start - 1] = 0  # the second copy's first token: not scored
    assert recall.copy_score(wrong_first, ids, start) == 1.0


def test_slices_are_consecutive_and_refuse_more_than_the_text():
    assert recall.slices(list(range(10)), [3, 2, 4]) == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="has 10 tokens, 11 asked for"):
        recall.slices(list(range(10)), [5, 6])


def test_rows_their_arguments_and_trials():
    listing = (
        "30 attention sites\nstate: 14.9 MB per sequence (14931240 bytes over 30 layers), the KV cache of 324 tokens"
    )
    assert recall.kv_tokens(listing) == 324
    assert recall.parse_row("calibrated: --to hedgehog -O window=64") == ("calibrated", "--to hedgehog -O window=64")
    with pytest.raises(argparse.ArgumentTypeError):
        recall.parse_row("--to hedgehog")
    assert recall.folder_name("hedgehog window=64, zero-shot") == "hedgehog-window-64-zero-shot"
    assert recall.trials_at([512, 4096, 8192], 10, ["4096=5", "8192=0"]) == {512: 10, 4096: 5}
    sizes = {"tokens": 324, "recent": 320}
    assert (
        recall.DEFAULT_ROWS["window, same bytes"].format(**sizes)
        == "--to streaming -O recent=320 -O sinks=4 --recurrent"
    )


def test_the_section_has_one_row_per_model_and_the_commands():
    measured = {"date": "2026-12-02", "processor": "cpu", "cpus": 2, "load_average_at_start": [1, 1, 1]}
    measured |= {"onnxruntime": "1.32.0", "genai": "0.18.0", "commit": "abc"}
    original = {"kv_bytes_per_token": 46080, "passkey": {"512": {"found": 2, "trials": 2, "seconds": 12}}}
    window = {"state_bytes": 14_930_000, "command": "attnrewrite genai/builder --to streaming", "seconds": 30.0}
    window |= {"passkey": {"512": {"found": 1, "trials": 2, "seconds": 30}}}
    window["copy"] = {"64": {"score": 0.95, "seconds": 30}}
    window |= {"heldout": {"agreement_far": 0.877, "perplexity_ratio_far": 1.19}, "measure_seconds": {"heldout": 60}}
    results = {"rows": {recall.ORIGINAL: original, "window": window}, "tokens": 324}
    results["runs"] = [{"command": "python bench/recall.py", "setup": "a setup.", "measured": measured}]
    text = recall.markdown(results)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| model | state | key 512 | copy 64 | 2k: agree | ppl x | time |"
    assert rows[1] == f"| {recall.ORIGINAL} | KV cache: 24 MB at 512 | 2/2 |  | 1 | 1 | 0.2 min |"
    assert rows[2] == "| window | 14.9 MB | 1/2 | 0.95 | 0.877 | 1.19 | 30 s + 2.0 min |"
    assert "- window: `attnrewrite genai/builder --to streaming`" in text
    assert (
        "Measured 2026-12-02 on cpu, 2 CPUs, onnxruntime 1.32.0, onnxruntime-genai 0.18.0, commits abc (load averages at the runs' starts: 1, 1, 1)"
        in text
    )
    assert text.count("`python bench/recall.py`: a setup.") == 1


def test_runs_written_at_the_same_time_merge_into_one_table():
    first = {"rows": {"w": {"passkey": {"512": {"found": 1}}, "seconds": 30.0}}, "tokens": 324}
    first["runs"] = [{"command": "one", "setup": "short."}]
    second = {"rows": {"w": {"passkey": {"4096": {"found": 0}}, "seconds": None}, "o": {}}, "tokens": 324}
    second["runs"] = [{"command": "two", "setup": "long."}]
    both = recall.merged_results(first, second)
    assert both["rows"]["w"] == {"passkey": {"512": {"found": 1}, "4096": {"found": 0}}, "seconds": 30.0}
    assert list(both["rows"]) == ["w", "o"] and [run["command"] for run in both["runs"]] == ["one", "two"]
    assert recall.merged_results(both, second)["runs"] == both["runs"]  # merged again: the same
