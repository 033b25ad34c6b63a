"""bench/corpus.py (the held-out text of bench/FIDELITY.md), bench/fidelity.py's metrics and bench/window_units.py's error split."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import corpus  # noqa: E402
import fidelity  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return corpus.minilm_tokenizer()


@pytest.fixture(scope="module")
def built(tokenizer):
    return corpus.build_corpus(tokenizer)


def test_held_out_and_calibration_are_disjoint_by_source(built):
    assert len(built.heldout) >= 200 and len(built.calibration) <= corpus.CALIBRATION_TEXTS
    assert not set(built.heldout_sources) & set(built.calibration_sources)
    assert sorted(built.heldout_sources + built.calibration_sources) == sorted(corpus.sources())
    assert not set(built.heldout) & set(built.calibration)
    # no paragraph on both sides (a passage is whole paragraphs, or sentences of one)
    heldout_text = " ".join(built.heldout)
    assert not [p for p in set(_paragraphs(built.calibration)) if len(p) > 80 and p in heldout_text]


def _paragraphs(passages):
    for name in corpus.sources():
        for paragraph in corpus.source_paragraphs(name):
            if any(paragraph in p for p in passages):
                yield paragraph


def test_passages_are_the_token_range_and_deterministic(built, tokenizer):
    lengths = [corpus.token_count(t, tokenizer) for t in built.heldout + built.calibration]
    assert min(lengths) >= corpus.MIN_TOKENS and max(lengths) <= corpus.MAX_TOKENS
    again = corpus.build_corpus(tokenizer)
    assert again.heldout == built.heldout and again.calibration == built.calibration


def test_wider_calibration_adds_package_prose_and_no_held_out_sentence(built, tokenizer, monkeypatch):
    monkeypatch.setattr(corpus, "PACKAGES", ("networkx", "no_such_package", "onnxscript"))
    read = corpus.package_paragraphs
    leak = built.heldout[0]  # as if a package quoted a held-out passage: its first paragraph
    monkeypatch.setattr(corpus, "package_paragraphs", lambda name: [leak, *read(name)])
    wide = corpus.wide_calibration(built, tokenizer, extra=60)
    added = [p for p in wide if p not in set(built.calibration)]
    assert [p for p in wide if p in set(built.calibration)] == built.calibration  # all of them, in order
    assert 55 <= len(added) <= 65 and len(set(added)) == len(added)
    assert read("no_such_package") == []
    prose = "\n".join(p for name in ("networkx", "onnxscript") for p in read(name))
    assert all(p[:24] in prose and p[-24:] in prose for p in added)  # their prose (a paragraph: >= 12 words)
    held = {s for passage in built.heldout for s in corpus.sentences(passage)}
    assert not [p for p in added if held & set(corpus.sentences(p))]
    assert corpus.wide_calibration(built, tokenizer, extra=60) == wide


def test_prose_filter():
    sentence = "The event loop runs callbacks in the order in which they were registered with it."
    assert corpus.is_prose(sentence)
    assert not corpus.is_prose(">>> loop.call_soon(callback, *args)  # the event loop runs callbacks in order.")
    assert not corpus.is_prose(
        "Example:\n    loop.run_forever()\n    loop.close() and some more words to pass the count."
    )
    assert not corpus.is_prose("Too short to be a passage.")
    assert corpus.paragraphs_of(
        "1. The loop runs the callbacks in the order in which\n   they were registered with the loop."
    ) == ["The loop runs the callbacks in the order in which they were registered with the loop."]


def test_fidelity_metrics():
    rng = np.random.default_rng(0)
    original = rng.standard_normal((6, 8))
    same = fidelity.fidelity(original, 3.0 * original)  # a scale changes no cosine
    assert same["mean_cosine"] == pytest.approx(1.0) and same["nn_agreement"] == 1.0
    flipped = original.copy()
    flipped[2] *= -1
    worse = fidelity.fidelity(original, flipped)
    assert worse["min_cosine"] == pytest.approx(-1.0)
    assert worse["mean_cosine"] == pytest.approx(4 / 6)


def test_nn_agreement_at_a_fixed_cosine():
    rng = np.random.default_rng(0)
    spread = rng.standard_normal((40, 16))
    rows = fidelity.turned(spread, 0.99, rng)
    np.testing.assert_allclose(np.sum(rows * fidelity._unit(spread), axis=1), 0.99, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-12)
    assert fidelity.nn_agreement_at_fixed_cosine(spread, cosines=(1.0,)) == {"1": 1.0}
    # passages in groups of four near-copies: a small turn flips some nearest neighbours
    tied = np.repeat(spread[:10], 4, axis=0) + 1e-3 * rng.standard_normal((40, 16))
    assert fidelity.nn_agreement_at_fixed_cosine(tied, cosines=(0.99,))["0.99"] < 0.9


def test_batches_pad_and_pooling_ignores_the_padding():
    batch = next(fidelity.batches([np.array([101, 5, 102]), np.array([101, 7, 8, 9, 102])], 2))
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["input_ids"][0].tolist() == [101, 5, 102, 0, 0]
    hidden = np.arange(2 * 5 * 2, dtype=np.float32).reshape(2, 5, 2)
    hidden[0, 3:] = 1e6  # padding positions: must not count
    pooled = fidelity.mean_pool(hidden, batch["attention_mask"])
    np.testing.assert_allclose(pooled, [hidden[0, :3].mean(axis=0), hidden[1].mean(axis=0)])


def test_the_table_calibrates_every_configuration_with_something_to_fit():
    """lsh's calibrated row is recorded as not run, with the reason, instead of failing the run."""
    reasons = {c.name: c.cannot_calibrate() for c in fidelity.configurations()}
    assert reasons["lsh"] == "lsh has nothing to fit (its buckets come from random rotations and a sort)"
    assert [name for name, why in reasons.items() if why] == ["lsh"]


