"""A one-sided side keeps its factor as the ``(d,)`` diagonal (``DiagonalStatistic``).

The oracle is the same run with the kind the code kept before, a ``d × d`` matrix of which
only the diagonal was computed (:class:`MatrixDiagonal`, a hand-written twin forced into the
solver): the weights must be the same, the running values its diagonal. Checkpoints of either layout
load where the side is kept the other way (a saved ``d × d`` factor gives its diagonal, a
saved diagonal where the side is dense gives ``diag(v)``), and a layer whose kind changes at
run time converts what it holds.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.engine.roles import basis_block_from_widths
from dkfac.solvers import eigen_basis
from dkfac.solvers.block_layout import as_dense
from dkfac.solvers.statistics import (
    BlockDiagonalStatistic,
    DenseStatistic,
    DiagonalStatistic,
    FactorAccumulator,
)
from tests.engine.test_moments import OPTIONS as MOMENT_OPTIONS
from tests.strategy_cases import DIMS, make_model, serial_step

# test_moments' options; the 19- and 49-wide A sides are one-sided, the 7-wide one not
OPTIONS: dict[str, Any] = {**MOMENT_OPTIONS, "basis_max_dim": 10}
WIDE = ("0", "3")


@dataclass
class _MatrixDiagonalSum(FactorAccumulator):
    """The diagonal of ``Σ scale · RᵀR`` summed into a ``d × d`` matrix of zeros."""

    def add(self, rows: Any, scale: float = 1.0) -> None:
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        if self.total is None:
            size = matrix.shape[1]
            self.total = matrix.new_zeros(size, size, dtype=self.dtype or matrix.dtype)
        squares = matrix.to(self.total.dtype).square().sum(0)
        self.total.diagonal().add_(squares, alpha=scale)
        self.normaliser += rows.normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        return torch.diag(total.diagonal())


@dataclass(frozen=True)
class MatrixDiagonal(DenseStatistic):
    """How a one-sided side was kept before: a dense ``d × d`` statistic of which only the
    diagonal is computed."""

    label: ClassVar[str] = "matrix-diagonal"

    def accumulator(self, dtype: Any, capture_dtype: Any) -> FactorAccumulator:
        return _MatrixDiagonalSum(dtype, capture_dtype)


@dataclass
class _MatrixBlocksSum(FactorAccumulator):
    """The diagonal blocks of ``Σ scale · RᵀR`` summed into a ``d × d`` matrix of zeros."""

    block: int = 1

    def add(self, rows: Any, scale: float = 1.0) -> None:
        dtype = self.compute_dtype
        matrix = rows.rows if dtype is None else rows.rows.to(dtype)
        size = matrix.shape[1]
        if self.total is None:
            self.total = matrix.new_zeros(size, size, dtype=self.dtype or matrix.dtype)
        for start in range(0, size, self.block):
            part = matrix[:, start : start + self.block]
            product = (part.T @ part).to(self.total.dtype)
            self.total[start : start + self.block, start : start + self.block].add_(
                product, alpha=scale
            )
        self.normaliser += rows.normaliser

    def kept_of(self, total: Tensor) -> Tensor:
        kept = torch.zeros_like(total)
        for start in range(0, total.shape[0], self.block):
            window = slice(start, start + self.block)
            kept[window, window] = total[window, window]
        return kept


@dataclass(frozen=True)
class MatrixBlocks(DenseStatistic):
    """How a block-diagonal side was kept before: a dense ``d × d`` statistic of which only
    the diagonal blocks are computed."""

    block: int
    label: ClassVar[str] = "matrix-blocks"

    def accumulator(self, dtype: Any, capture_dtype: Any) -> FactorAccumulator:
        return _MatrixBlocksSum(dtype, capture_dtype, block=self.block)


def _force_old_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-sided and block-diagonal sides kept as before: a ``d × d`` matrix with only its
    diagonal, or its diagonal blocks, computed."""
    monkeypatch.setattr(eigen_basis, "DiagonalStatistic", MatrixDiagonal)
    monkeypatch.setattr(eigen_basis, "BlockDiagonalStatistic", MatrixBlocks)


def _new_and_old(
    monkeypatch: pytest.MonkeyPatch,
    build: Callable[[], nn.Module],
    rows: int,
    inputs: int,
    classes: int,
    **options: Any,
) -> list[tuple[nn.Module, KFACOptimizer]]:
    """``for_model`` on ``build()`` for 6 steps of random batches, with the kinds of now
    and with the ``d × d`` kinds of before (:func:`_force_old_kind`)."""
    gen = torch.Generator().manual_seed(rows)
    batches = [(torch.randn(rows, inputs, generator=gen, dtype=torch.float64),
                torch.randint(0, classes, (rows,), generator=gen)) for _ in range(6)]  # fmt: skip
    runs = []
    for old in (False, True):
        with monkeypatch.context() as patch:
            if old:
                _force_old_kind(patch)
            model = build()
            opt = KFACOptimizer.for_model(model, lr=0.01, **options)
            for x, y in batches:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        runs.append((model, opt))
    return runs


