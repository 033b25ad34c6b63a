"""What every pass shares about its inputs' layout, in both lowerings: q's leading axes flattened
to [G, N, F] (the rank the ONNX bodies are written for), k and v repeated for grouped query
heads, per-head fitted values, the key keep flags, and a sum over positions (SequenceSum)."""

from __future__ import annotations

from onnx import helper
from onnxscript import script

from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, built_once, standard_opset


def expand_to_query_heads(x, q):
    """k or v ([..., Nk, D]) with q's leading dims, as attention reads them: grouped heads
    repeated (SDPA's enable_gqa, transformers' repeat_kv: query head h reads key/value head
    h // group), any other size-1 dim broadcast (multi-query attention's MatMul)."""
    if x.shape[:-2] == q.shape[:-2]:
        return x
    if x.dim() == q.dim() >= 3 and 1 < x.shape[-3] < q.shape[-3] and q.shape[-3] % x.shape[-3] == 0:
        x = x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3)
    return x.expand(*q.shape[:-2], *x.shape[-2:])


def flatten_heads(x):
    """[..., N, F] -> [G, N, F]: the ONNX bodies are written for rank 3."""
    return x.reshape(-1, *x.shape[-2:])


def fitted_heads(site) -> int:
    """Heads a per-head fitted value has: site.num_heads when q is known to be [batch, heads,
    seq, head_dim] (so [heads, ...] broadcasts against it), else 1 (shared by every head)."""
    return site.num_heads if site.rank == 4 and site.num_heads is not None else 1


@built_once
def flatten_heads_function(opset_version: int):
    """FlattenHeads(x): [..., N, F] -> [G, N, F] float32, the rank the kernels are written for.
    Every pass flattens with this one body, so passes sharing a model share one function."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def FlattenHeads(x):
        """[..., N, F] -> [G, N, F] float32."""
        shape = op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=-2), axis=0)
        return op.Reshape(op.Cast(x, to=FLOAT), shape)

    return FlattenHeads


@built_once
def key_keep_function(opset_version: int):
    """KeyKeep(key_keep, k): the splice's key_keep expanded and flattened as FlattenHeads(k)."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeyKeep(key_keep, k):
        """key_keep (broadcastable to [..., N, 1]) -> [G, N, 1]."""
        full = op.Expand(key_keep, op.Concat(op.Shape(k, end=-1), op.Constant(value_ints=[1]), axis=0))
        rows, one = op.Constant(value_ints=[-1]), op.Constant(value_ints=[1])
        return op.Reshape(full, op.Concat(rows, op.Shape(k, start=-2, end=-1), one, axis=0))

    return KeyKeep


@built_once
def key_mask_function(opset_version: int, key_padding: bool):
    """KeptKeys(features, key_keep): the keys' features zeroed on padding, or, for a site
    without key padding (key_keep all ones), AllKeys: the features as they are, not a
    full-size multiplication by ones."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def KeptKeys(features, key_keep):
        return features * key_keep

    @script(ATTNREWRITE, default_opset=op)
    def AllKeys(features, key_keep):
        return op.Identity(features)

    return KeptKeys if key_padding else AllKeys


_ONE_FLOAT = helper.make_tensor("one", FLOAT, [1], [1.0])


@built_once
def sequence_sum_function(opset_version: int):
    """SequenceSum(x): [..., N, F] -> [..., 1, F], the sum over positions as a product with a
    row of ones: GEMM speed whatever the layout (a reduction over a middle axis is strided on
    CPU and not a plain row or column sum for onnxruntime's CUDA reductions)."""
    op = standard_opset(opset_version)

    @script(ATTNREWRITE, default_opset=op)
    def SequenceSum(x):
        size = op.Concat(op.Constant(value_ints=[1]), op.Shape(x, start=-2, end=-1), axis=0)
        return op.MatMul(op.CastLike(op.ConstantOfShape(size, value=_ONE_FLOAT), x), x)

    return SequenceSum
