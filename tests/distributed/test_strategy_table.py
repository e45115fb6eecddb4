"""The strategy table: one class per strategy, a neutral base, rules read by the cost model."""

from __future__ import annotations

from typing import get_args

import pytest

from dkfac.costmodel import STRATEGIES as PRICED
from dkfac.costmodel import rule_of
from dkfac.distributed.strategies import STRATEGIES, Strategy, StrategyName
from dkfac.distributed.strategy_base import StrategyRule


def test_the_literal_and_the_table_name_the_same_strategies() -> None:
    assert tuple(STRATEGIES) == get_args(StrategyName)
    assert all(cls.name == name for name, cls in STRATEGIES.items())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_is_a_direct_kind_of_the_neutral_base(name: str) -> None:
    cls = STRATEGIES[name]
    assert cls.__bases__ == (Strategy,)
    assert isinstance(cls.rule, StrategyRule)


def test_the_cost_model_prices_every_strategy_by_its_own_rule() -> None:
    assert tuple(STRATEGIES) == PRICED
    assert all(rule_of(name) is cls.rule for name, cls in STRATEGIES.items())


@pytest.mark.parametrize(
    ("fraction", "world", "requested", "expected"),
    [("one", 4, 0.25, 1.0), ("inverse_p", 4, 1.0, 0.25), ("given", 4, 0.5, 0.5)],
)
def test_a_rule_fixes_or_passes_the_worker_fraction(
    fraction: str, world: int, requested: float, expected: float
) -> None:
    rule = StrategyRule("all", "all_reduce", False, True, "receivers", "ddp", "all", fraction)  # type: ignore[arg-type]
    assert rule.worker_fraction(world, requested) == expected


def test_dp_builds_on_the_owner_and_sends_no_factors() -> None:
    dp, mem_opt = STRATEGIES["dp"].rule, STRATEGIES["mem-opt"].rule
    assert (dp.builders, dp.factor_collective) == ("owner", None)
    assert (mem_opt.builders, mem_opt.factor_collective) == ("all", "all_reduce")
