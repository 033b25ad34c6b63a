"""One benchmark configuration, run in a fresh process: ``python bench_worker.py SPEC_JSON``.

It imports only numpy and onnxruntime (never the attnrewrite package, whose graph libraries would
count in the process's memory), loads the model and the inputs, runs it, and reports on stdout:
``ready`` once loaded, ``ran SECONDS`` after each run (the parent's watchdog), and finally
``result JSON``. Peers (torch modules in bench/) reuse ``time_runs`` and ``memory`` with the same
protocol, loading this file by path. With ``"placement": true`` in the spec it times nothing and
reports which execution provider ran each node instead (``node_placement``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time


def emit(kind: str, payload="") -> None:
    print(f"{kind} {payload}".rstrip(), flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's high-water resident set. VmHWM, not getrusage's ru_maxrss: Linux carries
    ru_maxrss over fork and exec, so a worker would report its parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB; no /proc


def time_runs(run_once, *, warmup: int, repeats: int, budget_seconds: float) -> dict:
    """Untimed warm-up runs, then timed ones; stops at the first run over the budget (the
    series stops there, so there is no point in repeating it)."""
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        run_once()
        elapsed = time.perf_counter() - start
        emit("ran", f"{elapsed:.6f}")
        if elapsed > budget_seconds:
            return {"status": "over_time", "times_s": [elapsed]}
        if i >= warmup:
            times.append(elapsed)
    return {"status": "ok", "times_s": times}


def memory(loaded_rss: int) -> dict:
    return {"loaded_rss_bytes": loaded_rss, "peak_rss_bytes": peak_rss_bytes()}


def gpu_memory_bytes() -> int | None:
    """This process's device memory as nvidia-smi reports it. onnxruntime's CUDA arena keeps
    what it has grown to, so after the runs this is the peak; None when unknown."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    apps = [line.partition(",")[::2] for line in out.strip().splitlines() if line.strip()]
    for pid, used in apps:
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 2**20
    if len(apps) == 1:  # in a container nvidia-smi shows host pids; cells run one at a time, so it is us
        return int(apps[0][1].strip()) * 2**20
    return None


_NUMPY_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}


EXECUTION_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# A node off the expected provider that reads or makes data (a float tensor, or any tensor of
# more than SHAPE_ELEMENTS elements: LSH's int64 positions) costs copies and a slow kernel; one
# that touches only a few integers is shape arithmetic onnxruntime places on CPU on purpose
# (GetCpuPreferredNodes), and Shape/Size read only a tensor's metadata.
DATA_TYPES = {"float", "float16", "bfloat16", "double"}
SHAPE_ELEMENTS = 64
METADATA_OPS = {"Shape", "Size"}


def load_feeds(session, inputs: str) -> dict:
    import numpy as np

    with np.load(inputs) as archive:
        # the fp16 model's float inputs are float16; ids and masks keep their type
        return {
            i.name: archive[i.name].astype(_NUMPY_TYPES.get(i.type, archive[i.name].dtype), copy=False)
            for i in session.get_inputs()
        }


def cuda_ready(ort) -> None:
    """onnxruntime-gpu links against the CUDA and cuDNN libraries torch's wheels bring; it
    finds them only once they are loaded (preload_dlls, onnxruntime >= 1.21)."""
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


def node_placement(model: str, feeds: dict | None, provider: str, inputs: str | None = None) -> dict:
    """Which execution provider ran each node of one run of ``model`` on ``provider`` ("cpu" or
    "cuda"), read from onnxruntime's profiler: every node that ran is listed with the provider
    that ran it, so nothing depends on log formats. Not ``session.disable_cpu_ep_fallback``: it
    refuses any CPU node, shape arithmetic included, and says nothing about which."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(os.path.dirname(os.path.abspath(model)), "placement")
    if provider == "cuda":
        cuda_ready(ort)
    session = ort.InferenceSession(model, options, providers=[EXECUTION_PROVIDERS[provider]])
    session.run(None, feeds if feeds is not None else load_feeds(session, inputs))
    path = session.end_profiling()
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        os.remove(path)
    return placement_from_profile(events, EXECUTION_PROVIDERS[provider])


def placement_from_profile(events: list[dict], expected: str) -> dict:
    """by_provider: node count per provider; elsewhere: nodes not on ``expected``;
    data_elsewhere: those of them that read or make float tensors (the costly kind: compute, and
    the copies around it); memcpy: the copies onnxruntime inserted between devices."""
    nodes: dict[str, dict] = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        tensors = {
            kind: [(t, dims) for shape in args.get(f"{kind}_type_shape", []) for t, dims in shape.items()]
            for kind in ("input", "output")
        }
        nodes.setdefault(
            name[: -len("_kernel_time")],
            {
                "op": args.get("op_name", "?"),
                "provider": args.get("provider", "?"),
                **{kind: sorted({t for t, _ in found}) for kind, found in tensors.items()},
                "data": any(
                    t in DATA_TYPES or math.prod(dims) > SHAPE_ELEMENTS
                    for found in tensors.values()
                    for t, dims in found
                ),
            },
        )
    by_provider: dict[str, int] = {}
    for node in nodes.values():
        by_provider[node["provider"]] = by_provider.get(node["provider"], 0) + 1
    elsewhere = {name: node for name, node in nodes.items() if node["provider"] != expected}
    return {
        "expected": expected,
        "nodes": len(nodes),
        "by_provider": by_provider,
        "elsewhere": [f"{n['op']} {name} ({n['provider']})" for name, n in elsewhere.items()],
        "data_elsewhere": [
            f"{n['op']} {name} ({'/'.join(n['input']) or '-'} -> {'/'.join(n['output'])})"
            for name, n in elsewhere.items()
            if n["op"] not in METADATA_OPS and n["data"]
        ],
        "memcpy": [f"{n['op']} {name}" for name, n in nodes.items() if n["op"].startswith("Memcpy")],
    }


def run_onnx(spec: dict) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if spec.get("threads"):
        options.intra_op_num_threads = spec["threads"]
        options.inter_op_num_threads = 1
    if spec.get("profile"):
        options.enable_profiling = True
        options.profile_file_prefix = spec["profile"]
    cuda = spec["provider"] == "cuda"
    if cuda:
        cuda_ready(ort)
    session = ort.InferenceSession(
        spec["model"], options, providers=["CUDAExecutionProvider" if cuda else "CPUExecutionProvider"]
    )
    feeds = load_feeds(session, spec["inputs"])
    if cuda:
        run_once = bound_cuda_run(session, feeds, ort)
    else:

        def run_once():
            session.run(None, feeds)

    loaded = rss_bytes()
    emit("ready")
    result = time_runs(run_once, warmup=spec["warmup"], repeats=spec["repeats"], budget_seconds=spec["budget_seconds"])
    result.update(memory(loaded))
    if cuda:
        result["gpu_memory_bytes"] = gpu_memory_bytes()
    if spec.get("profile"):
        result["profile"] = session.end_profiling()
    return result


def bound_cuda_run(session, feeds, ort):
    """IOBinding: inputs copied to the device once, outputs left there, so only the model's
    own work is timed."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda")

    def run_once():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return run_once


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    try:
        if spec.get("placement"):
            result = {
                "status": "ok",
                "placement": node_placement(spec["model"], None, spec["provider"], spec["inputs"]),
            }
        else:
            result = run_onnx(spec)
    except Exception as error:  # reported to the parent as this configuration's failure
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        result = {"status": "failed", "error": f"{type(error).__name__}: {text}"}
    emit("result", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
