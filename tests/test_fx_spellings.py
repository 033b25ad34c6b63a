"""FX frontend on hand-written attention: every spelling is found, reduced to the same site and
rewritten to exactly what the pass module computes on the same q, k, v; what must not be
rewritten is left alone with its reason.

Each model is ``Attention(spelling)``: projections and a head split around a ``spelling(self, q,
k, v, mask)`` function that symbolic_trace inlines. The reference swaps the spelling for
``module(q, k, v, key_keep)`` on the same [batch, heads, seq, head_dim] tensors, with key_keep
taken from the test's own mask input (not from the rewrite).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnrewrite import passes
from attnrewrite.fx import find_fx_sites, rewrite_graph_module
from attnrewrite.site import MaskKind

DIM, HEADS, HEAD_DIM = 32, 4, 8
BATCH, SEQ = 2, 7
SCALE = HEAD_DIM**-0.5


class Attention(nn.Module):
    def __init__(self, spelling, needs_mask: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(0.1)
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.relative_bias = nn.Parameter(torch.randn(1, HEADS, SEQ, SEQ))
        self.spelling = spelling
        self.needs_mask = needs_mask  # None, "keep" (1 = token) or "pad" (True = padding)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        out = self.spelling(self, q, k, v, mask)
        return self.o(out.transpose(1, 2).reshape(b, n, DIM))


# --- spellings: softmax(scale * q @ k^T + mask) @ v written the ways people write it ---------


def matmul_div_sqrt(m, q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def at_transpose23_method_softmax(m, q, k, v, mask):
    return ((q @ k.transpose(2, 3)) * SCALE).softmax(-1) @ v


def bmm_commuted_scale(m, q, k, v, mask):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    probs = torch.softmax(SCALE * torch.bmm(q3, k3.transpose(1, 2)), dim=2)
    return torch.bmm(probs, v3).reshape(b, h, n, d)


def aten_ops_safe_softmax(m, q, k, v, mask):
    """aten overloads written out, as torch.export leaves them: bmm, mul.Scalar, _safe_softmax."""
    aten = torch.ops.aten
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    logits = aten.mul.Scalar(aten.bmm.default(q3, aten.transpose.int(k3, 1, 2)), SCALE)
    return aten.bmm.default(aten._safe_softmax.default(logits, -1), v3).reshape(b, h, n, d)


def permute_scaled_q_softmax_module(m, q, k, v, mask):
    return m.softmax((q * SCALE) @ k.permute(0, 1, 3, 2)) @ v


def size_scale_keyword_dim(m, q, k, v, mask):
    scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    return F.softmax(scores, dim=3) @ v


def sqrt_on_q_and_k_transposed(m, q, k, v, mask):
    root = HEAD_DIM**-0.25
    return torch.softmax((q * root) @ (k.transpose(-2, -1) * root), dim=-1) @ v


def upcast_and_dropout(m, q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)).float() / HEAD_DIM**0.5
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return m.dropout(probs) @ v


def causal_masked_fill_triu(m, q, k, v, mask):
    n = q.size(2)
    scores = (q @ k.transpose(-2, -1)) * SCALE
    scores = scores.masked_fill(q.new_ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1) @ v


def causal_where_tril(m, q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) * SCALE
    keep = torch.ones_like(scores, dtype=torch.bool).tril()
    return torch.where(keep, scores, float("-inf")).softmax(-1) @ v


def key_padding_additive(m, q, k, v, mask):  # mask [B, N], 1 = token
    scores = (q @ k.transpose(-2, -1)) * SCALE + (1.0 - mask[:, None, None, :].float()) * -1e9
    return scores.softmax(-1) @ v


def key_padding_masked_fill(m, q, k, v, mask):  # mask [B, N] bool, True = padding
    scores = ((q @ k.transpose(-2, -1)) * SCALE).masked_fill(mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v


def causal_and_padding_where(m, q, k, v, mask):  # mask [B, N], 1 = token
    n = q.size(2)
    keep = q.new_ones(n, n, dtype=torch.bool).tril() & mask[:, None, None, :].bool()
    scores = torch.where(keep, (q @ k.transpose(-2, -1)) * SCALE, -1e9)
    return scores.softmax(-1) @ v


def sdpa_plain(m, q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal(m, q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_bool_key_padding_scale(m, q, k, v, mask):  # bool attn_mask: True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool(), scale=0.2)


def sdpa_additive_key_padding(m, q, k, v, mask):
    additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask == 0, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive[:, None, None, :])


SPELLINGS = [
    # (spelling, mask input convention, mask kind, scale, heads known)
    (matmul_div_sqrt, None, MaskKind.NONE, SCALE, HEADS),
    (at_transpose23_method_softmax, None, MaskKind.NONE, SCALE, HEADS),
    (bmm_commuted_scale, None, MaskKind.NONE, SCALE, None),
    (aten_ops_safe_softmax, None, MaskKind.NONE, SCALE, None),
    (permute_scaled_q_softmax_module, None, MaskKind.NONE, SCALE, HEADS),
    (size_scale_keyword_dim, None, MaskKind.NONE, SCALE, HEADS),
    (sqrt_on_q_and_k_transposed, None, MaskKind.NONE, SCALE, HEADS),
    (upcast_and_dropout, None, MaskKind.NONE, SCALE, HEADS),
    (causal_masked_fill_triu, None, MaskKind.CAUSAL, SCALE, HEADS),
    (causal_where_tril, None, MaskKind.CAUSAL, SCALE, HEADS),
    (key_padding_additive, "keep", MaskKind.KEY_PADDING, SCALE, HEADS),
    (key_padding_masked_fill, "pad", MaskKind.KEY_PADDING, SCALE, HEADS),
    (causal_and_padding_where, "keep", MaskKind.CAUSAL_KEY_PADDING, SCALE, HEADS),
    (sdpa_plain, None, MaskKind.NONE, SCALE, HEADS),
    (sdpa_causal, None, MaskKind.CAUSAL, SCALE, HEADS),
    (sdpa_bool_key_padding_scale, "keep", MaskKind.KEY_PADDING, 0.2, HEADS),
    (sdpa_additive_key_padding, "keep", MaskKind.KEY_PADDING, SCALE, HEADS),
]


def inputs(convention: str | None, batch: int = BATCH, seq: int = SEQ):
    x = torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seq))
    if convention is None:
        return (x,)
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[1:, seq - 2 :] = False  # every row but the first ends in two padded tokens
    return (x, keep.long() if convention == "keep" else ~keep)


def key_keep(convention: str | None, args) -> torch.Tensor | None:
    if convention is None:
        return None
    keep = args[1].bool() if convention == "keep" else ~args[1]
    return keep[:, None, :, None].float()  # [B, 1, Nk, 1]


def reference(model: Attention, site, method: str, convention, args) -> torch.Tensor:
    """The model with its spelling replaced by the pass module on the same q, k, v."""
    module = passes.get_pass(method).torch_module(site, passes.make_options(passes.get_pass(method)))
    keep = key_keep(convention, args)
    model.spelling = lambda m, q, k, v, mask: module(q, k, v, keep)
    with torch.no_grad():
        return model(*args)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def fx_model(spelling, convention) -> nn.Module:
    return Attention(spelling, convention).eval()


@pytest.mark.parametrize("method", ["hydra", "linear"])
@pytest.mark.parametrize(
    ("spelling", "convention", "mask", "scale", "heads"), SPELLINGS, ids=[s[0].__name__ for s in SPELLINGS]
)
def test_spelling_is_found_and_rewritten_exactly(spelling, convention, mask, scale, heads, method):
    model = fx_model(spelling, convention)
    gm = rewrite_graph_module(model, method)
    record = gm.meta["attnrewrite"]
    assert record["sites_found"] == 1 and record["sites_rewritten"] == 1, record
    site = record["sites"][0]
    assert site["mask"] == mask.value
    assert site["scale"] == pytest.approx(scale)
    assert site["num_heads"] == heads
    assert site["head_dim"] == HEAD_DIM and site["value_dim"] == HEAD_DIM
    assert not any("softmax" in str(n.target) or "scaled_dot_product" in str(n.target) for n in gm.graph.nodes)

    args = inputs(convention)
    with torch.no_grad():
        rewritten = gm(*args)
    sites = find_fx_sites(fx_model(spelling, convention))
    expected = reference(fx_model(spelling, convention), sites[0], method, convention, args)
    assert relative_error(rewritten, expected) < 1e-5


def test_rewritten_graph_calls_the_pass_module_and_keeps_the_record():
    gm = rewrite_graph_module(fx_model(causal_masked_fill_triu, None), "hydra", eps=1e-5)
    assert "HydraAttention" in str(gm)
    assert any(n.op == "call_module" and n.target.endswith("hydra_attention") for n in gm.graph.nodes)
    record = gm.meta["attnrewrite"]
    assert record["method"] == "hydra" and record["options"] == {"eps": 1e-5, "seed": 0} and record["seed"] == 0
    assert record["sites"][0]["replacement"].startswith("HydraAttention at ")


def test_the_input_model_is_not_modified():
    model = fx_model(key_padding_masked_fill, "pad")
    args = inputs("pad")
    with torch.no_grad():
        before = model(*args)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rewritten = rewrite_graph_module(model, "linear")
        rewritten.q.weight.add_(1.0)  # the rewrite owns its parameters
        assert torch.equal(model(*args), before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert not any("attention" in name for name, _ in model.named_modules())


def test_works_at_another_sequence_length_than_any_probe():
    """Masks built in-graph from sizes follow the input: the rewrite is not specialised."""
    gm = rewrite_graph_module(fx_model(causal_and_padding_where, "keep"), "linear")
    for seq in (3, 12):
        args = inputs("keep", batch=3, seq=seq)
        site = find_fx_sites(fx_model(causal_and_padding_where, "keep"))[0]
        model = fx_model(causal_and_padding_where, "keep")
        with torch.no_grad():
            assert relative_error(gm(*args), reference(model, site, "linear", "keep", args)) < 1e-5


# --- what must be left alone -----------------------------------------------------------------


def softmax_over_queries(m, q, k, v, mask):
    return F.softmax((q @ k.transpose(-2, -1)) * SCALE, dim=-2) @ v


def arbitrary_bias_input(m, q, k, v, mask):  # mask: a float [B, H, N, N] bias
    return ((q @ k.transpose(-2, -1)) * SCALE + mask).softmax(-1) @ v


def learned_relative_bias(m, q, k, v, mask):
    return ((q @ k.transpose(-2, -1)) * SCALE + m.relative_bias).softmax(-1) @ v


def sliding_window(m, q, k, v, mask):
    n = q.size(2)
    window = q.new_ones(n, n, dtype=torch.bool).triu(3) | q.new_ones(n, n, dtype=torch.bool).tril(-3)
    return ((q @ k.transpose(-2, -1)) * SCALE).masked_fill(window, float("-inf")).softmax(-1) @ v


def learned_temperature(m, q, k, v, mask):
    return ((q * m.temperature) @ k.transpose(-2, -1)).softmax(-1) @ v


def sdpa_user_square_mask(m, q, k, v, mask):  # mask: a float [N, N] input
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def probabilities_times_values_on_the_right(m, q, k, v, mask):
    probs = ((q @ k.transpose(-2, -1)) * SCALE).softmax(-1)
    return (v.transpose(-2, -1) @ probs.transpose(-2, -1)).transpose(-2, -1)


NEGATIVE = [
    (softmax_over_queries, None, "not the key axis"),
    (arbitrary_bias_input, torch.randn(BATCH, HEADS, SEQ, SEQ), "not a [batch, keys] key mask"),
    (learned_relative_bias, None, "values other than 0 and large negatives"),
    (sliding_window, None, "neither empty nor a causal triangle"),
    (learned_temperature, None, "not a constant"),
    (sdpa_user_square_mask, torch.zeros(SEQ, SEQ), "is not a key-padding (or causal) mask"),
    (probabilities_times_values_on_the_right, None, "feed"),
]


@pytest.mark.parametrize(("spelling", "mask", "reason"), NEGATIVE, ids=[s[0].__name__ for s in NEGATIVE])
def test_site_that_is_not_understood_is_left_alone_with_its_reason(spelling, mask, reason):
    model = Attention(spelling).eval()
    args = (inputs(None)[0],) if mask is None else (inputs(None)[0], mask)
    gm = rewrite_graph_module(model, "hydra", example_inputs=args)
    record = gm.meta["attnrewrite"]
    assert record["sites_found"] == 1 and record["sites_rewritten"] == 0, record
    assert reason in record["sites"][0]["reason"]
    with torch.no_grad():
        assert torch.allclose(gm(*args), model(*args))


def test_probabilities_used_elsewhere_are_not_rewritten():
    class Returning(nn.Module):
        def forward(self, q, k, v):
            probs = (q @ k.transpose(-2, -1)).softmax(-1)
            return probs @ v, probs

    record = rewrite_graph_module(Returning(), "linear").meta["attnrewrite"]
    assert record["sites_rewritten"] == 0
    assert "used outside the product with the values" in record["sites"][0]["reason"]


def test_a_softmax_that_is_not_attention_is_not_a_site():
    classifier = nn.Sequential(nn.Linear(DIM, 10), nn.Softmax(dim=-1))
    gm = rewrite_graph_module(classifier, "hydra")
    assert gm.meta["attnrewrite"]["sites_found"] == 0
    x = torch.randn(3, DIM)
    assert torch.equal(gm(x), classifier(x))  # unchanged, and no exception


def test_heads_are_unknown_without_the_head_split():
    """q from a plain reshape could hold batch anywhere: the layout is not claimed."""

    def reshaped_heads(m, q, k, v, mask):
        q4 = q.transpose(1, 2).reshape(q.shape[0], HEADS, -1, HEAD_DIM)  # not a head split
        return (q4 @ k.transpose(-2, -1)).softmax(-1) @ v

    site = find_fx_sites(Attention(reshaped_heads).eval())[0]
    assert site.rank == 4 and site.num_heads is None
