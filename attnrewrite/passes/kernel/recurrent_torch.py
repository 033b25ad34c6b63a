"""The kernel methods' recurrent form in torch (linear, hedgehog, favor; window included): the N
new tokens run the chunked causal form seeded with the incoming state (kernel/state.py,
window/torch_state.py) and the outgoing state is the last prefix (recurrent_state.py says what
it holds). S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t), o_t = phi(q_t)^T S_t /
phi(q_t)^T z_t; or the delta rule's update of the same state (kernel/delta.py)."""

from __future__ import annotations

import dataclasses

from attnrewrite.passes.kernel.delta import chunk_delta_attention
from attnrewrite.passes.kernel.feature_map import CausalTerms, FeatureMap
from attnrewrite.passes.kernel.query_key_maps import map_queries_and_keys
from attnrewrite.passes.kernel.recurrent_state import (
    CACHE_PARTS,
    KERNEL_STATE,
    LOG_SCALE,
    POSITION,
    SINK_KEEP,
    SINK_KEYS,
    SINK_VALUES,
    WINDOW_KEEP,
    WINDOW_KEYS,
    WINDOW_PARTS,
    WINDOW_VALUES,
)
from attnrewrite.passes.kernel.state import (
    KernelState,
    absorb_keys,
    chunk_kernel_attention,
)
from attnrewrite.passes.layout import expand_to_query_heads
from attnrewrite.passes.optional_torch import Module, torch
from attnrewrite.passes.recurrent import StateTensor, state_shape
from attnrewrite.passes.window.settings import KernelScales
from attnrewrite.passes.window.sparse_cache import CachedRows, Pairs, sparse_attention_from_state
from attnrewrite.passes.window.torch_state import SinkKeys, far_key_features, windowed_kernel_attention_from_state


