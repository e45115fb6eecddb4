"""Eigen-based preconditioning with exact Tikhonov damping of A⊗G (SC20).

With ``A = Q_A Λ_A Q_A^T`` and ``G = Q_G Λ_G Q_G^T`` (eigenvalues clamped at 0),
``V = Q_G [(Q_G^T ∇W Q_A) ⊘ (λ_G λ_A^T + λ)] Q_A^T`` solves ``(A ⊗ G + λI) vec(V) = vec(∇W)``
exactly. Damping enters only at apply time, so a damping schedule takes effect at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverState


def symmetric_eigh(matrix: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix in ``dtype``."""
    sym = matrix.to(dtype)
    sym = (sym + sym.T) / 2
    values, vectors = torch.linalg.eigh(sym)
    return values.clamp(min=0.0), vectors


class EigenSolver(Solver):
    """Eigendecomposition solver: state ``qa, da, qg, dg``."""

    name = "eigen"

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Eigendecomposes both factors (``damping`` is applied later, in :meth:`apply`)."""
        storage = a.dtype

        def run(dtype: torch.dtype) -> SolverState:
            da, qa = symmetric_eigh(a, dtype)
            dg, qg = symmetric_eigh(g, dtype)
            return {
                "qa": qa.to(storage),
                "da": da.to(storage),
                "qg": qg.to(storage),
                "dg": dg.to(storage),
            }

        return self.with_retry(run)

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``Q_G [(Q_G^T ∇W Q_A) ⊘ (λ_G λ_A^T + λ)] Q_A^T``."""
        qa, da, qg, dg = (state[k].to(grad.dtype) for k in ("qa", "da", "qg", "dg"))
        rotated = qg.T @ grad @ qa
        rotated = rotated / (torch.outer(dg, da) + damping)
        return qg @ rotated @ qa.T
