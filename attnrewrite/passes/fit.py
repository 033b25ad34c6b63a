"""Calibration: fit a learnable replacement to the exact softmax attention it replaces.

"Attention transfer" (LoLCATs): the replacement's parameters are fitted, per site, so that its
output matches softmax(scale * q k^T + mask) v on the model's own q, k, v (attention-output
MSE), optionally plus Hedgehog's cross-entropy between the softmax weights and the
replacement's own attention weights on sampled query rows. Both frontends use this one fitter:
the ONNX frontend collects q, k, v and key_keep as extra graph outputs of onnxruntime, the FX
frontend with forward hooks; neither does any math of its own.

Per-site fitting cannot see how the sites' errors combine downstream. After it,
``fit_end_to_end`` can fit all sites together against the whole model's outputs: the frontend
gives a differentiable run of the rewritten model (the GraphModule itself; the ONNX graph
evaluated in torch) and its outputs with every replacement computing the exact attention it
replaced (``exact_stand_in``), i.e. the original model's; both runs zero padded queries'
outputs (``zero_padded_queries``).

The samples are kept as a list of per-batch tensors (batches may differ in length); each step
fits a minibatch of examples drawn from one batch, so memory stays that of one minibatch's
attention whatever the amount of data. Everything is seeded: the same samples, module and seed
give the same parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable

import numpy as np

from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.window.reference import windowed_attention_weights

# Measured on MiniLM (favor, layer 0, 100 texts): 200 steps of 4 examples at 3e-2 fit as well
# as 200 of 8 at 1e-2 (loss 0.0367 -> 0.0131 vs 0.0147) in half the time. A module whose values
# need another rate says so in its CALIBRATION_LR (linformer's projections).
DEFAULT_STEPS = 200
DEFAULT_LR = 3e-2
# The end-to-end stage starts from fitted sites: a tenth of the per-site rate. Measured on
# MiniLM (hedgehog, window 32, ONNX path, bench/FIDELITY.md): 200 steps at 3e-3 take the
# held-out embedding cosine from 0.987 to 0.990 (minimum 0.941 to 0.955).
DEFAULT_END_TO_END_LR = 3e-3
# A fit's loss before and after (what it is judged by, kept_if_lower, and what it reports) is
# measured on at most this many batches, spread over the data. End to end each is a run of the
# whole model: on all of MiniLM's 38 batches of 8 the two took as long as 36 steps of 8. Per
# site, on all of them they took 4-5 s of each site's ~21 s (hedgehog, window 32, 300 steps).
MEASURED_BATCHES = 8
# entries of the leading axis a step fits on: per site, batch rows (or batch x heads); end to end on
# an ONNX model, batch rows (attnrewrite/onnx/calibrate.py)
EXAMPLES_PER_STEP = 4
CE_ROWS = 16  # query rows per step for the attention-weight cross-entropy
CE_EXAMPLES = 2  # of the minibatch's examples, those the cross-entropy looks at (N x N weights)
LOG_FLOOR = 1e-30


@dataclasses.dataclass
class SiteSamples:
    """q, k, v ([E, ..., N, D]) and key_keep ([E, ..., Nk, 1] or None) of many batches, as the
    replacement receives them; the leading axis E indexes examples."""

    q: list = dataclasses.field(default_factory=list)
    k: list = dataclasses.field(default_factory=list)
    v: list = dataclasses.field(default_factory=list)
    key_keep: list = dataclasses.field(default_factory=list)

    def add(self, q, k, v, key_keep=None) -> None:
        q, k, v = (torch.as_tensor(x).detach().float().cpu() for x in (q, k, v))
        if key_keep is not None:
            key_keep = torch.as_tensor(key_keep).detach().float().cpu()
            if bool((key_keep != 0).all()):
                key_keep = None  # nothing is masked: the unmasked path is the same math
            else:  # one row per example, so minibatches can index it like q
                key_keep = key_keep.expand(*k.shape[:-1], 1).contiguous()
        self.q.append(q)
        self.k.append(k)
        self.v.append(v)
        self.key_keep.append(key_keep)

    def __len__(self) -> int:
        return len(self.q)

    @property
    def examples(self) -> int:
        return sum(q.shape[0] for q in self.q)

    def batch(self, index: int, rows=None):
        """(q, k, v, key_keep) of one batch, restricted to the examples ``rows``."""
        parts = (self.q[index], self.k[index], self.v[index], self.key_keep[index])
        if rows is None:
            return parts
        return tuple(None if x is None else x[rows] for x in parts)


@dataclasses.dataclass
class FitResult:
    loss_before: float  # attention-output MSE on the measured batches, before fitting
    loss_after: float  # that of the values kept
    steps: int
    lr: float
    examples: int  # entries of the samples' leading axis
    query_rows: int  # query rows the loss counts (padded queries are not counted)
    seconds: float
    measured_batches: int  # of the samples' batches, those the losses are measured on
    batches: int
    rejected_loss: float | None = None  # where fitting ended higher than it started (see kept_if_lower)
    coverage: dict | None = None  # what the kernel part was fitted on (far_key_coverage)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def exact_attention(q, k, v, scale: float, key_keep=None, causal: bool = False):
    """softmax(scale * q k^T) v in float32; keys with key_keep == 0 and, when causal, keys after
    the query are left out. A query that sees no key gets 0 (as the replacements give it).
    torch's fused attention never writes the N x N weights out: on MiniLM's batches it is 4-7x
    faster on the CPU than softmax over them, and every fit's targets are computed with it."""
    q, k, v = q.float(), k.float(), v.float()
    lead = q.shape[:-2]  # k and v may share one head among several (multi-query): broadcast
    k, v = k.expand(*lead, *k.shape[-2:]), v.expand(*lead, *v.shape[-2:])
    visible = None if key_keep is None else key_keep.transpose(-2, -1) != 0
    if causal:
        earlier = ~future_keys(torch.arange(q.shape[-2], device=q.device), k.shape[-2])
        visible = earlier if visible is None else visible & earlier
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return torch.nan_to_num(out, nan=0.0)


