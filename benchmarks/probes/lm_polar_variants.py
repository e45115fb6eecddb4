"""Probe: ``dkfac bench lm`` with another Newton–Schulz iteration or update scale.

``DKFAC_POLAR`` picks the patch of :mod:`dkfac.solvers.polar` / the eigenbasis solvers:

- ``minimax``: per-step coefficients instead of Muon's fixed ``(a, b, c)``. Step ``i``'s odd
  quintic ``p(x) = a x + b x³ + c x⁵`` minimises ``max |1 − p(x)|`` over the interval the
  singular values occupy before it (a linear programme on a grid, solved here with scipy),
  starting from ``[DKFAC_POLAR_LOW, 1]`` (default 2e-3, the band of Muon's coefficients);
  the next interval is ``[1 − e, 1 + e]`` for the error ``e`` reached. With the default, four
  steps put ``[2e-3, 1]`` into [0.68, 1.32] (Muon's five: [0.68, 1.20]) and five into
  [0.98, 1.02]. The recipe's ``orthogonal-steps`` sets how many are taken.
- ``muon_scale``: the update of an ``m × n`` matrix scaled as ``torch.optim.Muon``'s default
  (``√max(1, m/n)`` per unit of lr, times a constant) instead of to an RMS entry: a wide
  matrix (``m < n``: the MLP's output projection, 128 × 513) then steps by half as much
  as now relative to the others; the recipe's ``orthogonal-rms`` is kept for the square
  and tall ones.

Measured (BENCHMARKS.md section 23, seeds 100–102, loss after 50 / 100 / 125 steps, beside
another probe; the recipe 2.49 / 2.21 / 2.03): ``minimax`` with four steps 2.49 / 2.20 /
2.06 (as Muon's coefficients with four steps: 2.47 / 2.21 / 2.06), with five 2.48 / 2.18 /
2.04; ``muon_scale`` 2.51 / 2.23 / 2.05. None kept.

    DKFAC_POLAR=minimax python benchmarks/probes/lm_polar_variants.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 80 --eval-every 25 --optimizers kfac \\
        --recipe benchmarks/recipes/gpt-text.toml --name probe_minimax5
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from scipy.optimize import linprog
from torch import Tensor

import dkfac.solvers.eigen_moments as eigen_moments
import dkfac.solvers.polar as polar
from dkfac.bench import lm

MAX_STEPS = 8


def minimax_step(low: float, high: float, points: int = 4000) -> tuple[tuple[float, ...], float]:
    """``((a, b, c), e)``: the odd quintic nearest 1 on ``[low, high]`` in the max norm."""
    x = np.concatenate([np.geomspace(low, high, points), np.linspace(low, high, points)])
    powers = np.stack([x, x**3, x**5], axis=1)
    ones = np.ones((len(x), 1))
    # variables (a, b, c, e): minimise e subject to |1 − p(x)| <= e on the grid
    constraints = np.block([[-powers, -ones], [powers, -ones]])
    bounds = np.concatenate([-np.ones(len(x)), np.ones(len(x))])
    result = linprog(
        [0, 0, 0, 1], A_ub=constraints, b_ub=bounds, bounds=[(None, None)] * 3 + [(0, None)]
    )
    a, b, c, error = result.x
    return (float(a), float(b), float(c)), float(error)


def minimax_coefficients(low: float, steps: int) -> list[tuple[float, ...]]:
    """Each step's coefficients, from ``[low, 1]`` (module notes)."""
    coefficients, interval = [], (low, 1.0)
    for _ in range(steps):
        step, error = minimax_step(*interval)
        coefficients.append(step)
        interval = (1.0 - error, 1.0 + error)
    return coefficients


COEFFICIENTS = minimax_coefficients(float(os.environ.get("DKFAC_POLAR_LOW", "2e-3")), MAX_STEPS)


def minimax_newton_schulz(
    matrix: Tensor, steps: int = polar.NS_STEPS, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """:func:`dkfac.solvers.polar.newton_schulz` with :data:`COEFFICIENTS`."""
    tall = matrix.shape[-2] > matrix.shape[-1]
    x = (matrix.mT if tall else matrix).to(dtype)
    norm = torch.linalg.matrix_norm(x.to(torch.promote_types(dtype, torch.float32)), keepdim=True)
    x = x / (norm.to(dtype) + polar.NORM_EPS)
    fused = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in COEFFICIENTS[:steps]:
        gram = x @ x.mT
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(matrix.dtype)


def patch(kind: str) -> None:
    """Applies the patch named ``kind`` (module notes)."""
    if kind == "minimax":
        polar.newton_schulz = minimax_newton_schulz  # orthogonal_update looks it up there
    elif kind == "muon_scale":
        plain = eigen_moments.orthogonal_update

        def muon_scaled(update: Tensor, rms: float, steps: int = polar.NS_STEPS) -> Tensor:
            rows, cols = update.shape[-2:]
            return plain(update, rms * min(1.0, (rows / cols) ** 0.5), steps)

        eigen_moments.orthogonal_update = muon_scaled  # type: ignore[assignment]
    else:
        raise SystemExit(f"DKFAC_POLAR must be minimax or muon_scale, got {kind!r}")


if __name__ == "__main__":
    patch(os.environ.get("DKFAC_POLAR", ""))
    sys.exit(lm.main(sys.argv[1:]))
