"""step_math's sum of products (the KL-clip's Σ⟨V, ∇W⟩) against the float64 definition,
in both forms: a dot product per layer (a CPU's) and the multi-tensor one (a GPU's); and the
KL-clip scale against its formula, at its edges."""

from __future__ import annotations

import math

import pytest
import torch

from dkfac.engine.step_math import kl_clip_scale, sum_of_products


def _pairs(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3, 1), (16, 9), (1, 1)]
    lefts = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    rights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return lefts, rights


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_of_products_is_the_definition(fused: bool, dtype: torch.dtype) -> None:
    lefts, rights = _pairs(dtype)
    pairs = zip(lefts, rights, strict=True)
    want = sum(float((a.double() * b.to(dtype).double()).sum()) for a, b in pairs)
    got = sum_of_products(lefts, rights, lefts[0], fused=fused)
    assert got.shape == () and got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert float(got) == pytest.approx(want, rel=tol, abs=tol)


@pytest.mark.parametrize("fused", [False, True])
def test_sum_of_products_keeps_the_sign_through_cancellation(fused: bool) -> None:
    # Positive and negative products that nearly cancel: the total is small and negative.
    left = torch.tensor([[3.0, -2.0], [1.0, 0.5]], dtype=torch.float64)
    right = torch.tensor([[1.0, 1.5], [-0.25, 0.25]], dtype=torch.float64)
    extra = (
        torch.tensor([[-1.0]], dtype=torch.float64),
        torch.tensor([[0.5]], dtype=torch.float64),
    )
    got = sum_of_products([left, extra[0]], [right, extra[1]], left, fused=fused)
    assert float(got) == pytest.approx(3.0 - 3.0 - 0.25 + 0.125 - 0.5, abs=1e-15)


@pytest.mark.parametrize("fused", [False, True])
def test_sum_of_products_of_nothing_is_a_zero_like(fused: bool) -> None:
    like = torch.ones(2, dtype=torch.float64)
    got = sum_of_products([], [], like, fused=fused)
    assert got.dtype == torch.float64 and float(got) == 0.0


def test_the_fused_sum_of_half_products_passes_their_range() -> None:
    # 4096 products of 4 each: 16384 a layer, 65536 in all, past float16's 65504.
    lefts = [torch.full((64, 64), 2.0, dtype=torch.float16) for _ in range(4)]
    got = sum_of_products(lefts, lefts, lefts[0], fused=True)
    assert got.dtype == torch.float32 and float(got) == 65536.0


class _Serial:
    """The strategy's part kl_clip_scale reads, for one process."""

    def kl_layers(self, ready: list[str]) -> list[str]:
        return list(ready)

    def reduce_kl(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


@pytest.mark.parametrize(
    ("total", "kl_clip", "lr"),
    [
        (2.5, 1e-3, 0.1),  # clipped
        (-2.5, 1e-3, 0.1),  # a negative sum clips by its size
        (1e-3, 10.0, 0.1),  # not clipped: 1
        (0.0, 1e-3, 0.1),  # nothing to clip: 1
        (1e-45, 1e-40, 1e-3),  # lr²|s| below 1e-30: the sum is taken as 1e-30
        (float("nan"), 1e-3, 0.1),
    ],
)
def test_the_kl_clip_scale_is_the_definition(total: float, kl_clip: float, lr: float) -> None:
    """ν = min(1, √(κ / max(lr² |Σ⟨V, ∇W⟩|, 1e-30))) in float64, from one layer whose
    product sums to ``total``."""
    final = torch.tensor([[total, 0.0]], dtype=torch.float64)
    raw = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    got = kl_clip_scale(_Serial(), {"w": final}, ["w"], {"w": raw}, kl_clip, lr)  # type: ignore[arg-type]
    assert got is not None and got.shape == () and got.dtype == torch.float64
    if math.isnan(total):
        assert math.isnan(float(got))
        return
    want = min(1.0, math.sqrt(kl_clip / max(lr**2 * abs(total), 1e-30)))
    assert float(got) == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize(
    ("rates", "want_sum"),
    [
        ({"w": 0.1, "b": 1e-4}, 0.1**2 * 2.5 + 1e-4**2 * -7.0),
        ({"w": 0.0, "b": 0.1}, 0.1**2 * -7.0),  # a frozen group at lr 0 adds nothing
        ({"w": 0.1, "b": 0.1}, 0.1**2 * (2.5 - 7.0)),  # one rate: the scalar form
    ],
)
def test_the_kl_clip_scale_takes_each_layer_s_rate(
    rates: dict[str, float], want_sum: float
) -> None:
    """ν = min(1, √(κ / |Σ_l lr_l² ⟨V_l, ∇W_l⟩|)) with each layer's own lr (parameter
    groups of several rates), whatever their order."""
    finals = {
        "w": torch.tensor([[2.5, 0.0]], dtype=torch.float64),
        "b": torch.tensor([[-7.0, 0.0]], dtype=torch.float64),
    }
    raws = {"w": torch.tensor([[1.0, 3.0]], dtype=torch.float64), "b": finals["b"].abs() / 7}
    want = min(1.0, math.sqrt(1e-4 / abs(want_sum)))
    for order in (["w", "b"], ["b", "w"]):
        got = kl_clip_scale(_Serial(), finals, order, raws, 1e-4, rates)  # type: ignore[arg-type]
        assert got is not None and float(got) == pytest.approx(want, rel=1e-14), order
    assert kl_clip_scale(_Serial(), finals, ["w"], raws, 1e-4, {"w": 0.0, "b": 0.0}) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("total", "lr"), [(2.5, 1e30), (0.0, 1e30), (2.5, 1e300), (0.0, 1e300)])
def test_the_kl_clip_scale_survives_a_huge_lr(total: float, lr: float, dtype: torch.dtype) -> None:
    """``lr ** 2`` raised OverflowError past 1.3e154, and lr² / κ beyond the sum's range
    times a zero sum was NaN: the scale is the definition to within the smallest step,
    1 for a zero sum."""
    final = torch.tensor([[total, 0.0]], dtype=dtype)
    raw = torch.tensor([[1.0, 3.0]], dtype=dtype)
    got = kl_clip_scale(_Serial(), {"w": final}, ["w"], {"w": raw}, 1e-3, lr)  # type: ignore[arg-type]
    assert got is not None and bool(torch.isfinite(got))
    want = 1.0 if total == 0 else math.sqrt(1e-3 / (lr * lr * abs(total)))
    assert float(got) == pytest.approx(want, abs=1e-30)
