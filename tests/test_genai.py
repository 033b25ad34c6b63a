"""onnxruntime-genai in and out: the decoders its model builder writes (GroupQueryAttention over
a packed, rotated qkv; SimplifiedLayerNormalization; MatMulNBits at int4) are read, listed,
rewritten in parallel over their cache and made recurrent; a rewrite written as a folder
(-o DIR/) is one genai generates with, the same tokens as ``attnrewrite generate`` on the same
model.

Builder models are made here from tiny random transformers folders (samples/export_decoder.py):
Llama and Qwen2, fp32 and int4. Skipped with the reason where onnxruntime-genai does not install.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import decoder_exported, read_record
from decoders import DecoderSpec, export_decoder, positions_of

from attnrewrite import cli, find_sites
from attnrewrite.generate import forced_logits, generate
from attnrewrite.onnx.torch_graph import TorchGraph
from attnrewrite.site import KvCache

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai does not install here")

SAMPLE = Path(__file__).parent.parent / "samples" / "export_decoder.py"
PROMPTS = [[1, 5, 9, 20, 33, 40, 41], [1, 7, 8]]  # two lengths: genai pads the shorter on the right
NEW_TOKENS = 20


def _sample():
    spec = importlib.util.spec_from_file_location("export_decoder", SAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    """(arch, precision) -> the builder's folder; arch -> the transformers folder it came from."""
    sample, root = _sample(), tmp_path_factory.mktemp("genai")
    made: dict = {}

    def get(arch: str, precision: str | None = None) -> Path:
        if arch not in made:
            made[arch] = sample.tiny_decoder(root / f"hf-{arch}", arch)
        if precision is None:
            return made[arch]
        if (arch, precision) not in made:
            made[arch, precision] = sample.builder_folder(made[arch], root / f"{arch}-{precision}", precision)
        return made[arch, precision]

    return get


def rewrite_to_folder(source: Path, out: Path, *args: str) -> Path:
    """-o OUT/ (the folder made by the command, as genai's builder makes its own)."""
    assert cli.main([str(source), "--recurrent", "-o", f"{out}/", *args]) == 0
    return out


def genai_tokens(folder: Path) -> list[list[int]]:
    """genai's greedy continuation of PROMPTS, right padded with the pad token as genai reads
    padding (batch_size given: without it genai reads a [2, N] array as one row)."""
    longest = max(map(len, PROMPTS))
    pad = json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"]
    ids = np.array([p + [pad] * (longest - len(p)) for p in PROMPTS], np.int32)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=longest + NEW_TOKENS, batch_size=len(PROMPTS))
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [generator.get_sequence(row).tolist()[longest:] for row in range(len(PROMPTS))]


def our_tokens(folder: Path) -> list[list[int]]:
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    eos, pad = config["eos_token_id"], config["pad_token_id"]
    result = generate(folder / "model.onnx", PROMPTS, NEW_TOKENS, padding="right", eos_token_id=eos, pad_token_id=pad)
    return result.tokens.tolist()


def padded_to(tokens: list[list[int]], length: int, pad: int) -> list[list[int]]:
    return [row + [pad] * (length - len(row)) for row in tokens]


