"""What the machine a benchmark ran on is: its processor, cores, memory and libraries."""

from __future__ import annotations

import os
import platform
from typing import Any

import onnx


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(threads: int | None) -> dict[str, Any]:
    import onnxruntime as ort

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(physical_memory_bytes() / 2**30, 1),
        "load_average": list(os.getloadavg()),
        "threads": threads,
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "providers": ort.get_available_providers(),
    }
