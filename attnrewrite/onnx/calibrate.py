"""Calibrating an ONNX rewrite: collect each replacement's inputs with onnxruntime, fit, write.

The replacements are already spliced (learnable lowerings, at their initial values). Each
replacement's q, k, v and key_keep are exposed as extra graph outputs (cast to float32), and
its fittable constants are made graph inputs as well as initializers, so each run is fed the
values fitted so far. Site l is collected on the model whose sites before it are fitted
(sequential), by a session of only the nodes its inputs need (onnxruntime runs every node of a
graph whatever outputs are asked for, so the graph is cut after site l), fitted by passes.fit
(on CUDA when torch sees a GPU; the samples stay in host memory, a minibatch at a time goes to
the device), and its values are written into its initializers. The model is restored afterwards.

With ``end_to_end`` steps, all sites are then fitted together against the model's outputs
(passes.fit.fit_end_to_end), on the graph evaluated in torch (attnrewrite.onnx.torch_graph):
the targets are the same graph with every replacement computing exact attention. That stage
runs on the CPU, as the evaluator keeps every tensor there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import onnx
import onnx_ir as ir

from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.io import saved_copy
from attnrewrite.onnx.validate import make_session
from attnrewrite.record import SiteOutcome

ROLES = ("q", "k", "v", "key_keep")


def calibrate_replacements(model: ir.Model, calls: dict[str, ir.Node], fitting: list, calibration) -> dict | None:
    """``fitting``: (outcome, learnable torch module, the lowering's constant names) per site,
    in graph order; ``calls``: site name -> replacement node. Fits in place; returns the
    record's entry for the end-to-end stage (None without one)."""
    from passes.fit import SiteSamples, fit_site

    sites = [_Site(outcome, module, calls[outcome.site.name], names) for outcome, module, names in fitting]
    whole = _torch_graph(model, sites) if calibration.end_to_end else None  # refused before any fitting
    device = _fitting_device()
    with _collecting(model, sites) as session_for:
        for index, site in enumerate(sites):
            session = session_for(site)
            samples = SiteSamples()
            fitted = {name: array for earlier in sites[:index] for name, array in earlier.feeds().items()}
            for feeds in calibration.batches:
                q, k, v, keep = _run(session, site.outputs, {**feeds, **fitted})
                samples.add(q, k, v, keep)
            del session
            result = fit_site(
                site.module, samples, scale=site.outcome.site.scale, causal=site.outcome.site.mask.causal,
                steps=calibration.steps, lr=calibration.lr, seed=calibration.seed, ce_weight=calibration.ce_weight,
                device=device,
            )
            site.module.cpu()  # where the end-to-end stage evaluates it
            site.write_fitted()
            site.outcome.calibration = calibration.report(index, len(sites), site.outcome.site.layer, result)
    return None if whole is None else _fit_end_to_end(whole, sites, calibration)


def _fitting_device():
    from passes._torch import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _torch_graph(model: ir.Model, sites: list["_Site"]):
    from attnrewrite.onnx.torch_graph import TorchGraph

    return TorchGraph(model.graph, [site.call for site in sites])


def _fit_end_to_end(whole, sites: list["_Site"], calibration) -> dict:
    """All sites fitted together on the model's outputs; their initializers rewritten."""
    from passes.fit import exact_stand_in, fit_end_to_end, zero_padded_queries

    def fitted_stand_in(module):
        return lambda q, k, v, key_keep: zero_padded_queries(module(q, k, v, key_keep), q, key_keep)

    exact = {s.call: exact_stand_in(s.outcome.site.scale, s.outcome.site.mask.causal) for s in sites}
    targets = [whole.run(feeds, exact) for feeds in calibration.batches]
    fitted = {s.call: fitted_stand_in(s.module) for s in sites}
    result = fit_end_to_end(
        lambda feeds: whole.run(feeds, fitted), [p for s in sites for p in s.module.parameters() if p.requires_grad],
        calibration.batches, targets, steps=calibration.end_to_end, seed=calibration.seed,
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
        # the call reads (q, k, v, key_keep, *constants), constants in the lowering's order
        self.constants = {
            name: value for name, value in zip(constant_names, call.inputs[4:]) if name in state
        }
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

    def write_fitted(self) -> None:
        for value, array in self.fitted().items():
            value.const_value = ir.tensor(array, name=value.name)


@contextlib.contextmanager
def _collecting(model: ir.Model, sites: list[_Site]) -> Iterator:
    """An onnxruntime session of the model with every site's inputs as extra float32 outputs
    and its fittable initializers as overridable inputs; the model is restored afterwards."""
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
            proto = onnx.load(str(path), load_external_data=False)  # weights stay in their file

            def session_for(site: _Site):
                cut = path.with_name(f"site{sites.index(site)}.onnx")
                onnx.save(_needed_for(proto, site.outputs), str(cut))
                try:
                    return make_session(str(cut))
                except Exception as error:
                    raise AttnRewriteError(f"onnxruntime cannot load the model to calibrate: {_first_line(error)}") from error

            yield session_for
    finally:
        for value in outputs:
            graph.outputs.remove(value)
        for value in inputs:
            graph.inputs.remove(value)
        for node in reversed(nodes):
            graph.remove(node, safe=True)


def _needed_for(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` with ``outputs`` as its outputs and only the nodes and initializers
    they depend on (names read inside subgraphs count as read by their node)."""
    needed, kept = set(outputs), []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(_names_read(node))
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    graph = cut.graph
    del graph.node[:]
    graph.node.extend(reversed(kept))
    wanted = {o.name: o for o in model.graph.output}
    del graph.output[:]
    graph.output.extend(wanted[name] for name in outputs)
    initializers = [t for t in model.graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    dropped = {t.name for t in model.graph.initializer} - needed  # some are inputs too
    inputs = [i for i in model.graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    return cut


def _names_read(node: onnx.NodeProto) -> set[str]:
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs] if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) else []:
            for inner in graph.node:
                names |= _names_read(inner)
    return names


def _run(session, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    # get_inputs() leaves out initializers that are also inputs: the fitted values are those
    known = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}
    try:
        return session.run(names, {name: array for name, array in feeds.items() if name in known})
    except Exception as error:
        raise AttnRewriteError(f"the model fails to run on the calibration data: {_first_line(error)}") from error


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
