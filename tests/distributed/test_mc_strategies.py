"""Monte-Carlo Fisher under every strategy (2 gloo ranks).

Rank ``r`` samples its targets with ``seed + r``. The oracle is a single-process
preconditioner per shard with that seed: after one step, a strategy that reduces factors
holds the mean of the shards' single-process factors, and ``dp`` holds its own shard's;
every rank ends the step with the same preconditioned gradients.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests import strategy_cases as cases
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import (
    Run,
    assert_factors_close,
    assert_tensors_close,
    train_sharded,
)

WORLD = 2
STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp", "spngd")
OPTIONS: dict[str, Any] = {"fisher": "mc", "factor_decay": 0.0, "seed": 11, "kl_clip": None}


def _one_step(rank: int, **options: Any) -> Run:
    """One step on ``rank``'s shard (in a process group: averaged as the strategy wants)."""
    return train_sharded(
        rank,
        WORLD,
        model_fn=cases.make_model,
        batch_fn=functools.partial(cases.global_batch, world_size=WORLD),
        steps=1,
        **{**OPTIONS, **options},
    )


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        fraction = 0.5 if strategy == "kaisa" else 1.0
        run = _one_step(rank, strategy=strategy, grad_worker_fraction=fraction)
        out[strategy] = {
            "factors": run.factors(),
            "grads": [p.grad.clone() for p in run.model.parameters() if p.grad is not None],
        }
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every strategy in one spawn of 2 ranks."""
    return run_distributed(_rank_main, WORLD, timeout=120)


@pytest.fixture(scope="module")
def shards() -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Each shard's factors in a single process, sampled with that rank's seed."""
    return [_one_step(r, seed=OPTIONS["seed"] + r).factors() for r in range(WORLD)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mc_fisher_equals_per_shard_single_process(
    strategy: str,
    two_ranks: list[dict[str, Any]],
    shards: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
) -> None:
    mean = {
        name: ((a + shards[1][name][0]) / 2, (g + shards[1][name][1]) / 2)
        for name, (a, g) in shards[0].items()
    }
    for rank, result in enumerate(two_ranks):
        factors = result[strategy]["factors"]
        assert factors, f"{strategy}: rank {rank} keeps no factor at all"
        want = shards[rank] if strategy == "dp" else mean
        assert_factors_close(factors, want, label=f"{strategy}, rank {rank}", kept_only=True)
    grads = [result[strategy]["grads"] for result in two_ranks]
    assert len(grads[0]) == len(list(cases.make_model().parameters()))
    assert_tensors_close(grads[1], grads[0], label=f"{strategy}: ranks disagree")
