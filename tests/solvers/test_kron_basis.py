"""The Kronecker-structured input basis (solvers/kron_basis.py) against dense formulas.

Oracles: a factor that *is* a Kronecker product (its dense eigendecomposition is then the
structured one), explicit loops for the partial traces, and ``diag(Qᵀ A Q)`` formed densely
for the eigenvalue estimates of a factor that is not one.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EKFACSolver, MomentOptions, make_solver
from dkfac.solvers.basis_refresh import descending_eigh, power_refresh
from dkfac.solvers.kron_basis import (
    check_input_map,
    partial_traces,
    structured_basis,
    times_basis,
)

DT = torch.float64
C, P = 4, 3


def _spd(n: int, seed: int, spread: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    values = torch.linspace(1.0, 1.0 + spread * n, n, dtype=DT) * (1.0 + 0.1 * seed)
    return q @ torch.diag(values) @ q.T


def _with_bias(features: Tensor, corner: float, coupling: Tensor | None = None) -> Tensor:
    n = len(features)
    out = torch.zeros(n + 1, n + 1, dtype=DT)
    out[:n, :n] = features
    out[n, n] = corner
    if coupling is not None:
        out[:n, n] = out[n, :n] = coupling
    return out


def _samples(rows: int, seed: int) -> Tensor:
    """A factor as the engine builds one: mean of ``ā āᵀ`` over rows with a ones column."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, C * P, generator=gen, dtype=DT).relu() + 0.1
    x = torch.cat([x, torch.ones(rows, 1, dtype=DT)], dim=1)
    return x.T @ x / rows


def test_partial_traces_match_explicit_sums() -> None:
    a = _spd(C * P, 0)
    a_c, a_p = partial_traces(a, C, P)
    want_c = torch.zeros(C, C, dtype=DT)
    want_p = torch.zeros(P, P, dtype=DT)
    for c in range(C):
        for d in range(C):
            want_c[c, d] = sum(a[c * P + p, d * P + p] for p in range(P)) / P
    for p in range(P):
        for q in range(P):
            want_p[p, q] = sum(a[c * P + p, c * P + q] for c in range(C)) / C
    torch.testing.assert_close(a_c, want_c)
    torch.testing.assert_close(a_p, want_p)


@pytest.mark.parametrize("bias", [False, True])
def test_a_kronecker_factor_is_diagonalised_exactly(bias: bool) -> None:
    factor = torch.kron(_spd(C, 1), _spd(P, 2, spread=3.0))
    if bias:
        factor = _with_bias(factor, corner=7.5)
    values, basis = structured_basis(factor, (C, P), DT)[:2]
    eye = torch.eye(len(factor), dtype=DT)
    torch.testing.assert_close(basis.T @ basis, eye, atol=1e-12, rtol=0)
    torch.testing.assert_close(basis.T @ factor @ basis, torch.diag(values), atol=1e-10, rtol=0)
    dense, _ = descending_eigh(factor, DT)
    torch.testing.assert_close(values, dense, atol=1e-10, rtol=1e-12)
    if bias:  # the bias coordinate is a basis vector of its own
        column = int(torch.nonzero(basis[-1].abs() > 0.5)[0, 0])
        assert values[column] == 7.5 and basis[:-1, column].abs().max() == 0.0


def test_a_general_factor_gets_an_orthogonal_kronecker_basis_and_rayleigh_estimates() -> None:
    factor = _samples(rows=40, seed=3)  # bias coupled to the features: not a Kronecker product
    values, basis = structured_basis(factor, (C, P), DT)[:2]
    n = C * P
    torch.testing.assert_close(basis.T @ basis, torch.eye(n + 1, dtype=DT), atol=1e-12, rtol=0)
    torch.testing.assert_close(values, torch.diagonal(basis.T @ factor @ basis), rtol=1e-10, atol=0)
    assert torch.all(values[:-1] >= values[1:])
    # Every feature column is u ⊗ w with u, w eigenvectors of the two partial traces.
    a_c, a_p = partial_traces(factor[:n, :n], C, P)
    feature_columns = basis[:, basis[n] == 0.0]
    assert feature_columns.shape[1] == n
    for column in feature_columns.T:
        block = column[:n].reshape(C, P)
        u, s, vh = torch.linalg.svd(block)
        assert s[1] < 1e-12  # rank one
        for vector, trace in ((u[:, 0], a_c), (vh[0], a_p)):
            image = trace @ vector
            torch.testing.assert_close(image, (vector @ image) * vector, atol=1e-10, rtol=0)


def test_the_basis_follows_the_float32_precision() -> None:
    factor = _samples(rows=40, seed=4)
    values, basis = structured_basis(factor.float(), (C, P), torch.float32)[:2]
    assert values.dtype == basis.dtype == torch.float32
    want, _ = structured_basis(factor, (C, P), DT)[:2]
    torch.testing.assert_close(values.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape", [(C * P + 2, C * P + 2), (C * P - 1, C * P - 1), (C * P, C * P + 1)]
)
def test_a_factor_of_another_width_is_refused(shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="4 x 3 input map must be 12 or 13 wide"):
        structured_basis(torch.zeros(shape, dtype=DT), (C, P), DT)


