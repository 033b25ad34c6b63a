"""What a kernel method (linear, hedgehog, favor) supplies to the kernel family: its FeatureMap,
phi in torch and in ONNX with its log scales where its unit has them, its feature count and its
constants. The family does the rest: the parallel entry's flatten -> kernel -> reshape
(kernel_attention_function), the recurrent prefill and step (recurrence.py) and, through
passes/window/, the window hybrid.

A method's phi has one torch definition (its module's, which the parallel, windowed and
recurrent forms all call) and one ONNX function, which its parallel entries and the terms
functions here call. What calibration fits is declared once, ``fitted_values``: the method's
torch module is built from them (its learnable parameters, by their state_dict names) and the
ONNX constants are them, so fitted values carry over through ``constants(site, weights)``.
"""

from __future__ import annotations

import abc
import dataclasses
import typing

import numpy as np
import onnx
from onnxscript import OnnxFunction, script

from attnrewrite.passes.kernel.delta import uses_delta
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS
from attnrewrite.passes.kernel.parallel import (
    causal_linear_attention_functions,
    causal_rescaled_linear_attention_functions,
    linear_attention_functions,
)
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    NODE_BUILT,
    built_once,
    standard_opset,
    unique_functions,
    weighted,
    with_callees,
)
from attnrewrite.passes.window.settings import KernelUnit, Window
from attnrewrite.site import AttentionSite


class CausalTerms(typing.NamedTuple):
    """What a method's causal form reads of q, k and keep: features in float32 (phi_k zero on
    padded keys) and, for a rescaled unit, the log scales (padded keys LOWEST) and hedgehog's
    local_max_weight."""

    phi_q: typing.Any
    phi_k: typing.Any
    query_log_scale: typing.Any = None
    key_log_scale: typing.Any = None
    local_max_weight: typing.Any = None


class OnnxTerms(typing.NamedTuple):
    """An ONNX function of the causal terms and the constants it reads after its tensors."""

    function: OnnxFunction
    constants: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FeatureMap(abc.ABC):
    """A kernel method's feature map under its ``options`` (the method's Options).

    ``entry``: the name its recurrent ONNX entry ends in (Recurrent[Windowed]<entry>)."""

    entry: typing.ClassVar[str]
    options: typing.Any

    @property
    def window(self) -> Window | None:
        return Window.of(self.options)

    @property
    @abc.abstractmethod
    def unit(self) -> KernelUnit:
        """How the kernel part is scaled: a rescaled unit carries log scales."""

    @property
    def delta(self) -> bool:
        """Whether the causal state is updated by the delta rule (kernel/delta.py)."""
        return uses_delta(self.options)

    @property
    def state_unit(self) -> KernelUnit:
        """The unit the causal state is kept in: the delta rule's normalised keys carry no log
        scale, so its state is shared whatever the method's unit."""
        return KernelUnit.SHARED if self.delta else self.unit

    @abc.abstractmethod
    def feature_count(self, site: AttentionSite) -> int | str:
        """F, features per token ("F" where unknown at rewrite time)."""

    @abc.abstractmethod
    def torch_terms(self, module, q, k, keep) -> CausalTerms:
        """The causal terms of q, k and keep [..., N', 1] from the parallel ``module``'s values."""

    @abc.abstractmethod
    def onnx_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """The function (q, k, keep, *constants) -> (phi_q, phi_k[, query log scale, key log
        scale]), as torch_terms."""

    @abc.abstractmethod
    def onnx_query_terms(self, site: AttentionSite, opset_version: int) -> OnnxTerms:
        """The function (q, *constants) -> phi_q[, query log scale]: a step's query alone (its
        key's terms are read when the key joins the state)."""

    @abc.abstractmethod
    def fitted_values(self, site: AttentionSite) -> dict[str, np.ndarray]:
        """What calibration fits, before fitting, by the learnable module's state_dict names
        (the module is built from them)."""

    def constants(self, site: AttentionSite, weights: dict | None = None) -> dict:
        """The parallel lowering's constants by name and in order: fitted_values, ``weights``'
        where given (a fitted module's state_dict, by the same names)."""
        return weighted(self.fitted_values(site), weights)


def entry_functions(entry: OnnxFunction, name: str | None = None) -> list[onnx.FunctionProto]:
    """``entry`` and every function it calls as FunctionProtos, callees first, the entry
    named ``name`` where given (a causal site's entry, say, beside its bidirectional twin)."""
    functions = []
    for function in with_callees(entry):  # a shim's node-built callees first (NODE_BUILT: onnx_sparse.py's)
        functions += getattr(function, NODE_BUILT, [])
        functions.append(function.to_function_proto())
    functions = unique_functions(functions)
    if name is not None:
        functions[-1].name = name
    return functions


@built_once
def _shaped_function(opset_version: int):
    """ShapedLikeQueries(out, phi_q, v): a kernel's [G, N, Dv] output as [..., N, Dv] in v's type."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def ShapedLikeQueries(out, phi_q, v):
        out_shape = op.Concat(op.Shape(phi_q, end=-1), op.Shape(v, start=-1), axis=0)
        return op.CastLike(op.Reshape(out, out_shape), v)

    return ShapedLikeQueries


@built_once
def kernel_attention_function(opset_version: int, causal: bool, chunk: int, eps: float = DENOMINATOR_EPS):
    """FeatureMapAttention(phi_q, phi_k, v) (causal: CausalFeatureMapAttention): a parallel
    entry's kernel part, phi_q and phi_k [..., N, F] flattened to [G, N, F] with v, the kernel
    (kernel.parallel), and its output shaped as [..., N, Dv] in v's type."""
    op = standard_opset(opset_version)
    flatten, shaped = flatten_heads_function(opset_version), _shaped_function(opset_version)
    if causal:
        kernel = causal_linear_attention_functions(opset_version, chunk, eps)[-1]

        @script(ATTNREWRITE, default_opset=op)
        def CausalFeatureMapAttention(phi_q, phi_k, v):
            return shaped(kernel(flatten(phi_q), flatten(phi_k), flatten(v)), phi_q, v)

        return CausalFeatureMapAttention
    kernel = linear_attention_functions(opset_version, eps)[-1]

    @script(ATTNREWRITE, default_opset=op)
    def FeatureMapAttention(phi_q, phi_k, v):
        return shaped(kernel(flatten(phi_q), flatten(phi_k), flatten(v)), phi_q, v)

    return FeatureMapAttention


@built_once
def rescaled_kernel_attention_function(opset_version: int, chunk: int, eps: float):
    """CausalRescaledFeatureMapAttention(phi_q, phi_k, key_log_scale, v): as
    kernel_attention_function, each key at its own scale (kernel.state.chunk_kernel_attention)."""
    op = standard_opset(opset_version)
    flatten, shaped = flatten_heads_function(opset_version), _shaped_function(opset_version)
    kernel = causal_rescaled_linear_attention_functions(opset_version, chunk, eps)[-1]

    @script(ATTNREWRITE, default_opset=op)
    def CausalRescaledFeatureMapAttention(phi_q, phi_k, key_log_scale, v):
        out = kernel(flatten(phi_q), flatten(phi_k), flatten(key_log_scale), flatten(v))
        return shaped(out, phi_q, v)

    return CausalRescaledFeatureMapAttention
