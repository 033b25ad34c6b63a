"""Rewriting a GraphModule: every understood attention site calls the pass's torch module.

Graph sites (softmax chains, SDPA calls) are spliced: a ``call_module`` of the pass module takes
q, k, v (and key_keep, computed in the graph from the site's key-padding mask) and replaces the
node that held ``probabilities @ v``; what only fed the old attention is then dead and erased.
nn.MultiheadAttention sites are module swaps (see modules.py); the graph is unchanged.
The input model is never modified: the rewrite works on a copy.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import warnings
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from attnrewrite import decision, passes
from attnrewrite.decision import RunPlan
from attnrewrite.errors import AttnRewriteError
from attnrewrite.fx import capture, ops
from attnrewrite.fx.detect import FxMatch, find_matches
from attnrewrite.fx.facts import GraphFacts, live_nodes
from attnrewrite.fx.masks import key_keep_from_mask
from attnrewrite.fx.modules import LinearizedMultiheadAttention, slow_path_container
from attnrewrite.passes.layout import expand_to_query_heads
from attnrewrite.passes.options import MethodOptions
from attnrewrite.record import METADATA_KEY, RewriteRecord, SiteOutcome
from attnrewrite.site import AttentionSite


def to_graph_module(model: Any, example_inputs: Any = None, dynamic_shapes: Any = None) -> GraphModule:
    """A GraphModule copy of an nn.Module, a GraphModule or an ExportedProgram (capture.py says how
    an nn.Module is captured and how ``example_inputs`` may be given)."""
    return _capture(model, example_inputs, dynamic_shapes)[0]


def _capture(model: Any, example_inputs: Any, dynamic_shapes: Any) -> tuple[GraphModule, dict | None]:
    """(the GraphModule, the record's ``capture`` entry where this captured it with torch.export)."""
    example = None if example_inputs is None else capture.as_example(example_inputs)
    entry = None
    if isinstance(model, torch.export.ExportedProgram):
        gm = _copy(model.module())
    elif isinstance(model, GraphModule):
        gm = _copy(model)
    elif isinstance(model, nn.Module):
        gm, entry = _trace(model, example, dynamic_shapes)
    else:
        raise TypeError(f"expected an nn.Module, GraphModule or ExportedProgram, not {type(model).__name__}")
    if example is not None and not _has_shapes(gm):
        _propagate_shapes(gm, example)
    return gm, entry


def _copy(gm: GraphModule) -> GraphModule:
    with warnings.catch_warnings():  # torch's pytree specs warn about their own deprecations
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm)


def _trace(model: nn.Module, example: capture.Example | None, dynamic_shapes: Any) -> tuple[GraphModule, dict | None]:
    if torch.fx.Tracer().is_leaf_module(model, ""):
        return _call_of_leaf(model), None
    if dynamic_shapes is None:
        try:
            return torch.fx.symbolic_trace(copy.deepcopy(model)), None
        except Exception as error:  # noqa: BLE001 - symbolic_trace fails in many ways on dynamic code
            if example is None:
                raise AttnRewriteError(
                    f"torch.fx.symbolic_trace cannot trace {type(model).__name__} ({capture.first_line(error)}); "
                    "pass example_inputs=(...) to capture it with torch.export, or pass an ExportedProgram"
                ) from None
    elif example is None:
        raise AttnRewriteError("dynamic_shapes= is for torch.export, which needs example_inputs=(...)")
    return capture.export(model, example, dynamic_shapes)


def _propagate_shapes(gm: GraphModule, example: capture.Example) -> None:
    """Shapes on a symbolic trace's nodes (ShapeProp takes positional arguments only)."""
    if isinstance(example, dict):
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        example = tuple(example.get(name) for name in names)
    with torch.no_grad():
        ShapeProp(gm).propagate(*example)


def _call_of_leaf(model: nn.Module) -> GraphModule:
    """A graph that calls a torch.nn module (nn.TransformerEncoder, ...) as ``module``:
    symbolic_trace would try to trace its forward, which it cannot. The graph takes the
    module's required arguments; optional ones (masks) keep their defaults."""
    graph = torch.fx.Graph()
    required = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    call = graph.call_module("module", tuple(graph.placeholder(name) for name in required))
    graph.output(call)
    root = nn.Module()
    root.module = copy.deepcopy(model)
    return GraphModule(root, graph, class_name=type(model).__name__)


