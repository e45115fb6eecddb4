"""Solvers: how the damped inverse of a Kronecker pair is applied."""

from __future__ import annotations

import torch

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.cholesky import CholeskySolver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.lowrank.smw import SMWSolver
from dkfac.solvers.unitwise import UnitwiseSolver

_SOLVERS: dict[str, type[Solver]] = {
    "eigen": EigenSolver,
    "cholesky": CholeskySolver,
    "smw": SMWSolver,
    "unitwise": UnitwiseSolver,
}


def make_solver(method: str, compute_dtype: torch.dtype = torch.float32) -> Solver:
    """The solver for ``method`` ("eigen", "cholesky", "smw"; "unitwise" for BatchNorm).

    ``"auto"`` is not a solver: it is resolved per layer by
    :func:`dkfac.solvers.lowrank.auto.choose_method`, whose ``MethodChoice.method`` is passed here.
    """
    if method not in _SOLVERS:
        raise ValueError(f"method must be one of {tuple(_SOLVERS)}, got {method!r}")
    return _SOLVERS[method](compute_dtype)


__all__ = [
    "CholeskySolver",
    "EigenSolver",
    "SMWSolver",
    "Solver",
    "SolverError",
    "SolverState",
    "UnitwiseSolver",
    "make_solver",
]
