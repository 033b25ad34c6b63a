"""The delta rule as a causal kernel state's update (``update=delta`` of linear, hedgehog and
favor), in torch: the sequential reference and the chunked (WY) form; kernel/delta_onnx.py holds
its ONNX forms.

The additive state adds every key: S_t = S_{t-1} + phi(k_t) [v_t, 1]^T. The delta rule corrects
the key's old association toward its value instead (DeltaNet; onnxruntime's
com.microsoft.LinearAttention with update_rule "delta", whose state this is):

    S_t = S_{t-1} + beta k_t ([v_t, 1] - S_{t-1}^T k_t)^T,   k_t = phi(k_t) / |phi(k_t)|_2,

S [F, Dv + 1] with the ones column included, so its last column is still the normaliser and the
read is the additive state's: o_t = phi(q_t)^T S_t[:, :Dv] / (phi(q_t)^T S_t[:, Dv] + eps).
beta is 1: a key's write replaces what the state held along it (|k| = 1 makes I - k k^T a
projection), nothing piles up. The rule needs a bounded key: every method's features are
L2-normalised here, hedgehog's too. Its softmax halves sum to 2, so an L1 normalisation would be
stable as well (|k|_2 <= 1) but writes weakly where the features are spread. Measured on hedgehog
features of 4096 random keys (d = 32, x ~ N(0, 4), W = I), values N(0, 1), read back with each
key's own features: L2 keeps |k|^2 = 1, the state's largest entry 2.9, every read's normaliser
>= 0.38, and recalls the last 8 values at relative error 0.30; L1 has |k|^2 in [0.04, 0.42],
the state's largest entry 2.6, normalisers >= 0.16, and recalls them at 0.91, the additive state
at 1.00 (tests/test_delta_rule.py holds L2 against additive). Normalised keys
carry no scale, so FAVOR+'s per-key log scales and its per-query one (a factor of the read's
numerator and denominator alike) drop out: the state holds no log scale. Padded keys have zero
features and write nothing.

The chunked form (Yang et al., "Parallelizing Linear Transformers with the Delta Rule", 2024):
per chunk of C positions with keys K, values V (the ones column included) and the incoming
state S, the corrections U' = T (V - K S) with T = (I + tril(beta K K^T, -1))^-1 diag(beta), so
W = T K and U = T V give U' = U - W S; outputs Q S + tril(Q K^T) U', the state after S + K^T U'.
The chunks follow one another (each reads the state the one before left); within a chunk
everything is a product. The triangular inverse is built by block doubling
(unit_lower_inverse), log2(C) pairs of products, each step's blocks the true inverse's own: the
Neumann product (I - A)(I + A^2)(I + A^4)... gives the same matrix from powers of A that grow as
C^k / k! for positive features, and cancels them away in float32 (test_delta_rule.py).
"""

from __future__ import annotations

from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS
from attnrewrite.passes.kernel.state import KernelState
from attnrewrite.passes.layout import flatten_heads
from attnrewrite.passes.optional_torch import torch
from attnrewrite.passes.options import Range, option

ADDITIVE, DELTA = "additive", "delta"
UPDATES = (ADDITIVE, DELTA)
# A key's features below this L2 norm are taken as that norm: a padded key (all zero) stays zero.
KEY_NORM_FLOOR = 1e-6
CAUSAL_ONLY = "update=delta is a causal state's update: a bidirectional site has no order to update it in"
NO_WEIGHTS = "update=delta gives no attention weights: its outputs mix values with signed coefficients"


class _WithoutWindow(Range):
    """The delta rule with a window is not built: refuse it when the Options are built."""

    def __str__(self) -> str:
        return "additive with window > 0"

    def admits(self, value, options) -> bool:
        return value != DELTA or not getattr(options, "window", 0)

    def requirement(self, options) -> str:
        return "additive while window > 0 (the delta rule's far state beside a window is not built yet)"


def update_option():
    """The ``update`` field of a causal kernel method's Options (linear, hedgehog, favor)."""
    return option(
        ADDITIVE,
        'the causal kernel state\'s update: "additive" (S += phi(k) [v, 1]^T) or "delta" '
        "(S += k ([v, 1] - S^T k)^T, k = phi(k) L2-normalised; causal sites only, no window)",
        choices=UPDATES,
        valid=_WithoutWindow(),
    )


def uses_delta(options) -> bool:
    """Whether a kernel method's ``options`` update its state by the delta rule."""
    return options.update == DELTA


def refusal(site, options) -> str | None:
    """Why ``site`` cannot take ``options``' update (a kernel method's supports)."""
    return CAUSAL_ONLY if uses_delta(options) and not site.mask.causal else None


def _wide(x):
    """float64 stays (the reference's tests), anything else computes in float32."""
    return x if x.dtype == torch.float64 else x.float()


