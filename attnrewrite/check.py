"""Fidelity: run an original and a rewritten model on the same inputs and compare every output.

A linearized attention approximates softmax attention, so the rewritten outputs differ; this
module says by how much (docs/ARCHITECTURE.md: fidelity is reported, never asserted as "equal"). Per
output: the largest absolute difference, the relative error ||rewritten - original|| /
||original||, and the cosine similarity PER EXAMPLE (each batch row, axis 0, over the flattened
rest: mean, minimum and 5th percentile), since one example ruined is hidden by a mean over the
batch. Cosine misleads on logits (a large shared offset keeps it near 1 while the argmax
flips), so logits-like outputs (``is_logits_like``) also get the fraction of rows whose argmax
agrees, the overlap of their top-5 classes and the KL divergence of the rewritten distribution
from the original's. Inputs are generated from the original's signature or read from a ``.npz``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite import passes
from attnrewrite.data import conform, load_inputs
from attnrewrite.errors import AttnRewriteError
from attnrewrite.generate import forced_logits
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import (
    embedding_rows,
    first_that_runs,
    generate_inputs,
    left_padding_pattern,
    model_around,
    prefill_parts,
    sequence_length,
)
from attnrewrite.onnx.limits import position_limit
from attnrewrite.onnx.masks import inputs_marking_padding
from attnrewrite.onnx.validate import make_session
from attnrewrite.record import METADATA_KEY, format_table, json_float, stage

DEFAULT_SEQ = 64  # generated inputs' length where no replaced site is exact on short inputs
DEFAULT_BATCH = 2
# Where replaced sites are exact on short inputs (a window, Linformer's k, one LSH chunk), the
# default length is this many times the longest exact reach (rounded up to LENGTH_STEP), so most
# of every query's keys are approximated.
PAST_REACH = 3
LENGTH_STEP = 64
TOP_K = 5
DECODE_STEPS = 8  # a decoder's check feeds its last tokens one at a time, as generation does


class FidelityBelowThreshold(AttnRewriteError):
    """--min-cosine or --min-agreement was given and some output falls below it."""


class ExactSitesUnmeasured(FidelityBelowThreshold):
    """A gate was given, but some replaced sites are exact at the length compared: it measured
    nothing there (--allow-exact accepts that)."""


@dataclasses.dataclass(frozen=True)
class ExactSites:
    """Replaced sites of one method that are softmax attention itself at the length compared
    (passes.exact_part), so the check does not measure them."""

    method: str
    said: str  # what makes them exact: "window=32"
    sites: int
    exact_up_to: int
    seq: int  # the length compared
    positions: int | None = None  # the model's position limit, where it is within exact_up_to

    @property
    def everywhere(self) -> bool:
        """Exact on every input the model accepts: nothing left to measure, which is a pass."""
        return self.positions is not None

    def note(self) -> str:
        sites = f"{self.sites} {self.method} {self.said} site{'s' if self.sites != 1 else ''}"
        are = "are" if self.sites != 1 else "is"
        if self.everywhere:
            return (
                f"the {sites} {are} exact up to {self.exact_up_to} positions and the model takes at most "
                f"{self.positions}: the rewrite is exact on every input the model accepts"
            )
        return f"at seq {self.seq} the {sites} {are} exact: this check does not measure them"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "everywhere": self.everywhere, "note": self.note()}


@dataclasses.dataclass
class OutputFidelity:
    name: str
    shape: tuple[int, ...]
    max_abs_error: float
    relative_error: float
    cosine_mean: float  # cosine per example (batch row): mean, minimum, 5th percentile
    cosine_min: float
    cosine_p5: float
    logits_like: bool
    # only for logits-like outputs, else None: per row (all axes but the last)
    argmax_agreement: float | None = None  # fraction of rows whose argmax agrees
    top5_overlap: float | None = None  # mean fraction of the original's top 5 the rewrite keeps
    kl_mean: float | None = None  # KL(original || rewritten) in nats: mean and max over rows
    kl_max: float | None = None
    nonfinite: int = 0  # NaN/inf entries in the rewritten output where the original is finite

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass
class CheckReport:
    outputs: list[OutputFidelity]
    inputs: dict[str, list[int]]  # name -> shape of what both models were run on
    input_source: str  # "generated (batch 2, seq 64, seed 0)" or the .npz path
    exact: list[ExactSites] = dataclasses.field(default_factory=list)  # replaced sites it cannot measure

    @property
    def unmeasured(self) -> list[ExactSites]:
        """Exact sites the model also runs past: a gate proved nothing about them."""
        return [e for e in self.exact if not e.everywhere]

    @property
    def min_cosine(self) -> float:
        """The smallest per-example cosine of any output: what --min-cosine gates on."""
        return min((_worst_first(o.cosine_min) for o in self.outputs), default=1.0)

    @property
    def min_agreement(self) -> float | None:
        """The smallest argmax agreement of any logits-like output (None: there is none)."""
        return min((_worst_first(o.argmax_agreement) for o in self.logits_outputs()), default=None)

    def worst(self) -> OutputFidelity:
        return min(self.outputs, key=lambda o: _worst_first(o.cosine_min))

    def gate(
        self, min_cosine: float | None = None, min_agreement: float | None = None, allow_exact: bool = False
    ) -> None:
        """Raise FidelityBelowThreshold (one line) for the first output below a threshold; with a
        threshold, ExactSitesUnmeasured where replaced sites are exact at the length compared,
        unless ``allow_exact``."""
        if min_cosine is not None and self.outputs and self.min_cosine < min_cosine:
            worst = self.worst()
            raise FidelityBelowThreshold(
                f"fidelity gate failed: output {worst.name!r} has per-example cosine min "
                f"{worst.cosine_min:.6f} < --min-cosine {min_cosine:g}"
            )
        if min_agreement is not None:
            self._gate_agreement(min_agreement)
        if min_cosine is not None or min_agreement is not None:
            self._gate_exact(allow_exact)

    def _gate_agreement(self, min_agreement: float) -> None:
        logits = self.logits_outputs()
        if not logits:
            # a gate that cannot look at anything must not pass silently
            names = ", ".join(o.name for o in self.outputs)
            raise AttnRewriteError(
                f"--min-agreement needs a logits-like output; none of the model's outputs ({names}) is one"
            )
        worst = min(logits, key=lambda o: _worst_first(o.argmax_agreement))
        if _worst_first(worst.argmax_agreement) < min_agreement:
            raise FidelityBelowThreshold(
                f"fidelity gate failed: output {worst.name!r} has argmax agreement "
                f"{worst.argmax_agreement:.4f} < --min-agreement {min_agreement:g}"
            )

    def _gate_exact(self, allow_exact: bool) -> None:
        if self.unmeasured and not allow_exact:
            raise ExactSitesUnmeasured(
                f"fidelity gate failed: {self.unmeasured[0].note()}; check longer inputs (--seq), "
                "or accept it with --allow-exact"
            )

    def logits_outputs(self) -> list[OutputFidelity]:
        return [o for o in self.outputs if o.logits_like]

    def table(self) -> str:
        with_logits = bool(self.logits_outputs())  # hidden states alone: no argmax columns at all
        rows = [table_row(o, with_logits) for o in self.outputs]
        lines = [format_table(table_header(with_logits), rows), f"inputs: {self.input_source}", *self.footer()]
        return "\n".join(lines)

    def footer(self, label: str = "rewritten") -> list[str]:
        """The lines under the table and its inputs: the sites it cannot measure, non-finite
        values in the ``label`` model's outputs."""
        lines = [f"note: {e.note()}" for e in self.exact]
        lines += [
            f"warning: {o.name}: {o.nonfinite} non-finite values in the {label} output"
            for o in self.outputs
            if o.nonfinite
        ]
        return lines

    def as_dict(
        self, min_cosine: float | None = None, min_agreement: float | None = None, allow_exact: bool = False
    ) -> dict[str, Any]:
        """The report as JSON: the gate's thresholds (None: not gated) apart from what was observed."""
        return {
            "inputs": self.inputs,
            "input_source": self.input_source,
            "exact_sites": [e.as_dict() for e in self.exact],
            "thresholds": {"min_cosine": min_cosine, "min_agreement": min_agreement, "allow_exact": allow_exact},
            "observed": {
                "cosine_min": None if not self.outputs else json_float(self.min_cosine),
                "argmax_agreement_min": json_float(self.min_agreement),
            },
            "outputs": [{k: json_float(v) for k, v in o.as_dict().items()} for o in self.outputs],
        }


