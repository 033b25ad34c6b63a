"""The window hybrid's settings, once: what a method's ``window``, ``window_next`` and ``sinks``
options mean (Window), how they are declared and checked (the option fields below, which every
windowed method's Options uses), and what follows from them alone (the exact part, the repr,
the kernel part's starting weight)."""

from __future__ import annotations

import dataclasses
import enum
import typing

import numpy as np

from attnrewrite.passes.exact_part import ExactPart
from attnrewrite.passes.kernel.numerics import DENOMINATOR_EPS, RESCALED_EPS
from attnrewrite.passes.layout import fitted_heads
from attnrewrite.passes.options import AtLeast, Range, option
from attnrewrite.passes.recurrent import key_value_groups

# Positions per chunk of a causal window's far part (onnx_causal._chunked_far_sums_functions), rounded
# to whole blocks of the window: at window=32 pairs of blocks, measured faster on CPU than chunks of 4
# (bench/ab_attention.py, hedgehog: the prefix of fewer states saves less than the [4W, 4W]
# masked scores cost).
WINDOW_FAR_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Window:
    """Exact softmax over each query's block of ``size`` positions, the previous block, the next
    one (bidirectional sites, ``following``) and the first ``sinks`` positions; the kernel beyond.
    Causal sites with ``sparse`` = G > 0 also keep G earlier key/value pairs per key/value head
    exactly, those the kernel state recalls worst (sparse_cache.py); ``groups``: the query heads
    sharing each key/value head (1 where the site does not say).

    Built from a method's Options (Window.of), whose fields (window_option, window_next_option,
    sinks_option, sparse_option) are where the values are checked."""

    size: int
    following: bool
    sinks: int
    sparse: int = 0
    groups: int = 1

    @classmethod
    def of(cls, options, site=None) -> Window | None:
        """The window of a windowed method's ``options`` (at ``site``, which says how its heads
        are grouped, for a sparse cache); None when it is off (window=0)."""
        if not options.window:
            return None
        sparse = options.sparse
        groups = key_value_groups(site) if sparse and site is not None else 1
        return cls(options.window, options.window_next, options.sinks, sparse, groups)

    def exact_part(self, causal: bool) -> ExactPart:
        """Where the hybrid is softmax attention itself. Bidirectional blocks are aligned to the
        end: with ``following`` a query sees every key while there are at most 2 blocks (its own,
        the previous, the next: 3W keys, plus the sinks); without, only while there is one (or
        every key is a sink). Causal blocks are aligned to the start: the last query's kernel
        part is the keys before its previous block, exact while they are all sinks."""
        said = f"window={self.size}" + (f", sparse={self.sparse}" if self.sparse else "")
        if causal:  # the cache holds every far key while there are at most sparse of them
            exact = self.sinks + self.sparse
            return ExactPart(self.size * (2 + exact // self.size), 2 * self.size + exact, said)
        blocks = 2 if self.following else 1
        return ExactPart(max(blocks * self.size, self.sinks), (blocks + 1) * self.size + self.sinks, said)

    def __str__(self) -> str:
        sparse = f", sparse={self.sparse}" if self.sparse else ""
        return f"window={self.size}, window_next={self.following}, sinks={self.sinks}{sparse}"


class KernelUnit(enum.Enum):
    """How a method's kernel part is weighed against the exact part, whose weights are in units
    of e^(s_ij - m_i) (m_i the row's max exact logit); one normaliser for both."""

    SHARED = "shared"  # the kernel's own weights, times w_h (linear)
    LOG_SCALED = "log_scaled"  # phi_q.phi_k e^(a_i + b_j) estimates e^(s_ij) (favor)
    MAX_WEIGHTED = "max_weighted"  # fitted log scales, moved by e^(-beta_h m_i) (hedgehog)

    @property
    def rescaled(self) -> bool:
        """Whether the kernel part comes with query and key log scales."""
        return self is not KernelUnit.SHARED

    @property
    def max_weighted(self) -> bool:
        return self is KernelUnit.MAX_WEIGHTED

    @property
    def eps(self) -> float:
        """The denominators' guard (kernel.numerics says why rescaled ones take their own)."""
        return RESCALED_EPS if self.rescaled else DENOMINATOR_EPS


class KernelScales(typing.NamedTuple):
    """The kernel part's weight and log scales in the torch forms (torch tensors, or None):
    w_h = exp(linear_log_weight) [heads, 1, 1]; with a rescaled KernelUnit the query and key log
    scales and, max weighted, beta_h = local_max_weight [heads, 1, 1]."""

    linear_log_weight: typing.Any = None
    query_log_scale: typing.Any = None
    key_log_scale: typing.Any = None
    local_max_weight: typing.Any = None


UNSCALED = KernelScales()  # the kernel's own weights, w_h = 1: a shared unit


def exact_part(options, causal: bool = False) -> ExactPart | None:
    """A windowed method's exact part (passes.exact_part): only with a window."""
    window = Window.of(options)
    return None if window is None else window.exact_part(causal)


def window_option(kernel: str):
    """The ``window`` field of a windowed method's Options; ``kernel``: what covers the rest."""
    return option(0, f"exact softmax over blocks of this many positions, {kernel} beyond (0: off)", valid=AtLeast(0))


def window_next_option():
    """The ``window_next`` field of a windowed method's Options."""
    return option(
        True,
        "with window, bidirectional sites: the next block's keys are exact too "
        "(causal sites never see later keys, so there it changes nothing)",
    )


def sinks_option():
    """The ``sinks`` field of a windowed method's Options."""
    return option(
        1,
        "with window: the first S key positions are exact for every query (attention sinks such as [CLS]); 0: none",
        valid=AtLeast(0),
    )


class SparseCacheSize(Range):
    """0, or any size with a window (a cache of keys leaving the window needs one)."""

    def __str__(self) -> str:
        return ">= 0, and 0 without window"

    def admits(self, value, options) -> bool:
        return value == 0 or (value > 0 and options.window > 0)

    def requirement(self, options) -> str:
        return ">= 0" if options.window else "0 without window (window=0)"


def sparse_option():
    """The ``sparse`` field of a windowed method's Options (sparse_cache.py)."""
    return option(
        0,
        "with window, causal sites: G key/value pairs per key/value head kept exactly beyond the window, "
        "those the kernel state recalls worst (LoLA), the others folded into it; 0: none",
        valid=SparseCacheSize(),
    )


def sparse_refusal(site, options) -> str | None:
    """Why a windowed method's ``options`` cannot replace ``site``: a sparse cache is causal only."""
    if options.window and options.sparse and not site.mask.causal:
        return f"sparse={options.sparse} keeps keys as they leave a causal window: this site is bidirectional"
    return None


def sparse_weights_unavailable(options) -> str | None:
    """Why a windowed method gives no attention weights with a sparse cache."""
    if options.window and options.sparse:
        return (
            f"sparse={options.sparse}: which keys the cache keeps depends on the values, which the weights do not read"
        )
    return None


def window_repr(window: Window | None) -> str:
    """The window's part of a windowed method's extra_repr ("" without a window)."""
    return "" if window is None else f", {window}"


def initial_linear_log_weight(site) -> np.ndarray:
    """The window's per-head log mixing weight [heads, 1, 1] before fitting: 0, weight 1."""
    return np.zeros((fitted_heads(site), 1, 1), np.float32)
