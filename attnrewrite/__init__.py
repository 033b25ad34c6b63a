"""attnrewrite: find softmax attention in ONNX models and torch.fx graphs, replace it with
linearized attention, and prove the result."""

__version__ = "0.1.0"
