"""AttentionSite: one matched softmax attention, described without reference to ONNX or FX.

Frontends reduce whatever they matched to this form; passes decide from it alone whether
and how they can replace the attention.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class MaskKind(str, enum.Enum):
    NONE = "none"
    KEY_PADDING = "key_padding"
    CAUSAL = "causal"
    CAUSAL_KEY_PADDING = "causal+key_padding"
    BIAS = "bias"  # an arbitrary additive term no linear method can express
    UNKNOWN = "unknown"  # not classified: the site was refused before its mask was looked at

    @property
    def causal(self) -> bool:
        return self in (MaskKind.CAUSAL, MaskKind.CAUSAL_KEY_PADDING)

    @property
    def key_padding(self) -> bool:
        return self in (MaskKind.KEY_PADDING, MaskKind.CAUSAL_KEY_PADDING)


# --- what both frontends' detectors share, so that they find and classify sites alike ----------


class Unsupported(Exception):
    """The one way a detector refuses: raised where it finds what it cannot prove (the message
    is the reason, word for word), caught once per site by the frontend's matcher or mask
    classifier, which writes it to ``AttentionSite.skip_reason``."""


# How deep upstream of a node on the logits (in nodes, breadth first) a detector looks for the
# product of two activations, q @ k^T: past the scale, mask and cast nodes exporters put between
# them, not so far that it finds the previous layer's attention.
UPSTREAM_WALK_DEPTH = 8
# The ONNX detector's other walks, each bounded so that a graph it does not understand ends in a
# refusal, never in a walk through the whole model:
# nodes from the softmax back to q @ k^T, one path: the scales, mask Adds and Wheres, Casts and
# Identities exporters write there are a handful; room for several times that
SCORE_PATH_LENGTH = 16
# nodes from the softmax to p @ v: a NaN guard (IsNaN and Where), casts, a Dropout
PROBABILITY_PATH_LENGTH = 8
# layout nodes from a KV cache's Concat(past, new) to the attention: k's transpose (between
# Reshapes), repeated key/value heads (Unsqueeze, Expand, Reshape), a cast and a scale
CACHE_WALK_DEPTH = 10
# copies of a graph input (Identity, Cast, one-input Concat) a legacy export makes of a cache
COPY_WALK_DEPTH = 4
# MatMul and bias Add nodes back from a contrib operator's input to the weights that project it
PROJECTION_WALK_DEPTH = 4
# Masks are probed on made-up inputs of this batch and these two sequence lengths (two, so that
# a mask that is causal at one size only is caught), where the graph does not fix the lengths.
MASK_PROBE_LENGTHS = (6, 9)
MASK_PROBE_BATCH = 2
# A model with a KV cache is probed and gated with this many cached positions before the new
# ones (its attention mask spans both): fewer than the new ones, so the two are never confused.
KV_PROBE_PAST = 3


class MaskEncoding(str, enum.Enum):
    """How a mask term's values say which logits are kept, in either frontend. The values are
    the words the FX rewrite passes to its key_keep at run time (fx.masks.key_keep_from_mask)."""

    ADDITIVE = "additive"  # logits + m: 0 keeps, MASKED_BELOW or lower drops
    KEEP_WHERE_TRUE = "keep"  # boolean, True attends: Where(m, logits, fill), a boolean attn_mask
    KEEP_WHERE_FALSE = "drop"  # boolean, True is masked: Where(m, fill, logits), masked_fill
    # onnxruntime's fused attention (com.microsoft): a raw mask attends where it is > 0; a 1-D
    # mask_index is one of two index forms, told apart when the mask is evaluated (onnx/masks.py)
    KEEP_WHERE_POSITIVE = "keep_where_positive"
    KEY_LENGTHS = "key_lengths"  # [batch]: keys before length[b] attend (right padding)
    KEY_RANGES = "key_ranges"  # [2 * batch]: ends, then starts: start[b] <= key < end[b]
    # torch's attn_mask arguments, boolean or additive by dtype: scaled_dot_product_attention's
    # boolean one keeps where True, nn.MultiheadAttention's (and key_padding_mask) drops
    SDPA = "sdpa"
    MHA = "mha"

    def for_dtype(self, boolean: bool) -> MaskEncoding:
        """The encoding a value of this dtype has: torch's attn_mask conventions resolved."""
        if self not in (MaskEncoding.SDPA, MaskEncoding.MHA):
            return self
        if not boolean:
            return MaskEncoding.ADDITIVE
        return MaskEncoding.KEEP_WHERE_TRUE if self is MaskEncoding.SDPA else MaskEncoding.KEEP_WHERE_FALSE