# --- reading what the builder writes -------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, precision", [("llama", "fp32"), ("llama", "int4"), ("qwen2", "fp32"), ("qwen2", "int4")]
)
def test_builder_models_are_read_and_every_site_listed_with_its_cache(builder, arch, precision, capsys):
    path = builder(arch, precision) / "model.onnx"
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(path))  # the ONNX checker alone refuses what onnxruntime runs
    assert cli.main([str(path.parent), "--list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1] == "2 attention sites, 2 rewritable"
    assert all("causal+key_padding (kv cache)" in row and row.startswith("/model/layers.") for row in rows[1:-1])
    caches = [site.kv_cache for site in find_sites(str(path))]
    assert caches == [
        KvCache(f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value", 2)
        for i in range(2)
    ]


def test_attnrewrite_generate_runs_the_builder_model_as_genai_does(builder):
    """The builder declares its caches' head size symbolically ("kv_cache_dim"): generate()
    takes it from the GroupQueryAttention that reads them."""
    folder = builder("llama", "fp32")
    assert genai_tokens(folder) == padded_to(our_tokens(folder), NEW_TOKENS, 0)


# --- the GroupQueryAttention unpacking, rotary included ---------------------------------------------


@pytest.fixture(scope="module")
def transformers_export(builder, tmp_path_factory):
    """(arch, cache) -> the same weights as the builder's model, exported as optimum does, with
    their KV cache or without one (once each)."""
    from transformers import AutoModelForCausalLM

    folder, made = tmp_path_factory.mktemp("transformers"), {}

    def get(arch: str, cache: bool) -> Path:
        if (arch, cache) not in made:
            model = AutoModelForCausalLM.from_pretrained(builder(arch), attn_implementation="sdpa").eval()
            spec = DecoderSpec(arch, lambda: model, kv_heads=2, position_ids=True, heads=4, head_dim=16, vocab=256)
            path = folder / f"{arch}{'-kv' if cache else ''}.onnx"
            made[arch, cache] = export_decoder(spec, model, path, "legacy", cache=cache)
        return made[arch, cache]

    return get


def rewritten_session(path: Path, out: Path, method: list[str], *flags: str) -> ort.InferenceSession:
    assert cli.main([str(path), *flags, "-o", str(out), "--to", *method]) == 0
    return ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    "method",
    [
        ["linear"],
        ["hedgehog"],
        ["hedgehog", "-O", "window=4", "-O", "sinks=1"],
        ["hedgehog", "-O", "window=4", "-O", "sinks=1", "-O", "sparse=3"],
        ["favor"],
        ["aft"],
    ],
    ids=["linear", "hedgehog", "hedgehog-window", "hedgehog-sparse", "favor", "aft"],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_builder_model_becomes_the_recurrent_model_of_the_transformers_export(
    builder, transformers_export, arch, method, tmp_path
):
    """The builder's GroupQueryAttention (packed qkv, rotary inside, a bias for Qwen2) unpacked
    and rotated here gives, stepped token by token through left and right padded batches, the
    logits of the recurrent model of the same weights exported by transformers, and those of
    the parallel rewrite of their no-cache export on the whole sequence."""
    ids = np.random.default_rng(0).integers(3, 256, (2, 12)).astype(np.int64)
    left, right = np.ones((2, 12), np.int64), np.ones((2, 12), np.int64)
    left[1, :3] = 0
    right[1, 9:] = 0
    ours = rewritten_session(builder(arch, "fp32") / "model.onnx", tmp_path / "builder.onnx", method, "--recurrent")
    recurrent = rewritten_session(transformers_export(arch, True), tmp_path / "recurrent.onnx", method, "--recurrent")
    parallel = rewritten_session(transformers_export(arch, False), tmp_path / "parallel.onnx", method)
    for mask in (left, right):
        actual = forced_logits(ours, "builder", ids, mask, prefill=5)
        whole = {"input_ids": ids, "attention_mask": mask, "position_ids": positions_of(mask)}
        for expected in (forced_logits(recurrent, "recurrent", ids, mask, prefill=5), parallel.run(None, whole)[0]):
            real = mask.astype(bool)
            assert np.abs(actual - expected)[real].max() <= 1e-4 * np.abs(expected).max()


def with_rotary_on_half(source: Path, out: Path) -> Path:
    """A copy of the builder folder whose rotary tables are half as wide: every operator turns
    only the first half of each head's features (partial rotary, as Phi's)."""
    shutil.copytree(source, out)
    model = onnx.load(out / "model.onnx")
    for table in model.graph.initializer:
        if table.name in ("cos_cache", "sin_cache"):
            half = onnx.numpy_helper.to_array(table)[:, : table.dims[1] // 2]
            table.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(half), table.name))
    (out / "model.onnx.data").unlink()
    onnx.save(model, out / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    return out


ROTATIONS = {  # the builder folder as each kind of rotation has it
    "llama": lambda builder, tmp: builder("llama", "fp32"),
    "qwen2": lambda builder, tmp: builder("qwen2", "fp32"),
    "interleaved-first-layer": lambda builder, tmp: with_first_attention_attributes(
        builder("llama", "fp32"), tmp / "interleaved", rotary_interleaved=1
    ),
    "partial": lambda builder, tmp: with_rotary_on_half(builder("llama", "fp32"), tmp / "partial"),
}


@pytest.mark.parametrize("rotation", list(ROTATIONS))
def test_a_recurrent_builder_model_rotates_with_the_operator_unless_standard_ops(builder, rotation, tmp_path, capsys):
    """The recurrent rewrite of a GroupQueryAttention turns its queries and keys with
    com.microsoft.RotaryEmbedding on the operator's tables (two nodes a layer, where standard
    operators take two dozen), stepped through a left-padded batch to the logits of
    --standard-ops: halves or interleaved pairs, every feature or the first half."""
    source = ROTATIONS[rotation](builder, tmp_path) / "model.onnx"
    ids = np.random.default_rng(0).integers(3, 256, (2, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    logits, models = {}, {}
    for flags in ([], ["--standard-ops"]):
        out = tmp_path / f"recurrent{len(flags)}.onnx"
        session = rewritten_session(source, out, ["hedgehog", "-O", "window=4"], "--recurrent", *flags)
        models[bool(flags)] = onnx.load(out)
        logits[bool(flags)] = forced_logits(session, "builder", ids, mask, prefill=5)
    capsys.readouterr()
    layers = sum(n.op_type == "GroupQueryAttention" for n in onnx.load(source).graph.node)
    rotations = {flag: sum(n.op_type == "RotaryEmbedding" for n in m.graph.node) for flag, m in models.items()}
    assert rotations == {False: 2 * layers, True: 0}
    real = mask.astype(bool)
    np.testing.assert_allclose(logits[False][real], logits[True][real], rtol=0, atol=1e-5 * np.abs(logits[True]).max())


@pytest.mark.parametrize("interleaved", [0, 1])
def test_the_torch_evaluation_of_rotary_embedding_is_onnxruntimes(interleaved):
    """What fine-tuning runs in torch for the node: packed heads, the first 4 of 8 features
    turned at each row's own positions."""
    from onnx import TensorProto, helper

    x, positions = np.random.default_rng(0).standard_normal((2, 3, 16), np.float32), np.array([[0, 1, 2], [5, 6, 7]])
    angles = np.arange(10)[:, None] * np.array([1.0, 0.1])[None]
    tables = {"cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    node = helper.make_node(
        "RotaryEmbedding",
        ["x", "position_ids", *tables],
        ["y"],
        domain="com.microsoft",
        interleaved=interleaved,
        num_heads=2,
        rotary_embedding_dim=4,
    )
    graph = helper.make_graph(
        [node],
        "rotary",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, positions.shape),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [onnx.numpy_helper.from_array(v, k) for k, v in tables.items()],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    feeds = {"x": x, "position_ids": positions}
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = TorchGraph(ir.serde.deserialize_model(proto).graph, []).run(feeds, {})[0].numpy()
    np.testing.assert_allclose(actual, expected, atol=1e-6)
    assert not np.allclose(expected, x)


PARALLEL_METHODS = {  # every causal method
    "linear": ["linear"],
    "hedgehog": ["hedgehog"],
    "hedgehog-window": ["hedgehog", "-O", "window=4", "-O", "sinks=1"],
    "favor": ["favor"],
    "aft": ["aft"],
    "lsh": ["lsh"],
    "efficient": ["efficient"],
    "hydra": ["hydra"],
    "streaming": ["streaming", "-O", "recent=4"],
    "streaming-no-sinks": ["streaming", "-O", "recent=4", "-O", "sinks=0"],  # the operator's own local window
}


@pytest.mark.parametrize(
    "arch, method", [*(("llama", m) for m in PARALLEL_METHODS), ("qwen2", "hedgehog"), ("qwen2", "hedgehog-window")]
)
def test_the_builder_models_parallel_rewrite_is_the_transformers_exports(
    builder, transformers_export, arch, method, tmp_path
):
    """Without --recurrent the builder's model keeps its cache, written as the operator writes
    it, and its logits are those of the parallel rewrite of the same weights' no-cache export:
    a right-padded prompt in one call, and prefilled then stepped a token at a time."""
    source = builder(arch, "fp32") / "model.onnx"
    ours = rewritten_session(source, tmp_path / "builder.onnx", PARALLEL_METHODS[method])
    parallel = rewritten_session(transformers_export(arch, False), tmp_path / "parallel.onnx", PARALLEL_METHODS[method])
    ids = np.random.default_rng(0).integers(3, 256, (2, 12)).astype(np.int64)
    full, right = np.ones((2, 12), np.int64), np.ones((2, 12), np.int64)
    right[1, 9:] = 0
    for mask, prefill in ((right, 12), (full, 5)):
        expected = parallel.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions_of(mask)})[0]
        actual = forced_logits(ours, "builder", ids, mask, prefill=prefill)
        assert np.abs(actual - expected)[mask.astype(bool)].max() <= 1e-4 * np.abs(expected).max()
    # the first layer's cache is the operator's, the pads of the right-padded prompt included
    empty = {i.name: np.zeros((2, 2, 0, 16), np.float32) for i in ours.get_inputs() if i.name.startswith("past")}
    feeds = {"input_ids": ids, "attention_mask": right, **empty}
    original = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    names = ["present.0.key", "present.0.value"]
    for written, operators in zip(ours.run(names, feeds), original.run(names, feeds)):
        assert np.abs(written - operators).max() <= 1e-6


# --- genai runs the rewritten folders ------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, precision, method",
    [("llama", "fp32", ["hedgehog", "-O", "window=4"]), ("qwen2", "int4", ["favor"])],
    ids=["llama-hedgehog-window", "qwen2-int4-favor"],
)
def test_genai_generates_from_the_parallel_folder_what_attnrewrite_generate_does(
    builder, arch, precision, method, tmp_path
):
    """genai shares one buffer between each past and present cache: the parallel rewrite's cache
    write keeps to it, and its genai_config.json is the builder's."""
    source, out = builder(arch, precision), tmp_path / "out"
    out.mkdir()
    assert cli.main([str(source), "-o", f"{out}/", "--to", *method]) == 0
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, 0)
    assert json.loads((out / "genai_config.json").read_text()) == json.loads((source / "genai_config.json").read_text())


@pytest.mark.parametrize(
    "arch, precision, method",
    [
        ("llama", "fp32", ["hedgehog"]),
        ("llama", "fp32", ["hedgehog", "-O", "window=4"]),
        ("llama", "fp32", ["hedgehog", "-O", "window=4", "-O", "sparse=3"]),
        ("llama", "int4", ["hedgehog"]),
        ("qwen2", "fp32", ["favor"]),
        ("qwen2", "int4", ["linear"]),
        ("llama", "fp32", ["streaming", "-O", "recent=5"]),  # a ring of 5 keys and 4 sinks: 27 positions pass it
        ("llama", "fp32", ["streaming", "-O", "recent=5", "-O", "sinks=0"]),
    ],
    ids=[
        "llama-hedgehog",
        "llama-hedgehog-window",
        "llama-hedgehog-sparse",
        "llama-int4",
        "qwen2-favor",
        "qwen2-int4",
        "llama-streaming",
        "llama-streaming-without-sinks",
    ],
)
def test_genai_generates_from_the_recurrent_folder_what_attnrewrite_generate_does(
    builder, arch, precision, method, tmp_path
):
    source = builder(arch, precision)
    out = rewrite_to_folder(source, tmp_path / "made" / "out", "--to", *method)  # with its parent
    assert list((tmp_path / "made").iterdir()) == [out]  # nothing written beside the folder
    assert sorted(p.name for p in out.iterdir()) == [
        "genai_config.json",
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, 0)
    # everything in the builder's config is kept but the decoder's inputs and outputs
    given, written = (json.loads((f / "genai_config.json").read_text()) for f in (source, out))
    given_decoder, written_decoder = given["model"].pop("decoder"), written["model"].pop("decoder")
    assert written["model"] == given["model"]
    assert {k: v for k, v in written_decoder.items() if k not in ("inputs", "outputs")} == {
        k: v for k, v in given_decoder.items() if k not in ("inputs", "outputs")
    }
    assert written_decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_recurrent_names": "past_key_values.%d.recurrent_state",
        "past_conv_names": "past_key_values.%d.conv_state",
    }
    assert written["search"] == {**given["search"], "past_present_share_buffer": False}


