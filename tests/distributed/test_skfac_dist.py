"""SKFAC (method="smw") on 2 gloo ranks against one process on the same global batch.

Low-rank statistics ``U = Rᵀ/√n`` are all-gathered between ranks: with equal local batches
the serial ``U`` of the global batch is the concatenation of the ranks' ``U``'s divided by
``√P``, so every strategy that shares statistics gives the serial parameters and factors, and
the ledger's ``factors`` bytes follow from the shapes by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dkfac.solvers.lowrank.factor import default_max_rank
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_factors_close, assert_tensors_close, train_sharded

WORLD = 2
SHARING = ("replicated", "mem-opt", "spngd")  # the strategies that share statistics
PER_RANK = 4
STEPS = 2
F64 = 8
OPTIONS: dict[str, Any] = {
    "method": "smw",
    "factor_decay": 0.5,
    "damping": 0.05,
    "kl_clip": 1e-3,
    "eigen_dtype": torch.float64,
}  # lr 0.1 for SGD (no momentum) and pre.step: train_sharded's default
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


def _train(rank: int | None, strategy: str) -> dict[str, Any]:
    """Rank ``rank``'s shard (DDP unless ``spngd``); ``rank=None``: the serial twin."""
    run = train_sharded(
        rank,
        WORLD,
        model_fn=_model,
        batch_fn=_batch,
        steps=STEPS,
        ddp=rank is not None and strategy != "spngd",
        momentum=0.0,
        strategy=strategy,
        **OPTIONS,
    )
    return {
        "params": run.params(),
        "factors": run.factors(),
        "describe": run.pre.describe(),
        "stats": run.pre.comm_stats(),
    }


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {s: _train(rank, s) for s in (*SHARING, "dp")}


def _factor_bytes(strategy: str) -> int:
    """Hand count per step: gathered U's (P·m·d) plus the dense G of layer 2."""
    gathered = sum(WORLD * PER_RANK * d for dims in LOWRANK_DIMS.values() for d in dims) * F64
    dense = DENSE_G2 * (DENSE_G2 + 1) // 2 if strategy == "spngd" else DENSE_G2**2
    return (gathered + dense * F64) * STEPS


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every strategy in one spawn of 2 ranks."""
    return run_distributed(_rank_main, WORLD, timeout=120)


@pytest.fixture(scope="module")
def serial() -> dict[str, Any]:
    return _train(None, "replicated")


def test_serial_twin_keeps_every_gathered_column(serial: dict[str, Any]) -> None:
    assert [row["method"] for row in serial["describe"]] == [
        "smw(A=lowrank,G=lowrank)",
        "smw(A=lowrank,G=dense)",
    ]
    u_cols = WORLD * PER_RANK * STEPS  # no truncation: 16 < 56
    assert serial["factors"]["0"][0].shape == (81, u_cols) and u_cols < RANK


@pytest.mark.parametrize("strategy", SHARING)
def test_two_ranks_equal_serial_and_ledger_counts_u_bytes(
    strategy: str, two_ranks: list[dict[str, Any]], serial: dict[str, Any]
) -> None:
    for rank, res in enumerate(two_ranks):
        got = res[strategy]
        label = f"{strategy}, rank {rank}"
        assert [r["method"] for r in got["describe"]] == [
            r["method"] for r in serial["describe"]
        ], label
        assert_tensors_close(got["params"], serial["params"], label=label, rtol=1e-9, atol=1e-12)
        # The kept ones equal the serial U's.
        assert_factors_close(got["factors"], serial["factors"], label=label, kept_only=True)
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


def test_dp_owner_keeps_its_local_u_and_sends_nothing(two_ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(two_ranks):
        got = res["dp"]
        assert got["stats"]["total"]["factors"] == 0
        for row in got["describe"]:
            if row["owner"] == rank and row["name"] == "0":
                local_rank = default_max_rank(PER_RANK, 0.5)  # 28: G of layer 2 stays dense
                assert row["method"] == "smw(A=lowrank,G=lowrank)" and local_rank < 64
                assert got["factors"]["0"][0].shape == (81, PER_RANK * STEPS)
