"""``apply_groups``: layer groups of several shapes, their elementwise work as one flat pass.

Oracle: each group's own :meth:`~dkfac.solvers.base.Solver.apply_batch` on twin solvers (the
per-group path), bit for bit: the flat pass runs the same elementwise formulas on the same
numbers, and each group's rotations are its own (an orthogonalised update to the rounding:
the groups' polar factors are one zero-padded iteration). Over several steps (the flat
moments read back from the last call), with fresh, carried and replaced moments mixed, an
advance that fails on one step, and every option the flat pass takes (Nesterov without bias
correction, EKFAC, one-sided and block-diagonal sides, lowered rotations); each with
full-rank factors and with singular ones in some groups (Adam's rounding floor in their null
directions, taken per layer of the flat moments, beside groups without one), and the
orthogonalised update. The orthogonal update with a split and the structured input side are
not fused (``fuse_key`` is ``None``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EKFACSolver, MomentOptions, make_solver
from dkfac.solvers.base import BatchJob
from dkfac.solvers.eigen_moments import EigenMomentsSolver
from tests.solvers.test_apply_batch import CASES as BATCH_CASES

DT = torch.float64
SHAPES = [(6, 9, 3), (4, 5, 1), (6, 8, 2), (3, 4, 1)]
"""``(g, a, layers)`` of each group: stacked groups and single layers."""


POLAR_TOL = 1e-12
"""The orthogonalised updates' agreement: the groups' polar factors are one zero-padded
iteration (:mod:`dkfac.solvers.padded_polar`), whose products may sum in another order."""

SINGULAR = {(0, "A"): 4, (2, "G"): 3, (3, "A"): 2, (3, "G"): 1}
"""``(group, side) -> rank`` of the factors made singular (the other groups' are full)."""


def _spd(n: int, seed: int, rank: int | None = None) -> Tensor:
    """A full-rank factor, or one of ``rank`` (``RᵀR`` of fewer rows than its width)."""
    gen = torch.Generator().manual_seed(seed)
    if rank is not None:
        x = torch.randn(n, rank, generator=gen, dtype=DT)
        return x @ x.T / rank
    x = torch.randn(n, 3 * n, generator=gen, dtype=DT)
    return x @ x.T / (3 * n) + 0.01 * torch.eye(n, dtype=DT)


def _grads(step: int, group: int) -> list[Tensor]:
    g, a, count = SHAPES[group]
    gen = torch.Generator().manual_seed(1000 * step + group)
    return [torch.randn(g, a, generator=gen, dtype=DT) for _ in range(count)]


CASES: dict[str, tuple[type[EigenMomentsSolver], MomentOptions]] = {
    name: case for name, case in BATCH_CASES.items() if not case[1].orthogonal_split
}
CASES["lowered rotation out"] = (EigenAdamSolver, MomentOptions(rotation_dtype=torch.bfloat16))
CASES["orthogonal, power"] = (
    EigenAdamSolver,
    MomentOptions(orthogonal_rms=1.5, orthogonal_rms_power=0.5, orthogonal_steps=3, max_dim=7),
)


def _setup(
    cls: type[EigenMomentsSolver], options: MomentOptions, singular: bool = False
) -> tuple[list[EigenMomentsSolver], list[list[dict[str, Tensor]]]]:
    """A solver a group and each group's states (as every rank completes them), with the
    factors of :data:`SINGULAR` singular where ``singular``."""
    solvers = [cls(DT, options) for _ in SHAPES]

    def factor(k: int, side: str, n: int, seed: int) -> Tensor:
        return _spd(n, seed, SINGULAR.get((k, side)) if singular else None)

    states = [
        [
            solvers[k].completed(
                solvers[k].compute(
                    factor(k, "A", a, 7 * k + i), factor(k, "G", g, 7 * k + i + 3), 0.1
                )
            )
            for i in range(count)
        ]
        for k, (g, a, count) in enumerate(SHAPES)
    ]
    return solvers, states


@pytest.mark.parametrize("singular", [False, True], ids=["full rank", "singular factors"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_flat_pass_equals_each_group_s_own_bit_for_bit(case: str, singular: bool) -> None:
    cls, options = CASES[case]
    fused_solvers, states = _setup(cls, options, singular)
    own_solvers, _ = _setup(cls, options, singular)
    floored = [k for k, group in enumerate(states) if "null_g" in group[0]]
    if singular and cls.adam_scaled:  # floored groups beside groups without a floor
        assert floored and len(floored) < len(SHAPES), floored
    else:
        assert not floored
    pairs = enumerate(zip(fused_solvers, states, strict=True))
    keys = {s.fuse_key(st[0], _grads(0, k)[0]) for k, (s, st) in pairs}
    assert len(keys) == 1 and None not in keys
    fused: list[list[Any]] = [[None] * count for _, _, count in SHAPES]
    own: list[list[Any]] = [[None] * count for _, _, count in SHAPES]
    for step in range(5):
        grads = [_grads(step, k) for k in range(len(SHAPES))]
        if step == 2:  # one layer starts afresh, another gets new tensors (a carry)
            fused[0][1] = own[0][1] = None
            fused[2][0] = {k: v.clone() for k, v in fused[2][0].items()}
        advance = None if step != 3 else torch.tensor(step != 3)
        extra = {} if advance is None else {"advance": advance}
        jobs = [
            BatchJob(fused_solvers[k], states[k], fused[k], grads[k]) for k in range(len(SHAPES))
        ]
        outputs = fused_solvers[0].apply_groups(jobs, 0.1, **extra)
        for k, group in enumerate(outputs):
            wants = own_solvers[k].apply_batch(states[k], own[k], grads[k], 0.1, **extra)
            assert len(group) == len(wants) == SHAPES[k][2]
            for i, ((update, moments), (want, want_moments)) in enumerate(
                zip(group, wants, strict=True)
            ):
                where = f"{case}: step {step}, group {k}, layer {i}"
                assert update.dtype == want.dtype, where
                if fused_solvers[0].orthogonalises:  # one padded iteration: to the rounding
                    torch.testing.assert_close(update, want, rtol=POLAR_TOL, atol=POLAR_TOL)
                else:
                    assert torch.equal(update, want), where
                assert moments is not None and want_moments is not None
                assert moments.keys() == want_moments.keys(), where
                for key, value in moments.items():
                    assert value.shape == want_moments[key].shape, (where, key)
                    assert torch.equal(value, want_moments[key]), (where, key)
                fused[k][i], own[k][i] = moments, want_moments
    assert own[0][0]["t"].item() == 4.0 and own[0][1]["t"].item() == 2.0  # step 3 held


def test_the_given_moments_are_left_alone() -> None:
    solvers, states = _setup(EigenAdamSolver, MomentOptions())
    jobs = [
        BatchJob(solvers[k], states[k], [None] * c, _grads(0, k))
        for k, (_, _, c) in enumerate(SHAPES)
    ]
    first = solvers[0].apply_groups(jobs, 0.1)
    moments = [[m for _, m in group] for group in first]
    copies = [[{k: v.clone() for k, v in m.items()} for m in group] for group in moments]  # type: ignore[union-attr]
    jobs = [BatchJob(solvers[k], states[k], moments[k], _grads(1, k)) for k in range(len(SHAPES))]
    solvers[0].apply_groups(jobs, 0.1)
    for group, saved in zip(moments, copies, strict=True):
        for m, c in zip(group, saved, strict=True):
            assert m is not None and all(torch.equal(m[k], c[k]) for k in c)


def test_split_orthogonal_and_structured_layers_are_not_fused() -> None:
    grad = torch.zeros(6, 9, dtype=DT)
    split = EigenAdamSolver(DT, MomentOptions(orthogonal_rms=0.5, orthogonal_split=0.5))
    state = split.compute(_spd(9, 0), _spd(6, 1), 0.1)
    assert split.fuse_key(state, grad) is None
    orthogonal = EigenAdamSolver(DT, MomentOptions(orthogonal_rms=0.5))
    assert orthogonal.fuse_key(state, grad) not in (None, EigenAdamSolver(DT).fuse_key(state, grad))
    assert EigenAdamSolver(DT).fuse_key(state, grad) is not None
    assert EigenAdamSolver(DT).fuse_key(state, grad) != EKFACSolver(DT).fuse_key(state, grad)
    structured = make_solver("eigen_adam", DT, input_map=(3, 3))
    assert isinstance(structured, EigenMomentsSolver)
    s_state = structured.compute(_spd(9, 0), _spd(6, 1), 0.1)
    assert structured.fuse_key(s_state, grad) is None
