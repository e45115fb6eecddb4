"""Block-diagonal bases of the eigenbasis-moment solvers (``block_size``) against dense oracles.

The oracle of a blocked solver is the dense one given the block-diagonal part of each factor:
a block-diagonal matrix with distinct eigenvalues has the union of its blocks' eigenvectors
as its eigenbasis, and an eigen-Adam update does not depend on the order or the signs of
the basis columns, so the two updates must agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, EKFACSolver, MomentOptions
from dkfac.solvers.eigen_moments import change_basis, descending_eigh, side_block, times_blocks
from dkfac.solvers.statistics import (
    BlockDiagonalAccumulator,
    BlockDiagonalStatistic,
    DenseStatistic,
    FactorAccumulator,
    block_bounds,
)

DT = torch.float64
BLOCK = 4
A_DIM, G_DIM = 11, 3  # A: blocks of 4, 4 and 3; G: narrower than a block (dense)


class _Rows:
    def __init__(self, rows: Tensor) -> None:
        self.rows = rows
        self.normaliser = float(rows.shape[0])


def _masked(matrix: Tensor, block: int = BLOCK) -> Tensor:
    out = torch.zeros_like(matrix)
    for i, j in block_bounds(matrix.shape[0], block):
        out[i:j, i:j] = matrix[i:j, i:j]
    return out


def _spd(n: int, seed: int) -> Tensor:
    """A symmetric positive definite matrix with distinct eigenvalues in every block."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(4 * n, n, generator=gen, dtype=DT)
    return rows.T @ rows / (4 * n) + 0.1 * torch.eye(n, dtype=DT)


def _grads(steps: int, g_dim: int = G_DIM, a_dim: int = A_DIM) -> list[Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(g_dim, a_dim, generator=gen, dtype=DT) for _ in range(steps)]


def _updates(solver: EigenAdamSolver | EKFACSolver, state: dict[str, Tensor]) -> list[Tensor]:
    moments, out = None, []
    for grad in _grads(3):
        update, moments = solver.apply_with_moments(state, moments, grad, 0.1)
        out.append(update)
    return out


def test_block_bounds_cut_consecutive_blocks_the_last_shorter() -> None:
    assert block_bounds(11, 4) == [(0, 4), (4, 8), (8, 11)]
    assert block_bounds(8, 4) == [(0, 4), (4, 8)]
    assert block_bounds(3, 4) == [(0, 3)]
    with pytest.raises(ValueError, match="size and block >= 1"):
        block_bounds(3, 0)


@pytest.mark.parametrize("capture", [None, torch.float32])
def test_the_accumulator_holds_the_diagonal_blocks_of_the_dense_sum(
    capture: torch.dtype | None,
) -> None:
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(6, A_DIM, generator=gen, dtype=DT) for _ in range(2))
    dense = FactorAccumulator(DT, capture)
    blocked = BlockDiagonalAccumulator(DT, capture, block=BLOCK)
    for acc in (dense, blocked):
        acc.add(_Rows(first), scale=2.0)
        acc.add(_Rows(second))
    assert blocked.normaliser == dense.normaliser == 12.0
    assert dense.total is not None and blocked.total is not None
    torch.testing.assert_close(blocked.total, _masked(dense.total))
    assert blocked.total[0, 4] == 0 and dense.total[0, 4] != 0


def test_a_precomputed_sum_loses_its_off_diagonal_blocks() -> None:
    total = _spd(A_DIM, 1)
    blocked = BlockDiagonalAccumulator(DT, None, block=BLOCK)
    blocked.add_sum(total, 5.0, scale=3.0)
    assert blocked.total is not None
    torch.testing.assert_close(blocked.total, 3.0 * _masked(total))
    assert blocked.normaliser == 5.0


def test_the_solver_captures_only_its_blocked_sides_block_diagonally() -> None:
    shapes = {"A": (A_DIM, A_DIM), "G": (G_DIM, G_DIM)}
    kinds = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK)).statistics(shapes)
    assert kinds["A"] == BlockDiagonalStatistic(BLOCK) and kinds["A"].label == "blockdiag"
    assert type(kinds["G"]) is DenseStatistic  # 3 wide: not wider than a block
    one_sided = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK, max_dim=10))
    assert type(one_sided.statistics(shapes)["A"]) is DenseStatistic  # identity basis
    structured = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK), input_map=(11, 1))
    assert type(structured.statistics(shapes)["A"]) is DenseStatistic
    assert type(EigenAdamSolver(DT).statistics(shapes)["A"]) is DenseStatistic


