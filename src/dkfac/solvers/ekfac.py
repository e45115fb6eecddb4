"""``"ekfac"``: eigenvalue-corrected K-FAC (George et al. 2018).

The formulas are in :mod:`dkfac.solvers.eigen_moments` (the module notes); this module
holds the method's own scaling.
"""

from __future__ import annotations

from torch import Tensor

from dkfac.solvers.base import SolverState
from dkfac.solvers.eigen_moments import EigenMomentsSolver
from dkfac.solvers.flat_moments import LayerIndex

__all__ = ["EKFACSolver"]


class EKFACSolver(EigenMomentsSolver):
    """Eigenvalue-corrected K-FAC: moments ``v, t`` (:mod:`~dkfac.solvers.eigen_moments`)."""

    name = "ekfac"

    def scaled(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        *,
        null: Tensor | None = None,
        layers: LayerIndex | None = None,
    ) -> Tensor:
        """``R ⊘ (v̂ + λ)`` (the damping bounds the null directions: ``null`` unread)."""
        del null, layers
        return rotated / self.denominator(moments, damping)

    def denominator(self, moments: SolverState, damping: float) -> Tensor:
        """``v̂ + λ``."""
        v = moments["v"]
        return (v / self.correction(self.options.beta2, moments["t"], v)).add_(damping)
