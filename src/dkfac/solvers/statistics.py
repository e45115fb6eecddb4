"""How a solver keeps its statistics: statistic kinds (and their accumulators).

An accumulator (:mod:`~dkfac.solvers.accumulators`) sums one step's contributions over
micro-batches; a :class:`StatisticKind` says how the step's value is combined over ranks,
averaged over steps, rescaled under a ``GradScaler``, checkpointed and handed to the
solver. :class:`BlockDiagonalStatistic` is a dense statistic of which only the diagonal
blocks are computed and kept, as ``(k, b, b)`` (for a solver that reads nothing else);
:class:`DiagonalStatistic` keeps only the diagonal, as a ``(d,)`` vector (for a solver that
reads nothing of it but its width).

A kind's *stored* value (:meth:`StatisticKind.stored_shape`) need not have the block's
statistic shape: the engine, the strategies and checkpoints ask the kind for it. The kinds
that average their values (:class:`DenseStatistic` and its subclasses) load each other's
saved values (:meth:`StatisticKind.restore`): a ``d × d`` value where the side now keeps its
diagonal gives its diagonal, a ``(d,)`` diagonal where it is now dense gives ``diag(v)``,
and so on between dense, diagonal and blocks (:mod:`~dkfac.solvers.block_layout`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dkfac.solvers.accumulators import (
    Accumulator,
    BlockDiagonalAccumulator,
    DiagonalAccumulator,
    FactorAccumulator,
    Rows,
)
from dkfac.solvers.block_layout import (
    DiagonalBlocks,
    as_blocks,
    as_dense,
    as_diagonal,
    block_bounds,
    blocks_shape,
    saved_layout,
)

__all__ = [
    "Accumulator",
    "BlockDiagonalAccumulator",
    "BlockDiagonalStatistic",
    "DenseStatistic",
    "DiagonalAccumulator",
    "DiagonalStatistic",
    "FactorAccumulator",
    "Rows",
    "StatisticKind",
    "block_bounds",
]


class StatisticKind(ABC):
    """How a solver keeps one statistic: accumulated, combined over ranks, averaged in time.

    The engine, the strategies, checkpoints and the refresh policy ask a layer's statistic
    kinds (given by its solver, :meth:`dkfac.solvers.base.Solver.statistics`) and never what
    the solver is. Four kinds exist: :class:`DenseStatistic` (``Σ RᵀR / n``, the default),
    its :class:`BlockDiagonalStatistic` (only the diagonal blocks computed), its
    :class:`DiagonalStatistic` (only the diagonal, kept as a vector) and
    :class:`~dkfac.solvers.lowrank.factor.LowRankStatistic` (the rows ``U`` with
    ``F = U Uᵀ``, for the SMW solver). What a kind stores need not have the statistic's
    shape: :meth:`stored_shape` says which it has, :meth:`restore` converts a value saved
    or kept by another kind, :meth:`part` cuts the statistic of some units out of it.

    Attributes:
        label: ``describe()``'s word for it (``"dense"``, ``"blockdiag"``, ``"diagonal"``,
            ``"lowrank"``).
        gathered: Ranks combine it by concatenating their rows (an all-gather) instead of
            averaging it.
        comparable: Its successive values keep one shape, so a refresh policy can measure
            their relative change.
    """

    label: ClassVar[str]
    gathered: ClassVar[bool] = False
    comparable: ClassVar[bool] = True

    @abstractmethod
    def accumulator(self, dtype: torch.dtype | None, capture_dtype: torch.dtype | None) -> Any:
        """A fresh accumulator of one step's contributions (an :class:`Accumulator`)."""

    @abstractmethod
    def update_running(self, old: Tensor | None, new: Tensor, decay: float) -> Tensor:
        """The running value after ``new`` (may update ``old`` in place)."""

    @abstractmethod
    def rescale(self, value: Tensor, factor: float) -> Tensor:
        """``value`` of a statistic quadratic in the output gradient, that gradient × √factor."""

    @abstractmethod
    def check_saved(self, where: str, shape: tuple[int, ...], got: tuple[int, ...]) -> None:
        """Raises ValueError unless a saved value of shape ``got`` fits ``shape``."""

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a stored value (running, accumulated, sent) of a statistic of
        ``shape``: ``shape`` itself unless the kind keeps less (an upper bound where the
        value grows: a low-rank ``U``)."""
        return shape

    def restore(self, value: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A saved value (checked by :meth:`check_saved`) or one kept by another kind of
        the same statistic, in this kind's stored layout (may be ``value`` itself or a view
        of it)."""
        del shape
        return value

    def part(self, value: Tensor, shape: tuple[int, ...], rows: slice) -> Any:
        """The statistic of the units ``rows`` alone (a diagonal block of the factor), from a
        stored value of a statistic of ``shape``, as the solver takes it
        (:meth:`solver_input`)."""
        del shape
        return value[rows, rows]

    def solver_input(self, value: Tensor, shape: tuple[int, ...]) -> Any:
        """The running value of a statistic of ``shape`` as the solver's ``compute`` takes
        it."""
        del shape
        return value


