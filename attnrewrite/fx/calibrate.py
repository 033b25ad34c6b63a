"""Calibrating an FX rewrite: collect each replacement's inputs with a forward pre-hook, fit.

The learnable pass modules are already in the graph (at their initial values, so the model's
outputs are unchanged). Site l's q, k, v and key_keep are collected by running the model on the
calibration examples with a hook on its module, which stops the forward there (nothing after
site l is needed); the sites before it are fitted already (sequential). passes.fit fits the
module's parameters in place: they stay nn.Parameters, trainable like any other.

With ``end_to_end`` steps, all modules are then fitted together against the model's outputs
(passes.fit.fit_end_to_end); the targets are the outputs with every module's output replaced,
by a forward hook, with the exact attention on its inputs. Forward hooks also zero padded
queries' outputs in both runs, and the model's own parameters are frozen meanwhile.

From 20 examples up, the last tenth is held out (attnrewrite.calibration.held_out_split) for the
guard: the model's outputs there with the zero-shot and with the fitted values, against those
with every module standing in for the exact attention; the zero-shot values are put back where
fitting made them worse.

Last, with ``finetune``, stage 2 (fx/finetune.py): peft's LoRA on the sites' projections, trained
with the modules' parameters and merged into the weights where its own guard keeps them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.fx import GraphModule
from torch.utils import _pytree

from attnrewrite.errors import AttnRewriteError
from attnrewrite.fx.capture import call, first_line
from attnrewrite.fx.finetune import Finetuning, objective_of
from attnrewrite.passes.fit import SiteSamples, exact_stand_in, fit_end_to_end, fit_site, zero_padded_queries


class _Collected(Exception):
    """Raised by the hook: this site's inputs are in, the rest of the forward is not needed."""


def calibrate_modules(gm: GraphModule, fitting: list, calibration) -> dict:
    """``fitting``: (outcome, learnable pass module) per rewritten site, in graph order. Returns
    the record's entries of the stages after the per-site fits that ran ("end_to_end",
    "finetune"). A calibration example the model does not run on, or a site that cannot be
    fitted, is one AttnRewriteError line."""
    zero_shot = [{name: p.detach().clone() for name, p in module.named_parameters()} for _, module in fitting]
    finetuning = Finetuning(gm, fitting) if calibration.finetune else None  # refused before any fitting
    stages = {}
    with _submodules_in_eval_mode(gm):
        for index, (outcome, module) in enumerate(fitting):
            result = _fit(outcome.site, module, _collect(gm, module, calibration.batches), calibration)
            outcome.calibration = calibration.report(index, len(fitting), outcome.site.layer, result)
        if calibration.end_to_end:
            stages["end_to_end"] = _fit_end_to_end(gm, fitting, calibration)
        if calibration.held_out is not None:
            _guard(gm, fitting, zero_shot, calibration)
        if finetuning is not None:
            stages["finetune"] = _finetune(gm, fitting, finetuning, calibration)
    return stages


def _finetune(gm: GraphModule, fitting: list, finetuning: Finetuning, calibration) -> dict:
    def outputs(example, exact: bool) -> list:
        with _outputs_replaced(fitting, exact):
            return _floating_outputs(gm, example)

    first = calibration.batches[0]
    with torch.no_grad():
        objective = objective_of(_run(gm, first), first)
    return finetuning.run(outputs, objective, calibration)


def _fit(site, module, samples: SiteSamples, calibration):
    try:
        return fit_site(
            module,
            samples,
            scale=site.scale,
            causal=site.mask.causal,
            steps=calibration.steps,
            lr=calibration.lr,
            seed=calibration.seed,
            ce_weight=calibration.ce_weight,
        )
    except (ValueError, RuntimeError) as error:  # no samples, shapes the module cannot take, ...
        raise AttnRewriteError(f"cannot calibrate site {site.name}: {first_line(error)}") from None


