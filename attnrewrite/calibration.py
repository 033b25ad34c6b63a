"""Calibration, the frontend-independent part: settings, checks, and the data to fit on.

``--calibrate DATA`` fits every replacement to the exact attention it replaces (attnrewrite/passes/fit.py
does the fitting; the ONNX and FX frontends only collect each site's q, k, v and key_keep).
DATA is model inputs: an ``.npz`` keyed by input name (batch axis stacked), a text file (one
text per line) made into token ids by a ``tokenizers`` tokenizer.json, or arrays / tensors given
to the API. Text is packed by default: consecutive texts joined into passages of the length
asked for (TextData says what was done). The record keeps, per site, the loss before and after,
the steps, how much data was used and a sha256 of it, never the data; what the kernel part of a
window saw (passes.fit.far_key_coverage); and the guard's figures: from GUARD_MIN_EXAMPLES
examples up, a part of the data is held out (held_out_split, HeldOut), never fitted on, and the
fitted values are kept only where the whole model is no further from the original there than
with the zero-shot ones.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from attnrewrite.data import conform, load_inputs, load_tokenizer, split_batch
from attnrewrite.errors import AttnRewriteError, require_file
from attnrewrite.onnx.inputs import model_around, prefill_filled, with_prefill_inputs
from attnrewrite.passes.finetune import ALPHA_PER_RANK, DEFAULT_RANK
from attnrewrite.passes.finetune import DEFAULT_LR as FINETUNE_LR
from attnrewrite.passes.finetune import DEFAULT_STEPS as FINETUNE_STEPS
from attnrewrite.passes.fit import DEFAULT_STEPS, fingerprint
from attnrewrite.progress import TerminalProgress

DEFAULT_MAX_LENGTH = 256
BATCH_SIZE = 8  # examples per onnxruntime run while collecting
# inputs a tokenizer's encoding gives, by the names models use for them
TEXT_INPUTS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
NPZ_MAGIC = b"PK\x03\x04"
LOW_COVERAGE = 0.25  # below this share of queries seeing far keys, the kernel part was barely fitted: said
# The guard (HeldOut) holds out the last batch or this share of the examples, whichever is larger,
# where the data has at least GUARD_MIN_EXAMPLES: a figure on one or two examples judges noise,
# and a small data set needs every example to fit on.
HELD_OUT_SHARE = 0.1
GUARD_MIN_EXAMPLES = 20
GUARD_TIE = 1e-6  # held-out cosines closer than this are a tie: rounding, not the fit


@dataclasses.dataclass
class Calibration:
    """What to fit on and how. ``batches``: the data as model-input dicts (one per run);
    ``fingerprint``, ``examples``, ``tokens``: what the record says about it."""

    batches: list
    fingerprint: str
    examples: int
    tokens: int | None
    steps: int = DEFAULT_STEPS
    lr: float | None = None  # None: the method's rate (passes.fit.fit_site)
    seed: int = 0
    ce_weight: float = 0.0
    end_to_end: int = 0  # steps fitting all sites together on the model's outputs (passes.fit.fit_end_to_end)
    finetune: Finetune | None = None  # stage 2: adapters on the sites' projections (passes/finetune.py)
    progress: Callable[[str], None] | None = None
    text: TextData | None = None  # for text data: how the lines became examples
    held_out: HeldOut | None = None  # what the guard compares on (never fitted on); None: no guard
    original: OriginalModel | None = None  # stage 2's teacher, loaded before the rewrite (ONNX, with finetune)
    terminal: TerminalProgress = dataclasses.field(
        default_factory=lambda: TerminalProgress("calibrating", "site"), repr=False, compare=False
    )  # without ``progress``: the lines on stderr, under them on a terminal the sites done and the time left
    finetune_terminal: TerminalProgress = dataclasses.field(
        default_factory=lambda: TerminalProgress("fine-tuning", "step"), repr=False, compare=False
    )  # stage 2's steps done and the time left, on a terminal

    def say(self, line: str) -> None:
        (self.progress or self.terminal.say)(line)

    def finetune_step_done(self, done: int, steps: int) -> None:
        """Stage 2 has taken ``done`` of its ``steps`` (a bar on a terminal; nothing in a log)."""
        if self.progress is None:
            self.finetune_terminal.done(done, steps)

    def report(self, index: int, total: int, layer, result) -> dict[str, Any]:
        """Say how site ``index`` went (stderr by default); the record's entry for it."""
        line = (
            f"calibrating site {index + 1}/{total} (layer {layer}): loss {result.loss_before:.4g} -> "
            f"{_after(result)} {_how(result)}"
        )
        self.say(line)
        if self.progress is None:
            self.terminal.done(index + 1, total)
        coverage = result.coverage
        if coverage is not None and coverage["queries"] < LOW_COVERAGE:
            self.say(self._low_coverage(index, coverage["queries"]))
        return {
            "loss_before": result.loss_before,
            "loss_after": result.loss_after,
            **_rejected(result),
            "steps": result.steps,
            "lr": result.lr,
            "seed": self.seed,
            "ce_weight": self.ce_weight,
            "examples": self.examples,
            "tokens": self.tokens,
            "samples": result.examples,
            "query_rows": result.query_rows,
            "measured_batches": result.measured_batches,
            "batches": result.batches,
            "data_sha256": self.fingerprint,
            **({"coverage": coverage} if coverage is not None else {}),
            **({"text": self.text.as_dict()} if self.text is not None else {}),
        }

    def judge(self, zero_shot: float, calibrated: float) -> dict[str, Any]:
        """The guard's verdict on the held-out figures (the whole model's cosine with the
        original, zero-shot and calibrated), said in one line: the record's entry for it, whose
        ``kept`` is "zero-shot" where fitting did not make the model better there: a held-out part
        that cannot tell the two apart (short texts all inside a window's exact part) proves
        nothing for the longer inputs the fitted values would meet."""
        kept = "calibrated" if calibrated > zero_shot + GUARD_TIE else "zero-shot"
        tie = " (a tie: fitting was not shown to help)" if abs(calibrated - zero_shot) <= GUARD_TIE else ""
        self.say(
            f"kept {kept}: held-out cosine {zero_shot:.4f} zero-shot, {calibrated:.4f} calibrated "
            f"(on {self.held_out.examples} examples not fitted on){tie}"
        )
        return {
            "examples": self.held_out.examples,
            "cosine_zero_shot": zero_shot,
            "cosine_calibrated": calibrated,
            "kept": kept,
        }

    def _low_coverage(self, index: int, queries: float) -> str:
        packing_off = " (packing is off)" if self.text is not None and not self.text.packed else ""
        return (
            f"site {index + 1}: the kernel part saw far keys for {queries:.1%} of queries: "
            f"calibrate on longer inputs{packing_off} or a smaller window"
        )

    def report_end_to_end(self, sites: int, result) -> dict[str, Any]:
        """Say how the end-to-end stage went; the record's entry for it."""
        self.say(
            f"calibrating all {sites} sites end to end: output error {result.loss_before:.4g} -> "
            f"{_after(result)} {_how(result)}"
        )
        entry = result.as_dict()
        del entry["rejected_loss"]  # said by _rejected, only where a fit was undone
        return {**entry, **_rejected(result), "examples": self.examples, "data_sha256": self.fingerprint}

    def report_finetune(self, result, objective: str, held_out: dict | None, adapters: dict) -> dict[str, Any]:
        """Say how fine-tuning went and what the guard kept; the record's entry for it."""
        settings, loss = self.finetune, objective.replace("_", "-")
        count = sum(len(site["projections"]) for site in adapters["adapted"])
        beside = sum(len(site.get("beside", ())) for site in adapters["adapted"])
        kept_beside = f", {beside} of them beside quantized weights" if beside else ""
        self.say(
            f"fine-tuning {count} adapters (rank {settings.rank}{kept_beside}) on {len(adapters['adapted'])} sites "
            f"with their replacements: {loss} {result.loss_before:.4g} -> {_after(result)} {_how(result)}"
        )
        if held_out is not None:
            self.say(
                f"kept {held_out['kept']}: held-out {loss} {held_out['loss_calibrated']:.4g} calibrated, "
                f"{held_out['loss_fine_tuned']:.4g} fine-tuned (on {held_out['examples']} examples not fitted on)"
            )
        entry = {**result.as_dict(), **_rejected(result)}
        del entry["rejected_loss"]
        return {
            **entry,
            "rank": settings.rank,
            "alpha": ALPHA_PER_RANK * settings.rank,
            "lr": settings.lr,
            "objective": objective,
            **adapters,
            "examples": self.examples,
            "tokens": self.tokens,
            "data_sha256": self.fingerprint,
            **({"held_out": held_out} if held_out is not None else {}),
        }


