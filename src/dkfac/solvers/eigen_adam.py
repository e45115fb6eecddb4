"""``"eigen_adam"``: Adam's moments in the Kronecker eigenbasis.

The formulas, the rounding floor in null directions and how the rotations run are in
:mod:`dkfac.solvers.eigen_moments` (the module notes); this module holds the method's own
moment update and scaling.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dkfac.solvers.base import SolverState
from dkfac.solvers.eigen_moments import EigenMomentsSolver
from dkfac.solvers.flat_moments import LayerIndex
from dkfac.solvers.null_space import flat_rounding_floor, rounding_floor

__all__ = ["EigenAdamSolver"]


def _root(value: Tensor | float) -> Tensor | float:
    """The square root of a correction (:meth:`EigenMomentsSolver.correction`), a tensor's
    or a number's."""
    return math.sqrt(value) if isinstance(value, float) else value.sqrt()


class EigenAdamSolver(EigenMomentsSolver):
    """Adam's moments in the Kronecker eigenbasis: moments ``m, v, t``
    (:mod:`~dkfac.solvers.eigen_moments`)."""

    name = "eigen_adam"
    keys = ("m", "v")
    adam_scaled = True
    reads_damping = False

    def update_moments(self, moments: SolverState, rotated: Tensor) -> SolverState:
        """``m ← β₁ m + (1−β₁) R``, ``v ← β₂ v + (1−β₂) R∘R``, ``t ← t + 1``."""
        beta1 = self.options.beta1
        new = super().update_moments(moments, rotated)
        new["m"] = (moments["m"].to(rotated.dtype) * beta1).add_(rotated, alpha=1.0 - beta1)
        return new

    def scaled(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        *,
        null: Tensor | None = None,
        layers: LayerIndex | None = None,
    ) -> Tensor:
        """``m̂ ⊘ (√v̂ + ε + φ)`` (Nesterov: the look-ahead ``m̂``; ``φ`` the rounding floor in
        ``null`` coordinates, :mod:`~dkfac.solvers.null_space`), computed as ``(√c₂ / c₁) · m ⊘
        (√v + ε√c₂)`` with ``c = 1 − βᵗ``: the same value in four elementwise passes instead
        of five, two of them in place."""
        del damping
        beta1, nesterov = self.options.beta1, self.options.nesterov
        m = moments["m"]
        if nesterov:
            m = (m * beta1).add_(rotated, alpha=1.0 - beta1)
        c1 = self.correction(beta1, moments["t"], m, ahead=1.0 if nesterov else 0.0)
        root_c2 = _root(self.correction(self.options.beta2, moments["t"], m))
        denominator = self._floored_root(moments["v"], root_c2 * self.options.eps, null, layers)
        return torch.div(m, denominator).mul_(root_c2 / c1)

    def _floored_root(
        self,
        v: Tensor,
        eps: Tensor | float,
        null: Tensor | None,
        layers: LayerIndex | None = None,
    ) -> Tensor:
        """``√v + ε + φ``, ``φ = rounding_floor · ‖√v‖_F`` on the ``null`` coordinates (of
        each matrix of ``v``, or of each layer of a flat ``v`` with ``layers``)."""
        if null is None:
            return v.sqrt().add_(eps)
        relative = self.options.rounding_floor
        if layers is None:
            floor = rounding_floor(v, relative)
        else:
            floor = flat_rounding_floor(v, layers.sizes, layers.entries, relative)
        return v.sqrt().add_(floor.mul(null).add_(eps))

    def denominator(self, moments: SolverState, damping: float) -> Tensor:
        """``√v̂ + ε``."""
        del damping
        c2 = self.correction(self.options.beta2, moments["t"], moments["v"])
        return torch.div(moments["v"], c2).sqrt_().add_(self.options.eps)

    def split_parts(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        split: float,
        *,
        null: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``V ⊘ W = m̂ ⊙ D^(S-1)`` and ``W = D^-S`` (``W`` up to a constant per matrix,
        which the weighted polar factor drops) from ``d = √v + ε√c₂ = √c₂ · D``:
        ``m̂ ⊙ D^(S-1) = k · m ⊙ d^(S-1)`` with ``k = (√c₂)^(1-S) / c₁`` folded into the
        look-ahead, ``W ∝ d^-S``. Six elementwise passes instead of eleven, one root instead
        of two (``S = ½``: ``d^(S-1) = d^-S = 1 / √d``)."""
        del damping
        beta1, t = self.options.beta1, moments["t"]
        like = moments["m"]
        root_c2 = _root(self.correction(self.options.beta2, t, like))
        c1 = self.correction(beta1, t, like, ahead=1.0 if self.options.nesterov else 0.0)
        k = root_c2 ** (1.0 - split) / c1
        if self.options.nesterov and isinstance(k, float):
            m = (like * (k * beta1)).add_(rotated, alpha=k * (1.0 - beta1))
        elif self.options.nesterov:
            m = (like * (k * beta1)).addcmul_(rotated, k, value=1.0 - beta1)
        else:
            m = like * k
        d = self._floored_root(moments["v"], root_c2 * self.options.eps, null)
        if split == 0.5:
            weight = d.rsqrt_()
            return m.mul_(weight), weight
        weight = d.pow(-split)
        return m.mul_(d.pow_(split - 1.0)), weight
