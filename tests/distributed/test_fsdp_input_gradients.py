"""A backward that computes no gradient of the weights (``torch.autograd.grad`` for an
input's gradient) changes nothing of a sharded model's training either, nor the overhead
budget's first-step rows: the forward runs with FSDP2's unsharded parameters, whose
gradient accumulators the capture and the budget ask about, not the sharded ones the
preconditioner holds (each layer its own ``fully_shard`` unit, resharded after its
forward)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed

STEPS = 10  # the budget's first step, captures and refreshes


def _train(probe: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = KFACOptimizer.for_model(model, lr=1e-2)
    budget = opt.preconditioner.budget
    assert budget is not None
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=gen).requires_grad_()
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        if probe:  # an input's gradient on other samples (FGSM's probe) first
            other = x.detach().flip(0).mul(2).requires_grad_()
            torch.autograd.grad(model(other).logsumexp(1).sum(), other)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]
    return full, dict(budget.step_rows)


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    del rank, world
    (plain, plain_rows), (extra, extra_rows) = _train(False), _train(True)
    return {
        "equal": all(torch.equal(plain[n], extra[n]) for n in plain),
        "rows": (plain_rows, extra_rows),
    }


def test_an_input_gradient_leaves_a_sharded_models_training_as_it_is() -> None:
    for result in run_distributed(_rank_main, 2, timeout=180):
        assert result["equal"], result
        plain_rows, extra_rows = result["rows"]  # 16 rows a layer on each of the 2 ranks
        assert plain_rows == extra_rows == {"0": 32, "2": 32}, result
