"""The K-FAC spec keys of ``dkfac bench`` that set the inner optimizer (bench/peers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from dkfac.bench.peers import OptimizerSpec, build_optimizer, check_kfac_options, kfac_parts


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_inner_keys_set_the_sgd_and_booleans_reach_the_preconditioner() -> None:
    options = {
        "method": "eigen_adam",
        "inner_momentum": 0,
        "inner_weight_decay": 0.1,
        "moment_nesterov": "True",
        "moment_bias_correction": "False",
    }
    opt = build_optimizer(OptimizerSpec("ea", "kfac", [0.01], options), _model(), 0.01, 0.9)
    assert isinstance(opt, KFACOptimizer) and isinstance(opt.inner, torch.optim.SGD)
    group = opt.inner.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["lr"]) == (0.0, 0.1, 0.01)
    config = opt.preconditioner.config
    assert config.moment_nesterov is True and config.moment_bias_correction is False


def test_without_inner_keys_the_benchmark_momentum_applies() -> None:
    opt = build_optimizer(OptimizerSpec("k", "kfac", [0.1], {}), _model(), 0.1, 0.9)
    assert isinstance(opt, KFACOptimizer)
    assert (opt.inner.param_groups[0]["momentum"], opt.inner.param_groups[0]["weight_decay"]) == (
        0.9,
        0.0,
    )


def test_an_unknown_inner_key_is_refused() -> None:
    spec = OptimizerSpec("k", "kfac", [0.1], {"inner_nesterov": 1})
    with pytest.raises(ValueError, match="inner_nesterov"):
        build_optimizer(spec, _model(), 0.1, 0.9)


def test_inner_adamw_takes_its_beta1_and_decay_from_the_inner_keys() -> None:
    options = {"inner": "adamw", "inner_momentum": 0.5, "inner_weight_decay": 0.1, "damping": 0.1}
    opt = build_optimizer(OptimizerSpec("k", "kfac", [0.01], options), _model(), 0.01, 0.0)
    assert isinstance(opt, KFACOptimizer) and type(opt.inner) is torch.optim.AdamW
    group = opt.inner.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.5, 0.999), 0.1)
    assert opt.preconditioner.config.damping == 0.1
    # not given: Adam's usual beta1 (not the benchmark's SGD momentum, 0.0 here) and no decay
    plain = build_optimizer(
        OptimizerSpec("k", "kfac", [0.01], {"inner": "adamw"}), _model(), 0.01, 0.0
    )
    assert isinstance(plain, KFACOptimizer)
    group = plain.inner.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.999), 0.0)


def test_the_first_inner_adamw_step_moves_every_weight_by_lr() -> None:
    """Oracle: Adam's first bias-corrected step is lr * g / (|g| + eps), whatever the
    preconditioner did to g: every parameter with a gradient moves by lr (an SGD step
    would move each by lr times its preconditioned gradient)."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    spec = OptimizerSpec("k", "kfac", [0.01], {"inner": "adamw", "method": "cholesky"})
    opt = build_optimizer(spec, model, 0.01, 0.9)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for old, new in zip(before, model.parameters(), strict=True):
        moved = (new.detach() - old).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, 0.01), rtol=1e-3, atol=0.0)


def test_kfac_parts_splits_inner_and_preconditioner_options() -> None:
    inner, pre = kfac_parts({"inner_momentum": 0, "damping": 3, "moment_nesterov": "True"})
    assert inner == {"inner": "sgd", "inner_momentum": 0}
    assert pre == {"damping": 3, "moment_nesterov": True}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inner": "adam"}, "kfac option inner must be sgd or adamw, got 'adam'"),
        ({"inner_momentum": 1.0}, "inner_momentum must be a number in [0, 1), got 1.0"),
        ({"inner_momentum": "x"}, "inner_momentum must be a number in [0, 1), got 'x'"),
        ({"inner_weight_decay": -0.1}, "inner_weight_decay must be a number in >= 0"),
        ({"inner_beta2": 0.9}, "kfac takes no option inner_beta2; inner ones: inner, "),
        ({"damping": -1.0}, "kfac option: "),
        ({"dampin": 1.0}, "kfac option: "),
        ({"overhead": -0.3}, "kfac option: overhead"),
        ({"overhead": "x"}, "kfac option: overhead"),
    ],
)
def test_bad_kfac_options_are_refused_before_any_run(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        check_kfac_options(options)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises((ValueError, TypeError)):  # the same options, when built
        build_optimizer(OptimizerSpec("k", "kfac", [0.1], options), _model(), 0.1, 0.9)


def test_a_kfac_spec_takes_the_overhead_budget() -> None:
    options = {"method": "eigen_adam", "overhead": 0.3, "inner_momentum": 0}
    check_kfac_options(options)
    opt = build_optimizer(OptimizerSpec("k", "kfac", [0.1], options), _model(), 0.1, 0.9)
    budget = opt.preconditioner.budget  # type: ignore[attr-defined]
    assert budget is not None and budget.budget == 0.3 and budget.explicit == {}
    plain = build_optimizer(OptimizerSpec("k", "kfac", [0.1], {}), _model(), 0.1, 0.9)
    assert plain.preconditioner.budget is None  # type: ignore[attr-defined]
