"""One ONNX model at every length of its series, in one process: ``python cuda_series_worker.py SPEC_JSON``.

bench/run_cuda_benchmarks.py's worker. A fresh process per cell (attnrewrite/bench_worker.py)
paid onnxruntime's import, the session and the CUDA context once per length: the fp16 attention
section alone took 8 minutes (issue 33). Here they are paid once per series, and a series ends
at its first failure (a GPU out-of-memory included), so the next series starts in a fresh
process. It speaks bench_worker's protocol to the parent's watchdog (``ready``, ``ran SECONDS``,
a final ``result``) and appends each length's result to ``spec["results"]`` (JSON lines) as it
finishes, so a worker killed at 65536 keeps what it measured before.

spec: model, provider ("cuda" or "cpu"), threads, warmup, repeats, budget_seconds, inputs
([[N, npz path], ...], ascending), results (a path), deadline (time.time() after which no length
starts). Memory is the process's so far: lengths ascend, so it is the longest one's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

BENCH_WORKER = Path(__file__).resolve().parents[1] / "attnrewrite" / "bench_worker.py"


def load_bench_worker():
    """attnrewrite/bench_worker.py by path: it imports numpy and onnxruntime only."""
    spec = importlib.util.spec_from_file_location("bench_worker", BENCH_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def session_for(spec: dict, worker):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if spec.get("threads"):
        options.intra_op_num_threads = spec["threads"]
        options.inter_op_num_threads = 1
    cuda = spec["provider"] == "cuda"
    if cuda:
        worker.cuda_ready(ort)
    provider = "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
    return ort.InferenceSession(spec["model"], options, providers=[provider])


def measure(session, inputs: str, spec: dict, worker) -> dict:
    """One length: its inputs bound once, timed as bench_worker times a cell."""
    import onnxruntime as ort

    cuda = spec["provider"] == "cuda"
    feeds = worker.load_feeds(session, inputs)
    worker.emit("loaded")  # a sign of life for the watchdog: loading 65536's inputs takes a while
    if cuda:
        run_once = worker.bound_cuda_run(session, feeds, ort)
    else:

        def run_once():
            session.run(None, feeds)

    loaded = worker.rss_bytes()
    budget = spec["budget_seconds"]
    result = worker.time_runs(run_once, warmup=spec["warmup"], repeats=spec["repeats"], budget_seconds=budget)
    result.update(worker.memory(loaded))
    if cuda:
        result["gpu_memory_bytes"] = worker.gpu_memory_bytes()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    worker = load_bench_worker()
    try:
        session = session_for(spec, worker)
    except Exception as error:  # the model does not load: every length fails alike
        worker.emit("result", json.dumps({"status": "failed", "error": f"{type(error).__name__}: {error}"[:300]}))
        return 0
    worker.emit("ready")
    with open(spec["results"], "a") as results:
        for n, inputs in spec["inputs"]:
            if time.time() > spec["deadline"]:
                break
            try:
                result = measure(session, inputs, spec, worker)
            except Exception as error:  # out of memory at this length: the series ends here
                text = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
                result = {"status": "failed", "error": f"{type(error).__name__}: {text}"}
            results.write(json.dumps({"n": n, **result}) + "\n")
            results.flush()
            if result["status"] != "ok":
                break
    worker.emit("result", json.dumps({"status": "ok"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
