"""A regression corpus of real exports: tiny configs of many model families (tests/models.py
CORPUS_MODELS and the audio encoders; random weights), each exported by the TorchScript (legacy)
and the dynamo exporter, must give exactly the sites below, with their mask kinds or the reason
each is refused, and every method's rewrite must replace exactly the sites it supports, pass the
validation gates and leave none of their Softmax nodes behind. (Numeric parity with the pass's
torch module is tested per site elsewhere: tests/test_onnx_exports.py, tests/test_audio.py.)

Expectations are today's honest behaviour; where it changed with shared key/value heads and
shape folding (branch coverage), the entry says what it was before. One export per (model, exporter) per
session (conftest ``exports``); the dynamo exports take most of the time and are marked slow.
"""

from __future__ import annotations

import collections
import re

import pytest
from conftest import exported, read_record
from models import BIDIRECTIONAL_REFUSED, CAUSAL_REFUSED, EXPORTERS

import attnrewrite
from attnrewrite import passes

ALL = ("none", "key_padding", "causal", "causal+key_padding")
BIAS = "the additive term on the logits is an attention bias, not a mask (values other than 0 and large negatives)"
SLIDING = "the mask is neither key padding nor causal (e.g. a sliding window or a mask on queries)"


def site_summary(sites) -> dict[tuple[str, str | None], int]:
    """How many sites have each (mask kind, reason refused); node names in reasons are
    replaced by '*' (they differ between exporters and layers)."""
    counts = collections.Counter(
        (s.mask.value, s.skip_reason and re.sub(r"'[^']*'", "'*'", s.skip_reason)) for s in sites
    )
    return dict(sorted(counts.items(), key=lambda item: (item[0][0], item[0][1] or "")))


# (model, exporter) -> {(mask, reason or None): sites}. An exporter that cannot export a model
# is skipped with its own reason (conftest.exported).
KEY_PADDING = {("key_padding", None): 2}
CAUSAL_KEY_PADDING = {("causal+key_padding", None): 2}
NO_MASK = {("none", None): 2}
BIASED = {("bias", BIAS): 2}


def both(expected):
    return {exporter: expected for exporter in EXPORTERS}


EXPECTED: dict[tuple[str, str], dict[tuple[str, str | None], int]] = {
    (name, exporter): expected
    for name, by_exporter in {
        # audio (tests/test_audio.py says why these kinds)
        "wav2vec2": both(KEY_PADDING),
        "wav2vec2-group": both(NO_MASK),
        "hubert": both(KEY_PADDING),
        "wavlm": both(BIASED),  # a gated relative position bias
        # encoders
        "albert": both(KEY_PADDING),
        "electra": both(KEY_PADDING),
        "xlm-roberta": both(KEY_PADDING),
        "esm": both(KEY_PADDING),  # rotary embeddings on q and k: still plain attention
        "clip-vision": both(NO_MASK),
        "siglip-vision": both(NO_MASK),
        "segformer": both(NO_MASK),  # keys reduced by a strided convolution: fewer keys than queries
        # decoders
        "opt": both(CAUSAL_KEY_PADDING),
        "llama": both(CAUSAL_KEY_PADDING),
        "qwen2": both(CAUSAL_KEY_PADDING),  # GQA: the exporters repeat k and v to every query head
        # MQA: one k and v head broadcast over q's four (before branch coverage every causal kernel
        # method but hydra failed its run gate on it)
        "falcon": both(CAUSAL_KEY_PADDING),
        "clip-text": both(CAUSAL_KEY_PADDING),
        # encoder-decoders: encoder self-attention, decoder self-attention (causal; no decoder
        # attention_mask given) and cross-attention (keys: the encoder's states)
        "bart": both({("causal", None): 2, ("key_padding", None): 4}),
        "whisper": both({("causal", None): 2, ("none", None): 4}),
        # the legacy export of nn.MultiheadAttention keeps the traced shape in its Reshapes
        # (skipped with that reason); at a fixed shape see "nn-transformer", "legacy-static"
        "nn-transformer": {
            exporter: {("causal", None): 2, ("none", None): 4} for exporter in (*EXPORTERS, "legacy-static")
        },
        # negatives: every site refused
        "t5-encoder-eager": both(BIASED),
        "t5-encoder-sdpa": both(BIASED),
        "beit": both(
            BIASED
        ),  # relative position bias (the dynamo exporter fails on it today: skipped, its reason said)
        "mpnet": both(BIASED),  # relative position bias
        "mpt": both(BIASED),  # ALiBi, added as a bias
        "bloom": both({("unknown", "cannot tell the logits from the mask in '*'"): 2}),  # ALiBi through baddbmm
        "gemma2": both({("unknown", "cannot tell the logits from the mask in '*'"): 2}),  # tanh soft-capping
        "gpt-neo": both({("bias", SLIDING): 2}),  # local attention
        "mistral": both({("bias", SLIDING): 2}),  # sliding window
        # disentangled attention: its relative terms vary over queries and keys (before branch
        # coverage folded shape arithmetic, the legacy export's scale, sqrt of a dim read at run
        # time, was refused first)
        "deberta": both({("bias", SLIDING): 2}),
        "deberta-v2": both({("unknown", "Reshape node '*' between q @ k^T and softmax is not understood"): 2}),
    }.items()
    for exporter, expected in by_exporter.items()
}

