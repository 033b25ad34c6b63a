"""Held-out next-token fidelity of recurrent hedgehog on a small decoder trained here.

A Llama-style model (4 layers, 256 wide, grouped-query, rotary) is trained on bench/corpus.py's
calibration passages, exported for generation with a KV cache, rewritten by the CLI into a
constant-memory recurrent model (``--to hedgehog --recurrent``, with and without ``-O window=64``,
zero-shot, ``--calibrate``d, and calibrated then ``--finetune``d), and measured on the held-out
passages. Writes the "Decoders" section of bench/FIDELITY.md (the rest of the file is left alone)
and bench/decoder_fidelity.json.

    python bench/decoder_fidelity.py                   # train (or reuse the cached model), rewrite, measure
    python bench/decoder_fidelity.py --only-zero-shot  # skip the calibrated and fine-tuned rewrites

The tokenizer (byte-level BPE) and the model are trained on the calibration passages only, and
calibration reads only those; the held-out passages (other sources) are only evaluated on. The
trained model and its export are cached in --cache under a key of every setting and of the
training text, so a rerun skips training. Every model runs on onnxruntime CPU, each held-out
passage in one call from an empty cache or a zero state (prefill); a decode check then feeds
the second half of some passages one token at a time and compares with that prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# this checkout's code, tests/decoders.py, bench/corpus.py; tests/ before bench/: decoders.py's
# ``import models`` means tests/models.py
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(HERE)]

import corpus
import decoders
import fidelity  # machine(), the section markers of FIDELITY.md
import torch

from attnrewrite.generate import Decoder, open_session

DEFAULT_JSON, DEFAULT_MARKDOWN = HERE / "decoder_fidelity.json", HERE / "FIDELITY.md"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnrewrite-bench" / "decoder"
SECTION_START, SECTION_END = fidelity.DECODERS_MARKERS  # this script's part of FIDELITY.md
NOTES_START, NOTES_END = "<!-- DECODERS NOTES -->", "<!-- /DECODERS NOTES -->"  # hand-written, kept on rewrite
BOS = "<|endoftext|>"  # starts every text (the tokenizer adds it) and separates packed passages
MINILM_VOCAB = 30522  # all-MiniLM-L6-v2's tokenizer, the alternative FIDELITY.md weighs
TARGET_AGREEMENT, TARGET_PPL_RATIO = 0.90, 1.10  # issue 26, calibrated hedgehog window=64
# issue 48, fine-tuned: the windowed rewrite from FAR_FROM on, the one without a window over all
# positions, and both perplexity ratios
FINETUNED_TARGETS = {"window_agreement_far": 0.95, "agreement": 0.85, "perplexity_ratio": 1.02}
WINDOW = 64
# A causal query's own block of WINDOW positions and the one before are exact: only a query from
# here on has keys beyond the window, left to the kernel
FAR_FROM = 2 * WINDOW
PROMPT_TOKENS = FAR_FROM + 32  # the side-by-side generation's prompts (BOS included)
CONFIGS = {"hedgehog": [], f"hedgehog+window{WINDOW}": ["-O", f"window={WINDOW}"]}
MODES = ("zero-shot", "calibrated", "finetuned")
# the cache folder of one trained model: what the CLI commands shown in FIDELITY.md read
TOKENIZER, CALIBRATION, ORIGINAL, TRAINING = "tokenizer.json", "calibration.txt", "decoder.onnx", "training.json"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the trained model depends on (with the training text): the cache key."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 4096
    max_positions: int = 512
    length: int = 256  # tokens per packed training sequence
    batch: int = 8
    steps: int = 400  # about where the loss on a tenth of the calibration passages, held back, stops falling
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 20
    seed: int = 0

    def key(self, texts: list[str]) -> str:
        versions = {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
        }
        blob = json.dumps([dataclasses.asdict(self), versions, texts], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# --- tokenizer, data, model, training ------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE learnt from ``texts`` (deterministic for the same texts); encode() starts
    every text with BOS, decode() leaves it out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def encode(texts: list[str], tokenizer, limit: int | None = None) -> list[np.ndarray]:
    """Each text's ids (BOS first), cut to ``limit`` tokens."""
    return [np.array(tokenizer.encode(text).ids[:limit], np.int64) for text in texts]


