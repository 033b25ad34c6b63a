"""FX frontend on transformers models through torch.export: BertModel, GPT2Model and ViTModel
(eager and sdpa attention), before and after run_decompositions(); gradients through the
rewritten graph; the pass module's buffers in the state_dict.

The reference runs the original model with transformers' attention function swapped for the
pass module on the same q, k, v, with key_keep from the test's own attention_mask input.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
from torch import nn

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import find_fx_sites, rewrite_graph_module
from attnrewrite.passes.layout import expand_to_query_heads
from attnrewrite.site import MaskKind

HIDDEN, HEADS, LAYERS, VOCAB = 32, 4, 2, 100
BATCH, SEQ = 2, 8

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


class TextEncoder(nn.Module):
    """transformers models misread positional inputs: call them by name."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ImageEncoder(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


def transformers_model(name: str, attention: str) -> nn.Module:
    """A small transformers model from a config (random weights, seeded): bert, gpt2, llama
    (grouped key and value heads) or vit, with ``attention`` as its attention implementation."""
    torch.manual_seed(0)
    common = dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS, attn_implementation=attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "bert":
            config = transformers.BertConfig(
                vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, max_position_embeddings=64, **common
            )
            return transformers.BertModel(config, add_pooling_layer=False).eval()
        if name == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=64,
                attn_implementation=attention,
            )
            return transformers.GPT2Model(config).eval()
        if name == "llama":
            config = transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=2 * HIDDEN,
                num_key_value_heads=HEADS // 2,
                max_position_embeddings=64,
                **common,
            )
            return transformers.LlamaModel(config).eval()
        config = transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, **common
        )
        return transformers.ViTModel(config, add_pooling_layer=False).eval()


def build(name: str, attention: str) -> nn.Module:
    wrapper = ImageEncoder if name == "vit" else TextEncoder
    return wrapper(transformers_model(name, attention)).eval()


def model_inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        return (torch.randn(BATCH, 3, 16, 16, generator=generator),)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - 3 :] = 0  # the second row ends in three padded tokens
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator), mask


EXPECTED_MASK = {"bert": MaskKind.KEY_PADDING, "gpt2": MaskKind.CAUSAL_KEY_PADDING, "vit": MaskKind.NONE}
MODELS = [(name, attention) for name in ("bert", "gpt2", "vit") for attention in ("eager", "sdpa")]


@functools.cache
def exported(name: str, attention: str, decomposed: bool = False) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(build(name, attention), model_inputs(name))
        return program.run_decompositions() if decomposed else program