# how each exporter key is exported: (exporter, dynamic axes)
EXPORT_MODES = {"legacy": ("legacy", True), "dynamo": ("dynamo", True), "legacy-static": ("legacy", False)}


def case(name: str, exporter: str):
    marks = [pytest.mark.slow] if exporter == "dynamo" else []
    return pytest.param(name, exporter, id=f"{name}-{exporter}", marks=marks)


CASES = [case(name, exporter) for name, exporter in EXPECTED]


@pytest.mark.parametrize("name, exporter", CASES)
def test_sites(exports, name, exporter):
    sites = attnrewrite.find_sites(exported(exports, name, *EXPORT_MODES[exporter]).load())
    assert site_summary(sites) == EXPECTED[name, exporter]
    assert [s.layer for s in sites] == list(range(len(sites)))


def rewritable_by(method: str, expected: dict[tuple[str, str | None], int]) -> int:
    """How many sites of an expectation ``method`` must rewrite: every unrefused one, but
    causal ones for linformer and nystrom (their projections and landmarks would mix future
    keys into the past), bidirectional ones for streaming."""
    return sum(
        n
        for (mask, reason), n in expected.items()
        if reason is None
        and not (method in CAUSAL_REFUSED and "causal" in mask)
        and not (method in BIDIRECTIONAL_REFUSED and "causal" not in mask)
    )


def refuses_every_site(name: str, exporter: str) -> bool:
    return all(reason is not None for _, reason in EXPECTED[name, exporter])


def rewrite_cases() -> list:
    """Every method on each export with a site to rewrite. An export whose every site detection
    refuses comes back unchanged whatever the method (refusal comes before a method is chosen):
    each takes one method, in turn, so that every method still meets refused sites (192
    rewrites fewer than every method on all of them)."""
    methods = list(passes.PASSES)
    refused = [c for c in CASES if refuses_every_site(*c.values)]
    taken = {c.id: [methods[turn % len(methods)]] for turn, c in enumerate(refused)}
    return [
        pytest.param(*c.values, method, id=f"{c.id}-{method}", marks=c.marks)
        for c in CASES
        for method in taken.get(c.id, methods)
    ]


@pytest.mark.parametrize("name, exporter, method", rewrite_cases())
def test_every_method_rewrites_what_it_supports(exports, name, exporter, method):
    export = exported(exports, name, *EXPORT_MODES[exporter])
    expected = EXPECTED[name, exporter]
    original = export.load()
    model = attnrewrite.rewrite(original, to=method)  # validates: checker, session, a run
    record = read_record(model)

    found = sum(expected.values())
    assert (record["sites_found"], record["sites_rewritten"]) == (found, rewritable_by(method, expected))
    rewritten = {s["name"] for s in record["sites"] if s["status"] == "rewritten"}
    softmax_left = [n.name for n in model.graph.node if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]
    assert not rewritten & set(softmax_left)
    assert len(softmax_left) == sum(n.op_type == "Softmax" for n in original.graph.node) - len(rewritten)
    assert sum(n.domain == "attnrewrite" for n in model.graph.node) == len(rewritten)
