"""Calibration, the frontend-independent part: settings, checks, and the data to fit on.

``--calibrate DATA`` fits every replacement to the exact attention it replaces (attnrewrite/passes/fit.py
does the fitting; the ONNX and FX frontends only collect each site's q, k, v and key_keep).
DATA is model inputs: an ``.npz`` keyed by input name (batch axis stacked), a text file (one
text per line) made into token ids by a ``tokenizers`` tokenizer.json, or arrays / tensors given
to the API. The record keeps, per site, the loss before and after, the steps, how much data was
used and a sha256 of it, never the data.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from attnrewrite import passes
from attnrewrite.data import conform, load_inputs
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.inputs import prefill_filled, with_prefill_inputs
from attnrewrite.passes.fit import DEFAULT_STEPS, fingerprint

DEFAULT_MAX_LENGTH = 256
BATCH_SIZE = 8  # examples per onnxruntime run while collecting
# inputs a tokenizer's encoding gives, by the names models use for them
TEXT_INPUTS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
NPZ_MAGIC = b"PK\x03\x04"


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
    progress: Callable[[str], None] | None = None

    def report(self, index: int, total: int, layer, result) -> dict[str, Any]:
        """Say how site ``index`` went (stderr by default); the record's entry for it."""
        line = (
            f"calibrating site {index + 1}/{total} (layer {layer}): loss {result.loss_before:.4g} -> "
            f"{_after(result)} {_how(result)}"
        )
        (self.progress or _to_stderr)(line)
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
        }

    def report_end_to_end(self, sites: int, result) -> dict[str, Any]:
        """Say how the end-to-end stage went; the record's entry for it."""
        (self.progress or _to_stderr)(
            f"calibrating all {sites} sites end to end: output error {result.loss_before:.4g} -> "
            f"{_after(result)} {_how(result)}"
        )
        entry = result.as_dict()
        del entry["rejected_loss"]  # said by _rejected, only where a fit was undone
        return {**entry, **_rejected(result), "examples": self.examples, "data_sha256": self.fingerprint}


def _after(result) -> str:
    if result.rejected_loss is None:
        return f"{result.loss_after:.4g}"
    return f"{result.rejected_loss:.4g}, worse: the values before fitting kept"


def _how(result) -> str:
    return f"(on {result.measured_batches} of {result.batches} batches; steps {result.steps}, {result.seconds:.1f} s)"


def _rejected(result) -> dict[str, Any]:
    """The record says when a fit was undone (passes.fit._kept_if_lower) and what it had reached."""
    return {} if result.rejected_loss is None else {"kept_unfitted": True, "rejected_loss": result.rejected_loss}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def require_fittable(method: types.ModuleType, options, ce_weight: float = 0.0) -> None:
    """One clear line, before any work, when calibration cannot run at all (or not with the
    attention-weight cross-entropy ``ce_weight`` asks for)."""
    from attnrewrite.passes._torch import torch

    if torch is None:
        raise AttnRewriteError("calibration fits in PyTorch: pip install 'attnrewrite[torch]'")
    reason = passes.nothing_to_fit(method, options)
    if reason:
        raise AttnRewriteError(f"cannot calibrate: {reason}")
    if not ce_weight >= 0:
        raise AttnRewriteError(f"the attention-weight cross-entropy weight must be >= 0, got {ce_weight:g}")
    if ce_weight and (reason := passes.attention_weights_unavailable(method, options)):
        raise AttnRewriteError(f"cannot calibrate with the attention-weight cross-entropy: {reason}")


# --- torch example inputs --------------------------------------------------------------------


def torch_calibration(examples, **settings) -> Calibration:
    """Calibration on torch example inputs: each a tuple of positional arguments (or one
    tensor) or a dict of keyword arguments; ``examples`` in the record counts them."""
    batches = [example if isinstance(example, (tuple, dict)) else (example,) for example in examples]
    if not batches:
        raise AttnRewriteError("the calibration inputs hold no example")
    arguments = [list(e.values()) if isinstance(e, dict) else list(e) for e in batches]
    arrays = [x.detach().cpu().numpy() for args in arguments for x in args if hasattr(x, "detach")]
    masks = [e.get("attention_mask") for e in batches if isinstance(e, dict)]
    tokens = None
    if len(masks) == len(batches) and all(hasattr(m, "detach") for m in masks):
        tokens = int(sum(int((m != 0).sum()) for m in masks))
    return Calibration(batches, fingerprint(arrays), len(batches), tokens, **settings)


