"""Monte-Carlo Fisher under every strategy (2 gloo ranks).

Rank ``r`` samples its targets with ``seed + r``. The oracle is a single-process
preconditioner per shard with that seed: after one step, a strategy that reduces factors
holds the mean of the shards' single-process factors, and ``dp`` holds its own shard's;
every rank ends the step with the same preconditioned gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from tests import strategy_cases as cases
from tests.distributed_utils import run_distributed

STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "spngd")
OPTIONS: dict[str, Any] = {"fisher": "mc", "factor_decay": 0.0, "seed": 11, "kl_clip": None}


def _shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = cases.global_batch(0, world)
    size = x.shape[0] // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _one_step(
    model: nn.Module, pre: KFACPreconditioner, x: torch.Tensor, y: torch.Tensor, world: int
) -> None:
    out = model(x)
    pre.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    if world > 1 and pre.config.strategy != "spngd":
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
    pre.step(lr=0.1)


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        model = cases.make_model()
        fraction = 0.5 if strategy == "kaisa" else 1.0
        pre = KFACPreconditioner(model, strategy=strategy, grad_worker_fraction=fraction, **OPTIONS)
        _one_step(model, pre, *_shard(rank, world), world)
        out[strategy] = {
            "factors": {n: (a.clone(), g.clone()) for n, (a, g) in pre.factors().items()},
            "grads": [p.grad.clone() for p in model.parameters()],
        }
    return out


def _serial_factors(rank: int, world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    model = cases.make_model()
    pre = KFACPreconditioner(model, **{**OPTIONS, "seed": OPTIONS["seed"] + rank})
    _one_step(model, pre, *_shard(rank, world), 1)
    return pre.factors()


def test_mc_fisher_under_every_strategy_equals_per_shard_single_process() -> None:
    world = 2
    results = run_distributed(_rank_main, world, timeout=120)
    shards = [_serial_factors(r, world) for r in range(world)]
    for strategy in STRATEGIES:
        for rank, result in enumerate(results):
            factors = result[strategy]["factors"]
            assert factors, f"{strategy}: rank {rank} keeps no factor at all"
            for name, (a, g) in factors.items():
                if strategy == "dp":
                    want_a, want_g = shards[rank][name]
                else:
                    want_a = (shards[0][name][0] + shards[1][name][0]) / 2
                    want_g = (shards[0][name][1] + shards[1][name][1]) / 2
                torch.testing.assert_close(a, want_a, msg=f"{strategy} {name} A")
                torch.testing.assert_close(g, want_g, msg=f"{strategy} {name} G")
        for got, want in zip(
            results[0][strategy]["grads"], results[1][strategy]["grads"], strict=True
        ):
            torch.testing.assert_close(got, want, msg=f"{strategy}: ranks disagree")
