"""Torch A/B of the causal window hybrid (kernels.windowed_kernel_attention, what the FX frontend
and calibration run): an older attnrewrite's kernels.py beside the current one, interleaved in one
process.

    python bench/ab_torch_window.py --base /path/to/old/checkout [--lengths 1024,4096,16384]

[1, 12, N, 64] q, k, v, window=32, no gradient; hedgehog-like features (F = 128, positive) and
favor-like ones (F = 256 with per-query and per-key log scales). Prints the minimum of --repeats
runs each and the outputs' relative difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from attnrewrite.passes import kernels


def load_base(checkout: str):
    spec = importlib.util.spec_from_file_location("base_kernels", f"{checkout}/attnrewrite/passes/kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_kernels"] = module
    spec.loader.exec_module(module)
    return module


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


def minimum_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="an older checkout whose kernels.py is the baseline")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--kinds", default="hedgehog,favor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    base = load_base(args.base)
    torch.set_num_threads(args.threads)
    print("| features | N | before, ms | after, ms | after / before | outputs' relative difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        for n in map(int, args.lengths.split(",")):
            tensors, scales = inputs(kind, n)
            options = dict(scale=0.125, window=32, causal=True, window_next=True, sinks=0, **scales)
            runs = {
                name: (lambda m=module: m.windowed_kernel_attention(*tensors, **options))
                for name, module in (("before", base), ("after", kernels))
            }
            with torch.no_grad():
                out = {name: run() for name, run in runs.items()}
                times = {name: [] for name in runs}
                for _ in range(args.repeats):  # interleaved, so that drift hits both alike
                    for name, run in runs.items():
                        times[name].append(minimum_ms(run, 1))
            before, after = min(times["before"]), min(times["after"])
            diff = ((out["after"] - out["before"]).abs().max() / out["before"].abs().max()).item()
            print(f"| {kind} | {n} | {before:.1f} | {after:.1f} | {after / before:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
