"""attnrewrite.generate and ``attnrewrite generate``: decoding with a KV cache (or any carried
state) gives the tokens that re-running the whole sequence gives, for a left-padded batch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import decoder_exported
from decoders import positions_of
from onnx import TensorProto, helper

from attnrewrite import generate
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21]]  # of different lengths: row 1 is left padded
STEPS = 8
# gpt2 and llama with both exporters; opt (positions from the mask, no position_ids input) once
DECODERS = [("gpt2", "legacy"), ("gpt2", "dynamo"), ("llama", "legacy"), ("llama", "dynamo"), ("opt", "legacy")]


def left_padded_batch(prompts, pad=0):
    longest = max(map(len, prompts))
    ids = np.array([[pad] * (longest - len(p)) + p for p in prompts], np.int64)
    mask = np.array([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], np.int64)
    return ids, mask


def greedy_the_slow_way(path, prompts, steps):
    """The whole sequence through the no-cache export at every step; the argmax of its last position."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    takes_positions = "position_ids" in {i.name for i in session.get_inputs()}
    ids, mask = left_padded_batch(prompts)
    chosen = []
    for _ in range(steps):
        feeds = {"input_ids": ids, "attention_mask": mask}
        if takes_positions:
            feeds["position_ids"] = positions_of(mask)
        token = session.run(["logits"], feeds)[0][:, -1].argmax(-1)
        chosen.append(token)
        ids = np.concatenate([ids, token[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], axis=1)
    return np.stack(chosen, axis=1)


@pytest.fixture(scope="module")
def llama(decoder_exports):
    return decoder_exported(decoder_exports, "llama", "legacy").path


@pytest.mark.parametrize("name,exporter", DECODERS)
def test_greedy_with_the_cache_equals_rerunning_the_whole_sequence(decoder_exports, name, exporter):
    cached = decoder_exported(decoder_exports, name, exporter, cache=True)
    uncached = decoder_exported(decoder_exports, name, exporter, cache=False)
    expected = greedy_the_slow_way(uncached.path, PROMPTS, STEPS)
    result = generate(cached.path, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)
    # the same from a 2-D batch with its mask, and from the no-cache export (run the slow way)
    ids, mask = left_padded_batch(PROMPTS, pad=3)
    np.testing.assert_array_equal(generate(cached.path, ids, STEPS, attention_mask=mask).tokens, expected)
    np.testing.assert_array_equal(generate(uncached.path, PROMPTS, STEPS).tokens, expected)
    kv_heads, layers = cached.spec.kv_heads, cached.spec.layers
    cache_length = len(PROMPTS[0]) + STEPS - 1  # the last token chosen is never fed
    assert result.state_bytes == 2 * layers * len(PROMPTS) * kv_heads * cache_length * cached.spec.head_dim * 4
    assert result.prefill_ms > 0 and len(result.step_ms) == STEPS - 1


@pytest.mark.parametrize("cache", [True, False], ids=["kv-cache", "no-cache"])
def test_right_padded_prompts_give_the_left_padded_tokens(decoder_exports, cache):
    """Padding on the right (onnxruntime-genai's way) leaves the pads between a row's prompt and
    its new tokens; the attention mask and positions keep them out, so the tokens are the same."""
    export = decoder_exported(decoder_exports, "llama", "legacy", cache=cache)
    left = generate(export.path, PROMPTS, STEPS).tokens
    right = generate(export.path, PROMPTS, STEPS, padding="right").tokens
    np.testing.assert_array_equal(right, left)


def test_llama_does_not_just_repeat_its_prompt(llama):
    """gpt2's random tied embeddings make it repeat its last token: llama's tokens carry the test."""
    tokens = generate(llama, PROMPTS, STEPS).tokens
    assert all(len(set(row)) > 2 for row in tokens.tolist())


def test_a_padded_row_continues_as_it_would_alone(llama):
    batch = generate(llama, PROMPTS, STEPS).tokens
    for row, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(generate(llama, [prompt], STEPS).tokens[0], batch[row])


def test_stop_tokens_stop_a_row_and_then_every_row(llama):
    free = generate(llama, PROMPTS, STEPS).tokens
    stop = free[0, 2]
    assert stop not in free[0, :2] and stop not in free[1] and free[1, 0] not in free[0, :3]
    stopped = generate(llama, PROMPTS, STEPS, eos_token_id=int(stop), pad_token_id=0).tokens
    np.testing.assert_array_equal(stopped[0], [*free[0, :3], 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(stopped[1], free[1])
    both = generate(llama, PROMPTS, STEPS, eos_token_id=[int(stop), int(free[1, 0])], pad_token_id=0).tokens
    np.testing.assert_array_equal(both, [free[0, :3], [free[1, 0], 0, 0]])  # ends when the last row stops
    # without pad_token_id, a stopped row continues with the (first) stop token
    np.testing.assert_array_equal(generate(llama, PROMPTS, 4, eos_token_id=int(stop)).tokens[0], [*free[0, :3], stop])


def test_sampling_is_seeded_and_top_1_is_greedy(decoder_exports, llama):
    def sampled(path, **kwargs):
        return generate(path, PROMPTS, STEPS, do_sample=True, **kwargs).tokens

    first = sampled(llama, seed=1)
    np.testing.assert_array_equal(sampled(llama, seed=1), first)
    assert (sampled(llama, seed=2) != first).any()
    np.testing.assert_array_equal(sampled(llama, top_k=1, temperature=0.5), generate(llama, PROMPTS, STEPS).tokens)
    assert not np.array_equal(sampled(llama, seed=1, top_k=3), first)
    # the same draws from the same distribution: the cache changes nothing
    uncached = decoder_exported(decoder_exports, "llama", "legacy", cache=False).path
    np.testing.assert_array_equal(sampled(uncached, seed=1), first)


def test_a_session_is_taken_as_it_is(llama):
    session = ort.InferenceSession(str(llama), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(generate(session, PROMPTS, 3).tokens, generate(llama, PROMPTS, 3).tokens)
    with pytest.raises(AttnRewriteError, match=r"^provider 'cuda': the session given runs on CPUExecutionProvider$"):
        generate(session, PROMPTS, 3, provider="cuda")


# --- a recurrent state: fixed-size values and a counter, not a growing cache --------------------

VOCAB = 50


def recurrent_model(path, merged=False):
    """Carries ``recurrent_state`` float [batch, 2, 3] (+1 per call) and ``count`` int64 [batch]
    (+ the tokens fed); its logits are one-hot at (count + state[:, 0, 0]) mod VOCAB, so the
    tokens it makes show that both started at zero and were fed back. ``merged``: it also takes
    optimum's use_cache_branch, adding 10 to the token where it is true."""
    state_in, count_in = "past_key_values.0.recurrent_state", "past_key_values.0.count"
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
        helper.make_tensor_value_info(state_in, TensorProto.FLOAT, ["batch", 2, 3]),
        helper.make_tensor_value_info(count_in, TensorProto.INT64, ["batch"]),
    ]
    branch = [
        helper.make_node("Cast", ["use_cache_branch"], ["branch"], to=TensorProto.INT64),
        helper.make_node("Mul", ["branch", "ten"], ["branch_ten"]),
        helper.make_node("Add", ["sum", "branch_ten"], ["merged_sum"]),
    ]
    if merged:
        inputs.append(helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]))
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one_i"], ["fed"], axis=0),
        helper.make_node("Add", [count_in, "fed"], ["present.0.count"]),
        helper.make_node("Add", [state_in, "one_f"], ["present.0.recurrent_state"]),
        helper.make_node("Gather", ["present.0.recurrent_state", "zero_i"], ["row"], axis=1),
        helper.make_node("Gather", ["row", "zero_i"], ["corner"], axis=1),
        helper.make_node("Cast", ["corner"], ["corner_i"], to=TensorProto.INT64),
        helper.make_node("Add", ["present.0.count", "corner_i"], ["sum"]),
        *(branch if merged else []),
        helper.make_node("Mod", ["merged_sum" if merged else "sum", "vocab"], ["token"]),
        helper.make_node("OneHot", ["token", "vocab", "off_on"], ["scores"], axis=-1),
        helper.make_node("Unsqueeze", ["scores", "one_axis"], ["logits"]),
    ]
    constants = [
        helper.make_tensor("one_i", TensorProto.INT64, [], [1]),
        helper.make_tensor("zero_i", TensorProto.INT64, [], [0]),
        helper.make_tensor("one_f", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("vocab", TensorProto.INT64, [], [VOCAB]),
        helper.make_tensor("off_on", TensorProto.FLOAT, [2], [0.0, 1.0]),
        helper.make_tensor("one_axis", TensorProto.INT64, [1], [1]),
        helper.make_tensor("ten", TensorProto.INT64, [1], [10]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, VOCAB]),
        helper.make_tensor_value_info("present.0.recurrent_state", TensorProto.FLOAT, ["batch", 2, 3]),
        helper.make_tensor_value_info("present.0.count", TensorProto.INT64, ["batch"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "recurrent", inputs, outputs, constants),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def test_a_recurrent_state_starts_at_zero_of_its_declared_shape(tmp_path):
    result = generate(recurrent_model(tmp_path / "recurrent.onnx"), [[1, 2, 3], [4, 5, 6]], 4)
    # after call t: count = 3 + t, state = t + 1
    np.testing.assert_array_equal(result.tokens, [[4, 6, 8, 10]] * 2)
    assert result.state_bytes == 2 * (2 * 3 * 4 + 8)


def test_a_merged_decoder_is_told_which_branch_to_take(tmp_path):
    """optimum's merged decoder: use_cache_branch false on the prompt's call, true after."""
    result = generate(recurrent_model(tmp_path / "merged.onnx", merged=True), [[1, 2, 3]], 4)
    np.testing.assert_array_equal(result.tokens, [[4, 16, 18, 20]])


# --- refusals ----------------------------------------------------------------------------------


def signature_model(path, inputs, outputs):
    """Identity from the first input to every output: only the names and types matter."""
    nodes = [helper.make_node("Identity", [inputs[0]], [name]) for name in outputs]
    graph = helper.make_graph(
        nodes,
        "signature",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "sequence"]) for name in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "sequence"]) for name in outputs],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize(
    "inputs,outputs,message",
    [
        (["x"], ["logits"], " has no input named input_ids, so it is not a decoder generate() can run (inputs: x)"),
        (["input_ids"], ["y"], " has no output named logits, so it is not a decoder generate() can run (outputs: y)"),
        (
            ["input_ids", "past_key_values.0.key"],
            ["logits", "present.0.value"],
            ": the input past_key_values.0.key has no output present.0.key to be fed from",
        ),
        (
            ["input_ids"],
            ["logits", "present.0.value"],
            ": the output present.0.value has no input past_key_values.0.value to be fed back into",
        ),
        (
            ["input_ids", "token_type_ids"],
            ["logits"],
            ": generate() cannot feed the input 'token_type_ids' (it feeds input_ids, attention_mask, "
            "position_ids, use_cache_branch and past_key_values.* from present.*)",
        ),
    ],
)
def test_a_model_that_is_not_a_decoder_is_refused(tmp_path, inputs, outputs, message):
    path = signature_model(tmp_path / "m.onnx", inputs, outputs)
    with pytest.raises(AttnRewriteError) as error:
        generate(path, [[1, 2]], 2)
    assert str(error.value) == f"{path}{message}"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [0, 1]]},
            "prompts of different lengths take no attention_mask: they are padded here",
        ),
        (
            {"input_ids": [[1, 2], [3, 4]], "attention_mask": [[1, 1], [1, 0]]},
            "row 1 of the prompts ends in padding (attention_mask 0): pad on the left, so that every row's last token is a real one",
        ),
        ({"input_ids": np.ones((1, 2))}, "input_ids must be integer token ids [batch, length], got float64 [1, 2]"),
        ({"input_ids": [[1, 2], [1.5]]}, "input_ids: prompt 1 is not a list of token ids"),
        ({"input_ids": [[1, 2], []]}, "row 1 of the prompts has no token"),
        ({"do_sample": True, "temperature": 0.0}, "temperature must be > 0 to sample, got 0.0"),
        ({"do_sample": True, "top_k": 0}, "top_k must be a positive integer, got 0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
        ({"provider": "tpu"}, "provider must be one of cpu, cuda, got 'tpu'"),
        ({"padding": "middle"}, "padding must be one of left, right, got 'middle'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(llama, kwargs, message):
    arguments = {"input_ids": PROMPTS, "max_new_tokens": 2, **kwargs}
    with pytest.raises(AttnRewriteError) as error:
        generate(llama, **arguments)
    assert str(error.value) == message


# --- the command line -----------------------------------------------------------------------------


@pytest.fixture
def tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 100)}}  # the decoders' vocabulary of 100
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def words(tokens) -> str:
    return " ".join(f"w{t}" for t in tokens)


