"""The overhead budget: the rule as a pure function of counted costs, and in a preconditioner."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.costmodel.budget import (
    DISPATCH_FLOPS,
    Costs,
    LayerShape,
    choose,
    layer_costs,
)


def test_layer_costs_are_the_counted_flops() -> None:
    d = DISPATCH_FLOPS
    costs = layer_costs(
        [LayerShape(a=5, g=3, rows=7, polar_steps=2), LayerShape(a=9, g=2, rows=4, a_parts=(3, 3))]
    )
    assert costs.step == 6 * 7 * 5 * 3 + 6 * 4 * 9 * 2 + 6 * d
    polar = 2 * (6 * 5 * 3 * 3 + 4 * d)  # two Newton-Schulz steps on the first layer
    assert costs.fixed == 4 * 5 * 3 * 8 + 4 * 9 * 2 * 11 + 28 * d + polar
    assert costs.capture == 2 * 7 * (25 + 9) + 2 * 4 * (81 + 4) + 8 * d
    # a flattened map's input basis is refreshed as its channel and position sides
    assert costs.refresh == 6 * (125 + 27) + 6 * (27 + 27 + 8) + 16 * d


COSTS = Costs(step=100.0, fixed=5.0, capture=40.0, refresh=200.0)


def _overhead(batch: int, b: int, fi: int, ii: int, costs: Costs = COSTS) -> float:
    return (costs.fixed + costs.capture * b / batch / fi + costs.refresh / ii) / costs.step


def test_a_generous_budget_takes_the_freshest_choice() -> None:
    choice = choose(COSTS, 256, 10.0)
    assert (choice.factor_batch_size, choice.factor_update_interval) == (None, 1)
    assert choice.inverse_update_interval == 5 and choice.within_budget
    assert choice.overhead == pytest.approx(_overhead(256, 256, 1, 5))  # 0.85


def test_a_tight_budget_takes_the_freshest_that_fits() -> None:
    choice = choose(COSTS, 256, 0.3)
    b = choice.factor_batch_size or 256
    fi, ii = choice.factor_update_interval, choice.inverse_update_interval
    assert choice.within_budget and choice.overhead <= 0.3
    assert choice.overhead == pytest.approx(_overhead(256, b, fi, ii))

    # brute force: no candidate within the budget is fresher
    def staleness(b: int, fi: int, ii: int) -> float:
        return 0.5 * math.log2(256 / b) + math.log2(fi) + math.log2(ii / 5)

    best = min(
        staleness(bb, f, i)
        for bb in (256, 128, 64, 32)
        for f in (1, 2, 4, 8)
        for i in (5, 10, 20, 50)
        if i >= f and _overhead(256, bb, f, i) <= 0.3
    )
    assert staleness(b, fi, ii) == pytest.approx(best)


def test_a_larger_budget_is_never_staler() -> None:
    def stale(budget: float) -> float:
        c = choose(COSTS, 256, budget)
        b = c.factor_batch_size or 256
        return (
            0.5 * math.log2(256 / b)
            + math.log2(c.factor_update_interval)
            + math.log2(c.inverse_update_interval / 5)
        )

    values = [stale(x) for x in (0.1, 0.2, 0.3, 0.5, 1.0, 3.0)]
    assert values == sorted(values, reverse=True)


def test_explicit_options_are_kept() -> None:
    choice = choose(COSTS, 256, 0.3, {"inverse_update_interval": 7, "factor_batch_size": None})
    assert choice.inverse_update_interval == 7 and choice.factor_batch_size is None
    assert "kept as given: factor_batch_size, inverse_update_interval" in choice.reason


def test_when_nothing_fits_the_rotation_gets_half_the_budget_on_top() -> None:
    costly = Costs(step=100.0, fixed=80.0, capture=40.0, refresh=200.0)
    choice = choose(costly, 256, 0.3)
    assert not choice.within_budget and "no choice fits" in choice.reason
    assert choice.overhead <= 0.8 + 0.15 + 1e-12


@pytest.mark.parametrize("budget", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_budget_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="overhead budget must be a finite number > 0"):
        choose(COSTS, 256, budget)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)
    )


def _step(model: nn.Module, opt: KFACOptimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(128, 20, generator=gen), torch.randint(0, 5, (128,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_the_preconditioner_applies_the_choice_after_the_first_step() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    assert opt.preconditioner.describe()[-1]["reason"] == "chosen after the first step"
    _step(model, opt, 0)
    # the hidden layer (role:hidden) takes the polar update: five Newton-Schulz steps
    hidden = LayerShape(65, 64, 128, polar_steps=5)
    shapes = [LayerShape(21, 64, 128), hidden, LayerShape(65, 5, 128)]
    want = choose(layer_costs(shapes), 128, 0.3)
    config = opt.preconditioner.config
    assert config.factor_batch_size == want.factor_batch_size
    assert config.factor_update_interval == want.factor_update_interval
    assert config.inverse_update_interval == want.inverse_update_interval
    row = opt.preconditioner.describe()[-1]
    assert row["name"] == "overhead budget" and row["reason"] == want.reason
    for seed in range(1, 4):  # it keeps training, the choice in place
        _step(model, opt, seed)
    assert opt.preconditioner.config.factor_update_interval == want.factor_update_interval


def test_explicit_intervals_win_over_the_budget() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.01, inverse_update_interval=3)
    _step(model, opt, 0)
    config = opt.preconditioner.config
    assert config.inverse_update_interval == 3
    assert "kept as given: inverse_update_interval" in opt.preconditioner.describe()[-1]["reason"]
    pre = KFACPreconditioner(_mlp(), overhead=0.3, factor_update_interval=2)
    assert pre.budget is not None and pre.budget.explicit == {"factor_update_interval": 2}


def test_without_a_budget_nothing_is_chosen() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=None)
    _step(model, opt, 0)
    assert opt.preconditioner.budget is None
    assert opt.preconditioner.config.inverse_update_interval == 5
    assert opt.preconditioner.describe()[-1]["name"] != "overhead budget"


def test_a_bad_overhead_is_refused() -> None:
    with pytest.raises(ValueError, match="overhead"):
        KFACPreconditioner(_mlp(), overhead=-0.5)


def test_the_choice_is_saved_and_a_resumed_run_continues_as_the_uninterrupted_one() -> None:
    """A run resumed before its first step there takes the saved choice (the budget would
    otherwise choose only after a step at the fixed intervals)."""
    model, twin = _mlp(), _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.state_dict()
    twin.load_state_dict(model.state_dict())
    resumed = KFACOptimizer.for_model(twin, overhead=0.3)
    resumed.load_state_dict(state)
    chosen = opt.preconditioner.budget.choice  # type: ignore[union-attr]
    assert resumed.preconditioner.budget.choice == chosen  # type: ignore[union-attr]
    assert resumed.preconditioner.config.inverse_update_interval == (
        opt.preconditioner.config.inverse_update_interval
    )
    for seed in range(1, 6):
        _step(model, opt, seed)
        _step(twin, resumed, seed)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_saved_choice_that_is_not_one_is_refused() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.preconditioner.state_dict()
    state["budget"] = {"factor_update_interval": 2}
    with pytest.raises(ValueError, match="'budget' is not an overhead budget's choice"):
        opt.preconditioner.check_state_dict(state)
