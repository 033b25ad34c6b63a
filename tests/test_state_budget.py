"""--state-budget (issue 68, attnrewrite.state_budget): the widest window (linear, hedgehog,
favor) or the most recent keys (streaming) whose recurrent state fits a size per sequence, said
and recorded; a budget that cannot be met is refused in one line. The numbers are counted by
hand as in tests/test_state_bytes.py: tests/decoders.py's llama, 2 layers, 4 query heads over 2
key/value heads of head_dim 8, float32, 256 bytes of KV cache per token."""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import decoder_exported, read_record

import attnrewrite
from attnrewrite import cli, decision
from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes.recurrent import rewrite_memory
from attnrewrite.state_budget import Budget, choose

KV_PER_TOKEN = 256


def hedgehog_state(window: int) -> int:
    """tests/test_state_bytes.py's hedgehog_window over both layers: 2 x (2328 + 272 W)."""
    return 4656 + 544 * window


@pytest.fixture
def llama_sites(decoder_exports):
    cached = decoder_exported(decoder_exports, "llama", "dynamo")
    plan = decision.RunPlan.of("hedgehog", recurrent=True)
    sites = [s for s in attnrewrite.find_sites(str(cached.path)) if decision.refusal(s, plan) is None]
    assert len(sites) == 2
    return cached, sites


@pytest.mark.parametrize(
    "text, expected",
    [("16MB", 16 * 10**6), ("1.5GiB", 3 * 2**29), ("512kB", 512000), ("322tok", 322 * KV_PER_TOKEN), ("900", 900)],
)
def test_a_budget_reads_bytes_or_the_kv_cache_of_some_tokens(text, expected):
    assert Budget.parse(text).bytes_for(KV_PER_TOKEN) == expected


@pytest.mark.parametrize("text", ["16XB", "-3MB", "0tok", "MB", "1e6"])
def test_a_budget_that_is_not_a_size_is_refused_in_one_line(text):
    with pytest.raises(AttnRewriteError) as error:
        Budget.parse(text)
    assert str(error.value) == (
        f"--state-budget {text!r}: not a size; give bytes (16MB, 512kB, 1.5GiB) "
        "or the KV cache of a number of tokens (322tok)"
    )


def test_the_widest_window_that_fits_is_chosen(llama_sites):
    _, sites = llama_sites
    choice = choose("hedgehog", {}, sites, Budget.parse("40tok"))  # 10240 bytes
    assert choice.options == {"window": 10} and choice.chosen == ("window",)
    assert choice.memory.state_bytes == hedgehog_state(10) <= 40 * KV_PER_TOKEN < hedgehog_state(11)
    assert choice.describe() == (
        "state budget 40tok (10.2 kB): chose window=10, a state of 10.1 kB per sequence (the KV cache of 39 tokens)"
    )
    sinks = choose("hedgehog", {"sinks": "3"}, sites, Budget.parse("40tok"))  # a given setting stays
    assert sinks.options == {"sinks": "3", "window": 9}  # two more sink rows per layer and head: 544 bytes


def test_streaming_keeps_the_most_recent_keys_that_fit(llama_sites):
    _, sites = llama_sites
    choice = choose("streaming", {}, sites, Budget.parse("40tok"))
    recent = choice.options["recent"]
    wider = decision.RunPlan.of("streaming", recurrent=True, recent=recent + 1)
    larger = rewrite_memory(wider.method, wider.options, sites)
    assert choice.memory.state_bytes <= 40 * KV_PER_TOKEN < larger.state_bytes
    assert 30 <= recent <= 36  # the sinks' 4 tokens and the keep flags out of 40 tokens of cache


