"""Probe: the parameters K-FAC leaves to the inner SGD get Adam's direction instead.

``dkfac bench lm`` with every K-FAC optimizer wrapped so that, before its step, the gradient
of each parameter no registered layer takes (the GPT's 18 LayerNorm weights and biases,
2304 numbers) is replaced by Adam's direction ``m̂ / (√v̂ + 1e-8)`` (β = 0.9, 0.999, bias
corrected) times ``DKFAC_LEFT_SCALE`` (default 0.5): the inner SGD at the recipe's lr 0.006
then moves them as Adam at lr 0.003 would, Muon's AdamW part's rate. Under ``eigen_adam``
those parameters otherwise get plain SGD steps at that lr, i.e. hardly move.

Measured (BENCHMARKS.md section 20, ``benchmarks/results/lm_block_tuning.json``): 0.00-0.02
lower loss per step at 100 and 125 steps on seeds 100-102, within the seeds' spread; not
built into the library.

    DKFAC_LEFT_SCALE=0.5 python benchmarks/probes/lm_leftover_adam.py --threads 1 --seeds 3 \\
        --first-seed 100 --no-sweep --seconds 60 --eval-every 25 --optimizers kfac \\
        --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml --name probe_left05
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.bench import lm, peers
from dkfac.optimizer import KFACOptimizer

SCALE = float(os.environ.get("DKFAC_LEFT_SCALE", "0.5"))
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
_build = peers.build_optimizer


class LeftoverAdam:
    """``optimizer`` whose step first turns the leftover parameters' gradients into Adam's."""

    def __init__(self, optimizer: KFACOptimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        taken = {
            id(p)
            for layer in optimizer.preconditioner.layers.values()
            for p in layer.block.parameters()
        }
        self.left = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
        self.moments = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in self.left}
        self.steps = 0

    @property
    def preconditioner(self) -> Any:
        """The wrapped optimizer's preconditioner (the bench's Monte-Carlo path reads it)."""
        return self.optimizer.preconditioner

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every gradient."""
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """Adam's direction into the leftover gradients, then the K-FAC step."""
        self.steps += 1
        c1, c2 = 1 - BETA1**self.steps, 1 - BETA2**self.steps
        for param in self.left:
            grad: Tensor | None = param.grad
            if grad is None:
                continue
            m, v = self.moments[id(param)]
            m.lerp_(grad, 1 - BETA1)
            v.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
            grad.copy_((m / c1) / ((v / c2).sqrt() + EPS) * SCALE)
        self.optimizer.step()


def build(spec: peers.OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Any:
    """The bench's optimizer, K-FAC ones wrapped."""
    optimizer = _build(spec, model, lr, momentum)
    if isinstance(optimizer, KFACOptimizer):
        return LeftoverAdam(optimizer, model)
    return optimizer


if __name__ == "__main__":
    torch.set_num_threads(1)
    lm.build_optimizer = build  # type: ignore[assignment]
    sys.exit(lm.main(sys.argv[1:]))
