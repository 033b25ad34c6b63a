"""Recall of SmolLM2-135M-Instruct against the same bytes of KV cache: what a recurrent state
remembers beside the cheapest thing its bytes buy, the first few and the last R tokens of the
cache kept exactly (``--to streaming``, StreamingLLM's cache), issue 68.

    python bench/recall.py --quick                            # 2 trials at 512 and 1024: a smoke run
    python bench/recall.py --trials 10 --trials-at 4096=5 --trials-at 8192=2
    python bench/recall.py --only "hedgehog window=64, zero-shot" --skip copy
    python bench/recall.py --rows "calibrated: --to hedgehog -O window=64 --recurrent --calibrate calibration.txt --tokenizer tokenizer.json"

Three tests, every model on the same inputs:

- pass key: a 5-digit key (" The pass key is 12345. Remember it. 12345 is the pass key.") hidden
  in filler (" The grass is green. The sky is blue. ...") at depth d of a prompt of L tokens, the
  question last; the trials' depths spread evenly over 10%-90%. Found when onnxruntime-genai's
  greedy continuation (NEW_TOKENS tokens, the prompt appended in chunks of CHUNK) writes the key.
- copy at distance: a PASSAGE-token held-out passage, D tokens of other held-out text, the passage
  again; the share of the second copy's next tokens (argmax, but its first) equal to the true ones.
- held-out text: HELDOUT_LENGTH-token passages of bench/corpus.py's held-out texts (never
  calibration's): next-token agreement with the original and perplexity ratio from position 128.

The copy and held-out tests run each folder's model.onnx in one call from an empty cache or a zero
state (genai_smollm2.prefilled_logits). The models: the builder's folder of bench/genai_smollm2.py
(the original, its KV cache) and a folder per row written by the CLI (``attnrewrite BUILDER ARGS
-o DIR/``, run in --cache). A row's ARGS may say {tokens}, the KV tokens that hedgehog window=64's
state buys (``attnrewrite --list``'s state line), and {recent}, those less SINKS: the defaults are
that window with and without its sinks and hedgehog window=64 zero-shot; --rows adds others by
their arguments. Writes bench/recall.json (a run replaces the entries it measures), the "Recall"
section of bench/FIDELITY.md and bench/recall.png.
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

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import decoder_fidelity  # run_cli, next_token, write_section
import fidelity  # machine(), the section markers of FIDELITY.md
import genai_smollm2  # builder_folder, carried_bytes, prefilled_logits
import smollm2_fidelity  # prepare, evaluate, measured_lines
from common import shown

DEFAULT_JSON, DEFAULT_MARKDOWN, DEFAULT_PLOT = HERE / "recall.json", HERE / "FIDELITY.md", HERE / "recall.png"
BUILDER, FOLDERS = "genai/builder", "genai/recall"  # in the cache
ORIGINAL = "original (KV cache)"
SINKS = 4
DEFAULT_ROWS = {
    "window, same bytes": "--to streaming -O recent={recent} -O sinks=4 --recurrent",
    "window, no sinks": "--to streaming -O recent={tokens} -O sinks=0 --recurrent",
    "hedgehog window=64, zero-shot": "--to hedgehog -O window=64 --recurrent",
}
BUDGET = ["--to", "hedgehog", "-O", "window=64", "--recurrent"]  # the state whose bytes the window gets
CONTEXTS = (512, 1024, 2048, 4096, 8192)
DISTANCES = (64, 128, 256, 512, 1024, 1792)
TESTS = ("passkey", "copy", "heldout")
PASSAGE, HELDOUT_LENGTH = 96, 2048
NEW_TOKENS, CHUNK = 8, 256  # a window's chunk attends to its C + R keys: small chunks are cheaper
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


# --- the tests' inputs and scores (pure) ------------------------------------------------------------


def depths(trials: int) -> list[float]:
    """The trials' depths, evenly from 10% to 90% (one trial: the middle)."""
    return [0.5] if trials == 1 else [round(float(d), 3) for d in np.linspace(0.1, 0.9, trials)]


