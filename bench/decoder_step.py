"""The trained decoder's decoding step: its KV cache against its windowed recurrent rewrite (issue
47: at 200 tokens of context the windowed step at most 1.5x the original's).

    python bench/decoder_step.py        # after bench/decoder_fidelity.py made the models

bench/decoder_fidelity.py trains the decoder and writes its rewrites into its cache folder; this
script times two of them, the original (decoder.onnx) and hedgehog window=64 fine-tuned. For
each model in turn, a block: a batch of two held-out passages' first 200 tokens prefilled in
one call (not timed), then 64 decoding steps, one token per row per call, each fed the cache or
state the one before returned, so one block boundary of the window falls among them. The models
alternate block by block (8 blocks each): onnxruntime's spinning threads and this CPU's drift
hit both alike, where `attnrewrite generate`'s side-by-side timing, one model after the other,
moved by 2x between runs. onnxruntime CPU, 2 intra-op threads, fp32. Writes its section of
bench/FIDELITY.md (between DECODER STEP markers) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import corpus
import decoder_fidelity
import fidelity
from common import shown

from attnrewrite.generate import Decoder
from attnrewrite.onnx.validate import make_session

CONTEXT = 200
STEPS = 64  # a block of the window: one of its boundaries falls among them
BLOCKS = 8
BOUND = 1.5  # issue 47
REWRITTEN = f"hedgehog+window{decoder_fidelity.WINDOW}-finetuned.onnx"
MARKERS = fidelity.DECODER_STEP_MARKERS  # this script's part of FIDELITY.md


class Stepper:
    """One model's session, and a block of timed steps after an untimed prefill."""

    def __init__(self, path: Path, threads: int):
        self.session = make_session(str(path), threads=threads)
        self.decoder = Decoder.of(self.session, path.name)
        self.outputs = ["logits", *(c.output for c in self.decoder.carried)]

    def block(self, ids: np.ndarray) -> list[float]:
        """ms of each step after a prefill of ids[:, :CONTEXT]."""
        carried = self.decoder.initial_state(len(ids))
        times = []
        for end in [CONTEXT, *range(CONTEXT + 1, CONTEXT + STEPS + 1)]:
            start = 0 if end == CONTEXT else end - 1
            feeds = self.decoder.feeds(ids[:, start:end], np.ones((len(ids), end), np.int64), step=start)
            began = time.perf_counter()
            _, *state = self.session.run(self.outputs, {**feeds, **carried})
            if start:
                times.append((time.perf_counter() - began) * 1e3)
            carried = {c.input: value for c, value in zip(self.decoder.carried, state)}
        return times


def measure(folder: Path, ids: np.ndarray, threads: int) -> dict[str, list[float]]:
    steppers = {name: Stepper(folder / name, threads) for name in (decoder_fidelity.ORIGINAL, REWRITTEN)}
    for stepper in steppers.values():
        stepper.block(ids)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(BLOCKS):
        for name, stepper in steppers.items():
            times[name] += stepper.block(ids)
    return times


def markdown(times: dict[str, list[float]], folder: Path, threads: int, m: dict) -> str:
    """``m``: fidelity.machine() before the measurements."""
    original, rewritten = (statistics.median(times[name]) for name in (decoder_fidelity.ORIGINAL, REWRITTEN))
    ratio = rewritten / original
    verdict = "met" if ratio <= BOUND else "not met"
    machine = f"{m['processor']}, {m['cpus']} cores, load {m['load_average_at_start']}, onnxruntime {m['onnxruntime']}"
    lines = [
        "## The trained decoder's decoding step at 200 tokens",
        "",
        f"`python bench/decoder_step.py` ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
        f"commit {m['commit']}, {machine}, {threads} intra-op threads): the models in {shown(str(folder))}, a batch of two "
        "held-out passages, "
        f"{BLOCKS} blocks per model alternating, each a prefill of {CONTEXT} tokens then {STEPS} timed steps "
        "(one window block boundary among them); the median step.",
        "",
        "| model | step, ms (median) | p10 / p90 | vs the KV cache |",
        "|---|---:|---:|---:|",
    ]
    for name in (decoder_fidelity.ORIGINAL, REWRITTEN):
        ms = times[name]
        p10, p90 = np.percentile(ms, [10, 90])
        relative = statistics.median(ms) / original
        lines.append(f"| {name} | {statistics.median(ms):.2f} | {p10:.2f} / {p90:.2f} | {relative:.2f}x |")
    lines += ["", f"Target: the windowed step at most {BOUND}x the original's: {ratio:.2f}x, **{verdict}**."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=decoder_fidelity.DEFAULT_CACHE)
    parser.add_argument("--markdown", type=Path, default=decoder_fidelity.DEFAULT_MARKDOWN)
    args = parser.parse_args(argv)
    text = corpus.build_corpus()
    folder = args.cache / decoder_fidelity.Settings().key(text.calibration)
    missing = [name for name in (decoder_fidelity.ORIGINAL, REWRITTEN) if not (folder / name).is_file()]
    if missing:
        print(f"error: {folder} lacks {', '.join(missing)}: run bench/decoder_fidelity.py first", file=sys.stderr)
        return 1
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / decoder_fidelity.TOKENIZER))
    passages = decoder_fidelity.encode(text.heldout, tokenizer, CONTEXT + STEPS)
    ids = np.stack([p for p in passages if len(p) == CONTEXT + STEPS][:2])
    machine = fidelity.machine()
    section = markdown(measure(folder, ids, args.threads), folder, args.threads, machine)
    decoder_fidelity.write_section(args.markdown, section, MARKERS)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
