"""How a kernel method (linear, hedgehog, favor; window included) runs as a recurrence: causal
kernel attention carries a fixed-size state instead of a KV cache (recurrent_state.py), built
from nothing but the method's FeatureMap; the torch module is recurrent_torch.py's, the ONNX
entry recurrent_onnx.py's."""

from __future__ import annotations

import dataclasses

from attnrewrite.passes.kernel.feature_map import FeatureMap
from attnrewrite.passes.kernel.query_key_maps import QUERY_KEY_MAPS
from attnrewrite.passes.kernel.recurrent_onnx import EntryPlan, entry_function
from attnrewrite.passes.kernel.recurrent_state import kernel_state_tensors
from attnrewrite.passes.kernel.recurrent_torch import RecurrentKernelAttention
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import with_callees
from attnrewrite.passes.recurrent import Recurrence, RecurrentLowering, StateTensor, key_value_groups
from attnrewrite.passes.window.settings import Window
from attnrewrite.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class KernelRecurrence(Recurrence):
    """A kernel method's recurrent form: its ``feature_map`` under the method's options."""

    feature_map: FeatureMap

    @property
    def options(self):
        return self.feature_map.options

    @property
    def window(self) -> Window | None:
        return self.feature_map.window

    def state(self, site: AttentionSite) -> list[StateTensor]:
        return kernel_state_tensors(site, self.feature_map)

    def torch_module(self, site: AttentionSite, parallel) -> RecurrentKernelAttention:
        return RecurrentKernelAttention(parallel, self.feature_map, self.state(site), self.key_value_groups(site))

    def key_value_groups(self, site: AttentionSite) -> int:
        """The groups of query heads whose keys and values a window keeps once (key_value_groups):
        its module and lowering take k and v with the key/value heads; without a window, q's."""
        return key_value_groups(site) if self.window is not None else 1

    def onnx_lowering(
        self, site: AttentionSite, opset_version: int, weights: dict | None = None, contrib_ops: bool = False
    ) -> RecurrentLowering:
        """The recurrent form as ONNX, the state in ``state``'s order. The constants are the
        parallel lowering's, without building it. With ``contrib_ops`` a step updates and reads
        the kernel state with com.microsoft.LinearAttention (where the feature count and the
        value dim are known); the additive prefill stays the chunked form, faster on CPU
        (docs/cli.md), the delta rule's prefill runs the operator too."""
        feature_map, window = self.feature_map, self.window
        if window is not None and window.sparse:  # its cache is shared by a key/value head's query heads
            window = dataclasses.replace(window, groups=self.key_value_groups(site))
        constants = feature_map.constants(site, weights)
        description = self.state(site)
        features, columns = feature_map.feature_count(site), site.value_dim
        # LinearAttention with each head of each batch row as its own row: their sizes fixed
        known = contrib_ops and isinstance(features, int) and columns is not None
        terms = feature_map.onnx_terms(site, opset_version)
        query_terms = feature_map.onnx_query_terms(site, opset_version)
        callees = [
            flatten_heads_function(opset_version),
            *with_callees(terms.function),
            *with_callees(query_terms.function),
        ]
        plan = EntryPlan(
            site,
            opset_version,
            feature_map.state_unit,
            window,
            self.options.chunk,
            self.key_value_groups(site),
            mapped=QUERY_KEY_MAPS[0] in constants,
            delta=feature_map.delta,
            terms=terms,
            query_terms=query_terms,
            state={t.name: t for t in description},
            linear_attention_rows=(features, columns + 1) if known else None,
            functions=[f.to_function_proto() for f in callees],
        )
        name = ("Learned" if plan.mapped else "") + "Recurrent" + ("Windowed" if self.window else "")
        functions = entry_function(plan, name + feature_map.entry, list(constants))
        return RecurrentLowering(functions, constants, description, plan.groups)
