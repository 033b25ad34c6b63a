"""--recurrent on decoders exported with a KV cache (issue 26, attnrewrite/onnx/recurrent.py): the
recurrent model, prefilled then stepped one token at a time, equals the parallel causal rewrite
of the same model's no-cache export on the whole sequence, at every step."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import decoder_exported, read_record
from decoders import left_padded_mask, logits_error, positions_of
from models import SAMPLE_BERT

import attnrewrite
from attnrewrite import cli, decision, passes
from attnrewrite.errors import NothingRewritten
from attnrewrite.generate import forced_logits, generate
from attnrewrite.onnx.rewrite import PARALLEL_CACHE_NOTE
from attnrewrite.onnx.validate import runs_linear_attention

CONFIGS = {"plain": {}, "window": {"window": 4, "sinks": 1}}
METHODS = ("hedgehog", "linear", "favor")
BATCH, PAST, STEPS = 2, 9, 5  # 14 tokens: keys leave a window of 4 (2W - 1 = 7 kept exactly)
TOLERANCE = 1e-5  # relative to the logits' largest magnitude


def rewritten(export, method: str, config: str, recurrent_form: bool) -> onnx.ModelProto:
    """The export rewritten with ``method`` (validated: the run gate feeds a recurrent model zero states)."""
    return _rewritten(str(export.path), method, config, recurrent_form)


@functools.cache
def _rewritten(path: str, method: str, config: str, recurrent_form: bool) -> onnx.ModelProto:
    return attnrewrite.rewrite(path, method, recurrent=recurrent_form, **CONFIGS[config])


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def full_sequence(spec, batch: int = BATCH, length: int = PAST + STEPS, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(2, spec.vocab, (batch, length)).astype(np.int64)
    mask = left_padded_mask(batch, length)  # row 1 padded at its first 2 positions
    feeds = {"input_ids": ids, "attention_mask": mask}
    if spec.position_ids:
        feeds["position_ids"] = positions_of(mask)
    return feeds


def state_inputs(recurrent_session: ort.InferenceSession) -> list:
    return [i for i in recurrent_session.get_inputs() if i.name.startswith("past_key_values.")]


def zero_states(recurrent_session: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """Zero states, or empty KV caches (every symbolic axis but the batch is a past length)."""
    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    return {
        i.name: np.zeros(
            [batch if axis == 0 else 0 if isinstance(d, str) else d for axis, d in enumerate(i.shape)], dtypes[i.type]
        )
        for i in state_inputs(recurrent_session)
    }


def stepped(recurrent_session: ort.InferenceSession, full: dict[str, np.ndarray], pieces: list[tuple[int, int]]):
    """(logits, states) after each piece (start, end) of the sequence, from zero states."""
    names = [o.name for o in recurrent_session.get_outputs()]
    states, results = zero_states(recurrent_session, full["input_ids"].shape[0]), []
    for start, end in pieces:
        feeds = {"input_ids": full["input_ids"][:, start:end], "attention_mask": full["attention_mask"][:, :end]}
        if "position_ids" in full:
            feeds["position_ids"] = full["position_ids"][:, start:end]
        outputs = dict(zip(names, recurrent_session.run(None, {**feeds, **states})))
        states = {name.replace("present.", "past_key_values.", 1): a for name, a in outputs.items() if name != "logits"}
        results.append((outputs["logits"], states))
    return results


def prefill_then_steps(past: int = PAST, steps: int = STEPS) -> list[tuple[int, int]]:
    return [(0, past), *((t, t + 1) for t in range(past, past + steps))]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prefill_then_decode_equals_the_parallel_rewrite(decoder_exports, name, exporter, method, config):
    assert_steps_equal_the_parallel_rewrite(decoder_exports, name, exporter, method, config)


@pytest.mark.parametrize(("method", "config"), [("hedgehog", "plain"), ("linear", "window"), ("favor", "window")])
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["qwen2", "falcon", "opt"])
def test_other_decoders_step_as_their_parallel_rewrite(decoder_exports, name, exporter, method, config):
    """Qwen2 (biased q/k/v), Falcon (one key/value head), OPT (positions from the mask)."""
    assert_steps_equal_the_parallel_rewrite(decoder_exports, name, exporter, method, config)


def assert_steps_equal_the_parallel_rewrite(decoder_exports, name, exporter, method, config):
    cached = decoder_exported(decoder_exports, name, exporter)
    uncached = decoder_exported(decoder_exports, name, exporter, cache=False)
    full = full_sequence(cached.spec)
    expected = session(rewritten(uncached, method, config, False)).run(["logits"], full)[0]
    scale = np.abs(expected).max()
    recurrent_session = session(rewritten(cached, method, config, True))
    for (start, end), (logits, _) in zip(prefill_then_steps(), stepped(recurrent_session, full, prefill_then_steps())):
        error = logits_error(logits, expected[:, :end], full["attention_mask"][:, :end])
        assert error <= TOLERANCE * scale, (start, end, error)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_the_interface_is_states_of_fixed_size(decoder_exports, exporter):
    cached = decoder_exported(decoder_exports, "llama", exporter)
    model = rewritten(cached, "hedgehog", "window", True)
    inputs = {i.name: i for i in model.graph.input}
    assert not any(name.endswith((".key", ".value")) for name in inputs)
    assert not any(o.name.endswith((".key", ".value")) for o in model.graph.output)
    parts = ["recurrent_state", "conv_state"]  # onnxruntime-genai's layout
    layers = range(cached.spec.layers)
    assert [n for n in inputs if n.startswith("past_key_values.")] == [
        f"past_key_values.{i}.{p}" for i in layers for p in parts
    ]
    assert [o.name for o in model.graph.output][1:] == [f"present.{i}.{p}" for i in layers for p in parts]
    dims = {name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for name, v in inputs.items()}
    batch = dims["input_ids"][0]
    # 4 query heads (2 key/value heads repeated), head dim 8, hedgehog's 16 features: the kernel
    # state with the normaliser as a 9th column
    assert dims["past_key_values.0.recurrent_state"] == [batch, 4, 16, 9]
    # log scale 4, window keys and values 2 x 2 x 7 x 8 (once per key/value head), their keep
    # flags 2 x 7, one sink's key, value (2 x 2 x 8) and flag (2); the position is not stored (the
    # mask gives it)
    assert dims["past_key_values.0.conv_state"] == [batch, 4 + 2 * 112 + 14 + 2 * 16 + 2]
    assert {inputs[f"past_key_values.0.{p}"].type.tensor_type.elem_type for p in parts} == {onnx.TensorProto.FLOAT}
    record = read_record(model)
    assert record["options"]["recurrent"] is True
    note = next(note for note in record["notes"] if note.startswith("recurrent:"))
    assert "kernel_state: recurrent_state[..., 0:9]; log_scale: conv_state[:, 0:4]" in note
    assert "window_keys: conv_state[:, 4:116]" in note
    assert "position: the attention mask's length minus input_ids' length" in note


def test_states_do_not_grow_with_the_context(decoder_exports):
    cached = decoder_exported(decoder_exports, "gpt2", "dynamo")
    recurrent_session = session(rewritten(cached, "favor", "window", True))
    full = full_sequence(cached.spec, length=40)
    shapes = {
        past: [{n: a.shape for n, a in states.items()} for _, states in stepped(recurrent_session, full, pieces)]
        for past, pieces in ((4, prefill_then_steps(4, 3)), (30, prefill_then_steps(30, 3)))
    }
    assert all(s == shapes[4][0] for s in shapes[4] + shapes[30])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_equals_greedy_on_the_parallel_rewrite(decoder_exports, tmp_path, name):
    cached = decoder_exported(decoder_exports, name, "dynamo")
    uncached = decoder_exported(decoder_exports, name, "dynamo", cache=False)
    paths = {}
    for form, export in (("recurrent", cached), ("parallel", uncached)):
        paths[form] = tmp_path / f"{form}.onnx"
        onnx.save(rewritten(export, "hedgehog", "window", form == "recurrent"), paths[form])
    prompts = [[5, 17, 3, 44, 9, 12, 30], [8, 21, 60]]
    tokens = generate(paths["recurrent"], prompts, 8).tokens
    np.testing.assert_array_equal(tokens, generate(paths["parallel"], prompts, 8).tokens)


@pytest.mark.parametrize("method", ["hydra", "linformer", "lsh"])
def test_methods_without_a_recurrence_are_refused_with_the_reason(decoder_exports, method):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    with pytest.warns(NothingRewritten):
        model = attnrewrite.rewrite(cached.load(), method, recurrent=True)
    record = read_record(model)
    assert [site["reason"] for site in record["sites"]] == [passes.get_pass(method).NO_RECURRENCE] * 2


def test_recurrent_refuses_an_encoder():
    with pytest.warns(NothingRewritten):
        model = attnrewrite.rewrite(str(SAMPLE_BERT), "hedgehog", recurrent=True)
    record = read_record(model)
    assert {site["reason"] for site in record["sites"]} == {decision.NO_CACHE}


# every causal method (the window's hybrid among them) on one export, two of them on another
PARALLEL_OVER_THE_CACHE = [
    *(("llama", "dynamo", m, "plain") for m in ("linear", "hedgehog", "favor", "aft", "lsh", "efficient", "hydra")),
    ("llama", "dynamo", "hedgehog", "window"),
    ("gpt2", "legacy", "hedgehog", "plain"),
    ("gpt2", "legacy", "hedgehog", "window"),
]


@pytest.mark.parametrize(("name", "exporter", "method", "config"), PARALLEL_OVER_THE_CACHE)
def test_without_recurrent_the_cache_stays_and_each_call_equals_the_no_cache_rewrite(
    decoder_exports, name, exporter, method, config
):
    """The parallel rewrite of a KV-cache decoder keeps its interface: prefilled, then stepped a
    token at a time through a left-padded batch, its logits are those of the parallel rewrite of
    the no-cache export on the whole sequence (each new query at its position among the keys)."""
    cached = decoder_exported(decoder_exports, name, exporter)
    uncached = decoder_exported(decoder_exports, name, exporter, cache=False)
    full = full_sequence(cached.spec)
    expected = session(rewritten(uncached, method, config, False)).run(["logits"], full)[0]
    model = rewritten(cached, method, config, False)
    assert [i.name for i in model.graph.input] == [i.name for i in cached.load().graph.input]
    record = read_record(model)
    assert [s["status"] for s in record["sites"]] == ["rewritten"] * 2 and PARALLEL_CACHE_NOTE in record["notes"]
    actual = forced_logits(session(model), "parallel", full["input_ids"], full["attention_mask"], prefill=PAST)
    assert logits_error(actual, expected, full["attention_mask"]) <= TOLERANCE * np.abs(expected).max()
    # calls of several new tokens after a past (a chunked prompt) place each at its position too
    pieces = [(0, 5), (5, 9), (9, 10), (10, 13), (13, PAST + STEPS)]
    for (start, end), (logits, _) in zip(pieces, stepped(session(model), full, pieces)):
        error = logits_error(logits, expected[:, :end], full["attention_mask"][:, :end])
        assert error <= TOLERANCE * np.abs(expected).max(), (start, end, error)


@pytest.mark.skipif(not runs_linear_attention(), reason="this onnxruntime has no com.microsoft.LinearAttention")
def test_standard_ops_keeps_the_steps_to_standard_operators(decoder_exports, tmp_path, capsys):
    """By default a step updates the kernel state with com.microsoft.LinearAttention;
    --standard-ops writes the same model in standard operators only, with the same logits."""
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    outputs = {}
    for flags in ([], ["--standard-ops"]):
        out = tmp_path / f"out{len(flags)}.onnx"
        assert cli.main([str(cached.path), "--to", "hedgehog", "--recurrent", *flags, "-o", str(out)]) == 0
        model = onnx.load(out)
        domains = {o.domain for o in model.opset_import} | {o.domain for f in model.functions for o in f.opset_import}
        assert ("com.microsoft" in domains) is not bool(flags), flags
        full = full_sequence(cached.spec)
        outputs[bool(flags)] = [logits for logits, _ in stepped(session(model), full, prefill_then_steps())]
    capsys.readouterr()
    for contrib, standard in zip(outputs[False], outputs[True]):
        np.testing.assert_allclose(contrib, standard, rtol=0, atol=TOLERANCE * np.abs(standard).max())


def test_without_the_operator_the_steps_keep_to_standard_operators(decoder_exports, monkeypatch):
    """An onnxruntime that does not run com.microsoft.LinearAttention gets standard operators
    without being asked."""
    monkeypatch.setattr("attnrewrite.onnx.rewrite.runs_linear_attention", lambda: False)
    model = attnrewrite.rewrite(
        str(decoder_exported(decoder_exports, "llama", "legacy").path), "linear", recurrent=True
    )
    assert "com.microsoft" not in {o.domain for o in model.opset_import}


def test_cli_writes_a_model_that_takes_states(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    out = tmp_path / "out.onnx"
    assert cli.main([str(cached.path), "--to", "hedgehog", "--recurrent", "-o", str(out)]) == 0
    assert "2 of 2 attention sites replaced by hedgehog" in capsys.readouterr().out
    names = [i.name for i in onnx.load(out).graph.input]
    assert names == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{part}" for i in range(2) for part in ("recurrent_state", "conv_state")
    ]


def test_a_cache_read_by_anything_else_refuses_the_model_in_words(decoder_exports):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    model = cached.load()
    model.graph.node.append(onnx.helper.make_node("ReduceSum", ["past_key_values.0.key"], ["cache_sum"], name="extra"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("cache_sum", onnx.TensorProto.FLOAT, None))
    with pytest.warns(NothingRewritten):
        rewritten_model = attnrewrite.rewrite(model, "hedgehog", recurrent=True)
    reason = (
        "the KV cache 'past_key_values.0.key' is also read by ReduceSum node 'extra', which a recurrent model, "
        "keeping no past keys, cannot feed"
    )
    assert [site["reason"] for site in read_record(rewritten_model)["sites"]] == [reason] * 2
