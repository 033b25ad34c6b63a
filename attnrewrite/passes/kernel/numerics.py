"""The numeric guards of the kernel family and the window hybrid: denominators that stay finite,
log scales whose differences are never NaN, exponents kept out of the subnormal range."""

from __future__ import annotations

DENOMINATOR_EPS = 1e-6  # keeps rows whose keys are all masked finite (0 instead of 0/0)


# The same guard for denominators in units of exp(-stabilisers) (favor; hedgehog's window), which
# can be legitimately tiny, so DENOMINATOR_EPS would bias them; 1e-30 is still a normal float32,
# and a denominator near it has underflowed anyway.
RESCALED_EPS = 1e-30


# "No key yet" in running maxima of log scales: finite, so differences of two stay NaN-free
# (-inf - -inf is NaN) while exp of any difference with a real scale is still 0.
LOWEST_LOG_SCALE = -3.0e38


EXP_FLOOR = 80.0  # e^-80 is a normal float32; see local_softmax_sums


# The least exponent shift of a window row (ONNX): where no exact key is kept, e^(lowest log
# scale - shift) is still 0 instead of e^0.
NO_EXACT_KEY_SHIFT = -1.0e30


# What a window's exact logit gets for a key it does not take (not kept, or outside the pair's
# structure): two of them add up to the lowest log scale, still finite, so no row max is -inf.
MASKED_LOGIT_BIAS = LOWEST_LOG_SCALE / 2