@dataclasses.dataclass(frozen=True)
class Finetune:
    """Stage 2's settings (passes/finetune.py): steps, the adapters' rank, Adam's rate."""

    steps: int = FINETUNE_STEPS
    rank: int = DEFAULT_RANK
    lr: float = FINETUNE_LR


def _after(result) -> str:
    if result.rejected_loss is None:
        return f"{result.loss_after:.4g}"
    return f"{result.rejected_loss:.4g}, worse: the values before fitting kept"


def _how(result) -> str:
    return f"(on {result.measured_batches} of {result.batches} batches; steps {result.steps}, {result.seconds:.1f} s)"


def _rejected(result) -> dict[str, Any]:
    """The record says when a fit was undone (passes.fit.kept_if_lower) and what it had reached."""
    return {} if result.rejected_loss is None else {"kept_unfitted": True, "rejected_loss": result.rejected_loss}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- torch example inputs --------------------------------------------------------------------


def torch_calibration(examples, **settings) -> Calibration:
    """Calibration on torch example inputs: each a tuple of positional arguments (or one
    tensor) or a dict of keyword arguments; ``examples`` in the record counts them. The guard's
    part (held_out_split, each example a batch of one) is held out."""
    batches = [example if isinstance(example, (tuple, dict)) else (example,) for example in examples]
    if not batches:
        raise AttnRewriteError("the calibration inputs hold no example")
    batches, held = held_out_split(batches, rows=lambda example: 1)
    arguments = [list(e.values()) if isinstance(e, dict) else list(e) for e in batches]
    arrays = [x.detach().cpu().numpy() for args in arguments for x in args if hasattr(x, "detach")]
    masks = [e.get("attention_mask") for e in batches if isinstance(e, dict)]
    tokens = None
    if len(masks) == len(batches) and all(hasattr(m, "detach") for m in masks):
        tokens = int(sum(int((m != 0).sum()) for m in masks))
    calibration = Calibration(batches, fingerprint(arrays), len(batches), tokens, **settings)
    if held:
        calibration.held_out = HeldOut(held, len(held))  # the original's outputs: the frontend's (fx.calibrate)
    return calibration


