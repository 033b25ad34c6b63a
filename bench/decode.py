"""Decoding speed and memory (issue 26): a Llama-shaped decoder exported for generation with its KV
cache, against its recurrent hedgehog rewrites, which carry a fixed-size state instead.

    python bench/run_benchmarks.py --decode            # contexts 1k .. 64k, prefill at 1k and 4k
    python bench/run_benchmarks.py --decode --quick    # contexts 1k and 4k, fewer steps: to try it

The decoder has random weights (seeded; the times do not depend on them) and is exported by
tests/decoders.py, the exports the generation tests check, once per shape into CACHE. Per
context C, one decoding step (one new token after C) of each model: the median step latency
and the bytes of cache or state the step returns to be fed back. Per prompt length N, the
prefill (N tokens from an empty cache or a zero state) of each model, the recurrent ones beside
the parallel rewrite of the no-cache export. onnxruntime CPU, fp32, batch 1, everything in
this process, each model's decoding steps and prefills one model after another. Writes the "Decoding" section of
bench/RESULTS.md (between DECODING markers; the rest of the file is kept), bench/decode.png and
bench/decode.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(HERE), str(HERE.parent)]  # common.py; this tree's attnrewrite

import onnx
from common import DECODING_MARKERS, Target, cpu_seconds, machine_state, others_cores, shown, table

import attnrewrite
from attnrewrite import bench
from attnrewrite.generate import Decoder
from attnrewrite.onnx.validate import make_session

CACHE = Path(tempfile.gettempdir()) / "attnrewrite-bench"  # the exports, kept between runs
WINDOW = 64
SCHEMA = "attnrewrite.decode-bench/1"
SECTION_START, SECTION_END = DECODING_MARKERS
COMMAND = "python bench/run_benchmarks.py --decode"
# the targets
FLAT_WITHIN = 0.15
FLAT_FROM = 1024
FASTER_AT_LONGEST = 5.0
SMALLER_AT_LONGEST = 50.0
SHORT_CONTEXT_BOUNDS = {"hedgehog": {256: 1.0, 1024: 1.0, 4096: 0.5}, "hedgehog-w": {256: 1.1, 1024: 1.1}}  # issue 47
MAX_NODES_PER_SITE = 40


def _import_decoders():
    """tests/decoders.py. It imports tests/models.py as ``models``, the name bench/models.py holds
    here (run_benchmarks imports it): that one is set aside while decoders loads."""
    if "decoders" in sys.modules:  # under pytest, conftest has it
        return sys.modules["decoders"]
    bench_models = sys.modules.pop("models", None)
    sys.path.insert(0, str(TESTS))
    try:
        import decoders
    finally:
        sys.path.remove(str(TESTS))
        sys.modules.pop("models", None)
        if bench_models is not None:
            sys.modules["models"] = bench_models
    return decoders


decoders = _import_decoders()


# --- what is measured ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama decoder (grouped-query attention, rotary positions) with random weights."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 32000
    max_positions: int = 2**17  # past the longest context: rotary positions have no table to outgrow
    seed: int = 0

    @property
    def name(self) -> str:
        return "llama-" + "-".join(f"{field}{value}" for field, value in dataclasses.asdict(self).items())

    def describe(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, {self.kv_heads} key/value heads "
            f"(grouped-query), FFN {self.intermediate}, vocabulary {self.vocab}"
        )

    def build(self):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(self.seed)
        config = LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config).eval()

    def spec(self):
        return decoders.DecoderSpec(
            self.name,
            self.build,
            kv_heads=self.kv_heads,
            position_ids=True,
            layers=self.layers,
            heads=self.heads,
            head_dim=self.hidden // self.heads,
            vocab=self.vocab,
        )


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    cached: bool  # made from the KV-cache export (else from the no-cache one)
    options: dict | None  # rewrite(..., to=method, **options); None: the export itself
    method: str = "hedgehog"

    @property
    def decodes(self) -> bool:
        """Carries a cache or a state, so it has a decoding step to time."""
        return self.cached


VARIANTS = (
    Variant("original", "original (KV cache)", True, None),
    Variant("hedgehog", "hedgehog, recurrent", True, {"recurrent": True}),
    Variant("hedgehog-std", "hedgehog, recurrent, --standard-ops", True, {"recurrent": True, "standard_ops": True}),
    Variant("hedgehog-w", f"hedgehog window={WINDOW}, recurrent", True, {"recurrent": True, "window": WINDOW}),
    Variant("hedgehog-parallel", "hedgehog, parallel", False, {}),
    Variant("hedgehog-w-parallel", f"hedgehog window={WINDOW}, parallel", False, {"window": WINDOW}),
)
# the tiny Llama of issue 47 (2 layers, 64 wide), one thread: its rows say what a step runs beyond
# the model's own work
TINY = dataclasses.replace(Shape(), layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1000)
TINY_WINDOW = 4
TINY_VARIANTS = (
    Variant("original", "original (KV cache)", True, None),
    Variant("linear", "linear, recurrent", True, {"recurrent": True}, "linear"),
    Variant("hedgehog", "hedgehog, recurrent", True, {"recurrent": True}),
    Variant(
        "hedgehog-w", f"hedgehog window={TINY_WINDOW}, recurrent", True, {"recurrent": True, "window": TINY_WINDOW}
    ),
    Variant(
        "hedgehog-w0",
        f"hedgehog window={TINY_WINDOW} sinks=0, recurrent",
        True,
        {"recurrent": True, "window": TINY_WINDOW, "sinks": 0},
    ),
    # without --recurrent: the KV cache kept, each step the causal form over all of it
    Variant("hedgehog-kv", "hedgehog, parallel over the KV cache", True, {}),
)
TINY_CONTEXTS = (64, 1024)
BY_KEY = {v.key: v for v in VARIANTS}
RECURRENT_VS_PARALLEL = (("hedgehog", "hedgehog-parallel"), ("hedgehog-w", "hedgehog-w-parallel"))
RECURRENT_KEYS = ("hedgehog", "hedgehog-std", "hedgehog-w")


@dataclasses.dataclass(frozen=True)
class Settings:
    shape: Shape = Shape()
    contexts: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    prefill: tuple[int, ...] = (1024, 4096)
    threads: int = os.cpu_count() or 1
    steps: int = 20  # timed decoding steps per (model, context), after ``warmup``
    warmup: int = 3
    prefill_runs: int = 3  # timed prefills per (model, N), after one warm-up
    prompt: int = 256  # tokens each recurrent state has absorbed before the timed steps
    tiny_contexts: tuple[int, ...] = TINY_CONTEXTS  # the tiny Llama's (none: not measured)


VOCAB_IN_USE = 100  # token ids are drawn below it: under every vocabulary benched here
QUICK = dict(contexts=(256, 1024), prefill=(1024,), steps=5, warmup=1, prefill_runs=2)
PREFILLED_UP_TO = 4096  # a context up to this is a real prefill's; past it, a stand-in (method_lines)
INTERLEAVED_UP_TO = 1024  # a context up to this has its models' steps timed in turns (interleaved_steps)
TURNS = 4


def exports(shape: Shape, cache: Path) -> dict[bool, Path]:
    """The KV-cache (True) and no-cache (False) exports of one set of weights, each made once per
    shape and kept in ``cache``; written under another name first, so a killed export is redone."""
    paths = {kv: cache / f"{shape.name}{'-kv' if kv else ''}.onnx" for kv in (True, False)}
    missing = [kv for kv, path in paths.items() if not path.exists()]
    if missing:
        cache.mkdir(parents=True, exist_ok=True)
        model = shape.build()
        for kv in missing:
            print(f"== exporting {paths[kv].name}", file=sys.stderr)
            partial = paths[kv].with_suffix(".partial.onnx")
            decoders.export_decoder(shape.spec(), model, partial, "legacy", cache=kv)
            partial.replace(paths[kv])
    return paths


def model_files(shape: Shape, cache: Path, folder: Path, variants=VARIANTS) -> dict[str, Path]:
    """Variant key -> its ONNX file: the exports, and their rewrites by the public API into ``folder``."""
    exported = exports(shape, cache)
    paths = {}
    for variant in variants:
        source = exported[variant.cached]
        if variant.options is None:
            paths[variant.key] = source
            continue
        print(f"== rewriting: {variant.label}", file=sys.stderr)
        paths[variant.key] = folder / f"{shape.name}-{variant.key}.onnx"
        onnx.save(attnrewrite.rewrite(str(source), to=variant.method, **variant.options), paths[variant.key])
    return paths


# --- measuring ----------------------------------------------------------------------------------


class Model:
    """One session with what it takes and carries (attnrewrite.generate.Decoder)."""

    def __init__(self, variant: Variant, path: Path, threads: int):
        self.variant = variant
        self.session = make_session(str(path), threads=threads)
        self.decoder = Decoder.of(self.session, variant.label)
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, feeds)))

    def prompt_feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The tokens ``ids`` [1, N] from an empty cache or a zero state: a prefill."""
        return {**self.decoder.feeds(ids, np.ones(ids.shape, np.int64), step=0), **self.decoder.initial_state(1)}

    def carried_after(self, context: int, prompt: np.ndarray, rng) -> dict[str, np.ndarray]:
        """What the model carries into the token after ``context`` tokens, by input name: the
        cache or state a prefill of ``context`` tokens leaves (up to PREFILLED_UP_TO); past it,
        a KV cache of random values (a step's time does not depend on them) or the state
        ``prompt`` left (a state has one size at every context)."""
        if context <= PREFILLED_UP_TO:
            ids = rng.integers(0, VOCAB_IN_USE, (1, context))
            return self.carried_of(self.run(self.prompt_feeds(ids)))
        carried = self.carried_of(self.run(self.prompt_feeds(prompt)))
        for c in self.decoder.carried:
            if not all(isinstance(d, int) for d in c.shape[1:]):
                shape = [1 if axis == 0 else d if isinstance(d, int) else context for axis, d in enumerate(c.shape)]
                carried[c.input] = rng.standard_normal(shape, np.float32).astype(c.dtype)
        return carried

    def step_feeds(self, token: np.ndarray, context: int, carried: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``token`` [1, 1] after ``context`` tokens (a mask of context + 1, position context)."""
        return {**self.decoder.feeds(token, np.ones((1, context + 1), np.int64), step=1), **carried}

    def carried_of(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {c.input: outputs[c.output] for c in self.decoder.carried}

    def carried_bytes(self, outputs: dict[str, np.ndarray]) -> int:
        """The cache or state a run returns to be fed back (present.*)."""
        return sum(outputs[c.output].nbytes for c in self.decoder.carried)


def timed(model: Model, feeds: dict, n: int, warmup: int, runs: int) -> tuple[bench.Measurement, dict]:
    """The run times (after ``warmup`` runs) as a Measurement at ``n``, and the last outputs."""
    times = []
    try:
        for run in range(warmup + runs):
            outputs = None  # a 64k KV cache's presents are gigabytes: never two sets at once
            start = time.perf_counter()
            outputs = model.run(feeds)
            if run >= warmup:
                times.append(time.perf_counter() - start)
    except Exception as error:  # one failed cell (out of memory at 64k) must not lose the others
        return bench.Measurement(model.variant.key, n, "failed", detail=_first_line(error)), {}
    return bench.Measurement(model.variant.key, n, "ok", times), outputs


def timed_steps(
    model: Model, context: int, carried: dict, settings: Settings, rng, keep_feeds: bool
) -> tuple[bench.Measurement, tuple]:
    """Consecutive decoding steps after ``context`` tokens, each fed what the one before returned
    (so a window's block boundaries come in their turn): the times after ``settings.warmup``, and
    (the first step's feeds where ``keep_feeds``, else None; the bytes it carries on)."""
    times, first = [], None
    try:
        for step in range(settings.warmup + settings.steps):
            feeds = model.step_feeds(rng.integers(0, VOCAB_IN_USE, (1, 1)), context + step, carried)
            carried = outputs = None  # a 64k KV cache's presents are gigabytes: never two sets at once
            start = time.perf_counter()
            outputs = model.run(feeds)
            if step >= settings.warmup:
                times.append(time.perf_counter() - start)
            first = first or (feeds if keep_feeds else None, model.carried_bytes(outputs))
            carried = model.carried_of(outputs)
    except Exception as error:  # one failed cell (out of memory at 64k) must not lose the others
        return bench.Measurement(model.variant.key, context, "failed", detail=_first_line(error)), {}
    return bench.Measurement(model.variant.key, context, "ok", times), first


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def nodes_per_step(path: Path, feeds: dict, threads: int) -> int:
    """The nodes onnxruntime runs for one step (its profiler, after its graph optimizations; an
    If's branch nodes included)."""
    with tempfile.TemporaryDirectory(prefix="attnrewrite-profile-") as folder:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.log_severity_level = threads, 3
        options.enable_profiling, options.profile_file_prefix = True, str(Path(folder) / "step")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    return sum(1 for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))


def measure_decoding(paths: dict[str, Path], settings: Settings, variants=VARIANTS) -> tuple[list, dict, dict]:
    """Per model that decodes, consecutive steps after each context: (measurements, {key:
    {context: carried bytes}}, {key: nodes run per step}). Up to INTERLEAVED_UP_TO the models
    take turns at each context (interleaved_steps); past it the recurrent models take turns over
    every longer context (their flat line, issue 26's target, is a comparison across contexts),
    then the models with a KV cache, one context after another: a step just after the original's at
    64k (gigabytes of KV cache through memory) ran up to 20% slower."""
    rng = np.random.default_rng(0)
    models = [Model(v, paths[v.key], settings.threads) for v in variants if v.decodes]
    prompt = rng.integers(0, VOCAB_IN_USE, (1, settings.prompt))
    measurements, carried, nodes = [], {m.variant.key: {} for m in models}, {}

    counted = settings.contexts[0]  # the context whose step's nodes are counted

    def record(model, context, measurement, first):
        measurements.append(measurement)
        if first:
            feeds, carried[model.variant.key][context] = first
            if context == counted:
                nodes[model.variant.key] = nodes_per_step(paths[model.variant.key], feeds, settings.threads)

    def in_turns(cells: list[tuple[Model, int]], said: str) -> None:
        print(f"== decoding steps {said}, in turns", file=sys.stderr)
        for (model, context), (measurement, first) in zip(
            cells, interleaved_steps(cells, prompt, settings, rng, counted)
        ):
            record(model, context, measurement, first)

    for context in [c for c in settings.contexts if c <= INTERLEAVED_UP_TO]:
        in_turns([(model, context) for model in models], f"after {context} tokens, every model")
    longer = [c for c in settings.contexts if c > INTERLEAVED_UP_TO]
    recurrent = [model for model in models if (model.variant.options or {}).get("recurrent")]
    if longer:
        in_turns([(model, c) for model in recurrent for c in longer], f"after {longer} tokens, the recurrent models")
    for model in [model for model in models if model not in recurrent]:  # with a KV cache
        for context in longer:
            print(f"== decoding steps: {model.variant.label} after {context} tokens", file=sys.stderr)
            start = model.carried_after(context, prompt, rng)
            measurement, first = timed_steps(model, context, start, settings, rng, keep_feeds=context == counted)
            record(model, context, measurement, first)
            del first  # a 64k KV cache is gigabytes: not two at once
    return measurements, carried, nodes


def interleaved_steps(cells: list[tuple[Model, int]], prompt, settings: Settings, rng, counted: int) -> list[tuple]:
    """timed_steps of every (model, context) cell in TURNS turns (fewer for fewer steps), cell
    after cell, each turn the same steps from the same state (its warm-up included): the
    machine's drift, 15% between two runs of one model after another, then hits every cell
    alike. (measurement, first) per cell, in order; the first step's feeds kept at ``counted``."""
    starts = [model.carried_after(context, prompt, rng) for model, context in cells]
    count = min(TURNS, settings.steps)
    per_turn = dataclasses.replace(settings, steps=settings.steps // count)
    turns = [[] for _ in cells]
    for _ in range(count):
        for (model, context), start, taken in zip(cells, starts, turns):
            taken.append(timed_steps(model, context, start, per_turn, rng, keep_feeds=context == counted))
    results = []
    for (model, context), taken in zip(cells, turns):
        failed = [m for m, _ in taken if m.status != "ok"]
        times = [t for m, _ in taken for t in m.times_s]
        measurement = failed[0] if failed else bench.Measurement(model.variant.key, context, "ok", times)
        results.append((measurement, taken[0][1]))
    return results


def measure_prefill(paths: dict[str, Path], settings: Settings) -> list[bench.Measurement]:
    """Per prompt length N, the prefill of every model on the same N tokens. One model at a time:
    a session keeps the memory its longest prefill took (several GB at N = 4096), and five at once
    would hold 20 GB of a machine shared with other work."""
    rng = np.random.default_rng(1)
    prompts = {n: rng.integers(0, settings.shape.vocab, (1, n)) for n in settings.prefill}
    measurements = []
    for variant in (BY_KEY[key] for key in PREFILL_ORDER):  # --standard-ops prefills as hedgehog does
        model = Model(variant, paths[variant.key], settings.threads)
        for n, ids in prompts.items():
            print(f"== prefill: {variant.label} at N = {n}", file=sys.stderr)
            measurements.append(timed(model, model.prompt_feeds(ids), n, 1, settings.prefill_runs)[0])
        del model
    return measurements


def measure_tiny(paths: dict[str, Path], settings: Settings) -> TinyResults:
    """The tiny Llama's decoding steps at ``settings.tiny_contexts`` on one thread, and the nodes
    each runs."""
    contexts = settings.tiny_contexts
    tiny = dataclasses.replace(settings, shape=TINY, contexts=contexts, threads=1, steps=4 * settings.steps)
    steps, _, nodes = measure_decoding(paths, tiny, TINY_VARIANTS)
    return TinyResults(contexts, steps, nodes)


# --- results and targets ------------------------------------------------------------------------


@dataclasses.dataclass
class TinyResults:
    contexts: tuple[int, ...]
    steps: list[bench.Measurement]  # variant = the model's key, n = the context
    nodes: dict[str, int]  # key -> nodes onnxruntime runs per step

    def step_ms(self, key: str, context: int) -> float | None:
        return _step_ms(self.steps, key, context)

    def as_dict(self) -> dict:
        return {
            "shape": dataclasses.asdict(TINY),
            "contexts": list(self.contexts),
            "threads": 1,
            "models": {v.key: {"label": v.label, "method": v.method, "options": v.options} for v in TINY_VARIANTS},
            "decode": [m.as_dict() for m in self.steps],
            "nodes_per_step": self.nodes,
        }


@dataclasses.dataclass
class Results:
    settings: Settings
    steps: list[bench.Measurement]  # variant = the model's key, n = the context
    carried: dict[str, dict[int, int]]  # key -> context -> bytes the step returned (present.*)
    prefill: list[bench.Measurement]  # n = the prompt's length
    machine: dict  # {"start": ..., "end": ...}: common.machine_state, others_cores at the end
    cache: Path  # where the exports are kept
    nodes: dict[str, int]  # key -> nodes onnxruntime runs per step (at the first context)
    tiny: TinyResults | None = None

    def step_ms(self, key: str, context: int) -> float | None:
        return _step_ms(self.steps, key, context)

    def prefill_of(self, key: str) -> list[bench.Measurement]:
        return [m for m in self.prefill if m.variant == key]

    def as_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "command": COMMAND,
            "machine": self.machine,
            "settings": dataclasses.asdict(self.settings),
            "exports": str(self.cache),
            "models": {v.key: {"label": v.label, "options": v.options} for v in VARIANTS},
            "decode": [{**m.as_dict(), "carried_bytes": self.carried.get(m.variant, {}).get(m.n)} for m in self.steps],
            "nodes_per_step": self.nodes,
            "prefill": [m.as_dict() for m in self.prefill],
            "tiny": None if self.tiny is None else self.tiny.as_dict(),
            "targets": [dataclasses.asdict(t) for t in evaluate(self)],
        }


def _ms(m: bench.Measurement | None) -> float | None:
    return m.median_s * 1e3 if m is not None and m.status == "ok" else None


def _step_ms(steps: list[bench.Measurement], key: str, context: int) -> float | None:
    return _ms(next((m for m in steps if m.variant == key and m.n == context), None))


def evaluate(results: Results) -> list[Target]:
    """The issues' targets, per recurrent model: a flat step latency from 1k on, faster and
    smaller than the KV cache at the longest context, a prefill no slower than the parallel
    rewrite's (issue 26); a step no slower than the KV cache's at short contexts, and at most
    MAX_NODES_PER_SITE more nodes per attention site than the original runs (issue 47)."""
    targets = []
    for key, parallel in RECURRENT_VS_PARALLEL:
        targets += [
            flat_target(results, key),
            faster_target(results, key),
            smaller_target(results, key),
            prefill_target(results, key, parallel),
        ]
    for key, bounds in SHORT_CONTEXT_BOUNDS.items():
        targets += [short_context_target(results, key, context, bound) for context, bound in bounds.items()]
    targets += [nodes_target(results.nodes, BY_KEY[key], results.settings.shape.layers) for key in RECURRENT_KEYS]
    if results.tiny is not None:
        recurrent = [v for v in TINY_VARIANTS if v.options and v.options.get("recurrent")]
        targets += [nodes_target(results.tiny.nodes, v, TINY.layers, "tiny Llama") for v in recurrent]
    return targets


def short_context_target(results: Results, key: str, context: int, bound: float) -> Target:
    times = f"at most {bound:g}x" if bound != 1 else "no slower than"
    text = f"{BY_KEY[key].label}: step {times} the KV-cache original's at C={context}"
    ours, original = results.step_ms(key, context), results.step_ms("original", context)
    if ours is None or original is None:
        return Target(text, "not measured", None)
    measured = f"{_ms_text(ours)} ms / original {_ms_text(original)} ms = {ours / original:.2f}x"
    return Target(text, measured, ours <= bound * original)


def nodes_target(nodes: dict[str, int], variant: Variant, layers: int, model: str = "12 layers") -> Target:
    key = variant.key
    text = (
        f"{variant.label} ({model}): at most {MAX_NODES_PER_SITE} more nodes run per step and attention site "
        "than the original"
    )
    if key not in nodes or "original" not in nodes:
        return Target(text, "not measured", None)
    extra = (nodes[key] - nodes["original"]) / layers
    measured = f"{nodes[key]} nodes, original {nodes['original']}: {extra:+.0f} per site"
    return Target(text, measured, extra <= MAX_NODES_PER_SITE)


def flat_target(results: Results, key: str) -> Target:
    contexts = [c for c in results.settings.contexts if c >= FLAT_FROM] or results.settings.contexts
    first, last = contexts[0], contexts[-1]
    text = f"{BY_KEY[key].label}: step latency flat within {FLAT_WITHIN:.0%} from C={first} to C={last}"
    times = {c: results.step_ms(key, c) for c in contexts}
    if None in times.values():
        return Target(text, "not measured at every context", None)
    ratios = {c: t / times[first] for c, t in times.items()}
    measured = f"C={first}: {_ms_text(times[first])} ms; " + "; ".join(
        f"C={c}: {_ms_text(times[c])} ms ({ratios[c] - 1:+.0%})" for c in contexts[1:]
    )
    return Target(text, measured, all(abs(r - 1) <= FLAT_WITHIN for r in ratios.values()))


def faster_target(results: Results, key: str) -> Target:
    last = results.settings.contexts[-1]
    text = f"{BY_KEY[key].label}: >= {FASTER_AT_LONGEST:g}x faster per token than the KV-cache original at C={last}"
    ours, original = results.step_ms(key, last), results.step_ms("original", last)
    if ours is None or original is None:
        return Target(text, "not measured", None)
    measured = f"original {_ms_text(original)} ms / {_ms_text(ours)} ms = {_ratio_text(original / ours)}x"
    return Target(text, measured, original / ours >= FASTER_AT_LONGEST)


def smaller_target(results: Results, key: str) -> Target:
    last = results.settings.contexts[-1]
    text = f"{BY_KEY[key].label}: state >= {SMALLER_AT_LONGEST:g}x smaller than the KV cache at C={last}"
    ours, original = results.carried.get(key, {}).get(last), results.carried.get("original", {}).get(last)
    if not ours or not original:
        return Target(text, "not measured", None)
    measured = f"KV cache {_mib(original)} MiB / state {_mib(ours)} MiB = {_ratio_text(original / ours)}x"
    return Target(text, measured, original / ours >= SMALLER_AT_LONGEST)


def prefill_target(results: Results, key: str, parallel: str) -> Target:
    """No slower: at no N are the recurrent prefill's runs slower than the parallel model's beyond
    their spread (attnrewrite.bench.compare_series: the interquartile ranges do not overlap)."""
    text = f"{BY_KEY[key].label}: prefill no slower than the parallel rewrite ({BY_KEY[parallel].label})"
    verdicts = bench.compare_series(
        results.prefill_of(key), results.prefill_of(parallel), list(results.settings.prefill)
    )
    if len(verdicts) < len(results.settings.prefill):
        return Target(text, "not measured at every N", None)
    measured = "; ".join(
        f"N={n}: {_ms_text(_ms(ours))} / {_ms_text(_ms(theirs))} ms = {_ms(ours) / _ms(theirs):.2f}x ({verdicts[n]})"
        for n, ours, theirs in zip(results.settings.prefill, results.prefill_of(key), results.prefill_of(parallel))
    )
    return Target(text, measured, "slower" not in verdicts.values())


def _ms_text(ms: float) -> str:
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.1f}"


def _mib(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    mib = nbytes / 2**20
    return f"{mib:.1f}" if mib >= 10 else f"{mib:.2f}" if mib >= 0.1 else f"{mib:.4f}"


# --- the report ---------------------------------------------------------------------------------

PREFILL_ORDER = ("original", "hedgehog", "hedgehog-parallel", "hedgehog-w", "hedgehog-w-parallel")


def nodes_table(results: Results) -> list[str]:
    layers = results.settings.shape.layers
    rows = [
        [v.label, str(results.nodes[v.key]), _per_site(results.nodes, v.key, layers)]
        for v in VARIANTS
        if v.key in results.nodes
    ]
    return [
        f"### Nodes run per decoding step (C = {results.settings.contexts[0]})",
        "",
        "Counted by onnxruntime's profiler after its graph optimizations, the nodes of the branch an `If` takes "
        f"included; per attention site: beyond the original's, over its {layers} layers.",
        "",
        table(["model", "nodes per step", "per attention site, beyond the original"], rows),
        "",
    ]


def tiny_table(results: Results) -> list[str]:
    tiny = results.tiny
    if tiny is None:
        return []
    header = [
        "model",
        *(f"step at C={c}, ms" for c in tiny.contexts),
        "nodes per step",
        "per site, beyond the original",
    ]
    rows = [
        [
            v.label,
            *(
                _cell(
                    _ms_text(tiny.step_ms(v.key, c) or 0),
                    tiny.step_ms("original", c) if v.cached and v.options is not None else None,
                    tiny.step_ms(v.key, c),
                )
                for c in tiny.contexts
            ),
            str(tiny.nodes.get(v.key, "")),
            _per_site(tiny.nodes, v.key, TINY.layers),
        ]
        for v in TINY_VARIANTS
    ]
    return [
        "### The tiny Llama, one thread",
        "",
        f"{TINY.describe()}, one intra-op thread, steps as above ({4 * results.settings.steps} timed). In "
        "parentheses: the original's time / the model's. The last row keeps the KV cache (no --recurrent): "
        "each step runs the causal form over the whole cache.",
        "",
        table(header, rows),
        "",
    ]


def _per_site(nodes: dict[str, int], key: str, layers: int) -> str:
    if key == "original" or key not in nodes or "original" not in nodes:
        return ""
    return f"{(nodes[key] - nodes['original']) / layers:+.0f}"


def render(results: Results, plotted: bool) -> str:
    """The Decoding section of RESULTS.md, its markers included."""
    targets = evaluate(results)
    verdict = {True: "**met**", False: "**not met**", None: "not measured"}
    lines = [
        SECTION_START,
        "## Decoding",
        "",
        f"Written by `{COMMAND}` ({results.machine['start']['time']} to {results.machine['end']['time']}).",
        "Numbers are benchmarks, not tests: rerun it on a quiet machine before quoting them.",
        "",
        *method_lines(results),
        "",
        "### Targets",
        "",
        table(
            ["target", "measured", "result"], [[t.text, t.measured, verdict[t.reached]] for t in targets], numeric=False
        ),
        "",
        *step_tables(results),
        *nodes_table(results),
        *prefill_table(results),
        *tiny_table(results),
        "![decode.png](decode.png)" if plotted else "(no plot: matplotlib is not installed)",
        "",
        SECTION_END,
    ]
    return "\n".join(lines)


def method_lines(results: Results) -> list[str]:
    s, start, end = results.settings, results.machine["start"], results.machine["end"]
    others = end["others_cores"]
    return [
        f"- Model: a Llama decoder with random weights (seed {s.shape.seed}), {s.shape.describe()}; exported for "
        "generation by tests/decoders.py (legacy exporter, opset 18) with its KV cache and without, both kept in "
        f'{shown(str(results.cache))}. Rewritten with `attnrewrite.rewrite(kv_export, to="hedgehog", recurrent=True)` '
        f"(and `window={WINDOW}`), zero-shot; the parallel models are `attnrewrite.rewrite(no_cache_export, "
        f'to="hedgehog")` (and `window={WINDOW}`).',
        f"- Machine: {start['cpu']}, {start['cores']} cores, {start['memory_gb']} GB memory; "
        f"onnxruntime {start['versions']['onnxruntime']}, torch {start['versions']['torch']}, Python {start['python']}.",
        f"- Load: load average (1, 5, 15 min) {start['load_average']} before the measurements, {end['load_average']} "
        f"after (ours included); other processes used {others:.2f} of {start['cores']} cores on average during "
        "them: "
        + (
            "the machine was otherwise idle."
            if others < 0.05
            else "the machine was NOT idle (shared with other work): the timings are noisy."
        ),
        f"- onnxruntime CPU, fp32, batch 1, {s.threads} intra-op thread{'s' if s.threads > 1 else ''}, one process. Steps at "
        f"context C: {s.warmup} warm-up and {s.steps} timed consecutive calls of one new token each, from position "
        "C on, each fed the cache or state the one before returned (a window's block boundaries come in their "
        f"turn); the median. Up to C = {INTERLEAVED_UP_TO} the models take {min(TURNS, s.steps)} turns, model after "
        f"model, of {s.warmup} warm-up and {s.steps // min(TURNS, s.steps)} timed steps from the same state (the machine's drift "
        "hits them alike); past it the recurrent models take those turns over every longer context together (their "
        "flat line compares contexts), then the KV-cache original one context after another. The prefills one model "
        f"after another too. A prefill: N tokens from an empty cache or a zero state, median of {s.prefill_runs} "
        "runs after 1 warm-up.",
        f"- Up to C = {PREFILLED_UP_TO} the cache or state is what a prefill of C tokens left. Past it the original "
        "is fed a KV cache of C random positions (a step's time does not depend on its values) and each recurrent "
        f"model the state a {s.prompt}-token prefill left, its position C (a state has one size at every C).",
        "- `hedgehog, recurrent` updates and reads its kernel state in one `com.microsoft.LinearAttention` node "
        "per step (the installed onnxruntime runs it); `--standard-ops` is the same model in standard operators.",
    ]


def step_tables(results: Results) -> list[str]:
    """Latency per step and bytes carried per step, per context and decoding model."""
    decoding = [v for v in VARIANTS if v.decodes]
    header = ["context C", *[v.label for v in decoding]]
    times, sizes = [], []
    for c in results.settings.contexts:
        step = {m.variant: m for m in results.steps if m.n == c}
        carried = {key: by_context.get(c) for key, by_context in results.carried.items()}
        times.append([str(c)])
        sizes.append([str(c)])
        for v in decoding:
            baseline = v.key != "original"
            times[-1].append(
                _cell(_time(step.get(v.key)), _ms(step.get("original")) if baseline else None, _ms(step.get(v.key)))
            )
            sizes[-1].append(
                _cell(_mib(carried.get(v.key)), carried.get("original") if baseline else None, carried.get(v.key))
            )
    return [
        "### Per-token decoding step, ms",
        "",
        "In parentheses: the original's time / the model's (its speedup).",
        "",
        table(header, times),
        "",
        "### Cache or state carried per step, MiB",
        "",
        "The bytes of the `present.*` outputs a step returns to be fed back: the KV cache of C + 1 positions, or the "
        "recurrent state (one size at every C). In parentheses: the original's bytes / the model's.",
        "",
        table(header, sizes),
        "",
    ]


def prefill_table(results: Results) -> list[str]:
    header = ["N", *[BY_KEY[key].label for key in PREFILL_ORDER]]
    rows = []
    for n in results.settings.prefill:
        run = {m.variant: m for m in results.prefill if m.n == n}
        rows.append([str(n)])
        for key in PREFILL_ORDER:
            ms, parallel = _ms(run.get(key)), _ms(run.get(f"{key}-parallel"))
            rows[-1].append(
                _time(run.get(key)) + (f" ({ms / parallel:.2f}x the parallel's)" if ms and parallel else "")
            )
    return [
        "### Prefill, ms",
        "",
        "N prompt tokens, batch 1: the recurrent models from a zero state beside the parallel rewrite of the no-cache "
        "export (no state), and the original (softmax attention) from an empty KV cache.",
        "",
        table(header, rows),
        "",
    ]


def _time(m: bench.Measurement | None) -> str:
    if m is None:
        return ""
    return _ms_text(m.median_s * 1e3) if m.status == "ok" else m.status.replace("_", " ")


def _cell(text: str, reference: float | None, value: float | None) -> str:
    """``text`` with reference / value in parentheses (how many times faster or smaller), when both are known."""
    return f"{text} ({_ratio_text(reference / value)}x)" if reference and value else text


def write_section(path: Path, section: str) -> None:
    """Replace the text between the DECODING markers of ``path`` with ``section`` (append it where
    there is none); the rest of the file is kept as it is."""
    text = path.read_text() if path.exists() else ""
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_START, 1)
        text = before + section + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    path.write_text(text)


def plot(results: Results, path: Path) -> bool:
    """Step latency and carried bytes against the context, log-log, one line per decoding model
    (drawn as attnrewrite.bench.draw_series draws the other sweeps); False without matplotlib."""
    try:  # a bare Figure, not pyplot: no global state, no display backend
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        return False
    figure = Figure(figsize=(11, 4.6))
    latency, size = figure.subplots(1, 2)
    contexts = list(results.settings.contexts)
    for v in (v for v in VARIANTS if v.decodes):
        times = [(c, results.step_ms(v.key, c)) for c in contexts if results.step_ms(v.key, c) is not None]
        sizes = sorted(results.carried.get(v.key, {}).items())
        for axes, points in ((latency, times), (size, [(c, b / 2**20) for c, b in sizes])):
            if points:
                axes.plot(*zip(*points), marker="o", label=v.label)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axes, unit in ((latency, "per-token step, median (ms)"), (size, "cache or state carried (MiB)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.xaxis.set_major_locator(FixedLocator(contexts))
        axes.xaxis.set_major_formatter(plain)
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(NullFormatter())
        axes.set_xlabel("context C (tokens before the new one)")
        axes.set_ylabel(unit)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    shape = results.settings.shape
    figure.suptitle(
        f"decoding: Llama {shape.layers} layers, d={shape.hidden}, {shape.heads}/{shape.kv_heads} heads; "
        f"CPU, {results.settings.threads} thread{'s' if results.settings.threads > 1 else ''}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


# --- the run ------------------------------------------------------------------------------------


def run(settings: Settings, output: Path, cache: Path = CACHE) -> Results:
    """Measure, then write the Decoding section of ``output`` (a RESULTS.md), and decode.png and
    decode.json beside it."""
    with tempfile.TemporaryDirectory(prefix="attnrewrite-decode-") as folder:
        paths = model_files(settings.shape, cache, Path(folder))
        tiny_paths = model_files(TINY, cache, Path(folder), TINY_VARIANTS) if settings.tiny_contexts else None
        started, cpu_start = machine_state(), cpu_seconds()
        steps, carried, nodes = measure_decoding(paths, settings)
        prefill = measure_prefill(paths, settings)
        tiny = measure_tiny(tiny_paths, settings) if tiny_paths else None
        ended = machine_state()
        ended["others_cores"] = round(others_cores(cpu_start, cpu_seconds()), 2)
    results = Results(settings, steps, carried, prefill, {"start": started, "end": ended}, cache, nodes, tiny)
    output.parent.mkdir(parents=True, exist_ok=True)
    plotted = plot(results, output.parent / "decode.png")
    (output.parent / "decode.json").write_text(json.dumps(results.as_dict(), indent=2) + "\n")
    write_section(output, render(results, plotted))
    return results


def main(args) -> int:
    """``run_benchmarks.py --decode``: ``args`` is its namespace; --quick, --lengths (the contexts),
    --threads and --output apply."""
    settings = Settings(threads=args.threads, **(QUICK if args.quick else {}))
    if args.lengths:
        settings = dataclasses.replace(settings, contexts=tuple(args.lengths))
    run(settings, args.output)
    print(f"wrote the Decoding section of {args.output}, and decode.png and decode.json beside it")
    return 0
