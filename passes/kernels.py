"""Kernelized attention out = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)), in both lowerings.

Feature maps are computed by each pass; these pieces only contract them. The causal form is a
chunked prefix sum: within a chunk a masked (chunk x chunk) product, across chunks an exclusive
cumulative sum of per-chunk key-value states, so memory stays O(N*F + N/chunk * F*Dv) instead
of the O(N*F*Dv) of a per-position prefix sum.
"""

from __future__ import annotations

from onnxscript import script

from passes._onnx import ATTNREWRITE, standard_opset
from passes._torch import torch

DENOMINATOR_EPS = 1e-6  # keeps rows whose keys are all masked finite (0 instead of 0/0)


# --- torch -----------------------------------------------------------------------------------


def linear_attention(phi_q, phi_k, v, eps: float = DENOMINATOR_EPS):
    kv = phi_k.transpose(-2, -1) @ v  # [..., F, Dv]: the reassociated product, never N x N
    numerator = phi_q @ kv
    denominator = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
    return numerator / (denominator + eps)


def causal_linear_attention(phi_q, phi_k, v, chunk: int, eps: float = DENOMINATOR_EPS):
    *lead, n, f = phi_q.shape
    dv = v.shape[-1]
    chunks = -(-n // chunk)
    pad = chunks * chunk - n

    def blocks(x):
        x = torch.nn.functional.pad(x.reshape(-1, n, x.shape[-1]), (0, 0, 0, pad))
        return x.reshape(x.shape[0], chunks, chunk, x.shape[-1])

    q4, k4, v4 = blocks(phi_q), blocks(phi_k), blocks(v)
    k4t = k4.transpose(-2, -1)
    state = _exclusive_cumsum(k4t @ v4)  # keys of earlier chunks only
    key_sum = _exclusive_cumsum(k4.sum(dim=2, keepdim=True))
    scores = torch.tril(q4 @ k4t)
    numerator = q4 @ state + scores @ v4
    denominator = (q4 * key_sum).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    out = (numerator / (denominator + eps)).reshape(-1, chunks * chunk, dv)[:, :n]
    return out.reshape(*lead, n, dv)


def _exclusive_cumsum(x):
    """Prefix sums over chunks (dim 1) that leave out the chunk itself."""
    return torch.cat([torch.zeros_like(x[:, :1]), torch.cumsum(x, dim=1)[:, :-1]], dim=1)


def flatten_heads(x):
    """[..., N, F] -> [G, N, F]: the ONNX kernels below are written for rank 3."""
    return x.reshape(-1, *x.shape[-2:])


# --- ONNX ------------------------------------------------------------------------------------


def linear_attention_function(opset_version: int, eps: float = DENOMINATOR_EPS):
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KernelAttention(phi_q, phi_k, v):
        kv = op.MatMul(op.Transpose(phi_k, perm=[0, 2, 1]), v)
        numerator = op.MatMul(phi_q, kv)
        key_sum = op.ReduceSum(phi_k, op.Constant(value_ints=[1]), keepdims=1)
        denominator = op.ReduceSum(phi_q * key_sum, op.Constant(value_ints=[2]), keepdims=1)
        return numerator / (denominator + op.Constant(value_float=eps))

    return KernelAttention


def causal_linear_attention_function(opset_version: int, chunk: int, eps: float = DENOMINATOR_EPS):
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def CausalKernelAttention(phi_q, phi_k, v):
        # phi_q, phi_k [G, N, F], v [G, N, Dv]; G = batch * heads, flattened by the caller.
        n = op.Shape(v, start=1, end=2)
        f = op.Shape(phi_q, start=2)
        dv = op.Shape(v, start=2)
        c = op.Constant(value_ints=[chunk])
        zero = op.Constant(value_ints=[0])
        minus_one = op.Constant(value_ints=[-1])
        chunks = op.Div(n + c - op.Constant(value_ints=[1]), c)
        pads = op.Concat(zero, zero, zero, zero, chunks * c - n, zero, axis=0)
        q4 = op.Reshape(op.Pad(phi_q, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        k4 = op.Reshape(op.Pad(phi_k, pads), op.Concat(minus_one, chunks, c, f, axis=0))
        v4 = op.Reshape(op.Pad(v, pads), op.Concat(minus_one, chunks, c, dv, axis=0))
        k4t = op.Transpose(k4, perm=[0, 1, 3, 2])
        state = op.CumSum(op.MatMul(k4t, v4), op.Constant(value_int=1), exclusive=1)
        key_sum = op.CumSum(
            op.ReduceSum(k4, op.Constant(value_ints=[2]), keepdims=1),
            op.Constant(value_int=1),
            exclusive=1,
        )
        scores = op.Trilu(op.MatMul(q4, k4t), upper=0)
        numerator = op.MatMul(q4, state) + op.MatMul(scores, v4)
        last = op.Constant(value_ints=[3])
        denominator = op.ReduceSum(q4 * key_sum, last, keepdims=1) + op.ReduceSum(
            scores, last, keepdims=1
        )
        out = op.Reshape(
            numerator / (denominator + op.Constant(value_float=eps)),
            op.Concat(minus_one, chunks * c, dv, axis=0),
        )
        return op.Slice(out, zero, n, op.Constant(value_ints=[1]))

    return CausalKernelAttention
