"""A one-sided side keeps its factor as the ``(d,)`` diagonal (``DiagonalStatistic``).

The oracle is the same run with the kind the code kept before, a ``d × d`` matrix of which
only the diagonal was computed (``BlockDiagonalStatistic(1)``, forced into the solver): the
weights must be the same, the running values its diagonal. Checkpoints of either layout
load where the side is kept the other way (a saved ``d × d`` factor gives its diagonal, a
saved diagonal where the side is dense gives ``diag(v)``), and a layer whose kind changes at
run time converts what it holds.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.solvers import eigen_basis
from dkfac.solvers.statistics import BlockDiagonalStatistic, DenseStatistic, DiagonalStatistic
from tests.engine.test_moments import OPTIONS as MOMENT_OPTIONS
from tests.strategy_cases import DIMS, make_model, serial_step

# test_moments' options; the 19- and 49-wide A sides are one-sided, the 7-wide one not
OPTIONS: dict[str, Any] = {**MOMENT_OPTIONS, "basis_max_dim": 10}
WIDE = ("0", "3")


def _force_old_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-sided sides kept as before: a ``d × d`` matrix with only its diagonal computed."""
    monkeypatch.setattr(eigen_basis, "DiagonalStatistic", lambda: BlockDiagonalStatistic(1))


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
        assert before.kinds["A"] == BlockDiagonalStatistic(1)
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
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 60, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (16,), generator=gen)) for _ in range(8)]  # fmt: skip

    def run() -> tuple[nn.Module, KFACOptimizer]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(60, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        opt = KFACOptimizer.for_model(model, lr=0.01)
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return model, opt

    model, opt = run()
    with monkeypatch.context() as patch:
        _force_old_kind(patch)
        old_model, old_opt = run()
    layer, before = opt.preconditioner.layers["0"], old_opt.preconditioner.layers["0"]
    assert layer.kinds["A"] == DiagonalStatistic()
    assert before.kinds["A"] == BlockDiagonalStatistic(1)
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
    with pytest.raises(ValueError, match=r"0: saved A has shape \(18,\), expected \(19, 19\) or"):
        pre.load_state_dict(bad)
    bad["layers"]["0"]["A"] = torch.zeros(19, 1, dtype=torch.float64)
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
