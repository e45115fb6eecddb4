"""Probe: eigen_adam's update orthogonalised per layer (Muon's Newton–Schulz), on the LM.

``dkfac bench lm`` with every eigenbasis-moment solver patched so that the update it
returns for a hidden layer, ``U = Q_G [m̂ ⊘ (√v̂ + ε)] Q_Aᵀ``, is replaced by
``scale · √max(1, g/a) · NS₅(U)``: five bf16 Newton–Schulz steps towards the orthogonal
polar factor of ``U`` (the iteration and coefficients ``torch.optim.Muon`` uses), sized like
a Muon update. ``scale`` (``DKFAC_PROBE_SCALE``, default 16.7 ≈ 0.05 / 0.003) turns the
recipe's lr 0.003 into Muon's 0.05 for those layers. The token embedding and the head keep
eigen_adam's own update (picked by shape: 128 × 256 and 256 × 128, as Muon leaves those to
AdamW). Orthogonalising the raw momentum would be Muon itself (the polar factor does not
depend on the basis); the second moment in K-FAC's eigenbasis is what changes the direction.

Not in the library: a probe. Every K-FAC entry of the run is patched (the recipe's too).
Superseded by the library's ``orthogonal_layers`` / ``orthogonal_rms`` options (BENCHMARKS.md
§15), which the recipe ``benchmarks/recipes/gpt-text.toml`` now uses; this script keeps the
probe of §14 reproducible (run it with a recipe without those options).

    DKFAC_PROBE_SCALE=16.7 python benchmarks/probes/lm_orthogonal_eigen_adam.py \\
        --threads 1 --seeds 1 --no-sweep --seconds 30 --eval-every 25 --optimizers muon kfac \\
        --muon-lrs 0.05 --kfac-lrs 0.003 --recipe benchmarks/recipes/gpt-text.toml \\
        --name lm_probe_orthogonal_eigen_adam      # --seeds 2 for the figures below

Measured 2026-11-25 with ``--seeds 2`` (BENCHMARKS.md §14,
``benchmarks/results/lm_probe_orthogonal_eigen_adam.json``): validation loss after 50 steps
2.52 / 2.53 (seeds 0 / 1) against Muon's 2.54 / 2.54 and the unpatched recipe's 2.79
(seed 0, ``lm_probe_30s_v3.json``); after 30 s 2.43 / 2.43 against Muon's 2.27 / 2.28, its
steps costing 0.52 s against Muon's 0.36 s.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from dkfac.bench.lm import main
from dkfac.solvers.base import SolverState
from dkfac.solvers.eigen_moments import EigenMomentsSolver

SCALE = float(os.environ.get("DKFAC_PROBE_SCALE", "16.7"))
LEFT_ALONE = {(128, 256), (256, 128)}  # the token embedding and the head of the 4x128 GPT
_apply = EigenMomentsSolver.apply_with_moments


def newton_schulz(update: Tensor, steps: int = 5) -> Tensor:
    """Muon's quintic Newton–Schulz iteration towards the polar factor, in bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def orthogonal_apply(
    self: EigenMomentsSolver,
    state: SolverState,
    moments: SolverState | None,
    grad: Tensor,
    damping: float,
) -> tuple[Tensor, SolverState]:
    """eigen_adam's update, orthogonalised and sized like Muon's for a hidden layer."""
    update, new = _apply(self, state, moments, grad, damping)
    rows, cols = update.shape
    if (rows, cols) in LEFT_ALONE:
        return update, new
    return SCALE * max(1.0, rows / cols) ** 0.5 * newton_schulz(update), new


if __name__ == "__main__":
    torch.set_num_threads(1)
    EigenMomentsSolver.apply_with_moments = orthogonal_apply  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
