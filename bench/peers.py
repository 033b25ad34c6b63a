"""The peers, one configuration per process: ``python bench/peers.py SPEC_JSON``.

Attention only (no projections), on the same shapes as our attention-only graphs: q, k, v of
[1, heads, N, head_dim] float32, torch.inference_mode, ``threads`` intra-op threads. Speaks
attnrewrite/bench_worker.py's protocol (ready / ran / result), whose helpers it loads by path so
that the attnrewrite package (and its graph libraries) stays out of the measured process.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

WORKER = Path(__file__).parents[1] / "attnrewrite" / "bench_worker.py"
PEERS = ("performer", "fast_transformers", "sdpa")


def load_protocol():
    spec = importlib.util.spec_from_file_location("bench_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def performer(heads: int, head_dim: int, features: int):
    """performer-pytorch's FastAttention: FAVOR+ with orthogonal random features."""
    from performer_pytorch import FastAttention

    attention = FastAttention(dim_heads=head_dim, nb_features=features, causal=False).eval()
    return lambda q, k, v: attention(q, k, v)


def fast_transformers(heads: int, head_dim: int, features: int):
    """fast-transformers' LinearAttention (phi = elu + 1); it takes [batch, N, heads, dim]."""
    import torch
    from fast_transformers.attention import LinearAttention
    from fast_transformers.masking import FullMask, LengthMask

    attention = LinearAttention(head_dim).eval()

    def run(q, k, v):
        batch, _, n, _ = q.shape
        lengths = LengthMask(torch.full((batch,), n, dtype=torch.long), max_len=n)
        # the layout change is part of using this library on [batch, heads, N, dim] tensors
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return attention(q, k, v, FullMask(n, n), lengths, lengths).transpose(1, 2)

    return run


def sdpa(heads: int, head_dim: int, features: int):
    """torch's scaled_dot_product_attention: exact softmax attention, fused on CPU."""
    import torch.nn.functional as F

    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)


def main(argv: list[str]) -> int:
    protocol = load_protocol()
    spec = json.loads(argv[1])
    try:
        import torch

        torch.set_num_threads(spec["threads"])
        attention = globals()[spec["peer"]](spec["heads"], spec["head_dim"], spec["features"])
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, spec["heads"], spec["n"], spec["head_dim"], generator=generator) for _ in range(3))

        def run_once():
            with torch.inference_mode():
                attention(q, k, v)

        loaded = protocol.rss_bytes()
        protocol.emit("ready")
        result = protocol.time_runs(run_once, warmup=spec["warmup"], repeats=spec["repeats"], budget_seconds=spec["budget_seconds"])
        result.update(protocol.memory(loaded))
    except Exception as error:
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        result = {"status": "failed", "error": f"{type(error).__name__}: {text}"}
    protocol.emit("result", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