def test_a_blocked_basis_is_the_eigenbasis_of_each_diagonal_block() -> None:
    a, g = _spd(A_DIM, 2), _spd(G_DIM, 3)
    state = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK)).compute(a, g, 0.1)
    assert side_block(state, "qa") == BLOCK and side_block(state, "qg") is None
    assert state["qa_block"].numel() == 0
    qa, da = state["qa"], state["da"]
    torch.testing.assert_close(qa.T @ qa, torch.eye(A_DIM, dtype=DT))
    torch.testing.assert_close(qa @ torch.diag(da) @ qa.T, _masked(a))
    for i, j in block_bounds(A_DIM, BLOCK):
        assert not qa[i:j, :i].any() and not qa[i:j, j:].any()
        values, _ = descending_eigh(a[i:j, i:j], DT)
        torch.testing.assert_close(da[i:j], values)


@pytest.mark.parametrize("solver_type", [EigenAdamSolver, EKFACSolver])
@pytest.mark.parametrize("refresh", ["eigh", "power"])
def test_a_blocked_solver_equals_the_dense_one_on_the_block_diagonal_factor(
    solver_type: type[EigenAdamSolver] | type[EKFACSolver], refresh: str
) -> None:
    """Three updates, a refresh from the first state (a power step per block against one
    power step of the dense solver from the same block-diagonal basis), three more."""
    options = {"basis_refresh": refresh, "carry": "reset"}
    blocked = solver_type(DT, MomentOptions(block_size=BLOCK, **options))  # type: ignore[arg-type]
    dense = solver_type(DT, MomentOptions(**options))  # type: ignore[arg-type]
    a, g, later = _spd(A_DIM, 4), _spd(G_DIM, 5), _spd(A_DIM, 6)
    first = blocked.compute(a, g, 0.1)
    for got, want in zip(
        _updates(blocked, first), _updates(dense, dense.compute(_masked(a), g, 0.1)), strict=True
    ):
        torch.testing.assert_close(got, want)
    stats = {"A": later, "G": g}
    refreshed = blocked.compute_statistics(stats, 0.1, previous=first)
    plain_first = {k: v for k, v in first.items() if not k.endswith("_block")}
    dense_stats = {"A": _masked(later), "G": g}
    want_state = dense.compute_statistics(dense_stats, 0.1, previous=plain_first)
    torch.testing.assert_close(refreshed["qa"] @ refreshed["qa"].T, torch.eye(A_DIM, dtype=DT))
    for got, want in zip(_updates(blocked, refreshed), _updates(dense, want_state), strict=True):
        torch.testing.assert_close(got, want)


def test_block_products_equal_the_dense_ones() -> None:
    basis = torch.block_diag(*(torch.randn(j - i, j - i, dtype=DT) for i, j in block_bounds(11, 4)))
    matrix = torch.randn(11, 5, dtype=DT)
    torch.testing.assert_close(times_blocks(basis, matrix, 4, left=True), basis @ matrix)
    torch.testing.assert_close(times_blocks(basis.T, matrix, 4, left=True), basis.T @ matrix)
    torch.testing.assert_close(times_blocks(basis, matrix.T, 4, left=False), matrix.T @ basis)
    torch.testing.assert_close(times_blocks(basis, matrix, None, left=True), basis @ matrix)
    nearly_dense = torch.block_diag(torch.randn(10, 10, dtype=DT), torch.randn(1, 1, dtype=DT))
    got = times_blocks(nearly_dense, matrix.T, 10, left=False)  # one product: the same value
    torch.testing.assert_close(got, matrix.T @ nearly_dense)


def test_a_dense_state_rotates_densely_whatever_the_options() -> None:
    """The rotation follows the state's markers, not the solver's options: a dense state (one
    saved without blocks) loaded under ``block_size`` still rotates by its whole basis."""
    a, g = _spd(A_DIM, 8), _spd(G_DIM, 9)
    dense_state = EigenAdamSolver(DT).compute(a, g, 0.1)
    grad = _grads(1)[0]
    want = dense_state["qg"].T @ grad @ dense_state["qa"]
    torch.testing.assert_close(change_basis(grad, dense_state, None), want)
    blocked = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK))
    update, _ = blocked.apply_with_moments(dense_state, None, grad, 0.1)
    plain, _ = EigenAdamSolver(DT).apply_with_moments(dense_state, None, grad, 0.1)
    torch.testing.assert_close(update, plain)


@pytest.mark.parametrize("value", [0, -2, 2.5, True])
def test_block_size_is_validated(value: object) -> None:
    with pytest.raises(ValueError, match="block_size must be an integer >= 1 or None"):
        MomentOptions(block_size=value)  # type: ignore[arg-type]
