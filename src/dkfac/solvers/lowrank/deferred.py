"""``method="smw"`` and ``"auto"``: a layer's solver and low-rank sides, decided at first sight.

A side's rank is the number of rows one factor update adds, which depends on the batch, so
with ``method="smw"`` or ``"auto"`` a Kronecker layer starts with a :class:`DeferredSolver`.
The **first rows added** (the first forward pass of the first factor-update step, the A
side) decide both sides (:meth:`DeferredSolver.resolve`); the G side is assumed to add as
many rows as A (true for Linear, Conv2d under every reduction, and Embedding).

Rows of one step, per side: ``m = r₁ · accumulation_steps · P``, where ``r₁`` is the rows of
that first micro-batch and ``P`` the number of ranks whose rows are gathered
(:class:`RowsRule`). The running concatenation keeps at most
``r = default_max_rank(m, factor_decay)`` columns (``r = m`` when the decay is 0), or all
of a step's where that step has more rows than ``m``
(:func:`~dkfac.solvers.lowrank.factor.decay_concat`).

* ``method="smw"``: a side is **low-rank** when ``r < d``; otherwise it stays dense (running
  ``d × d`` average, inverted by Cholesky inside the SMW solver). Under several ranks this
  also means low-rank statistics are all-gathered (``P·m·d`` values) only when that is
  smaller than the ``d × d`` all-reduce.
* ``method="auto"``: :func:`~dkfac.solvers.lowrank.auto.choose_method` with
  ``rows_a = rows_g = r`` picks the layer's solver and each side's kind.

A block that feeds precomputed sums (no rows) gets dense sides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverState
from dkfac.solvers.cholesky import CholeskySolver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.lowrank.auto import choose_method
from dkfac.solvers.lowrank.factor import default_max_rank
from dkfac.solvers.lowrank.smw import SMWSolver

__all__ = ["DEFERRED_METHODS", "DeferredSolver", "RowsRule", "decided_solver"]

logger = logging.getLogger(__name__)

DEFERRED_METHODS = ("smw", "auto")


@dataclass(frozen=True, kw_only=True)
class RowsRule:
    """What turns the rows of a first micro-batch into a bounded rank.

    Attributes:
        accumulation_steps: Micro-batches per step.
        gathered_ranks: ``P``, the ranks whose rows one reduced statistic holds.
        decay: The running-average decay (resolved at step 0).
        factor_update_interval: Steps between factor updates (``"auto"``'s cost rule).
        inverse_update_interval: Steps between inverse updates (``"auto"``'s cost rule).
    """

    accumulation_steps: int = 1
    gathered_ranks: int = 1
    decay: float = 0.0
    factor_update_interval: int = 1
    inverse_update_interval: int = 1

    def step_rows(self, rows: int) -> int:
        """``m``: the rows one step adds to a side."""
        return rows * self.accumulation_steps * self.gathered_ranks

    def bounded_rank(self, rows: int) -> int:
        """``r``: the columns the running concatenation keeps for ``rows`` first rows."""
        return default_max_rank(self.step_rows(rows), self.decay)


def decided_solver(
    method: str, compute_dtype: torch.dtype, lowrank: dict[str, int] | None = None
) -> Solver:
    """The concrete solver of a decision (as :meth:`Solver.decision` records it)."""
    if method == "smw":
        return SMWSolver(compute_dtype, lowrank)
    if lowrank:
        raise ValueError(f"only the smw solver has low-rank sides, got {method!r} with {lowrank}")
    if method == "eigen":
        return EigenSolver(compute_dtype)
    if method == "cholesky":
        return CholeskySolver(compute_dtype)
    raise ValueError(f"a decision names 'smw', 'eigen' or 'cholesky', got {method!r}")


class DeferredSolver(Solver):
    """A layer's solver until its first capture decides it (see the module docstring).

    Args:
        method: ``"smw"`` or ``"auto"``.
        compute_dtype: Precision of the decided solver's factorisations.
        rule: How rows become a bounded rank.
    """

    deferred = True

    def __init__(self, method: str, compute_dtype: torch.dtype, rule: RowsRule) -> None:
        if method not in DEFERRED_METHODS:
            raise ValueError(f"method must be one of {DEFERRED_METHODS}, got {method!r}")
        super().__init__(compute_dtype)
        self.name = method
        self.rule = rule

    @property
    def label(self) -> str:
        """``"smw (pending)"`` / ``"auto (pending)"``."""
        return f"{self.name} (pending)"

    def resolve(self, dims: tuple[int, int], rows: int | None) -> Solver:
        """The solver and low-rank sides for ``dims = (a_dim, g_dim)`` and the first rows."""
        sides_dims = {"A": dims[0], "G": dims[1]}
        rank = None if rows is None or rows < 1 else self.rule.bounded_rank(rows)
        if self.name == "smw":
            sides = {k: rank for k, d in sides_dims.items() if rank is not None and rank < d}
            return SMWSolver(self.compute_dtype, sides)
        choice = choose_method(
            dims[0],
            dims[1],
            rank or dims[0],
            rank or dims[1],
            factor_update_interval=self.rule.factor_update_interval,
            inverse_update_interval=self.rule.inverse_update_interval,
        )
        picked = {"A": choice.a, "G": choice.g}
        lowrank = {k: rank for k, kind in picked.items() if kind == "lowrank" and rank is not None}
        return decided_solver(choice.method, self.compute_dtype, lowrank)

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Never called: a layer computes only once its solver is decided."""
        raise RuntimeError(f"{self.label}: the solver is decided at the first capture")

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """Never called (no state before the decision)."""
        raise RuntimeError(f"{self.label}: the solver is decided at the first capture")

    def decision(self) -> dict[str, Any]:
        """Nothing is decided yet."""
        raise RuntimeError(f"{self.label}: nothing is decided before the first capture")
