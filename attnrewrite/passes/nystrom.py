"""Nyströmformer (Xiong et al., AAAI 2021): softmax attention rebuilt from M landmarks.

The landmarks are segment means of the queries (Q~) and the keys (K~), and

    out = softmax(s Q K~^T) · pinv(softmax(s Q~ K~^T)) · softmax(s Q~ K^T) V

with the pseudo-inverse from ``pinv_iterations`` Newton(-Schulz) steps,
Z <- Z (13 I - AZ (15 I - AZ (7 I - AZ))) / 4. The Newton form is not a cheap stand-in for an
exact pseudo-inverse: on a trained MiniLM an exact pinv collapses the embeddings (cosine ~0.1)
where six steps keep ~0.9 (issue 35); the unconverged iterate is a regularised inverse.

Choices, where the reference implementations differ or couple what should not be coupled:

- Newton's start is Z0 = A^T / (||A||_1 ||A||_inf) per (example, head): that bound on
  sigma_max(A)^2 holds for each matrix by itself, so every iterate converges; the PyPI package and
  transformers' default divide by a max over the whole batch, which (six steps being far from
  converged) makes a sequence's output depend on the other sequences in its batch.
  transformers' ``inv_init_coeff_option`` other than "original" is this start. Fidelity is not
  what decides it: on MiniLM the batch-wide start moves the held-out cosine by under 0.001
  (bench/nystrom_reference.py).
- Segments: the kept keys, in order, cut into min(M, n) near-equal contiguous segments (kept key
  of rank r belongs to segment floor(r * min(M, n) / n), n kept keys), so every landmark is a
  mean of floor(n/M) or ceil(n/M) keys for any n. (The references pad the front of the
  sequence to a multiple of M: at N = M + 1 that leaves M/2 - 1 landmarks empty; on MiniLM at
  240 tokens and 64 landmarks that rule costs 0.008 of held-out cosine.) Counting
  ranks among the kept keys, not positions, makes a sequence's result independent of how
  much padding follows or precedes it, wherever its kept keys are.
- Key padding: padded keys leave the key landmarks and every softmax over keys; a query's
  landmarks are over the real positions too (self-attention: query i is padding where key i
  is; with Nq != Nk every query counts). Landmarks with no key are left out of both softmaxes
  over landmarks and their rows of the inverted matrix are zero, so the Newton steps run on
  the real landmarks' matrix alone.
- n <= M kept keys: every landmark is one key and the replacement is softmax attention itself
  (the inverted product is replaced by the landmarks' values, per example), so the Newton
  steps' residual does not touch short sequences.

Calibration fits one log scale per head for each of the three softmaxes' logits (zero: the
zero-shot output). Causal masks cannot be expressed: every landmark mixes a whole segment.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnxscript import script

from attnrewrite.passes import hooks
from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.layout import fitted_heads, flatten_heads_function, key_keep_function
from attnrewrite.passes.lowering import (
    ATTNREWRITE,
    DOMAIN,
    FLOAT,
    FunctionNodes,
    OnnxLowering,
    built_once,
    make_function,
    standard_opset,
    with_callees,
)
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import UNUSED_SEED, AtLeast, MethodOptions, option
from attnrewrite.site import AttentionSite

NAME = "nystrom"
NO_WINDOW = "every landmark mixes a whole segment of keys, so no keys are left over for a window to split off"
NO_RECURRENCE = (
    "Nystromformer's landmarks mix every position of a segment, so it has no causal form to carry as a state"
)
MASKED_LOGIT = -1e30  # finite, so a row with no visible landmark or key stays NaN-free
# The three softmaxes, in the order of the fitted log scales' first axis.
KERNELS = ("queries_to_landmarks", "landmarks_to_landmarks", "landmarks_to_keys")
RANK_BLOCK = 64  # the ONNX kept-key ranks: a MatMul within blocks, a CumSum over N / RANK_BLOCK
INT64 = onnx.TensorProto.INT64
_ONE = onnx.numpy_helper.from_array(np.array([1.0], dtype=np.float32))


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    landmarks: int = option(64, "M, the number of segment-mean landmarks of queries and keys", valid=AtLeast(1))
    pinv_iterations: int = option(6, "Newton steps of the landmark matrix's pseudo-inverse", valid=AtLeast(1))
    seed: int = option(0, UNUSED_SEED, valid=AtLeast(0))


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed on segment-mean landmarks"
    if site.mask.causal:
        return "Nystromformer's landmarks mix every position of a segment, so a causal mask cannot be expressed"
    return None


nothing_to_fit = hooks.nothing_unfittable
attention_weights_unavailable = hooks.no_attention_weights(NAME)


def exact_part(options: Options, causal: bool = False) -> ExactPart:
    """With n <= M kept keys every landmark is one key: softmax attention itself."""
    return ExactPart(options.landmarks, options.landmarks, f"landmarks={options.landmarks}")


def initial_log_scales(site: AttentionSite) -> np.ndarray:
    """[3, heads, 1, 1] zeros (KERNELS order): the zero-shot output. ``heads`` as
    fitted_heads (1, shared, when the layout is not known)."""
    return np.zeros((len(KERNELS), fitted_heads(site), 1, 1), np.float32)


# --- torch -----------------------------------------------------------------------------------


def segment_matrix(keep, landmarks: int):
    """[..., N, M] one-hot of each kept position's segment (rows of padding are zero) and
    [..., 1, M] the kept positions per segment: the kept positions, in order, cut into
    min(M, n) near-equal segments (n kept positions)."""
    rank = (torch.cumsum(keep, dim=-2) - keep).long()  # kept positions before each
    kept = keep.sum(dim=-2, keepdim=True).long()
    segment = rank * torch.clamp(kept, max=landmarks) // kept.clamp_min(1)
    one_hot = (segment == torch.arange(landmarks, device=keep.device)).float() * keep
    return one_hot, one_hot.sum(dim=-2, keepdim=True)


def segment_means(x, one_hot, count):
    """[..., M, D]: the mean of x over each segment's kept positions (0 for an empty one)."""
    return one_hot.transpose(-2, -1) @ x / count.clamp_min(1.0).transpose(-2, -1)


