"""Learnable query and key maps (linear, hydra): calibration fits a per-head linear map of q and k
in front of a fixed feature map. The maps exist only in learnable modules (identity at first, so
the output is unchanged), and their ONNX form wraps the plain entry function, so uncalibrated
graphs are the ones they always were."""

from __future__ import annotations

import numpy as np
import onnx

from attnrewrite.passes.layout import fitted_heads
from attnrewrite.passes.lowering import DOMAIN, FLOAT, FunctionNodes, make_function
from attnrewrite.passes.optional_torch import torch

QUERY_KEY_MAPS = ("query_map", "key_map")


def query_key_map_shape(site) -> tuple[int, int, int]:
    """[heads, d, d] when q is [batch, heads, N, d], else [1, d, d] (one map for every head)."""
    if site.head_dim is None:
        raise ValueError("the head dimension is unknown, so no query/key map can be fitted")
    return fitted_heads(site), site.head_dim, site.head_dim


def with_query_key_maps(module, site, learnable: bool):
    """``module``, with identity maps registered as its trainable ``query_map`` and ``key_map``
    where it is ``learnable``."""
    if learnable:
        heads, d, _ = query_key_map_shape(site)
        for name in QUERY_KEY_MAPS:
            module.register_parameter(name, torch.nn.Parameter(torch.eye(d).repeat(heads, 1, 1)))
    return module


def map_queries_and_keys(module, q, k):
    """(q W_q, k W_k) in float32 when the module has maps, else q and k as they are."""
    if getattr(module, "query_map", None) is None:
        return q, k
    return q.float() @ module.query_map.float(), k.float() @ module.key_map.float()


def query_key_map_values(weights: dict | None) -> dict:
    """The fitted maps among ``weights`` (a fitted module's state) in float32; {} without them."""
    if not weights or QUERY_KEY_MAPS[0] not in weights:
        return {}
    return {name: np.asarray(weights[name], dtype=np.float32) for name in QUERY_KEY_MAPS}


def with_learned_entry(functions: list[onnx.FunctionProto], weights: dict | None, opset_version: int) -> list:
    """``functions`` (an entry last) and, where ``weights`` holds fitted maps, an entry
    ``Learned<Entry>(q, k, v, key_keep, *constants, query_map, key_map)`` after them that maps q
    and k (in float32, as map_queries_and_keys) and calls the entry."""
    if not query_key_map_values(weights):
        return functions
    inner = functions[-1]
    constants = list(inner.input[4:])
    body = FunctionNodes()
    q = body("MatMul", body("Cast", "q", to=FLOAT), "query_map")
    k = body("MatMul", body("Cast", "k", to=FLOAT), "key_map")
    body.output("out", body(inner.name, q, k, "v", "key_keep", *constants, domain=DOMAIN))
    inputs = ["q", "k", "v", "key_keep", *constants, *QUERY_KEY_MAPS]
    return [*functions, make_function(f"Learned{inner.name}", inputs, ["out"], body.nodes, opset_version)]