class RecurrentKernelAttention(Module):
    """forward(q, k, v, key_keep, *state) -> (out, *state): the N new tokens' outputs (q, k, v
    [..., N, *], k and v with q's heads, or their key/value heads where ``groups`` > 1 query heads
    share each (recurrence.KernelRecurrence.key_value_groups); key_keep [..., 1 or heads, N, 1] or None) and
    the state after them, in ``description``'s order (recurrent_state.kernel_state_tensors). The parallel module (``parallel``, a
    child) holds every parameter and buffer, so a fitted one is used as it is."""

    def __init__(self, parallel, feature_map: FeatureMap, description: list[StateTensor], groups: int = 1):
        super().__init__()
        self.parallel = parallel
        self.feature_map = feature_map
        window = feature_map.window
        # a sparse cache is shared by the query heads of a key/value head
        self.window = dataclasses.replace(window, groups=groups) if window and window.sparse else window
        self.description = description
        self.groups = groups

    def forward(self, q, k, v, key_keep=None, *state):
        keep = torch.ones_like(k[..., :1], dtype=torch.float32) if key_keep is None else key_keep.float()
        keep = keep.expand(*k.shape[:-1], 1)
        state = dict(zip((t.name for t in self.description), state))
        step = (self._sparse_windowed if self.window.sparse else self._windowed) if self.window else self._plain
        out, state = step(q, k, v, keep, state)
        return (out.to(v.dtype), *(state[t.name] for t in self.description))

    def initial_state(self, q, v) -> tuple:
        """The zero state for queries and values shaped like q and v (their shapes, dtype and
        device are all it reads)."""
        sizes = {"D": q.shape[-1], "Dv": v.shape[-1], "F": q.shape[-1]}  # F unknown only for linear: d
        sizes.update(zip(("B", "H") if q.dim() == 4 else ("G",), q.shape[:-2]))
        if q.dim() == 4:
            sizes["Hkv"] = q.shape[1] // self.groups
        dtypes = {"float32": torch.float32, "int64": torch.int64, "model": v.dtype}
        return tuple(
            torch.full(state_shape(t, sizes), t.initial, dtype=dtypes[t.dtype], device=v.device)
            for t in self.description
        )

    def _terms(self, q, k, keep) -> CausalTerms:
        return self.feature_map.torch_terms(self.parallel, q, k, keep)

    def _plain(self, q, k, v, keep, state):
        q, k = map_queries_and_keys(self.parallel, q, k)
        terms = self._terms(q, k, keep)
        absorbed = _absorbed(state)
        chunk, eps = self.parallel.chunk, self.feature_map.state_unit.eps
        if self.feature_map.delta:
            out, absorbed = chunk_delta_attention(terms.phi_q, terms.phi_k, v, absorbed, True, chunk=chunk, eps=eps)
            return out, _with_kernel_state(state, absorbed)
        out, absorbed = chunk_kernel_attention(
            terms.phi_q, terms.phi_k, v.float(), terms.key_log_scale, absorbed, True, chunk=chunk, eps=eps
        )
        return out, _with_kernel_state(state, absorbed)

    def _windowed(self, q, k, v, keep, state):
        n, position = q.shape[-2], int(state[POSITION])
        kept = _window_rows(state, k, v, keep)
        k_x, v_x, keep_x = (expand_to_query_heads(x, q) for x in kept)
        start = position - state[WINDOW_KEYS].shape[-2]  # the position of k_x's first row
        sinks = self.window.sinks
        kept_sinks, sink_keys = self._sinks(q, k, v, keep, state)
        q, mapped_k_x = map_queries_and_keys(self.parallel, q, k_x)  # the window keeps k unmapped
        terms = self._terms(q, mapped_k_x, keep_x)
        far_phi_k, far_key_log_scale = far_key_features(terms.phi_k, terms.key_log_scale, start, sinks)
        absorbed = _absorbed(state)
        scales = KernelScales(
            self.parallel.linear_log_weight, terms.query_log_scale, far_key_log_scale, terms.local_max_weight
        )
        out = windowed_kernel_attention_from_state(
            terms.phi_q,
            far_phi_k,
            q,
            mapped_k_x,
            v_x,
            keep_x,
            self.window,
            start=start,
            sink_keys=sink_keys,
            far=absorbed,
            scale=self.parallel.scale,
            scales=scales,
            eps=self.feature_map.unit.eps,
        )
        # the state stays block-aligned: the rows behind the next query's previous block join it
        # too (their keep flags turn 0), so a decoding step reads the state alone for the far keys
        joining = n + self._behind(position + n)
        leaving = None if far_key_log_scale is None else far_key_log_scale[..., :joining, :]
        absorbed = absorb_keys(absorbed, far_phi_k[..., :joining, :], v_x[..., :joining, :], leaving)
        state = _with_kernel_state(state, absorbed)
        return out, self._advanced(state, kept, kept_sinks, n)

    def _behind(self, position: int) -> int:
        """The rows of the window behind the previous block of a query at ``position``."""
        return self.window.size - 1 - position % self.window.size

    def _advanced(self, state: dict, kept: Pairs, kept_sinks: SinkKeys | None, n: int) -> dict:
        """The state after n new positions: the window's last rows (``kept``, the window's and the
        new ones; those behind the next query's previous block, which have left it, keep 0), the
        sinks, the position."""
        behind = self._behind(int(state[POSITION]) + n)
        window_keep = torch.cat([torch.zeros_like(kept.keep[..., :behind, :]), kept.keep[..., n + behind :, :]], dim=-2)
        state.update({WINDOW_KEYS: kept.k[..., n:, :], WINDOW_VALUES: kept.v[..., n:, :], WINDOW_KEEP: window_keep})
        if kept_sinks is not None:
            state.update({SINK_KEYS: kept_sinks.k, SINK_VALUES: kept_sinks.v, SINK_KEEP: kept_sinks.keep})
        state[POSITION] = state[POSITION] + n
        return state

    def _sparse_windowed(self, q, k, v, keep, state):
        """_windowed with a sparse cache (window/sparse_cache.py): its pairs are rows in front of
        the window's, and blocks leave the window into the cache or the kernel state."""
        n, position = q.shape[-2], int(state[POSITION])
        kept = _window_rows(state, k, v, keep)
        pairs = Pairs(*(torch.cat([state[name], x], dim=-2) for name, x in zip(CACHE_PARTS, kept)))
        k_x, v_x, keep_x = (expand_to_query_heads(x, q) for x in pairs)
        kept_sinks, sink_keys = self._sinks(q, k, v, keep, state)
        q, mapped_k_x = map_queries_and_keys(self.parallel, q, k_x)
        terms = self._terms(q, mapped_k_x, keep_x)
        scales = KernelScales(self.parallel.linear_log_weight, terms.query_log_scale, None, terms.local_max_weight)
        out, absorbed, cache = sparse_attention_from_state(
            terms.phi_q,
            q,
            CachedRows(mapped_k_x, v_x, terms.phi_k, terms.key_log_scale),
            keep_x,
            pairs,
            self.window,
            start=position - state[WINDOW_KEYS].shape[-2],
            sink_keys=sink_keys,
            far=_absorbed(state),
            scale=self.parallel.scale,
            scales=scales,
            eps=self.feature_map.unit.eps,
        )
        state = _with_kernel_state(state, absorbed)
        state.update(zip(CACHE_PARTS, cache))
        return out, self._advanced(state, kept, kept_sinks, n)

    def _sinks(self, q, k, v, keep, state) -> tuple[SinkKeys | None, SinkKeys | None]:
        """The sinks after the new positions, as the state keeps them and as the exact part reads
        them (q's heads, mapped keys); (None, None) without sinks."""
        if not self.window.sinks:
            return None, None
        kept = _with_new_sinks(state, k, v, keep, int(state[POSITION]))
        read = SinkKeys(*(expand_to_query_heads(x, q) for x in kept))
        return kept, read._replace(k=map_queries_and_keys(self.parallel, q, read.k)[1])

    def extra_repr(self) -> str:
        return f"method={self.feature_map.options.method_name}, state={[t.name for t in self.description]}"


