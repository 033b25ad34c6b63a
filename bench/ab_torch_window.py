"""Torch A/B of the causal window hybrid (windowed_kernel_attention, what the FX frontend and
calibration run): an older checkout's beside this one. Both are the package ``attnrewrite``, so
each side runs in a process of its own, the two alternating so that drift hits both alike.

    python bench/ab_torch_window.py --base /path/to/old/checkout [--lengths 1024,4096,16384]

[1, 12, N, 64] q, k, v, window=32, no gradient; hedgehog-like features (F = 128, positive) and
favor-like ones (F = 256 with per-query and per-key log scales). Prints the minimum of --repeats
runs each and the outputs' relative difference. A checkout from before passes/window/ (one
passes/kernels.py) is called with the keywords that module took.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
WINDOW = dict(scale=0.125, window=32, causal=True, window_next=True, sinks=0)


def inputs(kind: str, n: int):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, n, 64, generator=generator) for _ in range(3))
    features = 128 if kind == "hedgehog" else 256
    phi_q, phi_k = (torch.rand(1, 12, n, features, generator=generator) for _ in range(2))
    scales = {}
    if kind == "favor":
        scales = dict(
            query_log_scale=torch.randn(1, 12, n, 1, generator=generator),
            key_log_scale=3 * torch.randn(1, 12, n, 1, generator=generator),
        )
    return (phi_q, phi_k, q, k, v), scales


def hybrid():
    """The checkout's windowed_kernel_attention, as a function of (tensors, scales)."""
    try:
        from attnrewrite.passes import kernels  # before passes/window/
    except ImportError:
        from attnrewrite.passes.window.settings import KernelScales, Window
        from attnrewrite.passes.window.torch_form import windowed_kernel_attention

        window = Window(WINDOW["window"], WINDOW["window_next"], WINDOW["sinks"])
        return lambda tensors, scales: windowed_kernel_attention(
            *tensors, window, scale=WINDOW["scale"], causal=WINDOW["causal"], scales=KernelScales(**scales)
        )
    return lambda tensors, scales: kernels.windowed_kernel_attention(*tensors, **WINDOW, **scales)


def measure(kind: str, n: int, threads: int, output: str) -> None:
    """One timed run (after one to warm up) of this process's checkout: its ms on stdout, its
    output saved to ``output``."""
    torch.set_num_threads(threads)
    attend, (tensors, scales) = hybrid(), inputs(kind, n)
    with torch.no_grad():
        attend(tensors, scales)
        start = time.perf_counter()
        out = attend(tensors, scales)
        print(1e3 * (time.perf_counter() - start))
    torch.save(out, output)


def run_side(root: Path, kind: str, n: int, threads: int, output: str) -> float:
    """measure() in a process whose ``attnrewrite`` is the one under ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root))
    command = [sys.executable, str(HERE), "--measure", kind, str(n), str(threads), output]
    done = subprocess.run(command, env=env, cwd=root, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        kind, n, threads, output = sys.argv[2:]
        return measure(kind, int(n), int(threads), output)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="an older checkout, the baseline")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--kinds", default="hedgehog,favor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    roots = {"before": args.base.resolve(), "after": HERE.parent.parent}
    print("| features | N | before, ms | after, ms | after / before | outputs' relative difference |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds.split(","):
            for n in map(int, args.lengths.split(",")):
                outputs = {name: os.path.join(folder, f"{name}.pt") for name in roots}
                times = {name: [] for name in roots}
                for _ in range(args.repeats):  # alternating, so that drift hits both alike
                    for name, root in roots.items():
                        times[name].append(run_side(root, kind, n, args.threads, outputs[name]))
                before, after = (torch.load(outputs[name]) for name in roots)
                diff = ((after - before).abs().max() / before.abs().max()).item()
                fastest = {name: min(ms) for name, ms in times.items()}
                ratio = fastest["after"] / fastest["before"]
                print(
                    f"| {kind} | {n} | {fastest['before']:.1f} | {fastest['after']:.1f} | {ratio:.2f} | {diff:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