def _trained(steps: int, model: nn.Module | None = None, **options: Any) -> KFACOptimizer:
    model = model or make_model()
    pre = KFACPreconditioner(model, **{**OPTIONS, **options})
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), pre)
    for step in range(steps):
        serial_step(model, opt, step)
    return opt


def _params(opt: KFACOptimizer) -> list[Tensor]:
    return [p.detach().clone() for group in opt.param_groups for p in group["params"]]


def _continue(opt: KFACOptimizer, start: int, stop: int) -> list[Tensor]:
    model = opt.preconditioner.model
    for step in range(start, stop):
        serial_step(model, opt, step)
    return _params(opt)


def _copy_of(params: list[Tensor]) -> nn.Module:
    model = make_model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), params, strict=True):
            p.copy_(q)
    return model


def test_a_one_sided_side_holds_its_diagonal_and_trains_as_the_matrix_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    new = _trained(5)
    with monkeypatch.context() as patch:
        _force_old_kind(patch)
        old = _trained(5)
    for name in WIDE:
        layer, before = new.preconditioner.layers[name], old.preconditioner.layers[name]
        assert layer.kinds["A"] == DiagonalStatistic() and layer.summary()["a_factor"] == "diagonal"
        assert before.kinds["A"] == MatrixDiagonal()
        dim = DIMS[name][0]
        assert layer.running["A"].shape == (dim,) and before.running["A"].shape == (dim, dim)
        assert torch.equal(layer.running["A"], before.running["A"].diagonal())
        assert torch.count_nonzero(before.running["A"].diagonal().diag() - before.running["A"]) == 0
        assert layer.stored_shapes()["A"] == (dim,)
        saved = layer.memory()["factors"] - before.memory()["factors"]
        assert saved == -(dim * dim - dim) * 8  # float64
    narrow = new.preconditioner.layers["6"]
    assert narrow.kinds["A"] == DenseStatistic() and narrow.running["A"].shape == (7, 7)
    assert all(torch.equal(p, q) for p, q in zip(_params(new), _params(old), strict=True))


def test_for_model_with_a_one_sided_side_trains_as_the_matrix_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``for_model``'s budget makes the 60-wide input side of batches of 16 one-sided (its
    kind restated before the first capture): the same weights as with the ``d × d`` kind."""

    def build() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(60, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    (model, opt), (old_model, old_opt) = _new_and_old(monkeypatch, build, 16, 60, 3)
    layer, before = opt.preconditioner.layers["0"], old_opt.preconditioner.layers["0"]
    assert layer.kinds["A"] == DiagonalStatistic()
    assert before.kinds["A"] == MatrixDiagonal()
    assert torch.equal(layer.running["A"], before.running["A"].diagonal())
    for mine, theirs in zip(model.parameters(), old_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_checkpoint_with_the_matrix_loads_as_its_diagonal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint saved while one-sided sides were ``d × d`` continues, under the
    ``(d,)`` kind, as the old code continued it."""
    with monkeypatch.context() as patch:
        _force_old_kind(patch)
        old = _trained(3)
        saved = copy.deepcopy(old.state_dict())
        params = _params(old)
        want = _continue(old, 3, 6)
    fresh = _trained(0, _copy_of(params))
    fresh.load_state_dict(saved)
    pre_layers = fresh.preconditioner.layers
    for name in WIDE:
        dim = DIMS[name][0]
        assert pre_layers[name].running["A"].shape == (dim,)
        assert pre_layers[name].running["A"].is_contiguous()
    got = _continue(fresh, 3, 6)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_saved_diagonal_loads_where_the_side_is_dense_as_its_diag() -> None:
    saved = _trained(3).preconditioner.state_dict()
    dense = KFACPreconditioner(make_model(), **{**OPTIONS, "basis_max_dim": None})
    dense.load_state_dict(saved)
    for name in WIDE:
        vector = saved["layers"][name]["A"]
        assert vector.dim() == 1
        assert dense.layers[name].kinds["A"] == DenseStatistic()
        assert torch.equal(dense.layers[name].running["A"], torch.diag(vector))
    # and back: the dense checkpoint loads where the sides are one-sided again
    one_sided = KFACPreconditioner(make_model(), **OPTIONS)
    one_sided.load_state_dict(dense.state_dict())
    for name in WIDE:
        assert torch.equal(one_sided.layers[name].running["A"], saved["layers"][name]["A"])


