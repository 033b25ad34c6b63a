"""attnrewrite check --against-window (attnrewrite/check_window.py, issue 68): the rewritten decoder
beside the window of its state's bytes on the same inputs. The window's row is what a direct
`--to streaming -O recent=R -O sinks=4` rewrite's check gives; the rewritten row what check
alone gives; the refusals are one line each; the CLI writes both rows to the table, --json and
--report. tests/decoders.py's llama: 2 layers, 2 key/value heads of head_dim 8, float32, so 256
bytes of KV cache per token; hedgehog window=4's state is 6832 bytes (tests/test_state_bytes.py),
26 tokens of it."""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import decoder_exported
from models import EXPORTERS, SAMPLE_BERT

import attnrewrite
from attnrewrite import cli
from attnrewrite.check import check, check_inputs, model_record
from attnrewrite.check_window import NO_STATE, check_against_window, window_options

SEQ = 40  # past the window's 26 keys and hedgehog window=4's reach
TOKENS = 6832 // 256


def saved(path, model: onnx.ModelProto) -> str:
    onnx.save(model, path)
    return str(path)


def hedgehog(export, folder, recurrent: bool) -> str:
    model = attnrewrite.rewrite(str(export.path), to="hedgehog", window=4, recurrent=recurrent)
    return saved(folder / f"hedgehog{'-recurrent' if recurrent else ''}.onnx", model)


@pytest.mark.parametrize("recurrent", [True, False], ids=["recurrent", "parallel"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_window_row_is_a_direct_streaming_rewrites_check(decoder_exports, tmp_path, exporter, recurrent):
    cached = decoder_exported(decoder_exports, "llama", exporter)
    rewritten = hedgehog(cached, tmp_path, recurrent)
    inputs = check_inputs(cached.path, model_record(rewritten), seq=SEQ)  # a decoder's generation when recurrent
    report = check_against_window(cached.path, rewritten, inputs)
    window = report.window
    assert (window.recent, window.sinks, window.tokens) == (TOKENS - 4, 4, TOKENS)
    assert window.memory["state_bytes"] == 6832  # a parallel rewrite: its recurrent form's
    direct = attnrewrite.rewrite(str(cached.path), to="streaming", recent=TOKENS - 4, sinks=4)
    assert window.fidelity == check(cached.path, saved(tmp_path / "streaming.onnx", direct), inputs)
    alone = check(cached.path, rewritten, inputs)
    assert (report.outputs, report.exact, report.input_source) == (alone.outputs, alone.exact, alone.input_source)
    assert window.fidelity.outputs[0].argmax_agreement is not None  # the logits: next-token agreement


def test_generated_inputs_look_past_the_window(decoder_exports, tmp_path):
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    report = check_against_window(cached.path, hedgehog(cached, tmp_path, recurrent=True))
    assert report.input_source.endswith("seq 128: past recent=22, sinks=4's reach (26) for every site")
    assert report.window.fidelity.exact == []


def test_the_command_prints_writes_and_reports_both_rows(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    rewritten = hedgehog(cached, tmp_path, recurrent=True)
    written, report = tmp_path / "check.json", tmp_path / "report.json"
    args = ["check", str(cached.path), rewritten, "--against-window", "--seq", str(SEQ)]
    assert cli.main([*args, "--json", str(written), "--report", str(report), "--min-cosine", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["output", "model", "shape"]
    assert [line.split()[:2] for line in lines[1:3]] == [["logits", "rewritten"], ["logits", "window"]]
    assert lines[3] == (
        "window: streaming recent=22, sinks=4, the KV cache of 26 tokens (256 bytes per token), as many as "
        "the rewritten model's 6.8 kB state per sequence buys"
    )
    window = json.loads(written.read_text())["window"]
    assert {k: window[k] for k in ("method", "recent", "sinks", "kv_tokens")} == {
        "method": "streaming",
        "recent": 22,
        "sinks": 4,
        "kv_tokens": 26,
    }
    assert window["state_memory"]["state_bytes"] == 6832 and window["outputs"][0]["name"] == "logits"
    assert 0 <= window["observed"]["argmax_agreement_min"] <= 1 and window["exact_sites"] == []
    run = json.loads(report.read_text())
    assert run["outcome"] == "checked" and run["check"]["window"] == window


def error_of(capsys, original, rewritten) -> str:
    code = cli.main(["check", str(original), str(rewritten), "--against-window"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err.removeprefix("attnrewrite: error: ").rstrip("\n")


def test_an_encoder_has_no_state_to_weigh(tmp_path, capsys):
    rewritten = saved(tmp_path / "bert.onnx", attnrewrite.rewrite(str(SAMPLE_BERT), to="linear"))
    assert error_of(capsys, SAMPLE_BERT, rewritten) == (
        f"{NO_STATE}: its site '/model/encoder/layer.0/attention/self/Softmax': the most recent keys are a "
        "decoder's cache: a bidirectional site has no last keys to keep"
    )


def test_a_method_without_a_recurrence_has_no_state_to_weigh(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    rewritten = saved(tmp_path / "hydra.onnx", attnrewrite.rewrite(str(cached.path), to="hydra"))
    assert error_of(capsys, cached.path, rewritten).startswith(f"{NO_STATE}: hydra has no recurrent form (")


def test_a_state_smaller_than_five_tokens_buys_no_window(decoder_exports, tmp_path, capsys):
    # linear: 4 heads x 8 features x 9 columns x 4 bytes per layer; gpt2's cache 512 bytes per token
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    rewritten = attnrewrite.rewrite(str(cached.path), to="linear", recurrent=True)
    assert error_of(capsys, cached.path, saved(tmp_path / "linear.onnx", rewritten)) == (
        "--against-window: the rewritten model's state (2304 bytes per sequence) buys the KV cache of 4 tokens, "
        "fewer than a window's 4 sinks and 1 recent key"
    )
    assert window_options({"kv_tokens_equivalent": 5, "state_bytes": 5}).recent == 1


def test_a_model_without_a_record_or_a_cache_is_refused(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "gpt2", "legacy")
    assert error_of(capsys, cached.path, cached.path) == (
        "--against-window weighs a rewrite's state: the rewritten model has no attnrewrite record"
    )
    uncached = decoder_exported(decoder_exports, "gpt2", "legacy", cache=False)
    rewritten = saved(tmp_path / "linear.onnx", attnrewrite.rewrite(str(uncached.path), to="linear"))
    assert error_of(capsys, uncached.path, rewritten).startswith(
        "--against-window: no window of the rewritten model's bytes: state: 2.3 kB per sequence (2304 bytes over "
        "2 layers), the KV cache's bytes per token not known ("
    )
