"""Fine-tuning around the new attention (stage 2): the model's own projections learn to work with
their replacements, with the original model as the teacher.

Calibration (fit.py, stage 1) fits each replacement to the softmax it replaces with every weight
of the model frozen. Here low-rank adapters on the query, key, value and output projections of
the replaced sites (W + B A, B zero at first, so the model starts as it was: LoRA) are trained
together with the replacements' values, end to end on the model's outputs: for a decoder the
KL divergence from the original's next-token distribution at every real position
(``NEXT_TOKEN_KL``), else the outputs' relative squared error (``OUTPUT_ERROR``, the end-to-end
stage's). The teacher runs on the same batch at each step: no output of the whole data is ever
held. Afterwards the frontend merges B A into the weights, so the graph keeps its shape.

One step is one batch of the data (its examples all at once). Under torch.distributed (torchrun)
every process takes its share of the batch's examples, and the gradients are summed over the
processes before the step: each loss is its share of the whole batch's (the denominators, a
token count or the targets' squared norms, are summed over the processes first), so two
processes fit what one does, rounding aside. Everything is seeded.

The frontends (attnrewrite/onnx/finetune.py; the FX frontend puts peft's LoRA on the model's
nn.Linear modules) give the student's and the teacher's runs and the parameters; the math is here.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from collections.abc import Callable

import numpy as np

from attnrewrite.passes.fit import EXAMPLES_PER_STEP, kept_if_lower, snapshot, spread_indices
from attnrewrite.passes.optional_torch import Module, torch

DEFAULT_RANK = 8
ALPHA_PER_RANK = 2.0  # LoRA's alpha = 2 r (LoLCATs: rank 8, alpha 16): the update is scaled by alpha / r
DEFAULT_STEPS = 100
DEFAULT_LR = 1e-3
# A step takes about this many tokens (LoLCATs trains on 1024-token chunks) and at most
# fit.EXAMPLES_PER_STEP examples, for memory: on SmolLM2-135M (2-core CPU) a step of two
# 512-token passages peaks at 10 GB (12 s), of four at 18 GB (19 s), more than a 24 GB machine
# holds beside the rest of the run (14.5 GB at its peak with two).
TOKENS_PER_STEP = 1024
MEASURED_BATCHES = 4  # batches the loss before and after is measured on, spread over the data
NEXT_TOKEN_KL, OUTPUT_ERROR = "next_token_kl", "output_error"


def examples_per_step(tokens_per_example: int) -> int:
    """How many examples of ``tokens_per_example`` tokens one step takes (TOKENS_PER_STEP)."""
    return max(1, min(EXAMPLES_PER_STEP, TOKENS_PER_STEP // max(tokens_per_example, 1)))


class Unadaptable(Exception):
    """Why a site's projections cannot take adapters: the sentence a record keeps."""


class Quantized(Unadaptable):
    """A quantized projection that takes no adapter, merged or beside: the whole stage is refused."""


