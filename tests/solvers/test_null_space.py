"""The canonical null-space basis and Adam's rounding floor in a singular factor's null
directions, against explicit constructions: a rank-deficient factor built two ways that
differ only by rounding (a batch, and the same batch summed in two halves)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, MomentOptions, host_copy
from dkfac.solvers.base import BatchJob
from dkfac.solvers.basis_refresh import descending_eigh
from dkfac.solvers.null_space import (
    ROUNDING_FLOOR,
    any_null,
    canonical_null_basis,
    flat_rounding_floor,
    masked_null_basis,
    null_indicators,
    null_masks,
    null_weights,
    numerical_rank,
    numerical_ranks,
    rounding_floor,
)

DT = torch.float64
DIMS = [(7, 5, 3), (4, 6, 2), (3, 3, 4), (2, 4, 6)]
"""``(g, a, rows)`` of four layers: factors from ``rows`` rows (the first two singular)."""


def _rows(n_rows: int, width: int, seed: int, dtype: torch.dtype = DT) -> Tensor:
    return torch.randn(n_rows, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _two_ways(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``RᵀR`` at once and as the sum of its two halves' products."""
    half = rows.shape[0] // 2
    return rows.T @ rows, rows[:half].T @ rows[:half] + rows[half:].T @ rows[half:]


def test_the_null_basis_follows_the_range_where_eigh_picks_any() -> None:
    rows = _rows(5, 12, seed=0)
    one, other = _two_ways(rows)
    (d1, q1), (d2, q2) = descending_eigh(one, DT), descending_eigh(other, DT)
    assert numerical_rank(d1, DT) == numerical_rank(d2, DT) == 5
    assert (q1[:, 5:] - q2[:, 5:]).abs().max() > 0.1  # eigh: any basis of the null space
    (c1, b1), (_, b2) = canonical_null_basis(d1, q1, DT), canonical_null_basis(d2, q2, DT)
    signs = torch.sign((b1[:, 5:] * b2[:, 5:]).sum(0))
    assert torch.equal(signs, torch.ones(7, dtype=DT))
    torch.testing.assert_close(b1[:, 5:], b2[:, 5:], rtol=0, atol=1e-10)
    assert torch.equal(b1[:, :5], q1[:, :5])  # the range is kept as it was
    torch.testing.assert_close(b1.T @ b1, torch.eye(12, dtype=DT), rtol=0, atol=1e-12)
    torch.testing.assert_close(one @ b1[:, 5:], torch.zeros(12, 7, dtype=DT), rtol=0, atol=1e-10)
    assert torch.equal(c1[5:], torch.zeros(7, dtype=DT)) and torch.equal(c1[:5], d1[:5])


@pytest.mark.parametrize("rank", [1, 5, 11])
def test_the_null_columns_are_the_projected_probe_orthonormalised_in_order(rank: int) -> None:
    """Oracle: ``(I − Q_r Q_rᵀ) Ω_j`` for ``j >= r`` (``Ω`` the fixed Gaussian seeded by the
    width), orthonormalised one column after another by explicit Gram–Schmidt (twice), each
    column's sign that of its projection: what the single QR of ``[Q_r, Ω]`` computes."""
    rows = _rows(rank, 12, seed=30 + rank)
    values, basis = descending_eigh(rows.T @ rows, DT)
    got = canonical_null_basis(values, basis, DT)[1]
    omega = torch.randn(12, 12, generator=torch.Generator().manual_seed(12), dtype=DT)
    columns = [basis[:, i] for i in range(rank)]
    for j in range(rank, 12):
        y = omega[:, j].clone()
        for _ in range(2):
            for c in columns:
                y = y - (c @ y) * c
        columns.append(y / y.norm())
    want = torch.stack(columns, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_factor_of_full_rank_or_zero_is_left_as_it_is() -> None:
    full = _rows(30, 12, seed=1)
    values, basis = descending_eigh(full.T @ full, DT)
    assert canonical_null_basis(values, basis, DT) == (values, basis)
    zero_values, zero_basis = descending_eigh(torch.zeros(4, 4, dtype=DT), DT)
    got = canonical_null_basis(zero_values, zero_basis, DT)
    assert got[0] is zero_values and got[1] is zero_basis


def test_null_indicators_and_weights() -> None:
    dg = torch.tensor([3.0, 1.0, 0.0], dtype=DT)
    da = torch.tensor([2.0, 0.0], dtype=DT)
    entries = null_indicators(dg, da)
    assert torch.equal(entries["null_g"], torch.tensor([0.0, 0.0, 1.0], dtype=DT))
    weights = null_weights(entries)
    assert weights is not None
    assert torch.equal(weights, torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]], dtype=DT))
    assert null_indicators(dg[:2], da[:1]) == {}
    one_sided = null_indicators(dg, torch.zeros(0, dtype=DT))  # identity input side
    assert torch.equal(one_sided["null_a"], torch.zeros(1, dtype=DT))  # broadcasts
    one_sided_weights = null_weights(one_sided)
    assert one_sided_weights is not None and one_sided_weights.shape == (3, 1)
    assert null_weights({}) is None


