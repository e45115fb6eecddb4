"""The K-FAC spec keys of ``dkfac bench`` that set the inner SGD (bench/peers.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer
from dkfac.bench.peers import OptimizerSpec, build_optimizer


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
