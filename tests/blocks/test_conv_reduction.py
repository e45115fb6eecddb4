"""Reduce Sum and Spatial Subsampling factors of Conv2dBlock equal hand-built formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac.blocks import Conv2dBlock, LinearBlock
from tests.oracles import conv_patches_by_hand, weight_grad_matrix, with_ones

DT = torch.float64

CASES = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=2),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=1, padding=(3, 2), stride=2),  # wide zero padding, strided
    dict(kernel_size=3, padding=1, padding_mode="reflect", bias=False),
]


def _factor(rows) -> torch.Tensor:
    return rows.rows.T @ rows.rows / rows.normaliser


def _conv_and_grads(case: dict, batch: int = 3) -> tuple[nn.Conv2d, torch.Tensor, torch.Tensor]:
    """A conv, its input, and the batch-scaled output gradient of a mean loss."""
    conv = nn.Conv2d(2, 3, **case).to(DT)
    x = torch.randn(batch, 2, 7, 6, dtype=DT)
    out = conv(x)
    delta = torch.autograd.grad(out.pow(2).sum(dim=(1, 2, 3)).mean(), out)[0]
    return conv, x, delta * batch


def _hand_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, T, D[+1]) patches by explicit loops, with the bias column when there is a bias."""
    patches = conv_patches_by_hand(conv, x)
    return with_ones(patches) if conv.bias is not None else patches


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reduce_sum_equals_formula(case: dict) -> None:
    conv, x, g = _conv_and_grads(case)
    block = Conv2dBlock("", conv, reduction="sum")
    patches = _hand_rows(conv, x)  # (B, T, D)
    batch, total = patches.shape[0], patches.shape[1]
    expected_a = torch.zeros(patches.shape[2], patches.shape[2], dtype=DT)
    expected_g = torch.zeros(3, 3, dtype=DT)
    for n in range(batch):
        a_sum = sum(patches[n, t] for t in range(total))
        g_sum = sum(g[n, :, i, j] for i in range(g.shape[2]) for j in range(g.shape[3]))
        expected_a += torch.outer(a_sum, a_sum) / total**2 / batch
        expected_g += torch.outer(g_sum, g_sum) / batch
    a_rows, g_rows = block.a_rows(x), block.g_rows(g)
    assert a_rows.rows.shape[0] == batch and g_rows.rows.shape[0] == batch
    torch.testing.assert_close(_factor(a_rows), expected_a)
    torch.testing.assert_close(_factor(g_rows), expected_g)
    if conv.bias is not None:  # the bias entry of the averaged patch is exactly 1
        torch.testing.assert_close(a_rows.rows[:, -1], torch.ones(batch, dtype=DT))


