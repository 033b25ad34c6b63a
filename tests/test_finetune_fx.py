"""Fine-tuning on the torch path (issue 48, ``rewrite(model, ..., finetune=...)``): peft's LoRA on the
replaced sites' own nn.Linear projections, merged back when done. The model returned is what was
trained (its next-token KL from the original equals the record's), its graph has the calibrated
rewrite's ops, and a weight shared with anything else (tied embeddings, shared layers) is left
as it was; torch.export's graphs (weighted calls on parameters, GPT-2's Conv1D) are adapted too."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from decoders import DECODERS
from test_fx_hf_dynamic import sharpened
from torch import nn

import attnrewrite
from attnrewrite.errors import AttnRewriteError
from attnrewrite.passes import finetune
from attnrewrite.passes.fit import spread_indices

VOCAB, WIDTH, HEADS = 48, 32, 4
STEPS = 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.mlp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batch, n, _ = x.shape
        q, k, v = (p(x).view(batch, n, HEADS, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, n, WIDTH))
        return x + torch.tanh(self.mlp(x))


class TinyDecoder(nn.Module):
    """Token embedding, blocks, a head tied to the embedding; ``shared``: one block used for
    every layer (ALBERT's way), so its projections are called from two places."""

    def __init__(self, layers: int = 2, shared: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block()] * layers if shared else [Block() for _ in range(layers)])
        for block in self.blocks:  # peaked attention, as a trained model's, for the fit to matter
            block.q.weight.data.mul_(3.0)
            block.k.weight.data.mul_(3.0)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(x)}


def token_batches(count: int, batch: int = 2, n: int = 16, vocab: int = VOCAB, masked: bool = False) -> list:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        example = {"input_ids": torch.randint(0, vocab, (batch, n), generator=generator)}
        if masked:
            example["attention_mask"] = torch.ones(batch, n, dtype=torch.int64)
            example["attention_mask"][-1, n - 3 :] = 0  # right padding
        batches.append(example)
    return batches


def logits_of(model, example) -> torch.Tensor:
    with torch.no_grad():
        output = model(**example)
    return output["logits"]


def kl_from_original(model, original, batches: list, mask: str | None) -> float:
    """passes.finetune's next-token KL of ``model`` from ``original`` over the batches the record's
    losses are measured on."""
    measured = [batches[i] for i in spread_indices(len(batches), finetune.MEASURED_BATCHES)]
    objective = finetune.Objective(finetune.NEXT_TOKEN_KL, 0, mask)
    return finetune.mean_loss(lambda e: [logits_of(model, e)], lambda e: [logits_of(original, e)], measured, objective)


