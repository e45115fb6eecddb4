"""Layouts of a square statistic that keeps less than its ``d × d`` matrix.

A ``d × d`` statistic of which only the diagonal blocks of width ``b`` are kept is stored
as a ``(k, b, b)`` tensor, ``k = ⌈d / b⌉``: block ``i`` covers the units
``[i·b, min((i+1)·b, d))`` (:func:`block_bounds`), and where ``b`` does not divide ``d``
the last block's ``r × r`` (``r = d − (k−1)·b``) sits in the top-left corner of its slot,
zeros around it. The padding stays zero through every operation the engine applies (sums,
averages over ranks and in time, rescaling), and one ``(k, b, b)`` tensor is one buffer to
send and one multi-tensor operation to average. One that keeps only the diagonal stores
it as ``(d,)``.

:func:`saved_layout` tells the layouts apart by shape (``(d, d)`` dense, ``(d,)`` diagonal,
``(k, b, b)`` blocks), and :func:`as_dense`, :func:`as_diagonal` and :func:`as_blocks`
convert a value from any of them, which is how a checkpoint saved under one kind loads
under another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DiagonalBlocks",
    "as_blocks",
    "as_dense",
    "as_diagonal",
    "block_bounds",
    "blocks_shape",
    "diagonal_blocks",
    "saved_layout",
]


def block_bounds(size: int, block: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``range(size)`` cut into consecutive blocks of ``block``
    (the last one shorter when ``block`` does not divide ``size``).

    Raises:
        ValueError: If ``size`` or ``block`` is below 1.
    """
    if size < 1 or block < 1:
        raise ValueError(f"block_bounds needs size and block >= 1, got {size} and {block}")
    return [(start, min(start + block, size)) for start in range(0, size, block)]


def diagonal_blocks(matrix: Tensor, block: int) -> Tensor:
    """The ``(k, block, block)`` diagonal blocks of a square ``matrix`` whose side is
    ``k · block``, as a view (writing to it writes to ``matrix``).

    Raises:
        ValueError: If ``matrix`` is not square or its side is not a multiple of ``block``.
    """
    size = matrix.shape[-1]
    if matrix.dim() != 2 or matrix.shape[0] != size or block < 1 or size % block:
        raise ValueError(
            f"diagonal_blocks needs a square matrix whose side is a multiple of block "
            f"{block}, got shape {tuple(matrix.shape)}"
        )
    whole = size // block
    grid = matrix.unflatten(1, (whole, block)).unflatten(0, (whole, block))  # (k, b, k, b)
    return torch.diagonal(grid, dim1=0, dim2=2).movedim(-1, 0)


def blocks_shape(size: int, block: int) -> tuple[int, int, int]:
    """``(⌈size / block⌉, block, block)``: the stored shape of the blocks of a side."""
    return (-(-size // block), block, block)


@dataclass(frozen=True)
class DiagonalBlocks:
    """The diagonal blocks of a ``size × size`` statistic as a solver reads them.

    Attributes:
        blocks: The ``(k, b, b)`` stored value (module notes: the last block padded).
        size: ``d``, the side of the statistic.
    """

    blocks: Tensor
    size: int

    @property
    def block(self) -> int:
        """``b``, the width of a whole block."""
        return int(self.blocks.shape[-1])

    @property
    def shape(self) -> tuple[int, int]:
        """``(d, d)``: the shape of the statistic the blocks are of."""
        return (self.size, self.size)

    @property
    def dtype(self) -> torch.dtype:
        """The blocks' precision."""
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        """The blocks' device."""
        return self.blocks.device

    def parts(self) -> list[Tensor]:
        """Each block (views), the last one cut to its width."""
        return _parts(self.blocks, self.size)

    def dense(self) -> Tensor:
        """The ``d × d`` block-diagonal matrix."""
        return torch.block_diag(*self.parts())


def _parts(blocks: Tensor, size: int) -> list[Tensor]:
    bounds = block_bounds(size, int(blocks.shape[-1]))
    return [blocks[i, : j - s, : j - s] for i, (s, j) in enumerate(bounds)]


def saved_layout(got: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """Which layout a value of shape ``got`` has for a statistic of ``shape``: ``0`` the
    statistic's own, ``-1`` a square one's ``(d,)`` diagonal, ``b >= 1`` its ``(k, b, b)``
    diagonal blocks; ``None``: none of them."""
    if got == shape:
        return 0
    if len(shape) != 2 or shape[0] != shape[1]:
        return None
    size = shape[0]
    if got == (size,):
        return -1
    if len(got) == 3 and got[1] == got[2] >= 1 and got == blocks_shape(size, got[1]):
        return got[1]
    return None


def as_dense(value: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``value`` of any :func:`saved_layout` as the statistic's own (``d × d``, zeros where
    nothing was kept)."""
    layout = saved_layout(tuple(value.shape), shape)
    if layout == -1:
        return torch.diag(value)
    if layout:
        return torch.block_diag(*_parts(value, shape[0]))
    return value


def as_diagonal(value: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The ``(d,)`` diagonal of ``value`` of any :func:`saved_layout` of a square ``shape``
    (a view where it can be)."""
    layout = saved_layout(tuple(value.shape), shape)
    if layout == 0:
        return value.diagonal()
    if layout is not None and layout > 0:
        return value.diagonal(dim1=1, dim2=2).reshape(-1)[: shape[0]]
    return value


def as_blocks(value: Tensor, shape: tuple[int, ...], block: int) -> Tensor:
    """The ``(k, block, block)`` diagonal blocks of ``value`` of any :func:`saved_layout`
    of a square ``shape`` (module notes: the last padded)."""
    layout = saved_layout(tuple(value.shape), shape)
    if layout == block:
        return value
    size = shape[0]
    out = value.new_zeros(blocks_shape(size, block))
    if layout == -1:
        padded = value.new_zeros(out.shape[0] * block)
        padded[:size] = value
        return torch.diag_embed(padded.view(-1, block))
    dense = as_dense(value, shape)
    whole = size // block
    width = whole * block
    if whole:
        out[:whole].copy_(diagonal_blocks(dense[:width, :width], block))
    if width < size:
        out[whole, : size - width, : size - width].copy_(dense[width:, width:])
    return out