def masked_softmax(logits, visible):
    return torch.softmax(torch.where(visible, logits, MASKED_LOGIT), dim=-1)


def newton_pseudo_inverse(a, iterations: int):
    """pinv(a) by Newton steps from a^T / (||a||_1 ||a||_inf), each matrix its own start."""
    norm_1 = a.abs().sum(dim=-2, keepdim=True).amax(dim=-1, keepdim=True)
    norm_inf = a.abs().sum(dim=-1, keepdim=True).amax(dim=-2, keepdim=True)
    z = a.transpose(-2, -1) / (norm_1 * norm_inf).clamp_min(1e-30)
    eye = torch.eye(a.shape[-1], device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


class NystromAttention(Module):
    """``log_scales`` ([3, heads, 1, 1], KERNELS order) is named as the ONNX lowering's constant."""

    def __init__(self, scale: float | None, options: Options, log_scales: np.ndarray, learnable: bool = False):
        """scale None: 1/sqrt(head_dim), read from q (a torch graph without shapes)."""
        super().__init__()
        self.scale = scale
        self.options = options
        values = torch.from_numpy(log_scales)
        if learnable:
            self.log_scales = torch.nn.Parameter(values)
        else:
            self.register_buffer("log_scales", values)

    def forward(self, q, k, v, key_keep=None):
        m = self.options.landmarks
        q, k = q.float(), k.float()
        keep = torch.ones((), device=k.device) if key_keep is None else key_keep.float()
        keep = keep.expand(*k.shape[:-1], 1)
        query_keep = keep if q.shape[-2] == k.shape[-2] else torch.ones_like(q[..., :1])
        key_segments, key_count = segment_matrix(keep, m)
        query_segments, query_count = segment_matrix(query_keep, m)
        k_marks = segment_means(k, key_segments, key_count).transpose(-2, -1)
        q_marks = segment_means(q, query_segments, query_count)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        s1, s2, s3 = scale * torch.exp(self.log_scales)
        real_marks = key_count > 0  # [..., 1, M]
        to_marks = masked_softmax(s1 * (q @ k_marks), real_marks)
        among_marks = masked_softmax(s2 * (q_marks @ k_marks), real_marks)
        among_marks = among_marks * (query_count > 0).transpose(-2, -1).float()  # empty query landmarks
        to_keys = masked_softmax(s3 * (q_marks @ k.transpose(-2, -1)), keep.transpose(-2, -1) > 0)
        # n <= M kept keys: each landmark is one key, to_marks is softmax attention's weights, and
        # the landmarks' values are the keys' own (one-hot segments instead of to_keys, no inverse).
        exact = keep.sum(dim=-2, keepdim=True) <= m  # [..., 1, 1]
        marks_values = torch.where(exact, key_segments.transpose(-2, -1), to_keys) @ v.float()
        inverse = newton_pseudo_inverse(among_marks, self.options.pinv_iterations)
        mixed = torch.where(exact, marks_values, inverse @ marks_values)
        return (to_marks @ mixed).to(v.dtype)

    def extra_repr(self) -> str:
        o = self.options
        return f"scale={self.scale}, landmarks={o.landmarks}, pinv_iterations={o.pinv_iterations}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> NystromAttention:
    return NystromAttention(site.scale, options, initial_log_scales(site), learnable)


# --- ONNX ------------------------------------------------------------------------------------
# The bodies work on [G, N, D] (heads flattened); scale and landmarks are inputs, so one body
# serves every site of a model. The Newton steps are unrolled (make_function).


@built_once
def _segment_functions(op):
    """Segments(keep [G, N, 1], landmarks) -> (one_hot [G, N, M], count [G, 1, M]) and
    SegmentMeans(x, one_hot, count), as segment_matrix and segment_means."""
    block = RANK_BLOCK

    @script(ATTNREWRITE, default_opset=op)
    def KeptRank(keep):
        """[G, N, 1] -> the kept positions before each: a MatMul with a strictly upper triangle
        inside blocks of RANK_BLOCK, a CumSum over the blocks (never a CumSum along N)."""
        n = op.Shape(keep, start=1, end=2)
        zero, one, size = op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[block])
        blocks = (n + size - one) / size
        padded = op.Pad(keep, op.Concat(zero, zero, zero, zero, blocks * size - n, zero, axis=0))
        rows = op.Reshape(padded, op.Concat(op.Constant(value_ints=[-1]), blocks, size, axis=0))
        earlier_in_block = op.Trilu(op.ConstantOfShape(op.Concat(size, size, axis=0), value=_ONE), upper=1, k=1)
        block_sums = op.ReduceSum(rows, op.Constant(value_ints=[2]), keepdims=1)
        rank = op.MatMul(rows, earlier_in_block) + op.CumSum(block_sums, op.Constant(value_int=1), exclusive=1)
        rank = op.Reshape(rank, op.Concat(op.Constant(value_ints=[-1]), blocks * size, one, axis=0))
        return op.Slice(rank, zero, n, one)

    @script(ATTNREWRITE, default_opset=op)
    def Segments(keep, landmarks):
        rank = op.Cast(KeptRank(keep), to=INT64)
        kept = op.Cast(op.ReduceSum(keep, op.Constant(value_ints=[1]), keepdims=1), to=INT64)
        segment = rank * op.Min(kept, landmarks) / op.Max(kept, op.Constant(value_int=1))
        columns = op.Range(op.Constant(value_int=0), op.Squeeze(landmarks), op.Constant(value_int=1))
        one_hot = op.Cast(op.Equal(segment, columns), to=FLOAT) * keep
        return one_hot, op.ReduceSum(one_hot, op.Constant(value_ints=[1]), keepdims=1)

    @script(ATTNREWRITE, default_opset=op)
    def SegmentMeans(x, one_hot, count):
        sums = op.MatMul(op.Transpose(one_hot, perm=[0, 2, 1]), x)
        return sums / op.Transpose(op.Max(count, op.Constant(value_float=1.0)), perm=[0, 2, 1])

    return Segments, SegmentMeans