@contextlib.contextmanager
def _submodules_in_eval_mode(gm: GraphModule):
    """Dropout off while collecting and measuring (a traced model's nn.Dropout modules), every
    mode put back after. The root's own mode is left alone: the module torch.export returns
    refuses eval() and train(), its graph being in inference form already."""
    modes = [(module, module.training) for module in gm.modules() if module is not gm]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _floating_outputs(gm: GraphModule, example) -> list:
    outputs = _run(gm, example)
    return [t for t in _pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _guard(gm: GraphModule, fitting: list, zero_shot: list[dict], calibration) -> None:
    """As the ONNX frontend's (onnx.calibrate._guard): the model's outputs on the held-out
    examples, zero-shot and fitted, against the original's (every module standing in for the
    exact attention); padded queries zeroed in all three, as end to end. Where fitting made the
    model worse there, the zero-shot values are put back."""
    held = calibration.held_out
    fitted = [{name: p.detach().clone() for name, p in module.named_parameters()} for _, module in fitting]

    def outputs(index: int, exact: bool, values: list[dict] | None = None) -> dict:
        with torch.no_grad(), _outputs_replaced(fitting, exact):
            if values is not None:
                _load(fitting, values)
            found = _floating_outputs(gm, held.batches[index])
            return {str(i): t.detach().cpu().numpy() for i, t in enumerate(found)}

    held.reference = functools.partial(outputs, exact=True)
    figures = held.cosines(*(functools.partial(outputs, exact=False, values=v) for v in (zero_shot, fitted)))
    entry = calibration.judge(*figures)
    _load(fitting, zero_shot if entry["kept"] == "zero-shot" else fitted)
    for outcome, _ in fitting:
        outcome.calibration["held_out"] = entry


def _load(fitting: list, values: list[dict]) -> None:
    with torch.no_grad():
        for (_, module), named in zip(fitting, values):
            for name, p in module.named_parameters():
                p.copy_(named[name])


def _fit_end_to_end(gm: GraphModule, fitting: list, calibration) -> dict:
    run = functools.partial(_floating_outputs, gm)
    with _outputs_replaced(fitting, exact=True), torch.no_grad():
        targets = [run(example) for example in calibration.batches]
    fitted = [p for _, module in fitting for p in module.parameters() if p.requires_grad]
    with _outputs_replaced(fitting, exact=False), _only_trainable(gm, fitted):
        result = fit_end_to_end(
            run, fitted, calibration.batches, targets, steps=calibration.end_to_end, seed=calibration.seed
        )
    return calibration.report_end_to_end(len(fitting), result)


@contextlib.contextmanager
def _outputs_replaced(fitting: list, exact: bool):
    """Every module's output, for as long as this lasts: the exact attention on its inputs (or,
    ``exact`` False, its own), padded queries zeroed (passes.fit.zero_padded_queries)."""

    def zeroed(_, args, out):
        return zero_padded_queries(out, args[0], args[3] if len(args) > 3 else None)

    handles = []
    for outcome, module in fitting:
        stand_in = exact_stand_in(outcome.site.scale, outcome.site.mask.causal)
        hook = (lambda _, args, __, stand_in=stand_in: stand_in(*args)) if exact else zeroed
        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _only_trainable(gm: GraphModule, params: list):
    """The other parameters frozen (no gradients computed for them), restored afterwards."""
    fitted = {id(p) for p in params}
    frozen = [p for p in gm.parameters() if p.requires_grad and id(p) not in fitted]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _collect(gm: GraphModule, module, examples) -> SiteSamples:
    samples = SiteSamples()

    def hook(_, args):
        q, k, v, *rest = args
        samples.add(q, k, v, rest[0] if rest else None)
        raise _Collected

    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for example in examples:
                try:
                    _run(gm, example)
                except _Collected:
                    pass
    finally:
        handle.remove()
    return samples


def _run(gm: GraphModule, example):
    try:
        return call(gm, example)
    except _Collected:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the model raises on an input it cannot take
        raise AttnRewriteError(
            f"a calibration example ({_shapes(example)}) does not run on the model: {first_line(error)}"
        ) from None


def _shapes(example) -> str:
    named = example.items() if isinstance(example, dict) else enumerate(example)
    return ", ".join(f"{name} {list(x.shape) if hasattr(x, 'shape') else type(x).__name__}" for name, x in named)
