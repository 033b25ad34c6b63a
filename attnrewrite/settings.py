"""A run's settings beyond the method's options, each declared once: its name, type, default,
range (the API's refusal), help and command-line flag (passes/options.py's ``option``).

The groups compose pipeline.Settings; the CLI generates its arguments from them (cli_args.py)
and the API takes them as keywords (api.rewrite, whose signature lists them). Each group's
docstring is the API's description of its keywords.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from attnrewrite import calibration, passes
from attnrewrite import check as check_mod
from attnrewrite.cli_parsing import (
    parse_cosine,
    parse_fraction,
    parse_nonnegative,
    parse_positive,
    parse_positive_number,
)
from attnrewrite.passes.fit import DEFAULT_LR
from attnrewrite.passes.options import POSITIVE, AtLeast, RunSettings, flag, option


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateSettings(RunSettings):
    """Fidelity gates (ONNX models), as the CLI's ``--min-cosine`` and ``--min-agreement``: with
    ``min_cosine`` (the per-example cosine of every output) or ``min_agreement`` (the argmax
    agreement of every logits-like output) the rewritten model is compared with the original
    (``attnrewrite.check``) and ``FidelityBelowThreshold`` raised when it falls below; an
    ``AttnRewriteError`` when ``min_agreement`` finds no logits-like output; where a replaced
    site is still exact at the length compared they fail unless ``allow_exact``. They compare on
    ``inputs`` (a ``.npz`` path or arrays by input name, which the run gate and the mask probe
    then use too; default: generated from the signature). ``seq``: the length of generated
    inputs: those the fidelity gates compare on (default: long enough that every replaced site
    approximates, docs/checking.md), and those the mask probe and the run gate start from (both
    double it until the original model runs, e.g. past an audio model's convolutional front end)."""

    min_cosine: float | None = option(
        None,
        "{gate} if an output's cosine similarity is below X for any example (batch row): "
        "the gate uses the per-example minimum",
        flag=flag("--min-cosine", type=parse_cosine, metavar="X"),
    )
    min_agreement: float | None = option(
        None,
        "{gate} if the fraction of rows whose argmax agrees is below X for a logits-like output "
        "(logits, log-probabilities, probabilities)",
        flag=flag("--min-agreement", type=parse_fraction, metavar="X"),
    )
    allow_exact: bool = option(
        False,
        "let the gates pass although some replaced sites are exact at the length compared (a window, "
        "linformer's k, one lsh chunk), which the comparison then does not measure",
        flag=flag("--allow-exact", action="store_true"),
    )
    inputs: str | os.PathLike | dict | None = option(
        None,
        "inputs to compare on, by input name (default: generated from the signature)",
        flag=flag("--inputs", metavar="FILE.npz"),
    )
    seq: int | None = option(
        None,
        f"sequence length of generated inputs (default for the comparison: {check_mod.PAST_REACH} times the "
        f"longest reach of a replaced site's exact part, else {check_mod.DEFAULT_SEQ}, at most the model's "
        "positions; the rewrite's mask probe and run gate start short and double it until the model runs)",
        flag=flag("--seq", type=parse_positive, default=None),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationSettings(RunSettings):
    """``calibrate``: fit every replacement to the attention it replaces on this data, site by
    site (``calibrate_steps`` Adam steps each, learning rate ``calibrate_lr``, by default the
    method's: 0.03, linformer 0.003; minibatches drawn by ``calibrate_seed``; with
    ``calibrate_ce_weight`` > 0 the loss adds that times Hedgehog's cross-entropy between the
    softmax weights and the replacement's on sampled rows: linear, favor without a window,
    hedgehog). ``calibrate_end_to_end``: then fit all replacements together for that many steps
    (one batch each) so that the model's outputs match the original's; the record's
    ``end_to_end`` says how it went. For ONNX: an ``.npz`` path (arrays by input name), a text
    file path (one text per line, made into inputs by ``tokenizer``: TextSettings), a dict of
    arrays (batch axis stacked) or a list of such dicts. A part of ONNX data (the last batch or
    10%, from 20 examples up) is held out and never fitted on: unless the fitted values bring
    the whole model closer to the original there than the zero-shot ones, the zero-shot ones are
    kept (each site's ``calibration.held_out`` says both figures). For torch: a list of example
    inputs, each as ``example_inputs`` may be given."""

    calibrate: Any = option(
        None,
        "fit each replacement to the attention it replaces on DATA: an .npz of model inputs by name "
        "(batch axis stacked) or a text file, one text per line (with --tokenizer)",
        flag=flag("--calibrate", metavar="DATA", read=lambda data: data or None),
    )
    calibrate_steps: int = option(
        calibration.DEFAULT_STEPS,
        f"optimizer steps per site (default: {calibration.DEFAULT_STEPS})",
        valid=AtLeast(0),  # 0: the learnable lowerings with their initial values (the API's; the CLI's >= 1)
        flag=flag("--calibrate-steps", type=parse_positive, metavar="N", needs="calibration"),
    )
    calibrate_lr: float | None = option(
        None,  # the method's (passes.fit.fit_site)
        f"Adam learning rate of calibration (default: the method's, {DEFAULT_LR:g}; "
        f"linformer {passes.linformer.LinformerAttention.CALIBRATION_LR:g})",
        valid=POSITIVE,
        flag=flag("--calibrate-lr", type=parse_positive_number, metavar="LR", needs="calibration"),
    )
    calibrate_ce_weight: float = option(
        0.0,
        "add W times Hedgehog's cross-entropy between the softmax weights and the replacement's "
        "(linear, favor without a window, hedgehog; default: 0, output error only)",
        flag=flag("--calibrate-ce", type=parse_nonnegative, metavar="W", needs="calibration"),
    )
    calibrate_seed: int = option(
        0,
        "seed of the minibatches calibration draws (default: 0)",
        flag=flag("--calibrate-seed", type=int, metavar="N", needs="calibration"),
    )
    calibrate_end_to_end: int = option(
        0,
        "after fitting site by site, fit all sites together on the model's outputs for N steps "
        "(one batch each; default: off)",
        valid=AtLeast(0),
        flag=flag("--calibrate-end-to-end", type=parse_positive, default=0, metavar="N"),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneSettings(RunSettings):
    """``finetune`` (steps, or True for the default; with ``calibrate``): then fine-tune, stage 2:
    low-rank adapters of rank ``finetune_rank`` on every replaced site's query, key, value and
    output projections, trained with the replacements' values on the calibration data (Adam,
    ``finetune_lr``) so that the model matches the original (a decoder: its next-token
    distribution at every real position; else its outputs), then merged into the weights, so the
    model's graph keeps its shape. The held-out part judges it as it judges calibration, and the
    record's ``finetune`` says what was trained and how it went (docs/calibration.md). Torch
    models get peft's LoRA on their own ``nn.Linear`` projections, merged back when done."""

    finetune: int = option(
        0,  # steps of stage 2 (calibration.Finetune); 0: off
        "after calibrating, fine-tune: low-rank adapters on the replaced sites' query, key, value and output "
        "projections, trained with the replacements on the calibration data against the original model "
        "(a decoder's next-token distribution), then merged into the weights (kept beside quantized ones) "
        "(default steps: %(const)s)",
        valid=AtLeast(0),
        flag=flag(
            "--finetune", type=parse_positive, nargs="?", const=calibration.FINETUNE_STEPS, default=0, metavar="STEPS"
        ),
    )
    finetune_rank: int = option(
        calibration.DEFAULT_RANK,
        f"with --finetune: the adapters' rank (default: {calibration.DEFAULT_RANK})",
        valid=AtLeast(1),
        flag=flag("--finetune-rank", type=parse_positive, metavar="R", needs="fine-tuning"),
    )
    finetune_lr: float = option(
        calibration.FINETUNE_LR,
        f"with --finetune: Adam's learning rate (default: {calibration.FINETUNE_LR})",
        valid=POSITIVE,
        flag=flag("--finetune-lr", type=parse_positive_number, metavar="LR", needs="fine-tuning"),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextSettings(RunSettings):
    """A text file to calibrate on is made into inputs by ``tokenizer``, a tokenizer.json: with
    ``calibrate_pack`` consecutive texts joined into passages of at most ``max_length`` tokens,
    framed as the tokenizer frames a pair; without, one text per example; a longer text is cut
    and counted in the record."""

    tokenizer: str | os.PathLike | None = option(
        None,
        "with a text --calibrate file: the tokenizer that makes the model's inputs",
        flag=flag("--tokenizer", metavar="tokenizer.json"),
    )
    max_length: int = option(
        calibration.DEFAULT_MAX_LENGTH,
        "with --tokenizer: the length of a calibration example in tokens; a longer text is cut (and counted "
        f"in the record) (default: {calibration.DEFAULT_MAX_LENGTH})",
        valid=AtLeast(1),
        flag=flag("--max-length", type=parse_positive, metavar="N", needs="calibration"),
    )
    calibrate_pack: bool = option(
        True,
        "with --tokenizer: join consecutive texts into passages of --max-length tokens, framed as the "
        "tokenizer frames a pair ([CLS] a [SEP] b [SEP]); off: one text per example (default: on)",
        flag=flag("--calibrate-pack", choices=("on", "off"), read=lambda given: given != "off"),
    )


FITTING = (CalibrationSettings, FinetuneSettings, TextSettings)  # in the CLI's order of their flags
GROUPS = (*FITTING, GateSettings)


def declared() -> list[dataclasses.Field]:
    """Every setting of every group, in the groups' order."""
    return [field for group in GROUPS for field in dataclasses.fields(group)]


def split(keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run settings among ``keywords``, the rest: the method's options)."""
    names = {field.name for field in declared()}
    return (
        {name: value for name, value in keywords.items() if name in names},
        {name: value for name, value in keywords.items() if name not in names},
    )
