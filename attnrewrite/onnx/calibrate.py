"""Calibrating an ONNX rewrite: collect each replacement's inputs with onnxruntime, fit, write.

The replacements are already spliced (learnable lowerings, at their initial values). Each
replacement's q, k, v and key_keep are exposed as extra graph outputs (cast to float32), and
its fittable constants are made graph inputs as well as initializers, so each run is fed the
values fitted so far. Site l is collected on the model whose sites before it are fitted
(sequential), by a session of only the part of the graph between site l-1's replacement and
site l's inputs (_Runs: what lies before is fed back from site l-1's run), fitted by passes.fit
(on CUDA when torch sees a GPU; the samples stay in host memory, a minibatch at a time goes to
the device), and its values are written into its initializers. The model is restored afterwards.

With ``end_to_end`` steps, all sites are then fitted together against the model's outputs
(passes.fit.fit_end_to_end), on the graph evaluated in torch (attnrewrite.onnx.torch_graph, on
the fitting device too): the targets are the same graph with every replacement computing exact
attention.

Then the guard (where the calibration holds a part out, attnrewrite.calibration.HeldOut): the
whole rewritten model runs on the held-out data with the zero-shot values and with the fitted
ones, and the zero-shot ones are written back where fitting left it further from the original.
Last, with ``finetune``, stage 2 (onnx/finetune.py): adapters on the sites' projections, trained
with the replacements' values and merged into the weights where its own guard keeps them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.data import split_batch
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.finetune import Finetuning
from attnrewrite.onnx.inputs import with_prefill_inputs
from attnrewrite.onnx.io import saved_copy
from attnrewrite.onnx.validate import make_session
from attnrewrite.passes.optional_torch import torch
from attnrewrite.record import SiteOutcome

ROLES = ("q", "k", "v", "key_keep")


def calibrate_replacements(model: ir.Model, calls: dict[str, ir.Node], fitting: list, calibration) -> dict:
    """``fitting``: (outcome, learnable torch module, the lowering's constant names) per site,
    in graph order; ``calls``: site name -> replacement node. Fits in place; returns the
    record's entries of the stages after the per-site fits that ran ("end_to_end", "finetune")."""
    sites = [_Site(outcome, module, calls[outcome.site.name], names) for outcome, module, names in fitting]
    zero_shot = [site.fitted() for site in sites]  # the initial values, the guard's fallback
    # what the later stages need, refused before any fitting
    finetuning = Finetuning(sites) if calibration.finetune else None
    whole = _torch_graph(model, sites) if calibration.end_to_end or calibration.finetune else None
    _fit_each_site(model, sites, calibration, whole.device if whole is not None else "cpu")
    stages = {}
    if calibration.end_to_end:
        stages["end_to_end"] = _fit_end_to_end(whole, sites, calibration)
    if calibration.held_out is not None:
        _guard(model, sites, zero_shot, calibration)
    if finetuning is not None:
        stages["finetune"] = finetuning.run(whole, calibration)
    return stages


def _fit_each_site(model: ir.Model, sites: list[_Site], calibration, later_device) -> None:
    """Stage 1, site after site; the sites' samples and the activations carried between cuts
    (gigabytes on a large calibration set) are gone when it returns, before the later stages."""
    from attnrewrite.onnx.torch_graph import with_query_heads
    from attnrewrite.passes.fit import SiteSamples, fit_site

    device = _fitting_device()
    batches = [with_prefill_inputs(model.graph, feeds) for feeds in calibration.batches]  # a recurrent model's states
    with _collecting(model, sites) as runs:
        held = [{} for _ in batches]  # per batch: values an earlier run gave the next cut
        for index, site in enumerate(sites):
            session, cut = runs.session_for(index)
            samples = SiteSamples()
            fitted = {name: array for earlier in sites[:index] for name, array in earlier.feeds().items()}
            for number, feeds in enumerate(batches):
                given = {name: held[number][name] for name in cut.given}
                q, k, v, keep, *carried = _run(session, site.outputs + cut.carry, {**feeds, **fitted, **given})
                held[number] = {**given, **dict(zip(cut.carry, carried))}
                samples.add(*with_query_heads(q, k, v, keep))
            del session
            result = fit_site(
                site.module,
                samples,
                scale=site.outcome.site.scale,
                causal=site.outcome.site.mask.causal,
                steps=calibration.steps,
                lr=calibration.lr,
                seed=calibration.seed,
                ce_weight=calibration.ce_weight,
                device=device,
            )
            site.module.to(later_device)  # where the later stages evaluate it
            site.write_fitted()
            site.outcome.calibration = calibration.report(index, len(sites), site.outcome.site.layer, result)


def _guard(model: ir.Model, sites: list[_Site], zero_shot: list[dict], calibration) -> None:
    """The whole rewritten model compared with the original on the held-out data, with the
    zero-shot values and with the fitted ones: where fitting made it worse there, the zero-shot
    values are written back. Per-site losses cannot see this: they are measured on the data
    fitted on, site by site. Every site's record entry says both figures and which were kept."""
    held = calibration.held_out
    feeds = [with_prefill_inputs(model.graph, batch) for batch in held.batches]
    fitted = [site.fitted() for site in sites]  # in the model now
    with _constants_as_inputs(model, sites) as path:  # one session runs both sets of values
        session = make_session(str(path))
        figures = held.cosines(*(_run_with(session, model, feeds, values) for values in (zero_shot, fitted)))
    entry = calibration.judge(*figures)
    if entry["kept"] == "zero-shot":
        _write(zero_shot)
        for site, values in zip(sites, zero_shot):  # what a later stage starts from
            site.load(values)
    for site in sites:
        site.outcome.calibration["held_out"] = entry


def _run_with(session, model: ir.Model, feeds: list[dict], values: list[dict[ir.Value, np.ndarray]]):
    """The model's outputs on the batch at an index, its sites' constants fed ``values``."""
    names = [value.name for value in model.graph.outputs]
    given = {value.name: array for site_values in values for value, array in site_values.items()}
    return lambda index: dict(zip(names, _run(session, names, {**feeds[index], **given})))


@contextlib.contextmanager
def _constants_as_inputs(model: ir.Model, sites: list[_Site]) -> Iterator:
    """The model saved with the sites' fittable initializers also graph inputs, so that a run
    can be fed other values for them (an initializer that is also an input can be fed)."""
    inputs = [value for site in sites for value in site.constants.values()]
    model.graph.inputs.extend(inputs)
    try:
        with saved_copy(model) as path:
            yield path
    finally:
        for value in inputs:
            model.graph.inputs.remove(value)


def _write(values: list[dict[ir.Value, np.ndarray]]) -> None:
    for site_values in values:
        for value, array in site_values.items():
            value.const_value = ir.tensor(array, name=value.name)


def _fitting_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _torch_graph(model: ir.Model, sites: list[_Site]):
    from attnrewrite.onnx.torch_graph import TorchGraph

    return TorchGraph(model.graph, [site.call for site in sites], _fitting_device())


def _fit_end_to_end(whole, sites: list[_Site], calibration) -> dict:
    """All sites fitted together on the model's outputs; their initializers rewritten. A step
    runs at most EXAMPLES_PER_STEP examples, as the per-site fits take them: a step is a forward
    and backward pass of the whole model, and on MiniLM 100 steps of 4 passages fit as well as
    100 of 8 in half the time (bench/FIDELITY.md)."""
    from attnrewrite.passes.fit import EXAMPLES_PER_STEP, exact_stand_in, fit_end_to_end, fitted_stand_in

    batches = [
        with_prefill_inputs(whole.graph, part)  # cut before a recurrent model's states: a scalar one has no batch
        for feeds in calibration.batches
        for part in split_batch(feeds, EXAMPLES_PER_STEP)
    ]
    exact = {s.call: exact_stand_in(s.outcome.site.scale, s.outcome.site.mask.causal) for s in sites}
    targets = [whole.run(feeds, exact) for feeds in batches]
    fitted = {s.call: fitted_stand_in(s.module) for s in sites}
    result = fit_end_to_end(
        lambda feeds: whole.run(feeds, fitted),
        [p for s in sites for p in s.module.parameters() if p.requires_grad],
        batches,
        targets,
        steps=calibration.end_to_end,
        seed=calibration.seed,
    )
    for site in sites:
        site.write_fitted()
    return calibration.report_end_to_end(len(sites), result)


class _Site:
    def __init__(self, outcome: SiteOutcome, module, call: ir.Node, constant_names: list[str]):
        self.outcome = outcome
        self.module = module
        self.call = call
        state = set(module.state_dict())
        # the call reads (q, k, v, key_keep, *state, *constants), constants last in the lowering's order
        constants = call.inputs[len(call.inputs) - len(constant_names) :]
        self.constants = {name: value for name, value in zip(constant_names, constants) if name in state}
        self.outputs = [f"attnrewrite/calibrate/{outcome.site.name}/{role}" for role in ROLES]

    def fitted(self) -> dict[ir.Value, np.ndarray]:
        """Each fittable initializer and the module's current value for it."""
        state = self.module.state_dict()
        return {
            value: state[name].detach().cpu().numpy().astype(value.const_value.dtype.numpy())
            for name, value in self.constants.items()
        }

    def feeds(self) -> dict[str, np.ndarray]:
        """The fitted values under the initializers' names, to feed the collecting session."""
        return {value.name: array for value, array in self.fitted().items()}

    def load(self, values: dict[ir.Value, np.ndarray]) -> None:
        """The module's fittable values set to ``values`` (as fitted() gives them)."""
        names = {value: name for name, value in self.constants.items()}
        state = {names[value]: torch.from_numpy(np.asarray(array, np.float32)) for value, array in values.items()}
        self.module.load_state_dict(state, strict=False)

    def write_fitted(self) -> None:
        for value, array in self.fitted().items():
            value.const_value = ir.tensor(array, name=value.name)


@contextlib.contextmanager
def _collecting(model: ir.Model, sites: list[_Site]) -> Iterator[_Runs]:
    """The collecting runs (_Runs) of the model with every site's inputs as extra float32
    outputs and its fittable initializers as overridable inputs; the model is restored afterwards."""
    graph = model.graph
    nodes, outputs, inputs = [], [], []
    try:
        for site in sites:
            for value, name in zip(site.call.inputs[:4], site.outputs):
                cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)], name=name, num_outputs=1)
                cast.outputs[0].name = name
                cast.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
                graph.append(cast)
                nodes.append(cast)
                graph.outputs.append(cast.outputs[0])
                outputs.append(cast.outputs[0])
            for value in site.constants.values():
                graph.inputs.append(value)  # an initializer that is also an input can be fed
                inputs.append(value)
        with saved_copy(model) as path:
            yield _Runs(path, sites, _tensor_types(graph))
    finally:
        for value in outputs:
            graph.outputs.remove(value)
        for value in inputs:
            graph.inputs.remove(value)
        for node in reversed(nodes):
            graph.remove(node, safe=True)


