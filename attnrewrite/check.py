"""Fidelity: run an original and a rewritten model on the same inputs and compare every output.

A linearized attention approximates softmax attention, so the rewritten outputs differ; this
module says by how much (DESIGN.md: fidelity is reported, never asserted as "equal"). Per
output: the largest absolute difference, the relative error ||rewritten - original|| /
||original||, the cosine similarity of the flattened outputs, and for logits-like outputs
(float, rank >= 2, more than one entry on the last axis) the fraction of rows whose last-axis
argmax agrees. Inputs are generated from the original's signature or read from a ``.npz``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.validate import make_session
from attnrewrite.record import format_table

DEFAULT_SEQ = 64
DEFAULT_BATCH = 2


class FidelityBelowThreshold(AttnRewriteError):
    """--min-cosine was given and some output's cosine similarity is below it."""


@dataclasses.dataclass
class OutputFidelity:
    name: str
    shape: tuple[int, ...]
    max_abs_error: float
    relative_error: float
    cosine: float
    argmax_agreement: float | None  # None: not a logits-like output
    nonfinite: int  # NaN/inf entries in the rewritten output where the original is finite

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass
class CheckReport:
    outputs: list[OutputFidelity]
    inputs: dict[str, list[int]]  # name -> shape of what both models were run on
    input_source: str  # "generated (batch 2, seq 64, seed 0)" or the .npz path

    @property
    def min_cosine(self) -> float:
        # NaN sorts as the worst: a NaN cosine must never pass a gate
        return min((o.cosine if not math.isnan(o.cosine) else -math.inf for o in self.outputs), default=1.0)

    def worst(self) -> OutputFidelity:
        return min(self.outputs, key=lambda o: o.cosine if not math.isnan(o.cosine) else -math.inf)

    def gate(self, min_cosine: float | None) -> None:
        """Raise FidelityBelowThreshold (one line) when an output's cosine is below ``min_cosine``."""
        if min_cosine is None or not self.outputs or self.min_cosine >= min_cosine:
            return
        worst = self.worst()
        raise FidelityBelowThreshold(
            f"fidelity gate failed: output {worst.name!r} has cosine {worst.cosine:.6f} < --min-cosine {min_cosine:g}"
        )

    def table(self) -> str:
        header = ("output", "shape", "max_abs_err", "rel_err", "cosine", "argmax_agree")
        rows = [
            (
                o.name,
                "x".join(map(str, o.shape)),
                f"{o.max_abs_error:.3g}",
                f"{o.relative_error:.3g}",
                f"{o.cosine:.6f}",
                "-" if o.argmax_agreement is None else f"{o.argmax_agreement:.4f}",
            )
            for o in self.outputs
        ]
        lines = [format_table(header, rows), f"inputs: {self.input_source}"]
        lines += [f"warning: {o.name}: {o.nonfinite} non-finite values in the rewritten output" for o in self.outputs if o.nonfinite]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "input_source": self.input_source,
            "min_cosine": None if not self.outputs else _json_float(self.min_cosine),
            "outputs": [{k: _json_float(v) for k, v in o.as_dict().items()} for o in self.outputs],
        }


# --- the numbers --------------------------------------------------------------------------------


def compare_outputs(name: str, original: np.ndarray, rewritten: np.ndarray) -> OutputFidelity:
    """The fidelity of one output; float64 throughout so fp16 models do not round the errors."""
    if original.shape != rewritten.shape:
        raise AttnRewriteError(f"output {name!r} has shape {list(original.shape)} originally but {list(rewritten.shape)} rewritten")
    a = np.asarray(original, dtype=np.float64)
    b = np.asarray(rewritten, dtype=np.float64)
    nonfinite = int(np.count_nonzero(np.isfinite(a) & ~np.isfinite(b)))
    diff = np.abs(a - b)
    return OutputFidelity(
        name=name,
        shape=tuple(original.shape),
        max_abs_error=float(diff.max()) if diff.size else 0.0,
        relative_error=_relative_error(a, b),
        cosine=cosine_similarity(a, b),
        argmax_agreement=argmax_agreement(original, rewritten),
        nonfinite=nonfinite,
    )


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


