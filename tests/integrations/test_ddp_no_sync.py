"""DDP gradient accumulation with ``no_sync()``, as DDP's documentation writes it: no count
given to dkfac, the overlapped reduction on (DDP with ``find_unused_parameters=False``), two
gloo ranks against one process on the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed

DT = torch.float64
MICRO, BATCH, STEPS = 2, 4, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def _data(step: int, rank: int, micro: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(BATCH, 5, generator=gen, dtype=DT), torch.randint(
        0, 3, (BATCH,), generator=gen
    )


def _ranks(rank: int, world_size: int) -> list[Tensor]:
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = KFACOptimizer.for_model(ddp, lr=0.01, method="eigen", kl_clip=None)
    assert opt.preconditioner.eager is not None  # the overlapped path
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = _data(step, rank, micro)
            if micro < MICRO - 1:
                with ddp.no_sync():
                    (F.cross_entropy(ddp(x), y) / MICRO).backward()
            else:
                (F.cross_entropy(ddp(x), y) / MICRO).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def test_no_sync_accumulation_on_two_ranks_equals_one_process() -> None:
    ranks = run_distributed(_ranks, 2, timeout=240)
    model = _model()
    opt = KFACOptimizer.for_model(model, lr=0.01, method="eigen", kl_clip=None)
    for step in range(STEPS):
        pairs = [_data(step, r, m) for r in range(2) for m in range(MICRO)]
        opt.zero_grad()
        x, y = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for rank in ranks:
        for got, want in zip(rank, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
