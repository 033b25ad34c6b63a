"""Linformer (Wang et al., 2020): attention over low-rank projections of the keys and values.

Keys and values are projected along the sequence axis, K' = E^T K and V' = F^T V with E, F of
shape [N, k], and out = softmax(scale * Q K'^T) V': O(N * k) instead of O(N^2). One E (and F)
is shared by every head and batch row. Projections:

- ``gaussian``: a seeded Johnson-Lindenstrauss matrix, entries N(0, 1/k), stored for
  ``max_len`` positions; a sequence of N keys uses its first N rows, so the rewritten graph
  runs for every N <= max_len and fails past it (the failing node is named
  ``sequence_longer_than_max_len_<max_len>``);
- ``learned``: the same draw, as nn.Parameters in the torch module (to fine-tune); the ONNX
  lowering stores the drawn values;
- ``pool``: mean over k near-equal contiguous segments (position j -> segment floor(j*k/N)),
  built in the graph for any N;
- ``identity``: the first k positions, for exactness tests.

With N <= k the projection is the identity, which is exact softmax attention: ``pool`` gets it
by construction (N segments of one key), the matrix projections switch to it (an If node in
ONNX) unless ``exact_if_short`` is off.

Key padding: padded keys are zeroed before projecting, so they leave every projected key and
value. A projected key with no kept key in it (a pooling segment of padding only, an identity
column of a padded key) is left out of the softmax; ``pool`` divides each segment by its count
of kept keys. For ``gaussian``, right padding then gives exactly the result of the unpadded
sequence (the kept keys meet the same rows of E) as long as the kept length is > k. A site
without key padding gets bodies that do none of this (no product with the keep vector, no
select on the [.., N, k] logits): full passes over K, V and the logits that would only
multiply by one.
Causal masks cannot be expressed: every projected key mixes all positions.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnxscript import script

from attnrewrite.passes import hooks
from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.layout import flatten_heads_function, key_keep_function
from attnrewrite.passes.lowering import ATTNREWRITE, FLOAT, OnnxLowering, built_once, standard_opset
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.options import AtLeast, MethodOptions, option
from attnrewrite.site import AttentionSite

NAME = "linformer"
# Why ``window`` (exact softmax nearby, kernel beyond, one normaliser) is refused.
NO_WINDOW = "every projected key mixes all positions, so no keys are left over for a window to split off"
NO_RECURRENCE = (
    "Linformer projects the keys along the sequence axis, mixing every position into each "
    "projected key, so it has no causal form to carry as a state"
)
PROJECTIONS = ("gaussian", "learned", "pool", "identity")
MASKED_LOGIT = -1e30  # finite, so a row whose projected keys are all padding stays NaN-free


@dataclasses.dataclass
class Options(MethodOptions, method=NAME):
    proj_dim: int = option(256, "k, the number of projected keys", valid=AtLeast(1))
    projection: str = option("gaussian", "how keys and values are projected to k positions", choices=PROJECTIONS)
    share_kv: bool = option(False, "F = E (one matrix for keys and values)")
    max_len: int = option(
        4096,
        "positions a stored projection covers (gaussian, learned, identity)",
        valid=AtLeast("proj_dim", when="stored"),  # pool builds its matrix from N: nothing stored
    )
    exact_if_short: bool = option(True, "N <= k: exact attention instead of a k-column projection")
    seed: int = option(0, "numpy default_rng seed the projections are drawn from", valid=AtLeast(0))

    @property
    def stored(self) -> bool:
        """Whether the projection is a stored [max_len, k] matrix (else built from N)."""
        return self.projection != "pool"


def supports(site: AttentionSite, options: Options) -> str | None:
    if site.mask is site.mask.BIAS:
        return "an additive attention bias cannot be expressed after projecting the keys"
    if site.mask.causal:
        return "Linformer mixes every position into each projected key, so a causal mask cannot be expressed"
    return None


attention_weights_unavailable = hooks.no_attention_weights(NAME)


def exact_part(options: Options, causal: bool = False) -> ExactPart | None:
    """With N <= k the projection is the identity (pool, identity, or exact_if_short): softmax
    attention itself; past k every query sees k projected keys. None: never exact."""
    if options.projection in ("gaussian", "learned") and not options.exact_if_short:
        return None
    return ExactPart(options.proj_dim, options.proj_dim, f"proj_dim={options.proj_dim}")


def projection_matrices(options: Options) -> tuple[np.ndarray, np.ndarray]:
    """(E, F), each [max_len, k] float32, fixed by the seed; F is E when ``share_kv``."""
    shape = (options.max_len, options.proj_dim)
    if options.projection == "identity":
        e = np.eye(*shape, dtype=np.float32)
        return e, e
    rng = np.random.default_rng(options.seed)

    def draw():
        return (rng.standard_normal(shape) / math.sqrt(options.proj_dim)).astype(np.float32)

    e = draw()
    return e, (e if options.share_kv else draw())


# --- torch -----------------------------------------------------------------------------------


def pooling_matrix(n: int, segments: int, device=None):
    """[n, segments] one-hot: position j belongs to segment floor(j * segments / n)."""
    segment = torch.arange(n, device=device) * segments // n
    return (segment[:, None] == torch.arange(segments, device=device)).float()


def project(k, v, keep, p_e, p_f):
    """(E^T K, F^T V, support) with padded keys zeroed; support [..., m, 1] is how much the kept
    keys weigh in each projected key (0: the projected key holds padding only)."""
    p_e_t, p_f_t = p_e.transpose(0, 1), p_f.transpose(0, 1)
    return p_e_t @ (k * keep), p_f_t @ (v * keep), p_e_t.abs() @ keep


def attend_projected(q, k_proj, v_proj, support, scale: float):
    logits = scale * (q @ k_proj.transpose(-2, -1))
    logits = torch.where(support.transpose(-2, -1) > 0, logits, MASKED_LOGIT)
    return torch.softmax(logits, dim=-1) @ v_proj


class LinformerAttention(Module):
    """E and F are named as the ONNX lowering's constants (state_dict names = constant names)."""

    # Calibration's Adam rate (passes.fit): E and F have entries of about 1/sqrt(k), which the
    # default 3e-2 overshoots. MiniLM, k = 64, all six layers (bench/FIDELITY.md): held-out
    # embedding cosine 0.157 at 3e-2 (layer 5 fitted to a higher loss than it started at),
    # 0.522 at 3e-3; at 1e-3 the per-site losses end higher than at 3e-3.
    CALIBRATION_LR = 3e-3

    def __init__(self, scale: float | None, options: Options, learnable: bool = False):
        """scale None: 1/sqrt(head_dim), read from q (a torch graph without shapes)."""
        super().__init__()
        self.scale = scale
        self.options = options
        if options.stored:
            e, f = (torch.from_numpy(m) for m in projection_matrices(options))
            if options.projection == "learned" or learnable:
                self.E = torch.nn.Parameter(e)
                self.F = self.E if options.share_kv else torch.nn.Parameter(f.clone())
            else:
                self.register_buffer("E", e)
                self.register_buffer("F", f)

    def projections(self, n: int, device):
        """(P_E, P_F, pooled) for a sequence of n keys, each [n, min(n, k)]."""
        o = self.options
        if o.projection == "pool":
            p = pooling_matrix(n, min(n, o.proj_dim), device)
            return p, p, True
        if o.exact_if_short and n <= o.proj_dim:
            eye = torch.eye(n, device=device)
            return eye, eye, False
        if n > o.max_len:
            raise ValueError(f"sequence length {n} is longer than the Linformer projection's max_len {o.max_len}")
        return self.E[:n], self.F[:n], False

    def forward(self, q, k, v, key_keep=None):
        keep = torch.ones((), device=k.device) if key_keep is None else key_keep.float()
        keep = keep.expand(*k.shape[:-1], 1)
        p_e, p_f, pooled = self.projections(k.shape[-2], k.device)
        k_proj, v_proj, support = project(k.float(), v.float(), keep, p_e, p_f)
        if pooled:  # a mean over each segment's kept keys
            k_proj, v_proj = k_proj / support.clamp_min(1.0), v_proj / support.clamp_min(1.0)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return attend_projected(q.float(), k_proj, v_proj, support, scale).to(v.dtype)

    def extra_repr(self) -> str:
        o = self.options
        return f"scale={self.scale}, proj_dim={o.proj_dim}, projection={o.projection!r}, share_kv={o.share_kv}"


