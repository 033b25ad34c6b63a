"""Generation with a decoder ONNX model: ``generate(model, input_ids, max_new_tokens)``.

The model contract is the one transformers/optimum export and the recurrent rewrite keeps:
inputs ``input_ids`` [B, N], ``attention_mask`` [B, P + N] (over what came before and the new
tokens), optionally ``position_ids`` [B, N], and carried values ``past_key_values.X``; outputs
``logits`` [B, N, V] and ``present.X``, each fed back as ``past_key_values.X`` on the next call.
The loop pairs them by name and starts each from zeros of its declared shape (a symbolic batch
axis is the batch, any other symbolic axis the past length, 0), so it runs a KV cache, whose
past axis grows, and a recurrent state of fixed size alike without knowing which it has.
A model that carries nothing is run the slow way: the whole sequence on every call.

The prompt runs in one call (prefill), then one token per row per call. A batch of prompts
is left padded (attention_mask 0 on the pads), positions count a row's real tokens, as
transformers' own generate() makes them. On CUDA the carried values stay on the device
(IOBinding); only the ids and mask go in and the logits come out.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.detect import declared_cache_sizes
from attnrewrite.onnx.inputs import positions_of

# (carried input prefix, returned output prefix): optimum's and onnxruntime-genai's names, and
# the names issue 26 first proposed for recurrent states
CARRIED_PREFIXES = (("past_key_values.", "present."), ("past_state.", "present_state."))
MERGED_BRANCH = "use_cache_branch"  # optimum's merged decoder: False at the prefill, True after
FED_INPUTS = ("input_ids", "attention_mask", "position_ids", MERGED_BRANCH)
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclasses.dataclass(frozen=True)
class Generation:
    """What generate() made and what it cost."""

    tokens: np.ndarray  # int64 [B, T], T <= max_new_tokens; a row that stopped continues with the pad id
    prefill_ms: float  # the prompt's call, which also chose the first new token
    step_ms: tuple[float, ...]  # each later call, one token per row
    state_bytes: int  # the cache or state the last call returned

    @property
    def ms_per_token(self) -> float:
        """The median decoding step (NaN when only the prefill ran)."""
        return statistics.median(self.step_ms) if self.step_ms else float("nan")


@dataclasses.dataclass(frozen=True)
class Carried:
    """One value the model returns and takes back: ``present.X`` -> ``past_key_values.X``."""

    input: str
    output: str
    shape: tuple[int | str | None, ...]  # as declared
    dtype: np.dtype
    # axes the output declares under the input's symbol: a size the model fixes, not a length
    # (onnxruntime-genai's builder declares its caches' head size so: "kv_cache_dim")
    fixed_axes: tuple[int, ...] = ()
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)  # theirs, from the operator

    def initial(self, batch: int, batch_axis_name) -> np.ndarray:
        """Zeros of the declared shape: a symbolic batch axis is ``batch``, a fixed axis its
        size, any other symbolic axis a past length, empty at the start."""

        def size(axis: int, dim) -> int:
            if isinstance(dim, int):
                return dim
            if axis == 0 or (dim is not None and dim == batch_axis_name):
                return batch
            return self.sizes.get(axis, 0)

        return np.zeros(tuple(size(axis, dim) for axis, dim in enumerate(self.shape)), self.dtype)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What a session takes and returns, read once: the dtypes it wants and what it carries."""

    label: str
    ids_dtype: np.dtype
    mask_dtype: np.dtype | None  # None: the model takes no attention_mask
    positions_dtype: np.dtype | None  # None: no position_ids (the model derives them, or has none)
    merged: bool  # takes use_cache_branch
    carried: tuple[Carried, ...]
    batch_axis_name: int | str | None

    @classmethod
    def of(cls, session, label: str) -> Decoder:
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        if "input_ids" not in inputs:
            raise AttnRewriteError(
                f"{label} has no input named input_ids, so it is not a decoder generate() can run "
                f"(inputs: {', '.join(inputs)})"
            )
        if "logits" not in outputs:
            raise AttnRewriteError(
                f"{label} has no output named logits, so it is not a decoder generate() can run "
                f"(outputs: {', '.join(outputs)})"
            )
        carried = _with_operator_sizes(_pair_carried(inputs, outputs, label), session, label)
        taken = {c.input for c in carried}
        unknown = [name for name in inputs if name not in FED_INPUTS and name not in taken]
        if unknown:
            raise AttnRewriteError(
                f"{label}: generate() cannot feed the input {unknown[0]!r} (it feeds {', '.join(FED_INPUTS[:3])}, "
                f"{MERGED_BRANCH} and past_key_values.* from present.*)"
            )

        def dtype_of(name: str) -> np.dtype | None:
            return _numpy_dtype(inputs[name].type, name, label) if name in inputs else None

        return cls(
            label=label,
            ids_dtype=dtype_of("input_ids"),
            mask_dtype=dtype_of("attention_mask"),
            positions_dtype=dtype_of("position_ids"),
            merged=MERGED_BRANCH in inputs,
            carried=carried,
            batch_axis_name=(inputs["input_ids"].shape or [None])[0],
        )

    def initial_state(self, batch: int) -> dict[str, np.ndarray]:
        return {c.input: c.initial(batch, self.batch_axis_name) for c in self.carried}

    def feeds(self, new_ids: np.ndarray, mask: np.ndarray, step: int) -> dict[str, np.ndarray]:
        """The tokens of this call, the mask over every token so far, their positions."""
        feeds = {"input_ids": new_ids.astype(self.ids_dtype)}
        if self.mask_dtype is not None:
            feeds["attention_mask"] = mask.astype(self.mask_dtype)
        if self.positions_dtype is not None:
            feeds["position_ids"] = positions_of(mask)[:, -new_ids.shape[1] :].astype(self.positions_dtype)
        if self.merged:
            feeds[MERGED_BRANCH] = np.array([step > 0])
        return feeds


