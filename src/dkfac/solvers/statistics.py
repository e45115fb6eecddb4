"""How a statistic accumulates over the micro-batches of one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """Adds a precomputed sum of outer products (any shape) and its normaliser."""
        contribution = total if self.dtype is None else total.to(self.dtype)
        if scale != 1.0:
            contribution = contribution * scale
        if self.total is None:
            self.total = contribution.clone()
        else:
            self.total.add_(contribution)
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
