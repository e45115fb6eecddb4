"""The overhead budget: the rule as a pure function of counted costs, and in a preconditioner."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.config.schedules import EarlyRefresh, resolve
from dkfac.costmodel.budget import (
    DISPATCH_FLOPS,
    MIN_FACTOR_ROWS,
    MIN_FACTOR_SAMPLES,
    OVER_BUDGET_ALLOWANCE,
    OVER_BUDGET_POLAR_STEPS,
    Choice,
    Costs,
    LayerShape,
    basis_limit,
    choose,
    choose_for,
    layer_costs,
    min_factor_batch,
)


def test_layer_costs_are_the_counted_flops() -> None:
    d = DISPATCH_FLOPS
    costs = layer_costs(
        [LayerShape(a=5, g=3, rows=7, polar_steps=2), LayerShape(a=9, g=2, rows=4, a_parts=(3, 3))]
    )
    assert costs.step == 6 * 7 * 5 * 3 + 6 * 4 * 9 * 2 + 6 * d
    polar = 2 * (6 * 5 * 3 * 3 + 4 * d)  # two Newton-Schulz steps on the first layer
    # a flattened map's input side is rotated through its channel and position bases
    assert costs.fixed == 4 * 5 * 3 * 8 + 4 * 9 * 2 * (3 + 3 + 2) + 28 * d + polar
    assert costs.capture == 2 * 7 * (25 + 9) + 2 * 4 * (81 + 4)
    assert costs.capture_dispatch == 8 * d  # four operations a layer, whatever the batch
    # ... and refreshed as those two sides
    assert costs.refresh == 10 * (125 + 27) + 10 * (27 + 27 + 8) + 32 * d


def test_a_unit_wise_layer_is_priced_per_unit() -> None:
    """A grouped convolution's 6 output channels of 10 parameters, from 4 samples' 12 rows:
    per-sample unit gradients and their products, an eigh per unit, two products a step."""
    d = DISPATCH_FLOPS
    costs = layer_costs([LayerShape(a=10, g=6, rows=12, units=4)])
    assert costs.step == 6 * 12 * 10 * 6 + 3 * d
    assert costs.capture == 2 * 12 * 10 * 6 + 2 * 4 * 6 * 100
    assert costs.capture_dispatch == 4 * d
    assert costs.fixed == 4 * 6 * 100 + 12 * d
    assert costs.refresh == 10 * 6 * 1000 + 4 * d


COSTS = Costs(step=100.0, fixed=5.0, capture=40.0, refresh=200.0)


def _overhead(batch: int, b: int, fi: int, ii: int, costs: Costs = COSTS) -> float:
    capture = costs.capture * b / batch + costs.capture_dispatch
    return (costs.fixed + capture / fi + costs.refresh / ii) / costs.step


def test_a_smaller_factor_batch_cuts_a_captures_products_not_its_operations() -> None:
    """A capture whose operations alone cost 40% of the step every step cannot fit a 30%
    budget by cutting its batch: the captures come every other step, from the largest
    batch that then fits the freshest (staleness 1.5: half the batch, every 2nd step)."""
    costs = Costs(step=100.0, fixed=5.0, capture=8.0, refresh=10.0, capture_dispatch=40.0)
    choice = choose(costs, 256, 0.3)
    assert (choice.factor_batch_size, choice.factor_update_interval) == (128, 2)
    assert choice.inverse_update_interval == 5
    assert choice.overhead == pytest.approx(_overhead(256, 128, 2, 5, costs)) == 0.29
    assert _overhead(256, 32, 1, 50, costs) > 0.3  # the smallest batch every step does not fit


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


def test_a_factor_interval_longer_than_every_basis_interval_refreshes_with_the_factors() -> None:
    """``factor_update_interval=100`` left no inverse interval of at least 100 to choose
    from: ``min()`` of no candidates, a ValueError at the first step of ``for_model``."""
    choice = choose(COSTS, 256, 0.3, {"factor_update_interval": 100})
    assert (choice.factor_update_interval, choice.inverse_update_interval) == (100, 100)
    assert choice.factor_batch_size is None  # every batch fits: the freshest, the whole batch
    assert choice.overhead == pytest.approx(_overhead(256, 256, 100, 100)) == 0.074
    assert choice.within_budget


def test_when_nothing_fits_the_freshest_near_the_cheapest_is_taken() -> None:
    costly = Costs(step=100.0, fixed=80.0, capture=40.0, refresh=200.0)
    choice = choose(costly, 256, 0.3)
    assert not choice.within_budget and "no choice fits" in choice.reason
    b, fi = choice.factor_batch_size or 256, choice.factor_update_interval
    ii = choice.inverse_update_interval
    assert choice.overhead == pytest.approx(_overhead(256, b, fi, ii, costly))
    # brute force: the cheapest candidate, and none fresher within the allowance over it
    grid = [
        (bb, f, i)
        for bb in (256, 128, 64, 32)
        for f in (1, 2, 4, 8)
        for i in (5, 10, 20, 50)
        if i >= f
    ]
    cheapest = min(_overhead(256, *c, costly) for c in grid)
    allowed = cheapest + OVER_BUDGET_ALLOWANCE * 0.3
    assert choice.overhead <= allowed + 1e-12

    def staleness(bb: int, f: int, i: int) -> float:
        return 0.5 * math.log2(256 / bb) + math.log2(f) + math.log2(i / 5)

    best = min(staleness(*c) for c in grid if _overhead(256, *c, costly) <= allowed + 1e-12)
    assert staleness(b, fi, ii) == pytest.approx(best)
    # the longest intervals are not taken when a fresher choice costs little more
    assert (b, fi, ii) != (32, 8, 50)


@pytest.mark.parametrize("fixed", [5.0, 20.0, 24.0, 27.0, 29.0, 40.0, 80.0])
@pytest.mark.parametrize(("capture", "refresh"), [(40.0, 200.0), (8.0, 30.0), (120.0, 90.0)])
def test_a_smaller_budget_never_takes_a_costlier_choice(
    fixed: float, capture: float, refresh: float
) -> None:
    """The overhead chosen grows with the budget, through the boundary where the cheapest
    choice stops fitting: there the allowance over the cheapest took up to 10% of the
    budget more than a slightly larger budget took within it (the digits CNN: 31% of its
    step at a 25% budget, 29% at 30%)."""
    costs = Costs(step=100.0, fixed=fixed, capture=capture, refresh=refresh, capture_dispatch=4.0)
    budgets = [round(0.05 + 0.005 * k, 3) for k in range(140)]
    chosen = [choose(costs, 256, budget).overhead for budget in budgets]
    for k in range(len(budgets) - 1):
        low, high = chosen[k], chosen[k + 1]
        assert low <= high + 1e-12, f"{low:.4f} at budget {budgets[k]} > {high:.4f} above it"
    cheapest = min(chosen)
    for budget, overhead in zip(budgets, chosen, strict=True):
        assert overhead <= max(budget, cheapest + OVER_BUDGET_ALLOWANCE * budget) + 1e-12


def test_the_factor_batch_is_cut_to_rows_not_samples() -> None:
    # a classifier's head sees one row per sample: 32 samples
    flat = [LayerShape(65, 128, 256), LayerShape(129, 10, 256)]
    assert min_factor_batch(flat, 256) == MIN_FACTOR_ROWS
    # a language model's every layer sees 64 positions a sequence: 8 sequences
    tokens = [LayerShape(65, 64, 32 * 64), LayerShape(64, 256, 32 * 64)]
    assert min_factor_batch(tokens, 32) == MIN_FACTOR_SAMPLES
    assert min_factor_batch(tokens, 4) == 4  # never more than the batch
    costs = layer_costs(tokens)
    batches = {
        choose(costs, 32, budget, min_batch=8).factor_batch_size for budget in (0.01, 0.1, 1, 10)
    }
    assert 8 in batches and all(b is None or b >= 8 for b in batches)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        min_factor_batch(tokens, 0)


@pytest.mark.parametrize("budget", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_budget_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="overhead budget must be a finite number > 0"):
        choose(COSTS, 256, budget)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)
    )


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 200), nn.Tanh(), nn.Linear(200, 64), nn.Tanh(), nn.Linear(64, 5)
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
    want = choose_for(shapes, 128, 0.3)
    assert want.orthogonal_steps == OVER_BUDGET_POLAR_STEPS  # this MLP's polar is over budget
    config = opt.preconditioner.config
    assert config.orthogonal_steps == OVER_BUDGET_POLAR_STEPS
    layers = opt.preconditioner.layers
    assert layers["2"].solver.options.orthogonal_steps == OVER_BUDGET_POLAR_STEPS  # type: ignore[attr-defined]
    assert "3 steps" in layers["2"].solver.label
    assert config.factor_batch_size == want.factor_batch_size
    assert config.factor_update_interval == want.factor_update_interval
    assert config.inverse_update_interval == _applied(want)
    row = opt.preconditioner.describe()[-1]
    assert row["name"] == "overhead budget" and row["reason"] == want.reason
    for seed in range(1, 4):  # it keeps training, the choice in place
        _step(model, opt, seed)
    assert opt.preconditioner.config.factor_update_interval == want.factor_update_interval


def test_the_polar_steps_are_cut_only_over_the_budget_and_unless_set() -> None:
    hidden = [LayerShape(129, 128, 256, polar_steps=5), LayerShape(129, 10, 256)]
    over = choose_for(hidden, 256, 0.3)
    cut = [LayerShape(129, 128, 256, polar_steps=3), LayerShape(129, 10, 256)]
    assert over.orthogonal_steps == OVER_BUDGET_POLAR_STEPS and not over.within_budget
    # the intervals are chosen with the cheaper polar factors counted
    want = choose(layer_costs(cut), 256, 0.3, min_batch=min_factor_batch(cut, 256))
    assert over.overhead == pytest.approx(want.overhead)
    assert "3 Newton–Schulz steps instead of 5" in over.reason
    assert choose_for(hidden, 256, 100.0).orthogonal_steps is None  # within: kept
    assert choose_for(hidden, 256, 0.3, {"orthogonal_steps": 5}).orthogonal_steps is None
    plain = [LayerShape(129, 128, 256), LayerShape(129, 10, 256)]
    assert choose_for(plain, 256, 0.3).orthogonal_steps is None  # nothing to cut
    assert choose_for(plain, 256, 0.3) == choose(
        layer_costs(plain), 256, 0.3, min_batch=min_factor_batch(plain, 256)
    )


def test_explicit_polar_steps_win_over_the_budget() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3, orthogonal_steps=4)
    _step(model, opt, 0)
    assert opt.preconditioner.config.orthogonal_steps == 4
    assert opt.preconditioner.layers["2"].solver.options.orthogonal_steps == 4  # type: ignore[attr-defined]
    assert opt.preconditioner.budget.choice.orthogonal_steps is None  # type: ignore[union-attr]


def test_a_choice_saved_without_polar_steps_loads() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.preconditioner.state_dict()
    del state["budget"]["orthogonal_steps"]
    twin = KFACOptimizer.for_model(_mlp(), overhead=0.3)
    twin.preconditioner.load_state_dict(state)
    assert twin.preconditioner.budget.choice.orthogonal_steps is None  # type: ignore[union-attr]
    assert twin.preconditioner.layers["2"].solver.options.orthogonal_steps == 5  # type: ignore[attr-defined]


def test_explicit_intervals_win_over_the_budget() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.01, inverse_update_interval=3)
    _step(model, opt, 0)
    config = opt.preconditioner.config
    assert config.inverse_update_interval == 3
    assert "kept as given: inverse_update_interval" in opt.preconditioner.describe()[-1]["reason"]
    pre = KFACPreconditioner(_mlp(), overhead=0.3, factor_update_interval=2)
    assert pre.budget is not None and pre.budget.explicit == {"factor_update_interval": 2}


@pytest.mark.parametrize(
    "given",
    [
        {"factor_update_interval": 100},
        {"inverse_update_interval": lambda step: 3 if step < 10 else 30},
        {"factor_update_interval": lambda step: 2, "inverse_update_interval": 4},
    ],
    ids=["long-factor-interval", "inverse-schedule", "factor-schedule"],
)
def test_intervals_the_budget_cannot_choose_from_train_as_given(given: dict[str, object]) -> None:
    """A schedule (a callable of the step) is priced at its value at step 0 and kept as
    given: it was divided by, or compared with, as a number (a TypeError at the first
    step). The choice prices what runs: the intervals of the first step."""
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3, **given)  # type: ignore[arg-type]
    before = [p.detach().clone() for p in model.parameters()]
    for seed in range(3):
        _step(model, opt, seed)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    choice = opt.preconditioner.budget.choice  # type: ignore[union-attr]
    assert choice is not None and "kept as given" in choice.reason
    config = opt.preconditioner.config
    for name, value in given.items():
        assert getattr(config, name) is value  # the schedule itself, not its first value
        assert getattr(choice, name) == (value(0) if callable(value) else value)  # type: ignore[operator]
    if "inverse_update_interval" not in given:  # the basis comes with the factors
        assert choice.inverse_update_interval == choice.factor_update_interval == 100


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


@pytest.mark.parametrize("build", [_mlp, _wide], ids=["mlp", "one-sided"])
def test_the_choice_is_saved_and_a_resumed_run_continues_as_the_uninterrupted_one(
    build: Callable[[], nn.Module],
) -> None:
    """A run resumed before its first step there takes the saved choice (the budget would
    otherwise choose only after a step at the fixed intervals), one-sided sides included."""
    model, twin = build(), build()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.state_dict()
    twin.load_state_dict(model.state_dict())
    resumed = KFACOptimizer.for_model(twin, overhead=0.3)
    resumed.load_state_dict(state)
    chosen = opt.preconditioner.budget.choice  # type: ignore[union-attr]
    assert resumed.preconditioner.budget.choice == chosen  # type: ignore[union-attr]
    for name, layer in opt.preconditioner.layers.items():
        options = resumed.preconditioner.layers[name].solver.options  # type: ignore[attr-defined]
        assert options == layer.solver.options  # type: ignore[attr-defined]
    assert resumed.preconditioner.config.inverse_update_interval == (
        opt.preconditioner.config.inverse_update_interval
    )
    for seed in range(1, 6):
        _step(model, opt, seed)
        _step(twin, resumed, seed)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved_after", [0, 1], ids=["before-any-choice", "with-a-choice"])
@pytest.mark.parametrize("build", [_mlp, _wide], ids=["mlp", "one-sided"])
def test_an_earlier_state_loaded_into_a_stepped_optimizer_continues_as_a_fresh_one(
    build: Callable[[], nn.Module], saved_after: int
) -> None:
    """An optimizer that stepped on other batches (an lr finder on small ones) and then
    loads a state saved earlier, before the budget chose or after a choice on full
    batches, continues exactly as a new optimizer loading the same state: its own choice
    (intervals, Newton-Schulz steps, one-sided sides) undone, not kept."""
    model = build()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    for seed in range(saved_after):
        _step(model, opt, seed)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for seed in range(100, 104):  # steps on batches of 8: another choice
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 20, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.preconditioner.budget.choice is not None  # type: ignore[union-attr]
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    fresh = build()
    fresh.load_state_dict(weights)
    fresh_opt = KFACOptimizer.for_model(fresh, overhead=0.3)
    fresh_opt.load_state_dict(state)
    assert opt.preconditioner.config == fresh_opt.preconditioner.config
    for seed in range(saved_after, saved_after + 6):
        _step(model, opt, seed)
        _step(fresh, fresh_opt, seed)
    assert opt.preconditioner.budget.choice == fresh_opt.preconditioner.budget.choice  # type: ignore[union-attr]
    for name, layer in opt.preconditioner.layers.items():
        twin = fresh_opt.preconditioner.layers[name]
        assert layer.solver.options == twin.solver.options  # type: ignore[attr-defined]
        assert layer.kinds == twin.kinds
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_saved_choice_that_is_not_one_is_refused() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.preconditioner.state_dict()
    state["budget"] = {"factor_update_interval": 2}
    with pytest.raises(ValueError, match="'budget' is not an overhead budget's choice"):
        opt.preconditioner.check_state_dict(state)
    good = opt.preconditioner.state_dict()["budget"]
    for limits in ({"nope": 96}, {"0": 0}, {"0": 9.5}, [("0", 96)]):
        state["budget"] = {**good, "basis_max_dims": limits}
        with pytest.raises(ValueError, match="basis_max_dims must map this model's layer"):
            opt.preconditioner.check_state_dict(state)


def test_a_refused_choice_changes_nothing() -> None:
    """A choice whose options no configuration takes is refused before anything changes:
    the optimizer then trains as its untouched twin."""
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    state = opt.preconditioner.state_dict()
    state["budget"]["orthogonal_steps"] = 0
    target, untouched = _mlp(), _mlp()
    loaded = KFACOptimizer.for_model(target, overhead=0.3)
    fresh = KFACOptimizer.for_model(untouched, overhead=0.3)
    with pytest.raises(ValueError, match=r"'budget' holds a choice .* orthogonal_steps"):
        loaded.preconditioner.load_state_dict(state)
    assert loaded.preconditioner.budget.choice is None  # type: ignore[union-attr]
    for seed in range(3):
        _step(target, loaded, seed)
        _step(untouched, fresh, seed)
    for a, b in zip(target.parameters(), untouched.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_choice_loads_into_another_method_without_newton_schulz_steps() -> None:
    """The default's checkpoint (Newton-Schulz steps chosen for its orthogonalised layers)
    loads into ``method="eigen"``, which has none: its intervals and factor batch apply."""
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    _step(model, opt, 0)
    chosen = opt.preconditioner.budget.choice  # type: ignore[union-attr]
    assert chosen is not None and chosen.orthogonal_steps is not None
    target = _mlp()
    eigen = KFACOptimizer.for_model(target, overhead=0.3, method="eigen")
    eigen.load_state_dict(opt.state_dict())
    taken = eigen.preconditioner.budget.choice  # type: ignore[union-attr]
    assert taken is not None and taken.orthogonal_steps is None
    config = eigen.preconditioner.config
    assert config.inverse_update_interval == _applied(chosen)
    assert config.factor_update_interval == chosen.factor_update_interval
    for seed in range(1, 4):
        _step(target, eigen, seed)
    assert all(torch.isfinite(p).all() for p in target.parameters())


def test_one_sided_sides_are_neither_rotated_nor_refreshed_in_the_count() -> None:
    d = DISPATCH_FLOPS
    assert basis_limit(256) == 192  # 3/4 of the rows: 2s/(3 rows) > ONE_SIDED_SHARE
    assert basis_limit(1) == 1  # a layer that saw one row keeps a 1-wide basis
    wide = LayerShape(a=9, g=300, rows=100, basis_max=75)  # its output side is one-sided
    both = LayerShape(a=90, g=80, rows=100, basis_max=75)  # Adam on the raw gradient
    mapped = LayerShape(a=96, g=80, rows=100, a_parts=(8, 12), basis_max=75)  # kept: structured
    costs = layer_costs([wide, both, mapped])
    assert costs.fixed == 4 * 9 * 300 * 9 + 0 + 4 * 96 * 80 * (8 + 12) + 42 * d
    assert costs.refresh == 10 * 9**3 + 0 + 10 * (8**3 + 12**3) + 48 * d
    plain = layer_costs([LayerShape(a=9, g=300, rows=100)])
    assert plain.fixed == 4 * 9 * 300 * 309 + 14 * d  # no limit: both sides


def test_one_sided_and_blocked_sides_are_priced_as_they_are_kept() -> None:
    """A one-sided side is captured as its diagonal (``n`` products a row); a side cut into
    blocks of ``b`` captures ``n · b``, rotates in ``b`` and refreshes ``n · b²``; a side
    no wider than the block, and a flattened map's structured side, stay whole."""
    d = DISPATCH_FLOPS
    wide = LayerShape(a=9, g=300, rows=100, basis_max=75)  # G one-sided
    blocked = LayerShape(a=90, g=40, rows=100, block=32)  # A in blocks of 32, G whole
    mapped = LayerShape(a=96, g=80, rows=100, a_parts=(8, 12), block=32)  # A structured
    costs = layer_costs([wide, blocked, mapped])
    captured = (81 + 300) + (90 * 32 + 40 * 32) + (96 * 96 + 80 * 32)
    assert costs.capture == 2 * 100 * captured
    assert costs.fixed == (
        4 * 9 * 300 * 9 + 4 * 90 * 40 * (32 + 32) + 4 * 96 * 80 * (8 + 12 + 32) + 42 * d
    )
    assert costs.refresh == (
        10 * 9**3 + 10 * (90 * 32**2 + 40 * 32**2) + 10 * (8**3 + 12**3 + 80 * 32**2) + 48 * d
    )
    whole = layer_costs([LayerShape(a=90, g=40, rows=100)])
    assert whole.capture == 2 * 100 * (90**2 + 40**2)


