"""The kernel methods' recurrent state (linear, hedgehog, favor; window included), per layer:

- ``kernel_state`` sum phi(k) [v, 1]^T [B, H, F, Dv+1], float32: sum phi(k) v^T, and sum phi(k)
  (the normaliser) as the last column;
  (the delta rule's state, kernel/delta.py, is this one matrix too, updated otherwise);
- a rescaled kernel (FAVOR+, hedgehog's window: KernelUnit.rescaled, not the delta rule's
  normalised keys): ``log_scale`` [B, H]
  float32, the max of the absorbed keys' log scales, which the two sums are relative to (the
  parallel causal form's running max, kernel.state.chunk_kernel_attention), the
  lowest log scale before any key;
- with a window of W: the last 2W - 1 keys and values with their keep flags (``window_keys``
  [B, H, 2W-1, D], ``window_values`` [B, H, 2W-1, Dv], ``window_keep`` [B, H, 2W-1, 1]), which a
  later query can still take exactly: a query of block c takes blocks c-1 and c, and blocks are
  aligned to sequence positions, so a key leaves the window (into the kernel state) once it is
  2W - 1 positions old; the sinks (``sink_keys``, ``sink_values``, ``sink_keep``, positions
  0..sinks-1, kept from the tokens that had them); with ``sparse`` = G the sparse cache's G
  pairs (``cache_keys`` [B, H, G, D], ``cache_values``, ``cache_keep``, per key/value head:
  window/sparse_cache.py,
  in position order, empty slots last with keep 0); and ``position`` (int64 []), the positions
  consumed so far, padding included (blocks and sinks are positions of the padded sequence).
Sizes are fixed in the context length. Padded keys (key_keep 0) never enter a state. The names
below are the only spelling of the state's names; their outputs are StateTensor.output_name.
"""

from __future__ import annotations

from attnrewrite.passes.kernel.feature_map import FeatureMap
from attnrewrite.passes.kernel.numerics import LOWEST_LOG_SCALE
from attnrewrite.passes.recurrent import StateTensor, key_value_axes, leading_axes
from attnrewrite.site import AttentionSite

KERNEL_STATE, LOG_SCALE = "kernel_state", "log_scale"
WINDOW_KEYS, WINDOW_VALUES, WINDOW_KEEP = "window_keys", "window_values", "window_keep"
WINDOW_PARTS = (WINDOW_KEYS, WINDOW_VALUES, WINDOW_KEEP)
SINK_KEYS, SINK_VALUES, SINK_KEEP = "sink_keys", "sink_values", "sink_keep"
SINK_PARTS = (SINK_KEYS, SINK_VALUES, SINK_KEEP)  # the sinks: keys, values, keep flags
CACHE_PARTS = ("cache_keys", "cache_values", "cache_keep")  # the sparse cache's, likewise
POSITION = "position"


def kernel_state_tensors(site: AttentionSite, feature_map: FeatureMap) -> list[StateTensor]:
    """The per-layer state of ``feature_map``'s recurrence at ``site``, in the order its module
    and lowering take and return it."""
    lead, f = leading_axes(site), feature_map.feature_count(site)
    state = [
        StateTensor(
            KERNEL_STATE,
            (*lead, f, "Dv+1"),
            "float32",
            0.0,
            "sum of phi(k) [v, 1]^T over absorbed keys: sum phi(k) v^T, and sum phi(k) (the normaliser) as the last column",
        )
    ]
    if feature_map.state_unit.rescaled:
        state.append(
            StateTensor(
                LOG_SCALE, lead, "float32", LOWEST_LOG_SCALE, "max log scale of absorbed keys: the sums' reference"
            )
        )
    window = feature_map.window
    if window is None:
        return state
    kept, kv = 2 * window.size - 1, key_value_axes(site)  # keys and values once per key/value head
    state += [
        StateTensor(WINDOW_KEYS, (*kv, kept, "D"), "model", 0.0, f"the last {kept} keys"),
        StateTensor(WINDOW_VALUES, (*kv, kept, "Dv"), "model", 0.0, f"the last {kept} values"),
        StateTensor(WINDOW_KEEP, (*kv, kept, 1), "float32", 0.0, "1.0 where those keys are kept"),
    ]
    if window.sinks:
        state += [
            StateTensor(SINK_KEYS, (*kv, window.sinks, "D"), "model", 0.0, "the keys at positions < sinks"),
            StateTensor(SINK_VALUES, (*kv, window.sinks, "Dv"), "model", 0.0, "their values"),
            StateTensor(SINK_KEEP, (*kv, window.sinks, 1), "float32", 0.0, "1.0 where those keys are kept"),
        ]
    if window.sparse:
        held, (keys, values, keep) = window.sparse, CACHE_PARTS
        state += [
            StateTensor(keys, (*kv, held, "D"), "model", 0.0, f"the {held} keys beyond the window recalled worst"),
            StateTensor(values, (*kv, held, "Dv"), "model", 0.0, "their values"),
            StateTensor(keep, (*kv, held, 1), "float32", 0.0, "1.0 where a slot holds a pair"),
        ]
    return [*state, StateTensor(POSITION, (), "int64", 0, "positions consumed, padding included")]
