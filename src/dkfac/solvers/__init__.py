"""Solvers: how the damped inverse of a layer's curvature is applied.

The table of solvers is :data:`SOLVERS`; the methods a user can configure are
:data:`METHODS` (their :data:`MethodName` ``Literal`` and the runtime tuple come from one
source). Adding a solver touches this folder only: write the class, add it to
:data:`SOLVERS` and, if users pick it by name, to :data:`MethodName` (see
``docs/adding-a-solver.md``); a solver defined outside the package is added with
:func:`register_solver`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.cholesky import CholeskySolver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.eigen_adam import EigenAdamSolver
from dkfac.solvers.eigen_moments import EigenMomentsSolver
from dkfac.solvers.ekfac import EKFACSolver
from dkfac.solvers.lowrank.deferred import (
    DEFERRED_METHODS,
    DeferredSolver,
    RowsRule,
    decided_solver,
)
from dkfac.solvers.lowrank.smw import SMWSolver
from dkfac.solvers.moment_options import (
    BASIS_REFRESHES,
    MOMENT_CARRIES,
    BasisRefresh,
    MomentCarry,
    MomentOptions,
    check_moment_combinations,
)
from dkfac.solvers.polar import NS_STEPS
from dkfac.solvers.statistics import (
    BlockDiagonalStatistic,
    DenseStatistic,
    DiagonalStatistic,
    StatisticKind,
)
from dkfac.solvers.unitwise import UnitwiseSolver
from dkfac.solvers.unitwise_adam import UnitwiseAdamSolver

MethodName = Literal["eigen", "cholesky", "smw", "auto", "ekfac", "eigen_adam"]
"""What ``KFACConfig.method`` accepts."""
METHODS: tuple[str, ...] = get_args(MethodName)

SOLVERS: dict[str, type[Solver]] = {
    "eigen": EigenSolver,
    "cholesky": CholeskySolver,
    "smw": SMWSolver,
    "unitwise": UnitwiseSolver,
    "unitwise_adam": UnitwiseAdamSolver,
    "ekfac": EKFACSolver,
    "eigen_adam": EigenAdamSolver,
}
"""Solver name -> class: the one table of solvers (``"unitwise"`` and ``"unitwise_adam"``
are the unit-wise blocks' own: :attr:`~dkfac.blocks.base.Block.solver_name`)."""

_REGISTERED: list[str] = []


def register_solver(cls: type[Solver], name: str | None = None) -> None:
    """Adds (or replaces) a solver that users pick with ``KFACConfig(method=name)``.

    Built-in solvers are written into :data:`SOLVERS` and :data:`MethodName` instead (see
    ``docs/adding-a-solver.md``); this is for solvers defined outside the package.

    Args:
        cls: A :class:`Solver` subclass, built as ``cls(compute_dtype)``.
        name: The method's name (default: ``cls.name``).

    Raises:
        TypeError: If ``cls`` is not a Solver subclass.
        ValueError: If the name is empty or one of the deferred methods (``"smw"``/``"auto"``).
    """
    if not (isinstance(cls, type) and issubclass(cls, Solver)):
        raise TypeError(f"cls must be a Solver subclass, got {cls!r}")
    name = cls.name if name is None else name
    if not isinstance(name, str) or not name or name in DEFERRED_METHODS:
        raise ValueError(f"a solver's name must be a new non-empty string, got {name!r}")
    SOLVERS[name] = cls
    if name not in METHODS and name not in _REGISTERED:
        _REGISTERED.append(name)


def adam_scaled(method: str) -> bool:
    """Whether ``method``'s solver has Adam's scale (:attr:`Solver.adam_scaled`; ``False``
    for a name that is not a solver's, such as ``"auto"``)."""
    solver = SOLVERS.get(method)
    return solver is not None and solver.adam_scaled


def method_names() -> tuple[str, ...]:
    """Every method ``KFACConfig.method`` accepts now: :data:`METHODS` and registered ones."""
    return (*METHODS, *_REGISTERED)


def make_solver(
    method: str,
    compute_dtype: torch.dtype = torch.float32,
    rule: RowsRule | None = None,
    moments: MomentOptions | None = None,
    input_map: tuple[int, int] | None = None,
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
        input_map: ``(channels, positions)`` of a flattened input map: a Kronecker-structured
            input basis (:mod:`dkfac.solvers.kron_basis`). Only the eigenbasis-moment
            solvers take one.

    Raises:
        ValueError: For an unknown method, or an ``input_map`` for a solver without an
            eigenbasis of moments.
    """
    solver: Solver
    if rule is not None and method in DEFERRED_METHODS:
        solver = DeferredSolver(method, compute_dtype, rule)
    elif method not in SOLVERS:
        raise ValueError(f"method must be one of {(*SOLVERS, 'auto')}, got {method!r}")
    else:
        cls = SOLVERS[method]
        if issubclass(cls, EigenMomentsSolver):
            return cls(compute_dtype, moments, input_map)
        solver = cls(compute_dtype, moments) if cls is UnitwiseAdamSolver else cls(compute_dtype)
    if input_map is not None:
        raise ValueError(
            f"a structured input basis (input map {input_map!r}) needs an eigenbasis-moment "
            f"method ('eigen_adam' or 'ekfac'), got method {method!r}"
        )
    return solver


__all__ = [
    "BASIS_REFRESHES",
    "METHODS",
    "MOMENT_CARRIES",
    "NS_STEPS",
    "SOLVERS",
    "BasisRefresh",
    "BlockDiagonalStatistic",
    "CholeskySolver",
    "DenseStatistic",
    "DiagonalStatistic",
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
    "UnitwiseAdamSolver",
    "UnitwiseSolver",
    "adam_scaled",
    "check_moment_combinations",
    "decided_solver",
    "make_solver",
    "method_names",
    "register_solver",
]
