"""Fine-tuning an FX rewrite (stage 2, passes/finetune.py): peft's LoRA on each replaced site's
projections (fx/projections.py), trained with the replacement modules' parameters, merged into
the weights by peft when done.

peft adapts ``nn.Linear`` modules. One the graph calls once, with a weight nothing else holds,
takes LoRA where it is. Every other projection is lifted first into an ``nn.Linear`` of its own
(a copy of its weight and bias, called where it was): a weighted call on a parameter (what
torch.export makes of nn.Linear and Conv1D), a module called from several places (shared
layers), a weight tied to another. After merging, a lifted weighted call is put back as it was,
reading the merged weight: written into its parameter where nothing else reads that, else into
a new parameter beside it; a lifted module call stays a call of its merged copy. So a weight
shared with anything else is never changed under it, and the graph gains no kind of op.

The teacher is the model with the adapters off and every replacement standing in for the exact
attention (calibrate.py's hooks), the original; the student has both on. The objective: where
the model returns ``logits`` of [batch, sequence, vocabulary], the next-token KL at every real
position (the ``attention_mask`` input's); else the outputs' relative squared error. With
held-out examples, the guard keeps the fine-tuned model only where it scores better there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils import _pytree

from attnrewrite.errors import AttnRewriteError
from attnrewrite.fx.projections import Projection, site_projections
from attnrewrite.passes import finetune
from attnrewrite.passes.fit import snapshot

MASK = "attention_mask"
LIFTED = "attnrewrite_lora"  # the lifted projections' module names: LIFTED_0, LIFTED_1, ...
ADAPTER = "default"  # peft's adapter name


class Finetuning:
    """Stage 2 of one FX rewrite: the sites' projections found before anything is fitted (a
    quantized one refuses the whole stage), the training run after stage 1."""

    def __init__(self, gm: GraphModule, fitting: list):
        self.gm = gm
        self.fitting = fitting
        self.adapted, self.skipped = _adapted_projections(gm, fitting)
        if not self.adapted:
            raise AttnRewriteError(f"cannot fine-tune: no site has projections to adapt ({self.skipped[0]['reason']})")

    def run(self, outputs: Callable, objective: finetune.Objective, calibration) -> dict:
        """Fine-tune in place. ``outputs(example, exact)``: the model's floating outputs with
        every replacement computing exact attention (or, ``exact`` False, its own). Returns the
        record's entry; the adapters are merged where the guard keeps them, else removed."""
        import peft

        settings, gm = calibration.finetune, self.gm
        requires_grad = {p: p.requires_grad for p in gm.parameters()}
        values = [p for _, module in self.fitting for p in module.parameters() if p.requires_grad]
        projections = [p for _, ps in self.adapted for p in ps]
        in_place = [p.module is not None and _adaptable_in_place(gm, p) for p in projections]  # before any lifting
        hosts = [
            _Host(str(p.node.target), p) if own else _lift(gm, p, f"{LIFTED}_{number}")
            for number, (p, own) in enumerate(zip(projections, in_place))
        ]
        config = peft.LoraConfig(
            r=settings.rank,
            lora_alpha=finetune.ALPHA_PER_RANK * settings.rank,
            lora_dropout=0.0,
            target_modules="|".join(re.escape(host.name) for host in hosts),  # a string: matched whole
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(calibration.seed)  # LoRA's A is drawn from torch's generator
            lora = peft.LoraModel(gm, config, ADAPTER)
        keep = False
        try:
            result, held_out = self._train(lora, values, outputs, objective, calibration)
            keep = held_out is None or held_out["kept"] == "fine-tuned"
        finally:
            if keep:
                lora.merge_and_unload()
            else:
                lora.unload()
            _put_back(gm, hosts, merged=keep, requires_grad=requires_grad)
        return calibration.report_finetune(result, objective.kind, held_out, self._entries())

    def _train(self, lora, values: list, outputs: Callable, objective: finetune.Objective, calibration) -> tuple:
        """(passes.finetune's result, the guard's entry or None); ``values``: the replacements'
        trainable parameters."""
        for p in values:  # peft froze everything but its adapters
            p.requires_grad_(True)
        adapters = [p for name, p in self.gm.named_parameters() if "lora_" in name]

        def teacher(example):
            with _adapters_off(lora):
                return outputs(example, exact=True)

        def student(example):
            return outputs(example, exact=False)

        def calibrated_student(example):
            with _adapters_off(lora):
                return outputs(example, exact=False)

        calibrated = snapshot(values)
        settings = calibration.finetune
        result = finetune.finetune(
            student,
            teacher,
            [*values, *adapters],
            calibration.batches,
            objective,
            steps=settings.steps,
            lr=settings.lr,
            seed=calibration.seed,
            step_done=calibration.finetune_step_done,
        )
        held = calibration.held_out
        if held is None:
            return result, None
        return result, finetune.judge(
            held.batches, held.examples, student, calibrated_student, teacher, objective, values, calibrated
        )

    def _entries(self) -> dict:
        adapted = [
            {"site": outcome.site.name, "projections": [p.name for p in projections]}
            for outcome, projections in self.adapted
        ]
        return {"adapted": adapted, "not_adapted": self.skipped}


def objective_of(output, example) -> finetune.Objective:
    """Next-token KL where the model's ``output`` has ``logits`` of rank 3 (as transformers'
    models return), else the outputs' relative squared error."""
    logits = output.get("logits") if isinstance(output, Mapping) else None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        return finetune.Objective(finetune.OUTPUT_ERROR)
    leaves = [t for t in _pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    index = next(i for i, t in enumerate(leaves) if t is logits)
    mask = MASK if isinstance(example, Mapping) and MASK in example else None
    return finetune.Objective(finetune.NEXT_TOKEN_KL, index, mask)


def _adapted_projections(gm: GraphModule, fitting: list) -> tuple[list, list[dict]]:
    """([(site outcome, its projections)], [{site, reason}] for the sites without); a
    projection shared by two sites is adapted once, under the first."""
    calls = {node.meta["attnrewrite_site"]: node for node in gm.graph.nodes if "attnrewrite_site" in node.meta}
    adapted, skipped, taken = [], [], set()
    for outcome, _ in fitting:
        call = calls.get(outcome.site.name)
        if call is None:  # a module swap (modules.py): the projections are inside nn.MultiheadAttention
            reason = "nn.MultiheadAttention packs q, k and v into one parameter, not an nn.Linear"
            skipped.append({"site": outcome.site.name, "reason": reason})
            continue
        try:
            projections = site_projections(gm, call, set(calls.values()))
        except finetune.Quantized as why:
            raise AttnRewriteError(f"cannot fine-tune: {why}") from None
        except finetune.Unadaptable as why:
            skipped.append({"site": outcome.site.name, "reason": str(why)})
            continue
        adapted.append((outcome, [p for p in projections.all if p.node not in taken]))
        taken.update(p.node for p in projections.all)
    return adapted, skipped


@dataclasses.dataclass
class _Host:
    """The nn.Linear peft adapts for one projection: its own module (``lifted`` None), or a
    lifted copy called where the projection was (``lifted``: that call; ``was``: the node it
    replaced, as (op, target, args, kwargs, name), to put it back)."""

    name: str
    projection: Projection
    lifted: Node | None = None
    was: tuple = ()


def _adaptable_in_place(gm: GraphModule, projection: Projection) -> bool:
    """Whether merging into the module's own weight changes nothing but this projection: the
    graph calls the module once and no other name holds its parameters."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == projection.node.target]
    return len(calls) == 1 and all(_holders(gm, p) == 1 for p in projection.module.parameters())


def _holders(gm: GraphModule, tensor: torch.Tensor) -> int:
    return sum(p is tensor for _, p in gm.named_parameters(remove_duplicate=False))


def _lift(gm: GraphModule, projection: Projection, name: str) -> _Host:
    node, call = projection.node, projection.call
    if call is None:
        bias, activation = projection.module.bias, node.args[0]
    else:
        bias, activation = (None if call.bias is None else _tensor(gm, call.bias)), call.input
    weight = projection.weight.detach()
    linear = nn.Linear(*projection.shape, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.T.clone() if call is not None and call.weight_last else weight.clone())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    gm.add_submodule(name, linear)
    with gm.graph.inserting_before(node):
        lifted = gm.graph.call_module(name, (activation,))
    lifted.meta = dict(node.meta)
    was = (node.op, node.target, node.args, node.kwargs, node.name)
    node.replace_all_uses_with(lifted)
    gm.graph.erase_node(node)
    gm.recompile()
    return _Host(name, projection, lifted, was)


def _put_back(gm: GraphModule, hosts: list[_Host], merged: bool, requires_grad: dict) -> None:
    """The lifted projections as they were: a weighted call reads its weight again (the merged
    one where ``merged``); a module call stays on its merged copy, or goes back to its module."""
    for host in hosts:
        if host.lifted is None or (merged and host.projection.call is None):
            continue
        op, target, args, kwargs, name = host.was
        if merged:
            args, kwargs = _reading_merged(gm, host, args, kwargs)
        with gm.graph.inserting_before(host.lifted):
            node = gm.graph.create_node(op, target, args, kwargs, name=name)
        node.meta = host.lifted.meta
        host.lifted.replace_all_uses_with(node)
        gm.graph.erase_node(host.lifted)
        delattr(gm, host.name)
    gm.recompile()
    for p, flag in requires_grad.items():
        p.requires_grad_(flag)


def _reading_merged(gm: GraphModule, host: _Host, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The weighted call's arguments reading its lifted copy's merged weight: written into its
    parameter where nothing else reads that, else into a new parameter beside it."""
    projection, call = host.projection, host.projection.call
    merged = gm.get_submodule(host.name).weight.detach()
    value = (merged.T if call.weight_last else merged).to(projection.weight.dtype)
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and _tensor(gm, n) is projection.weight]
    if _holders(gm, projection.weight) <= 1 and not any(reader.users for reader in readers):
        with torch.no_grad():
            projection.weight.copy_(value)
        return args, kwargs
    name = _free_name(gm, f"{call.weight.target.replace('.', '_')}_finetuned")
    gm.register_parameter(name, nn.Parameter(value.clone(), requires_grad=projection.weight.requires_grad))
    with gm.graph.inserting_after(call.weight):
        reader = gm.graph.get_attr(name)
    swap = {call.weight: reader}
    return map_arg(args, lambda n: swap.get(n, n)), map_arg(kwargs, lambda n: swap.get(n, n))


def _tensor(gm: GraphModule, node: Node) -> torch.Tensor:
    owner, _, name = node.target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _free_name(gm: GraphModule, name: str) -> str:
    fresh, number = name, 1
    while hasattr(gm, fresh):
        fresh, number = f"{name}_{number}", number + 1
    return fresh


@contextlib.contextmanager
def _adapters_off(lora):
    lora.disable_adapter_layers()
    try:
        yield
    finally:
        lora.enable_adapter_layers()
