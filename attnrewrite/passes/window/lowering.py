"""The window hybrid's ONNX entry: the one call a windowed method makes (windowed_kernel), the
hybrid's entry function (windowed_kernel_attention_functions: bidirectional in pairs of blocks,
onnx_pairs.py; causal, onnx_causal.py) and the rows it reads (window_inputs_function)."""

from __future__ import annotations

import typing

from onnxscript import OnnxFunction, script

from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, built_once, standard_opset, with_callees
from attnrewrite.passes.window.onnx_blocks import window_block_functions
from attnrewrite.passes.window.onnx_causal import causal_paired_entry, causal_paired_window_functions
from attnrewrite.passes.window.onnx_pairs import pair_layout_functions, paired_window_entry, paired_window_functions
from attnrewrite.passes.window.onnx_sparse import sparse_window_entry
from attnrewrite.passes.window.settings import WINDOW_FAR_CHUNK, KernelUnit, Window
from attnrewrite.site import AttentionSite


class WindowedKernel(typing.NamedTuple):
    """What a windowed method's entry calls (windowed_kernel): ``inputs``, WindowInputs(q, k,
    key_keep) -> (q, k, keep) as the hybrid reads them (its feature maps run on these q and k),
    and ``attention``, the hybrid's entry (windowed_kernel_attention_functions)."""

    inputs: OnnxFunction
    attention: OnnxFunction


def windowed_kernel(window: Window, site: AttentionSite, opset_version: int, unit: KernelUnit) -> WindowedKernel:
    """The window hybrid for a method whose kernel part is in ``unit``s, at ``site``; with a
    sparse cache (causal sites only) its entry is onnx_sparse.py's."""
    causal = site.mask.causal
    if causal and window.sparse:
        attention = sparse_window_entry(opset_version, window, site.scale, unit)
    else:
        attention = windowed_kernel_attention_functions(opset_version, window, site.scale, causal, unit)[-1]
    return WindowedKernel(window_inputs_function(opset_version, window, causal), attention)


def windowed_kernel_attention_functions(
    opset_version: int,
    window: Window,
    scale: float,
    causal: bool,
    unit: KernelUnit = KernelUnit.SHARED,
    *,
    far_chunk: int = WINDOW_FAR_CHUNK,
):
    """ONNX form of windowed_kernel_attention: the functions it calls, then itself last.

    The entry reads (phi_q, phi_k, q, k, v, key_keep, linear_log_weight), q, k and key_keep as
    window_inputs_function gives them and phi_q, phi_k taken of those q and k (causal: [..., N, *],
    key_keep broadcastable to [..., N, 1]), v [..., N, Dv] as it is, with a rescaled ``unit``
    also (query_log_scale, key_log_scale) after phi_k and, max weighted, local_max_weight last;
    it returns float32 [..., N, Dv]. Blocks are laid out as ChunkLayout does (padded at the
    front), so both lowerings pick the same keys; ``causal`` and the window's settings choose
    the bodies at rewrite time, each in the builder that reads it. ``far_chunk``: the positions
    per chunk of a causal window's far part (rounded to whole blocks), a matter of speed only.
    """
    op = standard_opset(opset_version)
    size, sinks, rescaled, max_weighted, eps = window.size, window.sinks, unit.rescaled, unit.max_weighted, unit.eps
    blocks = window_block_functions(op, size, aligned_to_start=causal)
    flatten = flatten_heads_function(opset_version)
    if not causal:
        pieces = paired_window_functions(op, blocks, flatten, size, scale, window.following, sinks, eps)
        return with_callees(paired_window_entry(op, flatten, *pieces, rescaled, max_weighted))
    pieces = causal_paired_window_functions(opset_version, blocks, flatten, size, scale, sinks, eps, far_chunk)
    return with_callees(causal_paired_entry(op, flatten, pieces, rescaled, max_weighted))


@built_once
def window_inputs_function(opset_version: int, window: Window, causal: bool):
    """WindowInputs(q, k, key_keep) -> (q, k, keep): the q, k and key_keep a windowed kernel's
    entry reads, and the q and k its pass maps to phi_q, phi_k and log scales. Bidirectional:
    the window's rows [..., rows, *] (zero rows around the N positions, keep float
    [..., rows, 1], 0 on them), so the feature maps run on the rows and no [..., N, F] feature
    tensor is copied into them; causal: as they are."""
    op = standard_opset(opset_version)
    if causal:

        @script(ATTNREWRITE, default_opset=op)
        def CausalWindowInputs(q, k, key_keep):
            return op.Identity(q), op.Identity(k), op.Identity(key_keep)

        return CausalWindowInputs
    blocks = window_block_functions(op, window.size, aligned_to_start=False)
    FrontPad, RowCount = blocks.FrontPad, pair_layout_functions(op, blocks, window.size, False, 0).RowCount

    @script(ATTNREWRITE, default_opset=op)
    def WindowInputs(q, k, key_keep):
        n = op.Shape(k, start=-2, end=-1)
        front = FrontPad(n)
        pads, axis = op.Concat(front, RowCount(n) - front - n, axis=0), op.Constant(value_ints=[-2])
        zero = op.Constant(value_float=0.0)
        keep = op.Expand(
            op.Cast(key_keep, to=FLOAT), op.Concat(op.Shape(k, end=-1), op.Constant(value_ints=[1]), axis=0)
        )
        q_rows = op.Pad(q, pads, op.CastLike(zero, q), axis)
        return q_rows, op.Pad(k, pads, op.CastLike(zero, k), axis), op.Pad(keep, pads, zero, axis)

    return WindowInputs
