"""Loading a rewritten model prints nothing at onnxruntime's warning level: no initializer that
no node reads (onnxruntime inlines the model's functions, turns their Constants into
initializers and warns of each one unread; attnrewrite/onnx/prune.py takes such nodes out).
Every method's parallel model (an encoder, a decoder), every recurrence's recurrent model."""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import decoder_exported
from models import SAMPLE_BERT

import attnrewrite
from attnrewrite import passes
from attnrewrite.errors import NothingRewritten
from attnrewrite.generate import forced_logits
from attnrewrite.onnx import rewrite as onnx_rewrite
from attnrewrite.onnx.prune import prune_unread_nodes

WARNING = 2  # onnxruntime's log severity: 0 verbose, 1 info, 2 warning, 3 error
RECURRENT = [("hedgehog", {}), ("hedgehog", {"window": 4}), ("linear", {"window": 4, "sinks": 1})]
RECURRENT += [("favor", {}), ("favor", {"window": 4}), ("aft", {})]


def load_printed(model, capfd) -> str:
    """What onnxruntime printed while loading ``model``, at its warning level."""
    options = ort.SessionOptions()
    options.log_severity_level = WARNING
    capfd.readouterr()
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    out, err = capfd.readouterr()
    return out + err


def decoder(exports, cache: bool) -> str:
    return str(decoder_exported(exports, "llama", "dynamo", cache=cache).path)


@pytest.mark.parametrize("method", passes.PASSES)
def test_every_methods_parallel_model_loads_silently(method, decoder_exports, capfd):
    for source in (str(SAMPLE_BERT), decoder(decoder_exports, cache=False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NothingRewritten)  # a method that refuses a decoder's sites
            model = attnrewrite.rewrite(source, method)
        assert load_printed(model, capfd) == "", source


@pytest.mark.parametrize(("method", "options"), RECURRENT, ids=lambda x: x if isinstance(x, str) else str(x))
def test_every_recurrent_model_loads_silently(method, options, decoder_exports, capfd):
    model = attnrewrite.rewrite(decoder(decoder_exports, cache=True), method, recurrent=True, **options)
    assert load_printed(model, capfd) == ""


def test_pruning_changes_no_output_and_leaves_nothing_unread(decoder_exports, monkeypatch):
    """The recurrent model's logits, prefilled then stepped (both branches of its If), are the
    unpruned model's bit for bit; a second pruning finds nothing left."""
    source = decoder(decoder_exports, cache=True)
    pruned = attnrewrite.rewrite(source, "hedgehog", recurrent=True, window=4)
    monkeypatch.setattr(onnx_rewrite, "prune_unread_nodes", lambda model: 0)
    unpruned = attnrewrite.rewrite(source, "hedgehog", recurrent=True, window=4)
    assert len(pruned.SerializeToString()) < len(unpruned.SerializeToString())
    ids = np.random.default_rng(0).integers(3, 100, (2, 12))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    logits = [
        forced_logits(ort.InferenceSession(m.SerializeToString()), label, ids, mask, prefill=5)
        for m, label in ((pruned, "pruned"), (unpruned, "unpruned"))
    ]
    np.testing.assert_array_equal(*logits)
    assert prune_unread_nodes(ir.from_proto(pruned)) == 0
