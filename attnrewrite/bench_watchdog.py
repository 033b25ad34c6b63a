"""One configuration in its own process, watched: a worker speaking bench_worker's protocol
(``ready``, ``ran SECONDS``, ``result JSON``) is killed when its resident memory passes the
budget or when it goes quiet for longer than a run may take."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from attnrewrite.bench_config import BenchConfig
from attnrewrite.bench_results import Measurement, gigabytes

# A run that sends no sign of life for this long past the time budget is killed.
WATCHDOG_SLACK_SECONDS = 30.0
_POLL_SECONDS = 0.02


def measure_worker(argv: list[str], config: BenchConfig, n: int, env: dict | None = None) -> Measurement:
    """One configuration: a worker process speaking bench_worker's protocol."""
    outcome = run_worker(argv, config.budget_bytes, config.budget_seconds, env)
    return Measurement.from_worker("", n, outcome)


def run_worker(argv: list[str], budget_bytes: int, budget_seconds: float, env: dict | None = None) -> dict:
    """Run a worker speaking bench_worker's protocol; kill it when its resident memory passes
    ``budget_bytes`` or when it goes quiet for longer than a run may take. Returns its result
    dict (status over_memory / over_time / failed when it had to be stopped or died)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    last_sign = [time.monotonic()]
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines, last_sign), daemon=True)
    reader.start()
    peak, verdict = 0, None
    try:
        while process.poll() is None:
            rss = _process_rss(process.pid)
            peak = max(peak, rss)
            if rss > budget_bytes:
                verdict = {"status": "over_memory", "peak_rss_bytes": peak, "detail": f"killed at {gigabytes(rss)}"}
            elif time.monotonic() - last_sign[0] > budget_seconds + WATCHDOG_SLACK_SECONDS and any(
                line.startswith("ready") for line in lines
            ):
                quiet = time.monotonic() - last_sign[0]
                verdict = {
                    "status": "over_time",
                    "times_s": [quiet],
                    "peak_rss_bytes": peak,
                    "detail": f"killed after {quiet:.0f} s in one run",
                }
            if verdict:
                process.kill()
                break
            time.sleep(_POLL_SECONDS)
    finally:
        process.wait()
        reader.join(timeout=5)
        stderr = process.stderr.read()
        process.stderr.close()
    if verdict:
        return verdict
    result = next((line[len("result ") :] for line in reversed(lines) if line.startswith("result ")), None)
    if result is None:
        return {"status": "failed", "detail": _death(process.returncode, stderr, peak)}
    return json.loads(result)


def _read_lines(stream, lines: list[str], last_sign: list[float]) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        last_sign[0] = time.monotonic()


def _death(code: int, stderr: str, peak: int) -> str:
    if code in (-9, 137):
        return f"killed by the system (out of memory?) at {gigabytes(peak)}"
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"worker exited with {code}: {tail[-1][:200] if tail else 'no message'}"


def _process_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0