def _with_operator_sizes(carried: tuple[Carried, ...], session, label: str) -> tuple[Carried, ...]:
    """``carried`` with the sizes of their fixed axes, read from the operator that reads them in
    the model file the session was made from (detect.declared_cache_sizes)."""
    if not any(c.fixed_axes for c in carried):
        return carried
    path = getattr(session, "_model_path", None)  # onnxruntime keeps the file a session loaded
    sizes = declared_cache_sizes(ir.load(path).graph) if isinstance(path, str) and os.path.isfile(path) else {}
    for c in carried:
        unknown = [axis for axis in c.fixed_axes if axis not in sizes.get(c.input, {})]
        if unknown:
            raise AttnRewriteError(
                f"{label}: the input {c.input} declares its axis {unknown[0]} as {c.shape[unknown[0]]!r}, a size "
                "no operator of the model fixes, so generate() cannot start it"
            )
    return tuple(dataclasses.replace(c, sizes=sizes.get(c.input, {})) for c in carried)


def _pair_carried(inputs: dict, outputs: dict, label: str) -> tuple[Carried, ...]:
    """Every ``past_key_values.X`` input with its ``present.X`` output, and no one left alone."""
    carried = []
    for past_prefix, present_prefix in CARRIED_PREFIXES:
        pasts = [name for name in inputs if name.startswith(past_prefix)]
        presents = {name for name in outputs if name.startswith(present_prefix)}
        for past in pasts:
            present = present_prefix + past[len(past_prefix) :]
            if present not in presents:
                raise AttnRewriteError(f"{label}: the input {past} has no output {present} to be fed from")
            presents.discard(present)
            declared = inputs[past]
            if declared.shape is None:
                raise AttnRewriteError(f"{label}: the input {past} declares no shape to start it from")
            dtype = _numpy_dtype(declared.type, past, label)
            if outputs[present].type != declared.type:
                raise AttnRewriteError(
                    f"{label}: the output {present} is {outputs[present].type} but the input {past} it feeds "
                    f"is {declared.type}"
                )
            returned = outputs[present].shape or []
            fixed = tuple(
                axis
                for axis, dim in enumerate(declared.shape)
                if axis > 0 and isinstance(dim, str) and axis < len(returned) and returned[axis] == dim
            )
            carried.append(Carried(past, present, tuple(declared.shape), dtype, fixed))
        if presents:
            present = sorted(presents)[0]
            raise AttnRewriteError(
                f"{label}: the output {present} has no input {past_prefix + present[len(present_prefix) :]} "
                "to be fed back into"
            )
    return tuple(carried)


