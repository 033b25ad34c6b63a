"""FX frontend on nn.MultiheadAttention, also inside nn.TransformerEncoder(Layer), which
symbolic_trace keeps as leaf modules: the rewrite swaps the attention inside them, keeps their
calling convention (key_padding_mask, attn_mask, is_causal) and bypasses their fused fast path.

References are written out here from the modules' weights (post-norm encoder layer, packed
in-projection), with the pass module on [batch, heads, seq, head_dim] and key_keep taken from
the test's own padding mask.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnrewrite
from attnrewrite import passes
from attnrewrite.errors import NothingRewritten
from attnrewrite.fx import find_fx_sites, rewrite_graph_module
from attnrewrite.site import MaskKind

DIM, HEADS, HEAD_DIM, LAYERS = 32, 4, 8, 2
BATCH, SEQ = 2, 6


def padding(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """True = padding (nn.MultiheadAttention's convention): row 1 ends in two pads."""
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[1, -2:] = True
    return pad


def sequence(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seq))


def pass_module(method: str, site):
    method_module = passes.get_pass(method)
    return method_module.torch_module(site, passes.make_options(method_module))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def attention_block(mha: nn.MultiheadAttention, x: torch.Tensor, attend) -> torch.Tensor:
    """nn.MultiheadAttention's projections (batch_first) around attend(q, k, v)."""
    b, n, e = x.shape
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    split = lambda t: t.view(b, n, mha.num_heads, e // mha.num_heads).transpose(1, 2)  # noqa: E731
    return mha.out_proj(attend(split(q), split(k), split(v)).transpose(1, 2).reshape(b, n, e))


def reference_encoder(encoder: nn.TransformerEncoder, x: torch.Tensor, attends) -> torch.Tensor:
    """Post-norm layers (dropout 0), attends[i] in layer i."""
    for layer, attend in zip(encoder.layers, attends):
        x = layer.norm1(x + attention_block(layer.self_attn, x, attend))
        x = layer.norm2(x + layer.linear2(F.relu(layer.linear1(x))))
    return x


class Encoder(nn.Module):
    def __init__(self, causal: str | None, padded: bool = False):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.causal = causal  # None, "detected" (mask, is_causal=None) or "hinted" (is_causal=True)
        self.padded = padded

    def forward(self, x, padding=None):
        padding = padding if self.padded else None
        if self.causal is None:
            return self.encoder(x, src_key_padding_mask=padding)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.encoder(
            x, mask=mask, src_key_padding_mask=padding, is_causal=True if self.causal == "hinted" else None
        )


ENCODER_CASES = [
    (None, False, MaskKind.NONE),
    (None, True, MaskKind.KEY_PADDING),
    ("detected", False, MaskKind.CAUSAL),
    ("hinted", True, MaskKind.CAUSAL_KEY_PADDING),
]


@pytest.mark.parametrize("method", ["hydra", "linear"])
@pytest.mark.parametrize(("causal", "padded", "mask"), ENCODER_CASES)
def test_transformer_encoder(causal, padded, mask, method):
    model = Encoder(causal, padded).eval()
    gm = rewrite_graph_module(model, method)
    record = gm.meta["attnrewrite"]
    assert [(s["name"], s["layer"], s["mask"], s["status"]) for s in record["sites"]] == [
        (f"encoder.layers.{i}.self_attn", i, mask.value, "rewritten") for i in range(LAYERS)
    ]
    assert [(s["num_heads"], s["head_dim"]) for s in record["sites"]] == [(HEADS, HEAD_DIM)] * LAYERS
    assert "LinearizedTransformerEncoder" in str(gm) and type(gm.encoder).__name__ == "LinearizedTransformerEncoder"

    x = sequence()
    pad = padding() if padded else None
    keep = None if pad is None else (~pad)[:, None, :, None].float()
    modules = [pass_module(method, site) for site in find_fx_sites(Encoder(causal, padded).eval())]
    with torch.no_grad():  # no_grad + eval is where nn.TransformerEncoderLayer's fused path runs
        rewritten = gm(x, pad)
        expected = reference_encoder(model.encoder, x, [lambda q, k, v, m=m: m(q, k, v, keep) for m in modules])
    assert relative_error(rewritten, expected) < 1e-5


def test_transformer_encoder_keeps_its_state_dict_and_calling_convention():
    model = Encoder("detected", padded=True).eval()
    gm = rewrite_graph_module(model, "linear")
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    gm.load_state_dict(model.state_dict())
    with torch.no_grad():  # a float key padding mask (-inf = pad) works like the bool one
        as_float = torch.zeros(BATCH, SEQ).masked_fill(padding(), float("-inf"))
        assert torch.allclose(gm(sequence(), padding()), gm(sequence(), as_float), atol=1e-6)


def test_layers_selects_what_is_rewritten():
    model = Encoder(None).eval()
    gm = rewrite_graph_module(model, "hydra", layers=[1])
    sites = gm.meta["attnrewrite"]["sites"]
    assert [s["status"] for s in sites] == ["skipped", "rewritten"]
    assert sites[0]["reason"] == "layer 0 is not among the selected layers"

    module = pass_module("hydra", find_fx_sites(Encoder(None).eval())[1])
    softmax = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    x = sequence()
    with torch.no_grad():
        expected = reference_encoder(model.encoder, x, [softmax, lambda q, k, v: module(q, k, v, None)])
        assert relative_error(gm(x), expected) < 1e-5


@pytest.mark.parametrize("frontend", ["fx", "onnx"])
def test_api_warns_when_nothing_was_rewritten(frontend, tmp_path):
    if frontend == "fx":
        model = Encoder(None).eval()
    else:
        model = Path(__file__).parents[1] / "samples" / "tiny_bert.onnx"
    with pytest.warns(NothingRewritten) as caught:
        attnrewrite.rewrite(model, to="hydra", layers=[7])
    assert [str(w.message) for w in caught] == [
        "attnrewrite: none of the 2 attention sites could be rewritten; the model is returned unchanged (the record says why)"
    ]


def test_transformer_encoder_layer_alone():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True).eval()
    gm = rewrite_graph_module(layer, "linear")  # held as gm.module: symbolic_trace cannot enter it
    assert type(gm.get_submodule("module.self_attn")).__name__ == "LinearizedMultiheadAttention"
    site = find_fx_sites(layer)[0]
    assert (site.name, site.mask) == ("module.self_attn", MaskKind.NONE)
    module = pass_module("linear", site)
    x = sequence()
    with torch.no_grad():
        expected = reference_encoder(
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), x, [lambda q, k, v: module(q, k, v, None)]
        )
        assert relative_error(gm(x), expected) < 1e-5


