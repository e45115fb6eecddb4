"""Oracle tests for dkfac.app.schedules: every schedule equals its closed-form formula."""

from __future__ import annotations

import math

import pytest
import torch

from dkfac.app.schedules import (
    PiecewiseSchedule,
    lr_factor,
    make_lr_lambda,
    parse_piecewise,
    piecewise_by_step,
)
from dkfac.config import KFACConfig, resolve

S, T = 10, 100  # steps per epoch, total steps


def test_constant_is_one_and_warmup_is_linear() -> None:
    for step in range(T):
        assert lr_factor(step, schedule="constant", steps_per_epoch=S, total_steps=T) == 1.0
    w = 25  # 2.5 epochs
    for step in range(T):
        expected = (step + 1) / w if step < w else 1.0
        got = lr_factor(
            step, schedule="constant", steps_per_epoch=S, total_steps=T, warmup_epochs=2.5
        )
        assert got == pytest.approx(expected, rel=1e-12)


def test_step_decay_at_epoch_milestones() -> None:
    for step in range(T):
        expected = 0.5 ** sum(step >= m * S for m in (3, 7))
        got = lr_factor(
            step, schedule="step", steps_per_epoch=S, total_steps=T, milestones=[3, 7], gamma=0.5
        )
        assert got == expected
    assert lr_factor(29, schedule="step", steps_per_epoch=S, total_steps=T, milestones=[3]) == 1
    assert lr_factor(30, schedule="step", steps_per_epoch=S, total_steps=T, milestones=[3]) == (
        pytest.approx(0.1)
    )


@pytest.mark.parametrize("warmup_epochs", [0.0, 2.0])
def test_cosine_and_poly_formulas(warmup_epochs: float) -> None:
    w = int(warmup_epochs * S)
    for step in range(T + 5):
        p = min(max((step - w) / (T - w), 0.0), 1.0)
        warm = (step + 1) / w if step < w else 1.0
        cos = lr_factor(
            step, schedule="cosine", steps_per_epoch=S, total_steps=T, warmup_epochs=warmup_epochs
        )
        poly = lr_factor(
            step,
            schedule="poly",
            steps_per_epoch=S,
            total_steps=T,
            warmup_epochs=warmup_epochs,
            power=3.0,
        )
        assert cos == pytest.approx(warm * 0.5 * (1 + math.cos(math.pi * p)), abs=1e-12)
        assert poly == pytest.approx(warm * (1 - p) ** 3, abs=1e-12)
    assert lr_factor(T, schedule="cosine", steps_per_epoch=S, total_steps=T) == pytest.approx(0)


def test_lambda_lr_follows_the_factor() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.4)
    lam = make_lr_lambda(schedule="cosine", steps_per_epoch=S, total_steps=T, warmup_epochs=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for step in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.4 * lam(step), rel=1e-12)
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "linear"}, "schedule must be one of"),
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
        ({"warmup_epochs": -1.0}, "warmup_epochs"),
    ],
)
def test_lr_factor_validation(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"schedule": "cosine", "steps_per_epoch": S, "total_steps": T}
    with pytest.raises(ValueError, match=match):
        make_lr_lambda(**{**base, **kwargs})  # type: ignore[arg-type]


def test_parse_piecewise() -> None:
    assert parse_piecewise("1e-2@0,1e-3@5") == [(0.0, 1e-2), (5.0, 1e-3)]
    assert parse_piecewise("1e-3@5, 1e-2@0") == [(0.0, 1e-2), (5.0, 1e-3)]
    assert parse_piecewise("0.05") == [(0.0, 0.05)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1e-3@5", "must start at epoch 0"),
        ("a@0", "expected VALUE@EPOCH"),
        ("1@0,,2@3", "empty piece"),
        ("1@0,2@0", "twice"),
        ("1@-1", "epoch >= 0"),
        ("nan@0", "finite"),
    ],
)
def test_parse_piecewise_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_piecewise(text)


def test_piecewise_values_by_step_and_in_kfac_config() -> None:
    sched = piecewise_by_step("1e-2@0,1e-3@1.5,1e-4@3", steps_per_epoch=4)
    expected = [1e-2] * 6 + [1e-3] * 6 + [1e-4] * 4  # switches at steps 6 and 12
    assert [sched(s) for s in range(16)] == expected
    interval = piecewise_by_step("10@0,50@2", steps_per_epoch=3, integer=True)
    assert [interval(s) for s in (0, 5, 6, 9)] == [10, 10, 50, 50]
    assert isinstance(interval(6), int)
    config = KFACConfig(damping=sched, inverse_update_interval=interval)
    assert resolve("damping", config.damping, 7) == 1e-3
    assert resolve("inverse_update_interval", config.inverse_update_interval, 6) == 50
    assert isinstance(sched, PiecewiseSchedule)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        piecewise_by_step("1@0", 0)