def _numpy_dtype(onnxruntime_type: str, name: str, label: str) -> np.dtype:
    """'tensor(float)' -> float32."""
    element = onnxruntime_type.removeprefix("tensor(").removesuffix(")")
    try:
        return np.dtype({"float": "float32", "double": "float64"}.get(element, element))
    except TypeError:
        raise AttnRewriteError(
            f"{label}: the input {name} is {onnxruntime_type}, which generate() cannot make"
        ) from None


# --- the prompts, the choice of the next token --------------------------------------------------


PADDINGS = ("left", "right")


def padded(
    prompts: Sequence[Sequence[int]], pad_token_id: int = 0, side: str = "left"
) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of any lengths as one batch: ids [B, N] padded on ``side``, and their mask."""
    longest = max(len(prompt) for prompt in prompts)
    ids = np.full((len(prompts), longest), pad_token_id, np.int64)
    mask = np.zeros((len(prompts), longest), np.int64)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            columns = slice(longest - len(prompt), None) if side == "left" else slice(0, len(prompt))
            ids[row, columns] = prompt
            mask[row, columns] = 1
    return ids, mask


def _prompt_batch(input_ids, attention_mask, pad_token_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """input_ids as generate() takes them (a 2-D batch, one prompt, or a list of prompts of any
    lengths) -> ids and mask [B, N], padded on ``side`` (left: every row ends in a real token)."""
    if side not in PADDINGS:
        raise AttnRewriteError(f"padding must be one of {', '.join(PADDINGS)}, got {side!r}")
    prompts = isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0])
    if prompts and attention_mask is None:
        for row, prompt in enumerate(map(np.asarray, input_ids)):
            if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
                raise AttnRewriteError(f"input_ids: prompt {row} is not a list of token ids")
        ids, mask = padded(input_ids, pad_token_id, side)
    else:
        if prompts and len({len(prompt) for prompt in input_ids}) > 1:
            raise AttnRewriteError("prompts of different lengths take no attention_mask: they are padded here")
        ids = np.atleast_2d(np.asarray(input_ids))
        mask = np.ones(ids.shape, np.int64) if attention_mask is None else np.atleast_2d(np.asarray(attention_mask))
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise AttnRewriteError(
            f"input_ids must be integer token ids [batch, length], got {ids.dtype} {list(ids.shape)}"
        )
    if mask.shape != ids.shape:
        raise AttnRewriteError(f"attention_mask is {list(mask.shape)} but input_ids {list(ids.shape)}")
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise AttnRewriteError(f"row {empty[0]} of the prompts has no token")
    padded_last = np.flatnonzero(mask[:, -1] == 0)
    if padded_last.size and side == "left":
        raise AttnRewriteError(
            f"row {padded_last[0]} of the prompts ends in padding (attention_mask 0): pad on the left, "
            "so that every row's last token is a real one"
        )
    return ids.astype(np.int64), mask.astype(np.int64)


def _at_last_tokens(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The scores [B, V] at each row's last real token of the call (right-padded prompts end in
    padding)."""
    if logits.ndim == 2:
        return logits
    if mask is None:
        return logits[:, -1]
    fed = mask[:, -logits.shape[1] :]
    last = fed.shape[1] - 1 - np.argmax(fed[:, ::-1] != 0, axis=1)
    return logits[np.arange(len(logits)), last]


