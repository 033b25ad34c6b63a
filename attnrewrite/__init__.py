"""attnrewrite: find softmax attention in ONNX models and torch.fx graphs, replace it with
linearized attention, and prove the result."""

__version__ = "0.1.0"

from attnrewrite.api import find_sites, rewrite  # noqa: E402
from attnrewrite.generate import generate  # noqa: E402  (the function; the module stays in sys.modules)

__all__ = ["find_sites", "generate", "rewrite", "__version__"]