def table_header(with_logits: bool) -> tuple[str, ...]:
    header = ("output", "shape", "max_abs_err", "rel_err", "cos_mean", "cos_min", "cos_p5")
    return (*header, "argmax_agree", "top5", "kl_mean", "kl_max") if with_logits else header


def table_row(o: OutputFidelity, with_logits: bool) -> tuple[str, ...]:
    """One output's figures as the table prints them (table_header's columns)."""
    row = [o.name, "x".join(map(str, o.shape))]
    row += [f"{o.max_abs_error:.3g}", f"{o.relative_error:.3g}"]
    row += [f"{o.cosine_mean:.6f}", f"{o.cosine_min:.6f}", f"{o.cosine_p5:.6f}"]
    if with_logits and not o.logits_like:
        row += ["-"] * 4
    elif with_logits:
        row += [f"{o.argmax_agreement:.4f}", f"{o.top5_overlap:.4f}", f"{o.kl_mean:.3g}", f"{o.kl_max:.3g}"]
    return tuple(row)


def _worst_first(value: float | None) -> float:
    # NaN sorts as the worst: a NaN figure must never pass a gate
    return -math.inf if value is None or math.isnan(value) else value


# --- the numbers --------------------------------------------------------------------------------


def compare_outputs(name: str, original: np.ndarray, rewritten: np.ndarray) -> OutputFidelity:
    """The fidelity of one output; float64 throughout so fp16 models do not round the errors."""
    if original.shape != rewritten.shape:
        raise AttnRewriteError(
            f"output {name!r} has shape {list(original.shape)} originally but {list(rewritten.shape)} rewritten"
        )
    a = np.asarray(original, dtype=np.float64)
    b = np.asarray(rewritten, dtype=np.float64)
    diff = np.abs(a - b)
    cosines = per_example_cosine(a, b)
    fidelity = OutputFidelity(
        name=name,
        shape=tuple(original.shape),
        max_abs_error=float(diff.max()) if diff.size else 0.0,
        relative_error=_relative_error(a, b),
        cosine_mean=float(np.mean(cosines)),
        cosine_min=float(np.min(cosines)),
        cosine_p5=float(np.percentile(cosines, 5)),
        logits_like=is_logits_like(name, original),
        nonfinite=int(np.count_nonzero(np.isfinite(a) & ~np.isfinite(b))),
    )
    if fidelity.logits_like:
        fidelity.argmax_agreement = argmax_agreement(a, b)
        fidelity.top5_overlap = top_k_overlap(a, b, TOP_K)
        probabilities = _are_probabilities(
            a, _sum_tolerance(original.dtype)
        )  # decided on the original, applied to both
        kl = kl_divergence(_log_distribution(a, probabilities), _log_distribution(b, probabilities))
        fidelity.kl_mean, fidelity.kl_max = float(np.mean(kl)), float(np.max(kl))
    return fidelity


