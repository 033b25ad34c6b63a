"""Positive orthogonal random features' projection (favor.py; Choromanski et al., "Rethinking
Attention with Performers", ICLR 2021): W [features, head_dim] drawn once, at rewrite time, from
``numpy.random.default_rng(seed)``, rows orthogonal in blocks of d (QR of a Gaussian,
Haar-distributed), row lengths chi(d)-distributed like a Gaussian's or fixed at sqrt(d)."""

from __future__ import annotations

import math

import numpy as np


def default_features(head_dim: int) -> int:
    """The paper's O(d log d) features: enough for the estimator, few enough to stay cheap."""
    return max(1, round(head_dim * math.log(head_dim)))


def draw_projection(head_dim: int, features: int, seed: int, orthogonal: bool = True, norms: str = "chi") -> np.ndarray:
    """W [features, head_dim] float32; the same arguments give the same bytes."""
    rng = np.random.default_rng(seed)
    if orthogonal:
        blocks = [_haar_orthogonal(rng, head_dim) for _ in range(-(-features // head_dim))]
        directions = np.concatenate(blocks)[:features]
    else:
        gaussian = rng.standard_normal((features, head_dim))
        directions = gaussian / np.linalg.norm(gaussian, axis=1, keepdims=True)
    if norms == "chi":
        # Direction and length of a Gaussian vector are independent, so unit rows times chi(d)
        # lengths keep every row's marginal N(0, I_d): the estimator stays unbiased.
        lengths = np.sqrt(rng.chisquare(head_dim, size=features))
    else:
        lengths = np.full(features, math.sqrt(head_dim))
    return (directions * lengths[:, None]).astype(np.float32)


def _haar_orthogonal(rng: np.random.Generator, d: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    # QR leaves each column's sign to LAPACK; fixing it by R's diagonal makes Q Haar-distributed.
    return q * np.sign(np.diag(r))