def test_the_command_prints_both_models_texts(decoder_exports, llama, tokenizer, capsys):
    uncached = decoder_exported(decoder_exports, "llama", "legacy", cache=False).path
    expected = generate(llama, PROMPTS, 5).tokens
    prompts = [words(p) for p in PROMPTS]
    argv = ["generate", llama, uncached, "--tokenizer", tokenizer, "--max-new-tokens", "5"]
    code = main([str(a) for a in argv] + [a for p in prompts for a in ("--prompt", p)])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    width = max(len(str(llama)), len(str(uncached)))
    lines = out.splitlines()
    for row, prompt in enumerate(prompts):
        at = lines.index(f"prompt {row + 1}: {prompt}")
        assert lines[at + 1] == f"  {str(llama):<{width}}  {words(expected[row])}"
        assert lines[at + 2] == f"  {str(uncached):<{width}}  {words(expected[row])}"
    assert (
        lines[-2].startswith(f"{str(llama):<{width}}  prefill ") and " ms per token (median of 4), state " in lines[-2]
    )
    assert lines[-1].startswith(f"{str(uncached):<{width}}  prefill ") and lines[-1].endswith(", state 0 bytes")


def test_the_command_stops_a_text_at_a_stop_token(llama, tokenizer, capsys):
    free = generate(llama, PROMPTS, 5).tokens
    argv = ["generate", llama, "--tokenizer", tokenizer, "--prompt", words(PROMPTS[0]), "--stop", f"w{free[0, 1]}"]
    assert main([str(a) for a in argv]) == 0
    assert f"  {llama}  {words(free[0, :2])}\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--top-k", "3"], "--top-k is a setting of sampling; give --sample too"),
        (["--stop", "nope"], "--stop 'nope' is not a token of {tokenizer}"),
        (["--prompt", "  "], "--prompt '  ' makes no tokens"),
    ],
)
def test_the_command_refuses_in_one_line(llama, tokenizer, capsys, extra, message):
    argv = ["generate", llama, "--tokenizer", tokenizer, "--prompt", "w1", *extra]
    assert main([str(a) for a in argv]) == 2
    assert capsys.readouterr().err == f"attnrewrite: error: {message.format(tokenizer=tokenizer)}\n"


def test_the_command_refuses_a_model_that_is_no_file_in_one_line(tokenizer, tmp_path, capsys):
    (tmp_path / "empty.onnx").write_bytes(b"")
    for model, why in ((tmp_path, "is a directory, not an ONNX file"), (tmp_path / "empty.onnx", "is empty")):
        assert main(["generate", str(model), "--tokenizer", str(tokenizer), "--prompt", "w1"]) == 2
        assert capsys.readouterr().err == f"attnrewrite: error: {model}: {why}\n"


def test_the_command_without_the_tokenizers_library(llama, tokenizer, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # import tokenizers -> ImportError
    assert main(["generate", str(llama), "--tokenizer", str(tokenizer), "--prompt", "w1"]) == 2
    assert capsys.readouterr().err == (
        "attnrewrite: error: generate needs the tokenizers library: pip install 'attnrewrite[text]'\n"
    )
