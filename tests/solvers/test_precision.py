"""``"auto"`` precisions: bf16 where the device multiplies it natively, else the default.

The capability is read from the CPU's flags, not timed; the tests set it both ways
(``native_bf16``) so every branch runs on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dkfac.solvers import precision
from dkfac.solvers.polar import newton_schulz, orthogonal_update, polar_dtype, polar_factor

CPU = torch.device("cpu")


def test_the_cpu_counts_as_native_exactly_when_it_has_avx512_bf16_or_amx() -> None:
    precision._FAST.pop("cpu", None)
    flags = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert precision.bfloat16_is_fast(CPU) is bool(flags)
    assert precision._FAST["cpu"] is bool(flags)  # decided once


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_where_native_and_never_for_float64(
    native: bool, native_bf16: Callable[[bool], None]
) -> None:
    native_bf16(native)
    assert precision.resolve("auto", CPU, torch.float32) == (torch.bfloat16 if native else None)
    assert precision.resolve("auto", CPU, torch.bfloat16) == (torch.bfloat16 if native else None)
    assert precision.resolve("auto", CPU, torch.float64) is None
    for given in (None, torch.float32, torch.bfloat16, torch.float64):
        assert precision.resolve(given, CPU, torch.float32) is given
    low = torch.bfloat16 if native else torch.float32
    assert precision.low_precision(CPU, torch.float32) == low
    assert precision.low_precision(CPU, torch.float64) == torch.float64
    assert polar_dtype(torch.float32, CPU) == low


def test_resolve_refuses_other_strings() -> None:
    with pytest.raises(ValueError, match="'auto' or None, got 'bf16'"):
        precision.resolve("bf16", CPU, torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("native", [True, False])
def test_the_polar_factor_iterates_in_bf16_only_where_native(
    native: bool, native_bf16: Callable[[bool], None]
) -> None:
    """The same bits as the iteration written with that dtype; float64 stays float64. A
    128-wide matrix: on a CPU a smaller one iterates in float32 (the next test)."""
    native_bf16(native)
    update = torch.randn(128, 130)
    low = torch.bfloat16 if native else torch.float32
    want = newton_schulz(update, dtype=low) * (0.5 * 130**0.5)
    assert torch.equal(orthogonal_update(update, 0.5), want)
    double = update.double()
    want64 = newton_schulz(double, dtype=torch.float64) * (0.5 * 130**0.5)
    assert torch.equal(orthogonal_update(double, 0.5), want64)


def test_a_cpu_takes_bf16_only_from_the_minimum_work(
    native_bf16: Callable[[bool], None],
) -> None:
    """On a CPU with native bf16: float32 below ``CPU_BF16_MIN_WORK`` multiply-adds, bf16
    from it (and for no count); a CUDA device takes bf16 for any work; float64 stays."""
    native_bf16(True)
    least = precision.CPU_BF16_MIN_WORK
    assert least == 128**3
    assert precision.low_precision(CPU, torch.float32, least - 1) == torch.float32
    assert precision.low_precision(CPU, torch.float32, least) == torch.bfloat16
    assert precision.low_precision(CPU, torch.float32) == torch.bfloat16
    assert precision.low_precision(CPU, torch.float64, 10**9) == torch.float64
    cuda = torch.device("cuda:0")
    precision._FAST["cuda:0"] = True
    try:
        assert precision.low_precision(cuda, torch.float32, 1) == torch.bfloat16
    finally:
        del precision._FAST["cuda:0"]
    # the iteration by its smaller side cubed: 127 wide in float32, 128 in bf16
    assert polar_dtype(torch.float32, CPU, (127, 1000)) == torch.float32
    assert polar_dtype(torch.float32, CPU, (3, 1000, 128)) == torch.bfloat16
    update = torch.randn(16, 65)
    want = polar_factor(update, dtype=torch.float32) * (0.5 * 65**0.5)
    assert torch.equal(orthogonal_update(update, 0.5), want)


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_the_moments_are_float32_at_least(given: torch.dtype, want: torch.dtype) -> None:
    assert precision.moment_dtype(given) is want
    assert precision.moment_dtype(given) is torch.promote_types(given, torch.float32)
