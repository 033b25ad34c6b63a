"""A recurrent layer's state in onnxruntime-genai's layout: at most two batch-first float
tensors per layer, whatever the method keeps.

- ``recurrent_state`` [B, H, F, Dv + 1]: the method's running sum (the kernel state, AFT's
  numerator) with its normaliser as one more value column, the state layout of onnxruntime's
  ``com.microsoft.LinearAttention``.
- ``conv_state`` [B, C]: every other part (log scales, window keys, values and keep flags,
  sinks) flattened after the batch axis and laid end to end, in float32; where the method keeps
  nothing more, one column carried through unread (genai feeds a recurrent_state only beside a
  conv_state).

genai starts both at zeros and feeds each step's ``present.{i}.*`` back; zeros are every
method's initial state. A part that is not batch-first (the window's ``position``, positions
consumed) is not stored: it is the past length, which the attention mask gives.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from attnrewrite.onnx.graph_edit import GraphEditor
from attnrewrite.passes.recurrent import StateTensor, state_shape

RECURRENT_STATE = "recurrent_state"
CONV_STATE = "conv_state"
STATE_NAMES = (RECURRENT_STATE, CONV_STATE)
POSITION = "position"  # StateTensor name of the one part the attention mask gives: PAST_LENGTH
PAST_LENGTH = "the attention mask's length minus input_ids' length"


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one state part lives: ``tensor`` (RECURRENT_STATE, CONV_STATE, or None for the
    position) and its columns [start, stop) on that tensor's packed axis (recurrent_state's last,
    conv_state's second)."""

    part: StateTensor
    shape: tuple  # the part's own shape, batch symbolic
    tensor: str | None
    start: int = 0
    stop: int = 0


@dataclasses.dataclass(frozen=True)
class Layout:
    slots: list[Slot]
    shapes: dict[str, tuple]  # packed tensor -> its shape, batch symbolic

    def describe(self) -> list[str]:
        """Each part as ``tensor[..., start:stop]`` (docs, the record)."""
        return [
            f"{s.part.name}: {s.tensor}[{'..., ' if s.tensor == RECURRENT_STATE else ':, '}{s.start}:{s.stop}]"
            if s.tensor
            else f"{s.part.name}: {PAST_LENGTH}"
            for s in self.slots
        ]


def layout(description: list[StateTensor], sizes: dict) -> Layout:
    """The packed layout of ``description`` (the method's parts, in its order) with the symbolic
    sizes in ``sizes`` (batch left symbolic). The sums come first: one [B, H, F, Dv + 1] part
    (the kernel state with its normaliser column) taken as it is, or two [B, H, D] parts
    (AFT's numerator and denominator) side by side."""
    first, *rest = description
    head = state_shape(first, sizes)
    if len(head) == 4:
        slots = [Slot(first, head, RECURRENT_STATE, 0, head[3])]
        shapes = {RECURRENT_STATE: head}
    else:
        second, *rest = rest
        slots = [
            Slot(first, head, RECURRENT_STATE, 0, 1),
            Slot(second, state_shape(second, sizes), RECURRENT_STATE, 1, 2),
        ]
        shapes = {RECURRENT_STATE: (*head, 2)}
    offset = 0
    for part in rest:
        shape = state_shape(part, sizes)
        if part.name == POSITION:
            slots.append(Slot(part, shape, None))
            continue
        size = math.prod(shape[1:])
        slots.append(Slot(part, shape, CONV_STATE, offset, offset + size))
        offset += size
    # genai feeds a layer's recurrent_state only beside a conv_state: one column, carried
    # through unread, where the method keeps nothing more
    shapes[CONV_STATE] = (sizes["B"], offset or 1)
    return Layout(slots, shapes)


class Packing:
    """Builds the nodes between the packed graph values and the method's parts, with ``edit``."""

    def __init__(self, layout: Layout, dtypes: list[ir.DataType], edit: GraphEditor):
        self.layout, self.dtypes = layout, dtypes  # dtypes: each part's element type
        self.edit = edit

    def unpack(self, packed: dict[str, ir.Value], position: ir.Value, nodes: list[ir.Node]) -> list[ir.Value]:
        """The parts, in the method's order, read from the packed inputs (``position``: the past
        length as a scalar int64)."""
        parts = []
        for slot, dtype in zip(self.layout.slots, self.dtypes):
            if slot.tensor is None:
                parts.append(position)
                continue
            axis = -1 if slot.tensor == RECURRENT_STATE else 1
            if slot.stop - slot.start == self.layout.shapes[slot.tensor][axis]:  # the whole tensor
                columns = packed[slot.tensor]
            else:
                columns = self._slice(packed[slot.tensor], slot.start, slot.stop, axis, nodes)
            if slot.tensor == RECURRENT_STATE:
                value = (
                    columns
                    if len(slot.shape) == 4
                    else self.edit.node(nodes, "Squeeze", [columns, self.edit.const([-1])])
                )
            else:
                value = self.edit.node(nodes, "Reshape", [columns, self.edit.const([0, *slot.shape[1:]])])
            if dtype != ir.DataType.FLOAT:
                value = self.edit.node(nodes, "Cast", [value], [ir.AttrInt64("to", dtype)])
            parts.append(value)
        return parts

    def pack(self, packed: dict[str, ir.Value], parts: list[ir.Value], nodes: list[ir.Node]) -> dict[str, ir.Value]:
        """The packed outputs from the parts the method returns (the position's is dropped);
        ``packed``: the packed inputs, an unused placeholder returned as it came."""
        pieces: dict[str, list[ir.Value]] = {RECURRENT_STATE: [], CONV_STATE: []}
        for slot, value, dtype in zip(self.layout.slots, parts, self.dtypes):
            if slot.tensor is None:
                continue
            if dtype != ir.DataType.FLOAT:
                value = self.edit.node(nodes, "Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)])
            if slot.tensor == RECURRENT_STATE:
                if len(slot.shape) != 4:
                    value = self.edit.node(nodes, "Unsqueeze", [value, self.edit.const([-1])])
            else:
                value = self.edit.node(nodes, "Reshape", [value, self.edit.const([0, -1])])
            pieces[slot.tensor].append(value)
        return {tensor: self._joined(tensor, values, packed, nodes) for tensor, values in pieces.items()}

    def _joined(self, tensor: str, values: list[ir.Value], packed: dict[str, ir.Value], nodes) -> ir.Value:
        if not values:
            return self.edit.node(nodes, "Identity", [packed[tensor]])
        if len(values) == 1:
            return values[0]
        return self.edit.node(nodes, "Concat", values, [ir.AttrInt64("axis", -1 if tensor == RECURRENT_STATE else 1)])

    def _slice(self, value: ir.Value, start: int, stop: int, axis: int, nodes: list[ir.Node]) -> ir.Value:
        return self.edit.node(
            nodes, "Slice", [value, self.edit.const([start]), self.edit.const([stop]), self.edit.const([axis])]
        )
