"""LSH attention: ONNX lowering == torch reference == the definition; exactness, masks, fidelity,
and a sequence whose N x N attention matrix would not fit in memory."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from attention_graphs import lowering_session
from conftest import read_record
from models import SAMPLE_BERT, exact_attention, run_pass_module, text_args, text_feed
from models import relative_error as rel_err

import attnrewrite
from attnrewrite.passes import OptionError, get_pass, lsh, make_options
from attnrewrite.site import AttentionSite, MaskKind

SCALE = 0.3
D, DV = 8, 6


def inputs(n: int, lead=(2, 3), nq=None, pad=True, seed=0):
    rng = np.random.default_rng(seed)
    nq = n if nq is None else nq
    q = rng.standard_normal((*lead, nq, D)).astype(np.float32)
    k = rng.standard_normal((*lead, n, D)).astype(np.float32)
    v = rng.standard_normal((*lead, n, DV)).astype(np.float32)
    keep = np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    if pad:  # right padding of a different length per batch row, never every key
        for b in range(lead[0]):
            keep[b, ..., max(1, n - 1 - 3 * b) :, :] = 0.0
    return q, k, v, keep


def site(mask=MaskKind.KEY_PADDING, rank=4, head_dim=D, scale=SCALE):
    return AttentionSite("layer0", scale=scale, mask=mask, rank=rank, head_dim=head_dim, value_dim=DV)


def lsh_by_definition(q, k, v, keep, rotations, n_buckets, chunk, causal, dedup, scale=SCALE):
    """The keys each query sees per round, written out with loops over positions: sort by
    (bucket, position, query first), chunks of 2*chunk items, own and previous chunk; padded
    keys sort last; causal: keys at earlier positions plus the own one. Then a softmax over
    the union of those keys (dedup), or over every (round, key) pair."""
    nq, nk = len(q), len(k)
    seen = [[] for _ in range(nq)]  # per query, the keys of every round
    for r in range(rotations.shape[0]):

        def bucket(x):
            if n_buckets == 1:
                return 0
            rotated = x @ rotations[r]
            return int(np.argmax(np.concatenate([rotated, -rotated])))

        items = [(bucket(scale * q[i]), i, 0) for i in range(nq)]
        items += [(bucket(k[j]) if keep[j] else n_buckets, j, 1) for j in range(nk)]
        chunk_of = {(pos, kind): rank // (2 * chunk) for rank, (_, pos, kind) in enumerate(sorted(items))}
        for i in range(nq):
            for j in range(nk):
                window = chunk_of[(i, 0)] - chunk_of[(j, 1)] in (0, 1)
                if keep[j] and (window and (not causal or j < i) or causal and j == i):
                    seen[i].append(j)
    out = np.zeros((nq, v.shape[-1]))
    for i, keys in enumerate(seen):
        keys = sorted(set(keys)) if dedup else keys
        if keys:
            logits = scale * k[keys] @ q[i]
            weights = np.exp(logits - logits.max())
            out[i] = weights @ v[keys] / weights.sum()
    return out


MASKS = [MaskKind.NONE, MaskKind.KEY_PADDING, MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING]
CONFIGS = [
    (1, 1, 64, False),
    (8, 3, 4, False),
    (4, 2, 5, True),
]  # n_buckets, n_hashes, chunk, dedup


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_onnx_matches_torch_for_every_length(mask, config):
    n_buckets, n_hashes, chunk, dedup = config
    options = lsh.Options(n_buckets=n_buckets, n_hashes=n_hashes, chunk=chunk, dedup=dedup, seed=1)
    s = site(mask)
    session = lowering_session(lsh.onnx_lowering(s, options, 20), 4)
    module = lsh.torch_module(s, options)
    for n in (1, 9, 33):  # below, at odd multiples of, and not dividing the chunk
        nq = n if mask.causal else n + 2  # non-causal: queries and keys may differ in number
        q, k, v, keep = inputs(n, nq=nq, pad=mask.key_padding, seed=n)
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
        assert out.shape == (2, 3, nq, DV)
        assert rel_err(out, run_pass_module(module, q, k, v, keep)) < 1e-5, n


def test_onnx_runs_rank_3_with_a_keep_all_tensor():
    options = lsh.Options(n_buckets=4, n_hashes=2, chunk=4)
    s = site(MaskKind.CAUSAL, rank=3)
    session = lowering_session(lsh.onnx_lowering(s, options, 20), 3, keep_rank=2)
    q, k, v, _ = inputs(21, lead=(5,), pad=False)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.ones((1, 1), np.float32)))[0]
    assert rel_err(out, run_pass_module(lsh.torch_module(s, options), q, k, v, None)) < 1e-5


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
@pytest.mark.parametrize("n_hashes, dedup", [(1, False), (3, False), (3, True)])
def test_one_bucket_and_one_chunk_is_softmax_attention(mask, n_hashes, dedup):
    # Everything in one chunk: nothing missed, nothing counted twice within a round (the first
    # chunk has no previous chunk); across identical rounds, either counting gives the same.
    n = 40
    options = lsh.Options(n_buckets=1, n_hashes=n_hashes, chunk=n, dedup=dedup)
    q, k, v, keep = inputs(n, pad=mask.key_padding)
    expected = exact_attention(q, k, v, keep, SCALE, causal=mask.causal)
    assert rel_err(run_pass_module(lsh.torch_module(site(mask), options), q, k, v, keep), expected) < 1e-5
    session = lowering_session(lsh.onnx_lowering(site(mask), options, 20), 4)
    assert rel_err(session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0], expected) < 1e-5


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
@pytest.mark.parametrize("dedup", [False, True])
def test_matches_the_definition_written_with_loops(mask, dedup):
    options = lsh.Options(n_buckets=4, n_hashes=3, chunk=3, dedup=dedup, seed=2)
    q, k, v, keep = inputs(19, lead=(1, 1), pad=mask.key_padding, seed=3)
    out = run_pass_module(lsh.torch_module(site(mask), options), q, k, v, keep)[0, 0]
    one_head = (q[0, 0], k[0, 0], v[0, 0], keep[0, 0, :, 0], lsh.rotations(options, D), 4, 3)
    assert rel_err(out, lsh_by_definition(*one_head, mask.causal, dedup)) < 1e-5
    # Neither trivially exact nor blind to the counting:
    assert rel_err(out, exact_attention(q, k, v, keep, SCALE, causal=mask.causal)[0, 0]) > 1e-2
    assert rel_err(out, lsh_by_definition(*one_head, mask.causal, not dedup)) > 1e-3


def clustered(n, clusters, seed, query_clusters=None):
    """Queries and keys near a few directions (separate noise, separate norms), values near a
    per-cluster vector: attention should stay within a cluster."""
    g = torch.Generator().manual_seed(seed)
    dim = 32
    centers = torch.nn.functional.normalize(torch.randn(clusters, dim, generator=g), dim=-1)
    cluster_values = torch.randn(clusters, DV, generator=g)
    of_key = torch.randint(clusters, (n,), generator=g)
    of_query = torch.randint(query_clusters or clusters, (n,), generator=g)
    q = 4 * (centers[of_query] + 0.15 * torch.randn(n, dim, generator=g))
    k = 3 * (centers[of_key] + 0.15 * torch.randn(n, dim, generator=g))
    v = cluster_values[of_key] + 0.3 * torch.randn(n, DV, generator=g)
    return q[None], k[None], v[None], of_key, cluster_values


def test_error_on_clustered_inputs_falls_with_more_hashes():
    q, k, v, _, _ = clustered(512, 8, seed=0)
    s = site(MaskKind.NONE, rank=3, head_dim=32, scale=1.0)
    expected = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
    errors = []
    for n_hashes in (1, 2, 4, 8):
        trials = [
            lsh.torch_module(s, lsh.Options(n_buckets=16, n_hashes=n_hashes, chunk=16, seed=seed))(q, k, v)
            for seed in range(3)
        ]
        errors.append(np.mean([float((out - expected).norm() / expected.norm()) for out in trials]))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.5 * errors[0], errors


def test_queries_find_keys_of_their_bucket_when_queries_and_keys_differ():
    # All queries come from cluster 0, keys from 4 clusters: cluster 0's buckets hold 4x more
    # queries than keys. Sorting queries and keys separately would pair most queries with other
    # clusters' keys; the joint sort keeps them next to their own cluster's keys.
    q, k, v, of_key, cluster_values = clustered(256, 4, seed=1, query_clusters=1)
    v = torch.nn.functional.one_hot(of_key, 4).float()[None]  # output = attention mass per cluster
    s = site(MaskKind.NONE, rank=3, head_dim=32, scale=1.0)
    out = lsh.torch_module(s, lsh.Options(n_buckets=8, n_hashes=2, chunk=16))(q, k, v)
    exact = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
    assert exact[0, :, 0].min() > 0.95
    # (Sorting separately, measured on this input: worst query 0.0, mean 0.92.)
    assert out[0, :, 0].min() > 0.85 and out[0, :, 0].mean() > 0.99, out[0, :, 0]


def test_hash_depends_on_direction_only():
    options = lsh.Options(n_buckets=8, n_hashes=2)
    rotations = torch.from_numpy(lsh.rotations(options, D))
    x = torch.randn(1, 50, D)
    scales = torch.rand(1, 50, 1) * 10 + 0.1
    assert torch.equal(lsh.hash_buckets(x, rotations, 8), lsh.hash_buckets(x * scales, rotations, 8))
    assert not torch.equal(lsh.hash_buckets(x, rotations, 8), lsh.hash_buckets(-x, rotations, 8))


def test_padded_keys_do_not_contribute():
    options = lsh.Options(n_buckets=4, n_hashes=2, chunk=4)
    session = lowering_session(lsh.onnx_lowering(site(), options, 20), 4)
    q, k, v, keep = inputs(30)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    garbage = np.random.default_rng(1).standard_normal(k.shape).astype(np.float32) * 100
    k2 = np.where(keep == 0, garbage, k)
    v2 = np.where(keep[..., :1] == 0, garbage[..., :DV], v)
    assert np.array_equal(session.run(None, dict(q=q, k=k2, v=v2, key_keep=keep))[0], out)


def test_causal_rows_ignore_later_values_and_the_first_row_is_exact():
    options = lsh.Options(n_buckets=8, n_hashes=2, chunk=4)
    session = lowering_session(lsh.onnx_lowering(site(MaskKind.CAUSAL), options, 20), 4)
    q, k, v, keep = inputs(30, pad=False)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    later = v.copy()
    later[..., 15:, :] += 10.0  # keys (and so the sort) unchanged
    changed = session.run(None, dict(q=q, k=k, v=later, key_keep=keep))[0]
    assert np.array_equal(changed[..., :15, :], out[..., :15, :])
    assert not np.allclose(changed[..., 15:, :], out[..., 15:, :])
    np.testing.assert_allclose(out[..., 0, :], v[..., 0, :], rtol=1e-6)  # sees only itself


def test_row_without_a_visible_key_is_zero_not_nan():
    options = lsh.Options(n_buckets=4, n_hashes=2, chunk=4)
    session = lowering_session(lsh.onnx_lowering(site(), options, 20), 4)
    q, k, v, keep = inputs(12)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.zeros_like(keep)))[0]
    assert np.array_equal(out, np.zeros_like(out))


LONG_MASKS = [MaskKind.NONE, MaskKind.CAUSAL_KEY_PADDING]


def lowered_model(s: AttentionSite, options: lsh.Options, shape) -> onnx.ModelProto:
    """The lowering as one model with its functions inlined, every intermediate a graph output,
    q, k, v of a fixed shape [B, H, N, D] (D = the site's head dim, here also v's)."""
    lowering = lsh.onnx_lowering(s, options, 20)
    helper = onnx.helper
    inputs = ["q", "k", "v", "key_keep", *lowering.constants]
    node = helper.make_node(lowering.op_type, inputs, ["out"], domain="attnrewrite")
    b, _, n, _ = shape
    graph = helper.make_graph(
        [node],
        "lsh",
        [
            *(helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, shape) for x in "qkv"),
            helper.make_tensor_value_info("key_keep", onnx.TensorProto.FLOAT, [b, 1, n, 1]),
        ],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(a, name) for name, a in lowering.constants.items()],
    )
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("attnrewrite", 1)]
    model = onnx.inliner.inline_local_functions(
        helper.make_model(graph, functions=lowering.functions, ir_version=10, opset_imports=opsets)
    )
    unroll_loops(model.graph)
    produced = [x for node in model.graph.node for x in node.output if x and x != "out"]
    model.graph.output.extend(helper.make_empty_tensor_value_info(x) for x in produced)
    return model


def unroll_loops(graph: onnx.GraphProto) -> None:
    """Each Loop (of a Constant trip count, with scan outputs only) written out iteration by
    iteration, in place: what a round holds becomes a value of the graph, to be sized."""
    constants = {
        n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant" and n.attribute[0].t.dims == []
    }
    nodes = []
    for node in graph.node:
        if node.op_type != "Loop":
            nodes.append(node)
            continue
        body = node.attribute[0].g
        local = {x.name for x in body.input} | {x for n in body.node for x in n.output}
        scans = [x.name for x in body.output[1:]]
        for r in range(int(onnx.numpy_helper.to_array(constants[node.input[0]]))):
            name = {x: f"{x}__round{r}" for x in local}
            nodes.append(onnx.helper.make_node("Constant", [], [name[body.input[0].name]], value_int=r))
            nodes.append(onnx.helper.make_node("Constant", [], [name[body.input[1].name]], value_ints=[1]))
            for n in body.node:
                copy = onnx.NodeProto()
                copy.CopyFrom(n)
                copy.input[:] = [name.get(x, x) for x in n.input]
                copy.output[:] = [name.get(x, x) for x in n.output]
                copy.name = f"{n.name}__round{r}" if n.name else ""
                for attribute in copy.attribute:  # a nested Loop reads the round's values too
                    if attribute.type == onnx.AttributeProto.GRAPH:
                        _rename_inputs(attribute.g, name)
                nodes.append(copy)
            for x in scans:
                nodes.append(onnx.helper.make_node("Unsqueeze", [name[x], "loop_axis0"], [f"{x}__stacked{r}"]))
        nodes.insert(0, onnx.helper.make_node("Constant", [], ["loop_axis0"], value_ints=[0]))
        for x, out in zip(scans, node.output):
            nodes.append(onnx.helper.make_node("Concat", [f"{x}__stacked{r}" for r in range(r + 1)], [out], axis=0))
    del graph.node[:]
    graph.node.extend(nodes)


def _rename_inputs(graph: onnx.GraphProto, name: dict[str, str]) -> None:
    for node in graph.node:
        node.input[:] = [name.get(x, x) for x in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_inputs(attribute.g, name)


def intermediate_sizes(model: onnx.ModelProto, n: int, shape) -> dict[str, int]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    b, h, _, d = shape
    x = np.random.default_rng(0).standard_normal((b, h, n, d)).astype(np.float32)
    keep = np.ones((b, 1, n, 1), np.float32)
    outputs = session.run(None, dict(q=x, k=x, v=x, key_keep=keep))
    return {o.name: a.size for o, a in zip(session.get_outputs(), outputs)}


@pytest.mark.parametrize("mask", LONG_MASKS, ids=lambda m: m.value)
def test_body_has_cuda_kernels_and_no_tensor_past_int32_sizes_at_131072(mask):
    """What onnxruntime's CUDA provider needs (issue 12): no ArgMax (no CUDA kernel at opset
    12+), no Pad (none for int64), and, at [1, 12, 131072, 64] with the default options, no
    intermediate over 2^31 elements (cuDNN's reductions hold int sizes; all four rounds' window
    logits together were 3.2e9). Every size is linear in N (chunks of a fixed size), so it is
    measured at three lengths, checked to be linear, and extrapolated to N = 131072."""
    options = lsh.Options(dedup=mask.causal)  # dedup adds the pair counts, as large as the logits
    shape = (1, 12, 131072, 64)
    model = lowered_model(site(mask, head_dim=64), options, (1, 12, "n", 64))
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"ArgMax", "Pad", "Range"}, ops
    small = [intermediate_sizes(model, n, shape) for n in (256, 512, 1024)]
    per_position = {x: (small[2][x] - small[1][x]) / 512 for x in small[0]}
    for x in small[0]:
        assert small[1][x] - small[0][x] == 256 * per_position[x], x  # linear in N
    at_131072 = {x: small[2][x] + per_position[x] * (131072 - 1024) for x in small[0]}
    largest = max(at_131072, key=at_131072.get)
    assert at_131072[largest] < 2**31, (largest, at_131072[largest])
    # one round's window logits, [G, 1, C, 2 * chunk, 4 * chunk], are the largest
    assert at_131072[largest] == 12 * (2 * 131072 // 128) * 128 * 256


@pytest.mark.parametrize("mask", LONG_MASKS, ids=lambda m: m.value)
def test_onnx_matches_torch_at_a_long_sequence(mask):
    options = lsh.Options(n_hashes=1, seed=3)  # default buckets and chunk: 128 chunks
    s = site(mask)
    session = lowering_session(lsh.onnx_lowering(s, options, 20), 4)
    q, k, v, keep = inputs(8192, lead=(1, 2), pad=mask.key_padding, seed=4)
    out = session.run(None, dict(q=q, k=k, v=v, key_keep=keep))[0]
    assert rel_err(out, run_pass_module(lsh.torch_module(s, options), q, k, v, keep)) < 1e-5


@pytest.mark.slow
def test_runs_where_the_attention_matrix_would_not_fit():
    # N = 40000, one head of D = 16: softmax attention's N x N fp32 logits alone are 6.4 GB.
    # Run in a fresh process so its peak memory is this op's alone: VmHWM, the peak of this
    # process image (ru_maxrss would carry over the pytest process's peak across fork and exec).
    script = textwrap.dedent(
        r"""
        import json, re, sys, time
        import numpy as np, onnxruntime as ort
        sys.path.insert(0, sys.argv[1])
        from attention_graphs import lowering_session
        from test_lsh import site
        from attnrewrite.site import MaskKind
        from attnrewrite.passes import lsh
        n = 40000
        options = lsh.Options(n_buckets=64, n_hashes=2, chunk=32)
        lowering = lsh.onnx_lowering(site(MaskKind.CAUSAL, head_dim=16), options, 20)
        session = lowering_session(lowering, 4, keep_rank=2)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for _ in range(3))
        start = time.perf_counter()
        out = session.run(None, dict(q=q, k=k, v=v, key_keep=np.ones((1, 1), np.float32)))[0]
        peak_kb = int(re.search(r"VmHWM:\s*(\d+)", open("/proc/self/status").read())[1])
        print(json.dumps({"seconds": time.perf_counter() - start, "shape": out.shape,
                          "finite": bool(np.isfinite(out).all()),
                          "peak_mb": peak_kb / 1024}))
        """
    )
    tests_dir = __file__.rsplit("/", 1)[0]
    done = subprocess.run([sys.executable, "-c", script, tests_dir], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["shape"] == [1, 1, 40000, 16] and result["finite"]
    assert result["peak_mb"] < 2500, result  # the whole process, far below one N x N matrix


def test_supports_and_options():
    options = lsh.Options()
    for mask in MASKS:
        assert lsh.supports(site(mask), options) is None
    assert "bias" in lsh.supports(site(MaskKind.BIAS), options)
    assert "head dimension" in lsh.supports(site(head_dim=None), options)
    assert get_pass("lsh") is lsh
    parsed = make_options(lsh, n_buckets="16", n_hashes="2", chunk="32", seed="5")
    assert (parsed.n_buckets, parsed.n_hashes, parsed.chunk, parsed.seed) == (16, 2, 32, 5)
    with pytest.raises(OptionError, match="^lsh option n_buckets must be 1 or even, got 3$"):  # a user error
        make_options(lsh, n_buckets="3")


def test_rotations_are_seeded_constants_shared_by_both_lowerings():
    options = lsh.Options(n_buckets=8, n_hashes=3, seed=7)
    lowering = lsh.onnx_lowering(site(), options, 20)
    module = lsh.torch_module(site(), options)
    assert lowering.constants["rotations"].shape == (3, D, 4)
    assert np.array_equal(lowering.constants["rotations"], module.rotations.numpy())
    assert not np.array_equal(
        lowering.constants["rotations"],
        lsh.rotations(lsh.Options(n_buckets=8, n_hashes=3, seed=8), D),
    )
    assert lowering.op_type == "LSHAttention"
    assert lsh.onnx_lowering(site(MaskKind.CAUSAL), options, 20).op_type == "CausalLSHAttention"


# --- whole models, through the ONNX frontend -------------------------------------------------


def check_rewritten_model(original, vocab, op_type, exact_options, lengths=(5, 13, 40)):
    """Approximate options rewrite every site and run; degenerate ones leave the model's
    outputs as they were."""
    before = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    approximate = attnrewrite.rewrite(original, to="lsh", n_buckets=4, n_hashes=2, chunk=4)
    exact = attnrewrite.rewrite(original, to="lsh", **exact_options)
    for model in (approximate, exact):
        sites = read_record(model)["sites"]
        assert len(sites) == 2 and all(s["status"] == "rewritten" and s["replacement"] == op_type for s in sites)
    approximate = ort.InferenceSession(approximate.SerializeToString(), providers=["CPUExecutionProvider"])
    exact = ort.InferenceSession(exact.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in lengths:
        feed = text_feed(n, vocab, seed=n)
        expected = before.run(None, feed)[0]
        out = approximate.run(None, feed)[0]
        assert out.shape == expected.shape and np.isfinite(out).all()
        assert np.abs(exact.run(None, feed)[0] - expected).max() < 1e-5, n
    assert np.abs(out - expected).max() > 1e-4  # at N = 40 the buckets do leave keys out


def test_exported_bert_rewrites_and_runs():
    check_rewritten_model(
        onnx.load(SAMPLE_BERT),
        1000,
        "attnrewrite.LSHAttention",
        dict(n_buckets=1, n_hashes=2, chunk=40),
    )


def test_exported_gpt2_rewrites_to_causal_lsh_and_runs(exports):
    original = exports.get("gpt2-eager", "legacy").load()
    assert [s.mask for s in attnrewrite.find_sites(original)] == [MaskKind.CAUSAL_KEY_PADDING] * 2
    check_rewritten_model(original, 100, "attnrewrite.CausalLSHAttention", dict(n_buckets=1, n_hashes=1, chunk=40))


def test_fx_rewrite_of_gpt2_with_one_bucket_keeps_outputs(exports):
    model = exports.module("gpt2-eager")  # 2 layers of eager causal attention
    program = torch.export.export(model, text_args(24))
    args = text_args(24, seed=1)
    with torch.no_grad():
        expected = model(*args)
        exact = attnrewrite.rewrite(program, to="lsh", n_buckets=1, n_hashes=2, chunk=24)
        assert exact.meta["attnrewrite"]["sites_rewritten"] == 2
        assert (exact(*args) - expected).abs().max() < 1e-5
        bucketed = attnrewrite.rewrite(program, to="lsh", n_buckets=4, n_hashes=2, chunk=4)
        assert (bucketed(*args) - expected).abs().max() > 1e-4


def _op_counts(lowering, function: str) -> collections.Counter:
    """Standard ops a function of the lowering runs, its callees' counted in (Constants not)."""
    functions = {f.name: f for f in lowering.functions}
    counts = collections.Counter()
    for node in functions[function].node:
        if node.domain == "attnrewrite":
            counts += _op_counts(lowering, node.op_type)
        elif node.op_type != "Constant":
            counts[node.op_type] += 1
    return counts


