"""Tiny random-weight decoders, exported to ONNX for generation the way transformers/optimum do.

Importable by tests and benchmarks (``tests/`` is on ``sys.path`` under pytest; elsewhere add it).

The KV-cache export (``cache=True``) takes
    input_ids                     int64 [batch, sequence]              the new tokens, N of them
    attention_mask                int64 [batch, past + sequence]       over past and new tokens (left padding)
    position_ids                  int64 [batch, sequence]              where ``spec.position_ids`` (P..P+N-1)
    past_key_values.{i}.key/value float [batch, kv_heads, past, head_dim]
and returns
    logits                        float [batch, sequence, vocab]
    present.{i}.key/value         float [batch, kv_heads, past + sequence, head_dim]
The no-cache export (``cache=False``) of the same weights takes input_ids, attention_mask (and
position_ids) over the whole sequence and returns logits only: its logits on P + N tokens are
what the cached export's prefix and step logits must equal.

- ``DECODERS``: name -> DecoderSpec: "gpt2" (multi-head, learned positions), "llama" (grouped-query:
  2 key/value heads for 4 query heads, rotary), "qwen2" (grouped-query, rotary, biased q/k/v),
  "falcon" (multi-query: 1 key/value head, rotary), "opt" (learned positions it derives from the
  attention mask: no position_ids input);
- ``cache_input_names(spec)`` / ``cache_output_names(spec)`` / ``input_names(spec, cache)``;
- ``export_decoder(spec, model, path, exporter, cache)``: ``exporter`` "legacy" (TorchScript, opset
  18) or "dynamo"; batch, sequence and past axes dynamic. Raises models.ExportUnsupported with
  the reason when the export fails or is wrong at a shape other than the traced one;
- ``DecoderCache(folder).get(name, exporter, cache=True) -> DecoderExport``: one build per model
  and one export per (model, exporter, cache) for a whole test session (``conftest.decoders``);
- ``generation_feeds(spec, model, batch, past, new, padded=True)`` -> GenerationFeeds: ``cached``,
  feeds for the KV-cache export whose past tensors come from running the torch model on the first
  ``past`` tokens, and ``full``, the same P + N tokens for the no-cache export; row 0 unpadded,
  the others left padded (the padding is in the past, as in batched generation);
  ``next_step_feeds(spec, feeds, outputs, next_ids)``: a decoding step's feeds from the last run's;
- ``torch_logits(spec, model, feeds)``: the torch model's logits on ``full`` feeds;
  ``logits_error(actual, expected, attention_mask)``: the largest difference at real (unpadded)
  positions, ``actual`` being the last positions of ``expected``;
- ``run(export, feeds)``: every output of an export on onnxruntime's CPU provider, by name.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from models import EXPORTERS, ExportUnsupported, _quiet, _reason, _seeded, export_once, falcon_multi_query_config
from torch import nn

VOCAB = 100
HIDDEN = 32
HEADS = 4
LAYERS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_POSITIONS = 64
# Exports trace with this shape: past and new lengths differ, so no exporter can confuse them
TRACE_BATCH, TRACE_PAST, TRACE_NEW = 2, 3, 4
# ... and must be right at this one too (another batch, past and length; left padded)
CHECK_BATCH, CHECK_PAST, CHECK_NEW = 3, 5, 2
OPSET = 18


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    name: str
    build: Callable[[], nn.Module]  # the transformers *ForCausalLM model
    kv_heads: int  # key/value heads (= HEADS for multi-head attention)
    position_ids: bool  # whether the export takes position_ids (else the model derives them)
    layers: int = LAYERS
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    vocab: int = VOCAB


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=MAX_POSITIONS,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def _llama_like(model_name: str, config_name: str, kv_heads: int, **overrides):
    import transformers

    def build():
        config = getattr(transformers, config_name)(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=kv_heads,
            max_position_embeddings=MAX_POSITIONS,
            attn_implementation="sdpa",
            **overrides,
        )
        return getattr(transformers, model_name)(config)

    return build


def _falcon():
    from transformers import FalconForCausalLM

    return FalconForCausalLM(falcon_multi_query_config())


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        ffn_dim=2 * HIDDEN,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=1,
        attn_implementation="sdpa",
    )
    return OPTForCausalLM(config)


DECODERS: dict[str, DecoderSpec] = {
    spec.name: spec
    for spec in (
        DecoderSpec("gpt2", _seeded(_gpt2), kv_heads=HEADS, position_ids=True),
        DecoderSpec("llama", _seeded(_llama_like("LlamaForCausalLM", "LlamaConfig", 2)), kv_heads=2, position_ids=True),
        DecoderSpec("qwen2", _seeded(_llama_like("Qwen2ForCausalLM", "Qwen2Config", 2)), kv_heads=2, position_ids=True),
        DecoderSpec("falcon", _seeded(_falcon), kv_heads=1, position_ids=True),
        DecoderSpec("opt", _seeded(_opt), kv_heads=HEADS, position_ids=False),
    )
}


# --- names ---------------------------------------------------------------------------------


def cache_input_names(spec: DecoderSpec) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(spec.layers) for kv in ("key", "value")]


def cache_output_names(spec: DecoderSpec) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(spec.layers) for kv in ("key", "value")]


def input_names(spec: DecoderSpec, cache: bool = True) -> list[str]:
    names = ["input_ids", "attention_mask", *(["position_ids"] if spec.position_ids else [])]
    return names + (cache_input_names(spec) if cache else [])


# --- wrappers: flat tensors in and out (the exporters need both) ------------------------------


class CachedDecoder(nn.Module):
    """forward(input_ids, attention_mask, [position_ids,] *past) -> (logits, *presents): the past
    tensors become the model's DynamicCache, its updated cache the presents."""

    def __init__(self, spec: DecoderSpec, model: nn.Module):
        super().__init__()
        self.spec, self.model = spec, model

    def forward(self, input_ids, attention_mask, *rest):
        from transformers import DynamicCache

        position_ids, past = (rest[0], rest[1:]) if self.spec.position_ids else (None, rest)
        cache = DynamicCache()
        for layer in range(self.spec.layers):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        presents = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
        return (out.logits, *presents)


