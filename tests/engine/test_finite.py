"""all_finite against the definition, torch.isfinite(t).all(), on the values that matter."""

from __future__ import annotations

import pytest
import torch

from dkfac.engine.finite import all_finite

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_entry_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(37, 11, generator=gen).to(dtype)
    assert bool(all_finite(t)) is bool(torch.isfinite(t).all()) is True
    for index in (0, 200, t.numel() - 1):
        broken = t.clone()
        broken.view(-1)[index] = bad
        assert bool(all_finite(broken)) is bool(torch.isfinite(broken).all()) is False


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_of_both_signs_is_found(dtype: torch.dtype) -> None:
    t = torch.tensor([1.0, float("inf"), float("-inf"), 2.0], dtype=dtype)
    assert not bool(all_finite(t))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_large_half_precision_values_are_no_false_alarm(dtype: torch.dtype) -> None:
    # 4096 entries of 6e4 sum past float16's largest value (65504): summed in float32.
    t = torch.full((64, 64), 6.0e4, dtype=dtype)
    assert bool(torch.isfinite(t).all())
    assert bool(all_finite(t))


def test_integer_empty_and_shape() -> None:
    assert bool(all_finite(torch.arange(5)))
    assert bool(all_finite(torch.zeros(0)))
    flag = all_finite(torch.ones(3, 3))
    assert flag.shape == () and flag.dtype == torch.bool