def test_the_causal_round_adds_only_the_mask_and_one_sorted_table():
    """Issue 33: the causal graph computed another answer on CUDA than on CPU; the non-causal one
    did not. The causal round now differs from the other only by the mask (Less, Where) and its
    own-key logit, an item table gathered and chunked like the rows (plus the rounds-seen bias):
    no gather by a position clamped with Max, no separate own-key tables of k, v and keep."""
    causal = lsh.onnx_lowering(site(MaskKind.CAUSAL), lsh.Options(), 20)
    plain = lsh.onnx_lowering(site(MaskKind.NONE), lsh.Options(), 20)
    extra = _op_counts(causal, "CausalRound") - _op_counts(plain, "Round")
    expected = _op_counts(causal, "GatherItems") + _op_counts(causal, "InChunks")
    expected += collections.Counter(Less=1, Where=1, Add=1)
    assert extra == expected and not _op_counts(plain, "Round") - _op_counts(causal, "CausalRound")


GATHERS = {"Gather": "axis", "GatherElements": "axis", "GatherND": "batch_dims", "ScatterElements": "axis"}


@pytest.mark.parametrize("mask", [MaskKind.CAUSAL_KEY_PADDING, MaskKind.KEY_PADDING], ids=lambda m: m.value)
@pytest.mark.parametrize("dedup", [False, True], ids=["", "dedup"])
def test_every_gather_index_is_in_range(mask, dedup):
    """Every index the body gathers or scatters with lies in [0, dim): ONNX lets a negative one
    count from the end, and a provider that does not (or reads past the end) computes another
    answer. Padded keys, a length that is no multiple of the chunk, every round (the Loop
    written out)."""
    options = lsh.Options(n_buckets=4, chunk=8, n_hashes=2, dedup=dedup)
    model = lowered_model(site(mask), options, (2, 3, "n", D))
    produced = [o.name for o in model.graph.output]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, _, keep = inputs(37, pad=True, seed=5)
    values = dict(zip(produced, session.run(None, dict(q=q, k=k, v=k[..., ::-1].copy(), key_keep=keep))))
    checked = 0
    for node in model.graph.node:
        if node.op_type in GATHERS and node.input[1] in values:
            axis = next((a.i for a in node.attribute if a.name == GATHERS[node.op_type]), 0)
            table, index = values.get(node.input[0]), values[node.input[1]]
            dim = table.shape[axis] if table is not None else None
            assert index.min() >= 0 and (dim is None or index.max() < dim), (node.op_type, node.output[0])
            checked += 1
    assert checked >= 10
