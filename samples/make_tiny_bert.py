"""Builds samples/tiny_bert.onnx: a 2-layer BERT (random weights, hidden 64, 4 heads) exported
with torch's TorchScript-based exporter, dynamic batch and sequence. Needs the [test] extras.

    python samples/make_tiny_bert.py
"""

from pathlib import Path

import torch
from transformers import BertConfig, BertModel


class LastHiddenState(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def main(path: Path = Path(__file__).with_name("tiny_bert.onnx")) -> None:  # noqa: B008 - a constant path
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    model = LastHiddenState(BertModel(config, add_pooling_layer=False).eval())
    ids = torch.randint(0, 1000, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    dynamic = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        model,
        (ids, mask),
        path,
        dynamo=False,
        opset_version=18,
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "last_hidden_state": dynamic},
    )
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