def with_first_attention_attributes(source: Path, out: Path, **attributes) -> Path:
    """A copy of the builder folder whose first GroupQueryAttention has ``attributes``."""
    shutil.copytree(source, out)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    first = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    kept = [a for a in first.attribute if a.name not in attributes]
    del first.attribute[:]
    first.attribute.extend([*kept, *(onnx.helper.make_attribute(k, v) for k, v in attributes.items())])
    onnx.save(model, out / "model.onnx")
    return out


def with_a_sliding_window_in_layer_0(source: Path, out: Path) -> Path:
    """The first layer attends only its last 4 keys (``local_window_size``, as the builder
    writes Mistral's or Gemma 3's local layers)."""
    return with_first_attention_attributes(source, out, local_window_size=4)


@pytest.mark.parametrize("attributes", [{}, {"local_window_size": 4}, {"softcap": 2.0}, {"smooth_softmax": 1}], ids=str)
def test_a_group_query_attention_left_alone_is_evaluated_in_torch_as_onnxruntime_runs_it(builder, attributes, tmp_path):
    """The fitting's torch evaluation of the whole graph (fine-tuning a hybrid) runs the
    operator on prompts as onnxruntime does: packed qkv, rotary inside, right padding."""
    source = with_first_attention_attributes(builder("llama", "fp32"), tmp_path / "source", **attributes)
    model = ir.serde.deserialize_model(onnx.load(source / "model.onnx"))
    ids = np.random.default_rng(0).integers(3, 256, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    feeds |= {v.name: np.zeros((2, 2, 0, 16), np.float32) for v in model.graph.inputs if v.name.startswith("past_")}
    expected = ort.InferenceSession(str(source / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], feeds
    )[0]
    actual = TorchGraph(model.graph, []).run(feeds, {})[0].numpy()
    np.testing.assert_allclose(actual[mask == 1], expected[mask == 1], atol=1e-5)


def test_a_sliding_window_layer_keeps_its_kv_cache_beside_the_recurrent_layers(builder, tmp_path, capsys):
    """A site left alone keeps its KV cache in the recurrent model (a hybrid, as genai runs
    Qwen3.5's): the run gate and --check feed both; genai generates what attnrewrite generate
    does; stepped token by token it gives its one-call prefill's logits."""
    source = with_a_sliding_window_in_layer_0(builder("llama", "fp32"), tmp_path / "source")
    windowed = find_sites(str(source / "model.onnx"))[0]  # listed with its heads and cache, refused
    assert windowed.kv_cache == KvCache(
        "past_key_values.0.key", "past_key_values.0.value", "present.0.key", "present.0.value", 2
    )
    assert (windowed.num_heads, windowed.head_dim, windowed.scale) == (4, 16, 0.25)
    out = rewrite_to_folder(source, tmp_path / "out", "--to", "hedgehog", "-O", "window=4", "--check")
    printed = capsys.readouterr().out
    assert "skipped: GroupQueryAttention attends to a local window of 4 keys (sliding-window attention)" in printed
    assert "the sites left alone keep their KV caches (past_key_values.0.key, past_key_values.0.value)" in printed
    assert "1 of 2 attention sites replaced by hedgehog" in printed
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [
        "input_ids",
        "attention_mask",
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.recurrent_state",
        "past_key_values.1.conv_state",
    ]
    decoder = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["inputs"]["past_recurrent_names"] == "past_key_values.%d.recurrent_state"
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, 0)
    # stepped token by token, the hybrid gives the parallel rewrite's logits (both keep layer 0's
    # cache); rows without padding: onnxruntime's sliding window itself steps as it prefills only then
    parallel = tmp_path / "parallel.onnx"
    assert cli.main([str(source), "--to", "hedgehog", "-O", "window=4", "-o", str(parallel)]) == 0
    ids = np.random.default_rng(0).integers(3, 256, (2, 12))
    mask = np.ones_like(ids)
    expected = forced_logits(
        ort.InferenceSession(str(parallel), providers=["CPUExecutionProvider"]), "p", ids, mask, 12
    )
    for prefill in (1, 5, 12):
        np.testing.assert_allclose(forced_logits(session, "hybrid", ids, mask, prefill), expected, atol=1e-5)