class UncachedDecoder(nn.Module):
    """forward(input_ids, attention_mask[, position_ids]) -> logits, no cache."""

    def __init__(self, spec: DecoderSpec, model: nn.Module):
        super().__init__()
        self.spec, self.model = spec, model

    def forward(self, input_ids, attention_mask, position_ids=None):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits


# --- feeds -------------------------------------------------------------------------------------


@dataclasses.dataclass
class GenerationFeeds:
    cached: dict[str, np.ndarray]  # for the KV-cache export: N new tokens after P cached ones
    full: dict[str, np.ndarray]  # for the no-cache export: the same P + N tokens
    past: int
    new: int


def left_padded_mask(batch: int, length: int) -> np.ndarray:
    """1 = token, 0 = padding: row 0 full, row r padded at its first min(r + 1, length - 1) positions."""
    mask = np.ones((batch, length), np.int64)
    for row in range(1, batch):
        mask[row, : min(row + 1, length - 1)] = 0
    return mask


def positions_of(mask: np.ndarray) -> np.ndarray:
    """transformers' generate(): a token's position counts the real tokens before it; padding at 1."""
    positions = np.cumsum(mask, axis=-1) - 1
    return np.where(mask == 0, 1, positions).astype(np.int64)


def generation_feeds(
    spec: DecoderSpec, model: nn.Module, batch: int, past: int, new: int, padded: bool = True, seed: int = 0
) -> GenerationFeeds:
    total = past + new
    ids = np.random.default_rng(seed).integers(2, spec.vocab, (batch, total)).astype(np.int64)
    mask = left_padded_mask(batch, total) if padded else np.ones((batch, total), np.int64)
    full = {"input_ids": ids, "attention_mask": mask}
    if spec.position_ids:
        full["position_ids"] = positions_of(mask)
    cached = {"input_ids": ids[:, past:], "attention_mask": mask}
    if spec.position_ids:
        cached["position_ids"] = full["position_ids"][:, past:]
    cached.update(zip(cache_input_names(spec), _past_of_prefix(spec, model, full, past)))
    return GenerationFeeds(cached, full, past, new)


