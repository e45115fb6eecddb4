"""SKFAC (method="smw") on 2 gloo ranks against one process on the same global batch.

Low-rank statistics ``U = Rᵀ/√n`` are all-gathered between ranks: with equal local batches
the serial ``U`` of the global batch is the concatenation of the ranks' ``U``'s divided by
``√P``, so every strategy that shares statistics gives the serial parameters and factors, and
the ledger's ``factors`` bytes follow from the shapes by hand.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.solvers.lowrank.factor import default_max_rank
from tests.distributed_utils import run_distributed

WORLD = 2
PER_RANK = 4
STEPS = 2
F64 = 8
OPTIONS: dict[str, Any] = {
    "method": "smw",
    "factor_decay": 0.5,
    "damping": 0.05,
    "kl_clip": 1e-3,
    "lr": 0.1,
    "eigen_dtype": torch.float64,
}
# Bounded rank of the gathered rows: m = 2 · 4 = 8 per step, decay 0.5 -> 56 columns.
RANK = default_max_rank(WORLD * PER_RANK, 0.5)
# Layer "0": A 81, G 64 (both > 56: low-rank); layer "2": A 65 low-rank, G 6 dense.
LOWRANK_DIMS = {"0": (81, 64), "2": (65,)}
DENSE_G2 = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 6)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(WORLD * PER_RANK, 80, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 6, (WORLD * PER_RANK,), generator=gen)


def _train(rank: int, world: int, strategy: str) -> dict[str, Any]:
    model = _model()
    wrapped: nn.Module = model
    if world > 1 and strategy != "spngd":
        wrapped = nn.parallel.DistributedDataParallel(model)
    pre = KFACPreconditioner(wrapped, strategy=strategy, **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    size = WORLD * PER_RANK // world
    for step in range(STEPS):
        x, y = _batch(step)
        shard = slice(rank * size, (rank + 1) * size)
        opt.zero_grad()
        F.cross_entropy(wrapped(x[shard]), y[shard]).backward()
        pre.step()
        opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "factors": {n: (a.clone(), g.clone()) for n, (a, g) in pre.factors().items()},
        "describe": pre.describe(),
        "stats": pre.comm_stats(),
    }


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {s: _train(rank, world, s) for s in ("replicated", "mem-opt", "spngd", "dp")}


def _factor_bytes(strategy: str) -> int:
    """Hand count per step: gathered U's (P·m·d) plus the dense G of layer 2."""
    gathered = sum(WORLD * PER_RANK * d for dims in LOWRANK_DIMS.values() for d in dims) * F64
    dense = DENSE_G2 * (DENSE_G2 + 1) // 2 if strategy == "spngd" else DENSE_G2**2
    return (gathered + dense * F64) * STEPS


def test_two_ranks_equal_serial_and_ledger_counts_u_bytes() -> None:
    results = run_distributed(_rank_main, WORLD, timeout=120)
    serial = _train(0, 1, "replicated")
    assert [row["method"] for row in serial["describe"]] == [
        "smw(A=lowrank,G=lowrank)",
        "smw(A=lowrank,G=dense)",
    ]
    u_cols = WORLD * PER_RANK * STEPS  # no truncation: 16 < 56
    assert serial["factors"]["0"][0].shape == (81, u_cols) and u_cols < RANK
    for strategy in ("replicated", "mem-opt", "spngd"):
        for rank, res in enumerate(results):
            got = res[strategy]
            label = f"{strategy} rank {rank}"
            assert [r["method"] for r in got["describe"]] == [
                r["method"] for r in serial["describe"]
            ], label
            for p, q in zip(got["params"], serial["params"], strict=True):
                torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=label)
            for name, (a, g) in got["factors"].items():  # kept ones equal the serial U's
                torch.testing.assert_close(a, serial["factors"][name][0], msg=label)
                torch.testing.assert_close(g, serial["factors"][name][1], msg=label)
            if strategy == "replicated":
                assert set(got["factors"]) == {"0", "2"}, label
            stats = got["stats"]
            assert stats["total"]["factors"] == _factor_bytes(strategy), label
            gathered = sum(WORLD * PER_RANK * d for v in LOWRANK_DIMS.values() for d in v)
            all_gather = stats["by_collective"]["all_gather"]
            if strategy == "spngd":  # it also all-gathers the preconditioned gradients
                assert all_gather > gathered * F64 * STEPS, label
            else:
                assert all_gather == gathered * F64 * STEPS, label
    for rank, res in enumerate(results):  # dp: the owner keeps its local U, no traffic
        got = res["dp"]
        assert got["stats"]["total"]["factors"] == 0
        for row in got["describe"]:
            if row["owner"] == rank and row["name"] == "0":
                local_rank = default_max_rank(PER_RANK, 0.5)  # 28: G of layer 2 stays dense
                assert row["method"] == "smw(A=lowrank,G=lowrank)" and local_rank < 64
                assert got["factors"]["0"][0].shape == (81, PER_RANK * STEPS)
