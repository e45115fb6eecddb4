"""Captures of layers of one shape computed together, where kernel launches bound the step.

A small model's capture costs a dozen launches a layer on a GPU (BatchNorm's unit-wise
statistics: moments, per-sample gradients, their products). Layers whose blocks name one
:meth:`~dkfac.blocks.base.Block.group_key` (one shape, dtype and option set) are instead
held when their gradient arrives (the input and the output gradient, by reference) and
computed at the step as one stacked batch (:meth:`~dkfac.blocks.base.Block.capture_group`),
a few launches for the group. Only forwards whose every due statistic is a plain dense sum
(:class:`~dkfac.solvers.statistics.FactorAccumulator`) are held: the group hands each one
its slice of the group's result, kept without a copy.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from torch import Tensor

from dkfac.blocks.base import Block, HeldForward, Rows
from dkfac.engine.layer_state import LayerState
from dkfac.solvers.statistics import FactorAccumulator

__all__ = ["CaptureGroups"]


@dataclass
class _Held:
    """A forward whose capture waits for its group."""

    layer: LayerState
    inputs: Tensor
    grad: Tensor
    scale: float


class _HandedOver:
    """A dense accumulator as a group's capture sees it: the sums it is handed are the
    group's own tensors, kept without a copy."""

    takes_sums = True

    def __init__(self, accumulator: FactorAccumulator) -> None:
        self._accumulator = accumulator
        self.dtype = accumulator.dtype
        self.compute_dtype = accumulator.compute_dtype

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        self._accumulator.add(rows, scale)

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        self._accumulator.add_sum(total, normaliser, scale, owned=True)


class CaptureGroups:
    """The forwards held for their groups until :meth:`flush`."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, list[_Held]] = {}

    def hold(self, layer: LayerState, inputs: Tensor, grad: Tensor, scale: float) -> bool:
        """Holds one forward's capture (its input, output gradient and G scale) if its
        block names a group and every due statistic is a plain dense sum; whether it did."""
        sinks = layer.due_sinks()
        if not sinks or any(type(sink) is not FactorAccumulator for sink in sinks.values()):
            return False
        key = layer.block.group_key(inputs, grad, sinks)
        if key is None:
            return False
        self._groups.setdefault((key, scale), []).append(_Held(layer, inputs, grad, scale))
        return True

    def flush(self) -> None:
        """Captures every held forward: a group of several together, one alone as its
        hooks would."""
        groups, self._groups = self._groups, {}
        for members in groups.values():
            if len(members) == 1:
                held = members[0]
                alone = HeldForward(
                    held.layer.block, held.inputs, held.grad, held.layer.due_sinks(), held.scale
                )
                Block.capture_group([alone])
                continue
            handed = [
                HeldForward(
                    held.layer.block,
                    held.inputs,
                    held.grad,
                    {key: _HandedOver(sink) for key, sink in held.layer.due_sinks().items()},
                    held.scale,
                )
                for held in members
            ]
            type(handed[0].block).capture_group(handed)

    def held_bytes(self) -> int:
        """Bytes of the inputs and output gradients held until :meth:`flush` (a tensor
        held by two forwards, such as a shared input, counted once)."""
        tensors = {
            id(t): t
            for members in self._groups.values()
            for h in members
            for t in (h.inputs, h.grad)
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def clear(self) -> None:
        """Forgets every held forward."""
        self._groups.clear()
