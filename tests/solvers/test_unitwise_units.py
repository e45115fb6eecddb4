"""The unit-wise solver on units of ``d > 2`` parameters (grouped convolutions).

Oracles: a dense solve of ``(F_c + λ I)`` per unit, in float64; the 2×2 closed form kept
for BatchNorm's units; non-finite Fishers refused as BatchNorm's are.
"""

from __future__ import annotations

import pytest
import torch

from dkfac.solvers import SolverError
from dkfac.solvers.unitwise import (
    UnitwiseSolver,
    damped_inverse,
    damped_inverse_2x2,
    solve_units,
)

DT = torch.float64


def _fishers(units: int, dim: int, seed: int, samples: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(units, samples, dim, generator=gen, dtype=DT)
    return rows.mT @ rows / samples  # rank ``samples`` (< dim: singular without damping)


def _dense(fisher: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    eye = torch.eye(fisher.shape[-1], dtype=fisher.dtype)
    return torch.stack(
        [torch.linalg.solve(f + damping * eye, g) for f, g in zip(fisher, grad, strict=True)]
    )


@pytest.mark.parametrize("dim", [1, 3, 10, 50])
def test_apply_is_a_dense_solve_per_unit(dim: int) -> None:
    fisher = _fishers(7, dim, seed=dim)
    grad = torch.randn(7, dim, dtype=DT)
    solver = UnitwiseSolver(DT)
    state = solver.compute_statistics({"F": fisher}, 0.03)
    torch.testing.assert_close(solver.apply(state, grad, 0.03), _dense(fisher, grad, 0.03))
    # the cached inverse follows a change of damping at once
    torch.testing.assert_close(solver.apply(state, grad, 0.5), _dense(fisher, grad, 0.5))


def test_two_parameter_units_keep_the_closed_form_bit_for_bit() -> None:
    fisher = _fishers(5, 2, seed=1)
    grad = torch.randn(5, 2, dtype=DT)
    assert torch.equal(damped_inverse(fisher, 0.1), damped_inverse_2x2(fisher, 0.1))
    inverse = damped_inverse_2x2(fisher, 0.1)
    assert torch.equal(solve_units(inverse, grad), (inverse * grad.unsqueeze(-2)).sum(dim=-1))


def test_layers_of_one_unit_size_are_solved_and_refreshed_as_one() -> None:
    solver = UnitwiseSolver(DT)
    fishers = [_fishers(4, 10, seed=2), _fishers(6, 10, seed=3), _fishers(3, 2, seed=4)]
    grads = [torch.randn(f.shape[0], f.shape[-1], dtype=DT) for f in fishers]
    states = [solver.compute_statistics({"F": f}, 0.03) for f in fishers]
    keys = [solver.refresh_key({"F": f}, None) for f in fishers]
    assert keys[0] == keys[1] != keys[2]  # the unit size is part of the key
    assert solver.batch_key(states[0], grads[0]) != solver.batch_key(states[2], grads[2])
    batched = solver.compute_batch([{"F": f} for f in fishers[:2]], 0.03, [None, None])
    solved = solver.apply_batch(batched, [None, None], grads[:2], 0.03)  # type: ignore[arg-type]
    for (update, _), fisher, grad in zip(solved, fishers, grads, strict=False):
        torch.testing.assert_close(update, _dense(fisher, grad, 0.03))


def test_a_non_finite_fisher_is_refused_in_its_own_layer() -> None:
    solver = UnitwiseSolver(DT)
    bad = _fishers(3, 10, seed=5)
    bad[1, 2, 3] = float("nan")
    with pytest.raises(SolverError, match="non-finite"):
        solver.compute_statistics({"F": bad}, 0.03)
    good = _fishers(3, 10, seed=6)
    states = solver.compute_batch([{"F": good}, {"F": bad}], 0.03, [None, None])
    assert isinstance(states[1], SolverError) and not isinstance(states[0], SolverError)


def test_a_unit_that_does_not_factorise_takes_a_finite_stand_in() -> None:
    """A damped Fisher beyond float32's range: ``I / (λ + tr F)`` for that unit, the others
    their inverse."""
    fisher = _fishers(3, 5, seed=7).float()
    fisher[1] *= 1e36  # its factorisation overflows in float32
    inverse = damped_inverse(fisher, 1e-3)
    assert torch.isfinite(inverse).all()
    eye = torch.eye(5)
    for unit in (0, 2):
        want = torch.linalg.inv((fisher[unit] + 1e-3 * eye).double()).float()
        torch.testing.assert_close(inverse[unit], want, rtol=1e-3, atol=1e-3)
    trace = fisher[1].diagonal().sum()
    torch.testing.assert_close(inverse[1], eye / (1e-3 + trace))
