"""Shared model, data and training loop of the strategy tests (serial and per rank).

The model has three K-FAC layers of different sizes and a LayerNorm, whose parameters
K-FAC does not precondition (so ``spngd`` must average their gradients itself). LayerNorm
normalises each sample on its own, so a sharded batch gives exactly the serial gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner

PER_RANK = 8
STEPS = 4
# Factor dims (a_dim with the bias column, g_dim) of the K-FAC layers, by module name.
DIMS = {"0": (2 * 9 + 1, 3), "3": (3 * 16 + 1, 6), "6": (6 + 1, 3)}
LAYERNORM_PARAMS = 6 + 6
OPTIONS: dict[str, Any] = {
    "inverse_update_interval": 2,
    "factor_decay": 0.9,
    "damping": 0.01,
    "kl_clip": 1e-3,
    "lr": 0.1,
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 16, 6),
        nn.LayerNorm(6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(PER_RANK * world_size, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (PER_RANK * world_size,), generator=gen)
    return x, y


def average_gradients(model: nn.Module, world_size: int) -> None:
    """What DDP would do: every parameter's gradient averaged over the ranks."""
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world_size


def train(
    rank: int,
    world_size: int,
    data_world: int,
    strategy: str,
    *,
    fraction: float = 1.0,
    ddp: bool = False,
    steps: int = STEPS,
    **options: Any,
) -> tuple[nn.Module, KFACPreconditioner]:
    """``steps`` SGD-momentum steps on this rank's shard of ``data_world`` ranks' batches.

    Without DDP and with a strategy that expects averaged gradients, the gradients are
    averaged by hand (an all-reduce) before ``pre.step()``.
    """
    model = make_model()
    wrapped: nn.Module = model
    if ddp:
        wrapped = nn.parallel.DistributedDataParallel(model)
    pre = KFACPreconditioner(
        wrapped, strategy=strategy, grad_worker_fraction=fraction, **{**OPTIONS, **options}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, data_world)
        size = x.shape[0] // world_size
        shard = slice(rank * size, (rank + 1) * size)
        opt.zero_grad()
        F.cross_entropy(wrapped(x[shard]), y[shard]).backward()
        if world_size > 1 and not ddp and strategy != "spngd":
            average_gradients(model, world_size)
        pre.step(lr=0.1)
        opt.step()
    return model, pre


def summary(model: nn.Module, pre: KFACPreconditioner) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": pre.comm_stats(),
        "memory": pre.memory_usage(),
        "describe": pre.describe(),
        "factors": {n: (a.clone(), g.clone()) for n, (a, g) in pre.factors().items()},
        "inverse_layers": sorted(n for n, s in pre.layers.items() if s.solver_state is not None),
    }
