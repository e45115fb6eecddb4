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
from dkfac.solvers import EigenAdamSolver, MomentOptions, SolverError
from dkfac.solvers.base import Solver, unchecked
from dkfac.solvers.basis_refresh import power_refresh
from dkfac.solvers.eigen import EigenSolver
from dkfac.solvers.stacking import ALIGNMENT
from dkfac.solvers.unitwise import UnitwiseSolver


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


SHAPES = [(9, 5), (5, 9), (9, 5), (7, 7), (9, 9)]
"""(A, G) widths of a batch: sides of one width on either side, in several layers."""


def _mixed(seed: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"A": _factor(a, seed + 10 * i), "G": _factor(g, seed + 10 * i + 5)}
        for i, (a, g) in enumerate(SHAPES)
    ]


class _Calls:
    """Counts calls of ``torch.linalg.eigh`` and ``torch.geqrf`` (by the rank of the
    first argument: 2 a matrix, 3 a stack)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        for owner, name in ((torch.linalg, "eigh"), (torch, "geqrf")):
            real = getattr(owner, name)

            def spy(matrix: torch.Tensor, *a: Any, _real: Any = real, _n: str = name) -> Any:
                self.calls.append((_n, matrix.dim()))
                return _real(matrix, *a)

            monkeypatch.setattr(owner, name, spy)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)


def test_eigen_batch_equals_each_layer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    solver = EigenSolver(torch.float64)
    stats = _mixed(0)
    keys = {solver.refresh_key(s, None) for s in stats}
    assert len(keys) == 1 and None not in keys
    calls = _Calls(monkeypatch)
    batched = solver.compute_batch(stats, 0.1, [None] * len(stats))
    assert calls.count("eigh") == 3  # one a width (9, 5, 7), whichever side it is
    monkeypatch.undo()
    _assert_same_states(batched, [solver.compute_statistics(s, 0.1) for s in stats])
    for state, one in zip(batched, stats, strict=True):  # and each is its factor's eigenpairs
        assert isinstance(state, dict)
        rebuilt = state["qa"] @ torch.diag(state["da"]) @ state["qa"].T
        torch.testing.assert_close(rebuilt, one["A"], rtol=1e-10, atol=1e-12)


MOMENT_OPTIONS = [
    {"basis_refresh": "eigh"},
    {"basis_refresh": "power"},
    {"basis_refresh": "power", "power_rank": 3, "carry": "reset"},
    {"basis_refresh": "power", "block_size": 4},
    {"basis_refresh": "power", "max_dim": 6},
]


@pytest.mark.parametrize("options", MOMENT_OPTIONS)
def test_a_moment_batch_equals_each_layer_alone(options: dict[str, Any]) -> None:
    """The first refresh (``eigh``) and a later one (a power step or ``eigh``), whole
    sides, blocks, ranked power steps (alone) and one-sided sides, of layers of several
    shapes in one group."""
    solver = EigenAdamSolver(torch.float64, MomentOptions(**options))
    stats, later = _mixed(0), _mixed(1000)
    assert len({solver.refresh_key(s, None) for s in stats}) == 1
    first = solver.compute_batch(stats, 0.1, [None] * len(stats))
    _assert_same_states(first, [solver.compute_statistics(s, 0.1) for s in stats])
    previous: list[Any] = first
    batched = solver.compute_batch(later, 0.1, previous)
    alone = [solver.compute_statistics(s, 0.1, p) for s, p in zip(later, previous, strict=True)]
    _assert_same_states(batched, alone)
    for state in batched:  # each tensor starts on a boundary, as a lone one does
        assert isinstance(state, dict)
        assert all(v.data_ptr() % ALIGNMENT == 0 for v in state.values() if v.numel())


def test_a_batched_power_step_is_one_qr_a_width(monkeypatch: pytest.MonkeyPatch) -> None:
    solver = EigenAdamSolver(torch.float64, MomentOptions(basis_refresh="power"))
    stats = _mixed(0)
    first: list[Any] = solver.compute_batch(stats, 0.1, [None] * len(stats))
    calls = _Calls(monkeypatch)
    later = _mixed(1000)
    batched = solver.compute_batch(later, 0.1, first)
    assert calls.count("geqrf") == 3 and calls.count("eigh") == 0
    assert all(dim == 3 for _, dim in calls.calls)  # every width is shared
    # The formula: Q = qr(F Q_prev) with diag R > 0, estimates diag(Qᵀ F Q) (full rank: the
    # columns in the QR's order).
    q_prev, factor = first[0]["qa"], later[0]["A"]
    q, r = torch.linalg.qr(factor @ q_prev)
    q = q * torch.sign(torch.diagonal(r))
    estimates = torch.diagonal(q.T @ factor @ q).clamp(min=0)
    state = batched[0]
    assert isinstance(state, dict)
    torch.testing.assert_close(state["qa"], q, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state["da"], estimates, rtol=1e-10, atol=1e-12)


def test_only_a_structured_input_side_is_refreshed_alone() -> None:
    solver = EigenAdamSolver(torch.float64, input_map=(3, 3))
    assert solver.refresh_key(_stats(0), None) is None


def _solvers() -> list[tuple[str, Solver]]:
    power = MomentOptions(basis_refresh="power")
    return [
        ("eigen", EigenSolver(torch.float64)),
        ("eigen_adam-eigh", EigenAdamSolver(torch.float64)),
        ("eigen_adam-power", EigenAdamSolver(torch.float64, power)),
    ]


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize(("label", "solver"), _solvers())
def test_a_failed_layer_changes_no_other_layer(label: str, solver: Solver, checked: bool) -> None:
    """Layer 2 of the batch (sharing both widths with layer 0) gets a non-finite factor.
    With host checks layer 2 is refreshed alone and refused (its error in its place);
    without them (the device path) its state comes back non-finite, for the engine to
    select on the device. Every other layer's state equals its state from the same batch
    without the failure: to the bit for a power step (the stack is decomposed as it is);
    where LAPACK raises for the stack (``eigh`` of a NaN), each matrix is decomposed alone,
    as the layer-by-layer path does (to rounding)."""
    good = _mixed(0)
    previous: list[Any] = solver.compute_batch(good, 0.1, [None] * len(good))
    later = _mixed(1000)
    broken = [dict(s) for s in later]
    broken[2]["G"] = broken[2]["G"].clone()
    broken[2]["G"][0, 0] = float("nan")
    with unchecked([solver], not checked):
        healthy = solver.compute_batch(later, 0.1, previous)
        failed = solver.compute_batch(broken, 0.1, previous)
    for i, (want, got) in enumerate(zip(healthy, failed, strict=True)):
        assert isinstance(want, dict)
        if i == 2:
            if checked:
                assert isinstance(got, SolverError)
            else:
                assert isinstance(got, dict) and not torch.isfinite(got["qg"]).all()
            continue
        assert isinstance(got, dict) and want.keys() == got.keys()
        if label == "eigen_adam-power":
            assert all(torch.equal(want[k], got[k]) for k in want), i
        else:
            _assert_same_states([got], [want])


def test_a_stack_whose_eigh_raises_decomposes_each_matrix_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LAPACK's non-convergence raised for a stack: each matrix again on its own, the
    same states as each layer alone with every matrix alone."""
    real = torch.linalg.eigh

    def raising(matrix: torch.Tensor, *a: Any) -> Any:
        if matrix.dim() == 3:
            raise torch.linalg.LinAlgError("did not converge")
        return real(matrix, *a)

    solver = EigenAdamSolver(torch.float64)
    stats = _mixed(0)
    monkeypatch.setattr(torch.linalg, "eigh", raising)
    alone = [solver.compute_statistics(s, 0.1) for s in stats]
    batched = solver.compute_batch(stats, 0.1, [None] * len(stats))
    for want, got in zip(alone, batched, strict=True):
        assert isinstance(got, dict)
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_power_refresh_of_a_stack_refuses_a_rank() -> None:
    with pytest.raises(ValueError, match="full rank"):
        power_refresh(torch.eye(3).expand(2, 3, 3), torch.eye(3).expand(2, 3, 3), torch.float64, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 12), nn.Tanh()]
    for _ in range(3):  # three layers of one shape, and sides of 13 and 12 shared
        layers += [nn.Linear(12, 12), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(12, 3)).double()