class LowRankAdapter(Module):
    """The change B A of a projection x -> x W (W [in, out]) with rank ``rank``: x -> s (x A^T) B^T,
    s = alpha / rank. A starts as LoRA's (uniform, seeded), B at zero: the model is unchanged
    until a step moves it."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(in_features)
        self.down = torch.nn.Parameter((torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound)  # A
        self.up = torch.nn.Parameter(torch.zeros(out_features, rank))  # B
        self.scaling = alpha / rank

    def forward(self, x):
        return (x.to(self.down.dtype) @ self.down.T) @ self.up.T * self.scaling

    def delta(self):
        """[in, out]: what merging adds to W."""
        return (self.down.T @ self.up.T) * self.scaling

    def factors(self):
        """(A^T [in, rank], s B^T [rank, out]): the change as two products, x A^T then that s B^T."""
        return self.down.T, self.up.T * self.scaling

    def extra_repr(self) -> str:
        rank, in_features = self.down.shape
        return f"{in_features} -> {self.up.shape[0]}, rank={rank}, scaling={self.scaling:g}"


class Objective(typing.NamedTuple):
    """How a batch's outputs are scored against the teacher's. ``kind``: NEXT_TOKEN_KL (then
    ``logits`` is the index of the logits among the outputs and ``mask`` the name of the input
    that says which positions are real, if the model has one) or OUTPUT_ERROR."""

    kind: str
    logits: int = 0
    mask: str | None = None

    def parts(self, outputs: list, targets: list, feeds: dict) -> tuple:
        """(numerators, denominators) of this process's examples: the loss is the mean over
        the outputs of numerator / (the denominator summed over every process)."""
        if self.kind == NEXT_TOKEN_KL:
            return next_token_kl_parts(outputs[self.logits], targets[self.logits], _real(feeds, self.mask, outputs))
        squared = [((o.float() - t.float()).square().sum(), t.float().square().sum()) for o, t in zip(outputs, targets)]
        return torch.stack([s for s, _ in squared]), torch.stack([n for _, n in squared]).detach()


def next_token_kl_parts(logits, teacher_logits, real) -> tuple:
    """(sum over real positions of KL(teacher || student) of the next-token distributions, the
    number of real positions), each as a one-element tensor. ``real``: [B, N] (1 where a token is)."""
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, N]
    real = real.to(per_position.device, per_position.dtype)
    return (per_position * real).sum().reshape(1), real.sum().reshape(1)


def _real(feeds, mask: str | None, outputs: list):
    if mask is not None and isinstance(feeds, dict) and mask in feeds:
        return torch.as_tensor(feeds[mask]) != 0
    return torch.ones(outputs[0].shape[:2], dtype=torch.bool)


def _values(feeds) -> list:
    """A batch's inputs: a dict of them by name, or a tuple (torch's positional arguments)."""
    return list(feeds.values()) if isinstance(feeds, dict) else list(feeds)


def _examples(feeds) -> int:
    """The batch's examples: its inputs' longest leading axis (numpy arrays or tensors)."""
    return max(np.shape(x)[0] for x in _values(feeds) if np.ndim(x))


@dataclasses.dataclass
class FinetuneResult:
    loss_before: float  # measured on ``measured_batches`` of the data's batches
    loss_after: float  # that of the values kept
    steps: int
    parameters: int  # values trained (the adapters' and the replacements')
    seconds: float
    measured_batches: int
    batches: int
    processes: int  # torch.distributed's world size (1 without it)
    rejected_loss: float | None = None  # the loss a fit reached when it was undone (higher than before)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def finetune(
    student,
    teacher,
    params,
    batches: list,
    objective: Objective,
    *,
    steps: int,
    lr: float,
    seed: int = 0,
    step_done: Callable[[int, int], None] | None = None,
):
    """Train ``params`` (in place, Adam) so that ``student(feeds)`` (a list of output tensors)
    matches ``teacher(feeds)`` under ``objective``, one batch of ``batches`` (model-input dicts
    of numpy arrays, examples on the leading axis) per step, every batch once per pass over them,
    in a seeded random order (the same in every process). A fit that ends with a higher loss
    than it started with is undone. ``step_done(steps done, steps)`` after each step: progress."""
    params = list(params)
    started = time.perf_counter()
    world = _World()
    fewest = min(_examples(feeds) for feeds in batches)
    if world.size > fewest:
        raise ValueError(f"{world.size} processes share batches of {fewest} examples: each needs one at least")
    world.start_alike(params)
    measured = [batches[i] for i in spread_indices(len(batches), MEASURED_BATCHES)]

    def measured_loss() -> float:
        return mean_loss(student, teacher, measured, objective, world)

    loss_before = measured_loss()
    start = snapshot(params)
    optimizer = torch.optim.Adam(params, lr=lr)
    for done, index in enumerate(_passes(len(batches), steps, seed), start=1):
        feeds = batches[index]
        numerators, denominators = _loss_parts(student, teacher, feeds, objective, world)
        optimizer.zero_grad(set_to_none=True)
        (numerators / denominators).mean().backward()  # this process's share of the batch's loss
        world.sum_gradients(params)
        optimizer.step()
        if step_done is not None:
            step_done(done, steps)
    loss_after, rejected = kept_if_lower(params, start, loss_before, measured_loss())
    return FinetuneResult(
        loss_before,
        loss_after,
        steps,
        sum(p.numel() for p in params),
        time.perf_counter() - started,
        len(measured),
        len(batches),
        world.size,
        rejected,
    )


def _passes(batches: int, steps: int, seed: int) -> list[int]:
    """The batch of each step: passes over all of them, each in a seeded random order."""
    generator, order = torch.Generator().manual_seed(seed), []
    while len(order) < steps:
        order += torch.randperm(batches, generator=generator).tolist()
    return order[:steps]


def mean_loss(student, teacher, batches: list, objective: Objective, world=None) -> float:
    """The objective's loss over ``batches``, averaged over them, without gradients."""
    world = world or _World()
    with torch.no_grad():
        losses = [_batch_loss(*_loss_parts(student, teacher, feeds, objective, world), world) for feeds in batches]
    return float(torch.stack(losses).mean())


