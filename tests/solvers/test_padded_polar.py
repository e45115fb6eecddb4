"""``orthogonal_updates``: the polar factors of updates of several shapes as one zero-padded
batched iteration.

Oracle: each update's own :func:`~dkfac.solvers.polar.orthogonal_update` (the same
polynomial of the same normalised matrix; a padded block's products only sum in another
order), for wide and tall matrices and stacks, a fixed length and one that follows each
update's own RMS entry; a zero update stays zero; an update too large to pad keeps its own
iteration, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dkfac.solvers import padded_polar
from dkfac.solvers.padded_polar import PAD_MAX_WORK, orthogonal_updates
from dkfac.solvers.polar import orthogonal_update

DT = torch.float64
SHAPES = [(6, 9), (3, 5, 4), (2, 7, 7), (1, 12), (8, 3)]
"""Wide and tall matrices, stacks, a square stack and a row."""


def _updates(seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=DT) for shape in SHAPES]


@pytest.mark.parametrize("power", [0.0, 0.5])
def test_each_update_is_its_own_orthogonal_update(power: float) -> None:
    updates = _updates(0)
    updates[2][1] = 0.0  # one matrix of a stack is zero
    got = orthogonal_updates(updates, 1.5, steps=3, power=power)
    for update, result in zip(updates, got, strict=True):
        want = orthogonal_update(update, 1.5, 3, power)
        assert result.shape == update.shape and result.dtype == update.dtype
        torch.testing.assert_close(result, want, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got[2][1]) == 0


def _padded_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes the padded iteration is called with from now on (each update's own
    iteration goes through :func:`~dkfac.solvers.polar.orthogonal_update`, not counted)."""
    calls: list[tuple[int, ...]] = []
    original = padded_polar.polar_factor

    def counted(matrix: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
        calls.append(tuple(matrix.shape))
        return original(matrix, steps, dtype)

    monkeypatch.setattr(padded_polar, "polar_factor", counted)
    return calls


def test_one_batched_iteration_for_the_small_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _padded_calls(monkeypatch)
    orthogonal_updates(_updates(1), 0.5, steps=2)
    assert calls == [(1 + 3 + 2 + 1 + 1, 7, 12)]  # every matrix, wide, padded to 7 × 12


def test_an_update_too_large_to_pad_keeps_its_own_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The small ones are still padded together; a lone small one keeps its own too."""
    side = round(PAD_MAX_WORK ** (1 / 3)) + 1
    gen = torch.Generator().manual_seed(2)
    large = torch.randn(side, side, generator=gen, dtype=torch.float32)
    small = [torch.randn(4, 6, generator=gen, dtype=torch.float32) for _ in range(2)]
    got = orthogonal_updates([large, small[0]], 0.5, steps=2)
    assert torch.equal(got[0], orthogonal_update(large, 0.5, 2))
    assert torch.equal(got[1], orthogonal_update(small[0], 0.5, 2))  # alone: not padded
    calls = _padded_calls(monkeypatch)
    got = orthogonal_updates([small[0], large, small[1]], 0.5, steps=2)
    assert calls == [(2, 4, 6)]  # the large one went through orthogonal_update
    assert torch.equal(got[1], orthogonal_update(large, 0.5, 2))
