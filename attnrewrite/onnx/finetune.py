"""Fine-tuning an ONNX rewrite (stage 2, passes/finetune.py): low-rank adapters on each replaced
site's projections (onnx/projections.py), trained with the replacements' values on the graph
evaluated in torch (onnx/torch_graph.py), then merged into the projections' weights.

The objective: where the model's output is next-token logits ([batch, sequence, vocabulary],
named ``logits``), the KL divergence from the original's next-token distribution at every real
position (the attention mask's); else the outputs' relative squared error. The teacher is the
original model, run on each step's batch: for the KL on the CPU, onnxruntime's run of it
(calibration.OriginalModel, loaded before the rewrite), else the same graph in torch with every
replacement computing the exact attention it replaced (teacher_of). Where the calibration holds
data out (its guard), the rewrite with the fine-tuned values and the one with the calibrated
values are both scored there, and the fine-tuned ones are kept only where they score better.

Merging writes W + B A into each projection's weight in the weight's own dtype; a weight that
any other node reads too (tied embeddings, a shared layer) is first copied for the projection,
so the other reader keeps it as it was. A weight stored quantized (MatMulNBits, a
DequantizeLinear of integers) would round the change away: there the adapter stays beside the
projection, y + (x A^T) (s B^T), two small MatMuls and an Add in the activations' dtype, ops
every replacement's function already holds. Otherwise the graph gains no node.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnrewrite.data import split_batch
from attnrewrite.errors import AttnRewriteError
from attnrewrite.onnx.graph_edit import unique_initializer_name
from attnrewrite.onnx.inputs import with_prefill_inputs
from attnrewrite.onnx.projections import Projection, QuantizedProjection, site_projections
from attnrewrite.onnx.torch_graph import TorchGraph
from attnrewrite.passes import finetune
from attnrewrite.passes.fit import exact_stand_in, fitted_stand_in, snapshot
from attnrewrite.passes.optional_torch import torch

MASK = "attention_mask"
NUMPY_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE)


class Finetuning:
    """Stage 2 of one rewrite: the sites' projections found before anything is fitted (a
    quantized one refuses the whole stage), the training run after stage 1."""

    def __init__(self, sites: list):
        self.sites = sites
        self.adapted, self.skipped = _adapted_projections(sites)
        if not self.adapted:
            raise AttnRewriteError(f"cannot fine-tune: no site has projections to adapt ({self.skipped[0]['reason']})")

    def run(self, whole: TorchGraph, calibration) -> dict:
        """Fine-tune in place on ``whole`` (the graph in torch): the sites' modules' values
        written back, the adapters merged where the guard keeps them. Returns the record's entry."""
        settings, sites = calibration.finetune, self.sites
        projections = [p for ps in self.adapted.values() for p in ps]
        alpha = finetune.ALPHA_PER_RANK * settings.rank
        adapters = {
            p.node: finetune.LowRankAdapter(*p.shape, settings.rank, alpha, seed=i).to(whole.device)
            for i, p in enumerate(projections)
        }
        exact = {s.call: exact_stand_in(s.outcome.site.scale, s.outcome.site.mask.causal) for s in sites}
        fitted = {s.call: fitted_stand_in(s.module) for s in sites}
        objective = objective_of(whole.graph)
        teacher = teacher_of(whole, exact, calibration.original, objective)

        def student(feeds, with_adapters=True):
            return whole.run(feeds, fitted, adapters if with_adapters else None)

        replacement_values = [p for s in sites for p in s.module.parameters() if p.requires_grad]
        calibrated = snapshot(replacement_values)
        result = finetune.finetune(
            student,
            teacher,
            [*replacement_values, *(p for adapter in adapters.values() for p in adapter.parameters())],
            _step_batches(whole.graph, calibration.batches),
            objective,
            steps=settings.steps,
            lr=settings.lr,
            seed=calibration.seed,
            step_done=calibration.finetune_step_done,
        )
        held = calibration.held_out
        held_out = (
            None
            if held is None
            else finetune.judge(
                _step_batches(whole.graph, held.batches),
                held.examples,
                student,
                lambda feeds: student(feeds, with_adapters=False),
                teacher,
                objective,
                replacement_values,
                calibrated,
            )
        )
        undone = result.rejected_loss is not None  # the adapters are back at zero
        if not undone and (held_out is None or held_out["kept"] == "fine-tuned"):
            for projection in projections:
                adapter = adapters[projection.node]
                if isinstance(projection, QuantizedProjection):
                    down, up = (x.detach().cpu().numpy() for x in adapter.factors())
                    add_beside(projection, down, up)
                else:
                    merge(projection, adapter.delta().detach().cpu().numpy())
        for site in sites:
            site.write_fitted()
        return calibration.report_finetune(
            result, objective.kind, held_out, _adapter_entries(self.adapted, self.skipped)
        )


def teacher_of(whole: TorchGraph, exact: dict, original, objective: finetune.Objective):
    """The original's outputs on a batch, as the student gives them: onnxruntime's run of the
    original model (``original``, calibration.OriginalModel) where the student runs on the CPU,
    the original has each of its outputs by name and the objective reads real positions only
    (next-token KL: a padded query's output, which the stand-ins zero, is the original's own
    there); else the graph in torch with every replacement computing exact attention."""
    names = whole.output_names
    dtypes = {v.name: v.dtype for v in whole.graph.outputs}
    if (
        original is None
        or objective.kind != finetune.NEXT_TOKEN_KL
        or whole.device.type != "cpu"
        or not set(names) <= set(original.outputs)
        or any(dtypes[name] not in NUMPY_FLOATS for name in names)  # onnxruntime's bfloat16 is no numpy type
    ):
        return lambda feeds: whole.run(feeds, exact)
    return lambda feeds: [torch.from_numpy(array) for array in original.run(feeds, names)]


