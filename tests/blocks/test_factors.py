"""Factors equal explicit formulas, and the exact Fisher where K-FAC is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from tests.oracles import conv_patches_by_hand, weight_grad_matrix, with_ones

DT = torch.float64


def _capture(model: nn.Module, x: torch.Tensor, **options: object) -> KFACPreconditioner:
    """One forward/backward (mean loss) and one step with factor_decay=0."""
    pre = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, **options)
    out = model(x)
    out.pow(2).sum(dim=tuple(range(1, out.dim()))).mean().backward()
    pre.step()
    return pre


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5)])
def test_linear_factors_equal_formula(bias: bool, shape: tuple[int, ...]) -> None:
    layer = nn.Linear(5, 3, bias=bias).to(DT)
    x = torch.randn(*shape, dtype=DT)
    batch = shape[0]
    out = layer(x)
    delta = torch.autograd.grad(out.pow(2).sum(dim=tuple(range(1, out.dim()))).mean(), out)[0]
    pre = _capture(layer, x)
    a, g = pre.factors()[""]
    rows = x.reshape(-1, 5)
    rows = with_ones(rows) if bias else rows
    expected_a = rows.T @ rows / rows.shape[0]
    grows = (delta * batch).reshape(-1, 3)
    expected_g = grows.T @ grows / grows.shape[0]
    torch.testing.assert_close(a, expected_a)
    torch.testing.assert_close(g, expected_g)


CONV_CASES = [
    dict(kernel_size=3, stride=2, padding=1, dilation=1),
    dict(kernel_size=3, stride=1, padding=2, dilation=2),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=1),
    dict(kernel_size=3, stride=1, padding="same", dilation=1),
    dict(kernel_size=4, stride=1, padding="same", dilation=1),  # asymmetric 'same'
    dict(kernel_size=3, stride=1, padding=1, dilation=1, padding_mode="reflect"),
    dict(kernel_size=3, stride=2, padding=1, dilation=1, padding_mode="circular"),
    dict(kernel_size=3, stride=1, padding="valid", dilation=1, bias=False),
]


@pytest.mark.parametrize(
    "case", CONV_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_conv2d_factors_equal_formula(case: dict) -> None:
    conv = nn.Conv2d(2, 3, **case).to(DT)
    x = torch.randn(4, 2, 7, 6, dtype=DT)
    out = conv(x)
    delta = torch.autograd.grad(out.pow(2).sum(dim=(1, 2, 3)).mean(), out)[0]
    pre = _capture(conv, x)
    a, g = pre.factors()[""]
    patches = conv_patches_by_hand(conv, x)  # (B, T, D)
    # The hand-built patches reproduce the convolution itself.
    weight = conv.weight.reshape(3, -1)
    rebuilt = patches @ weight.T + (conv.bias if conv.bias is not None else 0)
    torch.testing.assert_close(rebuilt, out.detach().flatten(2).transpose(1, 2))
    rows = patches.reshape(-1, patches.shape[-1])
    if conv.bias is not None:
        rows = with_ones(rows)
    torch.testing.assert_close(a, rows.T @ rows / rows.shape[0])
    gr = (delta * x.shape[0]).permute(0, 2, 3, 1).reshape(-1, 3)
    torch.testing.assert_close(g, gr.T @ gr / x.shape[0])


def _exact_fisher_check(module: nn.Module, x: torch.Tensor) -> None:
    """With one sample, A ⊗ G is the empirical Fisher block vec(∇W) vec(∇W)^T."""
    pre = KFACPreconditioner(module, factor_decay=0.0, kl_clip=None)
    out = module(x)
    (out.pow(2).sum() + out.sum()).backward()
    grad = weight_grad_matrix(module).clone()
    pre.step()
    a, g = pre.factors()[""]
    fisher = torch.outer(grad.reshape(-1), grad.reshape(-1))  # row-major vec: G ⊗ A
    torch.testing.assert_close(torch.kron(g, a), fisher)


def test_linear_one_sample_equals_exact_fisher() -> None:
    _exact_fisher_check(nn.Linear(4, 3).to(DT), torch.randn(1, 4, dtype=DT))


def test_conv_one_position_equals_exact_fisher() -> None:
    conv = nn.Conv2d(2, 3, kernel_size=3).to(DT)
    _exact_fisher_check(conv, torch.randn(1, 2, 3, 3, dtype=DT))


def test_running_average_follows_decay() -> None:
    layer = nn.Linear(3, 2).to(DT)
    pre = KFACPreconditioner(layer, factor_decay=0.75, kl_clip=None)
    xs = [torch.randn(5, 3, dtype=DT) for _ in range(3)]
    expected = None
    for x in xs:
        layer.zero_grad()
        layer(x).sum().backward()
        pre.step()
        rows = with_ones(x)
        new = rows.T @ rows / 5
        expected = new if expected is None else 0.75 * expected + 0.25 * new
    torch.testing.assert_close(pre.factors()[""][0], expected)


def test_accumulation_equals_full_batch() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).to(DT)
    clone = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).to(DT)
    clone.load_state_dict(model.state_dict())
    x = torch.randn(8, 1, 6, 6, dtype=DT)
    y = torch.randint(0, 3, (8,))
    full = KFACPreconditioner(model, kl_clip=None, inverse_update_interval=1)
    F.cross_entropy(model(x), y).backward()
    full.step()
    accum = KFACPreconditioner(clone, kl_clip=None, inverse_update_interval=1, accumulation_steps=2)
    for part in (slice(0, 4), slice(4, 8)):
        (F.cross_entropy(clone(x[part]), y[part]) / 2).backward()
    accum.step()
    for name in full.factors():
        torch.testing.assert_close(accum.factors()[name][0], full.factors()[name][0])
        torch.testing.assert_close(accum.factors()[name][1], full.factors()[name][1])
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_inplace_activation_after_layer_sees_pre_activation_grad() -> None:
    conv = nn.Conv2d(1, 2, 3).to(DT)
    model = nn.Sequential(conv, nn.ReLU(inplace=True))
    x = torch.randn(3, 1, 5, 5, dtype=DT)
    out = conv(x)
    delta = torch.autograd.grad(torch.relu(out).pow(2).sum(dim=(1, 2, 3)).mean(), out)[0]
    pre = _capture(model, x)
    gr = (delta * 3).permute(0, 2, 3, 1).reshape(-1, 2)
    torch.testing.assert_close(pre.factors()["0"][1], gr.T @ gr / 3)
