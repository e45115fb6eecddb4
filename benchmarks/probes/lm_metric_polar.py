"""Probe: the polar factor in a norm weighted by K-FAC's eigenvalues (``dkfac bench lm``).

The recipe's update on an ``orthogonal_layers`` layer is ``polar(X)`` in the eigenbasis,
``X = m̂ ⊘ (√v̂ + ε)``: the factors' eigenvectors enter, their eigenvalues never do. With
``DKFAC_METRIC=P:D`` this probe takes instead the steepest-descent direction of ``⟨X, Δ⟩``
under the spectral norm of ``L Δ R`` (Muon's step is the unweighted one),
``U = L⁻¹ polar(L⁻¹ X R⁻¹) R⁻¹`` rescaled to the recipe's RMS, with the diagonal weights
``L = (d_G / mean(d_G) + D)^P`` and ``R`` likewise from ``d_A`` (the factors' eigenvalues
in the state, normalised to mean 1, plus a damping ``D``); ``P = 0`` is the recipe's
direction at an exact RMS. It replaces :func:`dkfac.solvers.polar.orthogonal_update` inside
the solver (:func:`~dkfac.solvers.polar.weighted_orthogonal_update` of ``W² ⊙ X`` with
``W = L⁻¹ ⊗ R⁻¹``). Measured in BENCHMARKS.md section 26 (``P = 0.25, D = 0.1``: no gain
per step); Adam's scale split around the polar factor, which did gain, is the library's
``orthogonal_split``.

    DKFAC_METRIC=0.25:0.1 python benchmarks/probes/lm_metric_polar.py --threads 1 \\
        --seeds 3 --first-seed 100 --no-sweep --seconds 115 --eval-every 25 \\
        --optimizers kfac --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml \\
        --name probe_kron
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor

from dkfac.bench import lm
from dkfac.solvers import eigen_moments
from dkfac.solvers.eigen_moments import EigenAdamSolver
from dkfac.solvers.polar import weighted_orthogonal_update


def _metric() -> tuple[float, float]:
    text = os.environ.get("DKFAC_METRIC", "")
    try:
        power, damping = (float(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"DKFAC_METRIC must read P:D (numbers), got {text!r}") from None
    return power, damping


POWER, DAMPING = _metric()
_ORIGINAL = EigenAdamSolver.apply_with_moments
_STATE: dict[str, Any] = {}
"""The state of the layer (or stack) being applied, for the patched polar step."""


def _weight(values: Tensor, like: Tensor, dim: int) -> Tensor:
    """``(d / mean(d) + D)^P`` shaped to scale ``like`` along ``dim`` (1 if one-sided)."""
    if values.numel() == 0:
        return torch.ones((), dtype=like.dtype, device=like.device)
    d = values.to(like.dtype).clamp(min=0)
    w = (d / d.mean(-1, keepdim=True).clamp(min=1e-30) + DAMPING).pow(POWER)
    shape = [*w.shape[:-1], 1, 1]
    shape[dim] = like.shape[dim]
    return w.reshape(shape)


def metric_update(update: Tensor, rms: float, steps: int) -> Tensor:
    """``L⁻¹ polar(L⁻¹ X R⁻¹) R⁻¹`` at RMS ``rms`` (module notes)."""
    state = _STATE["state"]
    inverse = 1.0 / (_weight(state["dg"], update, -2) * _weight(state["da"], update, -1))
    return weighted_orthogonal_update(update * inverse.square(), inverse, rms, steps)


def apply_with_moments(self, state, moments, grad, damping):  # type: ignore[no-untyped-def]
    """The solver's own apply, its state kept for :func:`metric_update`."""
    _STATE["state"] = state
    return _ORIGINAL(self, state, moments, grad, damping)


if __name__ == "__main__":
    torch.set_num_threads(1)
    EigenAdamSolver.apply_with_moments = apply_with_moments  # type: ignore[method-assign]
    eigen_moments.orthogonal_update = metric_update  # type: ignore[assignment]
    sys.exit(lm.main(sys.argv[1:]))
