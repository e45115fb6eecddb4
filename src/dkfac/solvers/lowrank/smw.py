"""Sherman–Morrison–Woodbury (SKFAC) preconditioning of low-rank Kronecker factors.

For a factor ``A = U Uᵀ`` with ``U`` of shape ``d × m`` and ``m < d``,

    (A + γI)^{-1} X = (1/γ) [X − U (γ I_m + UᵀU)^{-1} (Uᵀ X)],

so an inverse update costs one ``m × m`` Gram matrix (``2dm²`` flops) and one ``m × m``
Cholesky inverse, and no ``d × d`` matrix is ever formed. Damping is factored with the
π-correction exactly as in :mod:`dkfac.solvers.cholesky`:
``V = (G + (√λ/π) I)^{-1} ∇W (A + π√λ I)^{-1}`` with ``π = sqrt((tr A/dim A)/(tr G/dim G))``,
and ``tr(U Uᵀ) = ‖U‖_F²``. A factor with ``m >= d`` gains nothing from SMW and falls back to
the dense damped inverse (formed from ``U Uᵀ``, which then costs no more than ``U`` itself).

Interface (how the preconditioner uses it):

* ``SMWSolver.compute(a, g, damping)`` takes each factor either as a dense ``d × d`` tensor
  or as a :class:`~dkfac.solvers.lowrank.factor.LowRank` ``U``; ``Solver.accepts_lowrank`` is
  ``True`` for this solver. For each side ``s`` in ``("a", "g")`` the state holds either

  - ``s_u`` (``d × m``), ``s_core = (γ I_m + UᵀU)^{-1} / γ`` (``m × m``) and
    ``s_inv_gamma = 1/γ`` (0-d tensor, so applying never synchronises a device), or
  - ``s_inv = (F + γI)^{-1}`` (``d × d``, dense fallback or a dense input).

  Damping is fixed at compute time (like the Cholesky solver).
* ``SMWSolver.apply(state, grad, damping)`` returns ``G_damped^{-1} ∇W A_damped^{-1}`` for a
  ``g_dim × a_dim`` gradient matrix in ``O(g_dim · a_dim · m)`` flops on the low-rank sides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverState
from dkfac.solvers.cholesky import damped_inverse
from dkfac.solvers.lowrank.factor import LowRank, LowRankStatistic
from dkfac.solvers.statistics import DenseStatistic, StatisticKind

Factor = Tensor | LowRank


def factor_dim(factor: Factor) -> int:
    """``d`` of a dense ``d × d`` factor or of a low-rank ``U``."""
    return factor.dim if isinstance(factor, LowRank) else int(factor.shape[0])


def factor_trace(factor: Factor) -> float:
    """``tr F`` (``‖U‖_F²`` for a low-rank factor; no ``d × d`` matrix is formed)."""
    return factor.trace() if isinstance(factor, LowRank) else float(torch.trace(factor))


def lowrank_pi_correction(a: Factor, g: Factor) -> float:
    """``π = sqrt((tr A / dim A) / (tr G / dim G))``; 1 when either trace is not positive."""
    mean_a = factor_trace(a) / factor_dim(a)
    mean_g = factor_trace(g) / factor_dim(g)
    if mean_a <= 0 or mean_g <= 0 or not math.isfinite(mean_a / mean_g):
        return 1.0
    return math.sqrt(mean_a / mean_g)


def _check_factor(name: str, factor: object) -> None:
    if isinstance(factor, LowRank):
        return
    if not isinstance(factor, Tensor):
        raise TypeError(f"{name} must be a Tensor or a LowRank, got {type(factor).__name__}")
    if factor.dim() != 2 or factor.shape[0] != factor.shape[1] or factor.shape[0] == 0:
        raise ValueError(f"{name} must be a square (d, d) matrix, got {tuple(factor.shape)}")


def smw_core(u: Tensor, gamma: float, dtype: torch.dtype) -> Tensor:
    """``(γ I_m + UᵀU)^{-1}`` through a Cholesky factorisation in ``dtype``."""
    work = u.to(dtype)
    return damped_inverse(work.T @ work, gamma, dtype)


def smw_solve_left(u: Tensor, scaled_core: Tensor, inv_gamma: Tensor, x: Tensor) -> Tensor:
    """``(U Uᵀ + γI)^{-1} X = X/γ − U [core/γ] (Uᵀ X)`` for ``X`` of shape ``(d, n)``.

    ``scaled_core`` is ``(γ I_m + UᵀU)^{-1} / γ`` and ``inv_gamma`` is ``1/γ``.
    """
    return x * inv_gamma - u @ (scaled_core @ (u.T @ x))


def smw_solve_right(u: Tensor, scaled_core: Tensor, inv_gamma: Tensor, x: Tensor) -> Tensor:
    """``X (U Uᵀ + γI)^{-1} = X/γ − ((X U) [core/γ]) Uᵀ`` for ``X`` of shape ``(n, d)``."""
    return x * inv_gamma - ((x @ u) @ scaled_core) @ u.T


class SMWSolver(Solver):
    """Low-rank SMW solver with factored π-damping (SKFAC); dense fallback per factor.

    Args:
        compute_dtype: Precision of the factorisations.
        lowrank_sides: Statistic name (``"A"``, ``"G"``) -> bounded rank, for the sides
            kept as ``U`` (:class:`~dkfac.solvers.lowrank.factor.LowRankStatistic`); the
            other sides are kept dense and inverted by Cholesky.
    """

    name = "smw"
    fixed_size_state = False
    accepts_lowrank = True

    def __init__(
        self,
        compute_dtype: torch.dtype = torch.float32,
        lowrank_sides: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(compute_dtype)
        self.lowrank_sides = dict(lowrank_sides or {})

    @property
    def label(self) -> str:
        """``smw(A=lowrank,G=dense)``: the kind of each side."""
        kinds = {key: "lowrank" if key in self.lowrank_sides else "dense" for key in ("A", "G")}
        return f"smw(A={kinds['A']},G={kinds['G']})"

    def statistics(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, StatisticKind]:
        """Low-rank sides as ``U`` with their bounded rank, the others dense."""
        return {
            key: LowRankStatistic(self.lowrank_sides[key])
            if key in self.lowrank_sides
            else DenseStatistic()
            for key in shapes
        }

    def decision(self) -> dict[str, Any]:
        """``{"solver": "smw", "lowrank": {side: bounded rank}}``."""
        return {"solver": self.name, "lowrank": dict(self.lowrank_sides)}

    def compute(self, a: Factor, g: Factor, damping: float) -> SolverState:
        """Builds the per-side state (see the module docstring) for damping ``λ``.

        Args:
            a: The input factor: dense ``(a_dim, a_dim)`` or ``LowRank`` with ``U`` of
                shape ``(a_dim, m_a)``.
            g: The output-gradient factor, likewise.
            damping: ``λ > 0``.

        Raises:
            ValueError: For a non-positive damping or a malformed factor.
            SolverError: If the factorisations fail even in float64.
        """
        if not damping > 0 or not math.isfinite(damping):
            raise ValueError(f"damping must be a finite number > 0, got {damping!r}")
        _check_factor("a", a)
        _check_factor("g", g)
        pi = lowrank_pi_correction(a, g)
        root = math.sqrt(damping)
        gammas = {"a": pi * root, "g": root / pi}
        factors = {"a": a, "g": g}

        def run(dtype: torch.dtype) -> SolverState:
            state: SolverState = {}
            for side, factor in factors.items():
                gamma = gammas[side]
                if isinstance(factor, LowRank) and factor.rank < factor.dim:
                    storage = factor.u.dtype
                    state[f"{side}_u"] = factor.u.contiguous()
                    core = smw_core(factor.u, gamma, dtype) / gamma
                    state[f"{side}_core"] = core.to(storage)
                    state[f"{side}_inv_gamma"] = torch.tensor(
                        1.0 / gamma, dtype=storage, device=factor.u.device
                    )
                else:
                    dense = factor.dense() if isinstance(factor, LowRank) else factor
                    state[f"{side}_inv"] = damped_inverse(dense, gamma, dtype).to(dense.dtype)
            return state

        return self.with_retry(run)

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """``(G + γ_G I)^{-1} ∇W (A + γ_A I)^{-1}`` (damping was fixed at compute time)."""
        dtype = grad.dtype
        if "g_inv" in state:
            out = state["g_inv"].to(dtype) @ grad
        else:
            g_u, g_core, g_ig = (state[k].to(dtype) for k in ("g_u", "g_core", "g_inv_gamma"))
            out = smw_solve_left(g_u, g_core, g_ig, grad)
        if "a_inv" in state:
            return out @ state["a_inv"].to(dtype)
        a_u, a_core, a_ig = (state[k].to(dtype) for k in ("a_u", "a_core", "a_inv_gamma"))
        return smw_solve_right(a_u, a_core, a_ig, out)

    @staticmethod
    def is_lowrank_side(state: SolverState, side: str) -> bool:
        """Whether side ``"a"`` or ``"g"`` of ``state`` took the low-rank path."""
        if side not in ("a", "g"):
            raise ValueError(f"side must be 'a' or 'g', got {side!r}")
        return f"{side}_u" in state
