"""Unit-wise BatchNorm Fisher against per-sample gradients from torch.func."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from dkfac.blocks.unitwise_stats import (
    batch_moments,
    per_sample_grads,
    unit_fisher,
)
from dkfac.solvers.unitwise import UnitwiseSolver, damped_solve_2x2

DT = torch.float64


def normalized_input(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Oracle: ``x̂`` of a training-mode BatchNorm by the textbook formula (biased variance)."""
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims, keepdim=True)
    var = x.var(dim=dims, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _per_sample_bn_grads(bn: nn.Module, x: torch.Tensor, weights: torch.Tensor):
    """Per-sample gradients of loss_n = Σ w_n·y_n wrt (γ, β), batch statistics held fixed.

    In training mode the batch statistics couple samples; the per-sample gradient of the
    K-FAC/SP-NGD convention treats x̂ as given (it is the layer input seen by γ and β), which is
    what differentiating y = γ x̂ + β with x̂ fixed computes.
    """
    x_hat = normalized_input(x, bn.eps).detach()
    shape = [1, -1] + [1] * (x.dim() - 2)

    def loss(params, xh, w):
        y = params["weight"].view(shape[1:]) * xh + params["bias"].view(shape[1:])
        return (w * y).sum()

    params = {"weight": bn.weight.detach(), "bias": bn.bias.detach()}
    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x_hat, weights)
    return grads["weight"], grads["bias"]


@pytest.mark.parametrize("shape", [(6, 3), (5, 4, 7), (4, 3, 5, 6)])
def test_per_sample_grads_and_fisher_match_torch_func(shape) -> None:
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)](shape[1]).to(DT)
    with torch.no_grad():
        bn.weight.uniform_(-1, 1)
        bn.weight[0] = 0.0  # γ = 0 must not matter: x̂ comes from the input
        bn.bias.uniform_(-1, 1)
    x = torch.randn(*shape, dtype=DT) * 3 + 1
    w = torch.randn(*shape, dtype=DT)  # δ for the loss Σ w·y
    g_gamma_ref, g_beta_ref = _per_sample_bn_grads(bn, x, w)
    # the layer's own forward computes the same x̂
    y = bn(x)
    x_hat = normalized_input(x, bn.eps)
    view = [1, -1] + [1] * (x.dim() - 2)
    torch.testing.assert_close(y, bn.weight.view(view) * x_hat + bn.bias.view(view))
    mean, inv_std = batch_moments(x, bn.eps)
    g_gamma, g_beta = per_sample_grads(x, mean, inv_std, w)
    torch.testing.assert_close(g_gamma, g_gamma_ref)
    torch.testing.assert_close(g_beta, g_beta_ref)
    fisher = unit_fisher(g_gamma, g_beta)
    for c in range(shape[1]):
        v = torch.stack([g_gamma_ref[:, c], g_beta_ref[:, c]], dim=1)
        torch.testing.assert_close(fisher[c], v.T @ v)


def test_batch_moments_in_float32_match_float64_with_a_large_mean() -> None:
    """E[x²] − E[x]² loses little in float32 when |mean| is 5 standard deviations."""
    x = torch.randn(64, 5, 9, 9, dtype=DT) * 2.0 + 10.0
    mean64, inv64 = batch_moments(x, 1e-5)
    torch.testing.assert_close(mean64, x.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(inv64, (x.var(dim=(0, 2, 3), unbiased=False) + 1e-5).rsqrt())
    mean32, inv32 = batch_moments(x.float(), 1e-5)
    torch.testing.assert_close(mean32.double(), mean64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(inv32.double(), inv64, rtol=1e-4, atol=0)


def test_damped_solve_equals_dense_per_channel_solve() -> None:
    v = torch.randn(7, 5, 2, dtype=DT)
    fisher = torch.einsum("ncj,nck->cjk", v, v) / 7
    fisher[1] = 0.0  # a dead channel: damping alone
    grad_ = torch.randn(5, 2, dtype=DT)
    out = damped_solve_2x2(fisher, grad_, 0.01)
    for c in range(5):
        expected = torch.linalg.solve(fisher[c] + 0.01 * torch.eye(2, dtype=DT), grad_[c])
        torch.testing.assert_close(out[c], expected)


def test_batchnorm_layers_of_any_width_share_one_solve() -> None:
    """``apply_batch`` over layers of 3, 5 and 1 channels equals each layer's ``apply`` to
    the bit (the solve is per channel), and equal keys do not depend on the width."""
    solver = UnitwiseSolver()
    states, grads = [], []
    for width in (3, 5, 1):
        v = torch.randn(7, width, 2, dtype=DT)
        states.append(solver.compute_statistics({"F": torch.einsum("ncj,nck->cjk", v, v) / 7}, 0.0))
        grads.append(torch.randn(width, 2, dtype=DT))
    keys = {solver.batch_key(s, g) for s, g in zip(states, grads, strict=True)}
    assert len(keys) == 1 and None not in keys
    assert solver.batch_key(states[0], grads[0].float()) not in keys
    out = solver.apply_batch(states, [None] * 3, grads, 0.01)
    for (update, moments), state, grad_ in zip(out, states, grads, strict=True):
        assert moments is None
        assert torch.equal(update, solver.apply(state, grad_, 0.01))
