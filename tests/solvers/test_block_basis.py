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
from dkfac.solvers.basis_refresh import descending_eigh
from dkfac.solvers.block_layout import as_dense, block_bounds, blocks_shape, diagonal_blocks
from dkfac.solvers.rotations import change_basis, side_block, times_blocks
from dkfac.solvers.statistics import (
    BlockDiagonalAccumulator,
    BlockDiagonalStatistic,
    DenseStatistic,
    DiagonalAccumulator,
    DiagonalStatistic,
    FactorAccumulator,
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
    g_dim, a_dim = state["qg"].shape[0], state["qa"].shape[0]
    for grad in _grads(3, g_dim, a_dim):
        update, moments = solver.apply_with_moments(state, moments, grad, 0.1)
        out.append(update)
    return out


def test_block_bounds_cut_consecutive_blocks_the_last_shorter() -> None:
    assert block_bounds(11, 4) == [(0, 4), (4, 8), (8, 11)]
    assert block_bounds(8, 4) == [(0, 4), (4, 8)]
    assert block_bounds(3, 4) == [(0, 3)]
    with pytest.raises(ValueError, match="size and block >= 1"):
        block_bounds(3, 0)


@pytest.mark.parametrize("block", [BLOCK, 1])
@pytest.mark.parametrize("capture", [None, torch.float32])
def test_the_accumulator_holds_the_diagonal_blocks_of_the_dense_sum(
    capture: torch.dtype | None, block: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(6, A_DIM, generator=gen, dtype=DT) for _ in range(2))
    dense = FactorAccumulator(DT, capture)
    blocked = BlockDiagonalAccumulator(DT, capture, block=block)
    for acc in (dense, blocked):
        acc.add(_Rows(first), scale=2.0)
        acc.add(_Rows(second))
    assert blocked.normaliser == dense.normaliser == 12.0
    assert dense.total is not None and blocked.total is not None
    assert blocked.total.shape == blocks_shape(A_DIM, block)  # only the blocks are held
    shape = (A_DIM, A_DIM)
    torch.testing.assert_close(as_dense(blocked.total, shape), _masked(dense.total, block))
    if block == BLOCK:  # the last block, 3 wide, padded to 4 with zeros
        assert not blocked.total[-1, 3].any() and not blocked.total[-1, :, 3].any()


@pytest.mark.parametrize("block", [BLOCK, 1])
def test_a_low_precision_product_is_stored_before_it_is_scaled(block: int) -> None:
    """float16 products of 4096 rows times the squared batch size overflow float16; like the
    dense accumulator, the blocked one converts each product to float32 first."""
    gen = torch.Generator().manual_seed(2)
    rows = _Rows(torch.randn(4096, 8, generator=gen))
    dense = FactorAccumulator(torch.float32, torch.float16)
    blocked = BlockDiagonalAccumulator(torch.float32, torch.float16, block=block)
    for acc in (dense, blocked):
        acc.add(rows, scale=1.2e5)
    assert dense.total is not None and blocked.total is not None
    assert torch.isfinite(blocked.total).all()
    # The diagonal (blocks of 1) is summed from float16 inputs in float32, while the dense
    # product rounds its result to float16 (2^-11 relative) before it is converted.
    rtol = 1e-3 if block == 1 else None
    torch.testing.assert_close(
        as_dense(blocked.total, (8, 8)),
        _masked(dense.total, block),
        rtol=rtol,
        atol=None if rtol is None else 0.0,
    )


def test_a_precomputed_sum_loses_its_off_diagonal_blocks() -> None:
    total = _spd(A_DIM, 1)
    blocked = BlockDiagonalAccumulator(DT, None, block=BLOCK)
    blocked.add_sum(total, 5.0, scale=3.0)
    assert blocked.total is not None and blocked.total.shape == (3, BLOCK, BLOCK)
    torch.testing.assert_close(as_dense(blocked.total, (A_DIM, A_DIM)), 3.0 * _masked(total))
    assert blocked.normaliser == 5.0


def test_the_solver_captures_only_its_blocked_sides_block_diagonally() -> None:
    shapes = {"A": (A_DIM, A_DIM), "G": (G_DIM, G_DIM)}
    kinds = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK)).statistics(shapes)
    assert kinds["A"] == BlockDiagonalStatistic(BLOCK) and kinds["A"].label == "blockdiag"
    assert type(kinds["G"]) is DenseStatistic  # 3 wide: not wider than a block
    one_sided = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK, max_dim=10))
    assert one_sided.statistics(shapes)["A"] == DiagonalStatistic()  # identity basis
    structured = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK), input_map=(11, 1))
    assert type(structured.statistics(shapes)["A"]) is DenseStatistic
    # The structured input side builds its own basis whatever max_dim says.
    wide_structured = EigenAdamSolver(DT, MomentOptions(max_dim=10), input_map=(11, 1))
    assert type(wide_structured.statistics(shapes)["A"]) is DenseStatistic
    assert type(EigenAdamSolver(DT).statistics(shapes)["A"]) is DenseStatistic