@built_once
def _kernel_functions(op, key_padding: bool):
    """NystromKernels(q, k, v, key_keep, scale, landmarks, log_scales) -> (to_marks, among_marks,
    marks_values, exact): everything of the torch forward but the inverse and the last product.
    Without key padding (key_keep all ones, not read) the keep vector is one [1, N, 1] row, so
    the segments are built once, not once per head."""
    flatten = flatten_heads_function(op.version)
    segments, means = _segment_functions(op)

    @script(ATTNREWRITE, default_opset=op)
    def AllKept(key_keep, k):
        return op.Expand(
            op.Constant(value_float=1.0),
            op.Concat(op.Constant(value_ints=[1]), op.Shape(k, start=-2, end=-1), op.Constant(value_ints=[1]), axis=0),
        )

    keep_of = key_keep_function(op.version) if key_padding else AllKept

    @script(ATTNREWRITE, default_opset=op)
    def QueryKeep(keep, q):
        """Self-attention (Nq == Nk): query i is padding where key i is; else every query counts."""
        if op.Squeeze(op.Equal(op.Shape(q, start=1, end=2), op.Shape(keep, start=1, end=2))):
            query_keep = op.Identity(keep)
        else:
            one = op.Constant(value_ints=[1])
            query_keep = op.Expand(
                op.Constant(value_float=1.0), op.Concat(one, op.Shape(q, start=1, end=2), one, axis=0)
            )
        return query_keep

    @script(ATTNREWRITE, default_opset=op)
    def LogitScales(log_scales, scale, q):
        """[3, H, 1, 1] log scales -> scale * exp, one row per flattened head: [3, G, 1, 1]."""
        three, heads = op.Constant(value_ints=[3]), op.Shape(log_scales, start=1, end=2)
        per_head = op.Reshape(op.Exp(log_scales) * scale, op.Concat(three, op.Constant(value_ints=[1]), heads, axis=0))
        groups = op.Shape(q, start=0, end=1)
        tiled = op.Expand(per_head, op.Concat(three, groups / heads, heads, axis=0))
        return op.Reshape(tiled, op.Constant(value_ints=[3, -1, 1, 1]))

    @script(ATTNREWRITE, default_opset=op)
    def MaskedSoftmax(logits, visible):
        return op.Softmax(op.Where(visible, logits, op.Constant(value_float=MASKED_LOGIT)), axis=-1)

    @script(ATTNREWRITE, default_opset=op)
    def NystromKernels(q, k, v, key_keep, scale, landmarks, log_scales):
        keep = keep_of(key_keep, k)
        q3, k3, v3 = flatten(q), flatten(k), flatten(v)
        key_segments, key_count = segments(keep, landmarks)
        query_segments, query_count = segments(QueryKeep(keep, q3), landmarks)
        k_marks = op.Transpose(means(k3, key_segments, key_count), perm=[0, 2, 1])
        q_marks = means(q3, query_segments, query_count)
        scales = LogitScales(log_scales, scale, q3)
        s1 = op.Gather(scales, op.Constant(value_int=0), axis=0)
        s2 = op.Gather(scales, op.Constant(value_int=1), axis=0)
        s3 = op.Gather(scales, op.Constant(value_int=2), axis=0)
        real_marks = key_count > op.Constant(value_float=0.0)
        to_marks = MaskedSoftmax(op.MatMul(q3, k_marks) * s1, real_marks)
        among_marks = MaskedSoftmax(op.MatMul(q_marks, k_marks) * s2, real_marks)
        real_query_marks = op.Cast(query_count > op.Constant(value_float=0.0), to=FLOAT)
        among_marks = among_marks * op.Transpose(real_query_marks, perm=[0, 2, 1])
        visible_keys = op.Transpose(keep, perm=[0, 2, 1]) > op.Constant(value_float=0.0)
        to_keys = MaskedSoftmax(op.MatMul(q_marks, op.Transpose(k3, perm=[0, 2, 1])) * s3, visible_keys)
        kept = op.ReduceSum(keep, op.Constant(value_ints=[1]), keepdims=1)
        exact = op.LessOrEqual(kept, op.Cast(landmarks, to=FLOAT))  # [G, 1, 1]: each landmark one key
        mixing = op.Where(exact, op.Transpose(key_segments, perm=[0, 2, 1]), to_keys)
        return to_marks, among_marks, op.MatMul(mixing, v3), exact

    return NystromKernels