# --- nn.MultiheadAttention called directly ------------------------------------------------------


class SelfAttention(nn.Module):
    """x -> nn.MultiheadAttention(x, x, x, key_padding_mask=padding)[0]; need_weights is True
    by default, and the weights go unused."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first)

    def forward(self, x, padding):
        return self.attention(x, x, x, key_padding_mask=padding)[0]


class CausalBuiltInGraph(SelfAttention):
    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]


class CausalHinted(SelfAttention):
    def forward(self, x, mask):
        return self.attention(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]


class UserMask(SelfAttention):
    def forward(self, x, mask):
        return self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]


class WeightsUsed(SelfAttention):
    def forward(self, x):
        out, weights = self.attention(x, x, x)
        return out + weights.mean()


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_key_padding(batch_first):
    model = SelfAttention(batch_first).eval()
    gm = rewrite_graph_module(model, "hydra")
    site = find_fx_sites(model)[0]
    assert (site.name, site.mask, site.num_heads) == ("attention", MaskKind.KEY_PADDING, HEADS)
    assert "HydraAttention" in str(gm)
    x, pad = sequence(), padding()
    module = pass_module("hydra", site)
    keep = (~pad)[:, None, :, None].float()
    with torch.no_grad():
        expected = attention_block(model.attention, x, lambda q, k, v: module(q, k, v, keep))
        actual = gm(x if batch_first else x.transpose(0, 1), pad)
        actual = actual if batch_first else actual.transpose(0, 1)
    assert relative_error(actual, expected) < 1e-5


def test_multihead_attention_causal_mask_built_in_graph_or_hinted():
    in_graph = find_fx_sites(CausalBuiltInGraph())[0]
    assert in_graph.mask is MaskKind.CAUSAL and in_graph.skip_reason is None
    hinted = rewrite_graph_module(CausalHinted().eval(), "linear")
    assert hinted.meta["attnrewrite"]["sites"][0]["mask"] == "causal"
    module = pass_module("linear", in_graph)
    x = sequence()
    with torch.no_grad():
        expected = attention_block(SelfAttention().attention, x, lambda q, k, v: module(q, k, v, None))
        causal_mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        assert relative_error(hinted(x, causal_mask), expected) < 1e-5
        assert relative_error(rewrite_graph_module(CausalBuiltInGraph().eval(), "linear")(x), expected) < 1e-5


def test_multihead_attention_left_alone_when_not_understood():
    record = rewrite_graph_module(WeightsUsed().eval(), "hydra").meta["attnrewrite"]
    assert record["sites_rewritten"] == 0
    assert "attention weights of nn.MultiheadAttention are used" in record["sites"][0]["reason"]

    # a square attn_mask given as an input, without is_causal: its kind cannot be proven
    record = rewrite_graph_module(UserMask().eval(), "hydra").meta["attnrewrite"]
    assert record["sites_rewritten"] == 0
    assert "pass is_causal=True if it is a causal mask" in record["sites"][0]["reason"]

    with_bias_k = SelfAttention()
    with_bias_k.attention = nn.MultiheadAttention(DIM, HEADS, batch_first=True, add_bias_kv=True)
    record = rewrite_graph_module(with_bias_k.eval(), "hydra").meta["attnrewrite"]
    assert "bias_k" in record["sites"][0]["reason"]


def test_a_module_called_twice_is_not_swapped():
    class Twice(SelfAttention):
        def forward(self, x, padding):
            return self.attention(x, x, x)[0] + self.attention(x, x, x, key_padding_mask=padding)[0]

    record = rewrite_graph_module(Twice().eval(), "hydra").meta["attnrewrite"]
    assert record["sites_found"] == 2 and record["sites_rewritten"] == 0
    assert all("is called from 2 places" in s["reason"] for s in record["sites"])


def test_decoder_layers_are_reported_not_rewritten():
    torch.manual_seed(0)
    decoder = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, batch_first=True).eval()

    class Decode(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = decoder

        def forward(self, x, memory):
            return self.decoder(x, memory)

    record = rewrite_graph_module(Decode(), "linear").meta["attnrewrite"]
    assert [s["name"] for s in record["sites"]] == ["decoder.self_attn", "decoder.multihead_attn"]
    assert all("TransformerDecoderLayer" in s["reason"] for s in record["sites"])
