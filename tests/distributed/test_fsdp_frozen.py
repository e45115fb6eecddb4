"""A frozen bias of a sharded model (``fully_shard``) stays as it is while its layer's weight
trains, as in the serial run: the sharded layout's stand-in for a frozen parameter is a
frozen ``nn.Parameter``, which the blocks write no update (``for_model``'s SGD holds every
parameter, and a written gradient would step it), under the all-gather of the full
gradients and under the owner exchange (``mem-opt``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed

STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].bias.requires_grad_(False)
    return model


def _train(model: nn.Module, options: dict[str, Any]) -> None:
    opt = KFACOptimizer.for_model(model, overhead=None, **options)
    for step in range(STEPS):  # every rank the same global batch: the serial run's
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    del rank, world
    results: dict[str, Any] = {}
    for key, options in {"replicated": {}, "mem-opt": {"strategy": "mem-opt"}}.items():
        initial, serial, sharded = _model(), _model(), _model()
        _train(serial, options)
        fully_shard(sharded[0])
        fully_shard(sharded[2])
        fully_shard(sharded)
        _train(sharded, options)
        full = {n: p.full_tensor() for n, p in sharded.named_parameters()}  # type: ignore[operator]
        results[key] = {
            "bias_kept": torch.equal(full["0.bias"], initial[0].bias),
            "bias_grad": sharded[0].bias.grad is None,
            "trained": not torch.equal(full["0.weight"], initial[0].weight),
            "gap": max((full[n] - p).abs().max().item() for n, p in serial.named_parameters()),
        }
    return results


def test_a_frozen_bias_of_a_sharded_model_stays_and_the_weights_train_as_serial() -> None:
    for result in run_distributed(_rank_main, 2, timeout=180):
        for key, found in result.items():
            assert found["bias_kept"] and found["bias_grad"] and found["trained"], (key, found)
            assert found["gap"] < 1e-9, (key, found)