def _update(solver: EigenAdamSolver, g_factor: Tensor, grad: Tensor, a: Tensor) -> Tensor:
    return solver.apply(solver.completed(solver.compute(a, g_factor, 0.1)), grad, 0.1)


def test_adam_in_a_singular_basis_moves_rounding_by_a_thousandth_of_a_step() -> None:
    """float32, a G of rank 6 of 16 and a gradient in its range, each built at once and in
    two halves: the first eigen_adam steps agree to 1e-3 of a step; without the floor the
    null coordinates' rounding is normalised into steps of their own."""
    rows = _rows(6, 16, seed=2, dtype=torch.float32)
    coefficients = _rows(6, 5, seed=3, dtype=torch.float32)
    a = (lambda r: r.T @ r)(_rows(20, 5, seed=4, dtype=torch.float32))
    g_once, g_halves = _two_ways(rows)
    grad_once = rows.T @ coefficients
    grad_halves = rows[:3].T @ coefficients[:3] + rows[3:].T @ coefficients[3:]
    solver = EigenAdamSolver(torch.float32, MomentOptions())
    once = _update(solver, g_once, grad_once, a)
    halves = _update(solver, g_halves, grad_halves, a)
    assert (once - halves).abs().max() < 1e-3
    bare = EigenAdamSolver(torch.float32, dataclasses.replace(MomentOptions(), rounding_floor=0.0))
    assert (
        _update(bare, g_once, grad_once, a) - _update(bare, g_halves, grad_halves, a)
    ).abs().max() > 0.05


def test_the_flat_floor_is_each_layer_s_floor() -> None:
    """Against ``ROUNDING_FLOOR · √(Σ v)`` of each layer, written out."""
    gen = torch.Generator().manual_seed(5)
    layers = [torch.rand(g, a, generator=gen, dtype=DT) for g, a, _ in DIMS]
    sizes = tuple(v.numel() for v in layers)
    index = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    flat = flat_rounding_floor(torch.cat([v.reshape(-1) for v in layers]), sizes, index)
    for v, part in zip(layers, flat.split(sizes), strict=True):
        want = ROUNDING_FLOOR * float(v.sum()) ** 0.5
        torch.testing.assert_close(part, torch.full_like(part, want), rtol=1e-15, atol=0)
        assert torch.equal(part, rounding_floor(v).expand(v.shape).reshape(-1))
    stack = torch.stack([layers[0], layers[0] * 2])  # each matrix of a stack its own
    per = rounding_floor(stack)
    assert per.shape == (2, 1, 1) and torch.equal(per[0], rounding_floor(layers[0]))


def test_singular_layers_in_the_flat_pass_equal_each_layer_alone() -> None:
    """Layers of four shapes, two with singular factors (floored) and two without, through
    the flat pass against each layer's own apply, bit for bit (one layer a group: the same
    products), two steps each of three compositions (the last two: the same floored layer
    beside layers of other shapes without a floor)."""
    fused = [EigenAdamSolver(DT) for _ in DIMS]
    alone = EigenAdamSolver(DT)
    states = []
    for k, (g, a, rows) in enumerate(DIMS):
        x_a, x_g = _rows(rows, a, seed=10 + k), _rows(rows, g, seed=20 + k)
        states.append(fused[k].completed(fused[k].compute(x_a.T @ x_a, x_g.T @ x_g, 0.1)))
    assert ["null_g" in state for state in states] == [True, True, False, False]
    keys = {
        s.fuse_key(st, torch.zeros(g, a, dtype=DT))
        for s, st, (g, a, _) in zip(fused, states, DIMS, strict=True)
    }
    assert len(keys) == 1 and None not in keys
    flat: list[dict[str, Tensor] | None] = [None] * len(DIMS)
    own: list[dict[str, Tensor] | None] = [None] * len(DIMS)
    for step, members in enumerate([[0, 1, 2]] * 2 + [[0, 2]] * 2 + [[0, 3]] * 2):
        grads = [_rows(g, a, seed=100 * step + k) for k, (g, a, _) in enumerate(DIMS)]
        jobs = [BatchJob(fused[k], [states[k]], [flat[k]], [grads[k]]) for k in members]
        for k, [(update, moments)] in zip(members, fused[0].apply_groups(jobs, 0.1), strict=True):
            want, own[k] = alone.apply_with_moments(states[k], own[k], grads[k], 0.1)
            assert torch.equal(update, want), (step, k)
            assert moments is not None and all(torch.equal(moments[n], own[k][n]) for n in own[k])
            flat[k] = moments


