"""``for_model``'s overhead budget decides alike on every rank, from what all ranks saw
(2 gloo ranks against one process on the global batch).

The budget sizes each side from the rows of the first step: a side wider than 3/4 of the
rows keeps the identity basis. Sized from one rank's own rows, ranks whose first batches
differ would reduce factors of different shapes (gloo aborts, NCCL hangs), and 2 ranks
would not be the one-process run on the same global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match

DT = torch.float64
STEPS = 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(DT)


def _batch(step: int, rank: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, 8, generator=gen, dtype=DT), torch.randint(
        0, 3, (rows,), generator=gen
    )


def _global(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(step, r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _train(
    rank: int | None, world: int, first_rows: int = 16, strategy: str | None = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model()
    wrapped = model if rank is None else nn.parallel.DistributedDataParallel(model)
    options = {} if strategy is None else {"strategy": strategy}  # None: for_model's own
    opt = KFACOptimizer.for_model(wrapped, lr=0.01, **options)
    for step in range(STEPS):
        if rank is None:
            x, y = _global(step, world)
        else:
            x, y = _batch(step, rank, first_rows if (rank == 1 and step == 0) else 16)
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
    budget = opt.preconditioner.budget
    assert budget is not None and budget.choice is not None
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "one_sided": budget.choice.basis_max_dims,
    }


def test_two_ranks_size_the_sides_from_the_global_rows_as_one_process() -> None:
    """16 rows a rank: one rank's rows alone would make the 16-wide sides one-sided (limit
    12); the global batch's 32 rows keep their bases, on 2 ranks as in one process."""
    serial = _train(None, 2)
    results = run_distributed(_train, 2, timeout=90)
    assert serial["one_sided"] == {}
    for result in results:
        assert result["one_sided"] == serial["one_sided"]
    assert_ranks_match(
        [r["params"] for r in results], serial["params"], label="ddp", rtol=1e-9, atol=1e-9
    )


def test_ranks_whose_first_batches_differ_make_one_choice() -> None:
    """Rank 1's first batch has 6 rows, rank 0's 16: the ranks still choose alike and train
    in step (no mismatched reduction), ending with equal weights."""
    results = run_distributed(_train, 2, 6, timeout=90)
    assert results[0]["one_sided"] == results[1]["one_sided"]
    params = [r["params"] for r in results]
    assert_ranks_match(params, params[0], label="uneven first batch")


def test_dp_sizes_the_sides_from_an_owners_own_rows() -> None:
    """``dp`` builds each layer's factors from its owner's batch alone: 16 rows, so the
    16-wide sides are one-sided (limit 12) on both ranks alike."""
    results = run_distributed(_train, 2, 16, "dp", timeout=90)
    assert results[0]["one_sided"] and results[0]["one_sided"] == results[1]["one_sided"]
    assert set(results[0]["one_sided"].values()) == {12}
