"""Text calibration data packed into passages (issue 27): consecutive texts joined in file order,
framed as the tokenizer's post-processor frames a pair, never split unless one alone is too long
(then cut and counted); deterministic; the record says what was done. And the coverage each
fit reports: the share of queries whose kernel part saw far keys."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from conftest import read_record
from models import SAMPLE_BERT

import attnrewrite.onnx.io
from attnrewrite import calibration
from attnrewrite.cli import main

CLS, SEP, PAD = 1, 2, 0


def bert_like_tokenizer(path, framed: bool = True) -> None:
    """A tokenizer.json: whitespace words w0..w996 -> ids 3.., [CLS] = 1 and [SEP] = 2 framing a
    text ([CLS] a [SEP]) and a pair ([CLS] a [SEP] b [SEP]) when ``framed``; else none (a decoder's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[PAD]": PAD, "[CLS]": CLS, "[SEP]": SEP, **{f"w{i}": i + 3 for i in range(997)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if framed:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
        )
    tokenizer.save(str(path))


def words(first: int, count: int) -> str:
    return " ".join(f"w{first + i}" for i in range(count))


def ids(first: int, count: int) -> list[int]:
    return [first + i + 3 for i in range(count)]


@pytest.fixture
def graph():
    return attnrewrite.onnx.io.load_model(SAMPLE_BERT).graph


def text_data(tmp_path, texts: list[str], graph, framed: bool = True, **settings):
    bert_like_tokenizer(tmp_path / "tokenizer.json", framed)
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    return calibration.onnx_calibration(
        str(tmp_path / "texts.txt"),
        graph,
        tokenizer=tmp_path / "tokenizer.json",
        progress=lambda line: None,
        **settings,
    )


def rows(data) -> list[list[int]]:
    """Every example's real token ids (padding dropped), batch by batch."""
    return [
        [int(t) for t, m in zip(row, mask) if m]
        for batch in data.batches
        for row, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]


def test_texts_are_packed_in_file_order_framed_as_a_pair_never_split(tmp_path, graph):
    # lengths 3, 4, 5, 2, 9: [CLS] 3 [SEP] 4 [SEP] = 10 tokens; + 5 [SEP] would be 16 > 12
    texts = [words(0, 3), words(10, 4), words(20, 5), words(30, 2), words(40, 9)]
    data = text_data(tmp_path, texts, graph, max_length=12)
    assert rows(data) == [
        [CLS, *ids(0, 3), SEP, *ids(10, 4), SEP],
        [CLS, *ids(20, 5), SEP, *ids(30, 2), SEP],
        [CLS, *ids(40, 9), SEP],
    ]
    assert data.text.summary() == "packed 5 texts into 3 passages of <= 12 tokens"
    assert (data.examples, data.tokens, data.text.cut) == (3, 10 + 10 + 11, 0)


def test_a_text_longer_than_the_length_is_cut_and_counted(tmp_path, graph):
    data = text_data(tmp_path, [words(0, 2), words(100, 30), words(200, 2)], graph, max_length=8)
    assert rows(data) == [[CLS, *ids(0, 2), SEP], [CLS, *ids(100, 6), SEP], [CLS, *ids(200, 2), SEP]]
    assert data.text.summary() == "packed 3 texts into 3 passages of <= 8 tokens; 1 text longer than 8 tokens cut"
    unpacked = text_data(tmp_path, [words(0, 2), words(100, 30), words(200, 2)], graph, max_length=8, pack=False)
    assert sorted(map(len, rows(unpacked))) == [4, 4, 8] and unpacked.text.cut == 1


def test_without_a_post_processor_texts_are_joined_plainly(tmp_path, graph):
    data = text_data(tmp_path, [words(0, 3), words(10, 4), words(20, 5)], graph, framed=False, max_length=8)
    assert rows(data) == [[*ids(0, 3), *ids(10, 4)], ids(20, 5)]


def test_packing_is_byte_for_byte_deterministic_and_the_fingerprint_covers_it(tmp_path, graph):
    texts = [words(7 * i % 900, 1 + i % 13) for i in range(60)]
    first, again = (text_data(tmp_path, texts, graph, max_length=32) for _ in range(2))
    digest = [
        hashlib.sha256(b"".join(a.tobytes() for feeds in d.batches for a in feeds.values())).hexdigest()
        for d in (first, again)
    ]
    assert digest[0] == digest[1] and first.fingerprint == again.fingerprint
    unpacked = text_data(tmp_path, texts, graph, max_length=32, pack=False)
    longer = text_data(tmp_path, texts, graph, max_length=64)
    assert len({first.fingerprint, unpacked.fingerprint, longer.fingerprint}) == 3
    assert first.fingerprint == calibration.fitted_calibration(first.batches, graph).fingerprint


