"""torch.fx frontend: find softmax attention in GraphModules and swap in a pass's torch module.

    gm = rewrite_graph_module(model, to="hydra")   # nn.Module, GraphModule or ExportedProgram
    gm = rewrite_graph_module(hf_model, to="hydra", example_inputs=batch)  # torch.export, dynamic sizes
    gm.meta["attnrewrite"]                          # what was rewritten or skipped, and why
    sites = find_fx_sites(model)                    # the AttentionSites, without rewriting

The result is an ordinary GraphModule: trainable, and exportable with torch.onnx.export.
"""

from attnrewrite.fx.rewrite import find_fx_sites, rewrite_graph_module, to_graph_module

__all__ = ["find_fx_sites", "rewrite_graph_module", "to_graph_module"]