def judge(batches: list, examples: int, student, without_adapters, teacher, objective, values: list, calibrated: list):
    """The guard on held-out ``batches`` (``examples`` of them): the loss fine-tuned (``student``)
    and calibrated (``without_adapters``, run with ``values`` set to ``calibrated``). The
    calibrated values stay where they score better; the teacher runs once a batch for both.
    Returns the record's entry."""
    tuned, world = snapshot(values), _World()
    runs = {"fine-tuned": (student, tuned), "calibrated": (without_adapters, calibrated)}
    losses = {kept: [] for kept in runs}
    with torch.no_grad():
        for feeds in batches:
            mine = world.share(feeds)
            targets = teacher(mine)  # once for both
            for kept, (run, loaded) in runs.items():
                _load(values, loaded)
                losses[kept].append(_batch_loss(*_parts(run(mine), targets, mine, objective, world), world))
    loss_tuned, loss_calibrated = (float(torch.stack(losses[kept]).mean()) for kept in runs)
    kept = "fine-tuned" if loss_tuned < loss_calibrated else "calibrated"
    _load(values, tuned if kept == "fine-tuned" else calibrated)
    return {"examples": examples, "loss_calibrated": loss_calibrated, "loss_fine_tuned": loss_tuned, "kept": kept}


def _load(params: list, values: list) -> None:
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)


def _loss_parts(student, teacher, feeds: dict, objective: Objective, world) -> tuple:
    """(this process's numerators, every process's denominators) of ``feeds``' loss."""
    mine = world.share(feeds)
    with torch.no_grad():
        targets = teacher(mine)
    return _parts(student(mine), targets, mine, objective, world)


def _parts(outputs: list, targets: list, feeds, objective: Objective, world) -> tuple:
    numerators, denominators = objective.parts(outputs, targets, feeds)
    return numerators, world.sum(denominators).clamp_min(1e-30)


def _batch_loss(numerators, denominators, world):
    """A batch's loss over every process's examples: the mean over the outputs."""
    return (world.sum(numerators) / denominators).mean()


class _World:
    """torch.distributed's processes (one without it): their share of a batch, sums over them."""

    def __init__(self):
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.size = torch.distributed.get_world_size() if distributed else 1
        self.rank = torch.distributed.get_rank() if distributed else 0

    def share(self, feeds):
        """This process's examples of ``feeds``: contiguous rows (an input without the batch's
        leading axis goes whole to every process)."""
        if self.size == 1:
            return feeds
        total = _examples(feeds)
        start, stop = self.rank * total // self.size, (self.rank + 1) * total // self.size

        def mine(x):
            return x[start:stop] if np.ndim(x) and np.shape(x)[0] == total else x

        return {name: mine(x) for name, x in feeds.items()} if isinstance(feeds, dict) else tuple(map(mine, feeds))

    def sum(self, tensor):
        if self.size > 1:
            tensor = tensor.detach().clone()
            torch.distributed.all_reduce(tensor)
        return tensor

    def start_alike(self, params: list) -> None:
        """Every process from the first one's values (the same already where stage 1 was)."""
        if self.size > 1:
            with torch.no_grad():
                for param in params:
                    torch.distributed.broadcast(param, 0)

    def sum_gradients(self, params: list) -> None:
        if self.size == 1:
            return
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            torch.distributed.all_reduce(param.grad)
