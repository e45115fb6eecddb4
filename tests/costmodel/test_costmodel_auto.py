"""``strategy="auto"``: build_strategy picks what the cost model's recommend() says.

No process group: a fake communicator of ``P`` ranks whose collectives are inactive (the
strategy constructors only read its size and ranks), and blocks made by the block registry.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from dkfac.blocks.base import Block
from dkfac.blocks.linear import LinearBlock
from dkfac.blocks.registry import make_block
from dkfac.config import KFACConfig
from dkfac.costmodel import (
    DtypeBytes,
    candidate_strategies,
    extract_layers,
    recommend,
    select_strategy,
)
from dkfac.engine.strategy_choice import build_strategy


def fake_comm(world: int) -> Any:
    return SimpleNamespace(world_size=world, rank=0, ranks=list(range(world)), active=False)


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width),
        nn.Linear(width, 10),
    )


def blocks_of(model: nn.Module) -> dict[str, Block]:
    found = {}
    for name, module in model.named_modules():
        block = make_block(name, module)
        if block is not None:
            found[name] = block
    return found


def exact_candidates(world: int) -> list[tuple[str, float]]:
    """Every candidate but dp (local factors) and spngd (refuses a DDP model)."""
    return [(s, f) for s, f in candidate_strategies(world) if s not in ("dp", "spngd")]


CASES = [(w, width, ii) for w in (2, 4, 16, 64) for width in (16, 256, 2048) for ii in (1, 10)]


@pytest.mark.parametrize(("world", "width", "interval"), CASES)
def test_auto_picks_recommendation(world: int, width: int, interval: int) -> None:
    model = mlp(width)
    config = KFACConfig(strategy="auto", inverse_update_interval=interval)
    strategy = build_strategy(config, fake_comm(world), blocks_of(model), ddp_wrapped=True)
    choice, _ = recommend(
        extract_layers(model),
        world,
        batch_per_rank=32,
        strategies=exact_candidates(world),
        inverse_interval=interval,
    )
    assert strategy.name == choice.strategy
    assert strategy.workers_per_layer == round(choice.grad_worker_fraction * world)


def test_auto_choices_vary_and_exclude_dp_and_spngd() -> None:
    labels = set()
    for world, width, interval in CASES:
        pairs = exact_candidates(world)
        choice, preds = recommend(
            extract_layers(mlp(width)),
            world,
            batch_per_rank=32,
            strategies=pairs,
            inverse_interval=interval,
        )
        labels.add(choice.label)
        got = select_strategy(
            extract_layers(mlp(width)), world, ddp_wrapped=True, inverse_interval=interval
        )
        assert got == (choice.strategy, choice.grad_worker_fraction)
        assert choice.total_seconds == min(p.total_seconds for p in preds)
    assert {"replicated", "mem-opt", "kaisa(f=0.5)", "kaisa(f=0.25)"} <= labels
    # dp is considered only when asked for, and then the fastest of all may be it.
    spec = extract_layers(mlp(2048))
    with_dp, _ = recommend(
        spec, 4, batch_per_rank=32, strategies=[*exact_candidates(4), ("dp", 0.25)]
    )
    assert select_strategy(spec, 4, ddp_wrapped=True, allow_local_factors=True) == (
        with_dp.strategy,
        with_dp.grad_worker_fraction,
    )


def test_auto_unwrapped_single_rank_and_dtypes() -> None:
    model = mlp(16)
    blocks = blocks_of(model)
    config = KFACConfig(strategy="auto")
    assert build_strategy(config, fake_comm(4), blocks, ddp_wrapped=False).name == "spngd"
    assert build_strategy(config, fake_comm(1), blocks, ddp_wrapped=True).name == "replicated"
    # float64 blocks: the model is asked with 8-byte elements.
    model64 = mlp(256).double()
    strategy = build_strategy(config, fake_comm(64), blocks_of(model64), ddp_wrapped=True)
    choice, _ = recommend(
        extract_layers(model64),
        64,
        batch_per_rank=32,
        strategies=exact_candidates(64),
        dtypes=DtypeBytes(factor=8, inverse=8, grad=8),
        inverse_interval=10,  # KFACConfig's default
    )
    assert (strategy.name, strategy.workers_per_layer / 64) == (
        choice.strategy,
        choice.grad_worker_fraction,
    )


def test_auto_memory_budget() -> None:
    spec = extract_layers(mlp(2048))
    _, preds = recommend(spec, 4, batch_per_rank=32, strategies=exact_candidates(4))
    need = {p.label: p.memory_max + p.model_state_bytes for p in preds}
    # A budget only mem-opt fits; and one nothing fits (the smallest need is taken).
    budget = need["mem-opt"] + 1
    assert all(v > budget for k, v in need.items() if k != "mem-opt")
    assert select_strategy(spec, 4, ddp_wrapped=True, memory_budget_bytes=budget)[0] == "mem-opt"
    assert select_strategy(spec, 4, ddp_wrapped=True, memory_budget_bytes=1.0)[0] == "mem-opt"
    with pytest.raises(ValueError, match="world_size"):
        select_strategy(spec, 0, ddp_wrapped=True)


class _OddBlock(LinearBlock):
    """A user block type the cost model cannot describe (its own solver)."""

    solver_name = "cholesky"


def test_auto_falls_back_to_choose_strategy() -> None:
    layer = nn.Linear(4, 3)
    blocks: dict[str, Block] = {"0": _OddBlock("0", layer)}
    config = KFACConfig(strategy="auto")
    assert build_strategy(config, fake_comm(4), blocks, ddp_wrapped=True).name == "replicated"
    assert build_strategy(config, fake_comm(4), blocks, ddp_wrapped=False).name == "spngd"
    assert torch.is_tensor(layer.weight)
