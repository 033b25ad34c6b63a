"""Model inputs the user gives, as arrays by input name, made to fit a graph's signature.

The bottom of the data path: the fidelity check (``--inputs``), calibration (``--calibrate``)
and, through them, layer selection read arrays here, so a missing input, an array for an input
the model does not have, or floats for token ids are refused in one wording wherever they come in.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError, require_file


def load_inputs(path: str | os.PathLike, graph: ir.Graph, optional: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Arrays from a ``.npz`` keyed by input name, cast to each input's declared dtype (see conform)."""
    path = Path(path)
    require_file(path, "an .npz archive of inputs")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise AttnRewriteError(f"{path}: not a .npz archive of arrays ({first})") from error
    return conform(arrays, graph, str(path), optional)


def conform(
    arrays: dict[str, np.ndarray], graph: ir.Graph, where: str, optional: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """Check the arrays cover the model's inputs (and only them), but for the ``optional``
    ones (which the caller fills where left out); cast within a dtype kind (int32 ids for an
    int64 input), refuse across kinds (floats for token ids). ``where`` names the arrays in the
    messages."""
    wanted = {v.name: v for v in graph.inputs if not v.is_initializer()}
    unknown = sorted(set(arrays) - set(wanted))
    if unknown:
        raise AttnRewriteError(f"{where}: {unknown[0]!r} is not an input of the model (inputs: {', '.join(wanted)})")
    missing = [name for name in wanted if name not in arrays and name not in optional]
    if missing:
        raise AttnRewriteError(f"{where}: no array for input {missing[0]!r}")
    feeds = {}
    for name, value in wanted.items():
        if name not in arrays:
            continue
        array = np.asarray(arrays[name])
        dtype = value.dtype.numpy() if value.dtype is not None else array.dtype
        if array.dtype != dtype and not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise AttnRewriteError(f"{where}: input {name!r} is {array.dtype}, the model wants {np.dtype(dtype)}")
        feeds[name] = array.astype(dtype, copy=False)
    return feeds


def split_batch(feeds: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    """``feeds`` cut along the leading (example) axis into runs of at most ``size`` examples;
    whole where its inputs do not all lead with the same number of examples, as an input without
    that axis (shared by every example) cannot be cut with the others."""
    leading = {array.shape[0] if array.ndim else None for array in feeds.values()}
    if len(leading) != 1 or None in leading:
        return [feeds]
    rows = leading.pop()
    return [{name: array[start : start + size] for name, array in feeds.items()} for start in range(0, rows, size)]


def load_tokenizer(path: str | os.PathLike, needed_by: str):
    """The ``tokenizers`` library's Tokenizer of a tokenizer.json (``needed_by`` names the task
    that reads text, for the line that says the library is missing)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise AttnRewriteError(f"{needed_by} needs the tokenizers library: pip install 'attnrewrite[text]'") from None
    require_file(path, "a tokenizer.json")
    try:
        return Tokenizer.from_file(os.fspath(path))
    except Exception as error:  # the library's errors are plain exceptions with its message
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise AttnRewriteError(f"{path}: not a tokenizer.json ({first})") from error