# --- ONNX model inputs -----------------------------------------------------------------------


def onnx_calibration(
    data,
    graph: ir.Graph,
    *,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = BATCH_SIZE,
    pack: bool = True,
    guard: bool = True,
    original: ir.Model | None = None,
    **settings,
) -> Calibration:
    """Calibration on ``data`` for the model whose signature ``graph`` has: an ``.npz`` path,
    a text file path (with ``tokenizer``; its texts packed into passages of ``max_length``
    tokens unless ``pack`` is False), a dict of arrays (batch axis stacked) or a list of such
    dicts (one per batch). For a decoder the data is its tokens (and their mask): each batch
    is a prefill from nothing (onnx.inputs.with_prefill_inputs). With ``guard``, a part of the
    data is held out (held_out_split) with the outputs of ``original`` (default: a model around
    ``graph``, which must not be rewritten yet) on it: the guard's reference (HeldOut)."""
    where = "the calibration inputs"
    filled = prefill_filled(graph)
    text = None
    if isinstance(data, dict):
        batches = split_batch(conform(data, graph, where, filled), batch_size)
    elif isinstance(data, (list, tuple)):
        batches = [conform(feeds, graph, where, filled) for feeds in data]
    else:
        where = str(data)
        batches, text = _from_file(Path(data), graph, tokenizer, max_length, batch_size, pack)
    if not any(_rows(feeds) for feeds in batches):
        raise AttnRewriteError(f"{where}: no examples")
    if text is not None:
        (settings.get("progress") or _to_stderr)(text.summary())
    batches = [with_prefill_inputs(graph, feeds) for feeds in batches]
    held = []
    if guard:
        batches, held = held_out_split(batches)
    calibration = fitted_calibration(batches, graph, text=text, **settings)
    if held or calibration.finetune:
        runs = OriginalModel(original or model_around(graph))
        calibration.held_out = HeldOut.of(runs, held) if held else None
        calibration.original = runs if calibration.finetune else None
    return calibration


