"""The peers, one configuration per process: ``python bench/peers.py SPEC_JSON``.

Attention only (no projections), on the same shapes as our attention-only graphs: q, k, v of
[1, heads, N, head_dim] (float32 unless ``dtype`` says float16), torch.inference_mode,
``threads`` intra-op threads, on ``device`` (cpu, or cuda: each run synchronized, memory from
nvidia-smi as for onnxruntime). Speaks attnrewrite/bench_worker.py's protocol (ready / ran /
result), whose helpers it loads by path so that the attnrewrite package (and its graph
libraries) stays out of the measured process; only the ``module`` peer, our passes' own torch
modules, imports ``passes`` (and what it imports).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
WORKER = ROOT / "attnrewrite" / "bench_worker.py"
PEERS = ("performer", "fast_transformers", "sdpa", "module")


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


def module(heads: int, head_dim: int, features: int, method: str = "", options: dict | None = None):
    """A pass's torch module (what the FX frontend swaps in) for [1, heads, N, head_dim] softmax
    attention scaled by 1/sqrt(head_dim). Its buffers stay float32 (the passes compute their
    feature maps and sums in float32 whatever the inputs are)."""
    sys.path.insert(0, str(ROOT))
    from attnrewrite import passes
    from attnrewrite.site import AttentionSite

    method_pass = passes.get_pass(method)
    site = AttentionSite(
        name="bench", scale=head_dim**-0.5, rank=4, num_heads=heads, head_dim=head_dim, value_dim=head_dim
    )
    return method_pass.torch_module(site, passes.make_options(method_pass, **(options or {}))).eval()


def main(argv: list[str]) -> int:
    protocol = load_protocol()
    spec = json.loads(argv[1])
    try:
        import torch

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        device = torch.device(spec.get("device", "cpu"))
        dtype = {"float32": torch.float32, "float16": torch.float16}[spec.get("dtype", "float32")]
        extra = {"method": spec["method"], "options": spec.get("options", {})} if spec["peer"] == "module" else {}
        attention = globals()[spec["peer"]](spec["heads"], spec["head_dim"], spec["features"], **extra)
        if isinstance(attention, torch.nn.Module):
            attention = attention.to(device)
        generator = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(1, spec["heads"], spec["n"], spec["head_dim"], generator=generator).to(device, dtype)
            for _ in range(3)
        )
        cuda = device.type == "cuda"

        def run_once():
            with torch.inference_mode():
                attention(q, k, v)
            if cuda:
                torch.cuda.synchronize()

        loaded = protocol.rss_bytes()
        protocol.emit("ready")
        result = protocol.time_runs(
            run_once, warmup=spec["warmup"], repeats=spec["repeats"], budget_seconds=spec["budget_seconds"]
        )
        result.update(protocol.memory(loaded))
        if cuda:
            result["gpu_memory_bytes"] = protocol.gpu_memory_bytes()
    except Exception as error:
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        result = {"status": "failed", "error": f"{type(error).__name__}: {text}"}
    protocol.emit("result", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
