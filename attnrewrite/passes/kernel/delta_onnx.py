"""The delta rule's ONNX forms (kernel/delta.py is the math and its torch forms), standard ops
only: NormalisedKeys, UnitLowerInverse (block doubling), DeltaRuleFromState (the chunked WY
form continued from a state, its chunks one Scan iteration each), CausalDeltaRuleAttention (from
a zero state) and a kernel method's parallel entry, CausalDeltaRule<entry>. The recurrent entry
(recurrent_onnx.py) calls DeltaRuleFromState for a prefill, or onnxruntime's
com.microsoft.LinearAttention with update_rule "delta" where it may use contrib operators.

The bodies whose node count depends on the chunk (the doubling's levels) or that hold a Scan
body are written node by node (lowering.FunctionNodes); the chunk layout is chunks.py's."""

from __future__ import annotations

import math

import onnx
from onnxscript import script

from attnrewrite.passes.kernel.chunks import chunk_rows_functions
from attnrewrite.passes.kernel.delta import KEY_NORM_FLOOR
from attnrewrite.passes.kernel.feature_map import FeatureMap
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS
from attnrewrite.passes.kernel.query_key_maps import with_learned_entry
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    FLOAT,
    FunctionNodes,
    OnnxLowering,
    built_once,
    make_function,
    standard_opset,
    unique_functions,
    with_callees,
)
from attnrewrite.site import AttentionSite


