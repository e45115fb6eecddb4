"""Accumulators: one step's contributions to a statistic, summed over micro-batches.

:class:`FactorAccumulator` sums ``scale · RᵀR`` whole; :class:`BlockDiagonalAccumulator`
only its diagonal blocks, as ``(k, b, b)`` (:mod:`~dkfac.solvers.block_layout`);
:class:`DiagonalAccumulator` only its diagonal, as ``(d,)``. Which one a statistic gets is
its :class:`~dkfac.solvers.statistics.StatisticKind`'s choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dkfac.solvers.block_layout import as_blocks, block_bounds, blocks_shape

__all__ = [
    "Accumulator",
    "BlockDiagonalAccumulator",
    "DiagonalAccumulator",
    "FactorAccumulator",
    "Rows",
]


class Rows(Protocol):
    """Rows of one contribution (what a block hands a sink): the statistic is
    ``rows.T @ rows / normaliser`` (see :class:`dkfac.blocks.base.Rows`)."""

    @property
    def rows(self) -> Tensor:
        """A ``(r, d)`` matrix."""

    @property
    def normaliser(self) -> float:
        """The count the outer products are averaged over."""


@dataclass
class FactorAccumulator:
    """Sums ``scale · RᵀR`` and normalisers over the micro-batches of one step.

    Attributes:
        dtype: Precision the sums are kept in (``None``: as the rows come).
        product_dtype: Precision the rows are cast to for their products (``None``:
            ``dtype``); a product is converted to ``dtype`` before it is added.
        total: The running sum of outer products, ``None`` before the first contribution.
        normaliser: The running sum of normalisers.
    """

    dtype: torch.dtype | None = None
    product_dtype: torch.dtype | None = None
    total: Tensor | None = None
    normaliser: float = 0.0

    takes_sums = True
    """A dense accumulator accepts precomputed sums (:meth:`add_sum`)."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The precision of the products' inputs (``None``: as the rows come)."""
        return self.product_dtype or self.dtype

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        contribution = matrix.T @ matrix
        if self.dtype is not None:
            contribution = contribution.to(self.dtype)
        if scale != 1.0:
            contribution.mul_(scale)
        if self.total is None:
            self.total = contribution
        else:
            self.total.add_(contribution)
        self.normaliser += rows.normaliser

    def add_sum(
        self, total: Tensor, normaliser: float, scale: float = 1.0, *, owned: bool = False
    ) -> None:
        """Adds a precomputed sum of outer products (any shape; of it, what
        :meth:`kept_of` keeps) and its normaliser.

        ``owned``: the caller hands ``total`` over (a tensor no one else writes): a first
        contribution kept whole is then kept as it is, not copied."""
        kept = self.kept_of(total)
        contribution = kept if self.dtype is None else kept.to(self.dtype)
        if self.total is None:  # a tensor of its own; the caller's is left as it is
            if owned and scale == 1.0 and kept is total:
                self.total = contribution
            elif scale != 1.0:
                self.total = contribution * scale
            else:
                self.total = contribution.clone() if contribution is kept else contribution
        elif scale != 1.0:
            self.total.add_(contribution, alpha=scale)
        else:
            self.total.add_(contribution)
        self.normaliser += normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        """What this accumulator keeps of a precomputed sum (:meth:`add_sum`): all of it
        (may be ``total`` itself or a view of it)."""
        return total

    def add_stored(self, total: Tensor, normaliser: float) -> None:
        """Adds a sum already in this accumulator's stored layout (what its ``total`` holds,
        e.g. another kind's sum converted by :meth:`StatisticKind.restore`) and its
        normaliser."""
        if self.total is None:
            self.total = total if self.dtype is None else total.to(self.dtype)
        else:
            self.total.add_(total)
        self.normaliser += normaliser

    @property
    def has_data(self) -> bool:
        """Whether anything was added since the last reset."""
        return self.total is not None

    def mean(self) -> Tensor | None:
        """The averaged factor, or ``None`` when nothing was added."""
        if self.total is None or self.normaliser == 0:
            return None
        return self.total / self.normaliser

    def tensors(self) -> list[Tensor]:
        """The tensors held (for memory accounting)."""
        return [] if self.total is None else [self.total]

    def reset(self) -> None:
        """Forgets every contribution."""
        self.total = None
        self.normaliser = 0.0


