"""Shared model and data of the strategy tests, trained by tests/serial_vs_distributed.py.

The model has three K-FAC layers of different sizes and a LayerNorm, whose parameters
K-FAC does not precondition (so ``spngd`` must average their gradients itself). LayerNorm
normalises each sample on its own, so a sharded batch gives exactly the serial gradients.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from tests.serial_vs_distributed import Run, train_sharded

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
}  # lr 0.1 for SGD and pre.step: train_sharded's default


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


def make_bn_model() -> nn.Module:
    """:func:`make_model` with BatchNorm2d(3) after the convolution and BatchNorm1d(6) after
    the hidden Linear (affine: unit-wise blocks) in place of the LayerNorm."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 16, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def make_grouped_model() -> nn.Module:
    """:func:`make_model` with a depthwise 3×3 convolution (unit-wise, 10 parameters per
    channel) after the first one and a grouped 1×1 (groups=3, 2 per channel, no bias)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Conv2d(3, 3, 3, padding=1, groups=3),
        nn.Tanh(),
        nn.Conv2d(3, 6, 1, groups=3, bias=False),
        nn.Flatten(),
        nn.Linear(6 * 16, 6),
        nn.LayerNorm(6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(PER_RANK * world_size, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (PER_RANK * world_size,), generator=gen)
    return x, y


def serial_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One cross-entropy step of ``opt`` on ``global_batch(step, 1)``."""
    x, y = global_batch(step, 1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def train(
    rank: int | None,
    world: int,
    strategy: str,
    *,
    fraction: float = 1.0,
    ddp: bool = False,
    steps: int = STEPS,
    **options: Any,
) -> Run:
    """``steps`` SGD-momentum steps of :func:`make_model` on ``global_batch(step, world)``.

    ``rank`` trains its shard; ``rank=None`` is the serial twin on the whole batch (see
    :func:`tests.serial_vs_distributed.train_sharded` for who averages the gradients).
    """
    return train_sharded(
        rank,
        world,
        model_fn=make_model,
        batch_fn=functools.partial(global_batch, world_size=world),
        steps=steps,
        ddp=ddp,
        strategy=strategy,
        grad_worker_fraction=fraction,
        **{**OPTIONS, **options},
    )


def summary(run: Run) -> dict[str, Any]:
    """What the strategy tests compare: parameters, ledger, memory, placement, statistics."""
    pre = run.pre
    return {
        "params": run.params(),
        "stats": pre.comm_stats(),
        "memory": pre.memory_usage(),
        "describe": pre.describe(),
        "factors": run.factors(),
        "inverse_layers": sorted(n for n, s in pre.layers.items() if s.solver_state is not None),
    }