@dataclasses.dataclass
class _Cut:
    """What site l's collecting run computes: ``nodes`` (in graph order), reading the model's
    inputs and ``given``, values an earlier run computed (fed back), and giving the site's
    inputs and ``carry``, the values later cuts are given."""

    nodes: list[onnx.NodeProto]
    given: list[str]
    carry: list[str] = dataclasses.field(default_factory=list)


class _Runs:
    """One onnxruntime session per site, of only the nodes its inputs need (onnxruntime runs every
    node of a graph whatever outputs are asked for). A value an earlier site's run computed is
    fed back instead of recomputed: it lies upstream of that site's replacement, and the sites
    are in graph order, so no fit since can have changed it. Site l's run then computes only
    what lies between site l-1's replacement and site l's inputs, instead of the whole prefix."""

    def __init__(self, path, sites: list[_Site], types: dict[str, int]):
        self.path = path
        self.proto = onnx.load(str(path), load_external_data=False)  # weights stay in their file
        self.types = types
        self.sites = sites
        self.cuts = _plan_cuts(self.proto, [site.outputs for site in sites], set(types))

    def session_for(self, index: int):
        cut = self.cuts[index]
        part = self.path.with_name(f"site{index}.onnx")
        onnx.save(_cut_model(self.proto, cut, self.sites[index].outputs, self.types), str(part))
        try:
            # no arena: its outputs (the samples, the values carried to the next cut) outlive the
            # run, and an arena would keep every chunk they touched until the last of them goes
            # (SmolLM2-135M, its first 6 sites on 400 passages: 16.1 GB resident at the peak, 8.2 without)
            return make_session(str(part), arena=False), cut
        except Exception as error:
            raise AttnRewriteError(f"onnxruntime cannot load the model to calibrate: {_first_line(error)}") from error


