"""nn.MultiheadAttention through the legacy (TorchScript) exporter with a dynamic batch.

The exporter computes the scale from q's shape (Shape -> Slice -> Cast -> Sqrt) and builds q by
Reshape [seq, batch * heads, head_dim] -> Transpose -> Reshape [batch, heads, seq, head_dim],
with the head size itself computed from the input's shape (Gather(Shape(x), 2) / heads). With
the batch dynamic nothing of that is a constant to shape inference, yet every size it reads is
static: detection must fold it (scale 1/sqrt(head_dim), heads, head_dim), and every method,
those that need head_dim too, must rewrite the sites and match its torch reference.
The sequence stays fixed: this exporter bakes the traced length into MultiheadAttention's
Reshapes (tests/models.py exports it at a fixed shape for that reason). torchvision has no CPU
wheel for this torch here, so its ViT is rebuilt as torchvision writes it (VisionTransformer:
conv patches, class token, learned positions, pre-norm EncoderBlocks around
nn.MultiheadAttention(batch_first=True) called with need_weights=False).
"""

from __future__ import annotations

import pytest
import torch
from conftest import read_record
from models import (
    APPROXIMATING_OPTIONS,
    BIDIRECTIONAL_REFUSED,
    CAUSAL_REFUSED,
    HEADS,
    HIDDEN,
    LAYERS,
    Export,
    ExportUnsupported,
    ModelSpec,
    TorchEncoder,
    _seeded,
    export_onnx,
    relative_error,
    run_onnx,
    torch_reference,
)
from torch import nn

import attnrewrite
from attnrewrite import passes

SEQ, MEMORY = 8, 5
TOLERANCE = 1e-5
METHODS = {"hydra": {}, "linear": {}, **APPROXIMATING_OPTIONS}


class TorchDecoder(nn.Module):
    """nn.TransformerDecoder: causal self-attention over the target, then attention to memory."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerDecoderLayer(HIDDEN, HEADS, dim_feedforward=2 * HIDDEN, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 1)

    def forward(self, x, memory):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        # the flags said outright: left to be detected, the traced check is a tensor sdpa refuses
        return self.decoder(x, memory, tgt_mask=mask, tgt_is_causal=True, memory_is_causal=False)


class TorchTransformer(nn.Module):
    """nn.Transformer: encoder self-attention, decoder self-attention, cross-attention."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(HIDDEN, HEADS, 1, 1, 2 * HIDDEN, dropout=0.0, batch_first=True)

    def forward(self, x, memory):
        return self.transformer(memory, x, src_is_causal=False, tgt_is_causal=False, memory_is_causal=False)


class TorchvisionStyleViT(nn.Module):
    """torchvision.models.VisionTransformer's structure at toy size: 16x16 images in 4x4 patches."""

    IMAGE, PATCH = 16, 4

    def __init__(self):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, HIDDEN, kernel_size=self.PATCH, stride=self.PATCH)
        self.class_token = nn.Parameter(torch.randn(1, 1, HIDDEN))
        self.pos_embedding = nn.Parameter(0.02 * torch.randn(1, (self.IMAGE // self.PATCH) ** 2 + 1, HIDDEN))
        self.blocks = nn.ModuleList(_EncoderBlock() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(HIDDEN)

    def forward(self, images):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)  # [batch, patches, hidden]
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


class _EncoderBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.self_attention = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


def _images(batch: int, seq: int) -> dict[str, torch.Tensor]:  # seq: fixed by the image size
    size = TorchvisionStyleViT.IMAGE
    return {"images": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))}


def _inputs(*names_and_lengths):
    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:  # seq is fixed: see the module doc
        generator = torch.Generator().manual_seed(batch)
        return {name: torch.randn(batch, length, HIDDEN, generator=generator) for name, length in names_and_lengths}

    return make


def _spec(name, build, names_and_lengths, layers, masks):
    names = tuple(n for n, _ in names_and_lengths)
    spec = ModelSpec(
        name,
        _seeded(build),
        names,
        _inputs(*names_and_lengths),
        {n: {0: "batch"} for n in names},
        layers=layers,
        mask=masks[0],
        swap="sdpa",
    )
    return spec, masks


# the mask of each site, in graph order
SPECS = {
    spec.name: (spec, masks)
    for spec, masks in (
        _spec("encoder", lambda: TorchEncoder(causal=False), [("x", SEQ)], LAYERS, ["none"] * LAYERS),
        _spec("decoder", TorchDecoder, [("x", SEQ), ("memory", MEMORY)], 2, ["causal", "none"]),
        _spec("transformer", TorchTransformer, [("x", SEQ), ("memory", MEMORY)], 3, ["none"] * 3),
        (
            ModelSpec(
                "torchvision-vit",
                _seeded(TorchvisionStyleViT),
                ("images",),
                _images,
                {"images": {0: "batch"}},
                layers=LAYERS,
                mask="none",
                swap="sdpa",
            ),
            ["none"] * LAYERS,
        ),
    )
}


@pytest.fixture(scope="module")
def legacy_export(tmp_path_factory):
    """legacy_export(name): each model built and exported once, or a skip with the exporter's reason."""
    folder = tmp_path_factory.mktemp("legacy-multihead-attention")
    cache: dict[str, Export | ExportUnsupported] = {}

    def get(name: str) -> Export:
        if name not in cache:
            spec = SPECS[name][0]
            module = spec.build()
            try:
                cache[name] = Export(
                    spec, module, export_onnx(spec, module, folder / f"{name}.onnx", "legacy"), "legacy", True
                )
            except ExportUnsupported as reason:
                cache[name] = reason
        if isinstance(cache[name], ExportUnsupported):
            pytest.skip(str(cache[name]))
        return cache[name]

    return get


@pytest.mark.parametrize("name", SPECS)
def test_scale_heads_and_head_size_are_read_from_static_shape_arithmetic(legacy_export, name):
    spec, masks = SPECS[name]
    sites = attnrewrite.find_sites(legacy_export(name).load())
    assert [(s.skip_reason, s.mask.value, s.num_heads, s.head_dim, s.value_dim) for s in sites] == [
        (None, mask, HEADS, HIDDEN // HEADS, HIDDEN // HEADS) for mask in masks
    ]
    for site in sites:
        assert site.scale == pytest.approx((HIDDEN // HEADS) ** -0.5, rel=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", SPECS)
def test_every_method_rewrites_and_matches_its_torch_reference(legacy_export, name, method):
    spec, masks = SPECS[name]
    export = legacy_export(name)
    options = METHODS[method]
    model = attnrewrite.rewrite(export.load(), to=method, **options)
    record = read_record(model)
    method_pass = passes.get_pass(method)
    opts = passes.make_options(method_pass, **options)

    sites = attnrewrite.find_sites(export.load())
    expected_status = ["skipped" if method_pass.supports(s, opts) else "rewritten" for s in sites]
    assert [s["status"] for s in record["sites"]] == expected_status
    refused = (method in CAUSAL_REFUSED) * masks.count("causal")
    refused += (method in BIDIRECTIONAL_REFUSED) * (len(masks) - masks.count("causal"))
    assert expected_status.count("rewritten") == len(masks) - refused

    inputs = spec.inputs(batch=3)  # another batch than the export traced
    swap = [s.layer for s, status in zip(sites, expected_status) if status == "rewritten"]
    expected, state = torch_reference(export, method, inputs, options=opts, swap_layers=swap)
    assert state["calls"] == len(masks)
    assert relative_error(run_onnx(model, inputs), expected) < TOLERANCE
