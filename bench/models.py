"""The models the standard sweep measures, built in-process from configs (never downloaded):
BERT-shaped encoder stacks that take hidden states (so no position table caps the length), and
a bare attention, exported to ONNX with torch's TorchScript-based exporter."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertModel

OPSET = 18


class EncoderStack(torch.nn.Module):
    """BERT's encoder layers (self-attention with Q, K, V and output projections, FFN, layer
    norms) on hidden states [batch, N, d]."""

    def __init__(self, hidden: int, heads: int, layers: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        config = BertConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=4 * hidden,
            attn_implementation="eager",
        )
        self.encoder = BertModel(config, add_pooling_layer=False).encoder.eval()

    def forward(self, hidden_states):
        return self.encoder(hidden_states).last_hidden_state


class SoftmaxAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d)) v on [batch, heads, N, head_dim]: the attention-only model."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = head_dim**-0.5  # a Python float, so the export holds a constant

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def export_encoder(path: Path, hidden: int = 768, heads: int = 12, layers: int = 1) -> Path:
    model = EncoderStack(hidden, heads, layers)
    example = torch.randn(1, 16, hidden)
    export(model, (example,), ["hidden_states"], {"hidden_states": {1: "sequence"}}, path)
    return path


def export_attention(path: Path, heads: int = 12, head_dim: int = 64) -> Path:
    example = tuple(torch.randn(1, heads, 16, head_dim) for _ in range(3))
    axes = {name: {2: "sequence"} for name in "qkv"}
    export(SoftmaxAttention(head_dim), example, list("qkv"), axes, path)
    return path


def export(model, example, input_names, axes, path: Path) -> None:
    with torch.no_grad():
        torch.onnx.export(
            model,
            example,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=input_names,
            output_names=["output"],
            dynamic_axes={**axes, "output": {1 if "hidden_states" in axes else 2: "sequence"}},
        )