# --- ONNX model inputs -----------------------------------------------------------------------


def onnx_calibration(
    data,
    graph: ir.Graph,
    *,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = BATCH_SIZE,
    **settings,
) -> Calibration:
    """Calibration on ``data`` for the model whose signature ``graph`` has: an ``.npz`` path,
    a text file path (with ``tokenizer``), a dict of arrays (batch axis stacked) or a list of
    such dicts (one per batch). For a decoder the data is its tokens (and their mask): each batch
    is a prefill from nothing (onnx.inputs.with_prefill_inputs)."""
    where = "the calibration inputs"
    filled = prefill_filled(graph)
    if isinstance(data, dict):
        batches = split_batch(conform(data, graph, where, filled), batch_size)
    elif isinstance(data, (list, tuple)):
        batches = [conform(feeds, graph, where, filled) for feeds in data]
    else:
        where = str(data)
        path = Path(data)
        if not path.is_file():
            raise AttnRewriteError(f"{path}: no such file")
        with open(path, "rb") as file:
            is_npz = file.read(4) == NPZ_MAGIC
        if is_npz:
            batches = split_batch(load_inputs(path, graph, filled), batch_size)
        else:
            texts = _read_texts(path)
            if tokenizer is None:
                raise AttnRewriteError(
                    f"{path}: a text file needs --tokenizer tokenizer.json to make the model's inputs"
                )
            batches = _tokenize(texts, path, tokenizer, graph, max_length, batch_size)
    if not any(_rows(feeds) for feeds in batches):
        raise AttnRewriteError(f"{where}: no examples")
    batches = [with_prefill_inputs(graph, feeds) for feeds in batches]
    names = [v.name for v in graph.inputs if not v.is_initializer()]
    return Calibration(
        batches,
        fingerprint(feeds[name] for feeds in batches for name in names),
        sum(_rows(feeds) for feeds in batches),
        _tokens(batches),
        **settings,
    )


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


def split_batch(feeds: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    """``feeds`` cut along the leading (example) axis into runs of at most ``size`` examples;
    whole where its inputs do not all lead with the same number of examples, as an input without
    that axis (shared by every example) cannot be cut with the others."""
    leading = {array.shape[0] if array.ndim else None for array in feeds.values()}
    if len(leading) != 1 or None in leading:
        return [feeds]
    rows = leading.pop()
    return [{name: array[start : start + size] for name, array in feeds.items()} for start in range(0, rows, size)]


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


def _tokenize(texts, path: Path, tokenizer_path, graph: ir.Graph, max_length: int, batch_size: int):
    """Batches of encodings, truncated to ``max_length`` tokens, padded per batch as the
    tokenizer's own padding settings say (to the batch's longest text). Texts of similar length
    share a batch (sorted by token count), so little of the fitting's work goes to padding; the
    batches keep the file's order of their first texts."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise AttnRewriteError("calibrating on text needs the tokenizers library: pip install tokenizers") from None
    try:
        tokenizer = Tokenizer.from_file(os.fspath(tokenizer_path))
    except Exception as error:  # the library's errors are plain exceptions with its message
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise AttnRewriteError(f"{tokenizer_path}: not a tokenizer.json ({first})") from error
    filled = prefill_filled(graph)  # a decoder's caches and positions: not made from text
    wanted = {v.name: v for v in graph.inputs if not v.is_initializer() and v.name not in filled}
    unknown = [name for name in wanted if name not in TEXT_INPUTS]
    if unknown:
        raise AttnRewriteError(
            f"{path}: the model's input {unknown[0]!r} cannot be made from text (text gives {', '.join(TEXT_INPUTS)})"
        )
    tokenizer.enable_truncation(max_length)
    padding = tokenizer.padding or {}
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    tokenizer.enable_padding(
        direction=padding.get("direction", "right"),
        pad_id=padding.get("pad_id", 0),
        pad_type_id=padding.get("pad_type_id", 0),
        pad_token=padding.get("pad_token", "[PAD]"),
        pad_to_multiple_of=padding.get("pad_to_multiple_of"),
        length=None,  # each batch to its longest text
    )
    batches = []
    for group in similar_length_groups(lengths, batch_size):
        encodings = tokenizer.encode_batch([texts[i] for i in group])
        batches.append(
            {
                name: np.array([getattr(e, TEXT_INPUTS[name]) for e in encodings]).astype(
                    value.dtype.numpy() if value.dtype is not None else np.int64
                )
                for name, value in wanted.items()
            }
        )
    return batches
