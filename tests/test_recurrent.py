"""The recurrent forms of causal kernel attention (attnrewrite/passes/recurrent.py): prefill P tokens
then decode token by token (or in uneven pieces), and every step's outputs equal the parallel causal
module's on the whole sequence, for linear, hedgehog and favor, with and without a window (and
sinks), with left padding in a batch, in torch and as the ONNX lowering on onnxruntime; parameters
shared with the parallel module (fitted-looking values); a state whose size does not grow with
the context; padded keys never in a state; no CumSum; the methods that have no recurrence say why.
Also the causal window's blocks, aligned to the sequence's start so that appending a token changes
no earlier output (what makes the recurrence possible)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from models import relative_error
from onnx import TensorProto, helper, numpy_helper

from attnrewrite import passes
from attnrewrite.onnx.validate import runs_linear_attention
from attnrewrite.passes import favor, hedgehog, hydra, linear, linformer, lsh, recurrent
from attnrewrite.passes.kernel.chunks import PREFIX_GROUP
from attnrewrite.passes.lowering import nodes_with_branches
from attnrewrite.passes.window.reference import windowed_attention_weights
from attnrewrite.passes.window.settings import Window
from attnrewrite.site import AttentionSite, KvCache, MaskKind

B, H, D, DV = 2, 3, 8, 5
OPSET = 20
LENGTH = 15
SCHEDULES = {
    "prefill-then-tokens": [9, 1, 1, 1, 1, 1, 1],
    "uneven-pieces": [1, 2, 1, 5, 2, 4],  # a first call of one token: a step from the zero state
    "token-by-token": [1] * LENGTH,  # every position a step: each block boundary, each sink's turn
}
# chunk 4 < every prefill here; a window of 4 with and without a sink
CONFIGS = {
    "no-window": {"chunk": 4},
    "window4": {"chunk": 4, "window": 4, "sinks": 0},
    "window4-sink1": {"chunk": 4, "window": 4, "sinks": 1},
}
METHODS = {m.NAME: m for m in (linear, hedgehog, favor)}
LEFT_PADDING = 4  # positions padded at the front of the second batch row


def make_site(rank: int = 4) -> AttentionSite:
    heads = H if rank == 4 else None
    mask = MaskKind.CAUSAL_KEY_PADDING
    return AttentionSite("layer0", scale=D**-0.5, mask=mask, rank=rank, num_heads=heads, head_dim=D, value_dim=DV)


def method_options(method, config: str):
    extra = {"features": 16} if method is favor else {}  # few features: the approximation is real
    return passes.make_options(method, **CONFIGS[config], **extra)


def recurrent_form(site, options):
    """The method's recurrent form at ``site`` (passes.recurrent.form_for)."""
    return recurrent.form_for(passes.get_pass(options.method_name), site, options)


def fitted_parallel(method, site, options, seed: int = 0):
    """The pass's causal module with every value moved off its initial one, as fitting would:
    linear's query/key maps, hedgehog's W and b, favor's projection, the windows' values."""
    module = method.torch_module(site, options, learnable=method is not favor)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in [*module.parameters(), *module.buffers()]:
            value.add_(torch.randn(value.shape, generator=generator) * 0.3)
    return module.eval()


def state_dict(module) -> dict[str, np.ndarray]:
    """A module's values as the lowerings take them (``weights``)."""
    return {name: value.numpy() for name, value in module.state_dict().items()}


def sequence(padding: bool, length: int = LENGTH, seed: int = 1, lead=(B, H)):
    """q, k, v [*lead, length, *] (std 2: the stabilisers matter) and key_keep [B, 1, length, 1]
    (None without padding)."""
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*lead, length, D, generator=generator) * 2 for _ in range(2))
    v = torch.randn(*lead, length, DV, generator=generator)
    if not padding:
        return q, k, v, None
    keep = torch.ones(lead[0], *([1] * (len(lead) - 1)), length, 1)
    keep[1:, ..., :LEFT_PADDING, :] = 0.0
    return q, k, v, keep


def pieces(schedule: list[int]):
    start = 0
    for n in schedule:
        yield slice(start, start + n)
        start += n


def rows(x, piece):
    return None if x is None else x[..., piece, :]


