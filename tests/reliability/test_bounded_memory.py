"""Red team, memory that grew with the number of steps (issue 20, class 5).

Before: the communication ledger kept one record per step forever, even in one process
(about 560 bytes a step). Now it keeps running totals and the records of the last
``window`` steps; memory is checked by counting records, not by RSS.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.bench import soak
from dkfac.distributed.ledger import COLLECTIVES, KINDS, CommLedger


def test_ledger_keeps_totals_and_a_window_of_records() -> None:
    ledger = CommLedger(window=8)
    steps = 10_000
    for i in range(steps):  # step i: i bytes of factors, 2 bytes of inverses
        ledger.record("factors", "all_reduce", i)
        ledger.record("inverses", "broadcast", 2)
        ledger.end_step()
        assert ledger.records_held == min(i + 1, 8)
    stats = ledger.stats()
    assert stats["steps"] == steps and stats["first_step_in_window"] == steps - 8
    assert stats["total"] == {**dict.fromkeys(KINDS, 0), "factors": 49_995_000, "inverses": 20_000}
    assert stats["total_bytes"] == 49_995_000 + 20_000
    assert stats["by_collective"] == {
        **dict.fromkeys(COLLECTIVES, 0),
        "all_reduce": 49_995_000,
        "broadcast": 20_000,
    }
    assert [s["bytes"] for s in stats["per_step"]] == [i + 2 for i in range(steps - 8, steps)]
    assert stats["last_step"]["by_kind"]["factors"] == steps - 1


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_ledger_window_is_validated(window: object) -> None:
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        CommLedger(window=window)  # type: ignore[arg-type]


def test_preconditioner_in_one_process_holds_a_bounded_ledger() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    pre = KFACPreconditioner(model, damping=1e-2, inverse_update_interval=10)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    steps = CommLedger.WINDOW + 76
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
    stats = pre.comm_stats()
    assert stats["steps"] == steps
    assert len(stats["per_step"]) == pre.comm.ledger.records_held == CommLedger.WINDOW
    assert stats["first_step_in_window"] == 76


def test_tiny_soak_reports_ledger_records_and_slope(tmp_path: Path) -> None:
    argv = ["--steps", "12", "--sample-every", "4", "--world-size", "1", "--method", "cholesky"]
    argv += ["--checkpoint-every", "6", "--eval-every", "6", "--out-dir", str(tmp_path)]
    assert soak.main([*argv, "--plot", ""]) == 0
    result = json.loads((tmp_path / "soak-digits-1ranks-cholesky.json").read_text())
    assert result["ledger_records_at_end"] == [12]
    assert [s["step"] for s in result["samples"][0]] == [1, 4, 8, 12]
    assert "slope_mib_per_1000_steps" in result["growth_after_first_10pct"][0]


def test_slope_by_hand() -> None:
    flat = [{"step": s, "rss_mib": 100.0} for s in (100, 200, 300)]
    assert soak.slope_mib_per_1000_steps(flat) == 0.0
    leak = [{"step": s, "rss_mib": 100.0 + 0.002 * s} for s in (100, 200, 300, 400)]
    assert soak.slope_mib_per_1000_steps(leak) == pytest.approx(2.0)