def rewritten(model, batches, example=None, **settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnrewrite.rewrite(
            model, to="hedgehog", example_inputs=example, calibrate=batches, calibrate_steps=STEPS, **settings
        )


def call_targets(gm) -> list[str]:
    return sorted(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


def test_peft_lora_on_the_models_own_linears_merged_into_them():
    original = TinyDecoder()
    batches = token_batches(8)  # under 20 examples: nothing held out, the fine-tuned values kept
    calibrated = rewritten(original, batches)
    tuned = rewritten(original, batches, finetune=STEPS, finetune_lr=3e-3, finetune_rank=4)
    entry = tuned.meta["attnrewrite"]["finetune"]
    assert (entry["objective"], entry["rank"], entry["alpha"], entry["steps"]) == ("next_token_kl", 4, 8.0, STEPS)
    assert entry["adapted"] == [
        {"site": "blocks.0", "projections": ["blocks.0.q", "blocks.0.k", "blocks.0.v", "blocks.0.o"]},
        {"site": "blocks.1", "projections": ["blocks.1.q", "blocks.1.k", "blocks.1.v", "blocks.1.o"]},
    ]
    hedgehog = sum(p.numel() for name, p in tuned.named_parameters() if "hedgehog" in name)
    assert entry["parameters"] == hedgehog + 8 * 4 * (WIDTH + WIDTH)  # the replacements' and rank-4 A, B
    assert entry["loss_after"] < entry["loss_before"]
    # merged: what the model computes now is what was trained
    assert kl_from_original(tuned, original, batches, None) == pytest.approx(entry["loss_after"], rel=1e-4)
    assert not any("lora" in name for name in tuned.state_dict())
    assert call_targets(tuned) == call_targets(calibrated)
    assert all(p.requires_grad for p in tuned.parameters())
    before, after = dict(calibrated.named_parameters()), dict(tuned.named_parameters())
    assert torch.equal(after["embed.weight"], original.embed.weight)  # tied to the head, not a projection
    assert not torch.equal(after["blocks.0.q.weight"], before["blocks.0.q.weight"])
    assert torch.equal(after["blocks.0.mlp.weight"], before["blocks.0.mlp.weight"])


def test_a_shared_layer_gets_a_merged_copy_per_call():
    """One block for both layers: each call of its projections is lifted into its own nn.Linear
    and keeps its merged copy; the shared module itself is not changed."""
    original = TinyDecoder(shared=True)
    tuned = rewritten(original, token_batches(8), finetune=STEPS, finetune_lr=3e-3)
    entry = tuned.meta["attnrewrite"]["finetune"]
    projections = [name for site in entry["adapted"] for name in site["projections"]]
    assert len(projections) == 8 and all(name.startswith("blocks.0.") for name in projections)
    copies = sorted(n.target for n in tuned.graph.nodes if n.op == "call_module" and "lora" in str(n.target))
    assert copies == [f"attnrewrite_lora_{i}" for i in range(8)]
    for name in ("q", "k", "v", "o"):
        assert torch.equal(
            tuned.get_submodule(f"blocks.0.{name}").weight, original.blocks[0].get_submodule(name).weight
        )
    assert not torch.equal(tuned.get_submodule("attnrewrite_lora_0").weight, original.blocks[0].q.weight)


@pytest.mark.parametrize(
    "name, projections", [("llama", ["linear", "linear_1", "linear_2", "linear_3"]), ("gpt2", ["addmm", "addmm_1"])]
)
def test_a_torch_export_graph_is_finetuned_and_put_back(name, projections):
    """transformers' decoders, captured with torch.export: their projections are aten.linear and
    addmm calls on parameters (GPT-2's Conv1D, q, k and v packed), lifted into nn.Linears for peft
    and put back reading their merged weights; the tied embedding is unchanged."""
    spec = DECODERS[name]
    original = peaked(sharpened(spec.build().eval()))
    batches = token_batches(8, vocab=spec.vocab, masked=True)
    calibrated = rewritten(original, batches, example=batches[0])
    tuned = rewritten(original, batches, example=batches[0], finetune=STEPS, finetune_lr=1e-4)
    entry = tuned.meta["attnrewrite"]["finetune"]
    assert entry["objective"] == "next_token_kl"
    assert entry["adapted"][0]["projections"] == projections
    assert entry["loss_after"] < entry["loss_before"]
    assert kl_from_original(tuned, original, batches, "attention_mask") == pytest.approx(entry["loss_after"], rel=1e-4)
    assert call_targets(tuned) == call_targets(calibrated)
    assert dict(tuned.named_parameters()).keys() == dict(calibrated.named_parameters()).keys()
    embedding = original.get_input_embeddings().weight
    assert torch.equal(tuned.get_parameter(_name_of(original, embedding)), embedding)


def peaked(model: nn.Module) -> nn.Module:
    """The final norm's weight scaled up: random weights give near-uniform next-token
    distributions, whose KL from anything is tiny; a trained model's are peaked."""
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")]
    with torch.no_grad():
        norms[-1].weight.mul_(30.0)
    return model


def _name_of(model, tensor) -> str:
    return next(name for name, p in model.named_parameters() if p is tensor)


def test_input_model_is_left_as_it_was():
    original = TinyDecoder()
    state = copy.deepcopy(original.state_dict())
    rewritten(original, token_batches(4), finetune=2)
    assert all(torch.equal(state[name], value) for name, value in original.state_dict().items())


def test_multihead_attention_sites_cannot_take_adapters():
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    examples = [torch.randn(2, 10, WIDTH) for _ in range(4)]
    with pytest.raises(AttnRewriteError) as error:
        rewritten(encoder, examples, finetune=2)
    assert str(error.value) == (
        "cannot fine-tune: no site has projections to adapt "
        "(nn.MultiheadAttention packs q, k and v into one parameter, not an nn.Linear)"
    )
