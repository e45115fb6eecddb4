"""The stored layouts of a square statistic (``(d, d)``, ``(d,)``, ``(k, b, b)``) against
the dense matrix they keep part of, and the kinds that store them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dkfac.solvers import EigenAdamSolver, MomentOptions
from dkfac.solvers.block_layout import (
    DiagonalBlocks,
    as_blocks,
    as_dense,
    as_diagonal,
    block_bounds,
    blocks_shape,
    saved_layout,
)
from dkfac.solvers.statistics import BlockDiagonalStatistic, DenseStatistic, DiagonalStatistic

DT = torch.float64


def _spd(n: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(3 * n, n, generator=gen, dtype=DT)
    return rows.T @ rows / (3 * n) + 0.1 * torch.eye(n, dtype=DT)


def _masked(matrix: Tensor, block: int) -> Tensor:
    out = torch.zeros_like(matrix)
    for i, j in block_bounds(matrix.shape[0], block):
        out[i:j, i:j] = matrix[i:j, i:j]
    return out


@pytest.mark.parametrize(("size", "block"), [(11, 4), (12, 4), (5, 8), (7, 1)])
def test_the_blocks_hold_the_diagonal_blocks_the_last_padded(size: int, block: int) -> None:
    dense = _spd(size, size)
    blocks = as_blocks(dense, (size, size), block)
    assert blocks.shape == blocks_shape(size, block) == (-(-size // block), block, block)
    for i, (start, stop) in enumerate(block_bounds(size, block)):
        width = stop - start
        assert torch.equal(blocks[i, :width, :width], dense[start:stop, start:stop])
        assert not blocks[i, width:].any() and not blocks[i, :, width:].any()  # the padding
    assert torch.equal(as_dense(blocks, (size, size)), _masked(dense, block))
    assert torch.equal(as_diagonal(blocks, (size, size)), dense.diagonal())
    view = DiagonalBlocks(blocks, size)
    assert view.shape == (size, size) and view.block == block
    assert torch.equal(view.dense(), _masked(dense, block))


def test_every_layout_converts_to_every_other() -> None:
    size, shape = 11, (11, 11)
    dense = _spd(size, 0)
    diagonal = dense.diagonal().clone()
    assert torch.equal(as_dense(diagonal, shape), torch.diag(diagonal))
    assert torch.equal(as_blocks(diagonal, shape, 4), as_blocks(torch.diag(diagonal), shape, 4))
    blocks4 = as_blocks(dense, shape, 4)
    assert torch.equal(as_blocks(blocks4, shape, 4), blocks4)  # already that layout
    # blocks of another width: through the block-diagonal matrix (zeros off the old blocks)
    assert torch.equal(as_blocks(blocks4, shape, 3), as_blocks(_masked(dense, 4), shape, 3))
    assert torch.equal(as_diagonal(dense, shape), diagonal)
    assert torch.equal(as_dense(dense, shape), dense)


def test_the_saved_layout_is_told_by_shape() -> None:
    shape = (11, 11)
    assert saved_layout((11, 11), shape) == 0
    assert saved_layout((11,), shape) == -1
    assert saved_layout((3, 4, 4), shape) == 4
    assert saved_layout((11, 1, 1), shape) == 1
    for wrong in ((10,), (2, 4, 4), (3, 4, 5), (11, 10), (1, 11, 11, 1)):
        assert saved_layout(wrong, shape) is None
    assert saved_layout((5, 2, 2), (5, 2, 2)) == 0  # a statistic that is not square
    assert saved_layout((5,), (5, 2, 2)) is None


def test_each_kind_stores_its_layout_and_restores_any_other() -> None:
    shape, dense = (11, 11), _spd(11, 1)
    kinds = [DenseStatistic(), DiagonalStatistic(), BlockDiagonalStatistic(4)]
    stored = {
        DenseStatistic(): dense,
        DiagonalStatistic(): dense.diagonal().clone(),
        BlockDiagonalStatistic(4): as_blocks(dense, shape, 4),
    }
    assert [k.stored_shape(shape) for k in kinds] == [(11, 11), (11,), (3, 4, 4)]
    for kind in kinds:
        for value in stored.values():
            kind.check_saved("x", shape, tuple(value.shape))
            restored = kind.restore(value, shape)
            assert restored.shape == kind.stored_shape(shape)
        assert torch.equal(kind.restore(stored[kind], shape), stored[kind])
    # what the kept layouts share survives a trip through the others
    back = DiagonalStatistic().restore(BlockDiagonalStatistic(4).restore(dense, shape), shape)
    assert torch.equal(back, dense.diagonal())
    with pytest.raises(ValueError, match=r"x has shape \(2, 4, 4\), expected \(11, 11\)"):
        BlockDiagonalStatistic(4).check_saved("x", shape, (2, 4, 4))


def test_a_part_of_units_is_cut_from_the_matrix_each_kind_stands_for() -> None:
    shape, dense, rows = (11, 11), _spd(11, 2), slice(3, 9)
    blocks = as_blocks(dense, shape, 4)
    got = BlockDiagonalStatistic(4).part(blocks, shape, rows)
    assert torch.equal(got, _masked(dense, 4)[rows, rows])
    assert torch.equal(
        DiagonalStatistic().part(dense.diagonal(), shape, rows), dense.diagonal()[rows]
    )
    assert torch.equal(DenseStatistic().part(dense, shape, rows), dense[rows, rows])


def test_the_solver_reads_the_blocks_as_it_read_their_dense_matrix() -> None:
    """Blocks of 4 of an 11-wide input side (the last 3 wide, padded): the refresh from the
    stored blocks equals the refresh from the block-diagonal matrix (float64, to rounding)."""
    solver = EigenAdamSolver(DT, MomentOptions(block_size=4))
    a, g = _spd(11, 3), _spd(3, 4)
    kind = solver.statistics({"A": (11, 11), "G": (3, 3)})["A"]
    assert kind == BlockDiagonalStatistic(4)
    stored = kind.restore(a, (11, 11))
    from_blocks = solver.compute_statistics({"A": kind.solver_input(stored, (11, 11)), "G": g}, 0.1)
    from_matrix = solver.compute(_masked(a, 4), g, 0.1)
    assert set(from_blocks) == set(from_matrix)
    for key, value in from_matrix.items():
        torch.testing.assert_close(from_blocks[key], value, rtol=1e-12, atol=1e-12)
    # and a power step from that basis, blocks against matrix again
    power = EigenAdamSolver(DT, MomentOptions(block_size=4, basis_refresh="power"))
    step_blocks = power.compute_statistics(
        {"A": kind.solver_input(stored, (11, 11)), "G": g}, 0.1, from_matrix
    )
    step_matrix = power.compute_statistics({"A": _masked(a, 4), "G": g}, 0.1, from_matrix)
    for key, value in step_matrix.items():
        torch.testing.assert_close(step_blocks[key], value, rtol=1e-12, atol=1e-12)