def _tensor_types(graph: ir.Graph) -> dict[str, int]:
    """Node outputs of a known tensor type (the ones a run can hand to the next): name -> dtype."""
    return {
        value.name: value.type.dtype.value
        for node in graph
        for value in node.outputs
        if value.name and isinstance(value.type, ir.TensorType)
    }


def _plan_cuts(model: onnx.ModelProto, outputs: list[list[str]], carriable: set[str]) -> list[_Cut]:
    """Per site (``outputs``: its collected values), the nodes to run and the values to feed
    back: those of ``carriable`` an earlier run computed or was given."""
    cuts, available = [], set()
    for wanted in outputs:
        nodes, given = _needed_nodes(model, wanted, available)
        if cuts:  # the previous run gives what this one needs and was not given itself
            cuts[-1].carry = [name for name in given if name not in cuts[-1].given]
        cuts.append(_Cut(nodes, given))
        available = carriable & (set(given) | {name for node in nodes for name in node.output})
    return cuts


def _needed_nodes(model: onnx.ModelProto, outputs: list[str], available: set[str]) -> tuple[list, list[str]]:
    """The nodes ``outputs`` depend on (names read inside subgraphs count as read by their node),
    stopping at ``available`` values, which are returned as the ones to give."""
    needed, kept, given = set(outputs), [], []
    for node in reversed(model.graph.node):
        produced = [name for name in node.output if name in needed]
        if not produced:
            continue
        if all(name in available for name in produced):
            given.extend(produced)
            continue
        kept.append(node)
        needed.update(_names_read(node))
    return kept[::-1], given[::-1]


