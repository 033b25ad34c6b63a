"""What every ONNX lowering shares (attnrewrite/passes/lowering.py): script functions translated
once per distinct arguments, and the order a lowering lists its functions in."""

from __future__ import annotations

from onnxscript import script

from attnrewrite.passes.kernel.chunks import rescaled_prefix_functions
from attnrewrite.passes.layout import flatten_heads_function
from attnrewrite.passes.lowering import ATTNREWRITE, built_once, standard_opset, with_callees
from attnrewrite.passes.window.onnx_blocks import window_block_functions
from attnrewrite.passes.window.onnx_pairs import paired_window_functions


def test_a_factory_translates_once_per_distinct_arguments():
    made = []

    @built_once
    def scaled(opset_version: int, factor):
        op = standard_opset(opset_version)

        @script(ATTNREWRITE, default_opset=op)
        def Scaled(x):
            return x * op.Constant(value_float=float(factor))

        made.append(Scaled)
        return [Scaled]

    first = scaled(18, 2)
    assert scaled(18, 2) == first and scaled(18, 2)[0] is first[0] and len(made) == 1
    # 2 and 2.0 are different arguments (a constant's type can follow them); so is another opset
    scaled(18, 2.0)
    scaled(21, 2)
    assert len(made) == 3
    # a list comes back as the caller's own copy: extending it leaves the next caller's alone
    first.append("mine")
    assert scaled(18, 2) == [made[0]]


def test_every_site_of_a_model_shares_the_translated_bodies():
    assert flatten_heads_function(18) is flatten_heads_function(18)
    assert flatten_heads_function(18) is not flatten_heads_function(21)
    op = standard_opset(18)
    one = window_block_functions(op, 8, True)
    assert window_block_functions(op, 8, True) is one
    assert window_block_functions(op, 8, False) is not one
    assert rescaled_prefix_functions(18, 1) is rescaled_prefix_functions(18, 1)


def _ordered_by_onnxscript(*functions):
    """with_callees as onnxscript's own reach sets would order it (each function's whole call
    tree read again for every function)."""
    found = {}
    for function in functions:
        found.update(function.function_ir.get_called_functions())
        found[function.name] = function
    return sorted(found.values(), key=lambda function: len(function.function_ir.get_called_functions()))


def test_with_callees_lists_every_reached_function_once_callees_first():
    op = standard_opset(18)
    blocks = window_block_functions(op, 8, False)
    entry_parts = paired_window_functions(op, blocks, flatten_heads_function(18), 8, 0.5, False, 2, 1e-6)
    functions = [part for part in entry_parts if hasattr(part, "function_ir")]
    ordered = with_callees(*functions)
    names = [function.name for function in ordered]
    assert len(names) == len(set(names)) > len(functions)
    assert names == [function.name for function in _ordered_by_onnxscript(*functions)]
    for position, function in enumerate(ordered):
        callees = set(function.function_ir.get_called_functions())
        assert callees <= set(names[:position]), f"{function.name} listed before what it calls"
