"""Shared fixtures. Exports are slow (the dynamo exporter takes seconds per model), so each
model is built and exported once per session and every test reads the same files."""

from __future__ import annotations

import json
import os

import onnx
import onnxruntime
import pytest
from decoders import DecoderCache, DecoderExport
from models import Export, ExportCache, ExportUnsupported

import attnrewrite
from attnrewrite.record import METADATA_KEY


def pytest_configure(config):
    """Under xdist each worker gets its share of the cores: torch and onnxruntime would each start
    a thread per core in every worker, and the surplus threads only contend (and spin)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the processes tests start: torch's threads
    onnxruntime.SessionOptions = _options_with_threads(onnxruntime.SessionOptions, threads)


def _options_with_threads(options: type, threads: int) -> type:
    """SessionOptions whose default intra-op thread count is ``threads`` (a setting still wins)."""

    class WorkerSessionOptions(options):
        def __init__(self):
            super().__init__()
            self.intra_op_num_threads = threads

    return WorkerSessionOptions


def shared_folder(tmp_path_factory, name: str):
    """A folder every test worker of this run sees (xdist: beside the workers' own temporary
    folders), so that an export made by one is read by the others (models.export_once)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp(name)
    folder = tmp_path_factory.getbasetemp().parent / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> ExportCache:
    return ExportCache(shared_folder(tmp_path_factory, "exports"))


@pytest.fixture(scope="session")
def rewritten():
    """rewritten(export, method) -> (rewritten ModelProto, its record), once per session."""
    cache: dict[tuple, tuple[onnx.ModelProto, dict]] = {}

    def rewrite(export, method: str):
        key = (export.path, method)
        if key not in cache:
            model = attnrewrite.rewrite(export.load(), to=method)
            cache[key] = (model, read_record(model))
        return cache[key]

    return rewrite


def read_record(model: onnx.ModelProto) -> dict:
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props[METADATA_KEY])


def exported(exports: ExportCache, name: str, exporter: str, dynamic: bool = True) -> Export:
    """The export, or a skip that says why the exporter could not make it."""
    try:
        return exports.get(name, exporter, dynamic)
    except ExportUnsupported as reason:
        pytest.skip(str(reason))


@pytest.fixture(scope="session")
def decoder_exports(tmp_path_factory) -> DecoderCache:
    """tests/decoders.py's generation exports (KV cache and no cache), once per session."""
    return DecoderCache(shared_folder(tmp_path_factory, "decoders"))


def decoder_exported(exports: DecoderCache, name: str, exporter: str, cache: bool = True) -> DecoderExport:
    """The decoder's export, or a skip that says why the exporter could not make it."""
    try:
        return exports.get(name, exporter, cache)
    except ExportUnsupported as reason:
        pytest.skip(str(reason))