def _names_read(node: onnx.NodeProto) -> set[str]:
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for graph in (
            [attribute.g, *attribute.graphs]
            if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            else []
        ):
            for inner in graph.node:
                names |= _names_read(inner)
    return names


def _cut_model(model: onnx.ModelProto, cut: _Cut, collected: list[str], types: dict[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` with only the cut's nodes and the initializers they read, its given
    values as extra inputs, and the ``collected`` values and the carried ones as its outputs."""
    read = {name for node in cut.nodes for name in _names_read(node)}
    part = onnx.ModelProto()
    part.CopyFrom(model)
    graph = part.graph
    del graph.node[:]
    graph.node.extend(cut.nodes)
    del graph.output[:]
    graph.output.extend(_tensor_info(name, types) for name in [*collected, *cut.carry])
    initializers = [t for t in model.graph.initializer if t.name in read]
    dropped = {t.name for t in model.graph.initializer} - read  # some are inputs too
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    inputs = [i for i in model.graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend([*inputs, *(_tensor_info(name, types) for name in cut.given)])
    return part


def _tensor_info(name: str, types: dict[str, int]) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, types[name], None)


def _run(session, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    # get_inputs() leaves out initializers that are also inputs: the fitted values are those
    known = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}
    try:
        return session.run(names, {name: array for name, array in feeds.items() if name in known})
    except Exception as error:
        raise AttnRewriteError(f"the model fails to run on the calibration data: {_first_line(error)}") from error


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