def fitted_calibration(batches: list[dict[str, np.ndarray]], graph: ir.Graph, **settings) -> Calibration:
    """Calibration on ``batches`` (model inputs), whose record entries describe those batches."""
    names = [v.name for v in graph.inputs if not v.is_initializer()]
    return Calibration(
        batches,
        fingerprint(feeds[name] for feeds in batches for name in names if name in feeds),
        sum(_rows(feeds) for feeds in batches),
        _tokens(batches),
        **settings,
    )


def _from_file(path: Path, graph: ir.Graph, tokenizer, max_length: int, batch_size: int, pack: bool):
    """(batches, TextData or None) of an .npz archive or a text file. An archive is never repacked."""
    require_file(path, "calibration data (an .npz archive or a text file)")
    with open(path, "rb") as file:
        is_npz = file.read(4) == NPZ_MAGIC
    if is_npz:
        return split_batch(load_inputs(path, graph, prefill_filled(graph)), batch_size), None
    texts = _read_texts(path)
    if tokenizer is None:
        raise AttnRewriteError(f"{path}: a text file needs --tokenizer tokenizer.json to make the model's inputs")
    return _tokenize(texts, path, tokenizer, graph, max_length, batch_size, pack)


# --- the guard's held-out part -------------------------------------------------------------------


def held_out_split(batches: list, rows: Callable[[Any], int] | None = None) -> tuple[list, list]:
    """(the batches to fit on, those held out): the last batches, at least HELD_OUT_SHARE of the
    examples, one batch at least; a single batch is cut. Nothing is held out of fewer than
    GUARD_MIN_EXAMPLES examples. ``rows``: a batch's examples (default: its leading axis)."""
    rows = rows or _rows
    total = sum(rows(feeds) for feeds in batches)
    if total < GUARD_MIN_EXAMPLES:
        return batches, []
    wanted = math.ceil(HELD_OUT_SHARE * total)
    if len(batches) == 1:
        parts = split_batch(batches[0], total - wanted)
        return (parts[:1], parts[1:]) if len(parts) == 2 else (batches, [])
    kept = len(batches) - 1
    while kept > 1 and sum(rows(feeds) for feeds in batches[kept:]) < wanted:
        kept -= 1
    return batches[:kept], batches[kept:]


@dataclasses.dataclass
class HeldOut:
    """The guard's data: model inputs never fitted on, and ``reference``, the original model's
    outputs on the batch at an index. Rewrites are scored one batch at a time: a decoder's
    logits over the whole part would not fit in memory (SmolLM2-135M's vocabulary of 49152, 48
    held-out passages of 512 tokens: 4.8 GB a model)."""

    batches: list
    examples: int
    reference: Callable[[int], dict[str, np.ndarray]] | None = None  # None: the frontend sets it (fx.calibrate)

    @classmethod
    def of(cls, original: OriginalModel, batches: list[dict[str, np.ndarray]]) -> HeldOut:
        return cls(batches, sum(map(_rows, batches)), lambda index: original.outputs_of(batches[index]))

    def cosines(self, *rewrites: Callable[[int], dict[str, np.ndarray]]) -> list[float]:
        """Each rewrite's score, as ``check`` scores: the mean per-example (batch row) cosine of
        its worst output, over the outputs it gives as the original does (a recurrent rewrite's
        states are not its caches). ``rewrites``: each gives its outputs on the batch at an
        index; the original runs once a batch for all of them."""
        from attnrewrite.check import per_example_cosine

        scores = [collections.defaultdict(list) for _ in rewrites]
        for index in range(len(self.batches)):
            expected = self.reference(index)
            for per_output, rewrite in zip(scores, rewrites):
                outputs = rewrite(index)
                for name, want in expected.items():
                    got = outputs.get(name)
                    if np.issubdtype(want.dtype, np.floating) and got is not None and got.shape == want.shape:
                        per_output[name].append(per_example_cosine(want, got))
        return [
            min((float(np.mean(np.concatenate(cosines))) for cosines in per_output.values()), default=math.nan)
            for per_output in scores
        ]