def _has_shapes(gm: GraphModule) -> bool:
    return any("val" in n.meta or "tensor_meta" in n.meta for n in gm.graph.nodes if n.op == "placeholder")


def find_fx_sites(model: Any, example_inputs: Any = None, dynamic_shapes: Any = None) -> list[AttentionSite]:
    """Every attention site of the model; skipped ones carry ``skip_reason``."""
    gm = to_graph_module(model, example_inputs, dynamic_shapes)
    return [match.site for match in find_matches(GraphFacts(gm))]


def rewrite_graph_module(
    model: Any,
    to: RunPlan | str | MethodOptions,
    layers: list[int] | None = None,
    *,
    example_inputs: Any = None,
    dynamic_shapes: Any = None,
    **keywords: Any,
) -> GraphModule:
    """Replace every attention site the method supports; the record is in gm.meta["attnrewrite"].

    ``model``: an nn.Module (traced with symbolic_trace where it can be), a GraphModule, or an
    ExportedProgram. ``to``: the run's plan (decision.RunPlan), as the API settles it; or the
    method's name (or Options) with the plan's fields and the method's options
    (passes.<method>.Options) as ``keywords``, as for the ONNX path (RunPlan.of). ``layers``
    (the plan's): rewrite only sites of these layer indices (sites in graph order, numbered as
    the ONNX frontend numbers them). ``example_inputs``: a tuple of positional arguments, a dict
    of keyword arguments (or a tokenizer's BatchEncoding) or one tensor; used for shapes when the
    graph has none, and to capture with torch.export a model symbolic_trace cannot trace, with
    dynamic batch and sequence axes unless ``dynamic_shapes`` (torch.export's argument) says
    otherwise (capture.py; the record's ``capture`` says which dims are dynamic). The plan's
    ``include_single_query``: also rewrite sites with one query (left exact by default); its
    ``calibration`` (attnrewrite.calibration.torch_calibration, as ``rewrite`` makes it from its
    ``calibrate`` examples): fit every replacement on it, site by site (attnrewrite.fx.calibrate);
    the fitted values are the pass modules' nn.Parameters.
    """
    plan = RunPlan.of(to, **keywords) if layers is None else RunPlan.of(to, layers=layers, **keywords)
    method, method_options, fitting_data = plan.method, plan.options, plan.calibration
    if fitting_data is not None:
        passes.require_fittable(method, method_options, fitting_data.ce_weight)
    fitting = []
    gm, captured = _capture(model, example_inputs, dynamic_shapes)
    facts = GraphFacts(gm)
    record = RewriteRecord(method.NAME, dataclasses.asdict(method_options))
    splicer = _Splicer(gm, method.NAME)
    containers: dict[str, bool] = {}
    replaced: set[Node] = set()

    for match in find_matches(facts):
        reason = decision.refusal(match.site, plan)
        if reason is None and fitting_data is not None:
            module, reason = decision.learnable_module(match.site, method, method_options)
        elif reason is None:
            module = method.torch_module(match.site, method_options)
        if reason is not None:
            record.outcomes.append(SiteOutcome(match.site, rewritten=False, reason=reason))
            continue
        module = module.to(_device(gm))
        if match.attention_path is not None:
            where = _swap_multihead_attention(gm, match, module)
            if match.container is not None:
                containers[match.container.target] = match.site.mask.causal
        else:
            where = splicer.splice(match, module)
            replaced.update(match.probability_path)
        outcome = SiteOutcome(match.site, rewritten=True, replacement=f"{type(module).__name__} at {where}")
        record.outcomes.append(outcome)
        record.bytes_added += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        fitting.append((outcome, module))

    for path, causal in containers.items():
        _set_submodule(gm, path, slow_path_container(gm.get_submodule(path), causal))
    _erase_dead_code(gm, replaced)
    gm.graph.lint()
    gm.recompile()
    if fitting_data is not None and fitting:
        from attnrewrite.fx.calibrate import calibrate_modules

        stages = calibrate_modules(gm, fitting, fitting_data)
        record.end_to_end, record.finetune = stages.get("end_to_end"), stages.get("finetune")
    gm.meta[METADATA_KEY] = record.as_dict() | ({"capture": captured} if captured is not None else {})
    return gm


