"""Where fitting's gains hold: the SmolLM2 rewrites bench/smollm2_fidelity.py wrote (hedgehog
``window=64``, calibrated and calibrated + fine-tuned, in its cache) scored as it scores them, on
three sets of passages of 512 tokens: passages both stages fitted on (the first of the
calibration data), passages of the same sources never fitted on (the last of the guard's part,
which the CLI holds out), and the held-out sources bench/smollm2_fidelity.py measures on.

    python bench/smollm2_generalization.py [--passages 16]

A gain on the first set that the other two do not show is learnt from those passages, not from
the model's attention. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import smollm2_fidelity as bench

from attnrewrite.calibration import held_out_split

MODELS = ("calibrated", "finetuned")
CONFIG = f"hedgehog+window{bench.WINDOW}"


def passage_sets(cache: Path, count: int) -> dict[str, list]:
    fitted, guard = held_out_split(bench.packed_batches(cache, bench.CALIBRATION))
    return {
        "fitted on (calibration sources)": bench.real_passages(fitted)[:count],
        "never fitted on (calibration sources, the guard's)": bench.real_passages(guard)[-count:],
        "held out (other sources)": bench.heldout_passages(cache, count),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=bench.DEFAULT_CACHE)
    parser.add_argument("--passages", type=int, default=16)
    args = parser.parse_args(argv)
    paths = {"original": args.cache / bench.ORIGINAL} | {m: args.cache / f"{CONFIG}-{m}.onnx" for m in MODELS}
    sets = passage_sets(args.cache, args.passages)
    print(
        "| passages | tokens | "
        + " | ".join(f"{m}: agreement from {bench.FAR_FROM}, perplexity ratio" for m in MODELS)
        + " |"
    )
    print("|---|---:|" + "---:|" * len(MODELS))
    for name, passages in sets.items():
        rows = bench.evaluate(paths, passages)
        cells = [f"{rows[m]['agreement_far']:.3f}, {rows[m]['perplexity_ratio']:.3f}" for m in MODELS]
        print(f"| {name} | {sum(map(len, passages))} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
