"""Layers used by only some ranks on some steps: no hang, every rank agrees (2 gloo ranks).

A branch (a Linear layer) runs on rank 1 only at step 0, on both ranks at step 1 and on
neither at step 2. Without agreement the ranks would launch different collectives and hang
(the run has a timeout). Checks: every rank ends with the same parameters; a statistic
missing on a rank is skipped everywhere (the branch has no factors after step 0); once both
ranks use it, its factors equal the mean of the two ranks' formulas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.oracles import with_ones

DT = torch.float64
USES = {0: {1}, 1: {0, 1}, 2: set()}  # step -> ranks that run the branch


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 5)
        self.branch = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(5))  # not a K-FAC layer

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h)) * self.scale
        return self.head(h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 4, generator=gen, dtype=DT), torch.randint(0, 3, (6,), generator=gen)


def _rank_main(rank: int, world: int, strategy: str) -> dict[str, Any]:
    model = _Branchy().double()
    pre = KFACPreconditioner(
        model, strategy=strategy, factor_decay=0.0, inverse_update_interval=1, kl_clip=None
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    factors_after: list[dict[str, Any]] = []
    branch_inputs: list[torch.Tensor] = []
    for step in range(3):
        x, y = _batch(step, rank)
        opt.zero_grad()
        use = rank in USES[step]
        if use and step == 1:
            with torch.no_grad():
                branch_inputs.append(torch.tanh(model.stem(x)))
        F.cross_entropy(model(x, use), y).backward()
        if strategy != "spngd":
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world
        pre.step(lr=0.1)
        opt.step()
        factors_after.append({n: a.clone() for n, (a, _) in pre.factors().items()})
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "factors": factors_after,
        "branch_a_rows": with_ones(branch_inputs[0]),
    }


def test_unused_branch_does_not_hang_and_ranks_agree() -> None:
    for strategy in ("replicated", "spngd"):
        results = run_distributed(_rank_main, 2, strategy, timeout=90)
        for got, want in zip(results[0]["params"], results[1]["params"], strict=True):
            torch.testing.assert_close(got, want, msg=strategy)
            assert bool(torch.isfinite(got).all())
        for result in results:
            assert "branch" not in result["factors"][0], strategy
        rows = [r["branch_a_rows"] for r in results]
        expected = sum(r.T @ r / r.shape[0] for r in rows) / 2
        owners = [r for r in results if "branch" in r["factors"][1]]
        assert owners, f"{strategy}: nobody keeps the branch factors after step 1"
        for result in owners:
            torch.testing.assert_close(result["factors"][1]["branch"], expected)
