"""Solvers: how the damped inverse of a layer's curvature is applied.

The table of solvers is :data:`SOLVERS`; the methods a user can configure are
:data:`METHODS` (their :data:`MethodName` ``Literal`` and the runtime tuple come from one
source). Adding a solver touches this folder only: write the class, add it to
:data:`SOLVERS` and, if users pick it by name, to :data:`MethodName` (see
``docs/adding-a-solver.md``).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.cholesky import CholeskySolver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.eigen_moments import (
    BASIS_REFRESHES,
    MOMENT_CARRIES,
    BasisRefresh,
    EigenAdamSolver,
    EigenMomentsSolver,
    EKFACSolver,
    MomentCarry,
    MomentOptions,
)
from dkfac.solvers.lowrank.deferred import (
    DEFERRED_METHODS,
    DeferredSolver,
    RowsRule,
    decided_solver,
)
from dkfac.solvers.lowrank.smw import SMWSolver
from dkfac.solvers.statistics import DenseStatistic, StatisticKind
from dkfac.solvers.unitwise import UnitwiseSolver

MethodName = Literal["eigen", "cholesky", "smw", "auto", "ekfac", "eigen_adam"]
"""What ``KFACConfig.method`` accepts."""
METHODS: tuple[str, ...] = get_args(MethodName)

SOLVERS: dict[str, type[Solver]] = {
    "eigen": EigenSolver,
    "cholesky": CholeskySolver,
    "smw": SMWSolver,
    "unitwise": UnitwiseSolver,
    "ekfac": EKFACSolver,
    "eigen_adam": EigenAdamSolver,
}
"""Solver name -> class: the one table of solvers (``"unitwise"`` is BatchNorm's own)."""


def make_solver(
    method: str,
    compute_dtype: torch.dtype = torch.float32,
    rule: RowsRule | None = None,
    moments: MomentOptions | None = None,
) -> Solver:
    """The solver for ``method`` (a name of :data:`SOLVERS`, or ``"auto"``).

    Args:
        method: The solver's name.
        compute_dtype: Precision of its decompositions.
        rule: With ``"smw"`` or ``"auto"``, a :class:`RowsRule` defers the decision to the
            first capture (:class:`DeferredSolver`). Without one, ``"smw"`` keeps both
            sides dense; ``"auto"`` needs one.
        moments: Hyperparameters of the eigenbasis-moment solvers (``"ekfac"``,
            ``"eigen_adam"``; default :class:`MomentOptions`); other solvers ignore them.
    """
    if rule is not None and method in DEFERRED_METHODS:
        return DeferredSolver(method, compute_dtype, rule)
    if method not in SOLVERS:
        raise ValueError(f"method must be one of {(*SOLVERS, 'auto')}, got {method!r}")
    cls = SOLVERS[method]
    if issubclass(cls, EigenMomentsSolver):
        return cls(compute_dtype, moments)
    return cls(compute_dtype)


__all__ = [
    "BASIS_REFRESHES",
    "METHODS",
    "MOMENT_CARRIES",
    "SOLVERS",
    "BasisRefresh",
    "CholeskySolver",
    "DenseStatistic",
    "EKFACSolver",
    "EigenAdamSolver",
    "EigenMomentsSolver",
    "EigenSolver",
    "MethodName",
    "MomentCarry",
    "MomentOptions",
    "RowsRule",
    "SMWSolver",
    "Solver",
    "SolverError",
    "SolverState",
    "StatisticKind",
    "UnitwiseSolver",
    "decided_solver",
    "make_solver",
]