@pytest.mark.parametrize("solver_class", [EigenAdamSolver, EKFACSolver])
def test_a_one_sided_side_is_captured_as_its_diagonal_and_updates_as_if_dense(
    solver_class: type[EigenAdamSolver] | type[EKFACSolver],
) -> None:
    """A side wider than ``max_dim`` keeps the identity basis, so only its width is read:
    it is captured and kept as its ``(d,)`` diagonal, and the updates equal those of the
    same solver given the dense factor (float64, the other side's basis from the same
    factor)."""
    g_dim, a_dim = 4, 9
    solver = solver_class(DT, MomentOptions(max_dim=6, carry="reset"))
    kinds = solver.statistics({"A": (a_dim, a_dim), "G": (g_dim, g_dim)})
    assert kinds["A"] == DiagonalStatistic() and type(kinds["G"]) is DenseStatistic
    assert kinds["A"].label == "diagonal" and kinds["A"].stored_shape((a_dim, a_dim)) == (a_dim,)
    gen = torch.Generator().manual_seed(5)
    rows_a = torch.randn(20, a_dim, generator=gen, dtype=DT)
    acc = kinds["A"].accumulator(DT, None)
    acc.add(_Rows(rows_a), scale=2.0)
    diagonal = acc.mean()
    assert diagonal is not None and diagonal.shape == (a_dim,)
    torch.testing.assert_close(diagonal, (2.0 * rows_a.T @ rows_a / 20.0).diagonal())
    g = _spd(g_dim, 6)
    dense_state = solver.compute(rows_a.T @ rows_a / 20.0, g, 0.1)
    diagonal_state = solver.compute(diagonal, g, 0.1)
    assert dense_state["qa"].numel() == 0 and diagonal_state["qa"].numel() == 0
    moments: dict[str, dict[str, Tensor] | None] = {"dense": None, "diagonal": None}
    for grad in _grads(3, g_dim, a_dim):
        dense, moments["dense"] = solver.apply_with_moments(
            dense_state, moments["dense"], grad, 0.1
        )
        from_diagonal, moments["diagonal"] = solver.apply_with_moments(
            diagonal_state, moments["diagonal"], grad, 0.1
        )
        torch.testing.assert_close(from_diagonal, dense, rtol=1e-12, atol=1e-12)


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
@pytest.mark.parametrize("wide", ["A", "G"])
def test_a_blocked_solver_equals_the_dense_one_on_the_block_diagonal_factor(
    solver_type: type[EigenAdamSolver] | type[EKFACSolver], refresh: str, wide: str
) -> None:
    """Three updates, a refresh from the first state (a power step per block against one
    power step of the dense solver from the same block-diagonal basis), three more; the
    11-wide side (blocks of 4, 4 and 3) is the input or the output side."""
    options = {"basis_refresh": refresh, "carry": "reset"}
    blocked = solver_type(DT, MomentOptions(block_size=BLOCK, **options))  # type: ignore[arg-type]
    dense = solver_type(DT, MomentOptions(**options))  # type: ignore[arg-type]
    narrow = G_DIM if wide == "A" else 3
    first_stats = {"A": _spd(A_DIM, 4), "G": _spd(narrow, 5)}
    later_stats = {"A": _spd(A_DIM, 6), "G": first_stats["G"]}
    if wide == "G":  # the same matrices, the other way round
        first_stats = {"A": first_stats["G"], "G": first_stats["A"]}
        later_stats = {"A": later_stats["G"], "G": later_stats["A"]}
    key = "qa" if wide == "A" else "qg"

    def masked(stats: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**stats, wide: _masked(stats[wide])}

    first = blocked.compute_statistics(first_stats, 0.1)
    assert side_block(first, key) == BLOCK
    want_first = dense.compute_statistics(masked(first_stats), 0.1)
    for got, want in zip(_updates(blocked, first), _updates(dense, want_first), strict=True):
        torch.testing.assert_close(got, want)
    refreshed = blocked.compute_statistics(later_stats, 0.1, previous=first)
    plain_first = {k: v for k, v in first.items() if not k.endswith("_block")}
    want_state = dense.compute_statistics(masked(later_stats), 0.1, previous=plain_first)
    torch.testing.assert_close(refreshed[key] @ refreshed[key].T, torch.eye(A_DIM, dtype=DT))
    for got, want in zip(_updates(blocked, refreshed), _updates(dense, want_state), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("previous_block", [None, 3])
def test_a_power_step_does_not_follow_a_basis_of_other_blocks(previous_block: int | None) -> None:
    """A previous basis that is dense (a checkpoint without the option) or blocked otherwise
    has diagonal blocks that are not orthogonal: each block gets an ``eigh`` instead."""
    a, g = _spd(A_DIM, 10), _spd(G_DIM, 11)
    options = {"basis_refresh": "power", "carry": "reset"}
    other = MomentOptions(block_size=previous_block, **options)  # type: ignore[arg-type]
    previous = EigenAdamSolver(DT, other).compute(_spd(A_DIM, 12), g, 0.1)
    blocked = EigenAdamSolver(DT, MomentOptions(block_size=BLOCK, **options))  # type: ignore[arg-type]
    refreshed = blocked.compute_statistics({"A": a, "G": g}, 0.1, previous=previous)
    fresh = blocked.compute_statistics({"A": a, "G": g}, 0.1)  # an eigh per block
    torch.testing.assert_close(refreshed["qa"].abs(), fresh["qa"].abs())
    torch.testing.assert_close(refreshed["da"], fresh["da"])


def test_block_products_equal_the_dense_ones() -> None:
    basis = torch.block_diag(*(torch.randn(j - i, j - i, dtype=DT) for i, j in block_bounds(11, 4)))
    matrix = torch.randn(11, 5, dtype=DT)
    torch.testing.assert_close(times_blocks(basis, matrix, 4, left=True), basis @ matrix)
    torch.testing.assert_close(times_blocks(basis.T, matrix, 4, left=True), basis.T @ matrix)
    torch.testing.assert_close(times_blocks(basis, matrix.T, 4, left=False), matrix.T @ basis)
    torch.testing.assert_close(times_blocks(basis, matrix, None, left=True), basis @ matrix)
    noisy = basis + torch.where(basis == 0, 1.0, 0.0).to(DT)  # the products never read it
    torch.testing.assert_close(times_blocks(noisy, matrix, 4, left=True), basis @ matrix)
    torch.testing.assert_close(times_blocks(noisy, matrix.T, 4, left=False), matrix.T @ basis)
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


def test_diagonal_blocks_is_a_view_of_the_blocks() -> None:
    matrix = torch.arange(36.0).reshape(6, 6)
    blocks = diagonal_blocks(matrix, 3)
    assert blocks.shape == (2, 3, 3)
    torch.testing.assert_close(blocks[0], matrix[:3, :3])
    torch.testing.assert_close(blocks[1], matrix[3:, 3:])
    blocks.add_(100.0)  # writes through to the matrix's diagonal blocks only
    assert matrix[4, 5] == 29.0 + 100.0 and matrix[0, 4] == 4.0
    for bad in (torch.zeros(6, 4), torch.zeros(6, 6)[None], torch.zeros(7, 7)):
        with pytest.raises(ValueError, match="multiple of block 3"):
            diagonal_blocks(bad, 3)


@pytest.mark.parametrize("size", [8, 11, 12])
def test_the_batched_blocks_equal_each_block_alone(size: int) -> None:
    """Whole blocks go through one batched product, a shorter last one alone: every block
    equals its own product (float64), whatever the remainder."""
    gen = torch.Generator().manual_seed(size)
    rows = torch.randn(9, size, generator=gen, dtype=DT)
    blocked = BlockDiagonalAccumulator(DT, None, block=BLOCK)
    blocked.add(_Rows(rows), scale=3.0)
    assert blocked.total is not None
    expected = torch.zeros(size, size, dtype=DT)
    for i, j in block_bounds(size, BLOCK):
        expected[i:j, i:j] = 3.0 * rows[:, i:j].T @ rows[:, i:j]
    torch.testing.assert_close(
        as_dense(blocked.total, (size, size)), expected, rtol=1e-13, atol=1e-13
    )


def test_a_precomputed_sum_into_a_diagonal_keeps_its_diagonal() -> None:
    """``add_sum`` into a diagonal (a one-sided side) holds what ``add`` of the same rows
    holds: the diagonal of the sum, copied out of it."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    summed, added = DiagonalAccumulator(), DiagonalAccumulator()
    total = rows.T @ rows
    summed.add_sum(total, float(rows.shape[0]), scale=2.0)
    added.add(_Rows(rows), scale=2.0)
    assert summed.total is not None and added.total is not None
    torch.testing.assert_close(summed.total, added.total, rtol=1e-14, atol=0)
    torch.testing.assert_close(summed.total, 2.0 * total.diagonal(), rtol=1e-14, atol=0)
    summed.total.add_(1.0)  # a copy: the caller's sum is left as it was
    assert torch.equal(total, rows.T @ rows)
    assert summed.normaliser == added.normaliser == 7.0
