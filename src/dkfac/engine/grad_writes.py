"""The write-back of a step with the guard on the device, through one buffer.

:func:`~dkfac.engine.step_math.write_back` takes each layer's
:meth:`~dkfac.blocks.base.Block.grad_writes` (views of its final matrix, made again every
step: a view is no arithmetic, but a dispatched operation all the same) and one
multi-tensor product and copy. On a launch-bound device with the guard's flags on the
device (:mod:`~dkfac.engine.device_checks`), :class:`GradientWrites` instead copies every
delivered layer's final matrix into one flat buffer (one multi-tensor copy), multiplies it
by each layer's factor repeated to its entries (one product: the KL-clip scale times the
guard's flag where the layer was preconditioned, 1 elsewhere) and copies the parameters'
parts out of views made once (:meth:`~dkfac.blocks.base.Block.grad_layout`; one
multi-tensor copy): the same values, a few calls for any number of layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dkfac.blocks.base import Block
from dkfac.engine.launches import device_constant
from dkfac.engine.layer_state import LayerState

__all__ = ["GradientWrites"]


class GradientWrites:
    """One preconditioner's buffered write-back (module notes), its buffer and views kept
    for the next step while the delivered layers and their shapes are the same."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._flat = torch.empty(0)
        self._matrices: list[Tensor] = []
        self._layout: list[Tensor] = []
        self._factor_index = torch.empty(0, dtype=torch.int64)

    def write(
        self,
        layers: Mapping[str, LayerState],
        finals: Mapping[str, Tensor],
        delivered: Sequence[str],
        ready: Sequence[str],
        factors: Tensor,
    ) -> list[str]:
        """Sets each delivered layer's gradient to its final value, times its entry of
        ``factors`` (one a layer of ``layers``, in order) where it is ready; returns the
        delivered layers it left for :func:`~dkfac.engine.step_math.write_back`: those
        whose block writes its gradient its own way or lacks a parameter's ``.grad`` (all
        of them where the values have several dtypes or devices)."""
        mine: list[str] = []
        rest: list[str] = []
        destinations: list[Tensor] = []
        for name in delivered:
            block = layers[name].block
            own_writes = type(block).set_weight_grad is not Block.set_weight_grad
            sources = None if own_writes else block.grad_sources()
            if sources is None:
                rest.append(name)
            else:
                mine.append(name)
                destinations += sources
        values = [finals[name] for name in mine]
        if not mine or len({(v.dtype, v.device) for v in values}) > 1:
            return list(delivered)
        preconditioned = set(ready)
        index = {name: i for i, name in enumerate(layers)}
        positions = tuple(index[name] if name in preconditioned else len(layers) for name in mine)
        shapes = tuple(tuple(v.shape) for v in values)
        key = (tuple(mine), shapes, positions, values[0].dtype, values[0].device)
        if key != self._key:
            self._build(key, [layers[name].block for name in mine], values, positions)
        torch._foreach_copy_(self._matrices, values)
        dtype = values[0].dtype
        extended = torch.cat([factors.to(dtype), factors.new_ones(1, dtype=dtype)])
        self._flat.mul_(extended.index_select(0, self._factor_index))
        torch._foreach_copy_(destinations, self._layout)
        return rest

    def _build(
        self,
        key: tuple[object, ...],
        blocks: Sequence[Block],
        values: Sequence[Tensor],
        positions: tuple[int, ...],
    ) -> None:
        """The buffer, its matrices and views and each entry's factor for a new set."""
        sizes = tuple(math.prod(v.shape) for v in values)
        device = values[0].device
        self._flat = torch.empty(sum(sizes), dtype=values[0].dtype, device=device)
        parts = self._flat.split(sizes)
        self._matrices = [part.view(v.shape) for part, v in zip(parts, values, strict=True)]
        self._layout = [
            view
            for block, matrix in zip(blocks, self._matrices, strict=True)
            for view in block.grad_layout(matrix)
        ]
        self._factor_index = device_constant(positions, device).repeat_interleave(
            device_constant(sizes, device), output_size=sum(sizes)
        )
        self._key = key
