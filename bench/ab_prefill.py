"""The decoder's prefill, this tree's rewrite against an earlier commit's, interleaved in one process
(issue 47: "prefill time within 10% of now", now being the commit the issue was filed against).

    python bench/ab_prefill.py 5b60f8e                    # N = 1024 and 4096, 5 runs each
    python bench/ab_prefill.py 5b60f8e --n 1024 --runs 9

The 12-layer bench decoder of bench/decode.py (its KV-cache and no-cache exports, cached in
/tmp/attnrewrite-bench) is rewritten by the commit's attnrewrite (checked out in a temporary git
worktree) and by this tree's, each in its own process: hedgehog recurrent, with and without
window=64, from the KV-cache export, and hedgehog window=64 in parallel from the no-cache one. Then, per model and prompt length N,
the base and the new model run the same N-token prefill (one call from an empty state)
alternately, the order flipped every round, after one warm-up each: onnxruntime CPU, 2 intra-op
threads. Across runs on different days this CPU's prefill times moved by 2x, which is why the
two trees are measured side by side. Prints a markdown table: the median and fastest run of
each, and new / base.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

import decode

from attnrewrite.generate import Decoder
from attnrewrite.onnx.validate import make_session

# label -> (which export, rewrite keywords)
VARIANTS = {
    "hedgehog, recurrent": (True, dict(to="hedgehog", recurrent=True)),
    "hedgehog window=64, recurrent": (True, dict(to="hedgehog", window=decode.WINDOW, recurrent=True)),
    "hedgehog window=64, parallel": (False, dict(to="hedgehog", window=decode.WINDOW)),
}
BUILD = """
import sys
sys.path.insert(0, sys.argv[1])
import attnrewrite, onnx
onnx.save(attnrewrite.rewrite(sys.argv[2], **eval(sys.argv[4])), sys.argv[3])
"""


def build(tree: Path, exports: dict[bool, Path], out: Path) -> dict[str, Path]:
    """Each variant rewritten by the attnrewrite in ``tree`` (a fresh process: one attnrewrite
    per interpreter)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for n, (label, (cached, options)) in enumerate(VARIANTS.items()):
        paths[label] = out / f"{n}.onnx"
        command = [sys.executable, "-c", BUILD, str(tree), str(exports[cached]), str(paths[label]), repr(options)]
        subprocess.run(command, check=True, cwd=tempfile.gettempdir())
    return paths


def prefill_ms(paths: dict[str, Path], n: int, runs: int) -> dict[str, list[float]]:
    """ms of each timed prefill of ``n`` tokens, by tag; the tags' models alternate."""
    ids = np.random.default_rng(0).integers(0, decode.VOCAB_IN_USE, (1, n))
    sessions, feeds = {}, {}
    for tag, path in paths.items():
        sessions[tag] = make_session(str(path), threads=2)
        decoder = Decoder.of(sessions[tag], tag)
        feeds[tag] = {**decoder.feeds(ids, np.ones(ids.shape, np.int64), step=0), **decoder.initial_state(1)}
        sessions[tag].run(None, feeds[tag])  # warm-up
    times: dict[str, list[float]] = {tag: [] for tag in paths}
    for round_ in range(runs):
        for tag in list(paths)[:: 1 if round_ % 2 == 0 else -1]:
            began = time.perf_counter()
            sessions[tag].run(None, feeds[tag])
            times[tag].append((time.perf_counter() - began) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit to compare with")
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096], help="prompt lengths")
    parser.add_argument("--runs", type=int, default=5, help="timed prefills per model and length")
    args = parser.parse_args(argv)
    exports = decode.exports(decode.Shape(), decode.CACHE)
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.base], check=True)
        try:
            models = {
                tag: build(tree, exports, Path(scratch) / tag) for tag, tree in (("base", worktree), ("new", REPO))
            }
            rows = [
                "| model | N | base, ms (median / min) | new, ms (median / min) | new / base |",
                "|---|---:|---:|---:|---:|",
            ]
            for label in VARIANTS:
                for n in args.n:
                    times = prefill_ms({tag: models[tag][label] for tag in models}, n, args.runs)
                    base, new = (statistics.median(times[tag]) for tag in ("base", "new"))
                    cells = [f"{statistics.median(times[t]):.0f} / {min(times[t]):.0f}" for t in ("base", "new")]
                    rows.append(f"| {label} | {n} | {cells[0]} | {cells[1]} | {new / base:.2f}x |")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