@built_once
def normalised_keys_function(opset_version: int):
    """NormalisedKeys(phi_k): each key over its L2 norm (at least KEY_NORM_FLOOR), as
    delta.normalised_keys."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def NormalisedKeys(phi_k):
        norm = op.Sqrt(op.ReduceSumSquare(phi_k, op.Constant(value_ints=[-1]), keepdims=1))
        return phi_k / op.Max(norm, op.Constant(value_float=KEY_NORM_FLOOR))

    return NormalisedKeys


@built_once
def unit_lower_inverse_function(opset_version: int, chunk: int) -> onnx.FunctionProto:
    """UnitLowerInverse(a): (I + a)^-1 of strictly lower a [..., c, c], c <= ``chunk``, by
    block doubling (delta.unit_lower_inverse): ceil(log2(chunk)) levels, each two products."""
    b = FunctionNodes()
    c = b("Shape", "a", start=-1)
    index = b("Range", b("Constant", value_int=0), b("Squeeze", c, b.ints(0)), b("Constant", value_int=1))
    rows = b("Unsqueeze", index, b.ints(-1))
    inverse = b("Cast", b("Equal", rows, index), to=FLOAT)
    for level in range(math.ceil(math.log2(chunk)) if chunk > 1 else 0):
        size, pair_size = b.ints(2**level), b.ints(2 ** (level + 1))
        same_pair = b("Equal", b("Div", rows, pair_size), b("Div", index, pair_size))
        other_block = b("Not", b("Equal", b("Div", rows, size), b("Div", index, size)))
        lower = b("Mul", "a", b("Cast", b("And", same_pair, other_block), to=FLOAT))
        inverse = b("Sub", inverse, b("MatMul", b("MatMul", inverse, lower), inverse))
    b.output("inverse", inverse)
    return make_function("UnitLowerInverse", ["a"], ["inverse"], b.nodes, opset_version)


def _chunk_body() -> onnx.GraphProto:
    """A Scan iteration: one chunk from the state s -> (the state after, the chunk's reads)."""
    b = FunctionNodes("chunk_")
    s, q, kt, w, u, scores = names = [f"chunk_{x}" for x in ("s", "q", "kt", "w", "u", "scores")]
    corrections = b("Sub", u, b("MatMul", w, s))
    read = b("Add", b("MatMul", q, s), b("MatMul", scores, corrections))
    b.output("s_next", b("Add", s, b("MatMul", kt, corrections)))
    b.output("read", read)
    graph = b.graph("chunk", ["s_next", "read"])
    # every value [G, rows, columns]: onnxruntime wants a Scan body's output shapes set, if unknown
    graph.input.extend(onnx.helper.make_tensor_value_info(name, FLOAT, [None] * 3) for name in names)
    for output in graph.output:
        output.type.CopyFrom(onnx.helper.make_tensor_type_proto(FLOAT, [None] * 3))
    return graph


@built_once
def delta_rule_from_state_functions(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS) -> list:
    """[callees..., DeltaRuleFromState(phi_q, phi_k, v, kv_state, key_sum) -> (out, kv_state,
    key_sum)] as FunctionProtos: delta.chunk_delta_attention on [G, N, *] rows and a [G, F, Dv],
    [G, F] state, the signature of state.CausalKernelAttentionFromState."""
    chunk_size, chunked_rows, unchunked_rows = chunk_rows_functions(opset_version)
    keys_fn, inverse_fn = normalised_keys_function(opset_version), unit_lower_inverse_function(opset_version, chunk)
    b = FunctionNodes()
    zero = b("Constant", value_float=0.0)
    vo = b("Pad", b("Cast", "v", to=FLOAT), b.ints(0, 0, 0, 0, 0, 1), b("Constant", value_float=1.0))
    c = b.call(chunk_size, "v", b.ints(chunk))
    q4, k4, vo4 = (b.call(chunked_rows, x, c, zero) for x in ("phi_q", b.call(keys_fn, "phi_k"), vo))
    k4t = b("Transpose", k4, perm=[0, 1, 3, 2])
    below = b("Constant", value=onnx.helper.make_tensor("below", onnx.TensorProto.INT64, [], [-1]))
    t = b(inverse_fn.name, b("Trilu", b("MatMul", k4, k4t), below, upper=0), domain=inverse_fn.domain)
    scores = b("Trilu", b("MatMul", q4, k4t), upper=0)
    state = b("Concat", "kv_state", b("Unsqueeze", "key_sum", b.ints(-1)), axis=-1)
    scanned = [q4, k4t, b("MatMul", t, k4), b("MatMul", t, vo4), scores]
    final, reads = b(
        "Scan",
        state,
        *scanned,
        outputs=2,
        body=_chunk_body(),
        num_scan_inputs=len(scanned),
        scan_input_axes=[1] * len(scanned),
        scan_output_axes=[1],
    )
    read = b.call(unchunked_rows, reads, "v")
    numerator = b("Slice", read, b.ints(0), b.ints(-1), b.ints(-1))
    denominator = b("Slice", read, b.ints(-1), b("Shape", read, start=-1), b.ints(-1))
    b.output("out", b("Div", numerator, b("Add", denominator, b("Constant", value_float=eps))))
    b.output("kv", b("Slice", final, b.ints(0), b.ints(-1), b.ints(-1)))
    b.output("normaliser", b("Gather", final, b("Constant", value_int=-1), axis=-1))
    inputs, outputs = ["phi_q", "phi_k", "v", "kv_state", "key_sum"], ["out", "kv", "normaliser"]
    entry = make_function("DeltaRuleFromState", inputs, outputs, b.nodes, opset_version)
    scripted = with_callees(chunk_size, chunked_rows, unchunked_rows, keys_fn)
    return [*(f.to_function_proto() for f in scripted), inverse_fn, entry]


@built_once
def causal_delta_rule_attention_functions(opset_version: int, chunk: int) -> list:
    """[callees..., CausalDeltaRuleAttention(phi_q, phi_k, v) -> out]: phi_q, phi_k [..., N, F]
    and v flattened, DeltaRuleFromState from a zero state, the output [..., N, Dv] in v's type."""
    flatten = flatten_heads_function(opset_version)
    from_state = delta_rule_from_state_functions(opset_version, chunk)
    b = FunctionNodes()
    q, k, v = (b.call(flatten, x) for x in ("phi_q", "phi_k", "v"))
    rows, features, columns = b("Shape", q, end=1), b("Shape", k, start=-1), b("Shape", v, start=-1)
    zero = onnx.helper.make_tensor("zero", FLOAT, [1], [0.0])
    kv = b("ConstantOfShape", b("Concat", rows, features, columns, axis=0), value=zero)
    key_sum = b("ConstantOfShape", b("Concat", rows, features, axis=0), value=zero)
    out = b(from_state[-1].name, q, k, v, kv, key_sum, outputs=3, domain=from_state[-1].domain)[0]
    shape = b("Concat", b("Shape", "phi_q", end=-1), columns, axis=0)
    b.output("out", b("CastLike", b("Reshape", out, shape), "v"))
    entry = make_function("CausalDeltaRuleAttention", ["phi_q", "phi_k", "v"], ["out"], b.nodes, opset_version)
    return [flatten.to_function_proto(), *from_state, entry]


def delta_rule_lowering(
    feature_map: FeatureMap, site: AttentionSite, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """A kernel method's parallel causal lowering under ``update=delta``:
    CausalDeltaRule<entry>(q, k, v, key_keep, *constants) calls the method's causal terms
    (padded keys' features zero; any log scales unread) and CausalDeltaRuleAttention; fitted
    query/key maps (``weights``) wrap it as elsewhere (query_key_maps.with_learned_entry)."""
    terms = feature_map.onnx_terms(site, opset_version)
    kernel = causal_delta_rule_attention_functions(opset_version, feature_map.options.chunk)
    constants = list(feature_map.fitted_values(site))
    terms_proto = terms.function.to_function_proto()
    b = FunctionNodes()
    keep = b("Cast", "key_keep", to=FLOAT)
    found = b.call(terms.function, "q", "k", keep, *terms.constants, outputs=len(terms_proto.output))
    b.output("out", b(kernel[-1].name, found[0], found[1], "v", domain=kernel[-1].domain))
    inputs = ["q", "k", "v", "key_keep", *constants]
    entry = make_function(f"CausalDeltaRule{feature_map.entry}", inputs, ["out"], b.nodes, opset_version)
    scripted = [f.to_function_proto() for f in with_callees(terms.function)]
    functions = with_learned_entry([*unique_functions([*scripted, *kernel]), entry], weights, opset_version)
    return OnnxLowering(functions, feature_map.constants(site, weights))
