"""A finite gradient whose squares overflow is handled as a NaN one.

Adam's second moment squares the gradient: a float32 gradient with a 2-norm above about
1.8e19 makes it Inf, and an Inf second moment stays Inf (every later update of those
entries 0 or NaN: before, every later step was skipped). Oracle: the run where one step's
gradients are multiplied by 1e28 (a K-FAC layer's and a LayerNorm's, which the leftover
Adam steps) equals, bit for bit, the run where those gradients are NaN: that step skipped,
no moment moved, and training going on after it; on the branching guard and on the guard
kept on the device. The check itself: :func:`~dkfac.engine.finite.all_finite` refuses a
tensor whose squares overflow in its dtype, and nothing smaller.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from dkfac.engine.finite import all_finite, finite_each

BAD_STEP = 3
STEPS = 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.LayerNorm(16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def _run(options: dict[str, Any], bad: float, on_device: bool) -> dict[str, Any]:
    model = _model()
    opt = KFACOptimizer.for_model(model, lr=0.02, **options)
    opt.preconditioner.flags_on_device = on_device
    moved = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == BAD_STEP:
            for param in (model[3].weight, model[1].weight):
                param.grad.mul_(bad) if bad != 0 else param.grad.fill_(float("nan"))
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        after = list(model.parameters())
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, after, strict=True)))
    pre = opt.preconditioner
    pre._guard.late.flush()
    opt._late.flush()
    moments = {
        n: {k: v.clone() for k, v in (s.moments or {}).items()} for n, s in pre.layers.items()
    }
    leftover = pre.leftover.moments if pre.leftover is not None else {}
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": moments,
        "leftover": {n: {k: v.clone() for k, v in m.items()} for n, m in leftover.items()},
        "moved": moved,
        "skipped": opt.skipped_steps,
    }


@pytest.mark.parametrize("on_device", [False, True], ids=["branching", "on-device"])
@pytest.mark.parametrize("options", [{}, {"method": "eigen"}], ids=["default", "eigen"])
def test_an_overflowing_gradient_is_handled_as_a_nan_one(
    options: dict[str, Any], on_device: bool
) -> None:
    huge = _run(options, 1e28, on_device)
    nan = _run(options, 0.0, on_device)
    assert huge["skipped"] == nan["skipped"] == 1
    assert huge["moved"] == nan["moved"] == [i != BAD_STEP for i in range(STEPS)]
    for a, b in zip(huge["params"], nan["params"], strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    for kind in ("moments", "leftover"):
        assert huge[kind].keys() == nan[kind].keys()
        for name, moments in huge[kind].items():
            for key, value in moments.items():
                assert torch.isfinite(value).all(), (kind, name, key)
                assert torch.equal(value, nan[kind][name][key]), (kind, name, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_the_check_refuses_squares_past_the_dtype_s_range(dtype: torch.dtype) -> None:
    largest = torch.finfo(torch.float32 if dtype == torch.float16 else dtype).max
    root = largest**0.5  # a 2-norm whose square is the largest value
    fits = torch.full((4,), min(root / 4, torch.finfo(dtype).max), dtype=dtype)
    assert bool(all_finite(fits))
    assert bool(finite_each([fits, fits.clone()], fits.device).all())
    if dtype != torch.float16:  # a float16 tensor's squares cannot reach float32's largest
        over = torch.full((4,), root, dtype=dtype)
        assert not bool(all_finite(over))
        assert finite_each([fits, over], fits.device).tolist() == [True, False]
        if dtype != torch.float64:  # the multi-tensor 2-norms of a launch-bound device
            assert finite_each([fits, over], fits.device, fused=True).tolist() == [True, False]
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = fits.clone()
        broken[1] = bad
        assert not bool(all_finite(broken))


@pytest.mark.parametrize("fused", [False, True])
def test_a_statistic_s_check_takes_squares_that_overflow(fused: bool) -> None:
    """``squares=False`` (factors, solver states): a tensor of entries 1e20, whose squares
    overflow float32, is finite; NaN and ±Inf are not, nor a sum past float32's range."""
    big = torch.full((4, 4), 1e20)
    assert finite_each([big], big.device, fused=fused).tolist() == [False]
    assert finite_each([big], big.device, fused=fused, squares=False).tolist() == [True]
    past = torch.full((4,), torch.finfo(torch.float32).max / 2)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = big.clone()
        broken[1, 2] = bad
        flags = finite_each([big, broken, past], big.device, fused=fused, squares=False)
        assert flags.tolist() == [True, False, False]


def test_inputs_whose_factors_square_past_float32_train() -> None:
    """Raw features near 1e10 (a Unix time is 1.7e9): the factors' entries (1e20) are
    finite but their squares are not. Refused as non-finite, no layer got a basis and the
    default did not train at all (AdamW does). Oracle: every layer has a basis after the
    first step, no step is skipped, and 8 steps halve the loss (AdamW's: to 0.34 of it;
    the default's to 0.53, its folded biases lost below float32's precision beside the
    inputs' 1e20 in A's eigenbasis)."""
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(256, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    x = x * 1e10
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = KFACOptimizer.for_model(model, lr=3e-3)
    with torch.no_grad():
        first = float(F.cross_entropy(model(x), y))
    for step in range(8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 0:
            assert all(
                layer.solver_state is not None for layer in opt.preconditioner.layers.values()
            )
    assert opt.skipped_steps == 0
    with torch.no_grad():
        assert float(F.cross_entropy(model(x), y)) < 0.6 * first