def test_npz_data_is_never_repacked(tmp_path, graph):
    arrays = {"input_ids": np.full((4, 6), 5), "attention_mask": np.ones((4, 6), np.int64)}
    np.savez(tmp_path / "data.npz", **arrays)
    data = calibration.onnx_calibration(str(tmp_path / "data.npz"), graph, progress=lambda line: None)
    assert data.text is None and [b["input_ids"].shape for b in data.batches] == [(4, 6)]


def test_the_cli_says_what_packing_did_and_the_record_keeps_it(tmp_path, capsys):
    bert_like_tokenizer(tmp_path / "tokenizer.json")
    texts = [words(5 * i % 900, 2 + i % 4) for i in range(12)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "hedgehog", "--option", "window=4", "-o", str(out), "--calibrate-steps", "3"]
    argv += ["--calibrate", str(tmp_path / "texts.txt"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert main([*argv, "--max-length", "16"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "packed 12 texts into 4 passages of <= 16 tokens"
    entry = read_record(onnx.load(out))["sites"][0]["calibration"]
    assert entry["text"] == {
        "texts": 12,
        "examples": 4,
        "packed": True,
        "max_length": 16,
        "cut": 0,
        "summary": "packed 12 texts into 4 passages of <= 16 tokens",
    }
    assert entry["examples"] == 4 and "held_out" not in entry  # 4 passages: too few to hold any out


def test_coverage_is_what_the_kernel_part_saw_and_short_texts_are_warned_about(tmp_path, capsys):
    bert_like_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "texts.txt").write_text("\n".join(words(3 * i, 3) for i in range(16)) + "\n")
    argv = [
        str(SAMPLE_BERT),
        "--to",
        "hedgehog",
        "--option",
        "window=4",
        "--calibrate-steps",
        "3",
        "--max-length",
        "32",
    ]
    argv += ["--calibrate", str(tmp_path / "texts.txt"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    # 5-token texts, one per example: with a window of 4 the blocks before and after cover them
    assert main([*argv, "--calibrate-pack", "off", "-o", str(tmp_path / "off.onnx")]) == 0
    err = capsys.readouterr().err
    for site in (1, 2):
        assert (
            f"site {site}: the kernel part saw far keys for 0.0% of queries: calibrate on longer inputs "
            "(packing is off) or a smaller window"
        ) in err.splitlines()
    assert read_record(onnx.load(tmp_path / "off.onnx"))["sites"][0]["calibration"]["coverage"] == {
        "queries": 0.0,
        "attention_mass": 0.0,
    }
    # packed: passages of 7, 7 and 2 texts (29, 29 and 9 tokens): most queries see keys beyond their blocks
    assert main([*argv, "-o", str(tmp_path / "on.onnx")]) == 0
    assert "the kernel part saw far keys" not in capsys.readouterr().err
    coverage = read_record(onnx.load(tmp_path / "on.onnx"))["sites"][0]["calibration"]["coverage"]
    assert 0.5 < coverage["queries"] <= 1.0 and 0.0 < coverage["attention_mass"] < 1.0


def test_without_a_window_every_key_is_far(tmp_path):
    arrays = {"input_ids": np.arange(12).reshape(2, 6) + 3, "attention_mask": np.ones((2, 6), np.int64)}
    model = attnrewrite.rewrite(str(SAMPLE_BERT), "hedgehog", calibrate=arrays, calibrate_steps=2)
    coverage = [s["calibration"]["coverage"] for s in read_record(model)["sites"]]
    assert coverage == [{"queries": 1.0, "attention_mass": 1.0}] * 2


def test_packing_without_calibration_is_refused(tmp_path, capsys):
    argv = [str(SAMPLE_BERT), "--to", "linear", "--calibrate-pack", "off", "-o", str(tmp_path / "out.onnx")]
    assert main(argv) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --calibrate-pack is for a text --calibrate file; give --calibrate too")
    )