def objective_of(graph: ir.Graph) -> finetune.Objective:
    """Next-token KL on a decoder's logits (an output named like ``logits`` of rank 3), else
    the outputs' relative squared error."""
    floats = [v for v in graph.outputs if v.dtype is not None and v.dtype.is_floating_point()]
    for index, value in enumerate(floats):
        if "logits" in value.name.lower() and value.shape is not None and len(value.shape) == 3:
            inputs = {v.name for v in graph.inputs}
            return finetune.Objective(finetune.NEXT_TOKEN_KL, index, MASK if MASK in inputs else None)
    return finetune.Objective(finetune.OUTPUT_ERROR)


def merge(projection: Projection, delta: np.ndarray) -> None:
    """W + delta (delta [in, out], as x W_eff sees it) into the projection's weight, in its
    dtype; a weight another node reads too is copied for this projection first."""
    weight = projection.weight
    stored = weight.const_value.numpy()
    merged = (stored.astype(np.float32) + (delta.T if projection.transposed else delta)).astype(stored.dtype)
    if len(weight.uses()) == 1:
        weight.const_value = ir.tensor(merged, name=weight.name)
        return
    reader = _reader(projection)
    copy = _initializer(reader.graph, f"{projection.node.name}/weight", merged)
    reader.replace_input_with(list(reader.inputs).index(weight), copy)


def add_beside(projection: QuantizedProjection, down: np.ndarray, up: np.ndarray) -> None:
    """The projection's output y becomes y + (x down) up for all that read it (down [in, rank],
    up [rank, out] as x W_eff sees them; a Gemm's alpha scales up too), in x's dtype."""
    node, graph = projection.node, projection.node.graph
    x, y = node.inputs[0], node.outputs[0]
    dtype = x.dtype.numpy() if x.dtype is not None else np.float32
    readers = list(y.uses())
    down = _initializer(graph, f"{node.name}/adapter/down", down.astype(dtype))
    up = _initializer(graph, f"{node.name}/adapter/up", (up * _gemm_alpha(node)).astype(dtype))
    low = ir.Node("", "MatMul", [x, down], name=f"{node.name}/adapter/MatMul_down", num_outputs=1)
    change = ir.Node("", "MatMul", [low.outputs[0], up], name=f"{node.name}/adapter/MatMul_up", num_outputs=1)
    total = ir.Node("", "Add", [y, change.outputs[0]], name=f"{node.name}/adapter/Add", num_outputs=1)
    graph.insert_after(node, [low, change, total])
    for reader, index in readers:
        reader.replace_input_with(index, total.outputs[0])
    if y.is_graph_output():  # the output keeps its name, now on the sum
        position = list(graph.outputs).index(y)
        name, y.name = y.name, f"{y.name}/before_adapter"
        total.outputs[0].name = name
        graph.outputs[position] = total.outputs[0]


def _gemm_alpha(node: ir.Node) -> float:
    attribute = node.attributes.get("alpha")
    return 1.0 if node.op_type != "Gemm" or attribute is None else attribute.value


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    name = unique_initializer_name(graph, name)
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _reader(projection: Projection) -> ir.Node:
    """The node that reads the weight for the projection: the projection, or its Transpose."""
    producer = projection.node.inputs[1].producer()
    return producer if producer is not None and producer.op_type == "Transpose" else projection.node


def _adapted_projections(sites: list) -> tuple[dict, list[dict]]:
    """({site: its projections}, [{site, reason}] for the sites without). A projection shared by
    two sites is adapted once, under the first."""
    adapted, skipped, taken = {}, [], set()
    for site in sites:
        try:
            projections = site_projections(site.call)
        except finetune.Quantized as why:
            raise AttnRewriteError(f"cannot fine-tune: {why}") from None
        except finetune.Unadaptable as why:
            skipped.append({"site": site.outcome.site.name, "reason": str(why)})
            continue
        adapted[site] = [p for p in projections.all if id(p.node) not in taken]
        taken.update(id(p.node) for p in projections.all)
    return adapted, skipped


def _adapter_entries(adapted: dict, skipped: list[dict]) -> dict:
    """Each site's adapted projections, and of them those whose adapter stays beside (quantized)."""
    sites = [
        {
            "site": site.outcome.site.name,
            "projections": [p.node.name for p in projections],
            "beside": [p.node.name for p in projections if isinstance(p, QuantizedProjection)],
        }
        for site, projections in adapted.items()
    ]
    return {"adapted": sites, "not_adapted": skipped}


def _step_batches(graph: ir.Graph, batches: list) -> list:
    """The data as one step takes it (passes.finetune.examples_per_step), completed for a
    prefill from nothing (a recurrent model's zero states)."""
    return [
        with_prefill_inputs(graph, part)
        for feeds in batches
        for part in split_batch(feeds, finetune.examples_per_step(_tokens_per_example(feeds)))
    ]


def _tokens_per_example(feeds: dict) -> int:
    """The sequence length: the longest second axis among the inputs (1 where none has one)."""
    return max((array.shape[1] for array in feeds.values() if array.ndim >= 2), default=1)
