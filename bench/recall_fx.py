"""Pass key recall of SmolLM2-135M-Instruct through the torch/FX path: does the sparse exact
cache (``sparse=G``) make a hedgehog ``window=64`` conversion, zero-shot or calibrated, find a
key the window alone loses (issue 68)?

    python bench/recall_fx.py --contexts 1024 --trials 1            # one trial per row: the seconds
    python bench/recall_fx.py --contexts 1024 2048 --trials 3 --until 04:35

bench/recall.py's prompts and scoring (its Prompts, depths and key_found), on the transformers
model in the cache (float32, sdpa attention) rewritten with ``attnrewrite.rewrite(model,
to="hedgehog", window=64, sparse=G, example_inputs=...)``; the calibrated rows also pass
``calibrate=`` the cache's calibration texts as the CLI's ``--calibrate calibration.txt
--tokenizer tokenizer.json --max-length 512`` makes them (calibration.token_examples' packed
passages), fitting through the sparse cache. Greedy decoding in torch without a KV cache: a
full forward per new token (logits of the last position only), at most NEW_TOKENS tokens,
stopped once the key is written or can no longer be (remaining tokens too few for its missing
digits: the same verdict as decoding all of them). Trials run context by context, depth by
depth, every row at each depth, and the JSON is written after each: ``--until HH:MM`` (UTC)
stops before a trial that would start past it.

Each row states its recurrent state per sequence at SmolLM2's sites as the ONNX decoder's
grouped-query sites carry it (passes.recurrent.rewrite_memory; the sparse cache per key/value
head) and as this torch graph runs it: transformers repeats k and v to the 9 query heads
before attention, so the FX site does not know the grouping and each query head keeps its own
G pairs (Window.groups 1). Writes bench/recall_fx.json and bench/recall_fx.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import fidelity  # machine()
import recall  # Prompts, depths, key_found, NEW_TOKENS
import smollm2_fidelity  # DEFAULT_CACHE
from common import shown

DEFAULT_JSON, DEFAULT_MARKDOWN = HERE / "recall_fx.json", HERE / "recall_fx.md"
ORIGINAL = "original (transformers, sdpa)"
ROWS = {
    ORIGINAL: None,
    "hedgehog window=64": {"window": 64, "sparse": 0},
    "hedgehog window=64 sparse=64": {"window": 64, "sparse": 64},
    "hedgehog window=64 sparse=128": {"window": 64, "sparse": 128},
    "hedgehog window=64, calibrated": {"window": 64, "sparse": 0},
    "hedgehog window=64 sparse=64, calibrated": {"window": 64, "sparse": 64},
}
CALIBRATED = {label for label in ROWS if label.endswith(", calibrated")}
CALIBRATION_LENGTH = 512  # tokens a passage: the sparse cache takes keys from position 128 on
# SmolLM2-135M's attention: 30 layers, 9 query heads sharing 3 key/value heads, head dim 64
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
KEY_DIGITS = 5
EXAMPLE_LENGTH = 256  # torch.export's example: any length past two windows


# --- pure -----------------------------------------------------------------------------------------


def digits_missing(text: str, key: int) -> int:
    """The digits the continuation ``text`` still has to write before it holds ``key`` (0 when it
    does, recall.key_found's verdict): the key less the digits ``text`` ends in, where those are
    the key's first ones, else the whole key."""
    if recall.key_found(text, key):
        return 0
    digits, tail = str(key), re.search(r"\d*$", text).group()
    return len(digits) - len(tail) if digits.startswith(tail) else len(digits)


def decided(text: str, key: int, tokens_left: int, digits_per_token: int) -> bool:
    """Whether more tokens cannot change the verdict: the key is written, or the ``tokens_left``
    tokens (each at most ``digits_per_token`` digits) cannot write its missing digits."""
    missing = digits_missing(text, key)
    return missing == 0 or missing > tokens_left * digits_per_token


def state_bytes(options: dict, kv_heads: int) -> int:
    """Hedgehog's recurrent state with ``options`` per sequence over SmolLM2's sites, its
    key/value parts (the sparse cache and the window) kept for ``kv_heads`` heads."""
    from attnrewrite import passes
    from attnrewrite.passes.recurrent import rewrite_memory
    from attnrewrite.site import AttentionSite, KvCache, MaskKind

    cache = KvCache("past_key", "past_value", "present_key", "present_value", kv_heads=kv_heads)
    shape = dict(rank=4, num_heads=HEADS, head_dim=HEAD_DIM, value_dim=HEAD_DIM, mask=MaskKind.CAUSAL)
    sites = [AttentionSite(f"layer {i}", layer=i, kv_cache=cache, **shape) for i in range(LAYERS)]
    method, parsed = passes.method_and_options("hedgehog", **options)
    return rewrite_memory(method, parsed, sites).state_bytes


def sparse_cache_bytes(options: dict, heads: int) -> int:
    """The sparse cache's share of ``state_bytes`` for ``heads`` heads."""
    return state_bytes(options, heads) - state_bytes({**options, "sparse": 0}, heads)


def kv_bytes_per_token() -> int:
    """The original's fp32 KV cache per token: a key and a value per key/value head per layer."""
    return LAYERS * KV_HEADS * 2 * HEAD_DIM * 4


# --- the models -----------------------------------------------------------------------------------


def last_logits(causal_lm):
    """forward(input_ids) -> the logits after the last position [1, vocab] (the lm head on one
    row, not on every position)."""
    import torch

    class LastLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = causal_lm

        def forward(self, input_ids):
            hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
            return self.lm.lm_head(hidden[:, -1])

    return LastLogits().eval()


def calibration_examples(cache: Path, passages: int | None = None) -> list[tuple]:
    """The calibration texts as (input_ids [1, L],) examples, packed as the CLI packs them (the
    first ``passages`` of them; None: all)."""
    import tokenizers
    import torch

    from attnrewrite import calibration

    texts = [line for line in (cache / "calibration.txt").read_text().splitlines() if line.strip()]
    tokenizer = tokenizers.Tokenizer.from_file(str(cache / "tokenizer.json"))
    examples, _ = calibration.token_examples(tokenizer, texts, CALIBRATION_LENGTH, pack=True)
    return [(torch.tensor([ids]),) for ids in examples[:passages]]


def models(cache: Path, labels: list[str], calibration: list[tuple], log=print) -> tuple[dict, dict]:
    """({label: forward(input_ids) -> last logits}, {label: rewrite seconds}); the calibrated
    rows fit on the ``calibration`` examples."""
    import torch
    import transformers

    import attnrewrite

    causal_lm = transformers.AutoModelForCausalLM.from_pretrained(
        cache / "model", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    original, example = last_logits(causal_lm), torch.randint(0, 49152, (1, EXAMPLE_LENGTH))
    made, seconds = {}, {}
    for label in labels:
        if ROWS[label] is None:
            made[label] = original
            continue
        start = time.perf_counter()
        fitting = {"calibrate": calibration} if label in CALIBRATED else {}
        made[label] = attnrewrite.rewrite(original, to="hedgehog", example_inputs=(example,), **ROWS[label], **fitting)
        sites = made[label].meta["attnrewrite"]["sites"]
        rewritten = sum(site["status"] == "rewritten" for site in sites)
        if rewritten != LAYERS:
            raise SystemExit(f"{label}: {rewritten} of {len(sites)} sites rewritten: {sites}")
        seconds[label] = round(time.perf_counter() - start, 1)
        log(f"{label}: rewritten ({rewritten} sites, {seconds[label]} s)")
    return made, seconds


def continuation(model, ids: list[int], key: int, tokenizer, new_tokens: int, digits_per_token: int):
    """Greedy decoding without a cache: (the tokens written, their text), stopped once decided."""
    import torch

    sequence, written = torch.tensor([ids]), []
    with torch.no_grad():
        for step in range(new_tokens):
            token = int(model(sequence)[0].argmax())
            written.append(token)
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
            text = tokenizer.decode(written)
            if decided(text, key, new_tokens - step - 1, digits_per_token):
                break
    return written, text


def most_digits(tokenizer) -> int:
    """The most digits any token of the vocabulary holds."""
    return max(sum(c.isdigit() for c in piece) for piece in tokenizer.get_vocab())


# --- the run --------------------------------------------------------------------------------------


def past(until: str | None) -> bool:
    if until is None:
        return False
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%H:%M") >= until


def run_trials(args, made: dict, prompts, results: dict, log=print) -> None:
    """Every row at each context's depths in turn; results written after each trial."""
    digits_per_token = most_digits(prompts.tokenizer)
    for length in args.contexts:
        for trial in prompts.passkey(length, args.trials):
            for label, model in made.items():
                if past(args.until):
                    log(f"past {args.until} UTC: stopped")
                    return
                start = time.perf_counter()
                tokens, text = continuation(
                    model, trial["ids"], trial["key"], prompts.tokenizer, args.new_tokens, digits_per_token
                )
                seconds = round(time.perf_counter() - start, 1)
                found = recall.key_found(text, trial["key"])
                cell = results["rows"][label].setdefault("passkey", {}).setdefault(str(length), [])
                cell.append(
                    {"depth": trial["depth"], "key": trial["key"], "found": found, "wrote": text}
                    | {"tokens": len(tokens), "seconds": seconds}
                )
                log(f"{label} at {length}, depth {trial['depth']}: {'found' if found else repr(text)} ({seconds} s)")
                args.json.write_text(json.dumps(results, indent=2) + "\n")
                args.markdown.write_text(markdown(results))


def row_entry(label: str, rewrite_seconds: dict) -> dict:
    options = ROWS[label]
    if options is None:
        return {"kv_bytes_per_token": kv_bytes_per_token()}
    return {
        "options": options,
        "state_bytes": state_bytes(options, KV_HEADS),
        "state_bytes_as_run": state_bytes(options, KV_HEADS)
        + sparse_cache_bytes(options, HEADS)
        - sparse_cache_bytes(options, KV_HEADS),
        "rewrite_seconds": rewrite_seconds[label],
    }


def fitting_said(rows: dict) -> str:
    """The title's word for how this run's rewritten rows were fitted."""
    fitted = {label in CALIBRATED for label in rows if ROWS[label] is not None}
    if fitted == {True}:
        return "calibrated"
    return "zero-shot and calibrated" if True in fitted else "zero-shot"


def calibration_said(results: dict) -> str:
    """How the calibrated rows were fitted ("" for a run without them)."""
    if "calibration_passages" not in results:
        return ", nothing calibrated"
    return (
        f"; the calibrated rows with `calibrate=` the first {results['calibration_passages']} packed passages "
        f"of {CALIBRATION_LENGTH} tokens of the cache's calibration.txt (as `--calibrate calibration.txt "
        f"--tokenizer tokenizer.json --max-length {CALIBRATION_LENGTH}` packs them), fitted through the sparse cache"
    )


def markdown(results: dict) -> str:
    rows = results["rows"]
    contexts = sorted({int(n) for row in rows.values() for n in row.get("passkey", {})})
    per_token = kv_bytes_per_token()
    lines = [
        f"# Pass key through the torch/FX path: SmolLM2-135M-Instruct, {fitting_said(rows)}",
        "",
        f"{results['date']}, {results['processor']} ({results['cpus']} cpus, load {results['load_average_at_start']}, "
        f"one thread), commit {results['commit']}: `{results['command']}`. The transformers model in "
        "`$XDG_CACHE_HOME/attnrewrite-bench/smollm2/model` (float32, sdpa), rewritten by "
        '`attnrewrite.rewrite(model, to="hedgehog", window=64, sparse=G, example_inputs=...)`'
        f"{calibration_said(results)}; bench/recall.py's prompts (depths {recall.depths(results['trials'])}), "
        f"greedy decoding without a cache, at most {results['new_tokens']} new tokens. state: the recurrent form's bytes per "
        "sequence at SmolLM2's grouped sites (sparse cache per key/value head) and the KV tokens they buy; as run: "
        "this torch graph's, whose sparse cache is per query head (the FX site sees k and v repeated to 9 heads).",
        "",
        "| model | state | as run | " + " | ".join(f"key {n}" for n in contexts) + " | s / trial |",
        "|---|---:|---:|" + "---:|" * (len(contexts) + 1),
    ]
    for label, row in rows.items():
        keys = [row.get("passkey", {}).get(str(n), []) for n in contexts]
        found = [f"{sum(t['found'] for t in cell)}/{len(cell)}" if cell else "" for cell in keys]
        if "state_bytes" in row:
            state = f"{row['state_bytes'] / 1e6:.2f} MB ({row['state_bytes'] // per_token} tok)"
            as_run = f"{row['state_bytes_as_run'] / 1e6:.2f} MB"
        else:
            state, as_run = f"KV cache, {per_token / 1e3:.1f} kB / token", ""
        per_trial = [f"{sum(t['seconds'] for t in cell) / len(cell):.0f}" for cell in keys if cell]
        lines.append(f"| {label} | {state} | {as_run} | " + " | ".join(found) + f" | {' / '.join(per_trial)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=smollm2_fidelity.DEFAULT_CACHE)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--trials", type=int, default=3, help="trials per context (depths 10-90%%)")
    parser.add_argument("--new-tokens", type=int, default=recall.NEW_TOKENS)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="LABEL")
    parser.add_argument("--until", metavar="HH:MM", help="start no trial past this time (UTC)")
    parser.add_argument(
        "--calibration-passages", type=int, metavar="N", help="the calibrated rows fit on the first N (default: all)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = parse_args(argv)
    measured = fidelity.machine()
    measured.pop("attnrewrite")  # this machine's path
    command = shown(shlex.join(["python", "bench/recall_fx.py", *sys.argv[1:]]))
    calibrated = CALIBRATED.intersection(args.rows)
    calibration = calibration_examples(args.cache, args.calibration_passages) if calibrated else []
    made, rewrite_seconds = models(args.cache, args.rows, calibration)
    results = {"date": datetime.date.today().isoformat(), **measured, "torch": torch.__version__}
    results |= {"command": command, "trials": args.trials, "new_tokens": args.new_tokens}
    if calibrated:
        results["calibration_passages"] = len(calibration)
    results["rows"] = {label: row_entry(label, rewrite_seconds) for label in args.rows}
    run_trials(args, made, recall.Prompts(args.cache), results)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    args.markdown.write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
