"""A non-finite gradient in one rank's shard of a sharded model skips the step on every
rank (the optimizer checks each rank's shards and agrees the answer in one all-reduce),
and no moment moves on any rank: the layers' nor the leftover Adam's, whose finite shards
on the other rank included."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    fully_shard(model)
    return model


def _step(model: nn.Module, opt: KFACOptimizer, step: int, poison: bool) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if poison:  # only this rank's shard of the LayerNorm's weight (no K-FAC layer holds it)
        grad = model[1].weight.grad
        assert isinstance(grad, DTensor)
        grad.to_local()[0] = float("nan")
    opt.step()


def _moments(opt: KFACOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's moments: each layer's and its rows of the leftover Adam's."""
    pre = opt.preconditioner
    assert pre.leftover is not None
    kept = {name: layer.moments or {} for name, layer in pre.layers.items()}
    kept.update(pre.leftover.moments)
    return {name: {k: v.clone() for k, v in m.items()} for name, m in kept.items()}


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = KFACOptimizer.for_model(model, overhead=None)
    _step(model, opt, 0, poison=False)
    before = [p.to_local().clone() for p in model.parameters()]
    moments = _moments(opt)
    _step(model, opt, 1, poison=rank == 1)
    same = all(
        torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before, strict=True)
    )
    held = _moments(opt)
    moved_moments = sorted(
        f"{name}.{key}"
        for name, m in moments.items()
        for key, value in m.items()
        if not torch.equal(held[name][key], value)
    )
    _step(model, opt, 2, poison=False)
    moved = not all(
        torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before, strict=True)
    )
    return {
        "unchanged": same,
        "moved_moments": moved_moments,
        "skipped": opt.skipped_steps,
        "moved_after": moved,
    }


def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank() -> None:
    results = run_distributed(_rank_main, 2, timeout=180)
    assert [r["unchanged"] for r in results] == [True, True]
    assert [r["moved_moments"] for r in results] == [[], []]
    assert [r["skipped"] for r in results] == [1, 1]
    assert [r["moved_after"] for r in results] == [True, True]