# An additive mask value at or below this removes the key: exp(-1000) underflows to 0 in fp32.
MASKED_BELOW = -1e3


@dataclasses.dataclass
class MaskTerm:
    """One mask entering a site's logits: the graph's tensor (an ONNX value or an FX node) and
    how it encodes what is kept."""

    value: Any
    encoding: MaskEncoding
    rank: int | None = None  # learned when the mask is evaluated (onnx/masks.py)
    # the contrib ops' layout: [batch, keys], [batch, queries, keys], [batch, 1, queries, keys]
    # or a 1-D index, batch first and no head axis; otherwise aligned with the logits' last axes
    batch_first: bool = False

    @property
    def key_only(self) -> bool:
        """A key padding mask by the operator's definition, whatever its values."""
        return self.batch_first and self.rank is not None and self.rank <= 2

    @property
    def keep_rank(self) -> int | None:
        """The rank of the keep tensor the ONNX splice builds from this term."""
        return 4 if self.batch_first else self.rank


# Why a mask is refused, where both frontends find the same thing.
ATTENTION_BIAS = (
    "the additive term on the logits is an attention bias, not a mask (values other than 0 and large negatives)"
)
MASK_VARIES_WITH_LENGTH = "the mask behaves differently at different sequence lengths"


@dataclasses.dataclass(frozen=True)
class KvCache:
    """Where a site's keys and values come from in a model that generates with a KV cache: the
    keys are the past ones (a graph input, ``[batch, kv_heads, past, head_dim]``) followed by the
    new ones, and the model returns both (a graph output, ``[batch, kv_heads, past + new,
    head_dim]``) for the next step. ``kv_heads`` < the query heads: grouped or multi-query
    attention, each key/value head shared by heads / kv_heads query heads. A present name is
    None where the model does not return that cache."""

    past_key: str
    past_value: str
    present_key: str | None
    present_value: str | None
    kv_heads: int | None = None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AttentionSite:
    """softmax(scale * q @ k^T + mask) @ v, with q [..., Nq, Dh], k [..., Nk, Dh], v [..., Nk, Dv].

    ``num_heads`` is set only when the layout is known to be [batch, heads, seq, head_dim];
    for [batch*heads, seq, head_dim] it is None and methods that merge heads work per head.
    """

    name: str
    _: dataclasses.KW_ONLY
    # None: the default 1/sqrt(head_dim) of a graph without shapes, read from q at run time
    scale: float | None = 1.0
    mask: MaskKind = MaskKind.NONE
    rank: int | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    value_dim: int | None = None
    query_length: int | None = None  # Nq, when static
    dtype: str = "float32"
    layer: int | None = None
    # Why this site must be left alone; None when it is rewritable (by some method).
    skip_reason: str | None = None
    # set when the keys and values include a KV cache: queries are the new positions only, and
    # a causal mask is offset by the past length (query i sees keys up to past + i)
    kv_cache: KvCache | None = None
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def mask_label(self) -> str:
        """The mask as ``--list`` shows it: the kind, and "(kv cache)" where the keys include one."""
        return f"{self.mask.value} (kv cache)" if self.kv_cache is not None else self.mask.value

    @property
    def layout(self) -> str:
        if self.rank == 4 and self.num_heads is not None:
            return "[batch, heads, seq, head_dim]"
        if self.rank is not None:
            return f"rank {self.rank}, heads folded into batch"
        return "unknown"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "value_dim": self.value_dim,
            "query_length": self.query_length,
            "layout": self.layout,
            "scale": self.scale,
            "mask": self.mask.value,
            "dtype": self.dtype,
            **({"kv_cache": self.kv_cache.describe()} if self.kv_cache is not None else {}),
        }
