"""What the solvers keep between steps equals what they would make anew.

Oracle: a fresh solver of the same options (nothing kept), bit for bit: the eigen solver's
cast bases, their transposes and ``λ_G λ_Aᵀ + λ`` follow a new state, a new damping and a
new dtype; eigen-Adam's bases
cast for a lowered rotation follow a refreshed state; ``matmul`` of two stacks is ``@``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EigenSolver, MomentOptions
from dkfac.solvers.stacking import matmul
from dkfac.solvers.unitwise import UnitwiseSolver

DT = torch.float64


def _spd(n: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * n, generator=gen, dtype=DT)
    return x @ x.T / n + 0.05 * torch.eye(n, dtype=DT)


def _grad(seed: int, shape: tuple[int, ...] = (5, 7)) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def test_the_eigen_bases_and_denominator_follow_state_damping_and_dtype() -> None:
    kept = EigenSolver(DT)
    first = kept.compute(_spd(7, 1), _spd(5, 2), 0.1)
    second = kept.compute(_spd(7, 3), _spd(5, 4), 0.1)
    steps = [(first, 0.1, DT), (first, 0.1, DT), (first, 0.3, DT), (second, 0.3, DT)]
    steps.append((second, 0.3, torch.float32))
    for i, (state, damping, dtype) in enumerate(steps):
        grad = _grad(i).to(dtype)
        want = EigenSolver(DT).apply(state, grad, damping)
        got = kept.apply(state, grad, damping)
        assert got.dtype == dtype and torch.equal(got, want), i
    # The same state tensors give the very same prepared tensors (nothing recomputed).
    before = kept._last_prepared
    kept.apply(second, _grad(9).float(), 0.3)
    assert kept._last_prepared is before


def test_lowered_bases_follow_a_refreshed_state() -> None:
    options = MomentOptions(rotation_dtype=torch.bfloat16)
    kept = EigenAdamSolver(DT, options)
    states = [kept.compute(_spd(7, 2 * i), _spd(5, 2 * i + 1), 0.1) for i in range(2)]
    moments = None
    fresh_moments = None
    for step, state in enumerate([states[0], states[0], states[1], states[1]]):
        grad = _grad(10 + step)
        got, moments = kept.apply_with_moments(state, moments, grad, 0.1)
        fresh = EigenAdamSolver(DT, options)
        want, fresh_moments = fresh.apply_with_moments(state, fresh_moments, grad, 0.1)
        assert torch.equal(got, want), step
        assert all(torch.equal(moments[k], fresh_moments[k]) for k in moments), step


def test_matmul_of_stacks_is_the_operator() -> None:
    a, b = _grad(1, (3, 4, 5)), _grad(2, (3, 5, 6))
    assert torch.equal(matmul(a, b), a @ b)
    assert torch.equal(matmul(a[0], b[0]), a[0] @ b[0])
    assert torch.equal(matmul(a.mT.contiguous().mT, b), a @ b)


def test_the_unitwise_inverse_follows_states_and_damping() -> None:
    """BatchNorm's 2×2 solve keeps ``(F + λI)⁻¹`` between refreshes: a kept solver
    equals a fresh one bit for bit over a batch, a single layer, a new damping and new
    states."""
    kept = UnitwiseSolver(DT)

    def states(seed: int) -> list[dict[str, Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        fishers = [torch.randn(c, 2, 3, generator=gen, dtype=DT) for c in (3, 5)]
        return [kept.compute_statistics({"F": f @ f.mT}, 0.1) for f in fishers]

    first, second = states(1), states(2)
    grads = [_grad(20 + i, (c, 2)) for i, c in enumerate((3, 5))]
    for i, (group, damping) in enumerate([(first, 0.1), (first, 0.1), (first, 0.2), (second, 0.2)]):
        got = kept.apply_batch(group, [None, None], grads, damping)
        want = UnitwiseSolver(DT).apply_batch(group, [None, None], grads, damping)
        for (g, _), (w, _) in zip(got, want, strict=True):
            assert torch.equal(g, w), i
        alone = kept.apply(group[1], grads[1], damping)
        assert torch.equal(alone, UnitwiseSolver(DT).apply(group[1], grads[1], damping)), i