def token_chooser(do_sample: bool, temperature: float, top_k: int | None, seed: int) -> Callable:
    """scores [B, V] -> token ids [B]: the argmax, or a draw from softmax(scores / temperature)
    over the top_k best (all when None). Ties among the best go to the lower id, as argmax's."""
    if not do_sample:
        return lambda scores: scores.argmax(axis=-1)
    if not temperature > 0:
        raise AttnRewriteError(f"temperature must be > 0 to sample, got {temperature}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise AttnRewriteError(f"top_k must be a positive integer, got {top_k}")
    rng = np.random.default_rng(seed)

    def sample(scores: np.ndarray) -> np.ndarray:
        scores = scores.astype(np.float64) / temperature
        rows = np.arange(len(scores))
        candidates = np.broadcast_to(np.arange(scores.shape[-1]), scores.shape)
        if top_k is not None:
            candidates = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
            scores = np.take_along_axis(scores, candidates, axis=-1)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        cumulative = np.cumsum(weights, axis=-1) / weights.sum(axis=-1, keepdims=True)
        drawn = (cumulative < rng.random((len(scores), 1))).sum(axis=-1)
        return candidates[rows, np.minimum(drawn, candidates.shape[-1] - 1)]

    return sample


def _token_ids(ids: int | Iterable[int] | None) -> np.ndarray:
    if ids is None:
        return np.zeros(0, np.int64)
    return np.atleast_1d(np.asarray(list(ids) if not np.isscalar(ids) else ids, np.int64))


# --- sessions and runs -------------------------------------------------------------------------


def open_session(model, provider: str = "cpu"):
    """(session, label) for a path or an onnxruntime InferenceSession, on ``provider``."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise AttnRewriteError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    if isinstance(model, ort.InferenceSession):
        if PROVIDERS[provider] not in model.get_providers():
            raise AttnRewriteError(
                f"provider {provider!r}: the session given runs on {', '.join(model.get_providers())}"
            )
        return model, "the model"
    from attnrewrite.onnx import io as onnx_io
    from attnrewrite.onnx.validate import make_session

    label = os.fspath(model)
    onnx_io.check_input_file(Path(label))
    if provider == "cuda":
        _require_cuda(ort)

    try:
        providers = [PROVIDERS[provider]] + (
            [PROVIDERS["cpu"]] if provider == "cuda" else []
        )  # CPU for nodes without a CUDA kernel
        return make_session(label, providers=providers), label
    except Exception as error:
        raise AttnRewriteError(f"onnxruntime cannot load {label}: {_first_line(error)}") from error


def _require_cuda(ort) -> None:
    from attnrewrite.bench_worker import cuda_ready

    if PROVIDERS["cuda"] not in ort.get_available_providers():
        raise AttnRewriteError(
            "provider 'cuda': this onnxruntime has no CUDA execution provider "
            f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"
        )
    cuda_ready(ort)


def _host_runner(session, decoder: Decoder) -> Callable:
    """run(feeds, state) -> (logits, state): everything in numpy arrays."""
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict, state: dict) -> tuple[np.ndarray, dict]:
        outputs = dict(zip(names, session.run(None, {**feeds, **state})))
        return outputs["logits"], {c.input: outputs[c.output] for c in decoder.carried}

    return run


def _cuda_runner(session, decoder: Decoder) -> Callable:
    """As _host_runner, but the carried values stay on the GPU as OrtValues between calls: the
    small host inputs are copied in and the logits out, nothing else crosses."""

    def run(feeds: dict, state: dict) -> tuple[np.ndarray, dict]:
        binding = session.io_binding()  # a fresh one: each call's outputs are new buffers
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, value in state.items():
            if isinstance(value, np.ndarray):  # the zeros of the first call
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for carried in decoder.carried:
            binding.bind_output(carried.output, "cuda", 0)
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        logits, *values = binding.get_outputs()  # in the order bound
        return logits.numpy(), {c.input: value for c, value in zip(decoder.carried, values)}

    return run


def _nbytes(state: dict, decoder: Decoder) -> int:
    sizes = {c.input: c.dtype.itemsize for c in decoder.carried}
    return sum(
        value.nbytes if isinstance(value, np.ndarray) else int(np.prod(value.shape())) * sizes[name]
        for name, value in state.items()
    )


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


# --- the loop ------------------------------------------------------------------------------------


def forced_logits(session, label: str, ids: np.ndarray, mask: np.ndarray, prefill: int) -> np.ndarray:
    """The logits [B, N, V] of every position of ``ids`` [B, N] (``mask`` 0 on left padding) as
    generation computes them: the first ``prefill`` tokens in one call, then one token per call,
    each fed what the call before returned (a model that carries nothing gets the whole
    sequence so far); ``prefill`` >= 1. The fidelity check of a decoder compares two models by these."""
    decoder = Decoder.of(session, label)
    run = _host_runner(session, decoder)
    state, pieces = decoder.initial_state(len(ids)), []
    for step, end in enumerate(range(prefill, ids.shape[1] + 1)):
        start = 0 if step == 0 else end - 1  # the tokens this call computes
        fed = start if decoder.carried else 0
        try:
            logits, state = run(decoder.feeds(ids[:, fed:end], mask[:, :end], step), state)
        except Exception as error:
            when = "on the prefill" if step == 0 else f"at decoding step {step}"
            raise AttnRewriteError(f"{label} fails to run {when}: {_first_line(error)}") from error
        pieces.append(logits[:, start - end :])
    return np.concatenate(pieces, axis=1)


def generate(
    model,
    input_ids,
    max_new_tokens: int,
    *,
    attention_mask=None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    eos_token_id: int | Iterable[int] | None = None,
    pad_token_id: int | None = None,
    padding: str = "left",
    provider: str = "cpu",
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens with a decoder ONNX model.

    ``model``: a path or an onnxruntime InferenceSession. ``input_ids``: token ids [B, N] (with
    ``attention_mask`` [B, N], 0 on padding), one prompt [N], or a list of prompts of any
    lengths, padded here on the ``padding`` side: "left" (transformers' way) or "right"
    (onnxruntime-genai's: each row's first new token follows its last real one). Greedy unless ``do_sample``: then a draw from the softmax of the
    logits / ``temperature`` over the ``top_k`` best, from a generator seeded with ``seed``.
    A row that chooses one of ``eos_token_id`` (an id or several) stops: it continues with
    ``pad_token_id`` (default: the first stop id); the loop ends when every row stopped.
    Returns the new tokens [B, <= max_new_tokens] with the time of each call (Generation).
    """
    stops = _token_ids(eos_token_id)
    pad = int(pad_token_id if pad_token_id is not None else (stops[0] if stops.size else 0))
    ids, mask = _prompt_batch(input_ids, attention_mask, pad, padding)
    choose = token_chooser(do_sample, temperature, top_k, seed)
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise AttnRewriteError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    session, label = open_session(model, provider)
    decoder = Decoder.of(session, label)
    if decoder.mask_dtype is None and not mask.all():
        raise AttnRewriteError(f"{label} takes no attention_mask: give prompts of one length, or one at a time")
    run = (_cuda_runner if provider == "cuda" else _host_runner)(session, decoder)
    return _decode(run, decoder, ids, mask, int(max_new_tokens), choose, stops, pad)


def _decode(run, decoder: Decoder, ids, mask, max_new_tokens: int, choose, stops, pad: int) -> Generation:
    """Prefill, then one token per row per call; a model that carries nothing gets the whole
    sequence every call."""
    batch = len(ids)
    state = decoder.initial_state(batch)
    chosen_per_step, times = [], []
    finished = np.zeros(batch, bool)
    sequence, fresh = ids, ids.shape[1]  # every token so far; how many of them the next call feeds
    for step in range(max_new_tokens):
        feeds = decoder.feeds(sequence[:, -fresh:], mask, step)
        start = time.perf_counter()
        try:
            logits, state = run(feeds, state)
        except Exception as error:
            when = "on the prompts" if step == 0 else f"at decoding step {step}"
            raise AttnRewriteError(f"{decoder.label} fails to run {when}: {_first_line(error)}") from error
        times.append((time.perf_counter() - start) * 1e3)
        scores = _at_last_tokens(logits, feeds["attention_mask"] if "attention_mask" in feeds else None)
        chosen = np.where(finished, pad, choose(scores)).astype(np.int64)
        chosen_per_step.append(chosen)
        finished |= np.isin(chosen, stops)
        if finished.all():
            break
        sequence = np.concatenate([sequence, chosen[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((batch, 1), mask.dtype)], axis=1)
        fresh = 1 if decoder.carried else sequence.shape[1]
    return Generation(
        tokens=np.stack(chosen_per_step, axis=1) if chosen_per_step else np.zeros((batch, 0), np.int64),
        prefill_ms=times[0] if times else 0.0,
        step_ms=tuple(times[1:]),
        state_bytes=_nbytes(state, decoder) if times else 0,
    )
