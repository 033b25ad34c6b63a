"""bench/run_cuda_benchmarks.py: the whole script on the CPU provider (--smoke), so the GPU
session finds no bug in it; its deadline, resume and failure bookkeeping."""

from __future__ import annotations

import json
import subprocess
import sys

import onnxruntime as ort
import pytest
from models import BENCH, load_bench_module

from attnrewrite import bench

script = load_bench_module("run_cuda_benchmarks")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # about 90 s on a shared 2-core machine: the script's every step, in processes
def test_smoke_run_end_to_end(tmp_path):
    """Two methods (hedgehog brings the window configurations) and one dtype keep it short;
    every other path is the full run's."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run_cuda_benchmarks.py"),
            "--smoke",
            "--methods",
            "hydra,hedgehog",
            "--dtypes",
            "fp16",
            "--budget-seconds",  # a loaded CI machine must not stop a series: every cell is asserted
            "60",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "results_cuda.json").read_text())
    assert data["schema"] == "attnrewrite.cuda-bench/1"
    assert set(data["environment"]) >= {"gpu", "onnxruntime", "torch", "torch_cuda", "cudnn", "python"}
    methods = ("hydra", "hedgehog", "hedgehog:window=32", "hedgehog:window=64")  # favor's window: favor not asked
    expected = [f"attention/fp16/{c}/256" for c in ("softmax", "fused", *methods, "torch:hydra", "torch:hedgehog")]
    expected += ["attention/fp16/torch:sdpa/256"]
    expected += [f"causal/fp16/{c}/256" for c in ("softmax", "fused", *methods)]
    expected += [f"layer/fp16/{c}/256" for c in ("softmax", "fused", "identity", *methods)]
    placed = sorted(k.rsplit("/", 1)[0] for k in expected if "torch:" not in k)
    decoders = ("hedgehog", "hedgehog-std", "hedgehog-w", "original")
    expected += [f"decode/b{b}/{v}/{n}" for b in (1, 2) for v in decoders for n in (64, 128)]
    assert sorted(data["cells"]) == sorted(expected)
    for key, cell in data["cells"].items():
        assert cell["status"] == "ok" and cell["median_s"] > 0, (key, cell)
    assert sorted(data["placement"]) == placed
    # a KV cache grows with the context and the batch; a recurrent state with the batch only
    size = data["decode_bytes"]
    assert size["decode/b1/original/128"] > size["decode/b1/original/64"] > 0
    assert size["decode/b1/hedgehog/128"] == size["decode/b1/hedgehog/64"] > 0
    assert size["decode/b2/hedgehog/64"] == 2 * size["decode/b1/hedgehog/64"]
    for placement in data["placement"].values():
        assert placement["by_provider"] == {"CPUExecutionProvider": placement["nodes"]}
        assert placement["data_elsewhere"] == [] and placement["memcpy"] == []
    report = (tmp_path / "RESULTS_CUDA.md").read_text()
    assert report.startswith("# CUDA benchmark results (SMOKE RUN: CPU provider, tiny N; not a measurement)")
    assert "### attention only, q, k, v of [1, 12, N, 64], fp16" in report
    assert "- fused exact: opset-23 Attention x1" in report
    assert "### causal attention only (decoder prefill), q, k, v of [1, 12, N, 64], fp16" in report
    assert (
        "| N | softmax (ORT) | fused exact (ORT) | hydra | hedgehog | hedgehog window=32 | hedgehog window=64 |"
        in report
    )
    assert "### one BERT-base encoder layer (d = 768, 12 heads, FFN 3072), fp16" in report
    assert "### decoding, one token per step, batch 2 (fp32)" in report
    columns = "original (KV cache) | hedgehog, recurrent | hedgehog, recurrent, --standard-ops | hedgehog window=64, recurrent"
    assert f"| context | {columns} |" in report
    assert (
        "- fused exact: onnxruntime.transformers.optimizer: com.microsoft.Attention x1, float16 by onnxruntime's converter"
        in report
    )
    assert "| hydra | N = 256 |" in report or "| hydra | never |" in report
    assert "## Node placement" in report and "not reached" not in report
    for name in ("smoke_attention_fp16.png", "smoke_causal_fp16.png", "smoke_layer_fp16.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def _measured(status="ok", detail=None):
    calls = []

    def runner(n, inputs):
        calls.append(n)
        return bench.Measurement("", n, status, [0.01] if status == "ok" else [], 1, 1, detail=detail)

    return runner, calls


def test_cells_past_the_deadline_are_left_for_a_resumed_run(tmp_path):
    path = tmp_path / "results_cuda.json"
    store = script.Store(path, resume=False, header={"runs": []})
    runner, calls = _measured()
    late = script.stored(runner, store, "attention", "fp16", "hydra", deadline=0.0)
    assert late(1024, tmp_path).status == script.NOT_REACHED and calls == []
    on_time = script.stored(runner, store, "attention", "fp16", "hydra", deadline=float("inf"))
    assert on_time(2048, tmp_path).status == "ok" and calls == [2048]

    resumed = script.Store(path, resume=True, header={"runs": []})
    assert list(resumed.data["cells"]) == ["attention/fp16/hydra/2048"]  # the missed cell is not kept
    again = script.stored(runner, resumed, "attention", "fp16", "hydra", deadline=float("inf"))
    assert again(2048, tmp_path).median_s == 0.01 and calls == [2048]  # taken from the file
    assert again(1024, tmp_path).status == "ok" and calls == [2048, 1024]


@pytest.mark.parametrize(
    "detail,status,text",
    [
        (
            "RuntimeException: ... Failed to allocate memory for requested buffer of size 17179869184",
            "over_memory",
            "GPU OOM",
        ),
        ("OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB", "over_memory", "GPU OOM"),
        ("worker exited with -11: no message", "failed", "crashed"),
        ("Fail: ReduceMax CUDNN_STATUS_BAD_PARAM", "failed", "failed"),
    ],
)
def test_out_of_memory_and_crashes_are_named_in_the_table(tmp_path, detail, status, text):
    store = script.Store(tmp_path / "results_cuda.json", resume=False, header={"runs": []})
    runner, _ = _measured("failed", detail)
    m = script.stored(runner, store, "layer", "fp32", "softmax", deadline=float("inf"))(65536, tmp_path)
    assert m.status == status and m.detail == detail
    assert script.cell_text(m, None) == text


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA is available")
def test_the_full_run_needs_a_cuda_provider(tmp_path, capsys):
    assert script.main(["--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run_cuda_benchmarks: this onnxruntime (") and "has no CUDA execution provider" in err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_unknown_methods_are_refused():
    with pytest.raises(SystemExit):
        script.parse_args(["--smoke", "--methods", "hydra,softmax"])


def test_inputs_are_written_only_for_lengths_with_cells_to_measure(tmp_path):
    store = script.Store(tmp_path / "results_cuda.json", resume=False, header={"runs": []})
    store.put("layer/fp32/softmax/64", bench.Measurement("softmax", 64, "ok", [0.1]))
    written = []

    def write(n):
        written.append(n)
        return tmp_path / f"inputs-{n}.npz"

    inputs_for = script.needed_inputs(write, tmp_path, store, "layer", "fp32", ["softmax"], deadline=float("inf"))
    assert inputs_for(64) == tmp_path / "inputs-not-written-64.npz" and written == []  # measured already
    assert inputs_for(128) == tmp_path / "inputs-128.npz" and written == [128]
    late = script.needed_inputs(write, tmp_path, store, "layer", "fp32", ["softmax"], deadline=0.0)
    assert late(256) == tmp_path / "inputs-not-written-256.npz" and written == [128]


def _config(lengths):
    return bench.BenchConfig(model="", method="", lengths=lengths, provider="cpu", repeats=1, warmup=0)


def test_a_series_runs_every_length_in_one_process(tmp_path):
    """cuda_series_worker.py: one session for both lengths, each stored as it finishes."""
    model = script.models.export_attention(tmp_path / "attention.onnx", heads=2, head_dim=8)
    write = script.standard.inputs_writer(model, tmp_path)
    store = script.Store(tmp_path / "results_cuda.json", resume=False, header={"runs": []})
    inputs = {n: write(n) for n in (16, 32)}
    script.run_series(model, _config([16, 32]), store, ("attention", "fp32", "softmax"), inputs, float("inf"))
    cells = store.data["cells"]
    assert sorted(cells) == ["attention/fp32/softmax/16", "attention/fp32/softmax/32"]
    assert all(c["status"] == "ok" and c["median_s"] > 0 and c["peak_rss_bytes"] > 0 for c in cells.values())


def test_a_series_ends_at_its_first_failure_and_the_deadline_marks_the_rest(tmp_path):
    store = script.Store(tmp_path / "results_cuda.json", resume=False, header={"runs": []})
    inputs = {n: tmp_path / f"inputs-{n}.npz" for n in (16, 32)}
    where = ("layer", "fp16", "hydra")
    script.run_series(tmp_path / "missing.onnx", _config([16, 32]), store, where, inputs, float("inf"))
    [(key, cell)] = store.data["cells"].items()  # the series stopped at its first length
    assert key == "layer/fp16/hydra/16" and cell["status"] == "failed"
    assert cell["detail"].startswith("NoSuchFile: [ONNXRuntimeError] : 3 : NO_SUCHFILE : Load model from ")

    late = script.Store(tmp_path / "late.json", resume=False, header={"runs": []})
    script.run_series(tmp_path / "missing.onnx", _config([16, 32]), late, where, inputs, deadline=0.0)
    assert {c["status"] for c in late.data["cells"].values()} == {script.NOT_REACHED} and len(late.data["cells"]) == 2
