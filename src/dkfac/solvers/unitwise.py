"""Unit-wise natural gradient (SP-NGD): one damped ``d × d`` solve per unit.

A unit-wise block feeds the statistic ``"F"`` of shape ``(C, d, d)``, the Fisher of each
unit's ``d`` parameters, and its gradient matrix is ``(C, d)``, a unit per row:

* BatchNorm (:class:`~dkfac.blocks.batchnorm.BatchNormBlock`): a channel's ``(γ_c, β_c)``,
  ``d = 2``, solved in closed form;
* a grouped convolution (:class:`~dkfac.blocks.grouped_conv.GroupedConvBlock`): an output
  channel's weights and bias, solved through a batched Cholesky factorisation.

The update is ``(F_c + λ I_d)^{-1} g_c``, with the damping the block names passed to
:meth:`UnitwiseSolver.apply`. The state is the Fisher itself; the inverses of its damped
blocks are formed at the first apply after a refresh or a change of damping (a damping
schedule takes effect at once) and kept, so a step's solve is one batched product. A unit
whose damped block fails to factorise (a Fisher far beyond the damping in the working
precision) takes ``I / (λ + tr F_c)`` instead, chosen on the device without a host read:
never a non-finite update. The solve is per unit, so the layers of one unit size, dtype
and device are solved as one (:meth:`UnitwiseSolver.apply_batch`: their units
concatenated), whatever their widths, and refreshed as one
(:meth:`UnitwiseSolver.compute_batch`).
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
    return solve_2x2(damped_inverse_2x2(fisher, damping), grad)


def damped_inverse_2x2(fisher: Tensor, damping: float) -> Tensor:
    """``(F_c + λ I)^{-1} = [[d, −b], [−b, a]] / (ad − b²)`` of every channel, with
    ``F_c + λ I = [[a, b], [b, d]]``: ``(C, 2, 2)``, what :func:`solve_2x2` reads (fixed
    between refreshes for one damping)."""
    a = fisher[:, 0, 0] + damping
    b = fisher[:, 0, 1]
    d = fisher[:, 1, 1] + damping
    det = a * d - b * b
    rows = torch.stack([d, -b, -b, a], dim=-1).view(-1, 2, 2)
    return rows / det[:, None, None]


def solve_2x2(inverse: Tensor, grad: Tensor) -> Tensor:
    """``inverse_c grad_c`` for every channel (``(C, 2, 2)`` and ``(C, 2)``): one product
    and one sum of pairs (a GPU step is launches)."""
    return (inverse * grad.unsqueeze(-2)).sum(dim=-1)


def damped_inverse(fisher: Tensor, damping: float) -> Tensor:
    """``(F_c + λ I)^{-1}`` of every unit, ``(C, d, d)``: :func:`damped_inverse_2x2` for
    ``d = 2``; otherwise a batched Cholesky factorisation (``cholesky_ex``: no host read)
    and its inverse, with ``I / (λ + tr F_c)`` for a unit whose factorisation failed or
    whose inverse is not finite (a symmetric positive definite stand-in, never a NaN)."""
    dim = fisher.shape[-1]
    if dim == 2:
        return damped_inverse_2x2(fisher, damping)
    if fisher.dtype not in (torch.float32, torch.float64):  # no half-precision Cholesky
        return damped_inverse(fisher.float(), damping).to(fisher.dtype)
    eye = torch.eye(dim, dtype=fisher.dtype, device=fisher.device)
    factor, info = torch.linalg.cholesky_ex(fisher + damping * eye)
    inverse = torch.cholesky_inverse(factor)
    good = (info == 0) & torch.isfinite(inverse).flatten(1).all(dim=1)
    trace = fisher.diagonal(dim1=1, dim2=2).sum(dim=1).abs().nan_to_num(0.0, 0.0, 0.0)
    fallback = eye / (damping + trace)[:, None, None]
    return torch.where(good[:, None, None], inverse, fallback)


def solve_units(inverse: Tensor, grad: Tensor) -> Tensor:
    """``inverse_c grad_c`` for every unit (``(C, d, d)`` and ``(C, d)``): :func:`solve_2x2`
    for ``d = 2``, one batched matrix-vector product otherwise."""
    if inverse.shape[-1] == 2:
        return solve_2x2(inverse, grad)
    return torch.bmm(inverse, grad.unsqueeze(-1)).squeeze(-1)


class UnitwiseSolver(Solver):
    """Per-unit damped solve: state ``fisher`` of shape ``(C, d, d)`` (module notes)."""

    name = "unitwise"

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Not a Kronecker solver: use :meth:`compute_statistics` with ``{"F": ...}``."""
        raise TypeError("UnitwiseSolver takes the unit-wise statistic 'F', not an (A, G) pair")

    def compute_statistics(
        self, stats: Mapping[str, Any], damping: float, previous: SolverState | None = None
    ) -> SolverState:
        """Keeps a symmetrised copy of the running per-unit Fisher (a non-finite one is
        refused where :attr:`~dkfac.solvers.base.Solver.host_checks` holds)."""
        fisher = stats["F"]
        if self.host_checks and not bool(torch.isfinite(fisher).all()):
            raise SolverError("unitwise: non-finite unit-wise Fisher")
        return {"fisher": ((fisher + fisher.transpose(1, 2)) / 2).clone()}

    def refresh_key(
        self, stats: Mapping[str, Any], previous: SolverState | None
    ) -> tuple[Any, ...] | None:
        """The class, the unit size and the Fisher's dtype and device: any number of units
        of one size share :meth:`compute_batch`."""
        del previous
        fisher = stats["F"]
        if not isinstance(fisher, Tensor):
            return None
        return (type(self), fisher.shape[-1], fisher.dtype, fisher.device)

    def compute_batch(
        self,
        stats: Sequence[Mapping[str, Any]],
        damping: float,
        previous: Sequence[SolverState | None],
    ) -> list[SolverState | SolverError]:
        """:meth:`compute_statistics` of several layers as one pass over their concatenated
        channels (the same values; each state holds its rows of one buffer). A non-finite
        Fisher (one host read for the batch, where :attr:`host_checks` holds) is refused
        in its own layer only."""
        if len(stats) == 1:
            return super().compute_batch(stats, damping, previous)
        fishers = [one["F"] for one in stats]
        if self.host_checks:
            finite = torch.isfinite(torch.cat([f.reshape(-1) for f in fishers]))
            flags = torch.stack([part.all() for part in finite.split([f.numel() for f in fishers])])
            if not all(flags.tolist()):
                return super().compute_batch(stats, damping, previous)
        joined = torch.cat(fishers)
        symmetric = (joined + joined.transpose(1, 2)) / 2
        parts = symmetric.split([f.shape[0] for f in fishers])
        return [{"fisher": part} for part in parts]

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(compute_dtype)
        self._last: tuple[tuple[Tensor, ...], tuple[torch.dtype, float], Tensor] | None = None

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``(F_c + λ I)^{-1} grad_c`` for every unit."""
        return solve_units(self._inverse([state], grad.dtype, damping), grad)

    def _inverse(self, states: Sequence[SolverState], dtype: torch.dtype, damping: float) -> Tensor:
        """:func:`damped_inverse` of the states' Fishers (units concatenated) in ``dtype``:
        the last ones again while the states hold the very same Fishers (replaced at a
        refresh, never changed in place) for the same damping and dtype."""
        fishers = tuple(state["fisher"] for state in states)
        last = self._last
        if (
            last is not None
            and len(last[0]) == len(fishers)
            and all(a is b for a, b in zip(last[0], fishers, strict=True))
            and last[1] == (dtype, damping)
        ):
            return last[2]
        joined = fishers[0] if len(fishers) == 1 else torch.cat(fishers)
        inverse = damped_inverse(joined.to(dtype), damping)
        self._last = (fishers, (dtype, damping), inverse)
        return inverse

    def batch_key(self, state: SolverState, grad: Tensor) -> tuple[Any, ...] | None:
        """The class, the unit size, the gradient's dtype and device and the Fisher's dtype:
        any number of units of one size share a solve."""
        return (type(self), grad.shape[-1], grad.dtype, grad.device, state["fisher"].dtype)

    def apply_batch(
        self,
        states: Sequence[SolverState],
        moments: Sequence[SolverState | None],
        grads: Sequence[Tensor],
        damping: float,
        *,
        advance: Tensor | None = None,
    ) -> list[tuple[Tensor, SolverState | None]]:
        """:meth:`apply` of several layers as one solve over their concatenated units;
        each update is its layer's rows of the result."""
        if len(grads) == 1:
            return super().apply_batch(states, moments, grads, damping, advance=advance)
        inverse = self._inverse(states, grads[0].dtype, damping)
        solved = solve_units(inverse, torch.cat(list(grads)))
        updates = solved.split([grad.shape[0] for grad in grads])
        return list(zip(updates, moments, strict=True))
