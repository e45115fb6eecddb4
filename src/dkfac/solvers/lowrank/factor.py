"""Low-rank Kronecker factors ``A = U Uᵀ`` for the SMW (SKFAC) path.

A block's :class:`~dkfac.blocks.base.Rows` define a factor ``rows.T @ rows / n``; the same
factor is ``U Uᵀ`` with ``U = rows.T / sqrt(n)`` (``d × m``). The SMW solver only ever needs
``U``, so the low-rank path never forms the ``d × d`` matrix. Three operations keep ``U``
exact where the dense path would add matrices:

* **micro-batches / ranks** (:class:`LowRankRowsAccumulator`): the dense path sums ``RᵀR``
  and normalisers; the low-rank path concatenates the rows (scaled by ``sqrt(scale)``) and
  divides by ``sqrt(Σ n)`` once, which gives the same factor. Gathering the rows of several
  ranks is the same concatenation.
* **running averages** (:func:`decay_concat`, :class:`LowRankRunningFactor`):
  ``decay·A_old + (1−decay)·A_new = [√decay·U_old, √(1−decay)·U_new] [..]ᵀ`` exactly. The rank
  grows with every update, so it is bounded by ``max_rank``: the *oldest* columns (those with
  the smallest weight ``decay^k``) are dropped, never one of the newest update's (a step
  with more rows than the bound was made for, a later larger batch or micro-batches the
  bound did not count, keeps them all: ``U`` then has more than ``max_rank`` columns). With a
  truncation the result is an approximation from below (``U_kept U_keptᵀ ⪯ U Uᵀ``);
  ``decay = 0`` keeps only the newest factor and is always exact.
* Raw ``U`` matrices are never added: ``U_1 + U_2`` has no meaning for ``U Uᵀ``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from dkfac.solvers.statistics import Rows, StatisticKind


@dataclass(frozen=True)
class LowRank:
    """A symmetric PSD factor held as ``U Uᵀ`` with ``U`` of shape ``(d, m)``.

    Attributes:
        u: The ``d × m`` matrix; the factor it stands for is ``u @ u.T``.
    """

    u: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.u, Tensor):
            raise TypeError(f"u must be a Tensor, got {type(self.u).__name__}")
        if self.u.dim() != 2 or self.u.shape[0] == 0:
            raise ValueError(
                f"u must be a (d, m) matrix with d >= 1, got shape {tuple(self.u.shape)}"
            )
        if not self.u.is_floating_point():
            raise TypeError(f"u must be a floating tensor, got {self.u.dtype}")

    @classmethod
    def from_rows(cls, rows: Rows) -> LowRank:
        """``U = rows.T / sqrt(normaliser)``, so ``U Uᵀ = rows.T @ rows / normaliser``."""
        if rows.normaliser <= 0:
            raise ValueError(f"rows.normaliser must be > 0, got {rows.normaliser}")
        return cls(rows.rows.T / math.sqrt(rows.normaliser))

    @property
    def dim(self) -> int:
        """``d``, the dimension of the factor."""
        return int(self.u.shape[0])

    @property
    def rank(self) -> int:
        """``m``, the number of columns of ``U`` (an upper bound of the factor's rank)."""
        return int(self.u.shape[1])

    def trace(self) -> float:
        """``tr(U Uᵀ) = ‖U‖_F²`` without forming the factor."""
        return float(self.u.pow(2).sum())

    def dense(self) -> Tensor:
        """The ``d × d`` factor ``U Uᵀ`` (for the dense fallback and for tests)."""
        return self.u @ self.u.T


def decay_concat(u_old: Tensor | None, u_new: Tensor, decay: float, max_rank: int) -> Tensor:
    """Running average of low-rank factors: ``[√decay·U_old, √(1−decay)·U_new]``.

    Without truncation ``R Rᵀ = decay·U_old U_oldᵀ + (1−decay)·U_new U_newᵀ`` exactly. When
    the result has more than ``max_rank`` columns the oldest (leftmost) ones are dropped, which
    under-approximates the average; the columns of ``u_new`` are all kept, even past
    ``max_rank`` (dropping some would drop samples of the newest factor and leave it on the
    wrong scale). The first update (``u_old is None``) and ``decay == 0`` return ``u_new``
    itself, as the dense running average takes ``F_new`` as it is.

    Args:
        u_old: The running ``d × m_old`` matrix, oldest columns first, or ``None``.
        u_new: The new ``d × m_new`` matrix.
        decay: The running-average decay in ``[0, 1)``.
        max_rank: The most columns kept (>= 1).

    Returns:
        The new running ``d × max(min(m_old + m_new, max_rank), m_new)`` matrix.

    Raises:
        ValueError: For a decay outside ``[0, 1)``, ``max_rank < 1``, or mismatched shapes.
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise TypeError(f"decay must be a number, got {type(decay).__name__}")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"max_rank must be an integer >= 1, got {max_rank!r}")
    if u_new.dim() != 2:
        raise ValueError(f"u_new must be a (d, m) matrix, got shape {tuple(u_new.shape)}")
    if u_old is None or decay == 0.0:
        combined = u_new
    else:
        if u_old.dim() != 2 or u_old.shape[0] != u_new.shape[0]:
            raise ValueError(
                f"u_old must be a (d, m) matrix with d = {u_new.shape[0]}, "
                f"got shape {tuple(u_old.shape)}"
            )
        combined = torch.cat(
            [u_old * math.sqrt(decay), u_new.to(u_old.dtype) * math.sqrt(1.0 - decay)], dim=1
        )
    keep = max(max_rank, u_new.shape[1])  # never a column of the newest update
    if combined.shape[1] > keep:
        combined = combined[:, combined.shape[1] - keep :]
    return combined


def default_max_rank(rows: int, decay: float, weight_floor: float = 0.01) -> int:
    """A rank bound that keeps every update whose running-average weight is still sizeable.

    In the concatenation the ``k``-th newest update is weighted ``decay^(k-1)`` relative to
    the newest; the updates with ``decay^(k-1) >= weight_floor`` are kept, so the bound is
    ``rows · (1 + floor(log(weight_floor) / log(decay)))`` (``rows`` when ``decay == 0``).

    Args:
        rows: Columns one update adds (>= 1).
        decay: The running-average decay in ``[0, 1)``.
        weight_floor: The smallest relative weight worth keeping, in ``(0, 1]``.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    if not 0.0 < weight_floor <= 1.0:
        raise ValueError(f"weight_floor must be in (0, 1], got {weight_floor!r}")
    if decay == 0.0:
        return rows
    updates = 1 + math.floor(math.log(weight_floor) / math.log(decay) + 1e-12)
    return rows * updates


@dataclass
class LowRankRowsAccumulator:
    """Collects the rows of one step's factor over micro-batches (or ranks) without ``RᵀR``.

    ``to_lowrank()`` equals the dense ``Σ scale·RᵀR / Σ n`` as ``U Uᵀ``.

    Attributes:
        dtype: Precision the rows are kept in (``None``: as they come).
        parts: The scaled row blocks added so far.
        normaliser: The running sum of normalisers.
    """

    dtype: torch.dtype | None = None
    parts: list[Tensor] = field(default_factory=list)
    normaliser: float = 0.0
    takes_sums = False
    """Rows are kept, so sums of outer products are refused (:meth:`add_sum`)."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The rows are kept in :attr:`dtype`."""
        return self.dtype

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``rows`` whose outer products count ``scale`` times (``scale >= 0``)."""
        if not scale >= 0 or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
        matrix = rows.rows if self.dtype is None else rows.rows.to(self.dtype)
        if matrix.dim() != 2:
            raise ValueError(f"rows must be a (r, d) matrix, got shape {tuple(matrix.shape)}")
        if self.parts and matrix.shape[1] != self.parts[0].shape[1]:
            raise ValueError(
                f"rows have {matrix.shape[1]} columns, expected {self.parts[0].shape[1]}"
            )
        self.parts.append(matrix * math.sqrt(scale) if scale != 1.0 else matrix)
        self.normaliser += rows.normaliser

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Not possible: a sum of outer products has lost the rows ``U`` is made of.

        Raises:
            TypeError: Always; a block that feeds precomputed sums needs a dense side.
        """
        del total, normaliser, scale
        raise TypeError(
            "a low-rank factor side keeps rows, not sums of outer products: a block that "
            "calls add_sum() needs a dense factor side"
        )

    @property
    def has_data(self) -> bool:
        """Whether anything was added since the last reset."""
        return bool(self.parts)

    def mean(self) -> Tensor | None:
        """``U`` (``d × m``) of the accumulated factor, or ``None`` when nothing was added."""
        low = self.to_lowrank()
        return None if low is None else low.u

    def tensors(self) -> list[Tensor]:
        """The row blocks held (for memory accounting)."""
        return list(self.parts)

    def to_lowrank(self) -> LowRank | None:
        """The accumulated factor as ``U Uᵀ``, or ``None`` when nothing was added."""
        if not self.parts or self.normaliser == 0:
            return None
        rows = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts, dim=0)
        return LowRank(rows.T / math.sqrt(self.normaliser))

    def reset(self) -> None:
        """Forgets every contribution."""
        self.parts = []
        self.normaliser = 0.0


