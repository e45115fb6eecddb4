"""Unit-wise natural gradient for BatchNorm (SP-NGD): a 2×2 Fisher per channel.

For channel ``c`` of a BatchNorm layer with output ``y = γ x̂ + β``, the per-sample gradients
of the (per-sample) loss are ``gγ_n = Σ_{spatial} δ_n · x̂_n`` and ``gβ_n = Σ_{spatial} δ_n``,
where ``δ_n`` is the per-sample gradient of the output. The unit-wise Fisher of the channel is

    F_c = mean_n [[gγ², gγ·gβ], [gγ·gβ, gβ²]],

and the update is ``(F_c + λ I₂)^{-1} [∇γ_c, ∇β_c]``, solved in closed form. ``x̂`` comes from
the forward pass (never from dividing by ``γ``, which may be 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def normalized_input(x: Tensor, eps: float) -> Tensor:
    """``x̂`` of a training-mode BatchNorm: batch mean and biased batch variance per channel.

    Args:
        x: Input of shape ``(N, C)``, ``(N, C, L)`` or ``(N, C, H, W)``.
        eps: The layer's ``eps``.
    """
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims, keepdim=True)
    var = x.var(dim=dims, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def per_sample_grads(x_hat: Tensor, grad_output: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample ``(gγ, gβ)``, each of shape ``(N, C)``, from ``x̂`` and ``δ``."""
    spatial = tuple(range(2, grad_output.dim()))
    if spatial:
        return (grad_output * x_hat).sum(dim=spatial), grad_output.sum(dim=spatial)
    return grad_output * x_hat, grad_output


def unit_fisher(g_gamma: Tensor, g_beta: Tensor) -> Tensor:
    """Sum over samples of the per-channel outer products, shape ``(C, 2, 2)``."""
    per_sample = torch.stack([g_gamma, g_beta], dim=-1)  # (N, C, 2)
    return torch.einsum("nci,ncj->cij", per_sample, per_sample)


def damped_solve_2x2(fisher: Tensor, grad: Tensor, damping: float) -> Tensor:
    """``(F_c + λ I)^{-1} grad_c`` for every channel, in closed form.

    Args:
        fisher: ``(C, 2, 2)`` symmetric positive semi-definite matrices.
        grad: ``(C, 2)``: ``[∇γ_c, ∇β_c]``.
        damping: ``λ > 0``.
    """
    a = fisher[:, 0, 0] + damping
    b = fisher[:, 0, 1]
    d = fisher[:, 1, 1] + damping
    det = a * d - b * b
    g0, g1 = grad[:, 0], grad[:, 1]
    return torch.stack([(d * g0 - b * g1) / det, (a * g1 - b * g0) / det], dim=-1)
