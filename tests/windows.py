"""The window hybrid's torch forms called with the window's and the kernel part's settings as
keywords (window, window_next, sinks, linear_log_weight, query_log_scale, key_log_scale,
local_max_weight), as the tests vary them one at a time."""

from __future__ import annotations

from attnrewrite.passes.window.reference import windowed_attention_weights
from attnrewrite.passes.window.settings import KernelScales, Window
from attnrewrite.passes.window.torch_form import windowed_kernel_attention

SCALE_NAMES = KernelScales._fields


def _settings(keywords: dict) -> tuple[Window, KernelScales, dict]:
    window = Window(keywords.pop("window"), keywords.pop("window_next"), keywords.pop("sinks"))
    return window, KernelScales(**{name: keywords.pop(name, None) for name in SCALE_NAMES}), keywords


def windowed(phi_q, phi_k, q, k, v, **keywords):
    """windowed_kernel_attention."""
    window, scales, rest = _settings(dict(keywords))
    return windowed_kernel_attention(phi_q, phi_k, q, k, v, window, scales=scales, **rest)


def windowed_weights(phi_q, phi_k, q, k, **keywords):
    """windowed_attention_weights, the N x N definition."""
    window, scales, rest = _settings(dict(keywords))
    return windowed_attention_weights(phi_q, phi_k, q, k, window, scales=scales, **rest)