@dataclass
class LowRankRunningFactor:
    """The running low-rank factor of one side of a layer (see :func:`decay_concat`).

    Attributes:
        max_rank: The most columns kept, or the newest update's where it has more.
        u: The running ``d × m`` matrix, ``None`` before the first update.
    """

    max_rank: int
    u: Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int):
            raise TypeError(f"max_rank must be an int, got {type(self.max_rank).__name__}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")

    def update(self, new: LowRank, decay: float) -> None:
        """``U ← [√decay·U, √(1−decay)·U_new]``, its oldest columns dropped past ``max_rank``
        (:func:`decay_concat`: every column of ``U_new`` is kept)."""
        self.u = decay_concat(self.u, new.u, decay, self.max_rank)

    def value(self) -> LowRank | None:
        """The running factor, or ``None`` before the first update."""
        return None if self.u is None else LowRank(self.u)


@dataclass(frozen=True)
class LowRankStatistic(StatisticKind):
    """A factor side held as ``U`` (``d × r``, ``F = U Uᵀ``): rows, never ``RᵀR``.

    One step's value is ``U`` of the concatenated rows (:class:`LowRankRowsAccumulator`);
    ranks all-gather their rows (``gathered``); the running value is the decayed
    concatenation, its oldest columns dropped past ``max_rank`` but never one of the newest
    update's (:func:`decay_concat`), so its shape grows with the steps (not ``comparable``);
    a statistic quadratic in the gradient is rescaled through ``U`` by ``√factor``.

    Attributes:
        max_rank: The most columns the running ``U`` keeps (more where the newest update
            alone has more).
    """

    max_rank: int
    label: ClassVar[str] = "lowrank"
    gathered: ClassVar[bool] = True
    comparable: ClassVar[bool] = False

    def accumulator(
        self, dtype: torch.dtype | None, capture_dtype: torch.dtype | None
    ) -> LowRankRowsAccumulator:
        """A :class:`LowRankRowsAccumulator` in ``dtype`` (rows keep the factor dtype)."""
        del capture_dtype
        return LowRankRowsAccumulator(dtype)

    def update_running(self, old: Tensor | None, new: Tensor, decay: float) -> Tensor:
        """``[√decay·U_old, √(1−decay)·U_new]``, oldest columns dropped past ``max_rank``
        (every column of ``U_new`` kept: :func:`decay_concat`)."""
        return decay_concat(old, new, decay, self.max_rank)

    def rescale(self, value: Tensor, factor: float) -> Tensor:
        """``√factor · U`` (the factor ``U Uᵀ`` is scaled by ``factor``)."""
        return value * factor**0.5

    def check_saved(self, where: str, shape: tuple[int, ...], got: tuple[int, ...]) -> None:
        """A saved ``U`` is ``(d, r)`` with ``r >= 1`` (more than ``max_rank`` where a step
        added more rows than the bound was made for: :func:`decay_concat`)."""
        if len(got) != 2 or got[0] != shape[0] or got[1] < 1:
            raise ValueError(
                f"{where} has shape {got}, but this layer's side is low-rank: expected "
                f"({shape[0]}, r) with r >= 1 (a value of another layout loads before the "
                "first step, while the sides are undecided)"
            )

    def part(self, value: Tensor, shape: tuple[int, ...], rows: slice) -> LowRank:
        """The rows ``rows`` of ``U`` (the factor's diagonal block of those units)."""
        del shape
        return LowRank(value[rows])

    def solver_input(self, value: Tensor, shape: tuple[int, ...]) -> LowRank:
        """``U`` as a :class:`LowRank` factor."""
        del shape
        return LowRank(value)