def test_a_builder_model_is_calibrated_and_checked_as_it_generates(builder, tmp_path, capsys):
    """Calibration collects the recurrent replacements' q, k, v from prefills of the builder
    model (its caches sized from the operator, not their symbolic declaration), and --check runs
    both models as they generate."""
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(3, 256, rng.integers(20, 60))) for _ in range(24)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    source = builder("llama", "fp32")
    (tmp_path / "tokenizer").mkdir()
    tokenizer = str(shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer"))  # alone, as a calibration's may be
    out = rewrite_to_folder(
        source, tmp_path / "out", "--to", "hedgehog", "-O", "window=4", "--calibrate", str(tmp_path / "texts.txt"),
        "--tokenizer", tokenizer, "--max-length", "48", "--check",
    )  # fmt: skip
    printed = capsys.readouterr()
    assert "calibrating site 2/2 (layer 1)" in printed.err and "kept calibrated" in printed.err
    assert "prefill of 56 tokens, then 8 one at a time" in printed.out  # the check, as both generate
    assert (out / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, 0)


@pytest.mark.parametrize(
    "precision, hybrid",
    [("fp32", False), ("fp32", True), ("int4", False)],
    ids=["every-layer", "beside-a-sliding-window", "int4"],
)
def test_a_builder_model_is_fine_tuned_on_its_packed_projections(builder, precision, hybrid, tmp_path, capsys):
    """--finetune evaluates the builder's graph in torch (its SimplifiedLayerNormalization and
    SkipSimplifiedLayerNormalization included; a sliding window's GroupQueryAttention left
    alone too; at int4 its MatMulNBits, beside which adapters are written), puts adapters on each
    replaced layer's packed qkv and output projections, and writes a folder genai generates from."""
    rng = np.random.default_rng(1)
    texts = [" ".join(f"w{i}" for i in rng.integers(3, 256, rng.integers(20, 60))) for _ in range(24)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    source = builder("llama", precision)
    if hybrid:
        source = with_a_sliding_window_in_layer_0(source, tmp_path / "source")
    out = rewrite_to_folder(
        source, tmp_path / "out", "--to", "hedgehog", "--calibrate", str(tmp_path / "texts.txt"),
        "--tokenizer", str(source / "tokenizer.json"), "--max-length", "48", "--finetune", "3",
    )  # fmt: skip
    layers = [1] if hybrid else [0, 1]
    quantized = precision == "int4"
    beside = f", {2 * len(layers)} of them beside quantized weights" if quantized else ""
    adapters = f"fine-tuning {2 * len(layers)} adapters (rank 8{beside}) on {len(layers)} sites"
    assert adapters in capsys.readouterr().err
    finetune = read_record(onnx.load(out / "model.onnx", load_external_data=False))["finetune"]
    suffix = "MatMul_Q4" if quantized else "MatMul"
    assert [site["projections"] for site in finetune["adapted"]] == [
        [f"/model/layers.{i}/attn/qkv_proj/{suffix}", f"/model/layers.{i}/attn/o_proj/{suffix}"] for i in layers
    ]
    assert [site["beside"] for site in finetune["adapted"]] == [
        site["projections"] if quantized else [] for site in finetune["adapted"]
    ]
    # an adapter beside is three nodes, written only where the fine-tuned values are kept
    kept = finetune["held_out"]["kept"] == "fine-tuned" and "kept_unfitted" not in finetune
    model = onnx.load(out / "model.onnx", load_external_data=False)
    added = [n for n in model.graph.node if "/adapter/" in n.name]
    assert len(added) == (3 * 2 * len(layers) if quantized and kept else 0)
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, 0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_genai_runs_the_recurrent_rewrite_of_an_optimum_style_export(decoder_exports, name, tmp_path, capsys):
    """tests/decoders.py's KV-cache exports (position_ids among their inputs), beside the
    transformers config.json they would ship with: the genai_config.json is built from it."""
    cached = decoder_exported(decoder_exports, name, "legacy")
    source = tmp_path / "export"
    source.mkdir()
    shutil.copyfile(cached.path, source / "model.onnx")
    cached.model.config.save_pretrained(source)
    out = rewrite_to_folder(source / "model.onnx", tmp_path / "out", "--to", "hedgehog", "-O", "window=4")
    assert "genai_config.json beside it" in capsys.readouterr().out
    config = json.loads((out / "genai_config.json").read_text())["model"]
    assert config["type"] == "llama" and config["vocab_size"] == cached.spec.vocab  # genai's plain decoder
    assert config["decoder"]["num_hidden_layers"] == cached.spec.layers
    assert config["decoder"]["inputs"]["position_ids"] == "position_ids"
    assert genai_tokens(out) == padded_to(our_tokens(out), NEW_TOKENS, config["pad_token_id"])


def test_a_folder_output_without_any_config_is_refused_in_one_line(decoder_exports, tmp_path, capsys):
    cached = decoder_exported(decoder_exports, "llama", "legacy")
    source = tmp_path / "model.onnx"
    shutil.copyfile(cached.path, source)
    (tmp_path / "out").mkdir()
    assert cli.main([str(source), "--to", "linear", "--recurrent", "-o", f"{tmp_path}/out/"]) == 2
    assert capsys.readouterr().err == (
        f"attnrewrite: error: no genai_config.json and no transformers config.json beside the model (in {tmp_path}): "
        "a genai folder needs the model's context length and special tokens from one of them\n"
    )
    assert not any((tmp_path / "out").iterdir())  # refused before anything was written


def test_the_input_folder_is_never_the_output_folder(builder, capsys):
    folder = builder("llama", "fp32")
    capsys.readouterr()  # what making the folder printed
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.suffix == ".json"}
    assert cli.main([str(folder), "--to", "linear", "--recurrent", "-o", f"{folder}/"]) == 2
    assert capsys.readouterr().err == (
        f"attnrewrite: error: {folder}/: is the input model's folder; its files would be overwritten\n"
    )
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.suffix == ".json"} == before
