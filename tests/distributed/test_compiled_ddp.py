"""``torch.compile(DDP(model))`` is a DDP model to the preconditioner (2 gloo ranks).

The compiled wrapper hides the DDP inside it. Oracle: the same run with the DDP model
given uncompiled: the same strategy, the same overlapped path (DDP's buckets), and the same
weights bit for bit on every rank (taken for a model without DDP, ``strategy="auto"``
would choose SP-NGD, which reduces the gradients DDP already averaged).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed


def _rank_main(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(net)
    model: nn.Module = torch.compile(ddp, backend="eager") if compiled else ddp
    opt = KFACOptimizer.for_model(model, lr=0.05, strategy="auto")
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    pre = opt.preconditioner
    assert dist.get_world_size() == world
    return {
        "strategy": type(pre.strategy).__name__,
        "overlapped": pre.eager is not None,
        "params": [p.detach().clone() for p in net.parameters()],
    }


def test_a_compiled_ddp_model_is_preconditioned_as_the_ddp_model() -> None:
    plain = run_distributed(_rank_main, 2, False)
    compiled = run_distributed(_rank_main, 2, True)
    for rank in range(2):
        assert compiled[rank]["strategy"] == plain[rank]["strategy"]
        assert compiled[rank]["overlapped"] == plain[rank]["overlapped"]
        for a, b in zip(compiled[rank]["params"], plain[rank]["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(compiled[0]["params"], compiled[1]["params"], strict=True):
        assert torch.equal(a, b)


def _warmed_rank(rank: int, world: int) -> list[int]:
    """A compiled DDP model run once before the optimizer was built: the batch each step
    captured."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model = torch.compile(nn.parallel.DistributedDataParallel(net), backend="aot_eager")
    model(torch.randn(8, 6)).sum()  # a training-mode forward, before the hooks
    opt = KFACOptimizer.for_model(model, lr=0.05, overhead=None)
    captured = []
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        captured.append(opt.preconditioner.capture.captured_batch)
        opt.step()
    return captured


def test_a_compiled_ddp_model_run_before_the_build_captures_every_step() -> None:
    """Unlike a compiled plain module (refused: ``tests/integrations/test_compile.py``), a
    compiled DDP model that ran a training forward before the optimizer was built runs
    dkfac's hooks from the first step on, on every rank."""
    assert run_distributed(_warmed_rank, 2, timeout=60) == [[8, 8, 8]] * 2