def pack(token_ids: list[np.ndarray], length: int) -> torch.Tensor:
    """The passages one after another (each starts with BOS), cut into rows of ``length``; the
    incomplete last row is dropped."""
    stream = np.concatenate(token_ids)
    rows = len(stream) // length
    return torch.from_numpy(stream[: rows * length].reshape(rows, length))


def decoder_spec(settings: Settings) -> decoders.DecoderSpec:
    return decoders.DecoderSpec(
        "llama",
        lambda: build_model(settings),
        kv_heads=settings.kv_heads,
        position_ids=True,
        layers=settings.layers,
        heads=settings.heads,
        head_dim=settings.hidden // settings.heads,
        vocab=settings.vocab,
    )


def build_model(settings: Settings):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=settings.vocab,
        hidden_size=settings.hidden,
        intermediate_size=settings.intermediate,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=settings.max_positions,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(settings.seed)
    return LlamaForCausalLM(config)


def train(model, sequences: torch.Tensor, settings: Settings, log=print) -> list[float]:
    """AdamW with a linear warmup and a cosine decay to a tenth, on rows drawn with replacement
    from a seeded generator; the loss of every step."""
    torch.manual_seed(settings.seed)
    draw = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, settings))
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(settings.steps):
        rows = sequences[torch.randint(len(sequences), (settings.batch,), generator=draw)]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == settings.steps:
            seconds = time.perf_counter() - start
            log(f"step {step + 1}/{settings.steps}: train loss {np.mean(losses[-50:]):.3f} ({seconds:.0f} s)")
    model.eval()
    return losses


def _lr_factor(step: int, settings: Settings) -> float:
    warmup = min(1.0, (step + 1) / settings.warmup)
    return warmup * (0.1 + 0.45 * (1 + math.cos(math.pi * step / settings.steps)))


def mean_loss(model, token_ids: list[np.ndarray]) -> float:
    """Next-token cross-entropy per predicted token over the passages, one at a time (torch)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in token_ids:
            rows = torch.from_numpy(ids)[None]
            total += model(input_ids=rows, labels=rows).loss.item() * (len(ids) - 1)
            count += len(ids) - 1
    return total / count


@dataclasses.dataclass(frozen=True)
class Trained:
    """A cache folder holding the tokenizer, the calibration text (one passage a line), the
    KV-cache export and the training record."""

    folder: Path
    record: dict


def prepare(settings: Settings, calibration: list[str], cache: Path, log=print) -> Trained:
    """The trained, exported decoder for these settings and texts: from the cache, or made now."""
    folder = cache / settings.key(calibration)
    if (folder / TRAINING).is_file():
        log(f"the trained decoder is cached in {folder}")
        return Trained(folder, json.loads((folder / TRAINING).read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(calibration, settings.vocab)
    tokenizer.save(str(folder / TOKENIZER))
    (folder / CALIBRATION).write_text("".join(f"{text}\n" for text in calibration))
    token_ids = encode(calibration, tokenizer)
    sequences = pack(token_ids, settings.length)
    log(f"training on {len(sequences)} rows of {settings.length} tokens ({sum(map(len, token_ids))} tokens)")
    model = build_model(settings)
    start = time.perf_counter()
    losses = train(model, sequences, settings, log)
    seconds = time.perf_counter() - start
    decoders.export_decoder(decoder_spec(settings), model, folder / ORIGINAL, "legacy", cache=True)
    record = {
        "key": folder.name,
        "settings": dataclasses.asdict(settings),
        "parameters": sum(p.numel() for p in model.parameters()),
        "training_tokens": int(sum(map(len, token_ids))),
        "training_rows": len(sequences),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4),  # the last 50 steps' mean
        "calibration_loss": round(mean_loss(model, encode(calibration, tokenizer, settings.length)), 4),
        "training_seconds": round(seconds, 1),
    }
    (folder / TRAINING).write_text(json.dumps(record, indent=2) + "\n")  # last: it marks the folder complete
    return Trained(folder, record)


# --- rewriting with the CLI ------------------------------------------------------------------------


def rewrite_command(config: str, mode: str, finetune_steps: int | None = None) -> list[str]:
    """The user's command (run in the cache folder) that writes ``<config>-<mode>.onnx``; the
    fine-tuning's steps are its default unless given."""
    command = ["attnrewrite", ORIGINAL, "--to", "hedgehog", "--recurrent", *CONFIGS[config]]
    if mode != "zero-shot":
        command += ["--calibrate", CALIBRATION, "--tokenizer", TOKENIZER]
    if mode == "finetuned":
        command += ["--finetune", *([str(finetune_steps)] if finetune_steps else [])]
    return [*command, "-o", f"{config}-{mode}.onnx"]


