"""``factor_batch_size``: statistics from the first samples only, on the per-sample scale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import parse_args
from dkfac.app.runconfig import kfac_config_from_args

DT = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)
    ).to(DT)


def _factors(x: torch.Tensor, y: torch.Tensor, **options: object) -> dict:
    model = _model()
    pre = KFACPreconditioner(model, factor_decay=0.0, **options)  # type: ignore[arg-type]
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return pre.factors()


@pytest.mark.parametrize("reduction", [None, "sum"])
def test_first_samples_give_the_factors_of_those_samples_alone(reduction: str | None) -> None:
    """A and G of the first k of B samples (mean loss over B) equal those of a k-sample batch."""
    x = torch.randn(6, 2, 5, 5, dtype=DT)
    y = torch.randint(0, 4, (6,))
    sliced = _factors(x, y, factor_batch_size=2, conv_reduction=reduction)
    alone = _factors(x[:2], y[:2], conv_reduction=reduction)
    whole = _factors(x, y, conv_reduction=reduction)
    for name in alone:
        for got, want, other in zip(sliced[name], alone[name], whole[name], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            assert not torch.allclose(got, other)  # the slice really changed the factors


def test_batch_not_larger_than_the_limit_is_used_whole() -> None:
    x = torch.randn(3, 2, 5, 5, dtype=DT)
    y = torch.randint(0, 4, (3,))
    limited, whole = _factors(x, y, factor_batch_size=3), _factors(x, y)
    for name in whole:
        for got, want in zip(limited[name], whole[name], strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_factor_batch_size_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="factor_batch_size"):
        KFACConfig(factor_batch_size=bad)  # type: ignore[arg-type]


def test_factor_batch_size_flag() -> None:
    assert kfac_config_from_args(parse_args(["train"])).factor_batch_size is None
    args = parse_args(["train", "--optimizer", "kfac", "--factor-batch-size", "32"])
    assert kfac_config_from_args(args).factor_batch_size == 32
    with pytest.raises(SystemExit):
        parse_args(["train", "--factor-batch-size", "many"])