def _window_rows(state: dict, k, v, keep) -> Pairs:
    """The window's kept rows, then the new ones, as the state keeps them."""
    return Pairs(
        *(torch.cat([state[name], x.to(state[name].dtype)], dim=-2) for name, x in zip(WINDOW_PARTS, (k, v, keep)))
    )


def _absorbed(state: dict) -> KernelState:
    """The state's kernel part as KernelState (kernel_state's last column is the normaliser)."""
    return KernelState(state[KERNEL_STATE][..., :-1], state[KERNEL_STATE][..., -1], state.get(LOG_SCALE))


def _with_kernel_state(state: dict, absorbed: KernelState) -> dict:
    state = {**state, KERNEL_STATE: torch.cat([absorbed.kv, absorbed.key_sum.unsqueeze(-1)], dim=-1)}
    if absorbed.log_scale is not None:
        state[LOG_SCALE] = absorbed.log_scale
    return state


def _with_new_sinks(state: dict, k, v, keep, position: int) -> SinkKeys:
    """The sinks with those among the N new positions (position .. position + N - 1) filled in."""
    sinks, n = state[SINK_KEYS].shape[-2], k.shape[-2]
    row = torch.arange(sinks, device=k.device) - position  # sink s is new row s - position
    new = ((row >= 0) & (row < n)).unsqueeze(-1)
    rows = row.clamp(0, n - 1)

    def fill(x, old):
        return torch.where(new, x.index_select(-2, rows).to(old.dtype), old)

    return SinkKeys(fill(k, state[SINK_KEYS]), fill(v, state[SINK_VALUES]), fill(keep, state[SINK_KEEP]))
