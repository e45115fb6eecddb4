"""The refresh policies: fixed intervals and SP-NGD's adaptive controller."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.engine.refresh import AdaptiveRefresh, FixedRefresh, relative_change


def test_relative_change_formula() -> None:
    old = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    new = torch.tensor([[3.0, 0.0], [0.0, 5.0]])
    assert relative_change(old, new) == pytest.approx(1 / 5)
    assert relative_change(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_change(torch.zeros(2), torch.ones(2)) == math.inf


def test_fixed_refresh_follows_interval_schedule() -> None:
    policy = FixedRefresh(lambda step: 1 if step < 4 else 3)
    assert [s for s in range(12) if policy.due("x", s)] == [0, 1, 2, 3, 6, 9]


def test_adaptive_interval_sequence_for_scripted_matrices() -> None:
    """Stable statistics double their interval up to the cap; a jump halves it."""
    policy = AdaptiveRefresh(threshold=0.1, max_interval=8)
    base = torch.eye(3)
    # The value the statistic has whenever it is refreshed: stable (1 % change) except a
    # 50 % jump at the 6th refresh, then stable again.
    scale = [1.0, 1.01, 1.02, 1.03, 1.04, 1.56, 1.57, 1.58]
    refreshed: list[int] = []
    intervals: list[int] = []
    old = None
    step = 0
    while len(refreshed) < len(scale):
        if policy.due("A", step):
            new = base * scale[len(refreshed)]
            policy.record("A", step, old, new)
            refreshed.append(step)
            intervals.append(policy.interval("A"))
            old = new
        step += 1
    # first refresh has nothing to compare with: interval stays 1
    assert intervals == [1, 2, 4, 8, 8, 4, 8, 8]
    assert refreshed == [0, 1, 3, 7, 15, 23, 27, 35]


def test_adaptive_statistics_are_independent() -> None:
    policy = AdaptiveRefresh(threshold=0.5)
    policy.record("A", 0, None, torch.ones(2))
    policy.record("A", 1, torch.ones(2), torch.ones(2))  # stable: interval 2
    policy.record("G", 0, None, torch.ones(2))
    policy.record("G", 1, torch.ones(2), 3 * torch.ones(2))  # jump: stays 1
    assert (policy.interval("A"), policy.interval("G")) == (2, 1)
    assert not policy.due("A", 2) and policy.due("G", 2)


def test_adaptive_state_round_trip() -> None:
    policy = AdaptiveRefresh()
    policy.record("A", 0, None, torch.ones(2))
    policy.record("A", 1, torch.ones(2), torch.ones(2))
    restored = AdaptiveRefresh()
    restored.load_state_dict(policy.state_dict())
    assert restored.state_dict() == policy.state_dict() == {"A": [2, 3, 2]}


@pytest.mark.parametrize("kwargs", [{"threshold": 0.0}, {"threshold": -1}, {"max_interval": 0}])
def test_adaptive_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AdaptiveRefresh(**kwargs)


def test_due_keys_answers_as_due_does_for_each_statistic() -> None:
    """A layer's statistics due at a step are those :meth:`due` names, for both policies,
    also after a fixed interval is replaced within a step (the kept answer is the old
    interval's)."""
    fixed = FixedRefresh(2)
    adaptive = AdaptiveRefresh(threshold=0.1, max_interval=8)
    adaptive.record("layer/A", 0, None, torch.eye(2))  # A: next at 1; G: never refreshed yet
    for policy in (fixed, adaptive):
        for step in range(6):
            expected = {key for key in ("A", "G") if policy.due(f"layer/{key}", step)}
            assert policy.due_keys("layer", ("A", "G"), step) == expected
    assert fixed.due_keys("layer", ("A", "G"), 3) == set()
    fixed.interval = 3
    assert fixed.due_keys("layer", ("A", "G"), 3) == {"A", "G"}
    assert fixed.due_keys("other", (), 3) == set()


@pytest.mark.parametrize("scale", [1.0, 2.1e9])
def test_the_adaptive_refresh_reads_a_change_of_factors_whose_norm_overflows(
    scale: float,
) -> None:
    """Inputs near 1e9 give factor entries near 1e19: finite, but their squares overflow
    float32, so a float32 norm was Inf and every relative change 0 (the interval doubled
    while A changed by 69%). Oracle: the same intervals at both scales (A's relative change
    does not depend on the inputs' scale): doubled while A holds, halved when it moves."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen) * scale
    y = torch.randint(0, 4, (64,), generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    pre = KFACPreconditioner(model, refresh="adaptive", factor_decay=0.0, lr=0.0)
    intervals = []
    for step in range(4):
        xs = x if step < 3 else x * 1.3  # A changes by 1.3² − 1 = 69% at step 3
        model.zero_grad()
        F.cross_entropy(model(xs), y).backward()
        pre.step()
        intervals.append(pre.refresh.interval("/A"))
    assert intervals == [1, 2, 2, 1]
