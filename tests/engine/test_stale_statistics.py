"""SP-NGD stale statistics through the preconditioner (refresh="adaptive").

Checks: the refresh steps of each statistic follow the doubling / halving rule for scripted
data; a statistic that is not due costs nothing (its block methods are not called and no
byte is sent); on 2 gloo ranks the adaptive run equals a serial one on the global batch and
sends exactly the bytes of the statistics that were due.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACPreconditioner
from tests import strategy_cases as cases
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import Hooks, Run, assert_tensors_close

DT = torch.float64


def _counting_model() -> tuple[nn.Module, dict[str, list[int]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    return model, {"A": [], "G": []}


def _run(steps: int, batch_for_step, **options: Any) -> tuple[dict[str, list[int]], list[int]]:
    """Steps of a frozen model (no optimizer step): records when layer 0's rows are built."""
    model, calls = _counting_model()
    pre = KFACPreconditioner(model, refresh="adaptive", factor_decay=0.0, **options)
    block = pre.layers["0"].block
    a_rows, g_rows = block.a_rows, block.g_rows
    step_now = [0]
    block.a_rows = lambda x: (calls["A"].append(step_now[0]), a_rows(x))[1]  # type: ignore[method-assign]
    block.g_rows = lambda g: (calls["G"].append(step_now[0]), g_rows(g))[1]  # type: ignore[method-assign]
    refreshed = []
    for step in range(steps):
        step_now[0] = step
        x = batch_for_step(step)
        model.zero_grad()
        model(x).pow(2).sum(dim=1).mean().backward()
        pre.step()
        refreshed.append(pre.refresh_stats()["refreshed"])
    return calls, refreshed


def test_constant_statistics_double_their_interval() -> None:
    x = torch.randn(8, 4, dtype=DT)
    calls, refreshed = _run(20, lambda step: x)
    # Δ starts at 1; the first refresh has nothing to compare with; then each refresh sees
    # zero change and doubles Δ: refreshes at 0, 1, 3, 7, 15.
    assert calls == {"A": [0, 1, 3, 7, 15], "G": [0, 1, 3, 7, 15]}
    expected = [4 if s in (0, 1, 3, 7, 15) else 0 for s in range(20)]  # 2 layers × (A, G)
    assert refreshed == expected


def test_changing_statistics_keep_a_short_interval_and_cap_applies() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 4, dtype=DT, generator=gen)

    def batch(step: int) -> torch.Tensor:
        # Scale alternates 1, 3, 1, 3: A changes by far more than the threshold each time.
        return base * (3.0 if step % 2 else 1.0)

    calls, _ = _run(6, batch)
    assert calls["A"] == [0, 1, 2, 3, 4, 5]
    x = torch.randn(8, 4, dtype=DT)
    calls, _ = _run(12, lambda step: x, refresh_max_interval=2)
    assert calls["A"] == [0, 1, 3, 5, 7, 9, 11]


def test_adaptive_state_round_trips_through_state_dict() -> None:
    x = torch.randn(8, 4, dtype=DT)
    model, _ = _counting_model()
    pre = KFACPreconditioner(model, refresh="adaptive", factor_decay=0.0)
    for _ in range(4):
        model.zero_grad()
        model(x).pow(2).sum(dim=1).mean().backward()
        pre.step()
    state = pre.state_dict()
    model2, _ = _counting_model()
    pre2 = KFACPreconditioner(model2, refresh="adaptive", factor_decay=0.0)
    pre2.load_state_dict(state)
    assert pre2.refresh_stats()["intervals"] == pre.refresh_stats()["intervals"]
    assert {n: s.due for n, s in pre2.layers.items()} == {n: s.due for n, s in pre.layers.items()}


@pytest.mark.parametrize(
    "options,match",
    [
        ({"refresh": "sometimes"}, "refresh"),
        ({"refresh_threshold": 0.0}, "refresh_threshold"),
        ({"refresh_max_interval": 0}, "refresh_max_interval"),
    ],
)
def test_bad_refresh_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(_counting_model()[0], **options)


# ---------------------------------------------------------------- 2 ranks
ADAPTIVE = {"refresh": "adaptive", "refresh_threshold": 0.5, "refresh_max_interval": 4}
STEPS = 8


STRATEGIES = ("replicated", "spngd")


def _train(rank: int | None, strategy: str) -> dict[str, Any]:
    """Rank ``rank``'s shard of 2 (``None``: the serial twin); which statistics were due."""
    due: list[dict[str, list[str]]] = []

    def record_due(run: Run) -> None:
        due.append({n: sorted(layer.due) for n, layer in run.pre.layers.items()})

    run = cases.train(
        rank, 2, strategy, steps=STEPS, hooks=Hooks(before_forward=record_due), **ADAPTIVE
    )
    return {
        "params": run.params(),
        "due": due,
        "factor_bytes": [s["by_kind"]["factors"] for s in run.pre.comm_stats()["per_step"]],
    }


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {s: _train(rank, s) for s in STRATEGIES}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Both strategies in one spawn of 2 ranks."""
    return run_distributed(_rank_main, 2, timeout=120)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_adaptive_equals_serial_and_skipped_statistics_send_nothing(
    strategy: str, two_ranks: list[dict[str, Any]]
) -> None:
    serial = _train(None, strategy)
    skipped = sum(len(d[n]) < 2 for d in serial["due"] for n in d)
    assert skipped > 0, "the scripted run must skip some statistics"
    packed = strategy == "spngd"
    for rank, result in enumerate(two_ranks):
        result = result[strategy]
        label = f"{strategy}, rank {rank}"
        assert result["due"] == serial["due"], label
        assert_tensors_close(result["params"], serial["params"], label=label, rtol=1e-9, atol=1e-12)
        for step, due in enumerate(result["due"]):
            expected = 0
            for name, keys in due.items():
                a_dim, g_dim = cases.DIMS[name]
                for key in keys:
                    n = a_dim if key == "A" else g_dim
                    expected += (n * (n + 1) // 2 if packed else n * n) * 8
            assert result["factor_bytes"][step] == expected, (label, step)
