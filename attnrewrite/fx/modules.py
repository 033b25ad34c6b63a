"""Replacements for torch.nn modules that hold attention, keeping their calling conventions.

``LinearizedMultiheadAttention`` takes nn.MultiheadAttention's place: same arguments (query,
key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal), same
parameters under the same names (the state_dict does not change), and a pass module where the
softmax was. The masks were classified when the site was matched: the causal triangle is built
into the pass module, key_padding_mask becomes its key_keep.

nn.TransformerEncoderLayer / nn.TransformerEncoder have fused fast paths that call
``torch._transformer_encoder_layer_fwd`` with the attention weights directly, bypassing
``self_attn``; the ``Linearized*`` versions below keep their children (so state_dict keys are
unchanged) and always take the path that calls ``self_attn``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from attnrewrite.fx.masks import key_keep_from_mask
from attnrewrite.site import MaskEncoding


class LinearizedMultiheadAttention(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, attention: nn.Module):
        super().__init__()
        self.embed_dim = mha.embed_dim
        self.num_heads = mha.num_heads
        self.head_dim = mha.head_dim
        self.batch_first = mha.batch_first
        self.separate_projections = not mha._qkv_same_embed_dim
        if self.separate_projections:
            self.q_proj_weight = mha.q_proj_weight
            self.k_proj_weight = mha.k_proj_weight
            self.v_proj_weight = mha.v_proj_weight
        else:
            self.in_proj_weight = mha.in_proj_weight
        self.in_proj_bias = mha.in_proj_bias
        self.out_proj = mha.out_proj
        self.attention = attention

    def _project(self, query, key, value):
        if self.separate_projections:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        else:
            weights = self.in_proj_weight.chunk(3)
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        return [F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases)]

    def _split_heads(self, x):  # [B, N, E] -> [B, H, N, Dh]
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        batched = query.dim() == 3
        if not batched:  # [N, E]: one sequence
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # [N, B, E]
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q, k, v = (self._split_heads(x) for x in self._project(query, key, value))
        key_keep = None
        if key_padding_mask is not None:  # [B, Nk], True (or -inf) = padding
            key_keep = key_keep_from_mask(key_padding_mask[:, None, None, :], MaskEncoding.MHA.value)
        out = self.attention(q, k, v, key_keep)
        out = self.out_proj(out.transpose(1, 2).flatten(-2))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None  # no attention weights exist

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


class LinearizedTransformerEncoderLayer(nn.Module):
    def __init__(self, layer: nn.TransformerEncoderLayer):
        super().__init__()
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.norm_first = layer.norm_first
        if "activation" not in self._modules:  # a function such as F.relu, not a module
            self.activation = layer.activation

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False, is_causal=is_causal
        )[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class LinearizedTransformerEncoder(nn.Module):
    """``causal`` is the mask kind proven at rewrite time (nn.TransformerEncoder would compare
    the mask with a causal triangle at run time, which torch.export cannot trace)."""

    def __init__(self, encoder: nn.TransformerEncoder, causal: bool):
        super().__init__()
        self.layers = encoder.layers
        self.norm = encoder.norm
        self.causal = causal

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=self.causal)
        if self.norm is not None:
            output = self.norm(output)
        return output

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


def slow_path_container(container: nn.Module, causal: bool) -> nn.Module:
    """The Linearized* version of a torch.nn container whose self_attn modules were swapped."""
    if isinstance(container, nn.TransformerEncoder):
        for index, layer in enumerate(container.layers):
            if isinstance(layer, nn.TransformerEncoderLayer) and not isinstance(layer.self_attn, nn.MultiheadAttention):
                container.layers[index] = LinearizedTransformerEncoderLayer(layer)
        return LinearizedTransformerEncoder(container, causal)
    if isinstance(container, nn.TransformerEncoderLayer):
        return LinearizedTransformerEncoderLayer(container)
    raise TypeError(f"no slow path for {type(container).__name__}")