@contextlib.contextmanager
def attention_swapped(modules: list[nn.Module], key_keep: torch.Tensor | None):
    """transformers' eager and sdpa attention functions replaced by modules[i] for layer i (grouped
    key and value heads repeated per query head, as the pass modules take them)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    calls = iter(modules)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = expand_to_query_heads(key, query), expand_to_query_heads(value, query)
        out = next(calls)(query, key, value, key_keep)
        return out.transpose(1, 2).contiguous(), None  # [B, N, H, D], as transformers returns it

    for implementation in ("eager", "sdpa"):
        ALL_ATTENTION_FUNCTIONS[implementation] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(saved)


def reference(name: str, attention: str, method: str, sites, args) -> torch.Tensor:
    method_module = passes.get_pass(method)
    modules = [method_module.torch_module(site, passes.make_options(method_module)) for site in sites]
    key_keep = None if name == "vit" else args[1][:, None, :, None].float()  # [B, 1, Nk, 1]
    with attention_swapped(modules, key_keep), torch.no_grad():
        return build(name, attention)(*args)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def is_softmax_attention(node) -> bool:
    return "softmax" in str(node.target) or "scaled_dot_product" in str(node.target)


@pytest.mark.parametrize("method", ["hydra", "linear"])
@pytest.mark.parametrize(("name", "attention"), MODELS)
def test_transformers_model(name, attention, method):
    gm = rewrite_graph_module(exported(name, attention), method)
    record = gm.meta["attnrewrite"]
    assert record["sites_found"] == LAYERS and record["sites_rewritten"] == LAYERS, record
    assert [s["layer"] for s in record["sites"]] == list(range(LAYERS))
    assert {s["mask"] for s in record["sites"]} == {EXPECTED_MASK[name].value}
    assert [(s["num_heads"], s["head_dim"], s["scale"]) for s in record["sites"]] == [
        (HEADS, 8, pytest.approx(8**-0.5))
    ] * LAYERS
    assert not any(is_softmax_attention(n) for n in gm.graph.nodes)

    args = model_inputs(name, seed=1)  # not the traced values: the mask comes from the input
    with torch.no_grad():
        rewritten = gm(*args)
    expected = reference(name, attention, method, find_fx_sites(exported(name, attention)), args)
    assert relative_error(rewritten, expected) < 1e-5


@pytest.mark.parametrize(("name", "attention"), [("bert", "eager"), ("bert", "sdpa"), ("gpt2", "eager")])
def test_after_run_decompositions(name, attention):
    """aten.bmm / _softmax / _safe_softmax / mul.Scalar forms: the same sites, the same result."""
    decomposed = rewrite_graph_module(exported(name, attention, decomposed=True), "linear")
    plain = rewrite_graph_module(exported(name, attention), "linear")
    sites = decomposed.meta["attnrewrite"]["sites"]
    assert [(s["status"], s["mask"], s["scale"]) for s in sites] == [
        (s["status"], s["mask"], pytest.approx(s["scale"])) for s in plain.meta["attnrewrite"]["sites"]
    ]
    assert not any(is_softmax_attention(n) for n in decomposed.graph.nodes)
    args = model_inputs(name, seed=2)
    with torch.no_grad():
        assert relative_error(decomposed(*args), plain(*args)) < 1e-5


def test_exported_with_dynamic_shapes():
    """Sizes are symbolic in the graph's metadata: the masks are probed at made-up lengths and
    the rewritten graph runs at any batch and length."""
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=64)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(build("gpt2", "sdpa"), model_inputs("gpt2"), dynamic_shapes=shapes)
    gm = rewrite_graph_module(program, "hydra")
    assert [s["mask"] for s in gm.meta["attnrewrite"]["sites"]] == ["causal+key_padding"] * LAYERS
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 13, dtype=torch.int64)
    mask[2, 9:] = 0
    with torch.no_grad():
        rewritten = gm(ids, mask)
    expected = reference("gpt2", "sdpa", "hydra", find_fx_sites(program), (ids, mask))
    assert relative_error(rewritten, expected) < 1e-5


def test_python_api_dispatches_torch_models_here():
    program = exported("bert", "sdpa")
    gm = attnrewrite.rewrite(program, to="hydra", layers=[1])
    assert isinstance(gm, torch.fx.GraphModule)
    assert [s["status"] for s in gm.meta["attnrewrite"]["sites"]] == ["skipped", "rewritten"]
    assert len(attnrewrite.find_sites(program)) == LAYERS


def test_rewriting_twice_changes_nothing():
    once = rewrite_graph_module(exported("gpt2", "eager"), "linear")
    twice = rewrite_graph_module(once, "linear")
    assert twice.meta["attnrewrite"]["sites_found"] == 0
    args = model_inputs("gpt2", seed=3)
    with torch.no_grad():
        assert torch.equal(once(*args), twice(*args))


# --- training ---------------------------------------------------------------------------------


def gradient_step_changes_loss(model: nn.Module, args) -> None:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    target = torch.zeros(())

    def loss():
        return (model(*args) - target).pow(2).mean()

    before = loss()
    optimizer.zero_grad()
    before.backward()
    projections = [(n, p) for n, p in model.named_parameters() if any(k in n for k in ("query", "c_attn"))]
    assert projections and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in projections)
    optimizer.step()
    assert loss().item() < before.item()


@pytest.mark.parametrize(("name", "method"), [("bert", "hydra"), ("gpt2", "linear")])
def test_gradient_step_through_the_replacement(name, method):
    gm = rewrite_graph_module(exported(name, "sdpa"), method)
    gradient_step_changes_loss(gm, model_inputs(name))


def test_random_features_are_buffers_saved_in_the_state_dict():
    if "favor" not in passes.PASSES:
        pytest.skip("no favor pass in this checkout")
    gm = rewrite_graph_module(exported("bert", "sdpa"), "favor", seed=3)
    saved = {k: v for k, v in gm.state_dict().items() if "favor_attention" in k}
    assert saved and gm.meta["attnrewrite"]["seed"] == 3
    args = model_inputs("bert")
    with torch.no_grad():
        first, second = gm(*args), gm(*args)
        assert torch.equal(first, second)  # never redrawn at inference
        again = rewrite_graph_module(exported("bert", "sdpa"), "favor", seed=3)
        for key, value in saved.items():
            assert torch.equal(again.state_dict()[key], value)  # same seed, same features
        again.load_state_dict(gm.state_dict())
        assert torch.equal(again(*args), first)