# --- torch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
def test_torch_steps_equal_the_parallel_form(method, config, padding, schedule):
    method = METHODS[method]
    site, options = make_site(), method_options(method, config)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(padding)
    with torch.no_grad():
        expected = parallel(q, k, v, keep)
        module = recurrent_form(site, options).torch_module(site, parallel)
        state = module.initial_state(q, v)
        for piece in pieces(SCHEDULES[schedule]):
            out, *state = module(rows(q, piece), rows(k, piece), rows(v, piece), rows(keep, piece), *state)
            assert relative_error(out.numpy(), expected[..., piece, :].numpy()) < 1e-5, piece


def test_heads_folded_into_the_batch():
    """A [batch * heads, N, d] site: the state's leading axis is G, key_keep [G, N, 1]."""
    site, options = make_site(rank=3), method_options(linear, "window4-sink1")
    parallel = fitted_parallel(linear, site, options)
    q, k, v, keep = sequence(True, lead=(B * H,))
    module = recurrent_form(site, options).torch_module(site, parallel)
    with torch.no_grad():
        expected = parallel(q, k, v, keep)
        state = module.initial_state(q, v)
        for piece in pieces(SCHEDULES["uneven-pieces"]):
            out, *state = module(rows(q, piece), rows(k, piece), rows(v, piece), rows(keep, piece), *state)
            assert relative_error(out.numpy(), expected[..., piece, :].numpy()) < 1e-5, piece
    kernel_state = recurrent_form(site, options).state(site)[0]
    assert kernel_state.shape == ("G", D, "Dv+1")  # the normaliser is the last column


def test_parameters_are_the_parallel_modules():
    """The recurrent module reads the parallel module's values, not copies: changing them
    afterwards changes both alike."""
    site, options = make_site(), method_options(hedgehog, "window4-sink1")
    parallel = fitted_parallel(hedgehog, site, options)
    module = recurrent_form(site, options).torch_module(site, parallel)
    assert {id(p) for p in module.parameters()} == {id(p) for p in parallel.parameters()}
    with torch.no_grad():
        parallel.weight.mul_(1.5)
        parallel.local_max_weight.add_(0.25)
        q, k, v, keep = sequence(True)
        out, *_ = module(q, k, v, keep, *module.initial_state(q, v))
        assert relative_error(out.numpy(), parallel(q, k, v, keep).numpy()) < 1e-5


@pytest.mark.parametrize("config", CONFIGS)
def test_padded_keys_never_enter_the_state(config):
    """Whatever the padded positions hold, the outputs and the state after them are the same."""
    site, options = make_site(), method_options(favor, config)
    module = recurrent_form(site, options).torch_module(site, fitted_parallel(favor, site, options))
    q, k, v, keep = sequence(True)
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[1, :, :LEFT_PADDING] = 1e3
    junk_v[1, :, :LEFT_PADDING] = -7.0
    with torch.no_grad():
        first = module(q, k, v, keep, *module.initial_state(q, v))
        second = module(q, junk_k, junk_v, keep, *module.initial_state(q, v))
    kept = recurrent_form(site, options).state(site)
    for tensor, a, b in zip(["out", *(t.name for t in kept)], first, second):
        if tensor.startswith(("window_keys", "window_values", "sink_keys", "sink_values")):
            continue  # the rolling caches hold padded rows as they came, with keep flag 0
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=tensor)


# --- the state -----------------------------------------------------------------------------------


def test_state_description_of_a_windowed_hedgehog():
    site, options = make_site(), passes.make_options(hedgehog, window=4, sinks=1)
    described = [(t.name, t.shape, t.dtype) for t in recurrent_form(site, options).state(site)]
    assert described == [
        ("kernel_state", ("B", "H", 2 * D, "Dv+1"), "float32"),
        ("log_scale", ("B", "H"), "float32"),
        ("window_keys", ("B", "H", 7, "D"), "model"),
        ("window_values", ("B", "H", 7, "Dv"), "model"),
        ("window_keep", ("B", "H", 7, 1), "float32"),
        ("sink_keys", ("B", "H", 1, "D"), "model"),
        ("sink_values", ("B", "H", 1, "Dv"), "model"),
        ("sink_keep", ("B", "H", 1, 1), "float32"),
        ("position", (), "int64"),
    ]
    plain = [t.name for t in recurrent_form(site, passes.make_options(linear)).state(site)]
    assert plain == ["kernel_state"]
    assert [t.shape for t in recurrent_form(site, passes.make_options(favor, variant="hyperbolic")).state(site)] == [
        ("B", "H", 2 * favor.default_features(D), "Dv+1"),
        ("B", "H"),
    ]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
