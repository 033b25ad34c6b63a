"""The mission's own example: a module calling F.scaled_dot_product_attention, traced with
symbolic_trace (no shapes, no example inputs). SDPA's default scale is 1/sqrt(q.shape[-1]) at
run time: methods that do not use the scale (hydra, linear) or read it from q (linformer)
replace the site; FAVOR+ and LSH draw random features for head_dim at rewrite time, so they
refuse, saying so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import relative_error, run_pass_module
from torch import nn

import attnrewrite
from attnrewrite import passes
from attnrewrite.fx import find_fx_sites

TOLERANCE = 1e-5


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def qkv(n: int = 9):
    generator = torch.Generator().manual_seed(n)
    return [torch.randn(2, 4, n, 8, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("method", ["hydra", "linear", "linformer"])
def test_symbolic_trace_without_shapes_is_rewritten(method):
    gm = attnrewrite.rewrite(torch.fx.symbolic_trace(Attention()), to=method)
    (site,) = gm.meta["attnrewrite"]["sites"]
    assert (site["status"], site["head_dim"], site["scale"]) == ("rewritten", None, None)

    (attention_site,) = find_fx_sites(torch.fx.symbolic_trace(Attention()))
    method_pass = passes.get_pass(method)
    module = method_pass.torch_module(attention_site, passes.make_options(method_pass))
    q, k, v = qkv()
    with torch.no_grad():
        actual = gm(q, k, v).numpy()
    assert relative_error(actual, run_pass_module(module, q.numpy(), k.numpy(), v.numpy(), None)) < TOLERANCE
    if method == "linformer":  # 9 keys <= proj_dim: exact attention, so the scale read from q is SDPA's
        assert relative_error(actual, F.scaled_dot_product_attention(q, k, v).numpy()) < TOLERANCE


@pytest.mark.parametrize(
    "method, reason",
    [
        ("favor", "the head dimension is unknown, and W [features, head_dim] is drawn at rewrite time"),
        ("lsh", "the head dimension is unknown, and the LSH rotations are drawn for it"),
    ],
)
def test_methods_that_draw_for_head_dim_refuse(method, reason):
    gm = attnrewrite.rewrite(torch.fx.symbolic_trace(Attention()), to=method)
    assert [(s["status"], s["reason"]) for s in gm.meta["attnrewrite"]["sites"]] == [("skipped", reason)]