def _train(model: nn.Module, pre: KFACPreconditioner) -> None:
    """Seven steps of SGD over ``pre`` on ``_model``'s task."""
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pre)
    for step in range(7):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
        opt.step()


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
    _train(model, KFACPreconditioner(model, damping=0.05, **options))
    monkeypatch.undo()
    assert (max(sizes, default=0) == 5) == batched  # every layer, together
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


def _fisher(channels: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(channels, 6, 2, generator=g, dtype=torch.float64)
    skew = torch.randn(channels, 2, 2, generator=g, dtype=torch.float64) * 1e-3
    return rows.mT @ rows / 6 + skew  # symmetric up to a small skew part


@pytest.mark.parametrize("checked", [True, False])
def test_a_batch_of_batchnorm_fishers_equals_each_layer_alone(checked: bool) -> None:
    """One pass over the concatenated channels: each state is its layer's symmetrised
    Fisher to the bit; a non-finite Fisher is refused in its own layer only (host checks),
    or comes back as it is (the device path), the others unchanged."""
    solver = UnitwiseSolver(torch.float64)
    stats = [{"F": _fisher(c, c)} for c in (4, 8, 4, 16)]
    assert len({solver.refresh_key(s, None) for s in stats}) == 1
    alone = [solver.compute_statistics(s, 0.1) for s in stats]
    broken = [dict(s) for s in stats]
    broken[1]["F"] = broken[1]["F"].clone()
    broken[1]["F"][3, 0, 1] = float("inf")
    with unchecked([solver], not checked):
        batched = solver.compute_batch(stats, 0.1, [None] * len(stats))
        failed = solver.compute_batch(broken, 0.1, [None] * len(stats))
    for i, (want, got, bad) in enumerate(zip(alone, batched, failed, strict=True)):
        assert isinstance(got, dict) and torch.equal(got["fisher"], want["fisher"])
        if i != 1:
            assert isinstance(bad, dict) and torch.equal(bad["fisher"], want["fisher"])
        elif checked:
            assert isinstance(bad, SolverError)
        else:
            assert isinstance(bad, dict) and not torch.isfinite(bad["fisher"]).all()