def test_state_size_does_not_grow_with_the_context(method, config):
    """After 3 tokens or 40, in torch and ONNX, every state tensor has the described shape."""
    method = METHODS[method]
    site, options = make_site(), method_options(method, config)
    module = recurrent_form(site, options).torch_module(site, fitted_parallel(method, site, options))
    described = [recurrent.state_shape(t, axis_sizes(site, options)) for t in module.description]
    session = recurrent_session(method.NAME, config)
    for length in (3, 40):
        q, k, v, keep = sequence(True, length)
        with torch.no_grad():
            _, *state = module(q, k, v, keep, *module.initial_state(q, v))
        assert [tuple(s.shape) for s in state] == described
        ((_, *onnx_state),) = run_onnx_steps(session, site, options, [length], (q, k, v, keep))
        assert [a.shape for a in onnx_state] == described
    if options.window:
        assert int(state[-1]) == 40  # the position counter


# --- ONNX ----------------------------------------------------------------------------------------


def recurrent_model(lowering, description, rank: int = 4) -> onnx.ModelProto:
    """One recurrent node reading q, k, v, key_keep (rank ``rank``) and the state, writing out and
    the state after; the lowering's constants as initializers."""
    state = [t.name for t in description]
    node = helper.make_node(
        lowering.op_type,
        ["q", "k", "v", "key_keep", *state, *lowering.constants],
        ["out", *(f"{name}_out" for name in state)],
        domain="attnrewrite",
    )

    def value(name, dtype=TensorProto.FLOAT, rank=rank):
        return helper.make_tensor_value_info(name, dtype, [f"{name}{i}" for i in range(rank)])

    def state_value(tensor, suffix=""):
        dtype = TensorProto.INT64 if tensor.dtype == "int64" else TensorProto.FLOAT
        return value(tensor.name + suffix, dtype, len(tensor.shape))

    graph = helper.make_graph(
        [node],
        "recurrent",
        [value("q"), value("k"), value("v"), value("key_keep"), *map(state_value, description)],
        [value("out"), *(state_value(t, "_out") for t in description)],
        initializer=[numpy_helper.from_array(array, name) for name, array in lowering.constants.items()],
    )
    imported = {o.domain: o.version for f in lowering.functions for o in f.opset_import}  # com.microsoft too
    model = helper.make_model(
        graph,
        functions=lowering.functions,
        ir_version=10,
        opset_imports=[helper.make_opsetid(*d) for d in {**imported, "": OPSET, "attnrewrite": 1}.items()],
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def session_for(site, options, weights, contrib_ops: bool = False) -> ort.InferenceSession:
    lowering = recurrent_form(site, options).onnx_lowering(site, OPSET, weights, contrib_ops=contrib_ops)
    model = recurrent_model(lowering, recurrent_form(site, options).state(site))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@functools.cache
def recurrent_session(method: str, config: str, contrib_ops: bool = False) -> ort.InferenceSession:
    """The recurrent lowering of fitted_parallel(method, config)'s values."""
    site, options = make_site(), method_options(METHODS[method], config)
    weights = state_dict(fitted_parallel(METHODS[method], site, options))
    return session_for(site, options, weights, contrib_ops)


def axis_sizes(site, options) -> dict[str, int]:
    heads = site.num_heads or H
    kv_heads = site.kv_cache.kv_heads if site.kv_cache is not None else heads
    sizes = {"B": B, "H": heads, "Hkv": kv_heads, "G": B * heads, "D": D, "Dv": DV}
    return {**sizes, "F": recurrent_form(site, options).feature_map.feature_count(site)}


def run_onnx_steps(session, site, options, schedule: list[int], inputs) -> list[list[np.ndarray]]:
    """(out, *state) after each piece of ``schedule``, from the zero state; ``inputs``: q, k, v,
    key_keep (None: every key kept)."""
    q, k, v, keep = inputs
    keep = torch.ones(*k.shape[:-1], 1) if keep is None else keep
    description = recurrent_form(site, options).state(site)
    state, results = recurrent.zero_state(description, axis_sizes(site, options)), []
    for piece in pieces(schedule):
        piece_inputs = zip(["q", "k", "v", "key_keep"], (x[..., piece, :].numpy() for x in (q, k, v, keep)))
        out, *state = session.run(None, {**dict(piece_inputs), **{t.name: a for t, a in zip(description, state)}})
        results.append([out, *state])
    return results


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_equal_the_parallel_form(method, config, padding, schedule):
    assert_steps_equal_the_parallel_form(method, config, padding, schedule, contrib_ops=False)


@pytest.mark.skipif(not runs_linear_attention(), reason="this onnxruntime has no com.microsoft.LinearAttention")
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_through_linear_attention_equal_the_parallel_form(method, padding):
    """With onnxruntime's contrib operator a step updates and reads the kernel state in one
    LinearAttention node, its heads packed in a row as the operator takes them ([B, 1, H F], the
    state [B, H, F, Dv + 1] as it lies); the outputs are the standard operators'."""
    site, options = make_site(), method_options(METHODS[method], "no-window")
    lowering = recurrent_form(site, options).onnx_lowering(site, OPSET, contrib_ops=True)
    (node,) = [n for n in lowering_nodes(lowering) if (n.domain, n.op_type) == ("com.microsoft", "LinearAttention")]
    heads = {a.name: a.i for a in node.attribute if a.name.endswith("num_heads")}
    assert heads == {"q_num_heads": H, "kv_num_heads": H}
    assert_steps_equal_the_parallel_form(method, "no-window", padding, "prefill-then-tokens", contrib_ops=True)


@pytest.mark.skipif(not runs_linear_attention(), reason="this onnxruntime has no com.microsoft.LinearAttention")
@pytest.mark.parametrize("method", [hedgehog, linear], ids=["hedgehog", "linear"])
def test_linear_attention_steps_with_heads_folded_into_the_batch(method):
    """A [batch * heads, N, d] site: each head of each batch row is a row of the operator's own."""
    assert_folded_steps_equal_the_parallel_form(method, "no-window", "prefill-then-tokens", contrib_ops=True)


def assert_steps_equal_the_parallel_form(method, config, padding, schedule, contrib_ops):
    site, options = make_site(), method_options(METHODS[method], config)
    q, k, v, keep = sequence(padding)
    with torch.no_grad():
        expected = fitted_parallel(METHODS[method], site, options)(q, k, v, keep).numpy()
    session = recurrent_session(method, config, contrib_ops)
    steps = run_onnx_steps(session, site, options, SCHEDULES[schedule], (q, k, v, keep))
    for piece, (out, *_) in zip(pieces(SCHEDULES[schedule]), steps):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece


@pytest.mark.parametrize("method", METHODS)
def test_onnx_steps_with_heads_folded_into_the_batch(method):
    """A [batch * heads, N, d] site (OPT's bmm attention, nn.MultiheadAttention), windowed with a
    sink, left-padded: its ONNX steps, the one-token branch included, equal the parallel form."""
    assert_folded_steps_equal_the_parallel_form(METHODS[method], "window4-sink1", "token-by-token", contrib_ops=False)


def assert_folded_steps_equal_the_parallel_form(method, config, schedule, contrib_ops):
    site, options = make_site(rank=3), method_options(method, config)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(True, lead=(B * H,))
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    form = recurrent_form(site, options)
    lowering = form.onnx_lowering(site, OPSET, state_dict(parallel), contrib_ops=contrib_ops)
    assert contrib_ops == ("LinearAttention" in {n.op_type for n in lowering_nodes(lowering)})
    model = recurrent_model(lowering, form.state(site), rank=3)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    schedule = SCHEDULES[schedule]
    for piece, (out, *_) in zip(pieces(schedule), run_onnx_steps(session, site, options, schedule, (q, k, v, keep))):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece


def grouped_site(kv_heads: int) -> AttentionSite:
    """A KV-cache site of 6 query heads over ``kv_heads`` key/value heads (grouped-query
    attention, or multi-query with one)."""
    cache = KvCache("past.k", "past.v", None, None, kv_heads=kv_heads)
    return dataclasses.replace(make_site(), num_heads=6, kv_cache=cache)


@pytest.mark.parametrize("schedule", ["prefill-then-tokens", "token-by-token"])
@pytest.mark.parametrize("method", [hedgehog, linear], ids=["hedgehog", "linear-with-maps"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["grouped", "multi-query"])
def test_grouped_heads_keep_each_key_once(kv_heads, method, schedule):
    """At a grouped-query site a window's module and lowering take k and v with their key/value
    heads and keep them once ([B, Hkv, ...], sinks too); stepped in torch and in ONNX (a step
    attends each group's queries over their head's keys as kept; learned key maps are per query
    head), left-padded, the outputs are the parallel form's on the keys and values repeated for
    the query heads."""
    site, options = grouped_site(kv_heads), method_options(method, "window4-sink1")
    parallel = fitted_parallel(method, site, options)
    groups = 6 // kv_heads
    q, _, _, keep = sequence(True, lead=(B, 6))
    _, k, v, _ = sequence(True, lead=(B, kv_heads), seed=2)
    form = recurrent_form(site, options)
    shapes = {t.name: recurrent.state_shape(t, axis_sizes(site, options)) for t in form.state(site)}
    assert shapes["window_keys"] == (B, kv_heads, 7, D) and shapes["sink_values"] == (B, kv_heads, 1, DV)
    assert shapes["kernel_state"][:2] == (B, 6)  # the features of keys are per query head
    with torch.no_grad():
        # query head h reads key/value head h // groups
        expected = parallel(q, *(x.repeat_interleave(groups, dim=1) for x in (k, v)), keep).numpy()
        module = form.torch_module(site, parallel)
        state = module.initial_state(q, v)
        for piece in pieces(SCHEDULES[schedule]):
            out, *state = module(rows(q, piece), rows(k, piece), rows(v, piece), rows(keep, piece), *state)
            assert relative_error(out.numpy(), expected[..., piece, :]) < 1e-5, piece
    assert [tuple(x.shape) for x in state] == list(shapes.values())
    lowering = form.onnx_lowering(site, OPSET, state_dict(parallel))
    assert lowering.key_value_groups == groups
    session = ort.InferenceSession(
        recurrent_model(lowering, form.state(site)).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    steps = run_onnx_steps(session, site, options, SCHEDULES[schedule], (q, k, v, keep))
    for piece, (out, *_) in zip(pieces(SCHEDULES[schedule]), steps):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece
    for (name, shape), value in zip(shapes.items(), steps[-1][1:]):
        assert value.shape == shape, name


def lowering_nodes(lowering):
    """Every node of the lowering's functions, those of If branches included."""
    return [node for function in lowering.functions for node in nodes_with_branches(function.node)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
def test_one_token_runs_the_step_branch(method, config):
    """The entry chooses by the number of new tokens: one takes the step branch, which runs
    nothing of the chunked form (its entries, triangles, prefix sums), the others that form."""
    site, options = make_site(), method_options(METHODS[method], config)
    entry = recurrent_form(site, options).onnx_lowering(site, OPSET).functions[-1]
    (choice,) = [node for node in entry.node if node.op_type == "If"]
    branches = {a.name: a.g for a in choice.attribute}
    chunked = {
        "CausalKernelAttentionFromState",
        "CausalRescaledKernelAttentionFromState",
        "RecurrentWindowedKernelAttention",
        "Trilu",
        "CumSum",
    }

    def runs(graph):
        return {node.op_type for node in nodes_with_branches(graph.node)}

    assert runs(branches["then_branch"]).isdisjoint(chunked)
    assert runs(branches["else_branch"]) & chunked


@pytest.mark.parametrize(
    ("method", "options"),
    [
        (linear, {"chunk": 2}),
        (favor, {"chunk": 2, "features": 16}),
        (linear, {"window": 2, "sinks": 1}),
        (hedgehog, {"window": 2, "sinks": 0}),
    ],
    ids=["linear", "favor", "linear-window", "hedgehog-window"],
)
def test_onnx_long_prefill(method, options):
    """A prefill of 70 tokens in blocks of 2: more blocks than one group of the prefix sums'
    first level (PREFIX_GROUP), so both levels are used; then two tokens."""
    site, options = make_site(), passes.make_options(method, **options)
    parallel = fitted_parallel(method, site, options)
    q, k, v, keep = sequence(True, length=72)
    assert 70 // 2 > PREFIX_GROUP
    with torch.no_grad():
        expected = parallel(q, k, v, keep).numpy()
    steps = run_onnx_steps(session_for(site, options, state_dict(parallel)), site, options, [70, 1, 1], (q, k, v, keep))
    for piece, (out, *_) in zip(pieces([70, 1, 1]), steps):
        assert relative_error(out, expected[..., piece, :]) < 1e-5, piece


ENTRY_NAMES = {"linear": "LinearAttention", "hedgehog": "Hedgehog", "favor": "Favor"}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", METHODS)
def test_no_cumsum_in_the_recurrent_lowerings(method, config):
    """onnxruntime's CUDA CumSum is quadratic in its axis (kernel/chunks.py)."""
    site, options = make_site(), method_options(METHODS[method], config)
    lowering = recurrent_form(site, options).onnx_lowering(site, OPSET)
    assert "CumSum" not in {node.op_type for function in lowering.functions for node in function.node}
    windowed = "Windowed" if options.window else ""
    assert lowering.op_type == f"Recurrent{windowed}{ENTRY_NAMES[method]}"


def test_fitted_query_key_maps_select_the_learned_entry():
    site, options = make_site(), method_options(linear, "window4")
    weights = state_dict(fitted_parallel(linear, site, options))
    lowering = recurrent_form(site, options).onnx_lowering(site, OPSET, weights)
    assert lowering.op_type == "LearnedRecurrentWindowedLinearAttention"
    assert list(lowering.constants) == ["linear_log_weight", "query_map", "key_map"]
    np.testing.assert_array_equal(lowering.constants["query_map"], weights["query_map"])


# --- refusals ------------------------------------------------------------------------------------


def test_methods_without_a_recurrence_say_why():
    assert recurrent.recurrent_refusal(hydra, hydra.Options()) == (
        "Hydra's causal form is a recurrence too (its state would be sum k_hat * v, [B, H, D]), "
        "but it has no recurrent lowering yet"
    )
    assert recurrent.recurrent_refusal(linformer, linformer.Options()) == (
        "Linformer projects the keys along the sequence axis, mixing every position into each "
        "projected key, so it has no causal form to carry as a state"
    )
    assert recurrent.recurrent_refusal(lsh, lsh.Options()) == (
        "LSH attends exactly among the keys that share a query's hash bucket, and any past key "
        "may share a future query's: it must keep every key, a cache that grows with the context"
    )
    for method in METHODS.values():
        assert recurrent.recurrent_refusal(method, passes.make_options(method, window=4)) is None
    with pytest.raises(ValueError, match="^no recurrent form for lsh at layer0: LSH attends exactly"):
        recurrent_form(make_site(), lsh.Options()).onnx_lowering(make_site(), OPSET)


def test_a_bidirectional_site_has_no_recurrence():
    site = AttentionSite("layer3", scale=0.5, mask=MaskKind.KEY_PADDING, rank=4, num_heads=H, head_dim=D)
    options = passes.make_options(linear)
    with pytest.raises(ValueError) as error:
        recurrent_form(site, options).torch_module(site, linear.torch_module(site, options))
    assert str(error.value) == (
        "no recurrent form for linear at layer3: only a causal attention is a recurrence: "
        "a bidirectional one reads keys not yet generated"
    )


# --- the causal window's blocks (passes/window/) ---------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_causal_window_outputs_do_not_depend_on_later_tokens(method):
    """Blocks aligned to the sequence's start: the outputs of the first 10 positions are the
    same whether 10, 11 or 13 positions follow (torch and the parallel ONNX lowering)."""
    method = METHODS[method]
    site, options = make_site(), method_options(method, "window4-sink1")
    parallel = fitted_parallel(method, site, options)
    session = lowering_session(method.onnx_lowering(site, options, OPSET, state_dict(parallel)), rank=4)
    inputs = sequence(True, length=13)
    with torch.no_grad():
        first = parallel(*(x[..., :10, :] for x in inputs)).numpy()
        for n in (11, 13):
            prefix = [x[..., :n, :] for x in inputs]
            assert relative_error(parallel(*prefix)[..., :10, :].numpy(), first) < 1e-6, n
            onnx_out = session.run(None, dict(zip(["q", "k", "v", "key_keep"], (x.numpy() for x in prefix))))[0]
            assert relative_error(onnx_out[..., :10, :], first) < 1e-5, n


def test_causal_window_exact_keys_are_blocks_from_the_start():
    """N = 7 in windows of 3, causal: blocks {0, 1, 2}, {3, 4, 5}, {6}; each query's exact keys
    are its previous and own block up to itself (a zero kernel part leaves softmax over them)."""
    q, k = (torch.randn(1, 1, 7, 4, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    zero = torch.zeros(1, 1, 7, 2)
    weights = windowed_attention_weights(zero, zero, q, k, Window(3, following=False, sinks=0), scale=0.5, causal=True)
    expected = np.array(
        [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
        + [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
        + [[0, 0, 0, 1, 1, 1, 1]],
        bool,
    )
    np.testing.assert_array_equal(weights[0, 0].numpy() > 0, expected)
