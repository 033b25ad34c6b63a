"""Every method's rewritten model on onnxruntime's CUDA provider: the same numbers as on CPU
(fp32 and fp16), no data-producing node left on the CPU provider, and lsh / favor at lengths
whose intermediates pass 2^31 elements (or take the chunked path that avoids them).

The CUDA tests skip where onnxruntime has no CUDAExecutionProvider (docs/GPU.md says how to get
one on the GPU machine). The placement inspection they rely on is tested here on the CPU
provider, so a GPU session does not find its bugs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from attention_graphs import AttentionSpec, build_attention_model
from models import relative_error

from attnrewrite import bench, passes
from attnrewrite.bench_worker import cuda_ready, node_placement, placement_from_profile
from attnrewrite.check import cosine_similarity
from attnrewrite.onnx import io as onnx_io
from attnrewrite.onnx.inputs import generate_inputs
from attnrewrite.onnx.rewrite import rewrite_model

SAMPLE = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
PROVIDERS = ort.get_available_providers()
HAS_CUDA = "CUDAExecutionProvider" in PROVIDERS
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason=f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (available: {', '.join(PROVIDERS)}); "
    "install onnxruntime-gpu on a GPU machine, see docs/GPU.md",
)
if HAS_CUDA:
    cuda_ready(ort)
# Small enough that linformer projects (N > k) and causal chunks carry over (N > chunk).
OPTIONS = {"linformer": {"proj_dim": 8, "max_len": 512}, "favor": {"features": 32}, "lsh": {"chunk": 8, "n_buckets": 4}}
SEQ = 40
CAUSAL = AttentionSpec(mask="causal", heads=2, head_dim=16)
MODELS = {"tiny_bert": None, "causal_attention": CAUSAL}  # None: the sample file
FP32_TOLERANCE = 1e-4  # TF32 off: cuBLAS and MLAS differ in summation order only
FP16_TOLERANCE = 2e-2
# LSH's buckets are an argmax: an fp16 q or k near a bucket boundary hashes elsewhere and its
# row attends to other keys (measured on CPU, causal graph: 0.045 relative, cosine 0.99988).
FP16_TOLERANCE_LSH = 0.1


def cases():
    """(model, method) pairs. Issue 33 measured causal lsh 0.91 relative apart on CUDA and CPU
    (an H100); its causal round now gathers only by ranks of the sort (tests/test_lsh.py), and
    these cases say on the next GPU whether that was the cause."""
    for model, spec in MODELS.items():
        for method in passes.PASSES:
            if spec is not None and spec.causal and method == "linformer":
                continue  # linformer refuses causal attention (tested in test_linformer)
            yield pytest.param(model, method, id=f"{model}-{method}")


def _original(name: str, folder) -> str:
    if MODELS[name] is None:
        return str(SAMPLE)
    path = folder / f"{name}.onnx"
    onnx.save(build_attention_model(MODELS[name]), path)
    return str(path)


def _rewritten(name: str, method: str, folder, fp16: bool = False) -> tuple[str, dict]:
    original = _original(name, folder)
    model, record = rewrite_model(onnx_io.load_model(original), method, **OPTIONS.get(method, {}))
    assert record.rewritten and not record.skipped
    if fp16:
        model = bench.to_fp16(model)
    path = folder / f"{name}.{method}{'.fp16' if fp16 else ''}.onnx"
    onnx_io.save_model(model, path)
    return str(path), generate_inputs(onnx_io.load_model(original).graph, seq=SEQ, seed=3)


def _run(path: str, feeds: dict, provider: str) -> np.ndarray:
    providers = [("CUDAExecutionProvider", {"use_tf32": "0"})] if provider == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(path, providers=providers).run(None, _in_model_dtypes(path, feeds))[0]


def _in_model_dtypes(path: str, feeds: dict) -> dict:
    """The float32 inputs generated for the original, cast where the (fp16) model takes float16."""
    half = {
        i.name
        for i in onnx.load(path, load_external_data=False).graph.input
        if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    }
    return {name: value.astype(np.float16) if name in half else value for name, value in feeds.items()}


# --- the placement inspection, on CPU ------------------------------------------------------------


def test_a_cpu_session_has_every_node_on_cpu(tmp_path):
    path, feeds = _rewritten("tiny_bert", "favor", tmp_path)
    placement = node_placement(path, feeds, "cpu")
    assert placement["nodes"] > 50  # the inlined function bodies count node by node
    assert placement["by_provider"] == {"CPUExecutionProvider": placement["nodes"]}
    assert placement["elsewhere"] == [] and placement["data_elsewhere"] == [] and placement["memcpy"] == []
    assert not list(tmp_path.glob("placement*.json"))  # the profile is removed


def _event(name, op, provider, inputs, outputs, dims=(4,)):
    return {
        "cat": "Node",
        "name": f"{name}_kernel_time",
        "args": {
            "op_name": op,
            "provider": provider,
            "input_type_shape": [{t: list(dims)} for t in inputs],
            "output_type_shape": [{t: list(dims)} for t in outputs],
        },
    }


def test_placement_separates_shape_arithmetic_from_data_on_the_wrong_provider():
    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    events = [
        _event("mm", "MatMul", cuda, ["float", "float"], ["float"]),
        _event("shape", "Shape", cpu, ["float"], ["int64"]),
        _event("concat", "Concat", cpu, ["int64", "int64"], ["int64"]),
        _event("pad", "Pad", cpu, ["int64", "int64"], ["int64"], dims=(12, 4, 4096, 1)),  # positions: data
        _event("argmax", "ArgMax", cpu, ["float16"], ["int64"]),
        _event("copy", "MemcpyToHost", cuda, ["float16"], ["float16"]),
        _event("argmax", "ArgMax", cpu, ["float16"], ["int64"]),  # a second run of the same node counts once
        {"cat": "Session", "name": "model_run", "args": {}},
        {"cat": "Node", "name": "mm_fence_before", "args": {"op_name": "MatMul"}},
    ]
    placement = placement_from_profile(events, cuda)
    assert placement["nodes"] == 6 and placement["by_provider"] == {cuda: 2, cpu: 4}
    assert placement["elsewhere"] == [
        f"Shape shape ({cpu})",
        f"Concat concat ({cpu})",
        f"Pad pad ({cpu})",
        f"ArgMax argmax ({cpu})",
    ]
    assert placement["data_elsewhere"] == ["Pad pad (int64 -> int64)", "ArgMax argmax (float16 -> int64)"]
    assert placement["memcpy"] == ["MemcpyToHost copy"]


def test_the_worker_reports_placement_in_a_fresh_process(tmp_path):
    path, feeds = _rewritten("causal_attention", "linear", tmp_path)
    np.savez(tmp_path / "inputs.npz", **feeds)
    spec = {"model": path, "inputs": str(tmp_path / "inputs.npz"), "provider": "cpu", "placement": True}
    outcome = bench.run_worker([sys.executable, str(bench.WORKER), json.dumps(spec)], 2**40, 60.0)
    assert outcome["status"] == "ok", outcome
    assert outcome["placement"]["data_elsewhere"] == [] and outcome["placement"]["nodes"] > 10


# --- CUDA ----------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("model,method", cases())
def test_cuda_equals_cpu_in_fp32(model, method, tmp_path):
    path, feeds = _rewritten(model, method, tmp_path)
    assert relative_error(_run(path, feeds, "cuda"), _run(path, feeds, "cpu")) < FP32_TOLERANCE


@requires_cuda
@pytest.mark.parametrize("model,method", cases())
def test_cuda_fp16_is_close_to_cpu_fp32(model, method, tmp_path):
    full, feeds = _rewritten(model, method, tmp_path)
    half, _ = _rewritten(model, method, tmp_path, fp16=True)
    got, want = _run(half, feeds, "cuda"), _run(full, feeds, "cpu")
    assert got.dtype == np.float16 and np.isfinite(got).all()
    tolerance = FP16_TOLERANCE_LSH if method == "lsh" else FP16_TOLERANCE
    assert relative_error(got, want) < tolerance and cosine_similarity(got, want) > 0.999


@requires_cuda
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("model,method", cases())
def test_no_data_node_on_the_cpu_provider(model, method, fp16, tmp_path):
    """Shape arithmetic on CPU is onnxruntime's choice and cheap; a node making float tensors
    on CPU means copies both ways and a CPU kernel on the path (issue 12's profile)."""
    path, feeds = _rewritten(model, method, tmp_path, fp16=fp16)
    placement = node_placement(path, _in_model_dtypes(path, feeds), "cuda")
    assert placement["data_elsewhere"] == [], (
        f"{len(placement['memcpy'])} copies; on CPU: {placement['data_elsewhere']}"
    )


LONG = dict(batch=1, heads=12, n=131072, head_dim=64)


def lsh_window_logits_elements(options: passes.lsh.Options, heads: int, n: int) -> int:
    """Elements the window logits of all hash rounds together [G, hashes, chunks, 2*chunk,
    4*chunk] would hold (queries and keys sorted together make 2N items, cut into chunks of
    2*chunk items, each seeing its own and the previous chunk): past 2^31, the length at which
    the ONNX body must attend one round at a time (as attnrewrite/passes/lsh.py lowers it)."""
    items = 2 * options.chunk
    return heads * options.n_hashes * (2 * n // items) * items * 2 * items


def _long_inputs():
    rng = np.random.default_rng(0)
    shape = (LONG["batch"], LONG["heads"], LONG["n"], LONG["head_dim"])
    return {name: rng.standard_normal(shape, dtype=np.float32) for name in "qkv"}


def _torch_reference_on_cuda(method: str, site, options, feeds) -> np.ndarray:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device for the reference")
    torch.backends.cuda.matmul.allow_tf32 = False
    module = passes.PASSES[method].torch_module(site, options).cuda()
    with torch.inference_mode():
        out = module(*(torch.from_numpy(feeds[x]).cuda() for x in "qkv")).cpu().numpy()
    del module
    torch.cuda.empty_cache()  # onnxruntime's arena needs the memory next
    return out


@requires_cuda
@pytest.mark.parametrize("method,mask", [("lsh", "none"), ("favor", "causal")])
def test_long_sequence_on_cuda(method, mask, tmp_path):
    """lsh at N = 131072, 12 heads: its window logits hold 3.2e9 elements (> 2^31, where the
    issue saw ReduceMax fail in cuDNN); causal favor there runs its chunked prefix sums
    (2049 chunks). Both against the pass's torch module on the same GPU."""
    spec = AttentionSpec(mask=mask, heads=LONG["heads"], head_dim=LONG["head_dim"])
    path = tmp_path / "attention.onnx"
    onnx.save(build_attention_model(spec), path)
    options = {"lsh": {}, "favor": {"features": 256}}[method]
    model, record = rewrite_model(onnx_io.load_model(path), method, **options)
    [outcome] = record.rewritten
    onnx_io.save_model(model, tmp_path / "rewritten.onnx")
    resolved = passes.make_options(passes.PASSES[method], **options)
    if method == "lsh":
        assert lsh_window_logits_elements(resolved, LONG["heads"], LONG["n"]) > 2**31
    feeds = _long_inputs()
    want = _torch_reference_on_cuda(method, outcome.site, resolved, feeds)
    got = _run(str(tmp_path / "rewritten.onnx"), feeds, "cuda")
    assert np.isfinite(got).all()
    assert relative_error(got, want) < 1e-3


# --- the torch modules (what the FX frontend swaps in, and the CUDA sweep's torch columns) --------


def _torch_site(causal: bool):
    from attnrewrite.site import AttentionSite, MaskKind

    return AttentionSite(
        name="site",
        scale=0.125,
        rank=4,
        num_heads=2,
        head_dim=16,
        value_dim=16,
        mask=MaskKind.CAUSAL if causal else MaskKind.NONE,
    )


def torch_cases():
    for causal in (False, True):
        for method in passes.PASSES:
            if not (causal and method == "linformer"):
                yield pytest.param(method, causal, id=f"{method}{'-causal' if causal else ''}")


@pytest.mark.parametrize("method,causal", torch_cases())
def test_torch_modules_make_their_tensors_on_the_inputs_device(method, causal):
    """On torch's meta device, a tensor made on the CPU (torch.ones(()) expanded, say) meets
    the inputs and fails as it would on CUDA; this one runs everywhere."""
    torch = pytest.importorskip("torch")
    module = passes.PASSES[method].torch_module(
        _torch_site(causal), passes.make_options(passes.PASSES[method], **OPTIONS.get(method, {}))
    )
    q = torch.empty(1, 2, SEQ, 16, device="meta", dtype=torch.float16)
    with torch.inference_mode():
        out = module.to("meta")(q, q, q)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == torch.float16


@requires_cuda
@pytest.mark.parametrize("method,causal", torch_cases())
def test_torch_modules_on_cuda_equal_cpu(method, causal):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    module = passes.PASSES[method].torch_module(
        _torch_site(causal), passes.make_options(passes.PASSES[method], **OPTIONS.get(method, {}))
    )
    q, k, v = (torch.randn(1, 2, SEQ, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.inference_mode():
        want = module(q, k, v).numpy()
        got = module.cuda()(q.cuda(), k.cuda(), v.cuda()).cpu().numpy()
    assert relative_error(got, want) < FP32_TOLERANCE


def test_fp16_models_are_fed_float16(tmp_path):
    """The CUDA cases feed each model its own input types (issue 33: fp16 placement runs were fed
    float32 and failed on the feed, not on placement); checked here on CPU."""
    half, feeds = _rewritten("causal_attention", "linear", tmp_path, fp16=True)
    typed = _in_model_dtypes(half, feeds)
    assert {name: value.dtype for name, value in typed.items()} == {"q": np.float16, "k": np.float16, "v": np.float16}
    assert _run(half, feeds, "cpu").dtype == np.float16