def _hidden_keys(logits, key_keep, causal: bool, rows):
    """Where the sampled query ``rows``' logits see no key: padded, or (causal) after the row."""
    hidden = torch.zeros_like(logits, dtype=torch.bool)
    if key_keep is not None:
        hidden = hidden | (key_keep.transpose(-2, -1) == 0)
    if causal:
        hidden = hidden | future_keys(rows, logits.shape[-1])
    return hidden


def fit_site(
    module,
    samples: SiteSamples,
    *,
    scale: float,
    causal: bool,
    steps: int = DEFAULT_STEPS,
    lr: float | None = None,
    seed: int = 0,
    ce_weight: float = 0.0,
    device=None,
    examples_per_step: int = EXAMPLES_PER_STEP,
) -> FitResult:
    """Fit ``module``'s parameters (in place, Adam) to exact attention on ``samples``.

    Loss: MSE between the module's output and softmax attention over the query rows that are
    real tokens (for self-attention, a padded query's output is never used), plus ``ce_weight``
    times the cross-entropy of the module's ``attention_weights`` against the softmax weights on
    sampled rows. ``lr``: Adam's rate (default: the module's CALIBRATION_LR, else DEFAULT_LR).
    Before and after, the output MSE is measured on MEASURED_BATCHES batches spread over the
    samples. Runs on ``device`` (default: where the module's parameters are)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters to fit")
    if not len(samples):
        raise ValueError("no samples to fit on")
    if ce_weight and not hasattr(module, "attention_weights"):
        raise ValueError(f"{type(module).__name__} cannot give its attention weights for ce_weight")
    device = torch.device(device) if device is not None else params[0].device
    module.to(device)
    started = time.perf_counter()
    targets = [_targets(samples, i, scale, causal, device) for i in range(len(samples))]
    measured = spread_indices(len(samples), MEASURED_BATCHES)
    loss_before, query_rows = _mean_loss(module, samples, targets, measured, device)
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([float(q.shape[0]) for q in samples.q])
    lr = lr if lr is not None else getattr(module, "CALIBRATION_LR", DEFAULT_LR)
    start = snapshot(params)
    optimizer = torch.optim.Adam(params, lr=lr)
    module.train()
    for _ in range(steps):
        index = int(torch.multinomial(sizes, 1, generator=generator))
        rows = torch.randperm(samples.q[index].shape[0], generator=generator)[:examples_per_step]
        q, k, v, keep = _to(samples.batch(index, rows), device)
        loss = _output_loss(module, q, k, v, keep, targets[index][rows].to(device))[0]
        if ce_weight:
            loss = loss + ce_weight * _weight_loss(module, q, k, keep, scale, causal, generator)
        if not loss.requires_grad:  # a batch inside the exact part (linformer's N <= k): nothing to learn
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    module.eval()
    loss_after = _mean_loss(module, samples, targets, measured, device)[0]
    loss_after, rejected = kept_if_lower(params, start, loss_before, loss_after)
    coverage = far_key_coverage(module, samples, measured, scale, causal, device)
    return FitResult(
        loss_before,
        loss_after,
        steps,
        lr,
        samples.examples,
        query_rows,
        time.perf_counter() - started,
        len(measured),
        len(samples),
        rejected,
        coverage,
    )


def far_key_coverage(module, samples: SiteSamples, measured: list[int], scale: float, causal: bool, device) -> dict:
    """What a window hybrid's kernel part is fitted on, over the batches ``measured``:
    ``queries``, the fraction of real (non-padded) queries with at least one key outside the
    exact part, and ``attention_mass``, the share of the exact softmax weights on those far keys
    (mean over real queries). A short text inside the window fits the kernel part on nothing.
    Without a window every key is far: both 1."""
    if getattr(module, "window", None) is None:
        return {"queries": 1.0, "attention_mass": 1.0}
    seen = real = mass = 0.0
    with torch.no_grad():
        for _, _, (q, k, _, keep) in _minibatches(samples, measured, device):
            k = k.float().expand(*q.shape[:-2], *k.shape[-2:])  # one head shared (multi-query): broadcast
            logits = scale * q.float() @ k.transpose(-2, -1)
            hidden = _hidden_keys(logits, keep, causal, torch.arange(q.shape[-2], device=q.device))
            far = _far_keys(module, q.shape[-2], causal, q.device) & ~hidden
            weights = torch.nan_to_num(torch.softmax(logits.masked_fill(hidden, float("-inf")), -1))
            counted = _query_weight(q, keep)[..., 0].expand(q.shape[:-1]) > 0
            seen += float((far.any(-1) & counted).sum())
            mass += float(((weights * far).sum(-1) * counted).sum())
            real += float(counted.sum())
    return {"queries": seen / max(real, 1.0), "attention_mass": mass / max(real, 1.0)}


def _far_keys(module, n: int, causal: bool, device):
    """[n, n] True where a key lies outside the window hybrid's exact part: the exact part as
    windowed_attention_weights defines it, read off its weights on zero inputs (equal
    logits, no kernel), which are nonzero exactly on the visible exact keys. Positions decide
    it, not the data: one matrix for every example and head (padded keys are the caller's)."""
    zero = torch.zeros(n, 1, device=device)
    exact = windowed_attention_weights(zero, zero, zero, zero, module.window, scale=1.0, causal=causal)
    return exact == 0


@dataclasses.dataclass
class EndToEndResult:
    loss_before: float  # the outputs' relative squared error (see fit_end_to_end), on the measured batches
    loss_after: float  # that of the values kept
    steps: int
    parameters: int  # values fitted, over all sites
    seconds: float
    measured_batches: int  # of the data's batches, those the losses are measured on
    batches: int
    rejected_loss: float | None = None  # where fitting ended higher than it started (see kept_if_lower)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def exact_stand_in(scale: float, causal: bool):
    """A replacement's stand-in that gives the exact attention it replaced (padded queries
    zeroed, see zero_padded_queries): the rewritten model with every replacement so stood in
    for is the original model wherever the end-to-end loss looks."""

    def attention(q, k, v, key_keep=None):
        keep = None if key_keep is None else key_keep.float()
        return zero_padded_queries(exact_attention(q, k, v, scale, keep, causal).to(v.dtype), q, key_keep)

    return attention


def fitted_stand_in(module):
    """A replacement's stand-in that runs its learnable ``module``, padded queries zeroed as
    exact_stand_in zeroes them."""
    return lambda q, k, v, key_keep: zero_padded_queries(module(q, k, v, key_keep), q, key_keep)


def zero_padded_queries(out, q, key_keep=None):
    """``out`` with the rows of padded queries zeroed. A padded query's output is never used
    (the per-site loss does not count it), but unfitted it differs most from softmax's: in the
    end-to-end stage both runs zero it, so that only what the model uses is fitted."""
    if key_keep is None:
        return out
    return out * _query_weight(q, key_keep.float()).to(out.dtype)


def fit_end_to_end(
    run, params, batches: list, targets: list, *, steps: int, lr: float = DEFAULT_END_TO_END_LR, seed: int = 0
):
    """Fit ``params`` (every replacement's, together; in place, Adam, one batch per step) so that
    ``run(batch)``, the rewritten model's floating-point outputs, matches ``targets`` (per batch,
    the original model's). Loss: each output's squared error over its target's squared norm,
    averaged over the outputs, so that no output weighs more for being larger; before and after,
    it is measured on MEASURED_BATCHES batches spread over the data."""
    params = list(params)
    started = time.perf_counter()
    measured = spread_indices(len(batches), MEASURED_BATCHES)

    def measured_loss() -> float:
        return _mean_end_to_end_loss(run, [batches[i] for i in measured], [targets[i] for i in measured])

    loss_before = measured_loss()
    start = snapshot(params)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        index = int(torch.randint(len(batches), (1,), generator=generator))
        loss = _relative_error(run(batches[index]), targets[index])
        if not loss.requires_grad:  # a batch inside the exact part (linformer's N <= k): nothing to learn
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    loss_after, rejected = kept_if_lower(params, start, loss_before, measured_loss())
    return EndToEndResult(
        loss_before,
        loss_after,
        steps,
        sum(p.numel() for p in params),
        time.perf_counter() - started,
        len(measured),
        len(batches),
        rejected,
    )


def spread_indices(total: int, wanted: int) -> list[int]:
    """``wanted`` indices (all when there are fewer) evenly spread over range(total)."""
    if total <= wanted:
        return list(range(total))
    return [round(i * (total - 1) / max(wanted - 1, 1)) for i in range(wanted)]


def snapshot(params: list) -> list:
    return [p.detach().clone() for p in params]


def kept_if_lower(params: list, start: list, loss_before: float, loss_after: float) -> tuple[float, float | None]:
    """A fit that ends with a higher loss on its own data than it started with (a rate too high
    for these values, e.g. a Linformer projection) would leave the model worse than unfitted:
    then the starting values are put back. Returns (the kept values' loss, the rejected loss or None)."""
    if loss_after <= loss_before:
        return loss_after, None
    with torch.no_grad():
        for param, value in zip(params, start):
            param.copy_(value)
    return loss_before, loss_after


def _relative_error(outputs: list, targets: list):
    errors = [
        (o.float() - t.float()).square().sum() / t.float().square().sum().clamp_min(1e-30)
        for o, t in zip(outputs, targets)
    ]
    return torch.stack(errors).mean()


def _mean_end_to_end_loss(run, batches: list, targets: list) -> float:
    with torch.no_grad():
        return float(sum(float(_relative_error(run(b), t)) for b, t in zip(batches, targets)) / len(batches))


def _to(parts, device):
    return tuple(None if x is None else x.to(device) for x in parts)


def _targets(samples: SiteSamples, index: int, scale: float, causal: bool, device):
    """The exact outputs of one batch, a few examples at a time (the logits are N x N)."""
    out = []
    total = samples.q[index].shape[0]
    with torch.no_grad():
        for start in range(0, total, EXAMPLES_PER_STEP):
            rows = torch.arange(start, min(start + EXAMPLES_PER_STEP, total))
            q, k, v, keep = _to(samples.batch(index, rows), device)
            out.append(exact_attention(q, k, v, scale, keep, causal).cpu())
    return torch.cat(out)


def _query_weight(q, keep):
    """1 for query rows to count: with a key mask on self-attention, the kept positions."""
    if keep is None or keep.shape[-2] != q.shape[-2]:
        return torch.ones(*q.shape[:-1], 1, device=q.device)
    return keep


def _output_loss(module, q, k, v, keep, target):
    """(mean squared error over counted query rows and features, rows counted)."""
    out = module(q, k, v, keep).float()
    weight = _query_weight(q, keep).expand(*out.shape[:-1], 1)
    counted = weight.sum()
    loss = (weight * (out - target).square()).sum() / (counted.clamp_min(1.0) * out.shape[-1])
    return loss, counted


def _minibatches(samples: SiteSamples, measured: list[int], device):
    """(batch index, example rows, (q, k, v, key_keep) on ``device``) of the batches ``measured``,
    EXAMPLES_PER_STEP examples at a time."""
    for index in measured:
        size = samples.q[index].shape[0]
        for start in range(0, size, EXAMPLES_PER_STEP):
            rows = torch.arange(start, min(start + EXAMPLES_PER_STEP, size))
            yield index, rows, _to(samples.batch(index, rows), device)


def _mean_loss(module, samples: SiteSamples, targets, measured: list[int], device) -> tuple[float, int]:
    """(the output MSE over the batches ``measured``, query rows counted)."""
    total, counted = 0.0, 0.0
    module.eval()
    with torch.no_grad():
        for index, rows, (q, k, v, keep) in _minibatches(samples, measured, device):
            loss, n = _output_loss(module, q, k, v, keep, targets[index][rows].to(device))
            dims = v.shape[-1]
            total += float(loss) * float(n.clamp_min(1.0)) * dims
            counted += float(n) * dims
    return total / max(counted, 1.0), int(counted / max(samples.v[0].shape[-1], 1))


def _weight_loss(module, q, k, keep, scale: float, causal: bool, generator):
    """Cross-entropy of the module's attention weights against softmax's on sampled rows."""
    q, k = q[:CE_EXAMPLES], k[:CE_EXAMPLES]
    keep = None if keep is None else keep[:CE_EXAMPLES]
    rows = torch.randperm(q.shape[-2], generator=generator)[:CE_ROWS].to(q.device)
    logits = scale * (q.index_select(-2, rows).float() @ k.float().transpose(-2, -1))
    hidden = _hidden_keys(logits, keep, causal, rows)
    target = torch.nan_to_num(torch.softmax(logits.masked_fill(hidden, float("-inf")), -1))
    weights = module.attention_weights(q, k, keep).index_select(-2, rows)
    return -(target * torch.log(weights.clamp_min(LOG_FLOOR))).sum(-1).mean()


def fingerprint(arrays: Iterable[np.ndarray]) -> str:
    """sha256 over the calibration arrays' dtypes, shapes and bytes: names the data in a
    record without keeping it."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{list(array.shape)}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def future_keys(rows, n_keys: int):
    """[R, Nk] True where key j comes after query row rows[r] (hidden under a causal mask)."""
    return torch.arange(n_keys, device=rows.device) > rows[:, None]