class OriginalModel:
    """The original model in onnxruntime, loaded before the rewrite changes it in place: the
    guard's reference outputs, and stage 2's teacher (onnx/finetune.py), which is faster here
    than the graph evaluated in torch (SmolLM2-135M, 2 x 512 tokens on 2 cores: 2.3 s, 4.0 s)."""

    def __init__(self, model: ir.Model):
        from attnrewrite.onnx.io import saved_copy
        from attnrewrite.onnx.validate import make_session

        with saved_copy(model) as path:
            # kept through stage 1 for stage 2: no arena, so that between runs it holds its weights only
            self.session = make_session(str(path), arena=False)
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> list[np.ndarray]:
        """The outputs ``names`` (default: all) on ``feeds``, inputs it does not take left out."""
        return self.session.run(names, {k: v for k, v in feeds.items() if k in self.inputs})

    def outputs_of(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output by name on the held-out batch ``feeds``."""
        try:
            return dict(zip(self.outputs, self.run(feeds)))
        except Exception as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            raise AttnRewriteError(
                f"the original model fails to run on the held-out calibration data: {first}"
            ) from error


def _rows(feeds: dict[str, np.ndarray]) -> int:
    first = next(iter(feeds.values()), None)
    return 0 if first is None or first.ndim == 0 else int(first.shape[0])


def _tokens(batches: list[dict[str, np.ndarray]]) -> int | None:
    """Tokens the data holds: the attention mask's ones, else batch x length of token ids."""
    if all("attention_mask" in feeds for feeds in batches):
        return int(sum(int((feeds["attention_mask"] != 0).sum()) for feeds in batches))
    if all("input_ids" in feeds for feeds in batches):
        return int(sum(feeds["input_ids"].size for feeds in batches))
    return None


def _read_texts(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise AttnRewriteError(f"{path}: neither a .npz archive nor UTF-8 text (one text per line)") from None
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise AttnRewriteError(f"{path}: no text in it (one text per line)")
    return texts


def similar_length_groups(lengths: list[int], size: int) -> list[list[int]]:
    """Indices into ``lengths`` in groups of ``size`` whose lengths are close (cut from the
    indices sorted by length), each group and the groups themselves in input order (by their
    first index): batches that pad little and still follow the data's order."""
    by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups = (sorted(by_length[start : start + size]) for start in range(0, len(lengths), size))
    return sorted(groups, key=lambda group: group[0])


@dataclasses.dataclass
class TextData:
    """What became of a text file's lines: ``texts`` read, ``examples`` made of them (passages
    when ``packed``), ``cut``: texts longer than ``max_length`` tokens, cut to it."""

    texts: int
    examples: int
    packed: bool
    max_length: int
    cut: int

    def summary(self) -> str:
        cut = f"; {self.cut} text{'s' * (self.cut != 1)} longer than {self.max_length} tokens cut" if self.cut else ""
        if self.packed:
            return f"packed {self.texts} texts into {self.examples} passages of <= {self.max_length} tokens{cut}"
        return f"{self.texts} texts, one per example, of <= {self.max_length} tokens (packing off){cut}"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "summary": self.summary()}


@dataclasses.dataclass
class _Framing:
    """Special tokens a tokenizer's post-processor puts around one text (``prefix``, ``suffix``)
    and between two (``separator``), each as (id, type id) pairs: for BERT's [CLS] a [SEP] b
    [SEP], [CLS] / [SEP] / [SEP]; nothing for a tokenizer without a post-processor."""

    prefix: list[tuple[int, int]]
    separator: list[tuple[int, int]]
    suffix: list[tuple[int, int]]

    @classmethod
    def of(cls, tokenizer) -> _Framing:
        pair = tokenizer.encode("a", "b")  # the texts are irrelevant: only which tokens are special
        parts: list[list[tuple[int, int]]] = [[], [], []]  # before text 0, between, after text 1
        part = 0
        for token, type_id, sequence in zip(pair.ids, pair.type_ids, pair.sequence_ids):
            if sequence is None:
                parts[part].append((token, type_id))
            else:
                part = max(part, sequence + 1)
        return cls(*parts)

    def passage(self, texts: list[list[int]]) -> list[int]:
        """Token ids of ``texts`` framed as one sequence: prefix, texts joined by separators, suffix."""
        ids = [token for token, _ in self.prefix]
        for number, text in enumerate(texts):
            ids += ([token for token, _ in self.separator] if number else []) + text
        return ids + [token for token, _ in self.suffix]

    def overhead(self, texts: int) -> int:
        return len(self.prefix) + len(self.suffix) + max(texts - 1, 0) * len(self.separator)


def _packed(contents: list[list[int]], framing: _Framing, max_length: int) -> tuple[list[list[int]], int]:
    """(passages, texts cut): consecutive texts joined greedily, in file order, into passages of
    at most ``max_length`` tokens framed by ``framing``; a text is never split across passages,
    and one that alone exceeds the length is cut to fit."""
    room = max_length - framing.overhead(1)
    if room < 1:
        raise AttnRewriteError(f"--max-length {max_length} leaves no room for text beside the special tokens")
    passages, current, cut = [], [], 0
    for text in contents:
        if len(text) > room:
            text, cut = text[:room], cut + 1
        joined = sum(map(len, current)) + len(text) + framing.overhead(len(current) + 1)
        if current and joined > max_length:
            passages.append(framing.passage(current))
            current = []
        current.append(text)
    return [*passages, framing.passage(current)], cut


def token_examples(tokenizer, texts: list[str], max_length: int, pack: bool) -> tuple[list[list[int]], TextData]:
    """Each example's token ids, and what was done to make them."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    if pack:
        contents = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        examples, cut = _packed(contents, _Framing.of(tokenizer), max_length)
    else:
        examples = [e.ids for e in tokenizer.encode_batch(texts)]
        cut = sum(len(ids) > max_length for ids in examples)
        if cut:  # the tokenizer's own truncation keeps the special tokens
            tokenizer.enable_truncation(max_length)
            examples = [e.ids for e in tokenizer.encode_batch(texts)]
    return examples, TextData(len(texts), len(examples), pack, max_length, cut)


def _padded(examples: list[list[int]], padding: dict) -> dict[str, np.ndarray]:
    """One batch: the examples padded to the longest (rounded up to the tokenizer's
    pad_to_multiple_of), on the side its padding settings say, with their attention mask and
    token type ids (the single-sequence type, 0, as the post-processor gives a lone text;
    the pad type id on padding)."""
    multiple = padding.get("pad_to_multiple_of") or 1
    length = -(-max(map(len, examples)) // multiple) * multiple
    left = padding.get("direction", "right") == "left"
    pad_id, pad_type_id = padding.get("pad_id", 0), padding.get("pad_type_id", 0)
    ids = [_pad(example, length, pad_id, left) for example in examples]
    mask = [_pad([1] * len(example), length, 0, left) for example in examples]
    types = [_pad([0] * len(example), length, pad_type_id, left) for example in examples]
    return {"ids": np.array(ids), "attention_mask": np.array(mask), "type_ids": np.array(types)}


def _pad(values: list[int], length: int, fill: int, left: bool) -> list[int]:
    padding = [fill] * (length - len(values))
    return padding + values if left else values + padding


def _tokenize(texts, path: Path, tokenizer_path, graph: ir.Graph, max_length: int, batch_size: int, pack: bool):
    """(batches, TextData): the texts as the model's inputs, packed into passages (``pack``) or
    one per example, padded per batch as the tokenizer's own padding settings say. Examples of
    similar length share a batch, so little of the fitting's work goes to padding; the batches
    keep the file's order of their first examples."""
    tokenizer = load_tokenizer(tokenizer_path, "calibrating on text")
    filled = prefill_filled(graph)  # a decoder's caches and positions: not made from text
    wanted = {v.name: v for v in graph.inputs if not v.is_initializer() and v.name not in filled}
    unknown = [name for name in wanted if name not in TEXT_INPUTS]
    if unknown:
        raise AttnRewriteError(
            f"{path}: the model's input {unknown[0]!r} cannot be made from text (text gives {', '.join(TEXT_INPUTS)})"
        )
    padding = tokenizer.padding or {}
    examples, text_data = token_examples(tokenizer, texts, max_length, pack)
    batches = []
    for group in similar_length_groups([len(ids) for ids in examples], batch_size):
        arrays = _padded([examples[i] for i in group], padding)
        batches.append(
            {
                name: arrays[TEXT_INPUTS[name]].astype(value.dtype.numpy() if value.dtype is not None else np.int64)
                for name, value in wanted.items()
            }
        )
    return batches, text_data
