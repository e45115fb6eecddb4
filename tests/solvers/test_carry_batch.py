"""Carrying the moments of the layers of one shape in one batched pass equals carrying
them one by one: :meth:`EigenMomentsSolver.carry_batch` against its own ``carry_moments``
layer by layer, for every carry and basis layout, with a layer whose basis came back
unchanged (a refresh that kept its last state) among them; and completing the received
states of like layers in one pass (:meth:`EigenBasisSolver.completed_batch`) against
completing each alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dkfac.solvers import EigenAdamSolver, EKFACSolver, MomentOptions, host_copy

DT = torch.float64
LAYERS = 4


def _factor(n: int, seed: int) -> torch.Tensor:
    rows = torch.randn(3 * n, n, generator=torch.Generator().manual_seed(seed), dtype=DT)
    return rows.T @ rows / (3 * n)


def _stats(seed: int) -> list[dict[str, torch.Tensor]]:
    return [{"A": _factor(9, seed + i), "G": _factor(6, seed + 50 + i)} for i in range(LAYERS)]


def _moments(solver: Any, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    moments = []
    for i in range(LAYERS):
        zero = solver.zero_moments(torch.zeros(6, 9, dtype=DT))
        held = {k: torch.randn(6, 9, generator=g, dtype=DT).abs() for k in solver.keys}
        moments.append({**held, "t": zero["t"] + 3 + i})
    return moments


CASES = [
    (EigenAdamSolver, {"carry": "keep_v"}),
    (EigenAdamSolver, {"carry": "rotate", "basis_refresh": "power"}),
    (EigenAdamSolver, {"carry": "reset"}),
    (EigenAdamSolver, {"carry": "rotate", "block_size": 4}),
    (EigenAdamSolver, {"carry": "keep_v", "max_dim": 7}),
    (EKFACSolver, {"carry": "rotate"}),
]


@pytest.mark.parametrize(("cls", "options"), CASES)
def test_a_batched_carry_equals_each_layer_alone(cls: Any, options: dict[str, Any]) -> None:
    solver = cls(DT, MomentOptions(**options))
    olds: list[Any] = solver.compute_batch(_stats(0), 0.1, [None] * LAYERS)
    news: list[Any] = solver.compute_batch(_stats(100), 0.1, olds)
    news[1] = {k: v.clone() for k, v in olds[1].items()}  # kept: equal values, new tensors
    moments = _moments(solver, 7)
    keys = {solver.carry_key(o, n, m) for o, n, m in zip(olds, news, moments, strict=True)}
    assert len(keys) == 1 and None not in keys
    alone = [solver.carry_moments(o, n, m) for o, n, m in zip(olds, news, moments, strict=True)]
    batched = solver.carry_batch(olds, news, moments)
    for want, got in zip(alone, batched, strict=True):
        assert got is not None and want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12)
    assert all(torch.equal(batched[1][k], moments[1][k]) for k in moments[1])  # type: ignore[index]
    if options["carry"] == "reset":  # and the others start again
        assert all(not batched[i]["t"].any() for i in (0, 2, 3))  # type: ignore[index]


def test_a_carry_is_batched_only_between_like_bases() -> None:
    solver = EigenAdamSolver(DT)
    old: Any = solver.compute_statistics(_stats(0)[0], 0.1)
    new: Any = solver.compute_statistics(_stats(100)[0], 0.1)
    moments = _moments(solver, 7)[0]
    assert solver.carry_key(None, new, moments) is None  # nothing to carry from
    assert solver.carry_key(old, old, moments) is None  # the very same bases: kept as they are
    structured = EigenAdamSolver(DT, input_map=(3, 3))
    with_map: Any = structured.compute_statistics(_stats(0)[0], 0.1)
    assert structured.carry_key(with_map, dict(with_map, qg=new["qg"]), moments) is None
    assert solver.carry_key(old, new, moments) is not None


def _low_rank(n: int, rows: int, seed: int) -> torch.Tensor:
    data = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=DT)
    return data.T @ data / rows


@pytest.mark.parametrize("reads_now", [True, False], ids=["cpu", "queued_device"])
def test_completing_a_batch_equals_completing_each_layer(
    reads_now: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four layers of one shape, each with a solver of its own, over four refreshes: one
    always regular, one singular from the start, one singular from the second refresh, one
    whose output side only is singular, at the first and third. The batch's states (null
    indicators included) and each solver's decision equal completing layer by layer, to
    the bit; on a CPU each refresh decides from its own state, on a device whose reads
    wait (a GPU, emulated) from the flag read a refresh late, and then for good."""
    if not reads_now:
        monkeypatch.setattr(host_copy, "HOST_COUNT_DEVICES", frozenset())
    singular = {0: set(), 1: {0, 1, 2, 3}, 2: {1, 2, 3}, 3: {0, 2}}

    def states(solver: Any, refresh: int) -> list[dict[str, torch.Tensor]]:
        made = []
        for i in range(LAYERS):
            low = refresh in singular[i]
            a = _low_rank(9, 4 if low and i != 3 else 40, 10 * refresh + i)
            g = _low_rank(6, 3 if low else 30, 10 * refresh + i + 5)
            made.append(solver.compute_statistics({"A": a, "G": g}, 0.1))
        return made

    maker = EigenAdamSolver(DT)
    alone = [EigenAdamSolver(DT) for _ in range(LAYERS)]
    batched = [EigenAdamSolver(DT) for _ in range(LAYERS)]
    assert len({maker.complete_key(s) for s in states(maker, 0)}) == 1
    for refresh in range(4):
        received = states(maker, refresh)
        late = refresh > 0
        want = [s.completed(state, late=late) for s, state in zip(alone, received, strict=True)]
        got = batched[0].completed_batch(batched, received, late=late)
        for one, other in zip(want, got, strict=True):
            assert one.keys() == other.keys(), refresh
            assert all(torch.equal(one[k], other[k]) for k in one)
        assert [s._floored for s in alone] == [s._floored for s in batched]
    assert [s._floored for s in batched] == [False, True, True, not reads_now]