@dataclass
class BlockDiagonalAccumulator(FactorAccumulator):
    """A :class:`FactorAccumulator` that computes and keeps only the diagonal blocks of
    ``RᵀR``, as a ``(k, block, block)`` tensor (:mod:`~dkfac.solvers.block_layout`: the
    blocks of :func:`block_bounds`, a shorter last one padded with zeros): the products
    cost ``d · block`` per row instead of ``d²``, and ``k · block²`` floats are held. A
    precomputed sum (:meth:`add_sum`: a convolution's capture without a reduction) gives
    its diagonal blocks, so both paths hold the same (the sum itself was computed whole: no
    saving there). As :class:`FactorAccumulator`, each product is converted to the stored
    precision before it is scaled (a low-precision product times the squared batch size
    would overflow float16).

    Attributes:
        block: The width of a diagonal block (>= 1).
    """

    block: int = 1

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds the diagonal blocks of ``scale · rows.T @ rows`` and the rows' normaliser.

        The whole blocks are multiplied as one batch of contiguous copies (one ``bmm``: a
        column slice of a row matrix whose width is a power of two strides badly for the
        products; measured 30% slower per block on the language model's 512-wide sides),
        a shorter last block on its own (as a single whole block is).
        """
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        size = matrix.shape[1]
        if self.total is None:
            shape = blocks_shape(size, self.block)
            self.total = matrix.new_zeros(shape, dtype=self.dtype or matrix.dtype)
        whole = size // self.block
        batched = whole if whole > 1 else 0
        if batched:
            width = batched * self.block
            blocks = matrix[:, :width].reshape(-1, whole, self.block).transpose(0, 1).contiguous()
            products = torch.bmm(blocks.mT, blocks).to(self.total.dtype)  # stored, then scaled
            self.total[:whole].add_(products, alpha=scale)
        for index, (start, stop) in enumerate(block_bounds(size, self.block)):
            if index < batched:
                continue
            part = matrix[:, start:stop]
            product = (part.T @ part).to(self.total.dtype)
            self.total[index, : stop - start, : stop - start].add_(product, alpha=scale)
        self.normaliser += rows.normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        """The diagonal blocks of a precomputed ``d × d`` sum (a copy)."""
        return as_blocks(total, tuple(total.shape), self.block)


@dataclass
class DiagonalAccumulator(FactorAccumulator):
    """A :class:`FactorAccumulator` that keeps only the diagonal of ``Σ scale · RᵀR``, as a
    ``(d,)`` vector: each column's sum of squares (``d`` products a row instead of ``d²``,
    and ``d`` floats held instead of ``d²``). A precomputed sum (:meth:`add_sum`) gives its
    diagonal. As :class:`FactorAccumulator`, the squares are converted to the stored
    precision before they are scaled.
    """

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds the diagonal of ``scale · rows.T @ rows`` and the rows' normaliser."""
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        squares = matrix.to(self.dtype or matrix.dtype).square().sum(0)
        if self.total is None:
            self.total = squares if scale == 1.0 else squares.mul_(scale)
        else:
            self.total.add_(squares, alpha=scale)
        self.normaliser += rows.normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        """The diagonal of a precomputed ``d × d`` sum (a view: :meth:`add_sum` copies it)."""
        return total.diagonal()


class Accumulator(Protocol):
    """One statistic's accumulator: dense (:class:`FactorAccumulator`) or low-rank
    (:class:`~dkfac.solvers.lowrank.factor.LowRankRowsAccumulator`); blocks see it as a
    :class:`~dkfac.blocks.base.StatisticSink`."""

    @property
    def takes_sums(self) -> bool:
        """Whether :meth:`add_sum` is accepted."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Precision of the products' inputs."""

    @property
    def dtype(self) -> torch.dtype | None:
        """Precision the statistic is kept in."""

    @property
    def has_data(self) -> bool:
        """Whether anything was added since the last reset."""

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Adds a precomputed sum of outer products and its normaliser."""

    def mean(self) -> Tensor | None:
        """This step's statistic (``U`` for a low-rank side), ``None`` when empty."""

    def reset(self) -> None:
        """Forgets every contribution."""

    def tensors(self) -> list[Tensor]:
        """The tensors held."""
