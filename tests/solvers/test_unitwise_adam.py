"""Adam in each unit's eigenbasis (solvers/unitwise_adam.py) against explicit formulas."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dkfac.solvers import MomentOptions, SolverError, UnitwiseAdamSolver, make_solver

DT = torch.float64
UNITS, DIM = 5, 4


def _fisher(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(UNITS, DIM, 3 * DIM, generator=gen, dtype=DT)
    return rows @ rows.mT / (3 * DIM)


def _grads(steps: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(UNITS, DIM, generator=gen, dtype=DT) for _ in range(steps)]


def _explicit(fisher: Tensor, grads: list[Tensor], o: MomentOptions) -> list[Tensor]:
    """Each unit by hand: its eigenbasis from a dense eigh, Adam's moments of the rotated
    gradient (Nesterov's first moment, bias corrections) and the rotation back."""
    updates = []
    for unit in range(UNITS):
        _, q = torch.linalg.eigh(fisher[unit])
        m = torch.zeros(DIM, dtype=DT)
        v = torch.zeros(DIM, dtype=DT)
        for t, grad in enumerate(grads, start=1):
            r = q.T @ grad[unit]
            m = o.beta1 * m + (1 - o.beta1) * r
            v = o.beta2 * v + (1 - o.beta2) * r * r
            if o.nesterov:
                first = (o.beta1 * m + (1 - o.beta1) * r) / (1 - o.beta1 ** (t + 1))
            else:
                first = m / (1 - o.beta1**t)
            update = q @ (first / ((v / (1 - o.beta2**t)).sqrt() + o.eps))
            if len(updates) < t:
                updates.append(torch.zeros(UNITS, DIM, dtype=DT))
            updates[t - 1][unit] = update
    return updates


@pytest.mark.parametrize("nesterov", [False, True])
def test_updates_are_adam_in_each_units_eigenbasis(nesterov: bool) -> None:
    options = MomentOptions(beta1=0.8, beta2=0.9, eps=1e-3, nesterov=nesterov)
    solver = UnitwiseAdamSolver(DT, options)
    fisher = _fisher(0)
    state = solver.compute_statistics({"F": fisher}, damping=0.1)
    grads = _grads(3)
    moments = None
    for grad, want in zip(grads, _explicit(fisher, grads, options), strict=True):
        got, moments = solver.apply_with_moments(state, moments, grad, damping=0.1)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert moments is not None and float(moments["t"]) == 3.0


def test_a_diagonal_fisher_is_adam_on_the_raw_coordinates() -> None:
    """Distinct diagonal entries: every eigenvector is ± a coordinate, and Adam is equivariant
    to sign flips and permutations, so the update is Adam's on the gradient itself."""
    options = MomentOptions(beta1=0.9, beta2=0.95, eps=1e-8)
    solver = UnitwiseAdamSolver(DT, options)
    diagonal = torch.diag_embed(torch.arange(1, UNITS * DIM + 1, dtype=DT).view(UNITS, DIM))
    state = solver.compute_statistics({"F": diagonal}, damping=0.0)
    m = v = torch.zeros(UNITS, DIM, dtype=DT)
    moments = None
    for t, grad in enumerate(_grads(4), start=1):
        got, moments = solver.apply_with_moments(state, moments, grad, damping=0.0)
        m = 0.9 * m + 0.1 * grad
        v = 0.95 * v + 0.05 * grad * grad
        want = (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_apply_leaves_the_given_moments_and_casts_half_gradients() -> None:
    solver = UnitwiseAdamSolver(torch.float32)
    state = solver.compute_statistics({"F": _fisher(1).float()}, damping=0.1)
    grad = _grads(1)[0].to(torch.bfloat16)
    _, moments = solver.apply_with_moments(state, None, grad, 0.1)
    before = {k: v.clone() for k, v in moments.items()}
    update, after = solver.apply_with_moments(state, moments, grad, 0.1)
    assert update.dtype == torch.bfloat16 and after["m"].dtype == torch.float32
    assert all(torch.equal(moments[k], before[k]) for k in moments)
    assert solver.moment_elements(DIM, UNITS) == 2 * DIM * UNITS + 1
    assert solver.state_elements(DIM, UNITS) == UNITS * DIM * DIM


@pytest.mark.parametrize("carry", ["reset", "keep_v", "rotate"])
def test_moments_carried_across_a_refresh(carry: str) -> None:
    solver = UnitwiseAdamSolver(DT, MomentOptions(carry=carry))
    old = solver.compute_statistics({"F": _fisher(2)}, damping=0.1)
    new = solver.compute_statistics({"F": _fisher(3)}, damping=0.1)
    moments = None
    for grad in _grads(2):
        _, moments = solver.apply_with_moments(old, moments, grad, 0.1)
    assert moments is not None
    assert solver.carry_moments(old, old, moments) is moments  # the very same basis
    carried = solver.carry_moments(old, new, moments)
    if carry == "reset":
        assert all(not value.any() for value in carried.values())
        return
    # m carried exactly: the same vector in the weight space, Q' m' = Q m
    in_weights = (old["q"] @ moments["m"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close((new["q"] @ carried["m"].unsqueeze(-1)).squeeze(-1), in_weights)
    transition = new["q"].mT @ old["q"]
    want_v = (
        ((transition * transition) @ moments["v"].unsqueeze(-1)).squeeze(-1)
        if carry == "rotate"
        else moments["v"]
    )
    torch.testing.assert_close(carried["v"], want_v)
    assert torch.equal(carried["t"], moments["t"])


def test_a_non_finite_fisher_is_refused_and_the_factory_passes_the_options() -> None:
    solver = UnitwiseAdamSolver(DT)
    bad = _fisher(4)
    bad[1, 0, 0] = float("nan")
    with pytest.raises(SolverError, match="non-finite"):
        solver.compute_statistics({"F": bad}, damping=0.1)
    with pytest.raises(TypeError, match="not an \\(A, G\\) pair"):
        solver.compute(bad, bad, 0.1)
    with pytest.raises(TypeError, match="MomentOptions"):
        UnitwiseAdamSolver(DT, {"beta1": 0.5})  # type: ignore[arg-type]
    made = make_solver("unitwise_adam", DT, moments=MomentOptions(beta1=0.5))
    assert isinstance(made, UnitwiseAdamSolver) and made.options.beta1 == 0.5
    assert made.adam_scaled and made.stateful


def test_the_null_space_of_a_low_rank_fisher_gets_a_canonical_basis() -> None:
    """A Fisher from fewer samples than ``d``: rounding would pick the basis of its null
    space, to which Adam is not invariant; the canonical basis follows the Fisher
    continuously, so a perturbation at the rounding level moves the update by as little."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(UNITS, DIM, 2, generator=gen, dtype=DT)  # rank 2 of 4
    fisher = rows @ rows.mT
    noise = torch.randn(UNITS, DIM, DIM, generator=gen, dtype=DT) * 1e-17
    grad = torch.randn(UNITS, DIM, generator=gen, dtype=DT)  # not in the Fisher's range
    solver = UnitwiseAdamSolver(DT, MomentOptions(eps=1e-3))
    updates = [
        solver.apply(solver.compute_statistics({"F": f}, 0.1), grad, 0.1)
        for f in (fisher, fisher + noise + noise.mT)
    ]
    torch.testing.assert_close(updates[0], updates[1], rtol=0, atol=1e-8)
