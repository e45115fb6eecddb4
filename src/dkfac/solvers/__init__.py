"""Solvers: how the damped inverse of a Kronecker pair is applied."""

from __future__ import annotations

import torch

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.cholesky import CholeskySolver
from dkfac.solvers.eigen import EigenSolver

_SOLVERS: dict[str, type[Solver]] = {"eigen": EigenSolver, "cholesky": CholeskySolver}


def make_solver(method: str, compute_dtype: torch.dtype = torch.float32) -> Solver:
    """The solver for ``method`` ("eigen" or "cholesky")."""
    if method not in _SOLVERS:
        raise ValueError(f"method must be one of {tuple(_SOLVERS)}, got {method!r}")
    return _SOLVERS[method](compute_dtype)


__all__ = [
    "CholeskySolver",
    "EigenSolver",
    "Solver",
    "SolverError",
    "SolverState",
    "make_solver",
]