# --- bench/window_units.py: the split of a window hybrid's error -------------------------------


class _Weights:
    """Stands in for a fitted module: gives the attention weights it was made with."""

    sinks = 1

    def __init__(self, weights):
        self.weights = weights

    def attention_weights(self, q, k):
        return self.weights


def _softmax_and_far(n=40, window=8, seed=0):
    import torch
    from attention_mass import block_offsets

    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, 4, generator=generator) * 2 for _ in range(3))
    scale = 0.5
    true = torch.softmax(scale * q @ k.transpose(-2, -1), -1)
    offset = block_offsets(n, window)
    far = ~((offset.abs() <= 1) | (torch.arange(n) < 1)[None, :])
    return (q, k, v), scale, true, far


def test_window_split_of_softmax_itself_has_no_error():
    import window_units

    (q, k, v), scale, true, far = _softmax_and_far()
    split = window_units.far_split(_Weights(true), [(q, k, v)], scale, 8)
    assert split["far mass"] == pytest.approx(float((true * far).sum(-1).mean()), rel=1e-6)
    assert max(split["fitted"], split["true mass"], split["true distribution"]) < 1e-12


def test_window_split_puts_a_wrong_far_distribution_on_the_distribution():
    """The right far mass spread evenly over the far keys: all the error is the distribution's."""
    import window_units

    (q, k, v), scale, true, far = _softmax_and_far()
    mass = (true * far).sum(-1, keepdim=True)
    even = true * ~far + mass * far / far.sum(-1, keepdim=True)
    split = window_units.far_split(_Weights(even), [(q, k, v)], scale, 8)
    assert split["fitted"] > 1e-3
    assert split["true distribution"] < 1e-12
    assert split["true mass"] == pytest.approx(split["fitted"], rel=1e-5)


def test_window_units_variant_without_units_fits_only_w_b_and_the_kernel_weight():
    import math

    import torch
    import window_units

    from attnrewrite.site import AttentionSite, MaskKind

    site = AttentionSite("a", scale=1 / math.sqrt(8), mask=MaskKind.NONE, rank=4, num_heads=2, head_dim=8, value_dim=8)
    generator = torch.Generator().manual_seed(0)
    data = [tuple(torch.randn(2, 40, 8, generator=generator) for _ in range(3)) for _ in range(2)]
    beta, fitted_values = window_units.VARIANTS["before 685ec2c (no units)"]
    module = window_units.fitted(site, 8, beta, fitted_values, data, steps=3)
    assert not module.query_log_scale.any() and not module.key_log_scale.any()
    assert not module.local_max_weight.any()
    assert module.linear_log_weight.abs().sum() > 0 and not torch.equal(module.weight, torch.eye(8).repeat(2, 1, 1))
    beta, fitted_values = window_units.VARIANTS["beta_h from 1/2 (default)"]
    module = window_units.fitted(site, 8, beta, fitted_values, data, steps=3)
    assert module.query_log_scale.abs().sum() > 0 and not torch.equal(
        module.local_max_weight, torch.full((2, 1, 1), 0.5)
    )