def test_a_budget_it_cannot_meet_is_refused_with_the_least_it_takes(llama_sites):
    _, sites = llama_sites
    with pytest.raises(AttnRewriteError) as error:
        choose("hedgehog", {}, sites, Budget.parse("20tok"))
    assert str(error.value) == (
        "--state-budget 20tok (5.1 kB): hedgehog's smallest state here is 5.2 kB "
        "(window=1: the kernel state alone, whatever the window)"
    )
    with pytest.raises(AttnRewriteError) as error:
        choose("hydra", {}, sites, Budget.parse("20tok"))
    assert str(error.value) == (
        "--state-budget: hydra has no setting that sizes its state (methods with one: favor, hedgehog, linear, streaming)"
    )
    with pytest.raises(AttnRewriteError) as error:
        choose("hedgehog", {"window": "4"}, sites, Budget.parse("20tok"))
    assert str(error.value) == "--state-budget chooses window: give one or the other (-O window=4 was given)"


def test_the_cli_says_what_it_chose_and_the_model_keeps_it(llama_sites, capsys, tmp_path):
    cached, _ = llama_sites
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    args = [str(cached.path), "--to", "hedgehog", "--recurrent", "--state-budget", "40tok"]
    assert cli.main([*args, "-o", str(out), "--report", str(report)]) == 0
    said = "state budget 40tok (10.2 kB): chose window=10, a state of 10.1 kB per sequence (the KV cache of 39 tokens)"
    assert f"note: {said}" in capsys.readouterr().out.splitlines()
    record = read_record(onnx.load(out))
    assert record["options"]["window"] == 10 and said in record["notes"]
    assert record["state_memory"]["state_bytes"] == hedgehog_state(10)
    assert json.loads(report.read_text())["state_memory"]["state_bytes"] == hedgehog_state(10)
    assert cli.main([str(cached.path), "--list", *args[1:]]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[-2] == said and listed[-1].startswith("state: 10.1 kB per sequence (10096 bytes over 2 layers)")


def test_a_sparse_cache_given_beside_a_budget_is_counted_and_the_window_chosen_around_it(llama_sites, capsys, tmp_path):
    """sparse=4 needs a window, which the budget chooses: the cache's 2 x 2 x 4 pairs of 8 + 8
    floats and a keep flag (1088 bytes) come out of the window's share, so window=8, not 10."""
    cached, _ = llama_sites
    args = [str(cached.path), "--to", "hedgehog", "-O", "sparse=4", "--recurrent", "--state-budget", "40tok"]
    assert cli.main([*args, "-o", str(tmp_path / "out.onnx")]) == 0
    said = "state budget 40tok (10.2 kB): chose window=8, a state of 10.1 kB per sequence (the KV cache of 39 tokens)"
    assert f"note: {said}" in capsys.readouterr().out.splitlines()
    record = read_record(onnx.load(tmp_path / "out.onnx"))
    assert record["options"]["window"] == 8 and record["options"]["sparse"] == 4
    assert record["state_memory"]["state_bytes"] == hedgehog_state(8) + 1088
    assert cli.main([str(cached.path), "--list", *args[1:]]) == 0
    assert said in capsys.readouterr().out.splitlines()


def test_a_budget_without_a_recurrent_state_is_refused(llama_sites, capsys, tmp_path):
    cached, _ = llama_sites
    args = [str(cached.path), "--to", "hedgehog", "--state-budget", "40tok", "-o", str(tmp_path / "out.onnx")]
    assert cli.main(args) == 2
    assert (
        capsys.readouterr().err.strip()
        == "attnrewrite: error: --state-budget sizes a recurrent state; give --recurrent too"
    )
    assert cli.main([*args, "--recurrent", "--state-budget", "16XB"]) == 2
    assert "not a size" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()


def test_the_api_takes_the_budget_too(llama_sites):
    cached, _ = llama_sites
    model = attnrewrite.rewrite(str(cached.path), to="streaming", recurrent=True, state_budget="40tok")
    record = read_record(model)
    assert record["state_memory"]["state_bytes"] <= 40 * KV_PER_TOKEN
    assert any(note.startswith("state budget 40tok (10.2 kB): chose recent=") for note in record["notes"])
    with pytest.raises(AttnRewriteError, match="^state_budget sizes a recurrent state; give recurrent=True too$"):
        attnrewrite.rewrite(str(cached.path), to="streaming", state_budget="40tok")
