"""Unit-wise natural gradient for BatchNorm (SP-NGD): one closed-form 2×2 solve per channel.

The block (:class:`~dkfac.blocks.batchnorm.BatchNormBlock`) feeds the statistic ``"F"``,
the per-channel Fisher of ``(γ_c, β_c)`` of shape ``(C, 2, 2)``; the gradient matrix is
``(C, 2)`` = ``[∇γ_c, ∇β_c]``. The update is ``(F_c + λ_BN I₂)^{-1} [∇γ_c, ∇β_c]``, with
the BatchNorm damping ``λ_BN`` passed to :meth:`UnitwiseSolver.apply`. No decomposition is
needed, so the state is the Fisher itself and the solve happens at apply time (a damping
schedule takes effect at once). The solve is per channel, so the BatchNorm layers of one
dtype and device are solved as one (:meth:`UnitwiseSolver.apply_batch`: their channels
concatenated), whatever their widths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverError, SolverState


def damped_solve_2x2(fisher: Tensor, grad: Tensor, damping: float) -> Tensor:
    """``(F_c + λ I)^{-1} grad_c`` for every channel, in closed form.

    Args:
        fisher: ``(C, 2, 2)`` symmetric positive semi-definite matrices.
        grad: ``(C, 2)``: ``[∇γ_c, ∇β_c]``.
        damping: ``λ > 0``.
    """
    a = fisher[:, 0, 0] + damping
    b = fisher[:, 0, 1]
    d = fisher[:, 1, 1] + damping
    det = a * d - b * b
    g0, g1 = grad[:, 0], grad[:, 1]
    return torch.stack([(d * g0 - b * g1) / det, (a * g1 - b * g0) / det], dim=-1)


class UnitwiseSolver(Solver):
    """Closed-form per-channel 2×2 damped solve: state ``fisher`` of shape ``(C, 2, 2)``."""

    name = "unitwise"

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Not a Kronecker solver: use :meth:`compute_statistics` with ``{"F": ...}``."""
        raise TypeError("UnitwiseSolver takes the BatchNorm statistic 'F', not an (A, G) pair")

    def compute_statistics(
        self, stats: Mapping[str, Any], damping: float, previous: SolverState | None = None
    ) -> SolverState:
        """Keeps a symmetrised copy of the running per-channel Fisher."""
        fisher = stats["F"]
        if not bool(torch.isfinite(fisher).all()):
            raise SolverError("unitwise: non-finite BatchNorm Fisher")
        return {"fisher": ((fisher + fisher.transpose(1, 2)) / 2).clone()}

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``(F_c + λ I)^{-1} grad_c`` for every channel."""
        return damped_solve_2x2(state["fisher"].to(grad.dtype), grad, damping)

    def batch_key(self, state: SolverState, grad: Tensor) -> tuple[Any, ...] | None:
        """The class, the gradient's dtype and device and the Fisher's dtype: any number of
        channels share a solve."""
        return (type(self), grad.dtype, grad.device, state["fisher"].dtype)

    def apply_batch(
        self,
        states: Sequence[SolverState],
        moments: Sequence[SolverState | None],
        grads: Sequence[Tensor],
        damping: float,
        *,
        advance: Tensor | None = None,
    ) -> list[tuple[Tensor, SolverState | None]]:
        """:meth:`apply` of several layers as one solve over their concatenated channels;
        each update is its layer's rows of the result."""
        if len(grads) == 1:
            return super().apply_batch(states, moments, grads, damping, advance=advance)
        fisher = torch.cat([state["fisher"] for state in states]).to(grads[0].dtype)
        solved = damped_solve_2x2(fisher, torch.cat(list(grads)), damping)
        updates = solved.split([grad.shape[0] for grad in grads])
        return list(zip(updates, moments, strict=True))
