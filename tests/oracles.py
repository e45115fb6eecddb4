"""Explicit formulas the library is checked against, written independently of it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def conv_patches_by_hand(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """(B, T, C_in·kh·kw) patches built with explicit loops over output positions."""
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    if isinstance(conv.padding, str):
        th, tw = dh * (kh - 1), dw * (kw - 1)
        pads = (
            (tw // 2, tw - tw // 2, th // 2, th - th // 2) if conv.padding == "same" else (0,) * 4
        )
    else:
        ph, pw = conv.padding
        pads = (pw, pw, ph, ph)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    hp, wp = xp.shape[2], xp.shape[3]
    out_h = (hp - dh * (kh - 1) - 1) // sh + 1
    out_w = (wp - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for i in range(out_h):
        for j in range(out_w):
            patch = xp[
                :,
                :,
                i * sh : i * sh + dh * (kh - 1) + 1 : dh,
                j * sw : j * sw + dw * (kw - 1) + 1 : dw,
            ]
            rows.append(patch.reshape(x.shape[0], -1))
    return torch.stack(rows, dim=1)


def with_ones(rows: Tensor) -> Tensor:
    return torch.cat([rows, torch.ones(*rows.shape[:-1], 1, dtype=rows.dtype)], dim=-1)


def dense_eigen_solve(a: Tensor, g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """Solves (G ⊗ A + λI) vec_r(V) = vec_r(∇W) densely (row-major vec)."""
    fisher = torch.kron(g, a)
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype)
    v = torch.linalg.solve(fisher + damping * eye, grad.reshape(-1))
    return v.reshape(grad.shape)


def dense_factored_solve(a: Tensor, g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """Solves ((G + √λ/π I) ⊗ (A + π√λ I)) vec_r(V) = vec_r(∇W) densely."""
    pi = math.sqrt((torch.trace(a) / a.shape[0]) / (torch.trace(g) / g.shape[0]))
    root = math.sqrt(damping)
    ea = torch.eye(a.shape[0], dtype=a.dtype)
    eg = torch.eye(g.shape[0], dtype=g.dtype)
    fisher = torch.kron(g + root / pi * eg, a + pi * root * ea)
    return torch.linalg.solve(fisher, grad.reshape(-1)).reshape(grad.shape)


def weight_grad_matrix(module: nn.Module) -> Tensor:
    """The module's gradient as g_dim × a_dim with the bias column last."""
    grad = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        grad = torch.cat([grad, module.bias.grad.reshape(-1, 1)], dim=1)
    return grad


def quintic_polar(matrix: Tensor, steps: int = 5) -> Tensor:
    """``P φᵗ(Σ / (‖U‖_F + 1e-7)) Rᵀ`` from the SVD ``U = P Σ Rᵀ``, ``φ(σ) = aσ + bσ³ + cσ⁵``
    with Muon's coefficients: what ``steps`` Newton–Schulz steps do to the singular values
    (solvers/polar.py), written out."""
    p, sigma, rt = torch.linalg.svd(matrix, full_matrices=False)
    x = sigma / (torch.linalg.matrix_norm(matrix) + 1e-7)
    for _ in range(steps):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    return (p * x) @ rt