def test_the_masked_null_basis_equals_the_checked_one_bit_for_bit() -> None:
    """:func:`masked_null_basis` (no host read) against :func:`canonical_null_basis` with
    its read, for a singular factor, one of full rank and a zero one, alone and as one
    stack: the same tensors, bit for bit (full rank and zero: the inputs' values)."""
    singular = _rows(5, 12, seed=6)
    regular = _rows(30, 12, seed=7)
    pairs = [
        descending_eigh(singular.T @ singular, DT),
        descending_eigh(regular.T @ regular, DT),
        descending_eigh(torch.zeros(12, 12, dtype=DT), DT),
    ]
    stacked_values = torch.stack([v for v, _ in pairs])
    stacked_basis = torch.stack([q for _, q in pairs])
    ranks = numerical_ranks(stacked_values, DT)
    assert ranks.tolist() == [5, 12, 0]
    values, basis = masked_null_basis(stacked_values, stacked_basis, ranks)
    unread = canonical_null_basis(stacked_values, stacked_basis, DT, check=False)
    assert torch.equal(unread[0], values) and torch.equal(unread[1], basis)
    for i, (d, q) in enumerate(pairs):
        want_values, want_basis = canonical_null_basis(d, q, DT)
        alone = masked_null_basis(d, q, numerical_ranks(d, DT))
        assert torch.equal(alone[0], want_values) and torch.equal(alone[1], want_basis), i
        torch.testing.assert_close(values[i], want_values, rtol=0, atol=1e-14)
        torch.testing.assert_close(basis[i], want_basis, rtol=0, atol=1e-12)
    assert torch.equal(basis[1], pairs[1][1]) and torch.equal(values[1], pairs[1][0])
    assert torch.equal(basis[2], pairs[2][1]) and torch.equal(values[2], pairs[2][0])


def test_null_masks_are_fixed_shapes_and_indicators_read_them() -> None:
    dg = torch.tensor([3.0, 1.0], dtype=DT)
    da = torch.tensor([2.0, 1.0, 0.5], dtype=DT)
    masks = null_masks(dg, da)
    assert masks["null_g"].shape == (2,) and masks["null_a"].shape == (3,)
    assert not any_null(masks) and null_indicators(dg, da) == {}
    masks = null_masks(dg, torch.tensor([2.0, 0.0, 0.0], dtype=DT))
    assert bool(any_null(masks)) and masks["null_a"].tolist() == [0.0, 1.0, 1.0]


def _state(rows: int, seed: int) -> dict[str, Tensor]:
    """A completed-to-be state of a 6-wide ``A`` built from ``rows`` rows (singular below
    6) and a regular ``G``."""
    solver = EigenAdamSolver(DT, MomentOptions())
    a = (lambda r: r.T @ r)(_rows(rows, 6, seed=seed))
    g = (lambda r: r.T @ r)(_rows(20, 4, seed=seed + 1))
    return solver.compute(a, g, 0.1)


def test_a_refresh_takes_the_null_indicators_from_the_layer_s_earlier_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``completed(late=True)`` on a device whose reads wait (a GPU, emulated): the first
    state decides by a read; a layer whose factor turns singular gets its indicators from
    the refresh after the one that showed it (its flag read from a host copy), and keeps
    them (zero where nothing is singular); a completion without ``late`` (a checkpoint)
    decides from its own state again."""
    monkeypatch.setattr(host_copy, "HOST_COUNT_DEVICES", frozenset())
    solver = EigenAdamSolver(DT, MomentOptions())
    regular, singular = _state(30, seed=8), _state(3, seed=9)
    assert "null_g" not in solver.completed(regular, late=True)
    assert "null_g" not in solver.completed(singular, late=True)  # seen, not yet applied
    floored = solver.completed(singular, late=True)
    assert torch.equal(floored["null_a"], (floored["da"] == 0).to(DT))
    assert floored["null_a"].sum() == 3
    kept = solver.completed(regular, late=True)  # sticky: zeros move no value
    assert not kept["null_a"].any() and not kept["null_g"].any()
    assert "null_g" not in solver.completed(regular)  # decided anew from this state
    assert "null_g" in EigenAdamSolver(DT, MomentOptions()).completed(singular, late=True)


def test_on_a_cpu_a_refresh_decides_the_null_indicators_from_its_own_state() -> None:
    """On a CPU (a read waits for nothing) ``completed(late=True)`` reads this state's
    flag: a singular state gets its indicators at once, and a layer whose factors became
    regular drops them (its update is the same: they are zero), so that the rounding
    floor is not taken every step for nothing."""
    solver = EigenAdamSolver(DT, MomentOptions())
    regular, singular = _state(30, seed=8), _state(3, seed=9)
    assert "null_g" not in solver.completed(regular, late=True)
    floored = solver.completed(singular, late=True)
    assert torch.equal(floored["null_a"], (floored["da"] == 0).to(DT))
    assert "null_g" not in solver.completed(regular, late=True)
    grad = torch.randn(4, 6, dtype=DT, generator=torch.Generator().manual_seed(3))
    kept = {**regular, "null_g": torch.zeros(4, dtype=DT), "null_a": torch.zeros(6, dtype=DT)}
    moments = None
    for _ in range(3):  # zero indicators and none: the same updates, bit for bit
        with_zeros, after = solver.apply_with_moments(kept, moments, grad, 0.1)
        without, _ = solver.apply_with_moments(regular, moments, grad, 0.1)
        assert torch.equal(with_zeros, without)
        moments = after
