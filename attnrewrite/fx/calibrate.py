"""Calibrating an FX rewrite: collect each replacement's inputs with a forward pre-hook, fit.

The learnable pass modules are already in the graph (at their initial values, so the model's
outputs are unchanged). Site l's q, k, v and key_keep are collected by running the model on the
calibration examples with a hook on its module, which stops the forward there (nothing after
site l is needed); the sites before it are fitted already (sequential). passes.fit fits the
module's parameters in place: they stay nn.Parameters, trainable like any other.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from passes.fit import SiteSamples, fit_site


class _Collected(Exception):
    """Raised by the hook: this site's inputs are in, the rest of the forward is not needed."""


def calibrate_modules(gm: GraphModule, fitting: list, calibration) -> None:
    """``fitting``: (outcome, learnable pass module) per rewritten site, in graph order."""
    was_training = gm.training
    gm.eval()
    try:
        for index, (outcome, module) in enumerate(fitting):
            samples = _collect(gm, module, calibration.batches)
            result = fit_site(
                module, samples, scale=outcome.site.scale, causal=outcome.site.mask.causal,
                steps=calibration.steps, lr=calibration.lr, seed=calibration.seed,
                ce_weight=calibration.ce_weight,
            )
            outcome.calibration = calibration.report(index, len(fitting), outcome.site.layer, result)
    finally:
        gm.train(was_training)


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
                    gm(**example) if isinstance(example, dict) else gm(*example)
                except _Collected:
                    pass
    finally:
        handle.remove()
    return samples
