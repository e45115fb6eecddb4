"""The solver interface: how the damped inverse of a Kronecker pair is applied.

A solver turns the factors of one layer into a *state* (eigenpairs, inverses, ...) in
:meth:`Solver.compute`, which is the expensive, infrequent part, and applies the damped
inverse to a gradient matrix in :meth:`Solver.apply`, which runs every step. The state is a
flat ``dict[str, Tensor]`` so that strategies can communicate it and memory can be counted.

A solver whose :attr:`Solver.accepts_lowrank` is ``True`` (the SMW solver) also takes each
factor as a :class:`~dkfac.solvers.lowrank.factor.LowRank` ``U`` with ``F = U Uᵀ`` instead
of a dense matrix; the preconditioner then keeps the factors' rows rather than ``RᵀR``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SolverState = dict[str, Tensor]


class SolverError(RuntimeError):
    """A decomposition failed even in float64; the caller keeps the last good state."""


class Solver(ABC):
    """Applies ``(A ⊗ G + damping)^{-1}`` (in some approximation) to gradient matrices.

    Args:
        compute_dtype: Precision of the decompositions (float32 or float64); a failure in
            float32 is retried once in float64.
    """

    name: str = "solver"
    accepts_lowrank: bool = False
    """Whether :meth:`compute` also takes :class:`~dkfac.solvers.lowrank.factor.LowRank` factors."""

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_dtype = compute_dtype

    @abstractmethod
    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Builds the solver state from the factors ``A`` (d_in×d_in) and ``G``."""

    def compute_statistics(self, stats: Mapping[str, Any], damping: float) -> SolverState:
        """Builds the solver state from a layer's named running statistics.

        Kronecker solvers take ``stats["A"]`` and ``stats["G"]``; other solvers (unit-wise
        BatchNorm) override this to read the statistics their block produces.
        """
        return self.compute(stats["A"], stats["G"], damping)

    @abstractmethod
    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """Returns the preconditioned ``g_dim × a_dim`` gradient matrix."""

    def with_retry(self, fn: Callable[[torch.dtype], SolverState]) -> SolverState:
        """Runs ``fn(dtype)`` in the compute dtype, then once more in float64 on failure.

        A failure is a raised linear-algebra error or a non-finite result.

        Raises:
            SolverError: If float64 fails too.
        """
        dtypes = [self.compute_dtype]
        if self.compute_dtype != torch.float64:
            dtypes.append(torch.float64)
        last: Exception | None = None
        for dtype in dtypes:
            try:
                # Contiguous, so that ranks that receive a state by broadcast (row-major
                # buffers) and the owner run the same kernels and round identically.
                state = {key: value.contiguous() for key, value in fn(dtype).items()}
            except (RuntimeError, torch.linalg.LinAlgError) as err:
                last = err
            else:
                if all(bool(torch.isfinite(t).all()) for t in state.values()):
                    return state
                last = FloatingPointError("non-finite decomposition")
            if dtype != torch.float64:
                logger.warning(
                    "%s decomposition failed in %s (%s); retrying", self.name, dtype, last
                )
        raise SolverError(f"{self.name} decomposition failed in float64: {last}")
