"""Inverse-based preconditioning with factored Tikhonov damping and the π-correction.

``π = sqrt((tr A / dim A) / (tr G / dim G))`` splits the damping between the factors:
``V = (G + (√λ/π) I)^{-1} ∇W (A + π√λ I)^{-1}``. The inverses are formed through Cholesky
factorisations at inverse-update time, with the damping of that step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverState


def pi_correction(a: Tensor, g: Tensor) -> Tensor:
    """``π = sqrt((tr A / dim A) / (tr G / dim G))``; 1 when either trace is not positive
    (a 0-d float64 tensor on ``a``'s device: the arithmetic of Python floats, no host read)."""
    mean_a = torch.trace(a).to(torch.float64) / a.shape[0]
    mean_g = torch.trace(g).to(torch.float64) / g.shape[0]
    ratio = mean_a / mean_g
    fits = (mean_a > 0) & (mean_g > 0) & torch.isfinite(ratio)
    return torch.where(fits, ratio.clamp(min=0.0).sqrt(), 1.0)


def damped_inverse(
    matrix: Tensor, shift: float | Tensor, dtype: torch.dtype, checked: bool = True
) -> Tensor:
    """``(M + shift·I)^{-1}`` through a Cholesky factorisation in ``dtype``.

    A matrix that is not positive definite raises ``LinAlgError`` (a host read of the
    factorisation's status), or without ``checked`` gives NaN (for a check on the device).
    """
    sym = matrix.to(dtype)
    sym = (sym + sym.T) / 2 + shift * torch.eye(sym.shape[0], dtype=dtype, device=sym.device)
    factor, info = torch.linalg.cholesky_ex(sym)
    if not checked:
        return torch.cholesky_inverse(factor).masked_fill_(info != 0, float("nan"))
    if int(info) != 0:
        raise torch.linalg.LinAlgError(f"matrix not positive definite (info={int(info)})")
    return torch.cholesky_inverse(factor)


class CholeskySolver(Solver):
    """Cholesky-inverse solver: state ``a_inv, g_inv``."""

    name = "cholesky"
    cost_rate = "cholesky"
    apply_products = 2

    @classmethod
    def state_elements(cls, a_dim: int, g_dim: int) -> int:
        """``A⁻¹`` and ``G⁻¹``: ``a² + g²``."""
        return a_dim * a_dim + g_dim * g_dim

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Inverts the π-damped factors."""
        pi = pi_correction(a, g)
        root = math.sqrt(damping)
        storage = a.dtype

        def run(dtype: torch.dtype) -> SolverState:
            return {
                "a_inv": damped_inverse(a, pi * root, dtype, self.host_checks).to(storage),
                "g_inv": damped_inverse(g, root / pi, dtype, self.host_checks).to(storage),
            }

        return self.with_retry(run)

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``G_inv ∇W A_inv`` (the damping was fixed when the inverses were computed)."""
        return state["g_inv"].to(grad.dtype) @ grad @ state["a_inv"].to(grad.dtype)
