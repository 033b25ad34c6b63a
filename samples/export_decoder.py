"""A decoder to start from: a transformers model folder (a tiny random one when none is given),
its ONNX exports with and without a KV cache, its tokenizer, and onnxruntime-genai's model
builder folder made from it.

    python samples/export_decoder.py OUT                 # tiny random Llama
    python samples/export_decoder.py OUT --model HF_DIR  # your model folder
    python samples/export_decoder.py OUT --arch qwen2 --precision int4

- OUT/hf: the transformers model (config.json, generation_config.json, weights) and its
  tokenizer (tokenizer.json, tokenizer_config.json), when no --model is given;
- OUT/export: decoder_kv.onnx, exported for generation as optimum exports it (input_ids,
  attention_mask over past and new tokens, position_ids, past_key_values.{i}.key/value in,
  logits and present.{i}.key/value out), decoder.onnx without a cache (the whole sequence each
  call), and beside them the model's config.json and tokenizer files;
- OUT/builder: what ``python -m onnxruntime_genai.models.builder`` writes (model.onnx with its KV
  cache in GroupQueryAttention, genai_config.json, the tokenizer), when onnxruntime-genai is
  installed.

``attnrewrite OUT/export/decoder_kv.onnx --to hedgehog --recurrent -o DIR/`` or ``attnrewrite
OUT/builder --to hedgehog --recurrent -o DIR/`` writes a recurrent folder genai runs
(docs/genai.md). Needs transformers and torch ([torch] extra), tokenizers ([text]) and, for the
builder folder, onnxruntime-genai ([genai]).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

PAD, BOS, EOS = 0, 1, 2
VOCAB = 256
# GroupQueryAttention on CPU wants a head size that is a multiple of 16 when it rotates
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY |= {"num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": VOCAB}
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def tiny_decoder(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A random-weight decoder of ``arch`` with a word-level tokenizer of VOCAB tokens, saved
    as transformers saves a model (the layout the builder reads)."""
    import torch
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURES[arch])
    config = config_class(**TINY, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # biases start at zero, and the builder drops zero biases: give them values
        for name, parameter in model.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.normal_(0, 0.2)
    model.save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(folder)
    save_tokenizer(folder, config.max_position_embeddings)
    return folder


def save_tokenizer(folder: Path, max_length: int) -> None:
    """tokenizer.json (words w3..w255 by whitespace; <pad>, <s>, </s> first) and its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w3"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_length
    )
    fast.save_pretrained(folder)


def transformers_exports(hf: Path, out: Path) -> Path:
    """OUT/decoder_kv.onnx (KV cache) and OUT/decoder.onnx (none), with the model's config and
    tokenizer files beside them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="sdpa").eval()
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    out.mkdir(parents=True, exist_ok=True)
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    batch, new, cached = 2, 3, 4  # traced with different lengths, so that no exporter confuses them
    ids = torch.randint(3, model.config.vocab_size, (batch, new))
    mask = torch.ones(batch, cached + new, dtype=torch.int64)
    positions = torch.arange(cached, cached + new).expand(batch, new)
    cache = [torch.randn(batch, kv_heads, cached, head_dim) for _ in past]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"}}
    axes |= {"attention_mask": {0: "batch", 1: "total"}, "logits": {0: "batch", 1: "sequence"}}
    axes |= {name: {0: "batch", 2: "past"} for name in past} | {name: {0: "batch", 2: "total"} for name in present}
    names = ["input_ids", "attention_mask", "position_ids"]
    cached_module, uncached_module = _wrappers()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on tracing
        torch.onnx.export(
            cached_module(model, layers), (ids, mask, positions, *cache), str(out / "decoder_kv.onnx"),
            input_names=names + past, output_names=["logits", *present], dynamic_axes=axes, dynamo=False,
        )  # fmt: skip
        torch.onnx.export(
            uncached_module(model), (ids, mask[:, :new], positions - cached), str(out / "decoder.onnx"),
            input_names=names, output_names=["logits"], dynamic_axes=axes | {"attention_mask": {0: "batch", 1: "sequence"}},
            dynamo=False,
        )  # fmt: skip
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf / name).is_file():
            shutil.copyfile(hf / name, out / name)
    return out


def _wrappers():
    """Modules with flat tensors in and out, as the exporter wants them (torch imported late:
    the sample's --help needs none of it)."""
    from torch import nn
    from transformers import DynamicCache

    class Cached(nn.Module):
        def __init__(self, model, layers: int):
            super().__init__()
            self.model, self.layers = model, layers

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            for layer in range(self.layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
            return (out.logits, *(t for layer in out.cache.layers for t in (layer.keys, layer.values)))

    class Uncached(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits

    return Cached, Uncached


def builder_folder(hf: Path, out: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's model builder on ``hf`` for the CPU, its tokenizer files kept as
    they were (the builder saves them again through transformers, which may change them)."""
    with tempfile.TemporaryDirectory() as cache:
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
        command += ["-p", precision, "-e", "cpu", "-c", cache]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"the model builder failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf / name, out / name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write into")
    parser.add_argument("--model", type=Path, help="a transformers model folder (default: a tiny random one)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama", help="of the tiny random model")
    parser.add_argument("--precision", choices=("fp32", "fp16", "int4"), default="fp32", help="of the builder's model")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf = args.model or tiny_decoder(args.out / "hf", args.arch)
    print(f"transformers model: {hf}")
    print(f"ONNX exports: {transformers_exports(hf, args.out / 'export')}")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        print("onnxruntime-genai is not installed (pip install 'attnrewrite[genai]'): no builder folder")
        return 0
    print(f"builder folder: {builder_folder(hf, args.out / 'builder', args.precision)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
