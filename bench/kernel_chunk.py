"""How the causal kernel chunk form continued from a state grows with N (issue 67): a decoder's
prefill after earlier keys, plain and with per-key log scales (FAVOR+'s), through
kernel.state.chunk_kernel_attention.

    OMP_NUM_THREADS=1 python bench/kernel_chunk.py [--lengths 2048,8192,32768] [--chunk 64] [--repeats 20] [--label NAME]

1 batch x 4 heads, F = Dv = 64, float32, after a state of random keys. Two measures per cell:
the matmuls' GFLOP (torch's FlopCounterMode: exact, whatever the machine's load), and seconds,
the least of --repeats runs (the CPU is shared). A third row per run times one batched product
of [64 x 64] blocks, work linear in N by construction: how far this machine's own
timings are from linear at these sizes (memory, not arithmetic, bounds them). The rows are merged
by --label and --chunk into bench/kernel_chunk.json (PYTHONPATH at another tree adds its rows:
the base commit's from-state rescaled form held a (chunks x chunks) carry), and
bench/kernel_chunk.md is rewritten from them, with each row's largest growth per 4x N (linear: 4).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnrewrite.bench_machine import cpu_model
from attnrewrite.passes.kernel.state import KernelState

try:
    from attnrewrite.passes.kernel.state import chunk_kernel_attention
except ImportError:  # a tree before the one chunk form (0948d28): its two from-state forms
    from attnrewrite.passes.kernel import state as _before

    def chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, output_final_state, *, chunk):
        if log_scale is None:
            return _before.causal_linear_attention_from_state(phi_q, phi_k, v, state, chunk)
        return _before.causal_rescaled_linear_attention_from_state(phi_q, phi_k, log_scale, v, state, chunk)


HERE = Path(__file__).resolve().parent
RESULTS, TABLE = HERE / "kernel_chunk.json", HERE / "kernel_chunk.md"
HEADS, FEATURES = 4, 64


def inputs(n: int):
    generator = torch.Generator().manual_seed(n)
    phi_q, phi_k = (torch.rand(1, HEADS, n, FEATURES, generator=generator) for _ in range(2))
    v = torch.randn(1, HEADS, n, FEATURES, generator=generator)
    log_scale = torch.randn(1, HEADS, n, 1, generator=generator) * 10
    state = KernelState(torch.rand(1, HEADS, FEATURES, FEATURES), torch.rand(1, HEADS, FEATURES), torch.zeros(1, HEADS))
    return phi_q, phi_k, v, log_scale, state


def plain(phi_q, phi_k, v, log_scale, state, chunk):
    return chunk_kernel_attention(phi_q, phi_k, v, None, state._replace(log_scale=None), True, chunk=chunk)


def rescaled(phi_q, phi_k, v, log_scale, state, chunk):
    return chunk_kernel_attention(phi_q, phi_k, v, log_scale, state, True, chunk=chunk)


def linear_reference(phi_q, phi_k, v, log_scale, state, chunk):
    """One product of [F x F] blocks of the keys, [4, N / F, F, F] by itself: work linear in N."""
    states = phi_k.reshape(HEADS, -1, FEATURES, FEATURES)
    return states @ states


FORMS = {"plain": plain, "rescaled": rescaled, "linear reference (one bmm)": linear_reference}


# Written between runs: a prefill reads activations just made, not the inputs of the run
# before, which stay in the cache only while they are small (at 2048 positions they all fit).
CACHE_FLUSH = torch.empty(64 * 2**20 // 4)


def measure(form, n: int, chunk: int, repeats: int) -> dict:
    args = (*inputs(n), chunk)
    with torch.no_grad():
        with FlopCounterMode(display=False) as counter:
            form(*args)
        times = []
        for _ in range(repeats):
            CACHE_FLUSH.fill_(0.0)
            start = time.perf_counter()
            form(*args)
            times.append(time.perf_counter() - start)
    return {"gflop": counter.get_total_flops() / 1e9, "seconds": min(times)}


def growth(values: list) -> str:
    ratios = [b / a for a, b in zip(values, values[1:]) if a and b]
    return f"{max(ratios):.2f}" if ratios else ""


def table(results: dict) -> str:
    lengths = sorted({int(n) for run in results.values() for row in run["forms"].values() for n in row})
    header = " | ".join(f"N = {n}" for n in lengths)
    lines = [
        "Causal kernel chunk form from a state (bench/kernel_chunk.py; 1 x 4 heads, F = Dv = 64, float32): the",
        "matmuls' GFLOP, then seconds (least of the runs, each after 64 MB written to leave the inputs out of the",
        "cache); growth: the largest ratio per 4x N (linear: 4).",
        "",
        "Runs: "
        + "; ".join(f"{run['label']}: {run.get('date', '?')}, {run.get('machine', '?')}" for run in results.values()),
        "",
        f"| tree | chunk | form | threads | GFLOP: {header} | growth | seconds: {header} | growth |",
        "|---|---:|---|---:|" + "---:|" * (2 * len(lengths) + 2),
    ]
    for run in results.values():
        for form, row in run["forms"].items():
            cells = [row.get(str(n), {}) for n in lengths]
            gflop, seconds = [c.get("gflop") for c in cells], [c.get("seconds") for c in cells]
            lines.append(
                f"| {run['label']} | {run['chunk']} | {form} | {run['threads']} | "
                + " | ".join(f"{g:.3f}" if g is not None else "" for g in gflop)
                + f" | {growth(gflop)} | "
                + " | ".join(f"{s:.4f}" if s is not None else "" for s in seconds)
                + f" | {growth(seconds)} |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    run = {"label": args.label, "chunk": args.chunk, "threads": threads, "forms": {}}
    run.update(date=time.strftime("%Y-%m-%d"), machine=f"{cpu_model()}, {os.cpu_count()} cores")
    lengths = [int(n) for n in args.lengths.split(",")]
    for name, form in FORMS.items():
        measure(form, lengths[0], args.chunk, 1)  # first calls pay for allocations and dispatch
        run["forms"][name] = {str(n): measure(form, n, args.chunk, args.repeats) for n in lengths}
        print(args.label, args.chunk, name, run["forms"][name], flush=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[f"{args.label}, chunk {args.chunk}"] = run
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    TABLE.write_text(table(results))


if __name__ == "__main__":
    main()
