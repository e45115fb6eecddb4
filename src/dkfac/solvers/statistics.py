"""How a solver keeps its statistics: accumulators and statistic kinds.

An accumulator sums one step's contributions over micro-batches; a
:class:`StatisticKind` says how the step's value is combined over ranks, averaged over
steps, rescaled under a ``GradScaler``, checkpointed and handed to the solver.
:class:`BlockDiagonalStatistic` is a dense statistic of which only the diagonal blocks are
computed (for a solver that reads nothing else); :class:`DiagonalStatistic` keeps only the
diagonal, as a ``(d,)`` vector (for a solver that reads nothing of it but its width).

A kind's *stored* value (:meth:`StatisticKind.stored_shape`) need not have the block's
statistic shape: the engine, the strategies and checkpoints ask the kind for it. The kinds
that average their values (:class:`DenseStatistic` and its subclasses) load each other's
saved values (:meth:`StatisticKind.restore`): a ``d × d`` value where the side now keeps its
diagonal gives its diagonal, a ``(d,)`` diagonal where it is now dense gives ``diag(v)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor


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


@dataclass
class BlockDiagonalAccumulator(FactorAccumulator):
    """A :class:`FactorAccumulator` that computes only the diagonal blocks of ``RᵀR``.

    The sum is kept as the whole ``d × d`` matrix with zeros off the blocks of
    :func:`block_bounds`, so ranks, running averages and checkpoints treat it as a dense
    statistic; the products cost ``d · block`` per row instead of ``d²``. A precomputed
    sum (:meth:`add_sum`: a convolution's capture without a reduction) has its off-diagonal
    blocks zeroed, so both paths hold the same (the sum itself was computed whole: no saving
    there). As :class:`FactorAccumulator`, each product is converted to the stored precision
    before it is scaled (a low-precision product times the squared batch size would overflow
    float16).

    Attributes:
        block: The width of a diagonal block (>= 1).
    """

    block: int = 1

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds the diagonal blocks of ``scale · rows.T @ rows`` and the rows' normaliser.

        The whole blocks are multiplied as one batch of contiguous copies (one ``bmm``: a
        column slice of a row matrix whose width is a power of two strides badly for the
        products; measured 30% slower per block on the language model's 512-wide sides),
        a shorter last block on its own; blocks of 1 (the diagonal) are the columns' sums
        of squares.
        """
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        size = matrix.shape[1]
        if self.total is None:
            self.total = matrix.new_zeros(size, size, dtype=self.dtype or matrix.dtype)
        if self.block == 1:  # the diagonal: each column's sum of squares
            squares = matrix.to(self.total.dtype).square().sum(0)
            self.total.diagonal().add_(squares, alpha=scale)
            self.normaliser += rows.normaliser
            return
        whole = size // self.block
        batched = whole if whole > 1 else 0
        if batched:
            width = batched * self.block
            blocks = matrix[:, :width].reshape(-1, whole, self.block).transpose(0, 1).contiguous()
            products = torch.bmm(blocks.mT, blocks).to(self.total.dtype)  # stored, then scaled
            diagonal_blocks(self.total[:width, :width], self.block).add_(products, alpha=scale)
        for start, stop in block_bounds(size, self.block)[batched:]:
            part = matrix[:, start:stop]
            product = (part.T @ part).to(self.total.dtype)
            self.total[start:stop, start:stop].add_(product, alpha=scale)
        self.normaliser += rows.normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        """The diagonal blocks of a precomputed sum, zeros elsewhere (a copy)."""
        if self.block == 1:  # the diagonal, in one call
            return torch.diag(total.diagonal())
        masked = torch.zeros_like(total)
        for start, stop in block_bounds(total.shape[0], self.block):
            masked[start:stop, start:stop] = total[start:stop, start:stop]
        return masked


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

    def part(self, value: Tensor, rows: slice) -> Tensor:
        """The statistic of the units ``rows`` alone (a diagonal block of the factor) from
        a stored value."""
        return value[rows, rows]

    def solver_input(self, value: Tensor) -> Any:
        """The running value as the solver's ``compute`` takes it."""
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
        """The saved shape must be the statistic's shape, or for a square statistic its
        diagonal's ``(d,)`` (what :class:`DiagonalStatistic` stores)."""
        if got != shape and got != _diagonal_shape(shape):
            allowed = f"{shape}" + (f" or {(shape[0],)}" if _diagonal_shape(shape) else "")
            raise ValueError(f"{where} has shape {got}, expected {allowed}")

    def restore(self, value: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``value``, or ``diag(value)`` for a saved diagonal (nothing off it was kept)."""
        if tuple(value.shape) == _diagonal_shape(shape):
            return torch.diag(value)
        return value


@dataclass(frozen=True)
class BlockDiagonalStatistic(DenseStatistic):
    """A dense statistic of which only the diagonal blocks of width ``block`` are computed
    (:class:`BlockDiagonalAccumulator`); the off-diagonal blocks stay zero. It is combined,
    averaged, rescaled and saved as a dense one of the same shape, for a solver that reads
    only those blocks (:class:`~dkfac.solvers.eigen_moments.EigenMomentsSolver` with
    ``block_size``). A running value saved by it and loaded where the side is dense has zero
    off-diagonal blocks, which the running average then fills in over the next updates.

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
        """``value``'s diagonal where it is a ``d × d`` matrix, else ``value``."""
        return value.diagonal() if tuple(value.shape) == shape else value

    def part(self, value: Tensor, rows: slice) -> Tensor:
        """The entries ``rows`` of the diagonal."""
        return value[rows]


def _diagonal_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``(d,)`` for a square ``d × d`` statistic shape, else ``None``."""
    return (shape[0],) if len(shape) == 2 and shape[0] == shape[1] else None
