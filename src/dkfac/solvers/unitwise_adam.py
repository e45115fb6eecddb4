"""Adam in each unit's eigenbasis: eigen-Adam for the blocks with a unit-wise Fisher.

A unit-wise block of a weight layer (a grouped or depthwise convolution's output channel,
:mod:`dkfac.blocks.grouped_conv`) feeds the statistic ``"F"`` of shape ``(C, d, d)``: the
per-sample Fisher of each unit's ``d`` parameters; its gradient matrix is ``(C, d)``. Under a
method with Adam's scale (``"eigen_adam"``, the default's) such a unit is preconditioned the
way eigen-Adam preconditions a Kronecker layer (:mod:`dkfac.solvers.eigen_moments`), with the
eigenbasis of its own Fisher in place of the Kronecker one (SOAP's update, a full basis per
unit)::

    F_c = Q_c Λ_c Q_cᵀ        r_c = Q_cᵀ g_c
    m ← β₁ m + (1−β₁) r        v ← β₂ v + (1−β₂) r∘r        t ← t + 1
    m̂ = m / (1−β₁ᵗ)  (Nesterov: (β₁ m + (1−β₁) r) / (1−β₁ᵗ⁺¹))       v̂ = v / (1−β₂ᵗ)
    V_c = Q_c [m̂ ⊘ (√v̂ + ε)]

with the moment options of :class:`~dkfac.solvers.moment_options.MomentOptions` (``beta1``,
``beta2``, ``eps``, ``nesterov``, ``bias_correction``, ``carry``); the damping is not used
(``ε`` plays its part). The basis is an ``eigh`` of every unit's Fisher at each refresh, and
the moments follow ``carry`` across it: ``"reset"`` restarts them, ``"keep_v"`` rotates ``m``
into the new basis (``P_c m_c`` with ``P_c = Q'_cᵀ Q_c``) and keeps ``v``, ``"rotate"`` also
carries ``v`` by ``P_c∘P_c``.

A Fisher from fewer samples than ``d`` has a null space, whose basis ``eigh`` leaves to the
rounding; Adam is not invariant to it, so that part of ``Q_c`` is the canonical one of
:mod:`dkfac.solvers.null_space`.

Measured on digits with ``benchmarks/probes/grouped_conv_digits.py`` (the results page):
Adam in the unit's eigenbasis took fewer steps than leaving the grouped convolutions to
Adam; the damped natural gradient of the unit-wise Fisher took more (the probe's JSON at the
tag ``tried-grouped-conv-unitwise``), and Adam on the unit's raw coordinates (the identity
for ``Q``) more still on the ConvNeXt-like model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.basis_refresh import descending_eigh
from dkfac.solvers.eigen_adam import EigenAdamSolver
from dkfac.solvers.moment_options import MomentOptions
from dkfac.solvers.null_space import canonical_null_basis
from dkfac.solvers.precision import moment_dtype

__all__ = ["UnitwiseAdamSolver"]


class UnitwiseAdamSolver(Solver):
    """Adam's moments in the eigenbasis of each unit's Fisher (module notes): state ``q``
    of shape ``(C, d, d)``, moments ``m``, ``v`` of the gradient's ``(C, d)`` and ``t``.

    Args:
        compute_dtype: Precision of the decompositions.
        options: The moment hyperparameters (defaults: :class:`MomentOptions`); the options
            of a Kronecker eigenbasis (``max_dim``, ``orthogonal_rms``...) do not apply.
    """

    name = "unitwise_adam"
    stateful = True
    adam_scaled = True
    apply_products: ClassVar[int] = 2

    def __init__(
        self, compute_dtype: torch.dtype = torch.float32, options: MomentOptions | None = None
    ) -> None:
        super().__init__(compute_dtype)
        # Adam's moment update and scaling, eigen_adam's own (it checks the options' type)
        self._adam = EigenAdamSolver(compute_dtype, options)

    @property
    def options(self) -> MomentOptions:
        """The moment hyperparameters (those of the eigen-Adam formulas it applies)."""
        return self._adam.options

    @classmethod
    def state_elements(cls, a_dim: int, g_dim: int) -> int:
        """A ``d × d`` basis per unit (``a_dim`` = ``d``, ``g_dim`` = the units)."""
        return g_dim * a_dim * a_dim

    @classmethod
    def moment_elements(cls, a_dim: int, g_dim: int) -> int:
        """``m`` and ``v`` (one entry a parameter) and the count ``t``."""
        return 2 * a_dim * g_dim + 1

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Not a Kronecker solver: use :meth:`compute_statistics` with ``{"F": ...}``."""
        raise TypeError("UnitwiseAdamSolver takes a unit-wise statistic 'F', not an (A, G) pair")

    def compute_statistics(
        self, stats: Mapping[str, Any], damping: float, previous: SolverState | None = None
    ) -> SolverState:
        """The eigenbasis of every unit's Fisher, its null space in the canonical basis of
        :func:`~dkfac.solvers.null_space.canonical_null_basis` (a Fisher from fewer samples
        than ``d``: rounding would otherwise pick that part of the basis, to which Adam is
        not invariant). A non-finite Fisher is refused where
        :attr:`~dkfac.solvers.base.Solver.host_checks` holds; a failed ``eigh`` is retried
        in float64, then refused."""
        del damping, previous
        fisher = stats["F"]
        if self.host_checks and not bool(torch.isfinite(fisher).all()):
            raise SolverError("unitwise_adam: non-finite unit-wise Fisher")

        def basis(dtype: torch.dtype) -> SolverState:
            values, vectors = descending_eigh(fisher, dtype, self.host_checks)
            _, q = canonical_null_basis(values, vectors, fisher.dtype, check=self.host_checks)
            return {"q": q.to(fisher.dtype)}

        return self.with_retry(basis)

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """The update from fresh moments (:meth:`apply_with_moments` with none)."""
        return self.apply_with_moments(state, None, grad, damping)[0]

    def apply_with_moments(
        self, state: SolverState, moments: SolverState | None, grad: Tensor, damping: float
    ) -> tuple[Tensor, SolverState]:
        """``(V, moments after this gradient)`` (module notes); ``None`` moments start from
        zero. The moments and their scaling are eigen-Adam's own
        (:meth:`~dkfac.solvers.eigen_adam.EigenAdamSolver.update_moments` and ``scaled``, on
        the ``(C, d)`` rotated gradient as on a layer's matrix, without a rounding floor),
        kept in float32 at least; the update is returned in ``grad``'s dtype."""
        work = moment_dtype(grad.dtype)
        q = state["q"].to(work)
        rotated = (q.mT @ grad.to(work).unsqueeze(-1)).squeeze(-1)
        if moments is None:
            moments = self.zero_moments_like(grad)
        new = self._adam.update_moments(moments, rotated)
        scaled = self._adam.scaled(new, rotated, damping)
        update = (q @ scaled.unsqueeze(-1)).squeeze(-1)
        return update.to(grad.dtype), new

    def zero_moments_like(self, grad: Tensor) -> SolverState:
        """Zero ``m`` and ``v`` of ``grad``'s shape (float32 at least) and ``t = 0``."""
        return self._adam.zero_moments_like(grad)

    def carry_moments(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> SolverState:
        """The moments in the basis ``new`` after a refresh from ``old`` (``carry``: module
        notes); kept as they are where the basis is the very same tensor."""
        if old is None or old["q"] is new["q"]:
            return moments
        if self.options.carry == "reset":
            return self.zero_moments_like(moments["m"])
        dtype = moments["m"].dtype
        transition = new["q"].to(dtype).mT @ old["q"].to(dtype)  # P_c = Q'_cᵀ Q_c
        carried = dict(moments)
        carried["m"] = (transition @ moments["m"].unsqueeze(-1)).squeeze(-1)
        if self.options.carry == "rotate":
            carried["v"] = ((transition * transition) @ moments["v"].unsqueeze(-1)).squeeze(-1)
        return carried