def test_the_budget_prices_the_sides_a_layer_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running budget hands :func:`choose_for` each layer with the sides it keeps: a
    given ``basis_block_size`` and ``basis_max_dim`` (and its own one-sided limit)."""
    from dkfac.engine import overhead

    seen: list[list[LayerShape]] = []

    def recording(layers: list[LayerShape], *args: object, **kwargs: object) -> object:
        seen.append(list(layers))
        return choose_for(layers, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(overhead, "choose_for", recording)
    for options, want in (
        (
            {"basis_block_size": 64},
            [
                LayerShape(21, 200, 128, basis_max=96, block=64),
                LayerShape(201, 64, 128, polar_steps=5, basis_max=96, block=64),
                LayerShape(65, 5, 128, block=64),
            ],
        ),
        (
            {"basis_max_dim": 150},
            [
                LayerShape(21, 200, 128, basis_max=150),
                LayerShape(201, 64, 128, polar_steps=5, basis_max=150),
                LayerShape(65, 5, 128, basis_max=150),
            ],
        ),
    ):
        seen.clear()
        model = _wide()
        opt = KFACOptimizer.for_model(model, overhead=0.3, **options)
        _step(model, opt, 0)
        assert seen and seen[-1] == want, options


def test_a_side_too_wide_for_its_rows_is_one_sided_from_the_first_refresh() -> None:
    """Batch 128: sides wider than 96 keep the identity (the 200-wide output of the first
    layer, the 201-wide input of the second), from the first step on; the first step's
    update is then the one of the same sides made one-sided by hand (``basis_max_dim``)."""
    model, twin = _wide(), _wide()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    hand = KFACOptimizer.for_model(twin, overhead=None, basis_max_dim=96)
    _step(model, opt, 0)
    _step(twin, hand, 0)
    pre = opt.preconditioner
    assert pre.budget is not None and pre.budget.choice is not None
    assert pre.budget.choice.basis_max_dims == {"0": 96, "2": 96}
    layers = pre.layers
    assert layers["0"].solver.options.max_dim == 96  # type: ignore[attr-defined]
    assert layers["4"].solver.options.max_dim is None  # type: ignore[attr-defined]
    assert layers["0"].solver_state["qg"].numel() == 0  # type: ignore[index]
    assert layers["0"].solver_state["qa"].shape == (21, 21)  # type: ignore[index]
    assert layers["2"].solver_state["qa"].numel() == 0  # type: ignore[index]
    assert "one-sided bases" in pre.describe()[-1]["reason"]
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    shapes = [
        LayerShape(21, 200, 128, basis_max=96),
        LayerShape(201, 64, 128, polar_steps=5, basis_max=96),
        LayerShape(65, 5, 128),
    ]
    want = choose_for(shapes, 128, 0.3)  # counted without the one-sided sides' work
    assert pre.config.inverse_update_interval == _applied(want)
    assert pre.config.factor_update_interval == want.factor_update_interval


def test_an_explicit_basis_max_dim_wins_over_the_rule() -> None:
    model = _wide()
    opt = KFACOptimizer.for_model(model, overhead=0.3, basis_max_dim=1000)
    _step(model, opt, 0)
    pre = opt.preconditioner
    assert pre.budget is not None and pre.budget.choice is not None
    assert pre.budget.choice.basis_max_dims == {}
    assert pre.layers["0"].solver.options.max_dim == 1000  # type: ignore[attr-defined]
    assert pre.layers["0"].solver_state["qg"].shape == (200, 200)  # type: ignore[index]
    assert "kept as given: basis_max_dim" in pre.describe()[-1]["reason"]


def _applied(choice: Choice) -> int | EarlyRefresh:
    """The ``inverse_update_interval`` a preconditioner runs a choice with."""
    fi, ii = choice.factor_update_interval, choice.inverse_update_interval
    return EarlyRefresh(fi, ii) if ii > fi else ii


def test_a_long_basis_interval_refreshes_once_more_at_the_first_capture_after_the_first() -> None:
    schedule = EarlyRefresh(8, 50)
    refreshes = [
        s for s in range(120) if s % int(resolve("inverse_update_interval", schedule, s) or 1) == 0
    ]
    assert refreshes == [0, 8, 50, 100]
    assert [s for s in range(60) if s % EarlyRefresh(4, 20)(s) == 0] == [0, 4, 20, 40]
    # a preconditioner under the budget refreshes so: this MLP's choice is factors every 8
    # steps and bases every 50
    model = _mlp()
    opt = KFACOptimizer.for_model(model, overhead=0.3)
    seen = []
    for step in range(60):
        _step(model, opt, step)
        seen.append(opt.preconditioner.layers["0"].solver_state["qa"].clone())  # type: ignore[index]
    choice = opt.preconditioner.budget.choice  # type: ignore[union-attr]
    assert (choice.factor_update_interval, choice.inverse_update_interval) == (8, 50)
    assert "bases every 50 (and at step 8)" in choice.reason
    changed = [s for s in range(1, 60) if not torch.equal(seen[s], seen[s - 1])]
    assert changed == [8, 50]
