"""Explicit formulas the library is checked against, written independently of it."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


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


def per_sample_unit_grads(conv: nn.Module, x: Tensor, delta: Tensor) -> Tensor:
    """Oracle: ``(N, C_out, d)``, each sample's gradient of ``Σ δ_n · conv(x_n)`` by
    torch.func, the weight's entries of output channel ``o`` then its bias."""
    params = {k: v.detach() for k, v in conv.named_parameters()}

    def loss(p: Mapping[str, Tensor], xn: Tensor, dn: Tensor) -> Tensor:
        return (functional_call(conv, p, (xn.unsqueeze(0),)) * dn.unsqueeze(0)).sum()

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, delta)
    units = grads["weight"].flatten(2)
    if "bias" in grads:
        units = torch.cat([units, grads["bias"].unsqueeze(-1)], dim=2)
    return units


def unitwise_update(model: nn.Module, x: Tensor, y: Tensor, damping: float) -> Tensor:
    """``(F_o + λI)^{-1} ∇_o`` per output channel, ``F_o`` from torch.func per-sample
    gradients of the cross-entropy (the batch's mean loss: ``F_o = mean_n g gᵀ``)."""
    conv = model[0]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p: Mapping[str, Tensor], xn: Tensor, t: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xn.unsqueeze(0),)), t.unsqueeze(0))

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    units = grads["0.weight"].flatten(2)
    if conv.bias is not None:
        units = torch.cat([units, grads["0.bias"].unsqueeze(-1)], dim=2)
    fisher = torch.einsum("nci,ncj->cij", units, units) / x.shape[0]
    mean = units.mean(dim=0)
    eye = torch.eye(units.shape[2], dtype=units.dtype)
    return torch.stack(
        [torch.linalg.solve(f + damping * eye, g) for f, g in zip(fisher, mean, strict=True)]
    )


class SumSink:
    """A dense accumulator as the engine's, for blocks that add sums (unit-wise ones):
    ``Σ scale·sum`` and the normalisers."""

    takes_sums = True
    compute_dtype: torch.dtype | None = None
    dtype: torch.dtype | None = None

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0.0

    def add(self, rows: object, scale: float = 1.0) -> None:
        raise AssertionError("a unit-wise block adds sums")

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        self.total = total * scale if self.total is None else self.total + total * scale
        self.count += normaliser
