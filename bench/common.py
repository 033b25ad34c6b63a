"""What the CPU sweeps share (run_benchmarks.py, and decode.py, whose Decoding section it keeps in
bench/RESULTS.md): the machine's state and the cores other work kept busy, the targets, Markdown
tables, the markers of the Decoding section."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from attnrewrite import bench

DECODING_MARKERS = ("<!-- DECODING -->", "<!-- /DECODING -->")  # bench/decode.py's section
GENAI_MARKERS = ("<!-- GENAI -->", "<!-- /GENAI -->")  # bench/genai_smollm2.py's section
REPOSITORY = Path(__file__).resolve().parents[1]


def shown(text: str) -> str:
    """``text`` with this machine's folders named as any reader's: the repository's paths
    relative to it, the cache and temporary folders by their variables (bench/*.md name no path
    of the machine that wrote them; tests/test_docs.py checks)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    named = {REPOSITORY: ".", cache: "$XDG_CACHE_HOME", Path(tempfile.gettempdir()): "$TMPDIR"}
    for folder, name in named.items():
        inside = "" if name == "." else f"{name}/"  # bench/x, not ./bench/x
        text = text.replace(f"{folder}{os.sep}", inside).replace(str(folder), name)
    return text


@dataclasses.dataclass
class Target:
    text: str
    measured: str
    reached: bool | None  # None: could not be measured
    profile: tuple[str, int, str] | None = None  # (model, N, "layer" | "attention") to profile when missed


def cpu_seconds() -> dict:
    """Busy CPU seconds of the whole machine and of this process with its finished workers: the
    difference over the run is what other work used (the load average would count ours too)."""
    import resource

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    ours = sum(
        getattr(resource.getrusage(who), t)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for t in ("ru_utime", "ru_stime")
    )
    return {"machine": busy / os.sysconf("SC_CLK_TCK"), "ours": ours, "wall": time.monotonic()}


def others_cores(start: dict, end: dict) -> float:
    """Cores other processes kept busy on average during the run."""
    wall = max(end["wall"] - start["wall"], 1e-9)
    return max(0.0, (end["machine"] - start["machine"]) - (end["ours"] - start["ours"])) / wall


def machine_state() -> dict:
    import onnxruntime
    import torch

    versions = {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "numpy": np.__version__}
    for name, _module in (
        ("performer-pytorch", "performer_pytorch"),
        ("pytorch-fast-transformers", "fast_transformers"),
    ):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    return {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": bench.cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(bench.physical_memory_bytes() / 2**30, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "versions": versions,
    }


def table(header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    rule = "---:" if numeric else "---"
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