def argmax_agreement(original: np.ndarray, rewritten: np.ndarray) -> float | None:
    """Fraction of rows (all axes but the last) whose last-axis argmax agrees; None when the
    output is not logits-like (not float, rank < 2, or one entry per row)."""
    if not np.issubdtype(original.dtype, np.floating) or original.ndim < 2 or original.shape[-1] < 2 or original.size == 0:
        return None
    return float(np.mean(np.argmax(original, axis=-1) == np.argmax(rewritten, axis=-1)))


def _json_float(value):
    """JSON has no NaN/inf: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# --- running both models ------------------------------------------------------------------------


@dataclasses.dataclass
class CheckInputs:
    feeds: dict[str, np.ndarray]
    source: str  # said in the report: how the inputs were made


def prepare_inputs(
    graph: ir.Graph,
    inputs: str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int = DEFAULT_SEQ,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
) -> CheckInputs:
    """The inputs to compare on, for the model whose signature ``graph`` has: a ``.npz`` path
    or a dict of arrays (checked against the signature), or by default generated from it
    (``batch`` x ``seq`` for symbolic dims, token ids inside the vocabulary, masks with padding)."""
    if inputs is None:
        feeds = generate_inputs(graph, batch=batch, seq=seq, seed=seed)
        return CheckInputs(feeds, f"generated (batch {batch}, seq {seq}, seed {seed})")
    if isinstance(inputs, dict):
        return CheckInputs(_conform(inputs, graph, "the given inputs"), "given arrays")
    return CheckInputs(load_inputs(inputs, graph), str(inputs))


def check(
    original,
    rewritten,
    inputs: CheckInputs | str | os.PathLike | dict[str, np.ndarray] | None = None,
    *,
    seq: int = DEFAULT_SEQ,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    threads: int | None = None,
) -> CheckReport:
    """Run ``original`` and ``rewritten`` (paths or ``onnx_ir.Model``) on the same inputs and
    compare every output the original has, by name. ``inputs``: see ``prepare_inputs``."""
    if not isinstance(inputs, CheckInputs):
        inputs = prepare_inputs(_as_ir(original).graph, inputs, seq=seq, batch=batch, seed=seed)
    feeds = inputs.feeds
    with _session(original, "the original model", threads) as session:
        expected = _run(session, feeds, "the original model")
    with _session(rewritten, "the rewritten model", threads) as session:
        missing = sorted(set(feeds) - {i.name for i in session.get_inputs()})
        if missing:
            raise AttnRewriteError(f"the rewritten model has no input {missing[0]!r}: the models' signatures differ")
        actual = _run(session, feeds, "the rewritten model")
    outputs = []
    for name, value in expected.items():
        if name not in actual:
            raise AttnRewriteError(f"the rewritten model has no output {name!r}")
        outputs.append(compare_outputs(name, value, actual[name]))
    return CheckReport(outputs, {k: list(v.shape) for k, v in feeds.items()}, inputs.source)


def load_inputs(path: str | os.PathLike, graph: ir.Graph) -> dict[str, np.ndarray]:
    """Arrays from a ``.npz`` keyed by input name, cast to each input's declared dtype."""
    path = Path(path)
    if not path.is_file():
        raise AttnRewriteError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as error:
        raise AttnRewriteError(f"{path}: not a .npz archive of arrays ({_first_line(error)})") from error
    return _conform(arrays, graph, str(path))


def _conform(arrays: dict[str, np.ndarray], graph: ir.Graph, where: str) -> dict[str, np.ndarray]:
    """Check the arrays cover the model's inputs (and only them); cast within a dtype kind
    (int32 ids for an int64 input), refuse across kinds (floats for token ids)."""
    wanted = {v.name: v for v in graph.inputs if not v.is_initializer()}
    unknown = sorted(set(arrays) - set(wanted))
    if unknown:
        raise AttnRewriteError(f"{where}: {unknown[0]!r} is not an input of the model (inputs: {', '.join(wanted)})")
    missing = [name for name in wanted if name not in arrays]
    if missing:
        raise AttnRewriteError(f"{where}: no array for input {missing[0]!r}")
    feeds = {}
    for name, value in wanted.items():
        array = np.asarray(arrays[name])
        dtype = value.dtype.numpy() if value.dtype is not None else array.dtype
        if array.dtype != dtype and not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise AttnRewriteError(f"{where}: input {name!r} is {array.dtype}, the model wants {np.dtype(dtype)}")
        feeds[name] = array.astype(dtype, copy=False)
    return feeds


def _as_ir(model) -> ir.Model:
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
            if not path.is_file():
                raise AttnRewriteError(f"{path}: no such file")
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
