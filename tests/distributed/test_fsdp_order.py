"""A model sharded with ``fully_shard`` after the preconditioner was built is refused.

The preconditioner reads the model's layout when it is built: plain tensors (DDP, one
process) or FSDP2's DTensors. ``fully_shard`` applied afterwards swaps the parameters for
DTensors the plain layout cannot read; the first step must then say so (and what order
works), on every rank, instead of failing inside a DTensor operation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.strategy_cases import global_batch, make_model

PATTERN = "fully_shard after the preconditioner was built"


def _shard(model: nn.Module) -> None:
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)


def _first_step(build: Callable[[nn.Module], torch.optim.Optimizer]) -> str:
    model = make_model()
    opt = build(model)  # on the plain model
    _shard(model)
    x, y = global_batch(0, 1)
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _kfac_sgd(model: nn.Module) -> torch.optim.Optimizer:
    pre = KFACPreconditioner(model, method="eigen")
    return KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pre)


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {
        "preconditioner": _first_step(_kfac_sgd),
        "for_model": _first_step(lambda model: KFACOptimizer.for_model(model, lr=0.01)),
    }


def test_sharding_after_building_is_refused_at_the_first_step() -> None:
    for rank, result in enumerate(run_distributed(_rank_main, 2, timeout=60)):
        for case, message in result.items():
            assert PATTERN in message and "'0'" in message, f"rank {rank}, {case}: {message}"