def next_step_feeds(
    spec: DecoderSpec, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray], next_ids: np.ndarray
) -> dict[str, np.ndarray]:
    """The KV-cache export's feeds for one more token per row (``next_ids`` [B]) after a run on
    ``feeds`` returned ``outputs`` (by name): the presents become the past, the mask grows by one."""
    batch = next_ids.shape[0]
    mask = np.concatenate([feeds["attention_mask"], np.ones((batch, 1), np.int64)], axis=1)
    step = {"input_ids": next_ids.reshape(batch, 1).astype(np.int64), "attention_mask": mask}
    if spec.position_ids:
        step["position_ids"] = positions_of(mask)[:, -1:]
    step.update(zip(cache_input_names(spec), (outputs[name] for name in cache_output_names(spec))))
    return step


def _past_of_prefix(spec: DecoderSpec, model: nn.Module, full: dict[str, np.ndarray], past: int) -> list[np.ndarray]:
    """The keys and values the model caches for the first ``past`` tokens, [B, kv_heads, past, D] each."""
    if past == 0:
        batch = full["input_ids"].shape[0]
        return [np.zeros((batch, spec.kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.layers)
    prefix = {name: torch.from_numpy(array[:, :past]) for name, array in full.items()}
    with torch.no_grad():
        out = model(**prefix, use_cache=True)
    return [t.numpy() for layer in out.cache.layers for t in (layer.keys, layer.values)]


def logits_error(actual: np.ndarray, expected: np.ndarray, attention_mask: np.ndarray) -> float:
    """max |actual - expected| over the positions of ``actual`` (the last ones of ``expected``)
    that are tokens: a padded query sees no key, and what it computes is each exporter's own."""
    n = actual.shape[1]
    real = attention_mask[:, -n:].astype(bool)
    return float(np.max(np.abs(actual - expected[:, -n:])[real]))


def torch_logits(spec: DecoderSpec, model: nn.Module, full: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return model(**{name: torch.from_numpy(a) for name, a in full.items()}, use_cache=False).logits.numpy()


# --- export ------------------------------------------------------------------------------------


def export_decoder(
    spec: DecoderSpec, model: nn.Module, path: str | os.PathLike, exporter: str, cache: bool = True
) -> Path:
    """Export with dynamic batch, sequence and past axes; ExportUnsupported with the reason when
    the exporter fails or writes a graph that is wrong at a shape other than the traced one."""
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; one of {EXPORTERS}")
    path = Path(path)
    # in eval mode: the legacy exporter restores the wrapper's mode to every submodule afterwards
    module = (CachedDecoder(spec, model) if cache else UncachedDecoder(spec, model)).eval()
    feeds = generation_feeds(spec, model, TRACE_BATCH, TRACE_PAST, TRACE_NEW)
    feeds = feeds.cached if cache else feeds.full
    names = input_names(spec, cache)
    outputs = ["logits", *(cache_output_names(spec) if cache else [])]
    args = tuple(torch.from_numpy(feeds[name]) for name in names)
    try:
        with warnings.catch_warnings(), _quiet():
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                torch.onnx.export(
                    module,
                    args,
                    str(path),
                    input_names=names,
                    output_names=outputs,
                    dynamic_axes=_legacy_axes(spec, cache),
                    opset_version=OPSET,
                    dynamo=False,
                )
            else:
                program = torch.onnx.export(
                    module,
                    args,
                    input_names=names,
                    output_names=outputs,
                    dynamic_shapes=_dynamo_shapes(spec, cache),
                    opset_version=OPSET,
                    dynamo=True,
                    verbose=False,
                )
                program.save(str(path))
    except Exception as error:
        raise ExportUnsupported(f"{exporter} exporter: {_reason(error)}") from error
    _check_right_at_another_shape(spec, model, path, exporter, cache)
    return path


def _legacy_axes(spec: DecoderSpec, cache: bool) -> dict[str, dict[int, str]]:
    total = "past_sequence + sequence" if cache else "sequence"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: total}}
    if spec.position_ids:
        axes["position_ids"] = {0: "batch", 1: "sequence"}
    axes["logits"] = {0: "batch", 1: "sequence"}
    if cache:
        axes.update({name: {0: "batch", 2: "past_sequence"} for name in cache_input_names(spec)})
        axes.update({name: {0: "batch", 2: total} for name in cache_output_names(spec)})
    return axes


def _dynamo_shapes(spec: DecoderSpec, cache: bool) -> tuple:
    """Positional, as forward takes them: the past tensors are one *rest tuple."""
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    # torch.export cannot declare past + sequence; the mask's length is a dim of its own
    total = torch.export.Dim("total") if cache else sequence
    ids, mask = {0: batch, 1: sequence}, {0: batch, 1: total}
    positions = [{0: batch, 1: sequence}] if spec.position_ids else []
    if not cache:
        return (ids, mask, *positions)
    past = torch.export.Dim("past_sequence")
    return (ids, mask, (*positions, *[{0: batch, 2: past}] * (2 * spec.layers)))


def _check_right_at_another_shape(spec: DecoderSpec, model: nn.Module, path: Path, exporter: str, cache: bool) -> None:
    """The export's logits equal the torch model's at another batch, past and length (left
    padded), and at one new token (a decoding step)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for new in (CHECK_NEW, 1):
        feeds = generation_feeds(spec, model, CHECK_BATCH, CHECK_PAST, new, seed=1)
        try:
            logits = session.run(["logits"], feeds.cached if cache else feeds.full)[0]
        except Exception as error:
            raise ExportUnsupported(
                f"{exporter} exporter: the exported graph runs only at the traced shape ({_reason(error)})"
            ) from error
        error = logits_error(logits, torch_logits(spec, model, feeds.full), feeds.full["attention_mask"])
        if error > 1e-4:
            raise ExportUnsupported(
                f"{exporter} exporter: the exported graph is wrong at another shape (max error {error:.3g})"
            )


@dataclasses.dataclass
class DecoderExport:
    spec: DecoderSpec
    model: nn.Module  # the very transformers model exported (same weights)
    path: Path
    exporter: str
    cache: bool

    def load(self) -> onnx.ModelProto:
        return onnx.load(str(self.path))

    def feeds(
        self, batch: int = CHECK_BATCH, past: int = CHECK_PAST, new: int = CHECK_NEW, **kwargs
    ) -> GenerationFeeds:
        return generation_feeds(self.spec, self.model, batch, past, new, **kwargs)


class DecoderCache:
    """Builds each decoder once and exports it once per (exporter, cache); failures are cached too."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._models: dict[str, nn.Module] = {}
        self._exports: dict[tuple, DecoderExport | ExportUnsupported] = {}

    def model(self, name: str) -> nn.Module:
        if name not in self._models:
            self._models[name] = DECODERS[name].build()
        return self._models[name]

    def get(self, name: str, exporter: str, cache: bool = True) -> DecoderExport:
        path = self.folder / f"{name}-{exporter}{'-kv' if cache else ''}.onnx"

        def export(reuse: bool) -> DecoderExport:
            if not reuse:
                export_decoder(DECODERS[name], self.model(name), path, exporter, cache)
            return DecoderExport(DECODERS[name], self.model(name), path, exporter, cache)

        return export_once(self._exports, (name, exporter, cache), export, path)


def run(
    export: DecoderExport | onnx.ModelProto | str | os.PathLike, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every output, by name, on onnxruntime's CPU provider."""
    import onnxruntime as ort

    model = export.path if isinstance(export, DecoderExport) else export
    model = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))