def normalised_keys(phi_k):
    """phi_k [..., N, F] over its L2 norm per key (zero rows stay zero)."""
    phi_k = _wide(phi_k)
    return phi_k / torch.linalg.vector_norm(phi_k, dim=-1, keepdim=True).clamp_min(KEY_NORM_FLOOR)


def values_and_ones(v):
    """[v, 1] [..., N, Dv + 1]: what the state's columns hold, the normaliser last."""
    v = _wide(v)
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _joined(state: KernelState | None, keys, values):
    """The state as one [..., F, Dv + 1] matrix (zeros for None)."""
    if state is None:
        return keys.new_zeros(*keys.shape[:-2], keys.shape[-1], values.shape[-1])
    return torch.cat([state.kv, state.key_sum.unsqueeze(-1)], dim=-1).to(keys.dtype)


def _split(s) -> KernelState:
    return KernelState(s[..., :-1], s[..., -1])


def _read(read, eps: float):
    """A read of the state [..., Dv + 1] as numerator / (normaliser + eps)."""
    return read[..., :-1] / (read[..., -1:] + eps)


def naive_delta_attention(
    phi_q, phi_k, v, initial_state: KernelState | None = None, output_final_state: bool = False, *, eps=DENOMINATOR_EPS
):
    """The delta rule one position at a time (the module docstring's recurrence), from
    ``initial_state`` (None: zeros): (out [..., N, Dv], the state after, or None). For tests."""
    keys, values, phi_q = normalised_keys(phi_k), values_and_ones(v), _wide(phi_q)
    s, reads = _joined(initial_state, keys, values), []
    for t in range(keys.shape[-2]):
        k_t = keys[..., t : t + 1, :]  # [..., 1, F]
        s = s + k_t.transpose(-2, -1) @ (values[..., t : t + 1, :] - k_t @ s)
        reads.append(phi_q[..., t : t + 1, :] @ s)
    out = _read(torch.cat(reads, dim=-2), eps)
    return out, _split(s) if output_final_state else None


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower triangular a [..., C, C], by block doubling: with D the
    block diagonal of I + a in blocks of b (its inverse known) and E its lower blocks within
    blocks of 2b, (D + E)^-1 = D^-1 - D^-1 E D^-1 (E D^-1 E = 0)."""
    c = a.shape[-1]
    index = torch.arange(c, device=a.device)
    inverse = torch.eye(c, dtype=a.dtype, device=a.device)
    size = 1
    while size < c:
        pairs = (index[:, None] // (2 * size) == index // (2 * size)) & (index[:, None] // size != index // size)
        inverse = inverse - inverse @ (a * pairs) @ inverse
        size *= 2
    return inverse


def chunk_corrections(k4, vo4):
    """Per chunk (k4 [G, chunks, C, F] normalised keys, vo4 their [v, 1]): W = T K and U = T V,
    T = (I + tril(K K^T, -1))^-1 (beta 1)."""
    t = unit_lower_inverse(torch.tril(k4 @ k4.transpose(-2, -1), -1))
    return t @ k4, t @ vo4


def chunk_delta_attention(
    phi_q,
    phi_k,
    v,
    initial_state: KernelState | None = None,
    output_final_state: bool = False,
    *,
    chunk: int,
    eps: float = DENOMINATOR_EPS,
):
    """The delta rule of phi_q, phi_k [..., N, F] and v [..., N, Dv] after ``initial_state``
    (None: the first positions), in chunks of ``chunk`` positions (the module docstring): (out
    [..., N, Dv], the state after the N keys, or None unless ``output_final_state``), as
    kernel.state.chunk_kernel_attention (no log scales: normalised keys have none). Padded at
    the end with zero keys, which write nothing."""
    lead, n = phi_q.shape[:-2], phi_q.shape[-2]
    keys, values = normalised_keys(phi_k), values_and_ones(v)
    s = flatten_heads(_joined(initial_state, keys, values))
    chunks = -(-n // chunk)

    def blocks(x):
        x = torch.nn.functional.pad(flatten_heads(x), (0, 0, 0, chunks * chunk - n))
        return x.reshape(x.shape[0], chunks, chunk, x.shape[-1])

    q4, k4, vo4 = blocks(_wide(phi_q)), blocks(keys), blocks(values)
    w, u = chunk_corrections(k4, vo4)
    scores = torch.tril(q4 @ k4.transpose(-2, -1))
    reads = []
    for c in range(chunks):
        corrections = u[:, c] - w[:, c] @ s
        reads.append(q4[:, c] @ s + scores[:, c] @ corrections)
        s = s + k4[:, c].transpose(-2, -1) @ corrections
    read = torch.stack(reads, dim=1).reshape(s.shape[0], chunks * chunk, -1)[:, :n]
    out = _read(read, eps).reshape(*lead, n, v.shape[-1])
    if not output_final_state:
        return out, None
    return out, _split(s.reshape(*lead, *s.shape[-2:]))