# Names decide first: hidden states are never logits, whatever their values.
_HIDDEN_NAME = re.compile(r"hidden|pooler|embed|encoder_out|features", re.IGNORECASE)
_LOGITS_NAME = re.compile(r"logit|log_?prob|score|prob", re.IGNORECASE)


def is_logits_like(name: str, output: np.ndarray) -> bool:
    """Whether the last axis of a float output holds a distribution over classes or tokens.

    The rule: never for a name like ``last_hidden_state``, ``pooler_output``, ``hidden_states``,
    ``*embed*`` or ``features``; otherwise yes when the name says ``logits``, ``log_prob``,
    ``scores`` or ``probs``, or when the values say so: every row (all axes but the last) is a
    probability distribution (non-negative, sums to 1) or log-probabilities (logsumexp 0).
    Always at least two entries on the last axis, or there is nothing to choose between."""
    if not np.issubdtype(output.dtype, np.floating) or output.ndim < 1 or output.shape[-1] < 2 or output.size == 0:
        return False
    if _HIDDEN_NAME.search(name):
        return False
    if _LOGITS_NAME.search(name):
        return True
    values = np.asarray(output, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return False
    tolerance = _sum_tolerance(output.dtype)
    if _are_probabilities(values, tolerance):
        return True
    return bool(np.all(values <= tolerance) and np.allclose(_logsumexp(values), 0.0, atol=tolerance))


def per_example_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each batch row (axis 0) over the flattened rest; a rank-0/1 output
    is one example."""
    if a.ndim < 2:
        return np.array([cosine_similarity(a, b)])
    return np.array([cosine_similarity(x, y) for x, y in zip(a, b)]) if len(a) else np.array([1.0])


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    norm_a, norm_b = np.linalg.norm(a), np.linalg.norm(b)
    if norm_a == 0 and norm_b == 0:
        return 1.0  # two zero outputs agree exactly
    if norm_a == 0 or norm_b == 0:
        return 0.0
    return float(np.dot(a, b) / (norm_a * norm_b))


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
    norm_a, norm_diff = np.linalg.norm(a.ravel()), np.linalg.norm((a - b).ravel())
    if norm_a == 0:
        return 0.0 if norm_diff == 0 else math.inf
    return float(norm_diff / norm_a)


def argmax_agreement(original: np.ndarray, rewritten: np.ndarray) -> float:
    """Fraction of rows (all axes but the last) whose last-axis argmax agrees."""
    return float(np.mean(np.argmax(original, axis=-1) == np.argmax(rewritten, axis=-1)))


def top_k_overlap(original: np.ndarray, rewritten: np.ndarray, k: int) -> float:
    """Mean over rows of |top-k(original) & top-k(rewritten)| / k (k at most the classes)."""
    k = min(k, original.shape[-1])
    top = [np.argpartition(-x.reshape(-1, x.shape[-1]), k - 1, axis=-1)[:, :k] for x in (original, rewritten)]
    shared = [len(np.intersect1d(p, q)) for p, q in zip(*top)]
    return float(np.mean(shared) / k)


def kl_divergence(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, from log-probabilities on the last axis; 0 log 0 counts as 0."""
    p = np.exp(log_p)
    terms = np.where(p > 0, p * (log_p - log_q), 0.0)
    return terms.sum(axis=-1).reshape(-1)


def _sum_tolerance(dtype: np.dtype) -> float:
    return 1e-3 if dtype.itemsize >= 4 else 1e-2  # fp16/bf16 sums of a row round off


def _are_probabilities(values: np.ndarray, tolerance: float) -> bool:
    """Every row non-negative and summing to 1."""
    return bool(np.all(values >= 0) and np.allclose(values.sum(axis=-1), 1.0, atol=tolerance))


def _log_distribution(values: np.ndarray, probabilities: bool) -> np.ndarray:
    """Log-probabilities from an output: probabilities are logged (after renormalizing),
    logits and log-probabilities go through log-softmax (which keeps log-probabilities)."""
    if probabilities:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(values / values.sum(axis=-1, keepdims=True))
    return values - _logsumexp(values)[..., None]


def _logsumexp(values: np.ndarray) -> np.ndarray:
    peak = np.max(values, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.log(np.sum(np.exp(values - peak), axis=-1)) + peak[..., 0]


# --- running both models ------------------------------------------------------------------------


@dataclasses.dataclass
class CheckInputs:
    feeds: dict[str, np.ndarray]
    source: str  # said in the report: how the inputs were made
    seq: int | None = None  # the length they were generated at; None for given arrays
    # the same generation at another length, for a model that does not run at ``seq``
    regenerate: Callable[[int], CheckInputs] | None = None
    # a decoder's check (decoder_inputs): its last tokens fed one at a time after a prefill
    decode_steps: int | None = None


def prepare_inputs(
    model: ir.Model | ir.Graph,
    inputs: str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int = DEFAULT_SEQ,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
) -> CheckInputs:
    """The inputs to compare on, for the model whose signature ``model`` (or its graph) has: a
    ``.npz`` path or a dict of arrays (checked against the signature), or by default generated
    from it (``batch`` x ``seq`` for symbolic dims, token ids spanning the vocabulary, masks with
    padding at the ends of rows and never a fully masked row)."""
    graph = model.graph if isinstance(model, ir.Model) else model
    if inputs is None:
        model = model if isinstance(model, ir.Model) else model_around(graph)
        marked = inputs_marking_padding(model)

        def generated(length: int) -> CheckInputs:
            feeds = generate_inputs(graph, batch=batch, seq=length, seed=seed, padding_marked_by_one=marked)
            source = f"generated ({', '.join([*_generated_shapes(graph, feeds, length), f'seed {seed}'])})"
            return CheckInputs(feeds, source, length, generated)

        return generated(seq)
    if isinstance(inputs, dict):
        return CheckInputs(conform(inputs, graph, "the given inputs"), "given arrays")
    return CheckInputs(load_inputs(inputs, graph), str(inputs))


def prepare_decoder_inputs(
    model: ir.Model,
    inputs: str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int = DEFAULT_SEQ,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
) -> CheckInputs:
    """The inputs to compare a decoder and its recurrent rewrite on, which take different
    carried values (KV caches, states): tokens and their mask (decoder_inputs), given (``inputs``)
    or generated (``batch`` x ``seq`` ids spanning the vocabulary, rows after the first left
    padded at their first 2 positions)."""
    graph = model.graph
    if inputs is None:
        ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
        if ids is None:
            raise AttnRewriteError("a decoder is checked as it generates, from input_ids: the model has no such input")
        rng = np.random.default_rng(seed)
        mask = left_padding_pattern([batch, seq], 2)
        feeds = {"input_ids": rng.integers(0, embedding_rows(ids) or 2, (batch, seq)), "attention_mask": mask}
        return decoder_inputs(feeds, f"generated (batch {batch}, seq {seq}, seed {seed})")
    carried, positions = prefill_parts(graph)
    if isinstance(inputs, dict):
        source, feeds = "given arrays", conform(inputs, graph, "the given inputs", carried | positions)
    else:
        source, feeds = str(inputs), load_inputs(inputs, graph, carried | positions)
    given = sorted(carried & set(feeds))
    if given:
        raise AttnRewriteError(
            f"{source}: {given[0]!r}: a decoder is checked from an empty cache, on input_ids and attention_mask"
        )
    return decoder_inputs(feeds, source)


def decoder_inputs(feeds: dict[str, np.ndarray], source: str) -> CheckInputs:
    """Tokens (input_ids, attention_mask) a decoder is checked on as it generates: a prefill,
    then the last DECODE_STEPS tokens one at a time (generate.forced_logits); the source says so."""
    tokens = {name: feeds[name] for name in ("input_ids", "attention_mask") if name in feeds}
    length = tokens["input_ids"].shape[-1]
    if length < 2:
        raise AttnRewriteError(f"{source}: a decoder's check needs at least 2 tokens per row, got {length}")
    steps = min(DECODE_STEPS, length - 1)
    said = f"{source}; a prefill of {length - steps} tokens, then {steps} one at a time"
    return CheckInputs(tokens, said, decode_steps=steps)


def _generated_shapes(graph: ir.Graph, feeds: dict[str, np.ndarray], seq: int) -> list[str]:
    """What was fed, not what was asked for: a batch fixed at 1 in the model is batch 1, and
    the sequence length only when some input has a symbolic length to take it."""
    said = []
    batches = sorted({a.shape[0] for a in feeds.values() if a.ndim >= 1})
    if batches:
        said.append(f"batch {'/'.join(map(str, batches))}")
    inputs = [v for v in graph.inputs if v.name in feeds]
    if any(not isinstance(dim, int) for v in inputs for dim in list(v.shape or [])[1:]):
        said.append(f"seq {seq}")
    return said


def check(
    original,
    rewritten,
    inputs: CheckInputs | str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int | None = None,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    threads: int | None = None,
) -> CheckReport:
    """Run ``original`` and ``rewritten`` (paths or ``onnx_ir.Model``) on the same inputs and
    compare every output the original has, by name. ``inputs``: see ``prepare_inputs``; generated
    ones are ``seq`` long, by default past every replaced site's exact part (default_length).
    Replaced sites exact at the length compared are listed in the report (``CheckReport.exact``).
    Timed as the run's stage "check" (record.stage), layer selection's trials too."""
    with stage("check"):
        record = model_record(rewritten)
        inputs = check_inputs(original, record, inputs, seq=seq, batch=batch, seed=seed)
        [report] = run_compared(original, [(rewritten, "the rewritten model")], inputs, threads)
        report.exact = exact_sites(record, inputs, original, is_recurrent(record))
        return report


def check_inputs(
    original,
    record: dict | None,
    inputs: CheckInputs | str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int | None = None,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    also_exact: list[passes.ExactPart] = (),
) -> CheckInputs:
    """The inputs check compares on (see ``check``) for a rewritten model whose record is
    ``record``; generated ones are also past ``also_exact``'s reach (another model compared on them)."""
    if isinstance(inputs, CheckInputs):
        return inputs
    decoding = is_recurrent(record)
    model, why = as_ir(original), None
    if seq is None and inputs is None:
        parts = [part for part, _, _ in _replaced_exact_parts(record)]
        seq, why = default_length(model.graph, [*parts, *also_exact], from_empty_cache=decoding)
    prepare = prepare_decoder_inputs if decoding else prepare_inputs
    return with_reason(prepare(model, inputs, seq=seq or DEFAULT_SEQ, batch=batch, seed=seed), why)


def model_record(model) -> dict | None:
    """The attnrewrite record a model (a path, ``onnx.ModelProto`` or ``onnx_ir.Model``) carries:
    how it was rewritten (record.RewriteRecord.as_dict); None when it has none."""
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_file():
            return None  # said by what opens it
        model = onnx.load(os.fspath(model), load_external_data=False)
    if isinstance(model, onnx.ModelProto):
        text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    else:
        text = model.metadata_props.get(METADATA_KEY)
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None  # someone else's "attnrewrite" entry
    return record if isinstance(record, dict) else None


def is_recurrent(model) -> bool:
    """Whether ``model`` (a path, a model or its record) is a recurrent rewrite (--recurrent), by
    its record: it takes states where its original takes KV caches."""
    record = model if isinstance(model, dict) or model is None else model_record(model)
    return bool(record) and bool(record.get("options", {}).get("recurrent"))


# --- where replaced sites are exact ---------------------------------------------------------------


def default_length(graph: ir.Graph, parts: list[passes.ExactPart], from_empty_cache: bool = False):
    """(seq, why) for generated inputs: PAST_REACH times the longest reach of the replaced sites'
    exact parts (``parts``, passes.exact_part), so every query of every site is approximated,
    capped by the model's own position limit (onnx.limits; a decoder checked against its
    recurrent rewrite starts ``from_empty_cache``); ``why`` says so in words (None: DEFAULT_SEQ,
    with nothing exact to look past)."""
    widest = max(parts, key=lambda part: part.reach, default=None)
    seq = DEFAULT_SEQ
    if widest is not None:
        seq = max(seq, -(-PAST_REACH * widest.reach // LENGTH_STEP) * LENGTH_STEP)
    limit = position_limit(graph, from_empty_cache)
    if limit is None or limit.positions >= seq:
        return seq, None if widest is None else f"seq {seq}: past {widest.said}'s reach ({widest.reach}) for every site"
    seq = limit.positions
    why = f"seq {seq}: as long as the model takes"
    if widest is None:
        return seq, why
    if seq > widest.reach:
        return seq, f"{why}, past {widest.said}'s reach ({widest.reach}) for every site"
    if seq > widest.exact_up_to:
        return seq, f"{why}, past {widest.said}'s exact length ({widest.exact_up_to}), not its reach ({widest.reach})"
    return seq, f"{why}, within {widest.said}'s exact length ({widest.exact_up_to})"


def with_reason(inputs: CheckInputs, why: str | None) -> CheckInputs:
    """Generated inputs whose source also says why they are that long."""
    return inputs if why is None else dataclasses.replace(inputs, source=f"{inputs.source}; {why}")


def exact_sites(record: dict | None, inputs: CheckInputs, original, decoding: bool = False) -> list[ExactSites]:
    """The sites ``record`` (a rewritten model's, model_record) says were replaced that are exact
    at the length of ``inputs``, one entry per method and kind of site; each says whether the
    original takes longer inputs at all (its position limit)."""
    parts = _replaced_exact_parts(record, by_site=True)
    if not parts:
        return []
    graph = as_ir(original).graph
    seq = _compared_length(inputs, graph)
    exact = [(part, method, sites) for part, method, sites in parts if seq is not None and seq <= part.exact_up_to]
    if not exact:
        return []
    limit = position_limit(graph, from_empty_cache=decoding)
    return [
        ExactSites(
            method,
            part.said,
            sites,
            part.exact_up_to,
            seq,
            positions=limit.positions if limit is not None and limit.positions <= part.exact_up_to else None,
        )
        for part, method, sites in exact
    ]


def _replaced_exact_parts(record: dict | None, by_site: bool = False) -> list[tuple[passes.ExactPart, str, int]]:
    """(exact part, method, sites) of the replaced sites ``record`` and the records before it
    list, grouped alike: as each replaced site is (causal or not, ``by_site``), else as a
    bidirectional site of its method (the longest reach: default_length)."""
    groups: dict[tuple[passes.ExactPart, str], int] = {}
    while isinstance(record, dict):
        recorded = recorded_method(record)
        for site in replaced_sites(record) if recorded is not None else []:
            module, options = recorded
            part = passes.exact_part(module, options, by_site and "causal" in str(site.get("mask")))
            if part is not None:
                groups[part, module.NAME] = groups.get((part, module.NAME), 0) + 1
        record = record.get("previous")
    return [(part, method, sites) for (part, method), sites in groups.items()]


def recorded_method(record: dict):
    """(pass module, Options) of the rewrite ``record`` (one run's, model_record) says was made;
    None where this version does not know the method or read its options."""
    module = passes.PASSES.get(record.get("method"))
    if module is None:
        return None
    fields = {f.name for f in dataclasses.fields(module.Options)}
    try:
        return module, module.Options(**{k: v for k, v in record.get("options", {}).items() if k in fields})
    except passes.OptionError:
        return None


def replaced_sites(record: dict) -> list[dict]:
    """The sites one run's ``record`` says it replaced, as AttentionSite.describe() wrote them."""
    return [site for site in record.get("sites", []) if site.get("status") == "rewritten"]


def _compared_length(inputs: CheckInputs, graph: ir.Graph) -> int | None:
    """The sequence length both models ran on: generated, a decoder's tokens, or given arrays'."""
    if inputs.seq is not None:
        return inputs.seq
    if inputs.decode_steps is not None:
        return int(inputs.feeds["input_ids"].shape[-1])
    return sequence_length(graph, inputs.feeds)


def run_compared(original, compared: list[tuple[Any, str]], inputs: CheckInputs, threads: int | None = None):
    """A CheckReport per (model, label) of ``compared`` against ``original``, all run on ``inputs``
    (the original once)."""
    if inputs.decode_steps is not None:
        return _run_decoding(original, compared, inputs, threads)
    with _session(original, "the original model", threads) as session:
        inputs, expected = _run_original(session, inputs, original)
    feeds, reports = inputs.feeds, []
    for model, label in compared:
        with _session(model, label, threads) as session:
            missing = sorted(set(feeds) - {i.name for i in session.get_inputs()})
            if missing:
                raise AttnRewriteError(f"{label} has no input {missing[0]!r}: the models' signatures differ")
            actual = _run(session, feeds, label)
        outputs = []
        for name, value in expected.items():
            if name not in actual:
                raise AttnRewriteError(f"{label} has no output {name!r}")
            outputs.append(compare_outputs(name, value, actual[name]))
        reports.append(CheckReport(outputs, {k: list(v.shape) for k, v in feeds.items()}, inputs.source))
    return reports


def _run_decoding(original, compared: list[tuple[Any, str]], inputs: CheckInputs, threads: int | None):
    """The logits of every real token as each model generates them (generate.forced_logits),
    compared as one output of [real tokens, vocab]."""
    ids = inputs.feeds["input_ids"]
    mask = inputs.feeds.get("attention_mask", np.ones_like(ids))
    prefill, real = ids.shape[-1] - inputs.decode_steps, mask != 0
    shapes = {k: list(v.shape) for k, v in inputs.feeds.items()}

    def logits(model, label: str) -> np.ndarray:
        with _session(model, label, threads) as session:
            return forced_logits(session, label, ids, mask, prefill)[real]

    expected = logits(original, "the original model")
    return [
        CheckReport([compare_outputs("logits", expected, logits(model, label))], shapes, inputs.source)
        for model, label in compared
    ]


def _run_original(session, inputs: CheckInputs, original) -> tuple[CheckInputs, dict[str, np.ndarray]]:
    """The original's outputs; generated inputs it does not take (an audio model's convolutional
    front end needs more samples, a legacy export runs only at the lengths baked into its
    Reshapes) are generated again at other lengths until it runs (the report says so)."""
    if inputs.regenerate is None:
        return inputs, _run(session, inputs.feeds, "the original model")

    def run_at(length: int):
        at = inputs if length == inputs.seq else inputs.regenerate(length)
        return at, _run(session, at.feeds, "the original model")

    length, (used, expected) = first_that_runs(run_at, inputs.seq, as_ir(original).graph)
    if length != inputs.seq:
        used = dataclasses.replace(used, source=f"{used.source}; the original model does not run at seq {inputs.seq}")
    return used, expected


def as_ir(model) -> ir.Model:
    """``model`` (a path or an onnx_ir.Model) as an onnx_ir.Model."""
    return model if isinstance(model, ir.Model) else onnx_io.load_model(model)


@contextlib.contextmanager
def _session(model, label: str, threads: int | None):
    """An onnxruntime session on the file when there is one (no re-serialization), else on a
    temporary copy of the in-memory model."""
    with contextlib.ExitStack() as stack:
        if isinstance(model, ir.Model):
            path = stack.enter_context(onnx_io.saved_copy(model))
        else:
            path = Path(model)
            onnx_io.check_input_file(path)
        try:
            session = make_session(str(path), threads=threads)
        except Exception as error:
            raise AttnRewriteError(f"onnxruntime cannot load {label}: {_first_line(error)}") from error
        yield session


def _run(session, feeds: dict[str, np.ndarray], label: str) -> dict[str, np.ndarray]:
    try:
        values = session.run(None, feeds)
    except Exception as error:
        raise AttnRewriteError(f"{label} fails to run on the inputs: {_first_line(error)}") from error
    return {o.name: v for o, v in zip(session.get_outputs(), values)}


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
