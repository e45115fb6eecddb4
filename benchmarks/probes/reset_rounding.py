"""Rounding through Adam's restarts at the basis refreshes of ``for_model(overhead=None)``.

Under ``moment_carry="reset"`` (for_model's) each refresh restarts Adam's moments, and the
first step after it is nearly the sign of each rotated coordinate, so a coordinate whose
gradient is near ``moment_eps`` takes its sign from the rounding. Two serial runs that sum
the same 4 micro-batches in opposite orders (what a 4-rank run differs by from its serial
twin) are compared step by step, with a basis every 5 steps, under ``"reset"`` and under
``"rotate"`` (the moments carried into the new basis).

    PYTHONPATH=src python benchmarks/probes/reset_rounding.py
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer

SHOWN = (0, 4, 5, 9, 10, 14, 15, 19, 20, 24, 25, 29, 30, 34, 35, 39, 40, 44)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(129, 129), nn.Tanh(), nn.Linear(129, 129), nn.Tanh(), nn.Linear(129, 7)
    ).double()


def _run(order: list[int], steps: int, **options: str) -> list[torch.Tensor]:
    """The weights after each step, the 4 micro-batches of a step summed in ``order``."""
    model = _model()
    opt = KFACOptimizer.for_model(model, lr=3e-3, overhead=None, accumulation_steps=4, **options)
    weights = []
    for step in range(steps):
        opt.zero_grad()
        for part in order:  # micro-batch ``part``: one rank's shard of the global batch
            gen = torch.Generator().manual_seed(1000 * step + part)
            x = torch.randn(16, 129, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 7, (16,), generator=gen)
            (F.cross_entropy(model(x), y) / 4).backward()
        opt.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return weights


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    for carry in ("reset", "rotate"):
        one = _run([0, 1, 2, 3], 45, moment_carry=carry)
        other = _run([3, 2, 1, 0], 45, moment_carry=carry)
        gaps = [float((a - b).abs().max()) for a, b in zip(one, other, strict=True)]
        shown = "  ".join(f"{step}:{gaps[step]:.1e}" for step in SHOWN)
        logging.info("moment_carry=%r, step: max|w(0123) - w(3210)|  %s", carry, shown)


if __name__ == "__main__":
    main()