@built_once
def _pseudo_inverse_functions(op):
    @script(ATTNREWRITE, default_opset=op)
    def NewtonStart(a):
        """a^T / (||a||_1 ||a||_inf), per matrix."""
        magnitude = op.Abs(a)
        norm_1 = op.ReduceMax(
            op.ReduceSum(magnitude, op.Constant(value_ints=[1]), keepdims=1), op.Constant(value_ints=[2]), keepdims=1
        )
        norm_inf = op.ReduceMax(
            op.ReduceSum(magnitude, op.Constant(value_ints=[2]), keepdims=1), op.Constant(value_ints=[1]), keepdims=1
        )
        return op.Transpose(a, perm=[0, 2, 1]) / op.Max(norm_1 * norm_inf, op.Constant(value_float=1e-30))

    @script(ATTNREWRITE, default_opset=op)
    def NewtonStep(a, z):
        eye = op.EyeLike(op.ConstantOfShape(op.Concat(op.Shape(a, start=2), op.Shape(a, start=2), axis=0), value=_ONE))
        az = op.MatMul(a, z)
        inner = op.MatMul(
            az, op.Constant(value_float=15.0) * eye - op.MatMul(az, op.Constant(value_float=7.0) * eye - az)
        )
        return op.MatMul(z * op.Constant(value_float=0.25), op.Constant(value_float=13.0) * eye - inner)

    return NewtonStart, NewtonStep


