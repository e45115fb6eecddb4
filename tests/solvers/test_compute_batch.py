"""Refreshing the layers of one shape in one batched decomposition equals refreshing them one
by one: the solvers' ``compute_batch`` against their own ``compute_statistics`` layer by
layer, and a training run against its twin that refreshes each layer alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.solvers import SolverError
from dkfac.solvers.base import Solver
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.eigen_moments import EigenAdamSolver, MomentOptions, power_refresh

LAYERS = 4


def _factor(n: int, seed: int) -> torch.Tensor:
    rows = torch.randn(3 * n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return rows.T @ rows / (3 * n)


def _stats(seed: int) -> dict[str, torch.Tensor]:
    return {"A": _factor(9, seed), "G": _factor(5, seed + 100)}


def _assert_same_states(batched: list[dict[str, Any]], alone: list[dict[str, Any]]) -> None:
    for left, right in zip(batched, alone, strict=True):
        assert left.keys() == right.keys()
        for key in left:
            torch.testing.assert_close(left[key], right[key], rtol=1e-12, atol=1e-12)


def test_eigen_batch_equals_each_layer_alone() -> None:
    solver = EigenSolver(torch.float64)
    stats = [_stats(i) for i in range(LAYERS)]
    keys = {solver.refresh_key(s, None) for s in stats}
    assert len(keys) == 1 and None not in keys
    batched = solver.compute_batch(stats, 0.1, [None] * LAYERS)
    _assert_same_states(batched, [solver.compute_statistics(s, 0.1) for s in stats])
    for state, one in zip(batched, stats, strict=True):  # and each is its factor's eigenpairs
        rebuilt = state["qa"] @ torch.diag(state["da"]) @ state["qa"].T
        torch.testing.assert_close(rebuilt, one["A"], rtol=1e-10, atol=1e-12)


def test_a_batched_power_step_equals_each_layer_alone() -> None:
    solver = EigenAdamSolver(torch.float64, MomentOptions(basis_refresh="power"))
    stats = [_stats(i) for i in range(LAYERS)]
    first = [solver.compute_statistics(s, 0.1) for s in stats]  # a full eigh: no key
    assert all(solver.refresh_key(s, None) is None for s in stats)
    later = [_stats(i + 10) for i in range(LAYERS)]
    assert len({solver.refresh_key(s, p) for s, p in zip(later, first, strict=True)}) == 1
    batched = solver.compute_batch(later, 0.1, first)
    alone = [solver.compute_statistics(s, 0.1, p) for s, p in zip(later, first, strict=True)]
    _assert_same_states(batched, alone)
    # The formula: Q = qr(F Q_prev) with diag R > 0, estimates diag(Q_prevᵀ F Q_prev).
    q_prev, factor = first[0]["qa"], later[0]["A"]
    q, r = torch.linalg.qr(factor @ q_prev)
    q = q * torch.sign(torch.diagonal(r))
    torch.testing.assert_close(batched[0]["qa"], q, rtol=1e-10, atol=1e-12)
    estimates = torch.diagonal(q_prev.T @ factor @ q_prev).clamp(min=0)
    torch.testing.assert_close(batched[0]["da"], estimates, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"basis_refresh": "eigh"},
        {"basis_refresh": "power", "power_rank": 3, "carry": "reset"},
        {"basis_refresh": "power", "block_size": 4},
        {"basis_refresh": "power", "max_dim": 6},
    ],
)
def test_a_power_step_is_batched_only_in_its_plain_form(options: dict[str, Any]) -> None:
    solver = EigenAdamSolver(torch.float64, MomentOptions(**options))
    first = solver.compute_statistics(_stats(0), 0.1)
    assert solver.refresh_key(_stats(1), first) is None


def test_power_refresh_of_a_stack_refuses_a_rank() -> None:
    with pytest.raises(ValueError, match="full rank"):
        power_refresh(torch.eye(3).expand(2, 3, 3), torch.eye(3).expand(2, 3, 3), torch.float64, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 12), nn.Tanh()]
    for _ in range(3):  # three layers of one shape: one batched refresh
        layers += [nn.Linear(12, 12), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(12, 3)).double()


def _run(method: str, batched: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    sizes: list[int] = []
    for cls in (EigenSolver, EigenAdamSolver):
        if batched:
            original = cls.compute_batch

            def spy(
                self: Solver, stats: Any, damping: float, previous: Any, o: Any = original
            ) -> Any:
                sizes.append(len(stats))
                return o(self, stats, damping, previous)

            monkeypatch.setattr(cls, "compute_batch", spy)
        else:
            monkeypatch.setattr(cls, "refresh_key", lambda self, stats, previous: None)
    model = _model()
    options = {"method": method, "inverse_update_interval": 2, "eigen_dtype": torch.float64}
    if method == "eigen_adam":
        options.update(basis_refresh="power", kl_clip=None, moment_eps=1e-3)
    pre = KFACPreconditioner(model, damping=0.05, **options)
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pre)
    for step in range(7):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
        opt.step()
    monkeypatch.undo()
    assert (max(sizes, default=0) == 3) == batched  # the three 12 x 12 layers, together
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_training_with_batched_refreshes_equals_refreshing_each_layer(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _run(method, batched=False, monkeypatch=monkeypatch)
    batched = _run(method, batched=True, monkeypatch=monkeypatch)
    for left, right in zip(alone, batched, strict=True):
        torch.testing.assert_close(left, right, rtol=1e-10, atol=1e-12)


def test_a_failed_batch_is_refreshed_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: Solver, stats: Any, damping: float, previous: Any) -> Any:
        raise SolverError("batched decomposition failed")

    monkeypatch.setattr(EigenSolver, "compute_batch", fail)
    model = _model()
    pre = KFACPreconditioner(model, damping=0.05, method="eigen", inverse_update_interval=1)
    x = torch.randn(16, 6, dtype=torch.float64)
    F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
    pre.step()
    assert all(layer.solver_state is not None for layer in pre.layers.values())
