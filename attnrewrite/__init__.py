"""attnrewrite: find softmax attention in ONNX models and torch.fx graphs, replace it with
linearized attention, and prove the result."""

from attnrewrite.api import find_sites, rewrite
from attnrewrite.generate import generate  # (the function; the module stays in sys.modules)
from attnrewrite.version import __version__

__all__ = ["find_sites", "generate", "rewrite", "__version__"]