def test_reduce_sum_patch_means_by_hand_with_windows_inside_the_padding() -> None:
    """Kernel rows whose every window row is padding give zero means, as unfolding does."""
    conv = nn.Conv2d(2, 3, (3, 2), padding=(2, 1), stride=(3, 2), bias=False).to(DT)
    x = torch.randn(
        2, 2, 1, 3, dtype=DT
    )  # padded 5 x 5, one output row: kernel rows 0, 1 see padding
    patches = _hand_rows(conv, x)  # (B, T, D)
    rows = Conv2dBlock("", conv, reduction="sum").a_rows(x).rows
    torch.testing.assert_close(rows, patches.mean(dim=1))
    assert torch.count_nonzero(rows.view(2, 2, 3, 2)[:, :, 0]) == 0


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("positions", [1, 3])
def test_subsample_equals_formula(case: dict, positions: int) -> None:
    conv, x, g = _conv_and_grads(case)
    block = Conv2dBlock("", conv, reduction="subsample", positions=positions, seed=11)
    block.set_step(5)
    patches = _hand_rows(conv, x)
    batch, total = patches.shape[0], patches.shape[1]
    out_w = g.shape[3]
    index = block.subsample_indices(batch, total)
    assert index.shape == (batch, positions)
    expected_a = torch.zeros(patches.shape[2], patches.shape[2], dtype=DT)
    expected_g = torch.zeros(3, 3, dtype=DT)
    for n in range(batch):
        chosen = [int(t) for t in index[n]]
        assert len(set(chosen)) == positions and all(0 <= t < total for t in chosen)
        for t in chosen:
            a_t = patches[n, t]
            g_t = g[n, :, t // out_w, t % out_w]
            expected_a += torch.outer(a_t, a_t) / (batch * positions)
            expected_g += torch.outer(g_t, g_t) * total / (batch * positions)
    torch.testing.assert_close(_factor(block.a_rows(x)), expected_a)
    torch.testing.assert_close(_factor(block.g_rows(g)), expected_g)


def test_subsample_all_positions_equals_expand() -> None:
    conv, x, g = _conv_and_grads(CASES[0])
    expand = Conv2dBlock("", conv)
    full = Conv2dBlock("", conv, reduction="subsample", positions=10_000)
    torch.testing.assert_close(_factor(full.a_rows(x)), _factor(expand.a_rows(x)))
    torch.testing.assert_close(_factor(full.g_rows(g)), _factor(expand.g_rows(g)))


def test_subsample_positions_seeded_and_rank_independent() -> None:
    conv = nn.Conv2d(1, 1, 1)
    first = Conv2dBlock("", conv, reduction="subsample", positions=4, seed=2)
    other = Conv2dBlock("x", nn.Conv2d(1, 1, 1), reduction="subsample", positions=4, seed=2)
    first.set_step(9)
    other.set_step(9)
    torch.manual_seed(123)  # the global RNG plays no part
    picked = first.subsample_indices(6, 50)
    torch.manual_seed(456)
    torch.testing.assert_close(other.subsample_indices(6, 50), picked)
    other.set_step(10)
    assert not torch.equal(other.subsample_indices(6, 50), picked)
    reseeded = Conv2dBlock("", conv, reduction="subsample", positions=4, seed=3)
    reseeded.set_step(8)  # the generator's seed is seed + step (documented)
    torch.testing.assert_close(reseeded.subsample_indices(6, 50), picked)


@pytest.mark.parametrize("reduction", ["sum", "subsample"])
def test_one_by_one_output_equals_linear(reduction: str) -> None:
    conv = nn.Conv2d(2, 3, kernel_size=(3, 2)).to(DT)
    linear = nn.Linear(2 * 3 * 2, 3).to(DT)
    x = torch.randn(4, 2, 3, 2, dtype=DT)
    g = torch.randn(4, 3, 1, 1, dtype=DT)
    block = Conv2dBlock("", conv, reduction=reduction, positions=2)
    lin = LinearBlock("", linear)
    torch.testing.assert_close(_factor(block.a_rows(x)), _factor(lin.a_rows(x.reshape(4, -1))))
    torch.testing.assert_close(_factor(block.g_rows(g)), _factor(lin.g_rows(g.reshape(4, 3))))


def test_reduce_sum_exact_fisher_for_spatially_constant_patches() -> None:
    """1×1 kernel, spatially constant image, one sample: A ⊗ G is the exact Fisher."""
    conv = nn.Conv2d(2, 3, kernel_size=1).to(DT)
    x = torch.randn(1, 2, 1, 1, dtype=DT).expand(1, 2, 4, 5).contiguous()
    out = conv(x)
    loss = (out * torch.randn_like(out)).sum() + out.pow(2).sum()
    delta = torch.autograd.grad(loss, out, retain_graph=True)[0]
    loss.backward()
    grad = weight_grad_matrix(conv).reshape(-1)
    block = Conv2dBlock("", conv, reduction="sum")
    a, g = _factor(block.a_rows(x)), _factor(block.g_rows(delta))
    torch.testing.assert_close(torch.kron(g, a), torch.outer(grad, grad))


def test_unbatched_input() -> None:
    conv = nn.Conv2d(2, 3, 3).to(DT)
    x = torch.randn(2, 5, 5, dtype=DT)
    g = torch.randn(3, 3, 3, dtype=DT)
    for reduction in ("sum", "subsample"):
        block = Conv2dBlock("", conv, reduction=reduction, positions=2)
        batched = Conv2dBlock("", conv, reduction=reduction, positions=2)
        torch.testing.assert_close(
            _factor(block.a_rows(x)), _factor(batched.a_rows(x.unsqueeze(0)))
        )
        torch.testing.assert_close(
            _factor(block.g_rows(g)), _factor(batched.g_rows(g.unsqueeze(0)))
        )


def test_validation_errors() -> None:
    conv = nn.Conv2d(1, 1, 1)
    with pytest.raises(ValueError, match="reduction"):
        Conv2dBlock("", conv, reduction="mean")
    with pytest.raises(ValueError, match="positions"):
        Conv2dBlock("", conv, reduction="subsample", positions=0)
    with pytest.raises(TypeError, match="seed"):
        Conv2dBlock("", conv, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Conv2d"):
        Conv2dBlock("", nn.Linear(2, 2))
    block = Conv2dBlock("", conv, reduction="subsample")
    with pytest.raises(ValueError, match="step"):
        block.set_step(-1)
