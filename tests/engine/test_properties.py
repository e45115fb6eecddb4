"""Property-based tests (hypothesis) for blocks and solvers over shapes and hyperparameters.

Each property is still an oracle: the block factors equal the explicit formulas of
``tests/oracles.py`` and the solvers equal dense damped solves, for every drawn shape,
batch size and damping, including rank-deficient, zero and badly conditioned factors.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dkfac.blocks import Conv2dBlock, LinearBlock
from dkfac.solvers import CholeskySolver, EigenSolver
from tests.oracles import (
    conv_patches_by_hand,
    dense_eigen_solve,
    dense_factored_solve,
    with_ones,
)

DT = torch.float64
# derandomize: CI runs the same examples every time (no flaky draws, no example database).
PROFILE = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _factor(rows: torch.Tensor, normaliser: float) -> torch.Tensor:
    return rows.T @ rows / normaliser


@PROFILE
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    d_in=st.integers(1, 6),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_block_factors(
    lead: list[int], d_in: int, d_out: int, bias: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    layer = nn.Linear(d_in, d_out, bias=bias).to(DT)
    block = LinearBlock("fc", layer)
    x = torch.randn(*lead, d_in, dtype=DT)
    g = torch.randn(*lead, d_out, dtype=DT)
    a_rows, g_rows = block.a_rows(x), block.g_rows(g)
    rows = x.reshape(-1, d_in)
    rows = with_ones(rows) if bias else rows
    a = _factor(a_rows.rows, a_rows.normaliser)
    g_factor = _factor(g_rows.rows, g_rows.normaliser)
    assert a.shape == (block.a_dim, block.a_dim) and g_factor.shape == (d_out, d_out)
    torch.testing.assert_close(a, rows.T @ rows / rows.shape[0])
    flat_g = g.reshape(-1, d_out)
    torch.testing.assert_close(g_factor, flat_g.T @ flat_g / flat_g.shape[0])
    assert torch.linalg.eigvalsh(a).min() > -1e-10


@PROFILE
@given(
    batch=st.integers(1, 3),
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    size=st.integers(5, 8),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conv2d_block_factors(
    batch: int,
    c_in: int,
    c_out: int,
    kernel: tuple[int, int],
    stride: int,
    padding: int,
    dilation: int,
    size: int,
    bias: bool,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    conv = nn.Conv2d(
        c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias
    ).to(DT)
    block = Conv2dBlock("conv", conv)
    x = torch.randn(batch, c_in, size, size, dtype=DT)
    out = conv(x)
    grad_out = torch.randn_like(out)
    patches = conv_patches_by_hand(conv, x)  # (B, T, D)
    rows = patches.reshape(-1, patches.shape[-1])
    rows = with_ones(rows) if bias else rows
    a_rows = block.a_rows(x)
    torch.testing.assert_close(
        _factor(a_rows.rows, a_rows.normaliser), rows.T @ rows / rows.shape[0]
    )
    g_rows = block.g_rows(grad_out)
    per_position = grad_out.permute(0, 2, 3, 1).reshape(-1, c_out)
    torch.testing.assert_close(
        _factor(g_rows.rows, g_rows.normaliser), per_position.T @ per_position / batch
    )


def _psd(dim: int, rank: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """A PSD matrix of the given rank (0 gives the zero matrix) with eigenvalues ~ scale."""
    u = torch.randn(dim, rank, dtype=DT, generator=generator)
    return scale * u @ u.T / max(rank, 1)


def _kronecker_problem(
    a_dim: int, g_dim: int, a_rank: int, g_rank: int, a_scale: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded PSD factors A (rank ≤ a_rank, scale a_scale), G (rank ≤ g_rank) and a gradient."""
    gen = torch.Generator().manual_seed(seed)
    a = _psd(a_dim, min(a_rank, a_dim), a_scale, gen)
    g = _psd(g_dim, min(g_rank, g_dim), 1.0, gen)
    return a, g, torch.randn(g_dim, a_dim, dtype=DT, generator=gen)


def _finite_solve(
    solver: EigenSolver | CholeskySolver,
    a: torch.Tensor,
    g: torch.Tensor,
    grad: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """The solver's damped preconditioned gradient, checked finite and of the right shape."""
    out = solver.apply(solver.compute(a, g, damping), grad, damping)
    assert out.shape == grad.shape and bool(torch.isfinite(out).all())
    return out


@PROFILE
@given(
    a_dim=st.integers(1, 7),
    g_dim=st.integers(1, 6),
    a_rank=st.integers(0, 7),
    g_rank=st.integers(0, 6),
    a_scale=st.sampled_from([1e-6, 1.0, 1e4]),
    damping=st.floats(1e-4, 10.0),
    seed=st.integers(0, 2**16),
)
def test_eigen_solver_equals_dense_solve(
    a_dim: int,
    g_dim: int,
    a_rank: int,
    g_rank: int,
    a_scale: float,
    damping: float,
    seed: int,
) -> None:
    a, g, grad = _kronecker_problem(a_dim, g_dim, a_rank, g_rank, a_scale, seed)
    out = _finite_solve(EigenSolver(DT), a, g, grad, damping)
    expected = dense_eigen_solve(a, g, grad, damping)
    # (A⊗G + λI) has condition number up to ~1e8 here; two float64 solves (eigen and the
    # dense reference) agree to about cond·eps ≈ 1e-8 of the largest entry, 1e-5 relative.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-8 * float(expected.abs().max()))


@PROFILE
@given(
    a_dim=st.integers(1, 7),
    g_dim=st.integers(1, 6),
    a_rank=st.integers(1, 7),
    g_rank=st.integers(1, 6),
    a_scale=st.sampled_from([1e-3, 1.0, 1e3]),
    damping=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
)
def test_cholesky_solver_equals_dense_factored_solve(
    a_dim: int,
    g_dim: int,
    a_rank: int,
    g_rank: int,
    a_scale: float,
    damping: float,
    seed: int,
) -> None:
    a, g, grad = _kronecker_problem(a_dim, g_dim, a_rank, g_rank, a_scale, seed)
    out = _finite_solve(CholeskySolver(DT), a, g, grad, damping)
    expected = dense_factored_solve(a, g, grad, damping)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-8 * float(expected.abs().max()))


@PROFILE
@given(dim=st.integers(1, 6), damping=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16))
def test_solvers_finite_on_zero_factors(dim: int, damping: float, seed: int) -> None:
    """All-zero factors (a dead layer) give the damped identity: grad / damping (eigen)."""
    gen = torch.Generator().manual_seed(seed)
    zero = torch.zeros(dim, dim, dtype=DT)
    grad = torch.randn(dim, dim, dtype=DT, generator=gen)
    eigen = EigenSolver(DT)
    torch.testing.assert_close(
        eigen.apply(eigen.compute(zero, zero, damping), grad, damping), grad / damping
    )
    chol = CholeskySolver(DT)  # π = 1 when a trace is 0: (√λ I)^{-1} ∇W (√λ I)^{-1}
    torch.testing.assert_close(
        chol.apply(chol.compute(zero, zero, damping), grad, damping), grad / damping
    )