def run_cli(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    """``attnrewrite ...`` as ``python -m attnrewrite ...`` with this checkout's code, in ``folder``,
    its torch on as many threads as this process's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env |= {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.run(
        [sys.executable, "-m", *command], cwd=folder, env=env, capture_output=True, text=True, check=False
    )


def rewrite(trained: Trained, config: str, mode: str, finetune_steps: int | None = None, log=print) -> dict:
    """{"command", "seconds", and "path" or "refused": the CLI's last line}."""
    command = rewrite_command(config, mode, finetune_steps)
    start = time.perf_counter()
    done = run_cli(command, trained.folder)
    row = {"command": shlex.join(command), "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode:
        row["refused"] = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        log(f"{config}/{mode}: {row['refused']}")
    else:
        row["path"] = str(trained.folder / command[-1])
        log(f"{config}/{mode}: rewritten in {row['seconds']} s")
    return row


# --- measuring -------------------------------------------------------------------------------------


class Model:
    """A decoder ONNX model (KV cache or recurrent state) on onnxruntime CPU, one sequence at a time."""

    def __init__(self, path: str | Path):
        self.session, label = open_session(path)
        self.decoder = Decoder.of(self.session, label)
        self.outputs = ["logits", *(c.output for c in self.decoder.carried)]

    def run(self, new_ids: np.ndarray, past: int, state: dict) -> tuple[np.ndarray, dict]:
        """Logits [N, V] of ``new_ids`` after ``past`` tokens summarised by ``state``, and the next state."""
        mask = np.ones((1, past + len(new_ids)), np.int64)
        feeds = self.decoder.feeds(new_ids[None], mask, step=past)
        logits, *carried = self.session.run(self.outputs, {**feeds, **state})
        return logits[0], {c.input: value for c, value in zip(self.decoder.carried, carried)}

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        return self.run(ids, 0, self.decoder.initial_state(1))[0]

    def prefill_then_decode(self, ids: np.ndarray, split: int) -> np.ndarray:
        """Logits of every token: the first ``split`` in one call, then one call per token."""
        logits, state = self.run(ids[:split], 0, self.decoder.initial_state(1))
        rows = [logits]
        for t in range(split, len(ids)):
            step, state = self.run(ids[t : t + 1], t, state)
            rows.append(step)
        return np.concatenate(rows)


def next_token(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, negative log-likelihood of the true next token) at every position that has one."""
    scores = logits[:-1].astype(np.float64)
    top = scores.max(axis=-1)
    log_normaliser = top + np.log(np.exp(scores - top[:, None]).sum(axis=-1))
    return scores.argmax(axis=-1), log_normaliser - scores[np.arange(len(scores)), ids[1:]]


def evaluate(paths: dict[str, str | Path], passages: list[np.ndarray], reference: str = "original") -> dict:
    """Per model: next-token argmax agreement with ``reference``, perplexity on the true next
    tokens and its ratio to ``reference``'s, over every predicted position and (``*_far``) over
    those from FAR_FROM on; the seconds its runs took."""
    models = {name: Model(path) for name, path in paths.items()}
    argmaxes = {name: [] for name in models}
    nlls = {name: [] for name in models}
    seconds = dict.fromkeys(models, 0.0)
    for ids in passages:
        for name, model in models.items():
            start = time.perf_counter()
            choice, nll = next_token(model.prefill(ids), ids)
            seconds[name] += time.perf_counter() - start
            argmaxes[name].append(choice)
            nlls[name].append(nll)
    far = np.concatenate([np.arange(len(ids) - 1) >= FAR_FROM for ids in passages])
    rows = {}
    for name in models:
        choice, nll = np.concatenate(argmaxes[name]), np.concatenate(nlls[name])
        expected, expected_nll = np.concatenate(argmaxes[reference]), np.concatenate(nlls[reference])
        rows[name] = {
            **_figures(choice, nll, expected, expected_nll),
            **{
                f"{key}_far": value
                for key, value in _figures(*(a[far] for a in (choice, nll, expected, expected_nll))).items()
            },
            "heldout_seconds": round(seconds[name], 1),
        }
    return rows


def _figures(choice: np.ndarray, nll: np.ndarray, expected: np.ndarray, expected_nll: np.ndarray) -> dict:
    if not len(choice):  # passages cut shorter than FAR_FROM
        return dict.fromkeys(("agreement", "perplexity", "perplexity_ratio"), math.nan)
    perplexity = float(np.exp(nll.mean()))
    return {
        "agreement": float(np.mean(choice == expected)),
        "perplexity": perplexity,
        "perplexity_ratio": perplexity / float(np.exp(expected_nll.mean())),
    }


def bigram_perplexity(training: list[np.ndarray], heldout: list[np.ndarray], vocab: int) -> float:
    """The perplexity on the held-out next tokens of a bigram model of the training text (half the
    bigram's frequency, half the add-one unigram's): what word statistics alone achieve."""
    before, after = (np.concatenate([ids[:-1] for ids in training]), np.concatenate([ids[1:] for ids in training]))
    unigram = np.bincount(after, minlength=vocab) + 1.0
    unigram /= unigram.sum()
    pairs = dict(zip(*np.unique(before * vocab + after, return_counts=True)))
    seen_before = np.bincount(before, minlength=vocab)
    previous, following = (np.concatenate([ids[:-1] for ids in heldout]), np.concatenate([ids[1:] for ids in heldout]))
    pair_counts = np.array([pairs.get(pair, 0) for pair in previous * vocab + following], np.float64)
    bigram = pair_counts / np.maximum(seen_before[previous], 1)
    return float(np.exp(-np.mean(np.log(0.5 * bigram + 0.5 * unigram[following]))))


def decode_check(paths: dict[str, str | Path], passages: list[np.ndarray]) -> dict:
    """Per model: the largest difference between its logits decoded one token at a time after
    a prefill of half the passage and its logits from one prefill of the whole passage, and the
    share of positions whose argmax differs."""
    checks = {}
    for name, path in paths.items():
        model, error, differ, count = Model(path), 0.0, 0, 0
        for ids in passages:
            whole, stepped = model.prefill(ids), model.prefill_then_decode(ids, len(ids) // 2)
            error = max(error, float(np.max(np.abs(stepped - whole))))
            differ += int(np.sum(stepped.argmax(-1) != whole.argmax(-1)))
            count += len(ids)
        checks[name] = {"max_abs_logit_difference": error, "argmax_differs": differ / count}
    return checks


# --- generating side by side -----------------------------------------------------------------------


def prompts_from(passages: list[np.ndarray], tokenizer, count: int = 2) -> list[str]:
    """The text of the first PROMPT_TOKENS tokens of ``count`` passages spread over the list (of
    those that long): continued past FAR_FROM, where the window leaves keys to the kernel."""
    long_enough = [ids for ids in passages if len(ids) >= PROMPT_TOKENS]
    chosen = [long_enough[i * len(long_enough) // count] for i in range(count)]
    return [tokenizer.decode(ids[:PROMPT_TOKENS].tolist()) for ids in chosen]


def side_by_side(trained: Trained, rewritten: str, prompts: list[str], new_tokens: int) -> dict:
    """``attnrewrite generate ORIGINAL REWRITTEN`` on the prompts: the command and what it printed."""
    command = ["attnrewrite", "generate", ORIGINAL, Path(rewritten).name, "--tokenizer", TOKENIZER]
    command += [*(arg for prompt in prompts for arg in ("--prompt", prompt)), "--max-new-tokens", str(new_tokens)]
    done = run_cli(command, trained.folder)
    return {"command": shlex.join(command), "output": (done.stdout + done.stderr).strip()}


# --- the report ------------------------------------------------------------------------------------


def write_section(path: Path, section: str, markers: tuple[str, str] = (SECTION_START, SECTION_END)) -> None:
    """A script's section of the file (between ``markers``, this one's by default) replaced (its
    hand-written notes kept) or appended; the rest of the file left as it is."""
    start, end = markers
    text = path.read_text() if path.is_file() else ""
    old = _between(text, start, end)
    notes = _between(old or "", NOTES_START, NOTES_END) or f"{NOTES_START}\n{NOTES_END}"
    block = f"{start}\n{section.strip()}\n\n{notes}\n{end}"
    if old is not None:
        text = text.replace(old, block)
    else:
        text = f"{text.rstrip()}\n\n{block}\n" if text.strip() else f"{block}\n"
    path.write_text(text)


def _between(text: str, start: str, end: str) -> str | None:
    """The first part of ``text`` from ``start`` to the ``end`` after it, both included; None if absent."""
    first = text.find(start)
    last = text.find(end, first) if first >= 0 else -1
    return text[first : last + len(end)] if last >= 0 else None


def markdown(results: dict) -> str:
    lines = [
        "## Decoders: next-token fidelity of recurrent hedgehog on a trained decoder",
        "",
        "Generated by `python bench/decoder_fidelity.py` (`--only-zero-shot` skips the calibrated and fine-tuned "
        "rewrites); the "
        "numbers are also in `bench/decoder_fidelity.json`.",
        "",
        *_setup(results),
        "",
        f"| model | mode | next-token agreement | perplexity | perplexity ratio | agreement from {FAR_FROM} | "
        f"perplexity ratio from {FAR_FROM} | rewrite (+calibration) s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, row in results["rows"].items():
        config, _, mode = key.partition("/")
        seconds = f"{row['seconds']:.0f}" if "seconds" in row else "-"
        lines.append(
            f"| {config} | {mode or '-'} | {row['agreement']:.3f} | {row['perplexity']:.2f} | "
            f"{row['perplexity_ratio']:.3f} | {row['agreement_far']:.3f} | {row['perplexity_ratio_far']:.3f} | "
            f"{seconds} |"
        )
    lines += ["", _target_line(results), "", _finetuned_target_line(results)]
    if results["not_run"]:
        lines += ["", "Not measured:", ""] + [f"- {key}: {why}" for key, why in results["not_run"].items()]
    lines += [
        "",
        f"**Decode check** (the first {results['decode_passages']} passages: half prefilled in one call, the rest fed "
        "one token per call, the state or cache carried): the largest difference from the same model's logits when "
        "the whole passage is prefilled, and the share of positions whose argmax changes.",
        "",
        "| model | max abs logit difference | argmax differs |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {c['max_abs_logit_difference']:.2e} | {c['argmax_differs']:.4f} |"
        for name, c in results["decode_check"].items()
    ]
    lines += [
        "",
        "**Commands** (the rewrites run in the cache folder, where the script leaves the files they read):",
        "",
    ]
    folder = results["folder"].replace(str(Path.home()), "~", 1)
    lines += ["```text", "python bench/decoder_fidelity.py", f"cd {folder}"]
    lines += [row["command"] for row in results["rewrites"].values()]
    lines += ["```"]
    if results.get("generate"):
        lines += [
            "",
            f"**Side by side**, greedy, on two held-out passages' first {PROMPT_TOKENS} tokens (every new token's query "
            "has keys beyond the window):",
            "",
            "```text",
        ]
        lines += [f"$ {results['generate']['command']}", results["generate"]["output"], "```"]
    return "\n".join(lines)


def _setup(results: dict) -> list[str]:
    """The bullets that say what was trained, on what, how it was measured, where and when."""
    s, t, h = results["settings"], results["training"], results["heldout"]
    return [
        f"- **Model**: a Llama-style decoder (transformers `LlamaForCausalLM`, {t['parameters']:,} parameters): "
        f"{s['layers']} layers, {s['hidden']} wide, {s['heads']} query heads sharing {s['kv_heads']} key/value heads "
        f"(head size {s['hidden'] // s['heads']}), rotary positions (up to {s['max_positions']}), MLP {s['intermediate']}, "
        f"input and output embeddings tied. Trained from scratch here with torch on CPU: {s['steps']} AdamW steps "
        f"(learning rate {s['lr']:g}, {s['warmup']} warmup steps then a cosine decay to a tenth, weight decay "
        f"{s['weight_decay']:g}), batches of {s['batch']} rows of {s['length']} tokens drawn from the calibration passages "
        f"packed one after another ({t['training_rows']} rows, {t['training_tokens']} tokens: about "
        f"{s['steps'] * s['batch'] / t['training_rows']:.0f} epochs), seed {s['seed']}, {t['training_seconds']:.0f} s. "
        f"Final train loss {t['final_train_loss']:.3f} (the last 50 steps), {t['calibration_loss']:.3f} on the "
        f"calibration passages, **held-out loss {h['loss']:.3f}** (perplexity {math.exp(h['loss']):.1f}; a bigram "
        f"model of the training text gets {h['bigram_perplexity']:.1f}, the same with add-one smoothing interpolated "
        "half and half with the unigram). Exported for "
        "generation by `tests/decoders.py`'s `export_decoder` (legacy exporter, opset 18): `input_ids`, "
        "`attention_mask` over past and new tokens, `position_ids`, `past_key_values.{i}.key/value` in; `logits`, "
        "`present.{i}.key/value` out.",
        f"- **Tokenizer**: byte-level BPE with {s['vocab']} tokens, learnt by `tokenizers` from the calibration "
        f"passages only; `{BOS}` starts every text. Not the MiniLM tokenizer (`corpus.minilm_tokenizer`): its "
        f"{MINILM_VOCAB} lowercase WordPiece tokens would put {MINILM_VOCAB * s['hidden'] / 1e6:.1f}M parameters in the "
        f"(tied) embedding alone, {MINILM_VOCAB * s['hidden'] / (t['parameters'] - s['vocab'] * s['hidden']):.1f}x "
        "the rest of this model, and the text it decodes has lost its case and the spacing around punctuation.",
        f"- **Text**: {results['corpus']}. The tokenizer, the model and calibration see only the calibration "
        f"passages; the measurements use the first {h['passages']} held-out passages, each cut to {h['max_tokens']} "
        f"tokens ({h['predictions']} predicted positions, {h['far_predictions']} of them from position {FAR_FROM} "
        "on).",
        "- **Metric**: every model runs each passage in one call (prefill) from an empty KV cache (the original) or "
        "a zero state (the recurrent rewrites), on onnxruntime CPU. Agreement: the share of positions whose argmax "
        "next token equals the original's. Perplexity: exp of the mean negative log-likelihood of the true next "
        "tokens; ratio: the rewrite's over the original's. Over all positions, and over the positions from "
        f"{FAR_FROM} on: with `window={WINDOW}` a causal query's own block of {WINDOW} and the one before it are "
        f"exact (blocks aligned to the start), so only a query from position {FAR_FROM} on has keys left to the "
        "kernel; before it the windowed rewrite is the original.",
        f"- **Machine**: {results['machine']['processor']}, {results['machine']['cpus']} CPUs shared with other work "
        f"(load average {results['machine']['load_average_at_start']} at the start), onnxruntime "
        f"{results['machine']['onnxruntime']}. Times are wall-clock on that shared machine: indicative only.",
        f"- **Date**: {results['date']}, commit {results['machine']['commit']}.",
    ]


def _target_line(results: dict) -> str:
    key = f"hedgehog+window{WINDOW}/calibrated"
    row = results["rows"].get(key)
    wanted = f"the issue's target, calibrated hedgehog `window={WINDOW}` with >= {TARGET_AGREEMENT:.0%} agreement and "
    wanted += f"perplexity within {TARGET_PPL_RATIO - 1:.0%} of the original's"
    if row is None:
        return f"Not judged: {wanted}, was not measured ({results['not_run'].get(key, 'not run')})."
    met = row["agreement"] >= TARGET_AGREEMENT and row["perplexity_ratio"] <= TARGET_PPL_RATIO
    return (
        f"**{'Met' if met else 'Not met'}** on all positions: {wanted}: agreement {row['agreement']:.3f}, "
        f"perplexity ratio {row['perplexity_ratio']:.3f}; from position {FAR_FROM} on, where the kernel is in play, "
        f"{row['agreement_far']:.3f} and {row['perplexity_ratio_far']:.3f}."
    )


def _finetuned_target_line(results: dict) -> str:
    window = results["rows"].get(f"hedgehog+window{WINDOW}/finetuned")
    plain = results["rows"].get("hedgehog/finetuned")
    t = FINETUNED_TARGETS
    wanted = (
        f"issue 48's targets, fine-tuned: hedgehog `window={WINDOW}` agreement from position {FAR_FROM} >= "
        f"{t['window_agreement_far']}, hedgehog without a window agreement >= {t['agreement']}, perplexity ratios <= "
        f"{t['perplexity_ratio']}"
    )
    if window is None or plain is None:
        return f"Not judged: {wanted}; not measured."
    met = (
        window["agreement_far"] >= t["window_agreement_far"]
        and plain["agreement"] >= t["agreement"]
        and max(window["perplexity_ratio"], plain["perplexity_ratio"]) <= t["perplexity_ratio"]
    )
    return (
        f"**{'Met' if met else 'Not met'}**: {wanted}: window {window['agreement_far']:.3f} from {FAR_FROM} "
        f"(perplexity ratio {window['perplexity_ratio']:.3f}), no window {plain['agreement']:.3f} "
        f"(perplexity ratio {plain['perplexity_ratio']:.3f})."
    )


# --- the run ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=200, help="held-out passages measured (default: %(default)s)")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="each cut to this many tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--decode-passages", type=int, default=4, help="passages of the decode check (default: %(default)s)"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=40, help="tokens generated per prompt side by side (default: %(default)s)"
    )
    parser.add_argument("--only-zero-shot", action="store_true", help="skip the calibrated and fine-tuned rewrites")
    parser.add_argument("--finetune-steps", type=int, default=None, help="--finetune's steps (default: its own)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for training and the CLI's calibration (default: %(default)s: on a shared machine, "
        "more threads than free cores made each training step ten times slower)",
    )
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help="trained models, by key (default: %(default)s)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN)
    training = parser.add_argument_group("the model and its training (the cache key)")
    for field in dataclasses.fields(Settings):
        training.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default, help="%(default)s"
        )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:

    args = parse_args(argv)
    settings = Settings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Settings)})
    torch.set_num_threads(args.threads)
    text = corpus.build_corpus()
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": fidelity.machine(),
        "corpus": text.describe(),
        "settings": dataclasses.asdict(settings),
    }
    trained = prepare(settings, text.calibration, args.cache)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(trained.folder / TOKENIZER))
    passages = encode(text.heldout[: args.passages], tokenizer, args.max_tokens)
    modes = MODES[:1] if args.only_zero_shot else MODES
    rewrites = {
        f"{config}/{mode}": rewrite(trained, config, mode, args.finetune_steps) for config in CONFIGS for mode in modes
    }
    paths = {"original": trained.folder / ORIGINAL}
    paths |= {key: row["path"] for key, row in rewrites.items() if "path" in row}
    print(f"measuring {len(paths)} models on {len(passages)} held-out passages", flush=True)
    rows = evaluate(paths, passages)
    for key, row in rows.items():
        row.update({name: rewrites[key][name] for name in ("command", "seconds")} if key in rewrites else {})
        print(key, json.dumps(row), flush=True)
    results |= {
        "folder": str(trained.folder),
        "training": trained.record,
        "heldout": {
            "passages": len(passages),
            "max_tokens": args.max_tokens,
            "predictions": int(sum(len(ids) - 1 for ids in passages)),
            "far_predictions": int(sum(max(0, len(ids) - 1 - FAR_FROM) for ids in passages)),
            "loss": math.log(rows["original"]["perplexity"]),
            "bigram_perplexity": bigram_perplexity(encode(text.calibration, tokenizer), passages, settings.vocab),
        },
        "rows": rows,
        "rewrites": rewrites,
        "not_run": {key: row["refused"] for key, row in rewrites.items() if "refused" in row},
        "decode_passages": args.decode_passages,
        "decode_check": decode_check(paths, passages[: args.decode_passages]),
    }
    shown = next(
        (paths[key] for key in (f"hedgehog+window{WINDOW}/{mode}" for mode in reversed(modes)) if key in paths), None
    )
    if shown:
        prompts = prompts_from(passages, tokenizer)
        results["generate"] = side_by_side(trained, shown, prompts, args.new_tokens)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    write_section(args.markdown, markdown(results))
    print(f"wrote {args.markdown} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