@dataclass(frozen=True)
class DenseStatistic(StatisticKind):
    """A statistic kept whole: ``F = Σ scale·RᵀR / Σ n``, averaged over ranks and in time.
    Kinds compare by value (two dense kinds are equal; a block-diagonal one differs).

    Running average ``F ← decay·F + (1−decay)·F_new`` (a first value, or ``decay = 0``,
    is taken as it is).
    """

    label: ClassVar[str] = "dense"

    def accumulator(
        self, dtype: torch.dtype | None, capture_dtype: torch.dtype | None
    ) -> FactorAccumulator:
        """A :class:`FactorAccumulator` storing in ``dtype``, products in ``capture_dtype``."""
        return FactorAccumulator(dtype, capture_dtype)

    def update_running(self, old: Tensor | None, new: Tensor, decay: float) -> Tensor:
        """``decay·old + (1−decay)·new``, in place in ``old``."""
        if old is None or decay == 0.0:
            return new
        if old.dtype == new.dtype:  # one pass: old + (1−decay)(new − old)
            return old.lerp_(new, 1.0 - decay)
        return old.mul_(decay).add_(new, alpha=1.0 - decay)

    def rescale(self, value: Tensor, factor: float) -> Tensor:
        """``factor · value``."""
        return value * factor

    def check_saved(self, where: str, shape: tuple[int, ...], got: tuple[int, ...]) -> None:
        """The saved shape must be the statistic's shape or, for a square statistic, one of
        the layouts its other kinds store (:func:`~dkfac.solvers.block_layout.saved_layout`:
        the ``(d,)`` diagonal, ``(k, b, b)`` diagonal blocks)."""
        if saved_layout(got, shape) is None:
            square = len(shape) == 2 and shape[0] == shape[1]
            also = f", ({shape[0]},) or (k, b, b) with k = ceil({shape[0]} / b)" if square else ""
            raise ValueError(f"{where} has shape {got}, expected {shape}{also}")

    def restore(self, value: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``value`` as the ``d × d`` matrix: a saved diagonal or diagonal blocks with zeros
        where nothing was kept."""
        return as_dense(value, shape)


@dataclass(frozen=True)
class BlockDiagonalStatistic(DenseStatistic):
    """A square statistic of which only the diagonal blocks of width ``block`` are computed
    and kept, as a ``(k, block, block)`` tensor (:class:`BlockDiagonalAccumulator`; the
    layout of :mod:`~dkfac.solvers.block_layout`), for a solver that reads only those blocks
    (:class:`~dkfac.solvers.eigen_moments.EigenMomentsSolver` with ``block_size``), which
    takes them as :class:`~dkfac.solvers.block_layout.DiagonalBlocks`. It is combined over
    ranks, averaged in time, rescaled and saved as a dense one is (the same values in the
    blocks: ``k · block²`` floats instead of ``d²``). A saved ``d × d`` value or diagonal
    loads as its blocks; saved blocks load where the side is dense as the block-diagonal
    matrix (zero off the blocks, which the running average then fills in).

    Attributes:
        block: The width of a diagonal block.
    """

    block: int
    label: ClassVar[str] = "blockdiag"

    def accumulator(
        self, dtype: torch.dtype | None, capture_dtype: torch.dtype | None
    ) -> BlockDiagonalAccumulator:
        """A :class:`BlockDiagonalAccumulator` storing in ``dtype``, products in
        ``capture_dtype``."""
        return BlockDiagonalAccumulator(dtype, capture_dtype, block=self.block)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(⌈d / block⌉, block, block)``."""
        return blocks_shape(shape[0], self.block)

    def restore(self, value: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``value``'s diagonal blocks of width ``block``, from any layout."""
        return as_blocks(value, shape, self.block)

    def part(self, value: Tensor, shape: tuple[int, ...], rows: slice) -> Tensor:
        """The ``rows × rows`` part of the block-diagonal matrix (zero off the blocks), as
        a dense matrix (its blocks need not line up with ``rows``)."""
        return as_dense(value, shape)[rows, rows]

    def solver_input(self, value: Tensor, shape: tuple[int, ...]) -> DiagonalBlocks:
        """The blocks with the side they are of."""
        return DiagonalBlocks(value, shape[0])


@dataclass(frozen=True)
class DiagonalStatistic(DenseStatistic):
    """A square statistic of which only the diagonal is computed and kept, as a ``(d,)``
    vector (:class:`DiagonalAccumulator`), for a solver that reads nothing of the factor but
    its width (a one-sided side of
    :class:`~dkfac.solvers.eigen_basis.EigenBasisSolver`). It is averaged over ranks and in
    time, rescaled and saved as a dense statistic is (the same values on the diagonal:
    ``d`` floats held, sent and saved instead of ``d²``). A saved ``d × d`` value loads as
    its diagonal; a saved diagonal loads where the side is dense as ``diag(v)``
    (:meth:`DenseStatistic.restore`).
    """

    label: ClassVar[str] = "diagonal"

    def accumulator(
        self, dtype: torch.dtype | None, capture_dtype: torch.dtype | None
    ) -> DiagonalAccumulator:
        """A :class:`DiagonalAccumulator` storing in ``dtype``, products in ``capture_dtype``."""
        return DiagonalAccumulator(dtype, capture_dtype)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(d,)``."""
        return (shape[0],)

    def restore(self, value: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``value``'s diagonal, from any layout (a view where it can be)."""
        return as_diagonal(value, shape)

    def part(self, value: Tensor, shape: tuple[int, ...], rows: slice) -> Tensor:
        """The entries ``rows`` of the diagonal."""
        del shape
        return value[rows]
