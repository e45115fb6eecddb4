"""Preconditioned gradients equal dense damped solves; the KL-clip equals its formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.solvers import CholeskySolver, EigenSolver, SolverError, eigen
from tests.oracles import dense_eigen_solve, dense_factored_solve, weight_grad_matrix

DT = torch.float64


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)
    ).to(DT)


def _raw_and_preconditioned(method: str, damping: float, **options: object):
    model = _model()
    pre = KFACPreconditioner(
        model,
        method=method,
        damping=damping,
        factor_decay=0.0,
        inverse_update_interval=1,
        eigen_dtype=DT,
        **options,
    )
    x = torch.randn(5, 2, 6, 6, dtype=DT)
    y = torch.randint(0, 4, (5,))
    F.cross_entropy(model(x), y).backward()
    raw = {
        name: weight_grad_matrix(layer.block.module).clone() for name, layer in pre.layers.items()
    }
    pre.step()
    return pre, raw


@pytest.mark.parametrize("damping", [1e-3, 0.1, 3.0])
def test_eigen_equals_dense_damped_solve(damping: float) -> None:
    pre, raw = _raw_and_preconditioned("eigen", damping, kl_clip=None)
    for name, (a, g) in pre.factors().items():
        expected = dense_eigen_solve(a, g, raw[name], damping)
        got = weight_grad_matrix(pre.layers[name].block.module)
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("damping", [1e-3, 0.1, 3.0])
def test_cholesky_equals_factored_pi_damped_solve(damping: float) -> None:
    pre, raw = _raw_and_preconditioned("cholesky", damping, kl_clip=None)
    for name, (a, g) in pre.factors().items():
        expected = dense_factored_solve(a, g, raw[name], damping)
        got = weight_grad_matrix(pre.layers[name].block.module)
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("kl_clip,lr", [(1e-3, 0.1), (1e-8, 0.5), (10.0, 0.1)])
def test_kl_clip_scale_equals_formula(kl_clip: float, lr: float) -> None:
    unclipped, raw = _raw_and_preconditioned("eigen", 0.01, kl_clip=None)
    torch.manual_seed(0)
    clipped, _ = _raw_and_preconditioned("eigen", 0.01, kl_clip=kl_clip, lr=lr)
    vg = sum(
        (weight_grad_matrix(layer.block.module) * raw[name]).sum()
        for name, layer in unclipped.layers.items()
    )
    nu = min(1.0, math.sqrt(kl_clip / abs(lr**2 * float(vg))))
    assert clipped.last_kl_scale == pytest.approx(nu, rel=1e-9)
    for name, layer in clipped.layers.items():
        torch.testing.assert_close(
            weight_grad_matrix(layer.block.module),
            nu * weight_grad_matrix(unclipped.layers[name].block.module),
        )


def test_eigenvalues_clamped_at_zero() -> None:
    a = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=DT)  # eigenvalues 0 and 2
    a[0, 1] += 1e-13  # tiny asymmetric noise, could give a negative eigenvalue
    state = EigenSolver(DT).compute(a, torch.eye(1, dtype=DT), 1e-3)
    assert bool((state["da"] >= 0).all())


def test_solver_failure_raises_solver_error() -> None:
    bad = torch.full((3, 3), float("nan"), dtype=DT)
    with pytest.raises(SolverError):
        EigenSolver(torch.float32).compute(bad, torch.eye(2, dtype=DT), 1e-3)
    with pytest.raises(SolverError):
        CholeskySolver(torch.float32).compute(bad, torch.eye(2, dtype=DT), 1e-3)


def test_float32_eigen_close_to_float64() -> None:
    f64, raw = _raw_and_preconditioned("eigen", 0.01, kl_clip=None)
    for name, (a, g) in f64.factors().items():
        state = EigenSolver(torch.float32).compute(a.float(), g.float(), 0.01)
        got = EigenSolver(torch.float32).apply(state, raw[name].float(), 0.01)
        expected = dense_eigen_solve(a, g, raw[name], 0.01)
        torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("failure", ["raises", "returns nan"])
def test_eigh_that_does_not_converge_is_retried_on_a_shifted_matrix(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A first ``eigh`` that fails (an error, or NaN eigenvectors without one) is redone on
    ``F + δI`` in the same dtype, ``δ`` taken off the eigenvalues: the known spectrum and
    basis come back."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))
    spectrum = torch.tensor([0.0, 0.0, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    matrix = q @ torch.diag(spectrum) @ q.T
    real_eigh = torch.linalg.eigh
    seen: list[torch.Tensor] = []

    def failing_once(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(m)
        if len(seen) == 1 and failure == "raises":
            raise torch.linalg.LinAlgError("did not converge")
        values, vectors = real_eigh(m)
        if len(seen) == 1:
            vectors = torch.full_like(vectors, math.nan)
        return values, vectors

    monkeypatch.setattr(eigen.torch.linalg, "eigh", failing_once)
    values, vectors = eigen.symmetric_eigh(matrix, torch.float64)
    shift = eigen.SHIFT * float(torch.diagonal(matrix).mean())
    torch.testing.assert_close(seen[1] - seen[0], shift * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(values, spectrum, atol=1e-12, rtol=0)
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, matrix)


def test_a_factor_of_dead_units_decomposes_in_float32() -> None:
    """Half of 1000 units dead (interleaved zero rows): LAPACK's float32 ``eigh`` does not
    converge on this factor; the shifted retry gives a basis that rebuilds it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(128, 1000, generator=gen))
    x[:, torch.randperm(1000, generator=gen)[:509]] = 0
    factor = x.T @ x / 128
    values, vectors = eigen.symmetric_eigh(factor, torch.float32)
    assert values.dtype == torch.float32 and bool((values >= 0).all())
    rebuilt = vectors @ torch.diag(values) @ vectors.T
    assert float((rebuilt - factor).abs().max()) < 2e-5 * float(factor.abs().max())
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(1000), atol=1e-5, rtol=0)