@pytest.mark.parametrize("bad", [(4,), (4, 0), (4.0, 3), (True, 3), [4, 3], None])
def test_check_input_map_refuses_what_is_not_two_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError, match="pair \\(channels, positions\\)"):
        check_input_map(bad)


def _stats(seed: int) -> dict[str, Tensor]:
    return {"A": _samples(rows=40, seed=seed), "G": _spd(2, seed + 10)}


@pytest.mark.parametrize("cls", [EigenAdamSolver, EKFACSolver])
def test_a_moment_solver_with_an_input_map_takes_the_structured_input_basis(cls: type) -> None:
    solver = cls(DT, MomentOptions(basis_refresh="power"), input_map=(C, P))
    assert solver.label == f"{cls.name} (A basis 4x3)"
    first = solver.compute_statistics(_stats(5), 0.0)
    stats = _stats(6)
    second = solver.compute_statistics(stats, 0.0, previous=first)
    da, qa = structured_basis(stats["A"], (C, P), DT)[:2]
    torch.testing.assert_close(second["qa"], qa, rtol=0, atol=0)
    torch.testing.assert_close(second["da"], da, rtol=0, atol=0)
    # The output side still follows its previous basis with a power step.
    dg, qg = power_refresh(stats["G"], first["qg"], DT)
    torch.testing.assert_close(second["qg"], qg, rtol=0, atol=0)
    torch.testing.assert_close(second["dg"], dg, rtol=0, atol=0)


def test_the_input_map_overrides_the_one_sided_limit() -> None:
    options = MomentOptions(max_dim=5)
    state = EigenAdamSolver(DT, options, input_map=(C, P)).compute_statistics(_stats(7), 0.0)
    assert state["qa"].shape == (C * P + 1, C * P + 1)


def test_make_solver_gives_the_input_map_to_moment_solvers_only() -> None:
    solver = make_solver("eigen_adam", DT, input_map=(C, P))
    assert isinstance(solver, EigenAdamSolver) and solver.input_map == (C, P)
    assert make_solver("ekfac", DT).input_map is None  # type: ignore[attr-defined]
    for method in ("eigen", "cholesky", "smw"):
        with pytest.raises(ValueError, match="needs an eigenbasis-moment method"):
            make_solver(method, DT, input_map=(C, P))
    with pytest.raises(ValueError, match="pair \\(channels, positions\\)"):
        make_solver("eigen_adam", DT, input_map=(C, 0))


@pytest.mark.parametrize("bias", [False, True])
def test_the_parts_rebuild_the_dense_basis_and_multiply_like_it(bias: bool) -> None:
    """``dense[:, k]`` is column ``order[k]`` of ``(Q_C ⊗ Q_P) ⊕ 1``, and ``times_basis``
    equals ``X @ Q`` and ``X @ Qᵀ``."""
    factor = _samples(rows=30, seed=11) if bias else _spd(C * P, 12)
    basis = structured_basis(factor, (C, P), DT)
    assert basis.order.dtype == torch.int64
    structured = torch.kron(basis.channels, basis.positions)
    if bias:
        structured = torch.block_diag(structured, torch.ones(1, 1, dtype=DT))
    torch.testing.assert_close(basis.dense, structured[:, basis.order], rtol=0, atol=1e-15)
    x = torch.randn(5, len(factor), dtype=DT, generator=torch.Generator().manual_seed(3))
    parts = (basis.channels, basis.positions, basis.order)
    torch.testing.assert_close(times_basis(x, *parts), x @ basis.dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        times_basis(x, *parts, transpose=True), x @ basis.dense.T, rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("cls", [EigenAdamSolver, EKFACSolver])
def test_a_structured_state_rotates_like_its_dense_basis(cls: type) -> None:
    """The update and the carried moments through the parts equal those through the dense
    ``qa`` alone (the same state without its parts)."""
    solver = cls(DT, MomentOptions(carry="keep_v", rotation_dtype=torch.float32), (C, P))
    old = solver.compute_statistics(_stats(20), 0.0)
    new = solver.compute_statistics(_stats(21), 0.0, previous=old)
    assert {"qa_channels", "qa_positions", "qa_order"} <= set(new)
    dense_old, dense_new = ({k: s[k] for k in ("qa", "da", "qg", "dg")} for s in (old, new))
    grad = torch.randn(2, C * P + 1, dtype=DT, generator=torch.Generator().manual_seed(4))
    update, moments = solver.apply_with_moments(old, None, grad, 0.1)
    dense_update, dense_moments = solver.apply_with_moments(dense_old, None, grad, 0.1)
    # float32 rotation out: the same rounding either way, to float32's precision.
    torch.testing.assert_close(update, dense_update, rtol=1e-5, atol=1e-6)
    for key in moments:
        torch.testing.assert_close(moments[key], dense_moments[key], rtol=1e-12, atol=1e-12)
    carried = solver.carry_moments(old, new, moments)
    dense_carried = solver.carry_moments(dense_old, dense_new, dense_moments)
    for key in carried:
        torch.testing.assert_close(carried[key], dense_carried[key], rtol=1e-12, atol=1e-12)
