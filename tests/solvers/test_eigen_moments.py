"""The eigenbasis-moment solvers against dense, explicit formulas (solvers/eigen_moments.py).

The oracles work on ``vec(∇W)`` (column-major) with the Kronecker basis ``K = Q_A ⊗ Q_G``:
the rotated gradient is ``Kᵀ vec(∇W)`` and the update ``K s`` for the scaled vector ``s``;
the factors are built from known orthogonal bases and distinct eigenvalues, so the basis
is known up to column signs (which the updates do not depend on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from dkfac.solvers import (
    EigenAdamSolver,
    EKFACSolver,
    MomentOptions,
    eigen_basis,
    eigen_moments,
    make_solver,
    precision,
)
from dkfac.solvers.basis_refresh import descending_eigh, power_refresh, range_eigh
from dkfac.solvers.null_space import canonical_null_basis
from dkfac.solvers.polar import orthogonal_update
from dkfac.solvers.rotations import change_basis
from tests.oracles import quintic_polar

DT = torch.float64
A_DIM, G_DIM = 5, 3


def _orthogonal(n: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    return q


def _factor(q: Tensor, values: list[float]) -> Tensor:
    return q @ torch.diag(torch.tensor(values, dtype=DT)) @ q.T


QA, QG = _orthogonal(A_DIM, 1), _orthogonal(G_DIM, 2)
A = _factor(QA, [4.0, 2.0, 1.0, 0.5, 0.25])
G = _factor(QG, [3.0, 1.0, 0.2])
K = torch.kron(QA, QG)  # vec(Q_G X Q_Aᵀ) = K vec(X)


def vec(x: Tensor) -> Tensor:
    return x.T.reshape(-1)


def unvec(v: Tensor) -> Tensor:
    return v.reshape(A_DIM, G_DIM).T


def _grads(n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(G_DIM, A_DIM, generator=gen, dtype=DT) for _ in range(n)]


def _run(solver, grads: list[Tensor], damping: float = 0.1) -> list[Tensor]:
    state = solver.compute(A, G, damping)
    moments, out = None, []
    for grad in grads:
        update, moments = solver.apply_with_moments(state, moments, grad, damping)
        out.append(update)
    return out


def _adam_oracle(
    grads: list[Tensor],
    b1: float,
    b2: float,
    eps: float,
    *,
    bias: bool,
    nesterov: bool,
    basis: Tensor = K,
    out_basis: Tensor | None = None,
) -> list[Tensor]:
    m = torch.zeros(A_DIM * G_DIM, dtype=DT)
    v = torch.zeros_like(m)
    out = []
    for t, grad in enumerate(grads, start=1):
        r = basis.T @ vec(grad)
        m = b1 * m + (1 - b1) * r
        v = b2 * v + (1 - b2) * r**2
        num = b1 * m + (1 - b1) * r if nesterov else m
        c1 = (1 - b1 ** (t + 1 if nesterov else t)) if bias else 1.0
        c2 = (1 - b2**t) if bias else 1.0
        scaled = (num / c1) / ((v / c2).sqrt() + eps)
        if out_basis is not None:  # the rotation out of the basis with rounded inputs
            basis_out = out_basis
            scaled = scaled.float().double()
        else:
            basis_out = basis
        out.append(unvec(basis_out @ scaled))
    return out


def _ekfac_oracle(grads: list[Tensor], b2: float, damping: float, *, bias: bool) -> list[Tensor]:
    """EKFAC: ``(Q_A⊗Q_G) diag(s + λ)^{-1} (Q_A⊗Q_G)ᵀ vec(∇W)`` with ``s`` the running
    second moment of the rotated gradient."""
    v = torch.zeros(A_DIM * G_DIM, dtype=DT)
    out = []
    for t, grad in enumerate(grads, start=1):
        r = K.T @ vec(grad)
        v = b2 * v + (1 - b2) * r**2
        s = v / ((1 - b2**t) if bias else 1.0)
        out.append(unvec(K @ torch.diag(1.0 / (s + damping)) @ K.T @ vec(grad)))
    return out


@pytest.mark.parametrize("method", ["eigen_adam", "ekfac"])
def test_an_orthogonalised_update_is_the_polar_factor_of_the_plain_one(method: str) -> None:
    """Same moments as the plain solver; the update is its update's scaled polar factor."""
    cls = EigenAdamSolver if method == "eigen_adam" else EKFACSolver
    plain = cls(DT, MomentOptions(beta1=0.8, eps=1e-3))
    orthogonal = cls(DT, MomentOptions(beta1=0.8, eps=1e-3, orthogonal_rms=0.7))
    assert orthogonal.label == f"{method} (orthogonal, rms 0.7)"
    state = plain.compute(A, G, 0.1)
    moments_p = moments_o = None
    for grad in _grads(3):
        want, moments_p = plain.apply_with_moments(state, moments_p, grad, 0.1)
        got, moments_o = orthogonal.apply_with_moments(state, moments_o, grad, 0.1)
        torch.testing.assert_close(
            got, quintic_polar(want) * (0.7 * max(want.shape) ** 0.5), rtol=1e-9, atol=1e-12
        )
        for key, value in moments_p.items():
            torch.testing.assert_close(moments_o[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("method", "split", "nesterov", "bias"),
    [
        ("eigen_adam", 0.5, False, True),
        ("eigen_adam", 0.5, True, True),
        ("eigen_adam", 0.5, True, False),
        ("eigen_adam", 0.3, True, True),
        ("eigen_adam", 1.0, False, True),
        ("ekfac", 0.5, False, True),
    ],
)
def test_a_split_scaling_is_applied_around_the_polar_factor(
    method: str, split: float, nesterov: bool, bias: bool
) -> None:
    """``orthogonal_split`` S: ``D^-S ⊙ polar(D^(S-1) ⊙ m̂)`` in the basis (Adam's ``D = √v̂ +
    ε``, EKFAC's ``v̂ + λ`` with ``m̂`` the rotated gradient), rescaled to RMS ``rms`` and
    rotated out; written out with the Kronecker basis and an SVD polar factor, with and
    without Nesterov's look-ahead and the bias correction (eigen_adam forms the two factors
    from ``√v`` and ``m`` with the corrections folded into one constant per matrix: the
    same update to rounding). The moments are the plain solver's."""
    b1, b2, eps, damping, rms = 0.8, 0.95, 1e-3, 0.1, 0.7
    cls = EigenAdamSolver if method == "eigen_adam" else EKFACSolver
    flags = {"nesterov": nesterov, "bias_correction": bias} if method == "eigen_adam" else {}
    options = MomentOptions(beta1=b1, eps=eps, orthogonal_rms=rms, orthogonal_split=split, **flags)
    solver = cls(DT, options)
    assert solver.label == f"{method} (orthogonal, rms 0.7, split {split:g})"
    plain = cls(DT, MomentOptions(beta1=b1, eps=eps, **flags))
    state = solver.compute(A, G, damping)
    m = torch.zeros(A_DIM * G_DIM, dtype=DT)
    v = torch.zeros_like(m)
    moments = plain_moments = None
    for t, grad in enumerate(_grads(3), start=1):
        got, moments = solver.apply_with_moments(state, moments, grad, damping)
        plain_moments = plain.apply_with_moments(state, plain_moments, grad, damping)[1]
        for key, value in plain_moments.items():
            torch.testing.assert_close(moments[key], value, rtol=0, atol=0)
        r = K.T @ vec(grad)
        m = b1 * m + (1 - b1) * r
        v = b2 * v + (1 - b2) * r**2
        v_hat = v / (1 - b2**t) if bias else v
        if method == "eigen_adam":
            look = b1 * m + (1 - b1) * r if nesterov else m
            c1 = 1 - b1 ** (t + 1 if nesterov else t) if bias else 1.0
            numerator, scale = look / c1, v_hat.sqrt() + eps
        else:
            numerator, scale = r, v_hat + damping
        polar = quintic_polar(unvec(numerator * scale ** (split - 1.0)))
        inside = unvec(scale ** (-split)) * polar
        inside = inside * (rms / inside.square().mean().sqrt())
        want = unvec(K @ vec(inside))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_zero_split_is_the_plain_polar_factor() -> None:
    """``orthogonal_split=0`` (the default) gives the plain orthogonalised update, bit for bit."""
    base = MomentOptions(beta1=0.8, eps=1e-3, orthogonal_rms=0.7)
    default = EigenAdamSolver(DT, base)
    zero = EigenAdamSolver(DT, dataclasses.replace(base, orthogonal_split=0.0))
    for one, other in zip(_run(default, _grads(3)), _run(zero, _grads(3)), strict=True):
        assert torch.equal(one, other)


def test_a_split_needs_an_orthogonalised_update() -> None:
    with pytest.raises(ValueError, match="set orthogonal_rms too"):
        MomentOptions(orthogonal_split=0.5)


def test_the_length_follows_the_replaced_update_and_keeps_the_moments() -> None:
    """``orthogonal_rms_power=p``: the plain update's polar factor at ``rms^(1−p) · r^p``,
    ``r`` the plain update's own RMS entry (the rotation out keeps both: the bases are
    orthogonal), the same moments."""
    plain = EigenAdamSolver(DT, MomentOptions(beta1=0.8, eps=1e-3))
    options = MomentOptions(beta1=0.8, eps=1e-3, orthogonal_rms=2.0, orthogonal_rms_power=0.25)
    matched = EigenAdamSolver(DT, options)
    assert matched.label == "eigen_adam (orthogonal, rms 2 ^ 0.75 x own ^ 0.25)"
    state = plain.compute(A, G, 0.1)
    moments_p = moments_m = None
    for grad in _grads(3):
        want, moments_p = plain.apply_with_moments(state, moments_p, grad, 0.1)
        got, moments_m = matched.apply_with_moments(state, moments_m, grad, 0.1)
        length = 2.0**0.75 * want.square().mean().sqrt() ** 0.25
        scale = length * max(want.shape) ** 0.5
        torch.testing.assert_close(got, quintic_polar(want) * scale, rtol=1e-9, atol=1e-12)
        for key, value in moments_p.items():
            torch.testing.assert_close(moments_m[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"orthogonal_rms": 1.5, "orthogonal_rms_power": 1.5}, ValueError, r"in \[0, 1\]"),
        ({"orthogonal_rms": 1.5, "orthogonal_rms_power": "1"}, TypeError, "must be a number"),
        ({"orthogonal_rms_power": 0.5}, ValueError, "set orthogonal_rms too"),
        (
            {"orthogonal_rms": 1.5, "orthogonal_rms_power": 0.5, "orthogonal_split": 0.5},
            ValueError,
            "drop one of them",
        ),
        ({"orthogonal_rms": "adam"}, TypeError, "orthogonal_rms must be a number"),
    ],
)
def test_the_length_options_are_checked(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        MomentOptions(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("native", "least"),
    [(True, 1), (True, None), (False, 1)],
    ids=["bf16-native", "bf16-native-small", "bf16-emulated"],
)
def test_a_float32_polar_factor_is_taken_in_the_basis_and_rotated_out_in_its_precision(
    native: bool,
    least: int | None,
    native_bf16: Callable[[bool], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``O(Q_G S Q_Aᵀ) = Q_G O(S) Q_Aᵀ``: the float32 solver orthogonalises ``S`` in the basis
    and rotates the polar factor out in the iteration's own precision: bfloat16 where the
    CPU multiplies it natively, float32 where bf16 is emulated (the same bits as that recipe
    spelled out); the result is the polar factor of the float32 update rotated out first to
    that rounding: against the float64 polar factor, within 2% of that order's own error
    (1.6% here in bf16: the bfloat16 steps; the bfloat16 rotation of a matrix whose singular
    values are all about one adds about one rounding, 0.8% here). A CPU takes bf16 only
    from ``CPU_BF16_MIN_WORK`` multiply-adds: this 3 × 5 layer's are fewer, so it stays in
    float32 (``least`` None); set to 1, bf16."""
    native_bf16(native)
    if least is not None:
        monkeypatch.setattr(precision, "CPU_BF16_MIN_WORK", least)
    low = torch.bfloat16 if native and least is not None else torch.float32
    options = MomentOptions(beta1=0.8, eps=1e-3, orthogonal_rms=0.7)
    orthogonal = EigenAdamSolver(torch.float32, options)
    plain = EigenAdamSolver(torch.float32, MomentOptions(beta1=0.8, eps=1e-3))
    state = orthogonal.compute(A.float(), G.float(), 0.1)
    moments = None
    for grad in _grads(3):
        grad = grad.float()
        got, new = orthogonal.apply_with_moments(state, moments, grad, 0.1)
        rotated = change_basis(grad, state, None)
        scaled = orthogonal.scaled(new, rotated, 0.1)
        polar = orthogonal_update(scaled, 0.7)
        want = change_basis(polar, state, low, out=True)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        first_out = plain.apply_with_moments(state, moments, grad, 0.1)[0]
        exact = quintic_polar(first_out.double()) * (0.7 * max(grad.shape) ** 0.5)
        before = orthogonal_update(first_out, 0.7).double()
        error, error_before = ((x - exact).norm() / exact.norm() for x in (got.double(), before))
        assert error <= error_before + 0.02
        if low == torch.float32:  # the float64 iteration's result to float32 rounding
            assert error < 1e-4
        moments = new


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
def test_eigen_adam_equals_adam_in_the_kronecker_eigenbasis(bias: bool, nesterov: bool) -> None:
    options = MomentOptions(beta1=0.8, beta2=0.9, eps=1e-3, bias_correction=bias, nesterov=nesterov)
    grads = _grads(4)
    got = _run(EigenAdamSolver(DT, options), grads)
    want = _adam_oracle(grads, 0.8, 0.9, 1e-3, bias=bias, nesterov=nesterov)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_first_eigen_adam_step_is_the_rotated_sign() -> None:
    """Bias-corrected, the first step is ``Q_G sign(R)·|R|/(|R|+ε) Q_Aᵀ`` for any β."""
    grad = _grads(1)[0]
    got = EigenAdamSolver(DT, MomentOptions(eps=1e-12)).apply(
        EigenAdamSolver(DT).compute(A, G, 0.1), grad, 0.1
    )
    r = QG.T @ grad @ QA
    torch.testing.assert_close(got, QG @ torch.sign(r) @ QA.T)


@pytest.mark.parametrize("bias", [True, False])
def test_ekfac_equals_the_explicit_formula(bias: bool) -> None:
    grads = _grads(3)
    got = _run(EKFACSolver(DT, MomentOptions(beta2=0.7, bias_correction=bias)), grads, 0.05)
    for g, w in zip(got, _ekfac_oracle(grads, 0.7, 0.05, bias=bias), strict=True):
        torch.testing.assert_close(g, w)


def test_ekfac_with_beta_zero_scales_by_the_current_squares() -> None:
    grad = _grads(1)[0]
    got = _run(EKFACSolver(DT, MomentOptions(beta2=0.0)), [grad], 0.05)[0]
    r = QG.T @ grad @ QA
    torch.testing.assert_close(got, QG @ (r / (r * r + 0.05)) @ QA.T)


def test_apply_with_moments_leaves_the_given_moments_alone() -> None:
    solver = EigenAdamSolver(DT)
    state = solver.compute(A, G, 0.1)
    _, first = solver.apply_with_moments(state, None, _grads(1)[0], 0.1)
    assert first is not None
    saved = {k: v.clone() for k, v in first.items()}
    solver.apply_with_moments(state, first, _grads(2)[1], 0.1)
    for key, value in saved.items():
        assert torch.equal(first[key], value)
    assert first["t"].tolist() == [1.0]


def test_basis_is_descending_and_matches_the_factors() -> None:
    state = EigenAdamSolver(DT).compute(A, G, 0.1)
    torch.testing.assert_close(state["da"], torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25], dtype=DT))
    torch.testing.assert_close(state["dg"], torch.tensor([3.0, 1.0, 0.2], dtype=DT))
    torch.testing.assert_close((state["qa"].T @ QA).abs(), torch.eye(A_DIM, dtype=DT))


def test_power_refresh_converges_to_the_eigh_basis() -> None:
    values = [2.0**-i for i in range(6)]
    target = _orthogonal(6, 7)
    matrix = _factor(target, values)
    q = _orthogonal(6, 8)  # an unrelated start
    for _ in range(80):
        estimates, q = power_refresh(matrix, q, DT)
    torch.testing.assert_close((q.T @ target).abs(), torch.eye(6, dtype=DT), atol=1e-10, rtol=0)
    torch.testing.assert_close(estimates, torch.tensor(values, dtype=DT), atol=1e-10, rtol=0)


def test_a_converged_basis_is_a_fixed_point_of_the_power_refresh() -> None:
    _, q = descending_eigh(A, DT)
    estimates, again = power_refresh(A, q, DT)
    torch.testing.assert_close(again, q, atol=1e-12, rtol=0)
    torch.testing.assert_close(estimates, torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25], dtype=DT))


def test_power_option_follows_the_previous_state_and_starts_with_eigh() -> None:
    solver = EigenAdamSolver(DT, MomentOptions(basis_refresh="power"))
    first = solver.compute_statistics({"A": A, "G": G}, 0.1)
    torch.testing.assert_close((first["qa"].T @ QA).abs(), torch.eye(A_DIM, dtype=DT))
    moved = _factor(_orthogonal(A_DIM, 9), [5.0, 3.0, 1.0, 0.5, 0.1])
    second = solver.compute_statistics({"A": moved, "G": G}, 0.1, first)
    _, want = power_refresh(moved, first["qa"], DT)
    torch.testing.assert_close(second["qa"], want)
    eigh = EigenAdamSolver(DT).compute_statistics({"A": moved, "G": G}, 0.1, first)
    assert not torch.allclose(eigh["qa"].abs(), second["qa"].abs())


def test_a_partial_power_refresh_keeps_the_leading_columns_of_the_full_one() -> None:
    """``rank = k``: the first ``k`` columns and estimates of the full step (a QR's first
    columns depend only on the first columns of its matrix; the estimates are the new
    columns' Rayleigh quotients), an orthonormal completion, and the rest of the trace
    shared equally by the other estimates."""
    matrix = _low_rank(12, 30, seed=11)
    previous = _orthogonal(12, 12)
    full_estimates, full = power_refresh(matrix, previous, DT)
    estimates, q = power_refresh(matrix, previous, DT, rank=4)
    torch.testing.assert_close(q[:, :4], full[:, :4], rtol=0, atol=1e-12)
    torch.testing.assert_close(estimates[:4], full_estimates[:4], rtol=0, atol=1e-12)
    quotients = torch.diagonal(full.T @ matrix @ full)
    torch.testing.assert_close(full_estimates, quotients, rtol=0, atol=1e-12)
    torch.testing.assert_close(q.T @ q, torch.eye(12, dtype=DT), rtol=0, atol=1e-12)
    rest = (torch.trace(matrix) - full_estimates[:4].sum()) / 8
    torch.testing.assert_close(estimates[4:], rest.expand(8), rtol=1e-12, atol=0)
    assert not torch.allclose(q[:, 4:].abs(), full[:, 4:].abs(), atol=1e-3)  # unrelated
    for rank in (12, 20):  # as wide as the factor or wider: the full step
        same = power_refresh(matrix, previous, DT, rank=rank)
        torch.testing.assert_close(same[1], full, rtol=0, atol=0)
        torch.testing.assert_close(same[0], full_estimates, rtol=0, atol=0)


def test_the_power_refresh_finds_the_null_space_of_a_factor_whose_range_moved() -> None:
    """A factor of rank 3 of 8 whose range moved off the previous basis: ``F Q_prev`` is
    singular and the QR fills 5 columns with rounding. The estimates are the new columns'
    Rayleigh quotients, so :func:`canonical_null_basis` finds the null space wherever it
    lies and moves it last (oracle: ``eigh``'s rank and ``‖F Q_null‖``). With the old
    basis's quotients, columns of the range's rounding kept quotients of 1e-2 of the
    largest and the null space went unmarked."""
    old = _factor(_orthogonal(8, 21), [4.0, 2.0, 1.0, 0.5, 0.25, 0.0, 0.0, 0.0])
    _, previous = canonical_null_basis(*descending_eigh(old, DT), DT)
    factor = _low_rank(8, 3, seed=22)  # another range, rank 3
    estimates, q = power_refresh(factor, previous, DT)
    torch.testing.assert_close(estimates, torch.diagonal(q.T @ factor @ q), rtol=0, atol=1e-12)
    values, basis = canonical_null_basis(estimates, q, DT)
    assert int((values > 0).sum()) == int((torch.linalg.eigvalsh(factor) > 1e-10).sum()) == 3
    assert float((factor @ basis[:, 3:]).abs().max()) < 1e-12
    torch.testing.assert_close(basis.T @ basis, torch.eye(8, dtype=DT), rtol=0, atol=1e-12)


def test_a_partial_power_refresh_converges_to_the_leading_eigenvectors() -> None:
    values = [2.0**-i for i in range(8)]
    target = _orthogonal(8, 13)
    matrix = _factor(target, values)
    q = _orthogonal(8, 14)
    for _ in range(80):
        estimates, q = power_refresh(matrix, q, DT, rank=3)
    got = (q[:, :3].T @ target[:, :3]).abs()
    torch.testing.assert_close(got, torch.eye(3, dtype=DT), atol=1e-10, rtol=0)
    want = torch.tensor(values[:3], dtype=DT)
    torch.testing.assert_close(estimates[:3], want, atol=1e-10, rtol=0)
    torch.testing.assert_close(estimates[3:], torch.full((5,), sum(values[3:]) / 5, dtype=DT))


def test_power_rank_refreshes_the_leading_columns_of_a_wider_factor() -> None:
    """``power_rank=3``: the 5-wide input factor follows 3 columns, the 3-wide G all."""
    options = MomentOptions(basis_refresh="power", carry="reset", power_rank=3)
    solver = EigenAdamSolver(DT, options)
    first = solver.compute_statistics({"A": A, "G": G}, 0.1)
    moved_a = _factor(_orthogonal(A_DIM, 9), [5.0, 3.0, 1.0, 0.5, 0.1])
    moved_g = _factor(_orthogonal(G_DIM, 10), [2.0, 1.0, 0.5])
    second = solver.compute_statistics({"A": moved_a, "G": moved_g}, 0.1, first)
    want_da, want_qa = power_refresh(moved_a, first["qa"], DT, rank=3)
    torch.testing.assert_close(second["qa"], want_qa, rtol=0, atol=0)
    torch.testing.assert_close(second["da"], want_da, rtol=0, atol=0)
    torch.testing.assert_close(second["qg"], power_refresh(moved_g, first["qg"], DT)[1])
    full = EigenAdamSolver(DT, MomentOptions(basis_refresh="power"))
    assert not torch.allclose(
        full.compute_statistics({"A": moved_a, "G": moved_g}, 0.1, first)["qa"], second["qa"]
    )


def _moments(solver, state) -> dict[str, Tensor]:
    moments = None
    for grad in _grads(3):
        _, moments = solver.apply_with_moments(state, moments, grad, 0.1)
    return moments


def _new_state() -> dict[str, Tensor]:
    a2 = _factor(_orthogonal(A_DIM, 11), [4.0, 2.0, 1.0, 0.5, 0.25])
    g2 = _factor(_orthogonal(G_DIM, 12), [3.0, 1.0, 0.2])
    return EigenAdamSolver(DT).compute(a2, g2, 0.1)


@pytest.mark.parametrize("carry", ["keep_v", "rotate"])
def test_carry_rotates_the_first_moment_exactly(carry: str) -> None:
    solver = EigenAdamSolver(DT, MomentOptions(carry=carry))
    old, new = solver.compute(A, G, 0.1), _new_state()
    moments = _moments(solver, old)
    carried = solver.carry_moments(old, new, moments)
    torch.testing.assert_close(
        new["qg"] @ carried["m"] @ new["qa"].T, old["qg"] @ moments["m"] @ old["qa"].T
    )
    assert torch.equal(carried["t"], moments["t"])
    if carry == "keep_v":
        assert torch.equal(carried["v"], moments["v"])
    else:
        p_g, p_a = new["qg"].T @ old["qg"], new["qa"].T @ old["qa"]
        want = torch.einsum("ik,jl,kl->ij", p_g**2, p_a**2, moments["v"])
        torch.testing.assert_close(carried["v"], want)


def test_rotate_carries_the_second_moment_exactly_through_a_permutation() -> None:
    solver = EKFACSolver(DT, MomentOptions(carry="rotate"))
    old = solver.compute(A, G, 0.1)
    perm_a, perm_g = torch.tensor([2, 0, 4, 1, 3]), torch.tensor([1, 2, 0])
    new = {**old, "qa": -old["qa"][:, perm_a], "qg": old["qg"][:, perm_g]}
    moments = _moments(solver, old)
    carried = solver.carry_moments(old, new, moments)
    torch.testing.assert_close(carried["v"], moments["v"][perm_g][:, perm_a])


def test_reset_starts_the_moments_again() -> None:
    solver = EigenAdamSolver(DT, MomentOptions(carry="reset"))
    old, new = solver.compute(A, G, 0.1), _new_state()
    carried = solver.carry_moments(old, new, _moments(solver, old))
    assert carried["t"].tolist() == [0.0]
    assert not carried["m"].any() and not carried["v"].any()


@pytest.mark.parametrize("carry", ["reset", "keep_v", "rotate"])
def test_an_unchanged_basis_carries_nothing(carry: str) -> None:
    """The very same bases: the moments themselves; equal values in new tensors (a failed
    refresh kept by selection on the device): the same values, selected without a read."""
    solver = EigenAdamSolver(DT, MomentOptions(carry=carry))  # type: ignore[arg-type]
    old = solver.compute(A, G, 0.1)
    moments = _moments(solver, old)
    assert solver.carry_moments(old, dict(old), moments) is moments
    same = {k: v.clone() for k, v in old.items()}
    kept = solver.carry_moments(old, same, moments)
    assert kept.keys() == moments.keys()
    assert all(torch.equal(kept[k], moments[k]) for k in moments)


def test_costs_and_elements() -> None:
    assert EigenAdamSolver.moment_elements(10, 4) == 2 * 40 + 1
    assert EKFACSolver.moment_elements(10, 4) == 40 + 1
    assert EigenAdamSolver.state_elements(10, 4) == 100 + 10 + 16 + 4
    assert EigenAdamSolver.stateful and not make_solver("eigen").stateful
    assert EigenAdamSolver.apply_products == 4


def test_orthogonal_steps_sets_the_newton_schulz_steps() -> None:
    plain = EigenAdamSolver(DT, MomentOptions(beta1=0.8, eps=1e-3))
    options = MomentOptions(beta1=0.8, eps=1e-3, orthogonal_rms=0.7, orthogonal_steps=3)
    orthogonal = EigenAdamSolver(DT, options)
    assert orthogonal.label == "eigen_adam (orthogonal, rms 0.7, 3 steps)"
    for got, want in zip(_run(orthogonal, _grads(3)), _run(plain, _grads(3)), strict=True):
        scale = 0.7 * max(want.shape) ** 0.5
        torch.testing.assert_close(got, quintic_polar(want, 3) * scale, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("low", [torch.float32, torch.bfloat16], ids=str)
def test_a_lower_gradient_rotation_precision_rounds_only_the_rotation_into_the_basis(
    low: torch.dtype,
) -> None:
    """``gradient_rotation_dtype`` with float64 gradients: Adam on ``(Q_Gᵀ ∇W) Q_A`` taken
    in ``low`` (the same products in the same order: to the bit), the moments and the
    rotation out of the basis exact."""
    options = MomentOptions(
        beta1=0.8, beta2=0.9, eps=1e-3, carry="reset", gradient_rotation_dtype=low
    )
    solver = EigenAdamSolver(DT, options)
    qa, qg = (solver.compute(A, G, 0.1)[key] for key in ("qa", "qg"))
    grads = _grads(4)
    got = _run(solver, grads)
    rotated = [((qg.T.to(low) @ g.to(low)) @ qa.to(low)).to(DT) for g in grads]
    eye = torch.eye(A_DIM * G_DIM, dtype=DT)
    want = _adam_oracle(rotated, 0.8, 0.9, 1e-3, bias=True, nesterov=False, basis=eye)
    exact = _adam_oracle(grads, 0.8, 0.9, 1e-3, bias=True, nesterov=False)
    for g, w, e in zip(got, want, exact, strict=True):
        assert g.dtype == DT
        torch.testing.assert_close(g, qg @ w @ qa.T, rtol=1e-10, atol=1e-12)
        assert not torch.equal(g, e)  # the precision was lowered


def test_a_layer_with_no_basis_is_not_rounded() -> None:
    """Both sides one-sided (identity bases): no product to lower either way, the gradient
    and the update kept as they are."""
    both = {"max_dim": 2, "carry": "reset"}
    lowered = {"gradient_rotation_dtype": torch.bfloat16, "rotation_dtype": torch.bfloat16}
    low = EigenAdamSolver(DT, MomentOptions(**lowered, **both))  # type: ignore[arg-type]
    exact = EigenAdamSolver(DT, MomentOptions(**both))  # type: ignore[arg-type]
    for g, w in zip(_run(low, _grads(3)), _run(exact, _grads(3)), strict=True):
        assert torch.equal(g, w)


def _structured_case() -> tuple[EigenAdamSolver, Tensor, list[Tensor]]:
    """A solver whose 13-wide input factor (a 4 × 3 map and the bias) is structured."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(40, 12, generator=gen, dtype=DT).relu() + 0.1
    x = torch.cat([x, torch.ones(40, 1, dtype=DT)], dim=1)
    grads = [torch.randn(G_DIM, 13, generator=gen, dtype=DT) for _ in range(3)]
    options = MomentOptions(
        carry="reset", gradient_rotation_dtype=torch.bfloat16, rotation_dtype=torch.bfloat16
    )
    return EigenAdamSolver(DT, options, input_map=(4, 3)), x.T @ x / 40, grads


@pytest.mark.parametrize("case", ["dense", "one-sided", "structured", "out-only", "orthogonal"])
def test_one_cast_of_the_bases_for_both_rotations_changes_no_bit(
    case: str, monkeypatch: pytest.MonkeyPatch, native_bf16: Callable[[bool], None]
) -> None:
    """With the same dtype both ways the bases are cast once (``lowered_bases``), and kept
    for the next steps while the state is the same: the updates and moments equal those of
    a cast in each rotation, bit for bit; with only the rotation out lowered, the rotation
    in keeps the exact bases. A float32 polar factor is
    rotated out in bf16 without ``rotation_dtype`` where bf16 is native (for any work
    here): with a bf16 rotation in, one cast too."""
    native_bf16(True)
    monkeypatch.setattr(precision, "CPU_BF16_MIN_WORK", 1)
    g = G
    if case == "structured":
        solver, a, grads = _structured_case()
    elif case == "orthogonal":
        options = MomentOptions(
            carry="reset", gradient_rotation_dtype=torch.bfloat16, orthogonal_rms=0.7
        )
        solver = EigenAdamSolver(torch.float32, options)
        a, g, grads = A.float(), G.float(), [grad.float() for grad in _grads(3)]
    else:
        options = MomentOptions(
            carry="reset",
            gradient_rotation_dtype=None if case == "out-only" else torch.bfloat16,
            rotation_dtype=torch.bfloat16,
            max_dim=4 if case == "one-sided" else None,
        )
        solver, a, grads = EigenAdamSolver(DT, options), A, _grads(3)
    state = solver.compute(a, g, 0.1)

    def run() -> list[Tensor]:
        out, moments = [], None
        fresh = type(solver)(solver.compute_dtype, solver.options, solver.input_map)
        for grad in grads:
            update, moments = fresh.apply_with_moments(state, moments, grad, 0.1)
            out += [update, *moments.values()]
        return out

    lowered = eigen_moments.lowered_bases
    casts: list[torch.dtype] = []
    monkeypatch.setattr(
        eigen_moments,
        "lowered_bases",
        lambda state, dtype: casts.append(dtype) or lowered(state, dtype),
    )
    once = run()
    assert casts == [torch.bfloat16], case  # once for the three steps
    monkeypatch.setattr(eigen_moments, "lowered_bases", lambda state, dtype: state)
    for got, want in zip(once, run(), strict=True):
        assert torch.equal(got, want), case


def test_moments_of_a_narrower_dtype_take_the_gradient_s() -> None:
    """Moments saved in float32 and resumed under a float64 model are updated in float64."""
    solver = EigenAdamSolver(DT, MomentOptions(beta1=0.8))
    state = solver.compute(A, G, 0.1)
    grad = _grads(1)[0]
    _, exact = solver.apply_with_moments(state, None, grad, 0.1)
    narrow = {key: value.float() if key != "t" else value for key, value in exact.items()}
    _, got = solver.apply_with_moments(state, narrow, grad, 0.1)
    _, want = solver.apply_with_moments(state, exact, grad, 0.1)
    for key in ("m", "v"):
        assert got[key].dtype == DT, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)


def test_power_rank_needs_the_power_refresh_and_a_carry_of_v() -> None:
    with pytest.raises(ValueError, match=r"power_rank .* needs basis_refresh 'power'"):
        MomentOptions(carry="reset", power_rank=3)
    with pytest.raises(ValueError, match="use carry 'reset' or 'rotate'"):
        MomentOptions(basis_refresh="power", power_rank=3)  # the default carry keep_v
    for carry in ("reset", "rotate"):
        options = MomentOptions(basis_refresh="power", carry=carry, power_rank=3)  # type: ignore[arg-type]
        assert options.power_rank == 3


def test_gradient_rotation_dtype_needs_the_reset_carry() -> None:
    for carry in ("keep_v", "rotate"):
        with pytest.raises(ValueError, match="gradient_rotation_dtype needs carry 'reset'"):
            MomentOptions(carry=carry, gradient_rotation_dtype=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_rotation_dtype"):
        MomentOptions(carry="reset", gradient_rotation_dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float16 would flush"):
        MomentOptions(carry="reset", gradient_rotation_dtype=torch.float16)


def test_make_solver_passes_the_options() -> None:
    options = MomentOptions(beta1=0.5, carry="reset")
    solver = make_solver("eigen_adam", DT, moments=options)
    assert isinstance(solver, EigenAdamSolver) and solver.options is options
    assert isinstance(make_solver("ekfac"), EKFACSolver)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("beta1", 1.0, ValueError),
        ("beta2", -0.1, ValueError),
        ("eps", 0.0, ValueError),
        ("eps", math.inf, ValueError),
        ("beta1", "0.9", TypeError),
        ("bias_correction", 1, TypeError),
        ("basis_refresh", "lanczos", ValueError),
        ("carry", "keep", ValueError),
        ("max_dim", 0, ValueError),
        ("max_dim", True, ValueError),
        ("max_dim", 2.0, ValueError),
        ("orthogonal_rms", 0.0, ValueError),
        ("orthogonal_rms", math.inf, ValueError),
        ("orthogonal_rms", "1", TypeError),
        ("orthogonal_rms", [1.0], TypeError),
        ("orthogonal_rms", True, TypeError),
        ("orthogonal_steps", 0, ValueError),
        ("orthogonal_steps", 2.0, ValueError),
        ("orthogonal_steps", True, ValueError),
        ("power_rank", 0, ValueError),
        ("power_rank", 2.0, ValueError),
        ("power_rank", True, ValueError),
        ("orthogonal_split", -0.1, ValueError),
        ("orthogonal_split", 1.5, ValueError),
        ("orthogonal_split", math.nan, ValueError),
        ("orthogonal_split", "0.5", TypeError),
        ("orthogonal_split", True, TypeError),
    ],
)
def test_options_are_validated(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        MomentOptions(**{field: value})  # type: ignore[arg-type]


EYE_A, EYE_G = torch.eye(A_DIM, dtype=DT), torch.eye(G_DIM, dtype=DT)


@pytest.mark.parametrize(
    ("max_dim", "basis"),
    [(4, torch.kron(EYE_A, QG.contiguous())), (2, torch.kron(EYE_A, EYE_G)), (5, K)],
    ids=["wide-input-side", "both-sides-wide", "none-wide"],
)
def test_one_sided_eigen_adam_is_adam_in_the_basis_of_the_narrow_factors(
    max_dim: int, basis: Tensor
) -> None:
    """A factor wider than ``max_dim`` keeps the identity: ``K = I ⊗ Q_G`` (or ``I``)."""
    options = MomentOptions(beta1=0.8, beta2=0.9, eps=1e-3, nesterov=True, max_dim=max_dim)
    grads = _grads(4)
    got = _run(EigenAdamSolver(DT, options), grads)
    want = _adam_oracle(grads, 0.8, 0.9, 1e-3, bias=True, nesterov=True, basis=basis)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_wide_factor_is_never_decomposed_and_keeps_an_empty_basis() -> None:
    solver = EKFACSolver(DT, MomentOptions(max_dim=4, basis_refresh="power"))
    first = solver.compute(A, G, 0.1)
    assert first["qa"].shape == (0, 0) and first["da"].shape == (0,)
    nan_a = torch.full_like(A, float("nan"))  # never read: no decomposition of the wide side
    again = solver.compute_statistics({"A": nan_a, "G": G}, 0.1, previous=first)
    assert again["qa"].shape == (0, 0)
    want_dg, want_qg = power_refresh(G, first["qg"], DT)
    torch.testing.assert_close(again["qg"], want_qg)
    torch.testing.assert_close(again["dg"], want_dg)


def test_one_sided_carry_rotates_the_first_moment_exactly() -> None:
    solver = EigenAdamSolver(DT, MomentOptions(max_dim=4))
    old = solver.compute(A, G, 0.1)
    new = solver.compute(A, _factor(_orthogonal(G_DIM, 12), [3.0, 1.0, 0.2]), 0.1)
    moments = _moments(solver, old)
    carried = solver.carry_moments(old, new, moments)
    torch.testing.assert_close(new["qg"] @ carried["m"], old["qg"] @ moments["m"])


def test_a_lower_rotation_precision_rounds_only_the_rotation_out_of_the_basis() -> None:
    """float32 ``rotation_dtype`` with float64 gradients: the oracle whose last product
    ``K s`` takes ``K`` and ``s`` rounded to float32; the moments stay exact."""
    options = MomentOptions(beta1=0.8, beta2=0.9, eps=1e-3, rotation_dtype=torch.float32)
    grads = _grads(4)
    got = _run(EigenAdamSolver(DT, options), grads)
    assert all(g.dtype == DT for g in got)
    exact = _adam_oracle(grads, 0.8, 0.9, 1e-3, bias=True, nesterov=False)
    rounded = torch.kron(QA.float().double(), QG.float().double())
    want = _adam_oracle(grads, 0.8, 0.9, 1e-3, bias=True, nesterov=False, out_basis=rounded)
    for g, w, e in zip(got, want, exact, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert not torch.equal(g, e)  # the precision was lowered


@pytest.mark.parametrize(
    ("lowered", "bound"),
    [
        ({"rotation_dtype": torch.bfloat16}, 2e-2),
        ({"rotation_dtype": torch.bfloat16, "gradient_rotation_dtype": torch.bfloat16}, 4e-2),
    ],
    ids=["out-of-the-basis", "both-ways"],
)
def test_bf16_rotation_stays_within_bf16_of_the_exact_update(
    lowered: dict[str, torch.dtype], bound: float
) -> None:
    """On gradients of one scale (no entry below bf16's rounding: see the module notes)."""
    options = MomentOptions(eps=1e-3, nesterov=True, carry="reset", **lowered)
    grads = _grads(4)
    got = _run(EigenAdamSolver(DT, options), grads)
    want = _adam_oracle(grads, 0.9, 0.95, 1e-3, bias=True, nesterov=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == DT
        assert (g - w).norm() <= bound * w.norm()
    out_only = MomentOptions(eps=1e-3, nesterov=True, carry="reset", rotation_dtype=torch.bfloat16)
    if "gradient_rotation_dtype" in lowered:  # and the rotation in was lowered
        assert not torch.equal(got[-1], _run(EigenAdamSolver(DT, out_only), grads)[-1])


def test_the_carry_keeps_the_moments_precision_under_a_bf16_rotation() -> None:
    """The carried ``m`` is exact: in bf16 its error would be divided by ``√v``."""
    exact = EigenAdamSolver(DT)
    low = EigenAdamSolver(DT, MomentOptions(rotation_dtype=torch.bfloat16))
    old, new = exact.compute(A, G, 0.1), _new_state()
    moments = _moments(exact, old)
    assert torch.equal(
        low.carry_moments(old, new, moments)["m"], exact.carry_moments(old, new, moments)["m"]
    )


@pytest.mark.parametrize("value", ["bfloat16", torch.int32])
def test_rotation_dtype_is_validated(value: object) -> None:
    with pytest.raises(ValueError, match="rotation_dtype"):
        MomentOptions(rotation_dtype=value)  # type: ignore[arg-type]


def _low_rank(size: int, rank: int, seed: int) -> Tensor:
    """A factor as ``rank`` rows build it (some units dead: zero rows and columns)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(rank, size, generator=gen, dtype=DT).relu()
    return rows.T @ rows / rank


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_range_eigh_of_a_low_rank_factor_is_its_eigendecomposition(dtype: torch.dtype) -> None:
    factor = _low_rank(64, 12, seed=1)
    result = range_eigh(factor, dtype, rank=16)
    assert result is not None
    values, basis = result
    assert values.dtype == basis.dtype == dtype
    want = torch.linalg.eigvalsh(factor).flip(0)
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == DT else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(values.to(DT), want.clamp(min=0.0), **tol)
    assert torch.all(values[:-1] >= values[1:])
    eye = torch.eye(64, dtype=dtype)
    torch.testing.assert_close(basis.T @ basis, eye, **tol)
    rebuilt = basis @ torch.diag(values) @ basis.T
    torch.testing.assert_close(rebuilt.to(DT), factor, **tol)


def test_range_eigh_refuses_a_factor_of_higher_rank() -> None:
    assert range_eigh(_low_rank(64, 40, seed=2), DT, rank=16) is None
    nan = _low_rank(64, 8, seed=3)
    nan[0, 0] = float("nan")
    assert range_eigh(nan, DT, rank=16) is None


def test_the_first_decomposition_of_a_wide_low_rank_factor_takes_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wide enough and of low rank: the range basis; full rank: eigh; later: the power step;
    each with its null space in the canonical basis."""
    monkeypatch.setattr(eigen_basis, "RANGE_MIN_DIM", 32)
    solver = EigenAdamSolver(DT, MomentOptions(basis_refresh="power"))
    low = _low_rank(40, 6, seed=4)
    first = solver.compute_statistics({"A": low, "G": G}, 0.1)
    want = range_eigh(low, DT, rank=10)
    assert want is not None
    values, canonical = canonical_null_basis(want[0], want[1], DT)
    torch.testing.assert_close(first["qa"], canonical, rtol=0, atol=0)
    torch.testing.assert_close(first["da"], values, rtol=0, atol=0)
    assert "null_a" not in first  # derived on every rank, never sent
    completed = solver.completed(first)
    assert torch.equal(completed["null_a"], (values == 0).to(DT))
    assert completed["null_a"].sum() == 34
    assert not completed["null_g"].any()  # G has full rank
    assert solver.shared(completed) == first
    second = solver.compute_statistics({"A": low, "G": G}, 0.1, first)
    stepped = power_refresh(low, first["qa"], DT)
    torch.testing.assert_close(second["qa"], canonical_null_basis(*stepped, DT)[1])
    full = _low_rank(40, 200, seed=5)
    fresh = solver.compute_statistics({"A": full, "G": G}, 0.1)
    torch.testing.assert_close(fresh["qa"], descending_eigh(full, DT)[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [EigenAdamSolver, EKFACSolver])
def test_half_precision_gradients_keep_float32_moments(cls, dtype: torch.dtype) -> None:
    """A half-precision gradient is worked on in float32 and only its update rounded: the
    same bits as the float32 gradient's update rounded once, float32 moments, and no
    flushed second moment (in float16 these gradients' squares, ~1e-10, are zero)."""
    solver = cls(torch.float32)
    state = solver.compute(A.float(), G.float(), 0.1)
    grads = [(g * 1e-5).to(dtype) for g in _grads(3)]
    assert bool((grads[0].float() ** 2).to(torch.float16).eq(0).all())
    half, full = None, None
    for grad in grads:
        update, half = solver.apply_with_moments(state, half, grad, 0.1)
        want, full = solver.apply_with_moments(state, full, grad.float(), 0.1)
        assert update.dtype == dtype and half["v"].dtype == torch.float32
        assert torch.equal(update, want.to(dtype))
        assert all(torch.equal(half[k], full[k]) for k in full)
    if cls is EigenAdamSolver:  # Adam's entries stay of order one
        assert float(update.float().abs().max()) < 5.0


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("split", [0.0, 0.5])
def test_host_corrections_give_the_device_path_s_update(nesterov: bool, split: float) -> None:
    """One count on a CPU takes its bias corrections as Python numbers; a stack of two
    layers takes them as tensors: each layer's update is the same (float64, to rounding),
    and both are Adam's ``m̂ ⊘ (√v̂ + ε)`` written out."""
    options = MomentOptions(
        beta1=0.8, beta2=0.9, eps=1e-3, nesterov=nesterov, orthogonal_rms=0.2 if split else None,
        orthogonal_split=split,
    )  # fmt: skip
    solver = EigenAdamSolver(torch.float64, options)
    gen = torch.Generator().manual_seed(5)
    m, v = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64), torch.rand(2, 4, 3)
    rotated = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
    t = torch.tensor([[3.0], [7.0]], dtype=torch.float64)
    stack = {"m": m, "v": v.double(), "t": t}
    assert isinstance(solver.correction(0.8, t[0], m[0]), float)
    assert isinstance(solver.correction(0.8, t, m), Tensor)  # counts that differ
    same = torch.tensor([[4.0], [4.0]], dtype=torch.float64)
    assert solver.correction(0.8, same, m) == pytest.approx(1 - 0.8**4, rel=1e-15)
    for i in range(2):
        one = {"m": m[i], "v": v[i].double(), "t": t[i]}
        count = t[i].item()
        m_hat = (
            (0.8 * m[i] + 0.2 * rotated[i]) / (1 - 0.8 ** (count + 1))
            if nesterov
            else (m[i] / (1 - 0.8**count))
        )
        want = m_hat / ((v[i].double() / (1 - 0.9**count)).sqrt() + 1e-3)
        if not split:
            got = solver.scaled(one, rotated[i], 0.0)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
            torch.testing.assert_close(
                solver.scaled(stack, rotated, 0.0)[i], got, rtol=1e-12, atol=0
            )
        else:
            ratio, weight = solver.split_parts(one, rotated[i], 0.0, split)
            ratios, weights = solver.split_parts(stack, rotated, 0.0, split)
            # each up to a positive scale of its own: compare the products and the shapes
            torch.testing.assert_close(ratio * weight, ratios[i] * weights[i], rtol=1e-12, atol=0)
            scale = (ratio * weight / want).mean()
            torch.testing.assert_close(ratio * weight, want * scale, rtol=1e-10, atol=0)


def test_the_default_keeps_rounding_of_a_low_rank_factor_out_of_its_steps() -> None:
    """``for_model`` (power refreshes) on factors of low rank whose range moves (a 129-wide
    layer read by a 7-wide one, through a LayerNorm): one batch against the same batch
    accumulated in two halves, which differ by rounding only. With the old basis's
    quotients as the power step's estimates the null space went unmarked after the first
    refresh, and the runs ended 2.0 apart after 20 steps (as far as a 2-rank run from the
    serial one); 1e-4 now."""
    from dkfac import KFACOptimizer

    def run(parts: int) -> list[Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(7, 129), torch.nn.LayerNorm(129), torch.nn.Linear(129, 7),
            torch.nn.Tanh(), torch.nn.Linear(7, 3),
        ).double()  # fmt: skip
        opt = KFACOptimizer.for_model(
            model, lr=0.05, accumulation_steps=parts, factor_batch_size=None
        )
        for step in range(20):
            gen = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(512, 7, generator=gen, dtype=DT)
            y = torch.randint(0, 3, (512,), generator=gen)
            opt.zero_grad()
            for xs, ys in zip(x.chunk(parts), y.chunk(parts), strict=True):
                (torch.nn.functional.cross_entropy(model(xs), ys) / parts).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    whole, halves = run(1), run(2)
    assert max(float((p - q).abs().max()) for p, q in zip(whole, halves, strict=True)) < 1e-3


def test_a_converged_basis_stays_put_when_its_values_swap_or_tie() -> None:
    """Each new column follows the previous basis's column of its place, so moments kept
    across the refresh (``"keep_v"``) still belong to their direction: a factor with the
    same eigenvectors gives the same basis when two eigenvalues swap or two are equal
    (sorting the columns by their estimates moved them, and ``keep_v`` then scaled one
    direction by another's second moment)."""
    _, q = descending_eigh(A, DT)
    for values in ([0.5, 2.0, 1.0, 4.0, 0.25], [2.0, 2.0, 1.0, 1.0, 0.25]):
        moved = q @ torch.diag(torch.tensor(values, dtype=DT)) @ q.T
        estimates, again = power_refresh(moved, q, DT)
        torch.testing.assert_close(again, q, rtol=0, atol=1e-12)
        torch.testing.assert_close(estimates, torch.tensor(values, dtype=DT))


def test_a_partial_power_refresh_marks_the_null_space_where_it_lies() -> None:
    """``rank = k`` with a factor whose range partly left the followed columns: the
    completion's shared estimate exceeds the followed columns' zero ones, and the null
    space (the columns moved last) must not hold the range."""
    eye = torch.eye(8, dtype=DT)
    factor = 4 * torch.outer(eye[0], eye[0]) + torch.outer(eye[6], eye[6])  # e6 not followed
    estimates, q = power_refresh(factor, eye, DT, rank=4)
    values, basis = canonical_null_basis(estimates, q, DT)
    null = basis[:, values == 0]
    assert null.shape[1] >= 3
    assert float((factor @ null).abs().max()) < 1e-12


def test_a_direction_that_dies_keeps_its_place_and_is_marked_null() -> None:
    """A converged basis whose second eigenvalue drops to 0 (a unit that died): ``F Q_prev``
    has a column of rounding. In the QR's order it became a direction of rounding that the
    later columns were mixed into (overlaps of 0.4-0.9), with no estimate at 0; and the null
    partition moved it last, so a kept ``v`` scaled each later direction by its neighbour's.
    Now every column stays (the dead one replaced by the canonical null vector, here itself
    up to sign), its estimate is 0, and ``keep_v`` carries each ``v`` to its own direction."""
    gen = torch.Generator().manual_seed(1)
    q_a, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=DT))
    solver = EigenAdamSolver(DT, MomentOptions(basis_refresh="power", carry="keep_v"))
    old = solver.compute(_factor(q_a, [4.0, 2.0, 1.0, 0.5, 0.25]), G, 0.1)
    moments = None
    for _ in range(3):
        grad = torch.randn(G_DIM, A_DIM, generator=gen, dtype=DT) @ old["qa"].T
        _, moments = solver.apply_with_moments(old, moments, grad, 0.1)
    assert moments is not None
    dead = _factor(old["qa"], [4.0, 0.0, 1.0, 0.5, 0.25])
    new = solver.compute_statistics({"A": dead, "G": G}, 0.1, previous=old)
    torch.testing.assert_close(new["da"], torch.tensor([4.0, 0.0, 1.0, 0.5, 0.25], dtype=DT))
    torch.testing.assert_close((new["qa"].T @ old["qa"]).abs(), torch.eye(A_DIM, dtype=DT))
    carried = solver.carry_moments(old, new, moments)
    torch.testing.assert_close(carried["v"], moments["v"])