def torch_module(site: AttentionSite, options: Options, learnable: bool = False) -> LinformerAttention:
    """``learnable``: E and F are parameters (as for ``learned``); needs a stored projection."""
    reason = nothing_to_fit(options) if learnable else None
    if reason:
        raise ValueError(reason)
    return LinformerAttention(site.scale, options, learnable)


def nothing_to_fit(options: Options) -> str | None:
    if options.projection in ("gaussian", "learned"):
        return None
    return f"linformer's {options.projection!r} projection has nothing to fit (use gaussian or learned)"


# --- ONNX ------------------------------------------------------------------------------------
# Every number the bodies need (scale, k, the matrices) is an input, so one body serves every
# site of a model; the variants (pool, shared E = F) are separate functions.


@built_once
def _low_rank_functions(op, key_padding: bool, pooled: bool):
    """The functions behind LowRank(q, k, v, key_keep, p_e, p_f, scale) -> [G, N, Dv], the
    projections' attention, last: with key padding they zero padded keys and leave empty
    projected keys out; without (key_keep all ones) they neither multiply by key_keep nor
    select on the [G, N, k] logits. ``pooled``: a segment's mean over its (kept) keys."""
    flatten = flatten_heads_function(op.version)
    key_keep_3d = key_keep_function(op.version)

    @script(ATTNREWRITE, default_opset=op)
    def Project(k, v, keep, p_e, p_f):
        # k [G, N, D], v [G, N, Dv], keep [G, N, 1], p_e / p_f [N, m]
        p_e_t = op.Transpose(p_e)
        k_proj = op.MatMul(p_e_t, k * keep)
        v_proj = op.MatMul(op.Transpose(p_f), v * keep)
        support = op.MatMul(op.Abs(p_e_t), keep)
        return k_proj, v_proj, support

    @script(ATTNREWRITE, default_opset=op)
    def AttendProjected(q, k_proj, v_proj, support, scale):
        logits = op.MatMul(q, op.Transpose(k_proj, perm=[0, 2, 1])) * scale
        valid = op.Transpose(support, perm=[0, 2, 1]) > op.Constant(value_float=0.0)
        logits = op.Where(valid, logits, op.Constant(value_float=MASKED_LOGIT))
        return op.MatMul(op.Softmax(logits, axis=-1), v_proj)

    @script(ATTNREWRITE, default_opset=op)
    def KeptLowRank(q, k, v, key_keep, p_e, p_f, scale):
        keep = key_keep_3d(key_keep, k)
        k_proj, v_proj, support = Project(flatten(k), flatten(v), keep, p_e, p_f)
        return AttendProjected(flatten(q), k_proj, v_proj, support, scale)

    @script(ATTNREWRITE, default_opset=op)
    def KeptPooledLowRank(q, k, v, key_keep, p_e, p_f, scale):
        keep = key_keep_3d(key_keep, k)
        k_proj, v_proj, support = Project(flatten(k), flatten(v), keep, p_e, p_f)
        count = op.Max(support, op.Constant(value_float=1.0))  # kept keys per segment
        return AttendProjected(flatten(q), k_proj / count, v_proj / count, support, scale)

    @script(ATTNREWRITE, default_opset=op)
    def LowRank(q, k, v, key_keep, p_e, p_f, scale):
        # every key kept: key_keep is all ones and not read
        k_proj = op.MatMul(op.Transpose(p_e), flatten(k))
        v_proj = op.MatMul(op.Transpose(p_f), flatten(v))
        logits = op.MatMul(flatten(q), op.Transpose(k_proj, perm=[0, 2, 1])) * scale
        return op.MatMul(op.Softmax(logits, axis=-1), v_proj)

    @script(ATTNREWRITE, default_opset=op)
    def PooledLowRank(q, k, v, key_keep, p_e, p_f, scale):
        means = p_e / op.ReduceSum(p_e, op.Constant(value_ints=[0]), keepdims=1)  # [N, m] / [1, m]
        return LowRank(q, k, v, key_keep, means, means, scale)

    if key_padding:
        return [flatten, key_keep_3d, Project, AttendProjected, KeptPooledLowRank if pooled else KeptLowRank]
    return [flatten, LowRank, PooledLowRank] if pooled else [flatten, LowRank]


