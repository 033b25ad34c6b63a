"""Attention-only A/B of two attnrewrite versions, interleaved in one process.

    PYTHONPATH=/path/to/old python bench/ab_attention.py build OUT/base VARIANT...
    python bench/ab_attention.py build OUT/new VARIANT...
    python bench/ab_attention.py time OUT N VARIANT...

VARIANT: [causal:]method[:option=value[+option=value]] (favor defaults to 256 features). ``build``
rewrites a [1, 12, N, 64] softmax attention export (bench/models.py; causal: a causally masked
one) with whichever attnrewrite is importable; ``time`` runs OUT/base and OUT/new alternately,
2 intra-op threads, and prints the minimum of 8 runs each and their outputs' relative difference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import models
import numpy as np
import onnxruntime as ort
import torch


class CausalAttention(torch.nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * 0.125
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        return torch.matmul(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1), v)


def build(out: Path, variants: list[str]) -> None:
    from attnrewrite.onnx import io as onnx_io
    from attnrewrite.onnx.rewrite import rewrite_model

    out.mkdir(parents=True, exist_ok=True)
    causal_source, source = out / "causal_source.onnx", out / "source.onnx"
    example = tuple(torch.randn(1, 12, 16, 64) for _ in range(3))
    models.export(CausalAttention(), example, list("qkv"), {n: {2: "sequence"} for n in "qkv"}, causal_source)
    models.export_attention(source)
    for variant in variants:
        causal = variant.startswith("causal:")
        method, _, text = variant.removeprefix("causal:").partition(":")
        options = {key: int(value) for key, value in (o.split("=") for o in text.split("+") if o)}
        if method == "favor":
            options.setdefault("features", 256)
        model, record = rewrite_model(onnx_io.load_model(causal_source if causal else source), method, **options)
        assert record.rewritten, [s.reason for s in record.skipped]
        onnx_io.save_model(model, out / f"{variant.replace(':', '_')}.onnx")


def time_interleaved(out: Path, n: int, variants: list[str]) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    feeds = {name: np.random.randn(1, 12, n, 64).astype(np.float32) for name in "qkv"}
    for variant in variants:
        file = f"{variant.replace(':', '_')}.onnx"
        sessions = {tag: ort.InferenceSession(str(out / tag / file), options) for tag in ("base", "new")}
        outputs = {tag: session.run(None, feeds)[0] for tag, session in sessions.items()}
        times = {tag: [] for tag in sessions}
        for _ in range(8):
            for tag, session in sessions.items():
                start = time.perf_counter()
                session.run(None, feeds)
                times[tag].append(time.perf_counter() - start)
        base, new = (min(times[tag]) * 1e3 for tag in ("base", "new"))
        difference = np.abs(outputs["base"] - outputs["new"]).max() / np.abs(outputs["base"]).max()
        print(f"| {variant} | {n} | {base:.1f} | {new:.1f} | {new / base:.2f} | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    command, path, *rest = sys.argv[1:]
    if command == "build":
        build(Path(path), rest)
    else:
        time_interleaved(Path(path), int(rest[0]), rest[1:])