def pass_keys(trials: int, seed: int) -> list[int]:
    """``trials`` 5-digit keys, the same for every model."""
    return [int(k) for k in np.random.default_rng(seed).integers(10_000, 100_000, trials)]


def passkey_prompt(
    intro: list[int], filler: list[int], needle: list[int], question: list[int], length: int, depth: float
) -> tuple[list[int], int]:
    """(ids of exactly ``length`` tokens, where the needle starts): the intro, the filler repeated
    (cut at a token), the needle starting at token round(depth * length) (kept after the intro
    and before the question), more filler, the question last."""
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"a prompt of {length} tokens has no room for the intro, the key and the question")
    start = min(max(round(depth * length), len(intro)), length - len(needle) - len(question))
    fill = (filler * (room // len(filler) + 1))[:room]
    before = start - len(intro)
    return [*intro, *fill[:before], *needle, *fill[before:], *question], start


def key_found(text: str, key: int) -> bool:
    """Whether the continuation writes the key (not inside a longer number)."""
    return re.search(rf"(?<!\d){key}(?!\d)", text) is not None


def copy_sequence(passage: list[int], other: list[int]) -> tuple[list[int], int]:
    """(the passage, the other text, the passage again; where the second copy starts)."""
    return [*passage, *other, *passage], len(passage) + len(other)


def copy_score(predicted: np.ndarray, ids: list[int], start: int) -> float:
    """The share of the second copy's tokens after its first (from ``start`` + 1 to the end)
    that ``predicted`` (the argmax after each position, decoder_fidelity.next_token's) gets."""
    return float(np.mean(predicted[start:] == np.asarray(ids[start + 1 :])))


def slices(stream: list[int], lengths: list[int]) -> list[list[int]]:
    """Consecutive pieces of ``stream`` of the given lengths (disjoint, from its start)."""
    if sum(lengths) > len(stream):
        raise ValueError(f"the held-out text has {len(stream)} tokens, {sum(lengths)} asked for")
    ends = np.cumsum(lengths)
    return [stream[end - n : end] for n, end in zip(lengths, ends)]


def kv_tokens(listing: str) -> int:
    """The KV tokens a state buys, from the state line ``attnrewrite --list`` prints."""
    found = re.search(r"the KV cache of (\d+) tokens", listing)
    if found is None:
        raise ValueError(f"no state line in: {listing.strip()[-300:]}")
    return int(found.group(1))


def parse_row(text: str) -> tuple[str, str]:
    """``LABEL: ARGS`` -> (label, args)."""
    label, sep, args = text.partition(": ")
    if not sep or not label.strip() or not args.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a row is 'LABEL: CLI ARGUMENTS'")
    return label.strip(), args.strip()


def folder_name(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def trials_at(contexts: list[int], trials: int, overrides: list[str]) -> dict[int, int]:
    """Trials per context: ``trials``, but where ``L=N`` says otherwise."""
    chosen = dict.fromkeys(contexts, trials)
    for override in overrides:
        length, _, count = override.partition("=")
        chosen[int(length)] = int(count)
    return {length: n for length, n in chosen.items() if n > 0}


# --- the models ---------------------------------------------------------------------------------


def rewrite_row(cache: Path, label: str, args: str, sizes: dict, reuse: bool, log=print) -> dict:
    """Write the row's folder with the CLI in the cache: {"command", "folder", "seconds"}."""
    folder = f"{FOLDERS}/{folder_name(label)}/"
    command = ["attnrewrite", BUILDER, *shlex.split(args.format(**sizes)), "-o", folder]
    row = {"command": shlex.join(command), "folder": folder, "seconds": None}
    if reuse and (cache / folder / "genai_config.json").is_file():
        log(f"{label}: reusing {folder}")
        return row
    log(f"{label}: $ {row['command']}")
    start = time.perf_counter()
    done = decoder_fidelity.run_cli(command, cache)
    if done.returncode:
        raise SystemExit(f"{label}: the rewrite failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return row | {"seconds": round(time.perf_counter() - start, 1)}


def budget_sizes(cache: Path) -> dict:
    """{"tokens": the KV tokens hedgehog window=64's state buys, "recent": those less SINKS}."""
    done = decoder_fidelity.run_cli(["attnrewrite", BUILDER, "--list", *BUDGET], cache)
    tokens = kv_tokens(done.stdout + done.stderr)
    return {"tokens": tokens, "recent": tokens - SINKS}


# --- measuring ----------------------------------------------------------------------------------


class Prompts:
    """The tests' token ids, from SmolLM2's tokenizer and the cached held-out texts."""

    def __init__(self, cache: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(cache / smollm2_fidelity.TOKENIZER))
        texts = [line for line in (cache / "heldout.txt").read_text().splitlines() if line.strip()]
        self.stream = self.ids("\n\n".join(texts))

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def passkey(self, length: int, trials: int) -> list[dict]:
        """The trials at ``length``: {"depth", "key", "ids"}."""
        parts = [self.ids(INTRO), self.ids(FILLER)]
        made = []
        for depth, key in zip(depths(trials), pass_keys(trials, seed=length)):
            needle, question = self.ids(NEEDLE.format(key=key)), self.ids(QUESTION)
            ids, _ = passkey_prompt(*parts, needle, question, length, depth)
            made.append({"depth": depth, "key": key, "ids": ids})
        return made

    def copies(self, distances: list[int], trials: int) -> dict[int, list[tuple[list[int], int]]]:
        """Per distance, ``trials`` copy sequences, each from its own stretch of the held-out text."""
        lengths = [n for d in distances for _ in range(trials) for n in (PASSAGE, d)]
        pieces = iter(slices(self.stream, lengths))
        return {d: [copy_sequence(next(pieces), next(pieces)) for _ in range(trials)] for d in distances}

    def heldout(self, count: int) -> list[np.ndarray]:
        return [np.array(p, np.int64) for p in slices(self.stream, [HELDOUT_LENGTH] * count)]


def continuation(model, ids: list[int], new_tokens: int) -> list[int]:
    """genai's greedy continuation of ``ids``, the prompt appended CHUNK tokens at a time."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens)
    generator = og.Generator(model, params)
    for start in range(0, len(ids), CHUNK):
        generator.append_tokens(np.array([ids[start : start + CHUNK]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return generator.get_sequence(0)[len(ids) :].tolist()


def passkey_results(folder: Path, prompts: Prompts, trials: dict[int, int], log=print) -> dict:
    """Per context: {"found", "trials", "depths", "missed", "seconds"}; what a miss wrote kept."""
    import onnxruntime_genai as og

    model, results = og.Model(str(folder)), {}
    limit = json.loads((folder / "genai_config.json").read_text())["model"]["context_length"]
    for length, count in trials.items():
        start, found, missed = time.perf_counter(), 0, []
        for trial in prompts.passkey(min(length, limit - NEW_TOKENS), count):  # 8192: 8184 and 8 new
            text = prompts.tokenizer.decode(continuation(model, trial["ids"], NEW_TOKENS))
            if key_found(text, trial["key"]):
                found += 1
            else:
                missed.append({"depth": trial["depth"], "key": trial["key"], "wrote": text})
        seconds = round(time.perf_counter() - start, 1)
        results[str(length)] = {"found": found, "trials": count, "depths": depths(count), "missed": missed}
        results[str(length)]["seconds"] = seconds
        log(f"  pass key at {length}: {found}/{count} ({seconds} s)")
    return results


def copy_results(folder: Path, copies: dict, log=print) -> dict:
    """Per distance: {"score": the mean share over the trials, "trials", "seconds"}."""
    from attnrewrite.onnx.validate import make_session

    session, results = make_session(str(folder / "model.onnx")), {}
    for distance, sequences in copies.items():
        start, scores = time.perf_counter(), []
        for ids, second in sequences:
            logits = genai_smollm2.prefilled_logits(session, str(folder), np.array(ids, np.int64))
            scores.append(copy_score(decoder_fidelity.next_token(logits, np.array(ids))[0], ids, second))
        seconds = round(time.perf_counter() - start, 1)
        results[str(distance)] = {"score": float(np.mean(scores)), "trials": len(scores), "seconds": seconds}
        log(f"  copy at {distance}: {results[str(distance)]['score']:.3f} ({seconds} s)")
    return results


def heldout_results(folders: dict[str, Path], passages: list[np.ndarray], log=print) -> dict:
    """Per folder but the original's: smollm2_fidelity.evaluate's figures against it, each
    passage in one call; the seconds of the whole test."""
    start = time.perf_counter()
    paths = {"original" if label == ORIGINAL else label: folder / "model.onnx" for label, folder in folders.items()}
    figures = smollm2_fidelity.evaluate(paths, passages, logits_of=genai_smollm2.prefilled_logits)
    seconds = round(time.perf_counter() - start, 1)
    log(f"  held-out text: {len(passages)} passages of {HELDOUT_LENGTH} tokens ({seconds} s, every model)")
    return {label: figures["original" if label == ORIGINAL else label] for label in folders if label != ORIGINAL}


# --- the section and the plot ---------------------------------------------------------------------


def state_cell(row: dict, contexts: list[int]) -> str:
    """A recurrent row's state, the original's KV cache at the longest context."""
    if "kv_bytes_per_token" in row:
        longest = max(contexts)
        return f"KV cache: {row['kv_bytes_per_token'] * longest / 1e6:.0f} MB at {longest}"
    return f"{row['state_bytes'] / 1e6:.1f} MB"


def passkey_cell(row: dict, length: int) -> str:
    found = row.get("passkey", {}).get(str(length))
    return f"{found['found']}/{found['trials']}" if found else ""


def copy_cell(row: dict, distance: int) -> str:
    found = row.get("copy", {}).get(str(distance))
    return f"{found['score']:.2f}" if found else ""


def heldout_cells(row: dict) -> list[str]:
    if "heldout" not in row:
        return ["1", "1"] if "kv_bytes_per_token" in row else ["", ""]
    return [f"{row['heldout']['agreement_far']:.3f}", f"{row['heldout']['perplexity_ratio_far']:.2f}"]


def time_cell(row: dict) -> str:
    rewrite = "" if row.get("seconds") is None else f"{row['seconds']:.0f} s + "
    seconds = sum(entry["seconds"] for test in ("passkey", "copy") for entry in row.get(test, {}).values())
    seconds += row.get("measure_seconds", {}).get("heldout", 0)
    return f"{rewrite}{seconds / 60:.1f} min"


def measured_line(runs: list[dict]) -> str:
    """Where and when the runs measured, once: the machine, the versions, each run's commit and load."""
    known = [run["measured"] for run in runs if "measured" in run]
    said = {
        f"{m['date']} on {m['processor']}, {m['cpus']} CPUs, onnxruntime {m['onnxruntime']}, onnxruntime-genai "
        f"{m['genai']}"
        for m in known
    }
    commits = ", ".join(dict.fromkeys(m["commit"] for m in known))
    loads = "; ".join(
        ", ".join(f"{x:g}" for x in m["load_average_at_start"]) if m.get("load_average_at_start") else "not recorded"
        for m in known
    )
    return f"Measured {' and '.join(sorted(said))}, commits {commits} (load averages at the runs' starts: {loads})."


def runs_said(runs: list[dict]) -> str:
    return " ".join(f"`{run['command']}`: {run['setup']}" for run in runs)


def markdown(results: dict) -> str:
    rows = results["rows"]
    contexts = sorted({int(n) for row in rows.values() for n in row.get("passkey", {})})
    distances = sorted({int(d) for row in rows.values() for d in row.get("copy", {})})
    header = ["model", "state", *(f"key {n}" for n in contexts), *(f"copy {d}" for d in distances)]
    header += ["2k: agree", "ppl x", "time"]
    lines = [
        "## Recall: SmolLM2-135M-Instruct's state against the same bytes of KV cache",
        "",
        f"{runs_said(results['runs'])} The builder's folder (the original) and the CLI's folders below (run in "
        "`$XDG_CACHE_HOME/attnrewrite-bench/smollm2`; the window's tokens are the "
        f"{results['tokens']} that hedgehog window=64's state buys), on onnxruntime CPU. key L: pass key found by "
        f"genai's greedy decoding in a prompt of L tokens (8192: {8192 - NEW_TOKENS}), depths 10-90% (one trial: "
        f"50%); copy D: share of a {PASSAGE}-token passage's second copy after D tokens; 2k: agreement and "
        f"perplexity ratio from position 128 on {HELDOUT_LENGTH}-token held-out text (copy and 2k: model.onnx in "
        "one call); time: rewrite + measuring.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
    ]
    for label, row in rows.items():
        cells = [label, state_cell(row, contexts), *(passkey_cell(row, n) for n in contexts)]
        cells += [*(copy_cell(row, d) for d in distances), *heldout_cells(row), time_cell(row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {label}: `{row['command']}`" for label, row in rows.items() if "command" in row)]
    lines += ["", measured_line(results["runs"]), "", "![recall](recall.png)"]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    figure, (keys, copies, text) = plt.subplots(1, 3, figsize=(15, 4.5), width_ratios=(1, 1, 0.8))
    rows = results["rows"]
    for label, row in rows.items():
        found = sorted((int(n), v["found"] / v["trials"]) for n, v in row.get("passkey", {}).items())
        copied = sorted((int(d), v["score"]) for d, v in row.get("copy", {}).items())
        if found:
            keys.plot(*zip(*found), marker="o", label=label)
        if copied:
            copies.plot(*zip(*copied), marker="o", label=label)
    keys.set(xscale="log", xlabel="context (tokens)", ylabel="pass key found", ylim=(-0.05, 1.05))
    keys.set_xticks(CONTEXTS, [str(n) for n in CONTEXTS])
    copies.set(xscale="log", xlabel="distance D (tokens)", ylabel="second copy's tokens right", ylim=(0, 1.05))
    copies.set_xticks(DISTANCES, [str(d) for d in DISTANCES])
    for axes in (keys, copies):
        axes.xaxis.set_minor_formatter(NullFormatter())
    scored = {label: row["heldout"]["agreement_far"] for label, row in rows.items() if "heldout" in row}
    text.barh(list(scored), list(scored.values()))
    text.set(xlabel=f"agreement from position 128, {HELDOUT_LENGTH} tokens", xlim=(0, 1))
    text.invert_yaxis()
    keys.legend(fontsize=8)
    figure.suptitle("SmolLM2-135M-Instruct: recall against the same bytes of KV cache")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --- the run ------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=smollm2_fidelity.DEFAULT_CACHE)
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--trials", type=int, default=10, help="pass key trials per context")
    parser.add_argument("--trials-at", action="append", default=[], metavar="L=N", help="N trials at context L")
    parser.add_argument("--distances", type=int, nargs="+", default=list(DISTANCES))
    parser.add_argument("--copy-trials", type=int, default=3)
    parser.add_argument("--heldout-passages", type=int, default=4)
    parser.add_argument("--rows", nargs="+", action="extend", default=[], type=parse_row, metavar="'LABEL: ARGS'")
    parser.add_argument("--only", action="append", default=[], metavar="LABEL", help="measure only these rows")
    parser.add_argument("--skip", action="append", default=[], choices=TESTS)
    parser.add_argument("--reuse", action="store_true", help="keep the folders an earlier run wrote")
    parser.add_argument("--quick", action="store_true", help="2 trials at 512 and 1024, 1 copy and passage")
    parser.add_argument("--report", action="store_true", help="only write the section and the plot from --json")
    parser.add_argument("--merge", type=Path, nargs="+", default=[], help="add the rows of other runs' JSON files")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.trials, args.copy_trials, args.heldout_passages = [512, 1024], 2, 1, 1
        args.distances = [64, 512]
    return args


def measure(label: str, folder: Path, args, prompts: Prompts, log=print) -> dict:
    """The row's pass key and copy results, each entry with its seconds."""
    row = {}
    if "passkey" not in args.skip:
        trials = trials_at(args.contexts, args.trials, args.trials_at)
        row["passkey"] = passkey_results(folder, prompts, trials, log)
    if "copy" not in args.skip:
        row["copy"] = copy_results(folder, prompts.copies(args.distances, args.copy_trials), log)
    return row


def merged(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s entries, a test's per-length results entry by entry."""
    out = {**old}
    for key, value in new.items():
        if key == "seconds" and value is None:  # a folder reused: its rewrite's time kept
            continue
        out[key] = {**old.get(key, {}), **value} if key in ("passkey", "copy", "measure_seconds") else value
    return out


def merged_results(results: dict, other: dict) -> dict:
    """``results`` with another run's rows (merged) and runs (a run of those written at the same time)."""
    rows = {**results["rows"]}
    for label, row in other["rows"].items():
        rows[label] = merged(rows.get(label, {}), row)
    runs = [run for run in results.get("runs", []) if run not in other["runs"]]
    return {**results, "rows": rows, "runs": [*runs, *other["runs"]], "tokens": other["tokens"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = json.loads(args.json.read_text()) if args.json.is_file() else {"rows": {}}
    if not args.report:
        results = measured_results(args, results)
    for other in args.merge:
        results = merged_results(results, json.loads(other.read_text()))
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    decoder_fidelity.write_section(args.markdown, markdown(results), fidelity.RECALL_MARKERS)
    plot(results, args.plot)
    print(markdown(results))
    return 0


def measured_results(args, results: dict) -> dict:
    """``results`` with this run's rows measured, written to --json after each row."""
    import onnxruntime_genai as og

    cache = smollm2_fidelity.prepare(args.cache, calibration_texts=96)
    genai_smollm2.builder_folder(cache / "model", cache / BUILDER)
    sizes = budget_sizes(cache)
    wanted = {ORIGINAL: None, **DEFAULT_ROWS, **dict(args.rows)}
    wanted = {label: a for label, a in wanted.items() if not args.only or label in args.only}
    prompts = Prompts(cache)
    measured = {"date": datetime.date.today().isoformat(), **fidelity.machine(), "genai": og.__version__}
    measured.pop("attnrewrite")  # this machine's path
    command = shown(shlex.join(["python", "bench/recall.py", *sys.argv[1:]]))
    results["tokens"] = sizes["tokens"]
    runs = [run for run in results.get("runs", []) if run["command"] != command]
    results["runs"] = [*runs, {"command": command, "setup": setup_line(args), "measured": measured}]
    folders = {ORIGINAL: cache / BUILDER}
    for label, arguments in wanted.items():
        row = {} if arguments is None else rewrite_row(cache, label, arguments, sizes, args.reuse)
        folders[label] = cache / row.get("folder", BUILDER)
        carried = genai_smollm2.carried_bytes(folders[label], 1)
        row |= {"kv_bytes_per_token": carried} if arguments is None else {"state_bytes": carried}
        row |= measure(label, folders[label], args, prompts)
        results["rows"][label] = merged(results["rows"].get(label, {}), row)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if "heldout" not in args.skip:
        start = time.perf_counter()
        for label, figures in heldout_results(folders, prompts.heldout(args.heldout_passages)).items():
            results["rows"][label]["heldout"] = figures
        share = round((time.perf_counter() - start) / len(folders), 1)  # every model ran once
        for label in wanted:
            results["rows"][label].setdefault("measure_seconds", {})["heldout"] = share
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


def setup_line(args) -> str:
    """What the run measured."""
    said = []
    if "passkey" not in args.skip:
        trials = trials_at(args.contexts, args.trials, args.trials_at)
        said.append("pass key trials " + ", ".join(f"{n} at {length}" for length, n in trials.items()))
    if "copy" not in args.skip:
        said.append(f"copy {args.copy_trials} per distance")
    if "heldout" not in args.skip:
        said.append(f"held-out text {args.heldout_passages} passages")
    return "; ".join(said) + "."


if __name__ == "__main__":
    raise SystemExit(main())