def test_a_saved_value_of_another_shape_is_refused() -> None:
    saved = _trained(1).preconditioner.state_dict()
    pre = KFACPreconditioner(make_model(), **OPTIONS)
    bad = copy.deepcopy(saved)
    bad["layers"]["0"]["A"] = torch.zeros(18, dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"0: saved A has shape \(18,\), expected \(19, 19\), \(19,\) or \(k, b, b\)",
    ):
        pre.load_state_dict(bad)
    for shape in ((19, 1), (2, 8, 8), (3, 8, 7)):  # 19 wide: 3 blocks of 8
        bad["layers"]["0"]["A"] = torch.zeros(shape, dtype=torch.float64)
        with pytest.raises(ValueError, match="expected"):
            pre.check_state_dict(bad)


def test_a_kind_changed_at_run_time_converts_what_the_layer_holds() -> None:
    """Running values and this step's sums go to the new kind's layout: a dense side made
    one-sided keeps its diagonal, and back its ``diag``."""
    opt = _trained(2, basis_max_dim=None)
    model, pre = opt.preconditioner.model, opt.preconditioner
    x, y = torch.randn(8, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    layer = pre.layers["3"]
    dense_running = layer.running["A"].clone()
    held = layer.accumulators["A"]
    assert held.has_data
    dense_sum, normaliser = held.total.clone(), held.normaliser
    solver: Any = layer.solver
    solver.options = dataclasses.replace(solver.options, max_dim=10)
    layer.restate_kinds()
    assert layer.kinds["A"] == DiagonalStatistic()
    assert torch.equal(layer.running["A"], dense_running.diagonal())
    assert torch.equal(layer.accumulators["A"].total, dense_sum.diagonal())
    assert layer.accumulators["A"].normaliser == normaliser
    solver.options = dataclasses.replace(solver.options, max_dim=None)
    layer.restate_kinds()
    assert layer.kinds["A"] == DenseStatistic()
    assert torch.equal(layer.running["A"], torch.diag(dense_running.diagonal()))
    assert torch.equal(layer.accumulators["A"].total, torch.diag(dense_sum.diagonal()))


def test_for_model_with_block_diagonal_sides_trains_as_the_matrix_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``for_model`` given the block of the widths (the narrowest hidden width, 128, as a
    side is wider than twice that) cuts the bases of the sides wider into blocks of 128:
    the 129-, 300- and 301-wide sides are kept as ``(2, 128, 128)`` and ``(3, 128, 128)``
    (the last block padded) and give the weights of the ``d × d`` kind."""

    def build() -> nn.Module:
        torch.manual_seed(4)
        widths = (20, 64, 128, 300)
        layers = [m for i, o in itertools.pairwise(widths) for m in (nn.Linear(i, o), nn.Tanh())]
        return nn.Sequential(*layers, nn.Linear(300, 10)).double()

    block = basis_block_from_widths(build())
    assert block == 128
    options = {"overhead": None, "basis_block_size": block}
    (model, opt), (old_model, old_opt) = _new_and_old(monkeypatch, build, 64, 20, 10, **options)
    blocked = {("4", "A", 129), ("4", "G", 300), ("6", "A", 301)}
    for name, key, size in blocked:
        layer, before = opt.preconditioner.layers[name], old_opt.preconditioner.layers[name]
        assert layer.kinds[key] == BlockDiagonalStatistic(128)
        assert before.kinds[key] == MatrixBlocks(128)
        assert layer.running[key].shape == (-(-size // 128), 128, 128)
        torch.testing.assert_close(
            as_dense(layer.running[key], (size, size)),
            before.running[key],
            rtol=1e-12,
            atol=1e-15,
        )
    for mine, theirs in zip(model.parameters(), old_model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-13)


def test_saved_blocks_load_where_the_side_is_dense_and_back() -> None:
    saved = _trained(3, basis_max_dim=None, basis_block_size=8).preconditioner.state_dict()
    blocks = saved["layers"]["3"]["A"]
    assert blocks.shape == (7, 8, 8)  # 49 wide: 6 blocks of 8 and one of 1
    dense = KFACPreconditioner(make_model(), **{**OPTIONS, "basis_max_dim": None})
    dense.load_state_dict(saved)
    assert torch.equal(dense.layers["3"].running["A"], as_dense(blocks, (49, 49)))
    again = KFACPreconditioner(
        make_model(), **{**OPTIONS, "basis_max_dim": None, "basis_block_size": 8}
    )
    again.load_state_dict(dense.state_dict())
    assert torch.equal(again.layers["3"].running["A"], blocks)
    one_sided = KFACPreconditioner(make_model(), **OPTIONS)  # the blocks' diagonal
    one_sided.load_state_dict(saved)
    assert torch.equal(one_sided.layers["3"].running["A"], as_dense(blocks, (49, 49)).diagonal())