_ONE_INT64 = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64))


@built_once
def _rows_function(op, max_len: int):
    """ProjectionRows(matrix, n): the first n rows of a stored [max_len, k] projection."""

    @script(ATTNREWRITE, default_opset=op)
    def ProjectionRows(matrix, n):
        ones = op.ConstantOfShape(n, value=_ONE_INT64)
        positions = op.CumSum(ones, op.Constant(value_int=0), exclusive=1)  # 0 .. n-1
        # Gather, not Slice: past max_len an index is out of range and this node, named after
        # the cause, fails (a Slice would quietly return max_len rows). The positions come from
        # CumSum rather than Range so that onnxruntime does not fuse Range + Gather to a Slice.
        return op.Gather(matrix, positions, axis=0)

    proto = ProjectionRows.to_function_proto()
    (gather,) = [node for node in proto.node if node.op_type == "Gather"]
    gather.name = f"sequence_longer_than_max_len_{max_len}"
    return ProjectionRows, proto


def onnx_lowering(
    site: AttentionSite, options: Options, opset_version: int, weights: dict | None = None
) -> OnnxLowering:
    """``weights``: a fitted module's state; its ``E`` and ``F`` replace the drawn matrices."""
    return _lowering(site, options, opset_version).with_weights(weights)


def _lowering(site: AttentionSite, options: Options, opset_version: int) -> OnnxLowering:
    op = standard_opset(opset_version)
    *callees, low_rank = _low_rank_functions(op, site.mask.key_padding, options.projection == "pool")
    functions = [f.to_function_proto() for f in (*callees, low_rank)]
    constants = {"scale": np.array(site.scale, dtype=np.float32)}

    @script(ATTNREWRITE, default_opset=op)
    def WithHeadsOf(out, q, v):
        """[G, N, Dv] -> q's leading axes + [N, Dv], in v's dtype."""
        return op.CastLike(op.Reshape(out, op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)), v)

    functions.append(WithHeadsOf.to_function_proto())

    if options.projection == "pool":

        @script(ATTNREWRITE, default_opset=op)
        def LinformerPool(q, k, v, key_keep, scale, proj_dim):
            n = op.Shape(k, start=-2, end=-1)
            segments = op.Min(n, proj_dim)
            zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
            segment = op.Range(zero, op.Squeeze(n), one) * segments / n  # floor(j * m / N)
            columns = op.Range(zero, op.Squeeze(segments), one)
            p = op.Cast(op.Equal(op.Unsqueeze(segment, op.Constant(value_ints=[1])), columns), to=FLOAT)
            return WithHeadsOf(low_rank(q, k, v, key_keep, p, p, scale), q, v)

        constants["proj_dim"] = np.array([options.proj_dim], dtype=np.int64)
        return OnnxLowering([*functions, LinformerPool.to_function_proto()], constants)

    rows, rows_proto = _rows_function(op, options.max_len)

    @script(ATTNREWRITE, default_opset=op)
    def Linformer(q, k, v, key_keep, scale, exact_if_short, e, f):
        n = op.Shape(k, start=-2, end=-1)
        if op.Squeeze(op.And(exact_if_short, op.LessOrEqual(n, op.Shape(e, start=1)))):
            p_e = op.EyeLike(op.ConstantOfShape(op.Concat(n, n, axis=0)))  # exact attention
            p_f = op.Identity(p_e)
        else:
            p_e = rows(e, n)
            p_f = rows(f, n)
        return WithHeadsOf(low_rank(q, k, v, key_keep, p_e, p_f, scale), q, v)

    @script(ATTNREWRITE, default_opset=op)
    def LinformerSharedKV(q, k, v, key_keep, scale, exact_if_short, e):
        return Linformer(q, k, v, key_keep, scale, exact_if_short, e, e)

    e, f = projection_matrices(options)
    constants["exact_if_short"] = np.array([options.exact_if_short])
    constants["E"] = e
    functions += [rows_proto, Linformer.to_function_proto()]
    if options.share_kv:
        functions.append(LinformerSharedKV.to_function_proto())
    else:
        constants["F"] = f
    return OnnxLowering(functions, constants)
