"""torch is an optional extra: pass modules import it from here so the ONNX path works without it."""

from __future__ import annotations

try:
    import torch
    from torch import nn

    Module = nn.Module
except ImportError:  # pragma: no cover - exercised only in torch-less installs
    torch = None  # type: ignore[assignment]

    class Module:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError("the torch lowering needs PyTorch: pip install 'attnrewrite[torch]'")