@built_once
def _output_function(op):
    @script(ATTNREWRITE, default_opset=op)
    def NystromOutput(to_marks, inverse, marks_values, exact, q, v):
        mixed = op.Where(exact, marks_values, op.MatMul(inverse, marks_values))
        out = op.MatMul(to_marks, mixed)  # [G, Nq, Dv] -> q's leading axes + [Nq, Dv], v's dtype
        return op.CastLike(op.Reshape(out, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)), v)

    return NystromOutput


def _entry(iterations: int, opset_version: int) -> onnx.FunctionProto:
    """Nystrom(q, k, v, key_keep, scale, landmarks, log_scales): the kernels, ``iterations``
    Newton steps (unrolled: a script function cannot unroll a Python loop), the output."""

    body = FunctionNodes()
    inputs = ["q", "k", "v", "key_keep", "scale", "landmarks", "log_scales"]
    to_marks, among_marks, marks_values, exact = body("NystromKernels", *inputs, outputs=4, domain=DOMAIN)
    z = body("NewtonStart", among_marks, domain=DOMAIN)
    for _ in range(iterations):
        z = body("NewtonStep", among_marks, z, domain=DOMAIN)
    body.output("out", body("NystromOutput", to_marks, z, marks_values, exact, "q", "v", domain=DOMAIN))
    return make_function("Nystrom", inputs, ["out"], body.nodes, opset_version)


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state; its ``log_scales`` replace the zeros."""
    op = standard_opset(opset_version)
    bodies = with_callees(
        _kernel_functions(op, site.mask.key_padding), *_pseudo_inverse_functions(op), _output_function(op)
    )
    functions = [f.to_function_proto() for f in bodies]
    functions.append(_entry(options.pinv_iterations, opset_version))
    constants = {
        "scale": np.array(site.scale, dtype=np.float32),
        "landmarks": np.array([options.landmarks], dtype=np.int64),
        "log_scales": initial_log_scales(site),
    }
    return OnnxLowering(functions, constants).with_weights(weights)
