"""A recurrent rewrite states its state's bytes per sequence beside the KV cache it replaces
(issue 68, passes.recurrent.rewrite_memory): in --list, the record, the report and check. The
expected numbers are counted here by hand from tests/decoders.py's configs: 2 layers, 4 query
heads of head_dim 8, float32; llama 2 key/value heads, gpt2 4."""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import decoder_exported, read_record
from decoders import HEAD_DIM, HEADS, LAYERS

import attnrewrite
from attnrewrite import cli, decision
from attnrewrite.passes.recurrent import kv_cache_bytes_per_token, rewrite_memory, sized_bytes
from attnrewrite.record import state_memory_line
from attnrewrite.site import AttentionSite, KvCache, MaskKind

F32 = 4
WINDOW, SINKS = 4, 1  # sinks: the default
KEPT = 2 * WINDOW - 1  # the window keys a state keeps


def kv_per_token(kv_heads: int) -> int:
    """Keys and values of every layer, one token."""
    return LAYERS * kv_heads * 2 * HEAD_DIM * F32


def kernel_state(features: int) -> int:
    return HEADS * features * (HEAD_DIM + 1) * F32  # the sums with the normaliser column


def hedgehog_window(kv_heads: int) -> int:
    """One layer of hedgehog window=4: its 2 x head_dim features, the log scale, the window and
    the sink (keys and values once per key/value head at grouped heads), the position."""
    held = kv_heads if kv_heads < HEADS else HEADS
    window = held * KEPT * (2 * HEAD_DIM + 1) * F32
    sinks = held * SINKS * (2 * HEAD_DIM + 1) * F32
    return kernel_state(2 * HEAD_DIM) + HEADS * F32 + window + sinks + 8


FAVOR_FEATURES = 17  # round(8 ln 8)
# (method, options) -> one layer's state bytes, by key/value heads
STATES = {
    ("hedgehog", "window=4"): hedgehog_window,
    ("linear", ""): lambda kv_heads: kernel_state(HEAD_DIM),
    ("favor", ""): lambda kv_heads: kernel_state(FAVOR_FEATURES) + HEADS * F32,  # with its log scale
}
KV_HEADS = {"llama": 2, "gpt2": 4}


def options_of(text: str) -> dict:
    return dict(pair.split("=") for pair in text.split(",") if pair)


@pytest.mark.parametrize("name", KV_HEADS)
@pytest.mark.parametrize("method, options", STATES)
def test_the_state_and_the_cache_it_buys_count_every_byte(decoder_exports, name, method, options):
    cached = decoder_exported(decoder_exports, name, "dynamo")
    plan = decision.RunPlan.of(method, recurrent=True, **options_of(options))
    sites = [s for s in attnrewrite.find_sites(str(cached.path)) if decision.refusal(s, plan) is None]
    memory = rewrite_memory(plan.method, plan.options, sites)
    kv_heads = KV_HEADS[name]
    state = LAYERS * STATES[method, options](kv_heads)
    assert (memory.layers, memory.state_bytes, memory.kv_bytes_per_token) == (LAYERS, state, kv_per_token(kv_heads))
    assert memory.kv_tokens_equivalent == state // kv_per_token(kv_heads)
    assert memory.unknown == ()


def test_the_numbers_of_hedgehog_window_4_on_llama():
    # 2 x (2304 kernel state + 16 log scale + 448 + 448 + 56 window + 64 + 64 + 8 sink + 8 position)
    assert LAYERS * hedgehog_window(2) == 6832 and kv_per_token(2) == 256


def test_a_size_the_site_does_not_know_is_said_not_guessed():
    site = AttentionSite(
        "s",
        mask=MaskKind.CAUSAL,
        rank=4,
        num_heads=4,
        head_dim=None,
        value_dim=8,
        kv_cache=KvCache("k", "v", None, None),
    )
    plan = decision.RunPlan.of("linear", recurrent=True)
    memory = rewrite_memory(plan.method, plan.options, [site])
    assert (memory.state_bytes, memory.kv_bytes_per_token, memory.kv_tokens_equivalent) == (None, None, None)
    assert memory.unknown == (
        "s's state: the axes F not known",
        "s's KV cache: key/value heads, head_dim not known",
    )
    assert state_memory_line(memory.as_dict()) == (
        "state: not known, the KV cache's bytes per token not known "
        "(s's state: the axes F not known; s's KV cache: key/value heads, head_dim not known)"
    )
    assert sized_bytes([], site) == 0 and kv_cache_bytes_per_token(AttentionSite("t")) == "no KV cache"


LLAMA_LINE = "state: 6.8 kB per sequence (6832 bytes over 2 layers), the KV cache of 26 tokens (256 bytes per token)"


def test_list_states_the_bytes_of_the_methods_state(decoder_exports, capsys, tmp_path):
    cached = decoder_exported(decoder_exports, "llama", "dynamo")
    report = tmp_path / "list.json"
    args = [str(cached.path), "--list", "--to", "hedgehog", "-O", "window=4", "--recurrent", "--report", str(report)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["2 attention sites, 2 rewritable", LLAMA_LINE]
    assert json.loads(report.read_text())["state_memory"]["state_bytes"] == 6832
    assert cli.main([str(cached.path), "--list", "--to", "hydra", "--recurrent"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("state: none, no site becomes a recurrence of hydra (")
    assert cli.main([str(cached.path), "--list", "--to", "hedgehog"]) == 2  # --to alone lists nothing more
    assert "--to would do nothing there" in capsys.readouterr().err


def test_the_rewrite_its_record_its_report_and_check_state_the_bytes(decoder_exports, capsys, tmp_path):
    cached = decoder_exported(decoder_exports, "llama", "dynamo")
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    args = [str(cached.path), "--to", "hedgehog", "-O", "window=4", "--recurrent", "-o", str(out)]
    assert cli.main([*args, "--report", str(report)]) == 0
    assert LLAMA_LINE in capsys.readouterr().out.splitlines()
    expected = {"layers": 2, "state_bytes": 6832, "kv_bytes_per_token": 256, "kv_tokens_equivalent": 26}
    assert json.loads(report.read_text())["state_memory"] == expected
    assert read_record(onnx.load(out))["state_memory"] == expected
    assert cli.main(["check", str(cached.path), str(out), "--seq", "12", "--report", str(report)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == LLAMA_LINE
    assert json.loads(report.read_text())["state_memory"] == expected
