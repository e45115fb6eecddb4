"""Strategies on one process: identical to the serial engine; validation; the auto rule."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.distributed.strategies import choose_strategy
from tests.strategy_cases import DIMS, make_model, summary, train

STRATEGIES = ["replicated", "kaisa", "mem-opt", "dp", "spngd", "auto"]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return summary(train(None, 1, "replicated"))


def test_replicated_on_one_process_sends_nothing(reference: dict[str, Any]) -> None:
    assert reference["stats"]["total_bytes"] == 0


@pytest.mark.parametrize("name", STRATEGIES[1:])
def test_every_strategy_on_one_process_is_the_serial_engine(
    name: str, reference: dict[str, Any]
) -> None:
    got = summary(train(None, 1, name))
    for p, q in zip(reference["params"], got["params"], strict=True):
        assert torch.equal(p, q), name
    for layer, (a, g) in reference["factors"].items():
        assert torch.equal(a, got["factors"][layer][0]), name
        assert torch.equal(g, got["factors"][layer][1]), name
    assert got["stats"]["total_bytes"] == 0
    assert got["stats"]["steps"] == 4
    assert got["memory"] == reference["memory"]
    layers = [row for row in got["describe"] if row["block"] != "inner optimizer"]
    assert {row["owner"] for row in layers} == {0}


def test_one_process_memory_holds_every_layer() -> None:
    usage = train(None, 1, "mem-opt", steps=1).pre.memory_usage()
    assert usage["factors"] == 8 * sum(a * a + g * g for a, g in DIMS.values())
    assert usage["inverses"] == 8 * sum(a * a + a + g * g + g for a, g in DIMS.values())


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"strategy": "ring"}, ValueError, "strategy"),
        ({"grad_worker_fraction": 0.0}, ValueError, "grad_worker_fraction"),
        ({"grad_worker_fraction": 1.5}, ValueError, "grad_worker_fraction"),
        ({"grad_worker_fraction": "half"}, TypeError, "grad_worker_fraction"),
        ({"bucket_bytes": 0}, ValueError, "bucket_bytes"),
        ({"pack_triangles": "yes"}, TypeError, "pack_triangles"),
        ({"placement_cost": "time"}, ValueError, "placement_cost"),
    ],
)
def test_bad_strategy_options_are_rejected(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KFACConfig(**options)


def test_any_fraction_is_one_worker_on_one_process() -> None:
    """One process is the serial engine whatever the fraction (round(0.3 × 1) = 0 workers
    would be refused with several ranks: tests/distributed/test_assignment.py)."""
    pre = KFACPreconditioner(make_model(), strategy="kaisa", grad_worker_fraction=0.3)
    assert pre.strategy.workers_per_layer == 1
    assert all(pre.strategy.preconditions(name) for name in pre.layers)


def test_process_group_type_is_checked() -> None:
    with pytest.raises(TypeError, match="process_group"):
        KFACPreconditioner(make_model(), process_group="world")


def test_choose_strategy_rule() -> None:
    assert choose_strategy(1, ddp_wrapped=False, replicated_state_bytes=10**12) == "replicated"
    assert choose_strategy(4, ddp_wrapped=False, replicated_state_bytes=1) == "spngd"
    assert choose_strategy(4, ddp_wrapped=True, replicated_state_bytes=10**12) == "replicated"
    budget = 4 * 10**9
    assert (
        choose_strategy(
            4, ddp_wrapped=True, replicated_state_bytes=10**9 + 1, memory_budget_bytes=budget
        )
        == "mem-opt"
    )
    assert (
        choose_strategy(
            4, ddp_wrapped=True, replicated_state_bytes=10**9, memory_budget_bytes=budget
        )
        == "replicated"
    )