def _device(gm: GraphModule) -> torch.device:
    for tensor in (*gm.parameters(), *gm.buffers()):
        return tensor.device
    return torch.device("cpu")


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, name, module)


def _swap_multihead_attention(gm: GraphModule, match: FxMatch, module: nn.Module) -> str:
    mha = gm.get_submodule(match.attention_path)
    _set_submodule(gm, match.attention_path, LinearizedMultiheadAttention(mha, module))
    return f"{match.attention_path}.attention"


class _Splicer:
    """Adds the pass modules to the GraphModule and routes each site's output through one."""

    def __init__(self, gm: GraphModule, method_name: str):
        self.gm = gm
        self.method_name = method_name
        self.replaced: dict[Node, Node] = {}  # old output -> new call, for sites that feed sites
        self.key_keeps: dict[tuple, Node] = {}  # one key_keep per mask, shared by the sites using it

    def _current(self, node: Node) -> Node:
        while node in self.replaced:
            node = self.replaced[node]
        return node

    def _free_name(self, owner_path: str | None) -> str:
        if owner_path:
            try:
                self.gm.get_submodule(owner_path)
            except AttributeError:
                owner_path = None
        prefix = f"{owner_path}." if owner_path else ""
        base = f"{prefix}{self.method_name}_attention"
        name, suffix = base, 1
        while _has_submodule(self.gm, name):
            name, suffix = f"{base}_{suffix}", suffix + 1
        return name

    def splice(self, match: FxMatch, module: nn.Module) -> str:
        graph = self.gm.graph
        name = self._free_name(match.site.provenance.get("module"))
        self.gm.add_submodule(name, module)
        output = match.output
        q, v = self._current(match.q), self._current(match.v)
        with graph.inserting_before(output):
            if match.k is not None:
                k = self._current(match.k)
            else:
                k = graph.call_function(torch.transpose, (self._current(match.k_transposed), -2, -1))
            shapes = match.site.provenance.get("shapes") or {}
            if not _same_leading_dims(shapes.get("k"), shapes.get("q")):
                k = graph.call_function(expand_to_query_heads, (k, q))
            if not _same_leading_dims(shapes.get("v"), shapes.get("q")):
                v = graph.call_function(expand_to_query_heads, (v, q))
            call = graph.call_module(name, (q, k, v, self._key_keep(match)))
        call.meta["attnrewrite_site"] = match.site.name
        if "nn_module_stack" in output.meta:
            call.meta["nn_module_stack"] = output.meta["nn_module_stack"]
        output.replace_all_uses_with(call)
        self.replaced[output] = call
        return name

    def _key_keep(self, match: FxMatch) -> Node | None:
        """float [..., Nk, 1] from the site's key-padding masks (inserted before the site's
        output); sites that read the same masks share it when it already comes before them."""
        if not match.key_padding:
            return None
        key = tuple((self._current(use.value), use.encoding) for use in match.key_padding)
        shared = self.key_keeps.get(key)
        if shared is not None and _comes_before(shared, match.output):
            return shared
        graph = self.gm.graph
        product = None
        for tensor, encoding in key:
            keep = graph.call_function(key_keep_from_mask, (tensor, encoding.value))
            product = keep if product is None else graph.call_function(operator.mul, (product, keep))
        self.key_keeps[key] = product
        return product


def _same_leading_dims(shape, q_shape) -> bool:
    """Whether k or v provably has q's leading dims (else the splice expands it to them)."""
    if shape is None or q_shape is None or len(shape) != len(q_shape):
        return False
    return all(isinstance(d, int) and d == e for d, e in zip(shape[:-2], q_shape[:-2]))


def _comes_before(node: Node, other: Node) -> bool:
    for current in node.graph.nodes:
        if current is node:
            return True
        if current is other:
            return False
    return False


def _has_submodule(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _erase_dead_code(gm: GraphModule, replaced: set[Node]) -> None:
    """Erase what no longer reaches the output: the replaced attention's logits, softmax and
    masks, export's metadata asserts on them, and its attention dropout (impure to torch, but
    replaced). Other nodes with side effects stay."""
    live = live_nodes(gm, not_roots=replaced)
    for node in reversed(list(gm.graph.nodes)):
        if node in live or node.op in ("placeholder", "output") or node.users:
            continue
        if node in replaced or ops.is_bookkeeping(node) or not node.is_impure():
            gm.graph.erase_node(node)
