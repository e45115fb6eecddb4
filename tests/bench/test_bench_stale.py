"""The stale-statistics benchmark's bookkeeping: time to target, summaries, one tiny run."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from dkfac.app.data import load_digits
from dkfac.bench.stale import build_parser, run_one, summarise, time_to_target


def test_time_to_target_is_the_first_evaluation_at_or_above_it() -> None:
    trace = [(2, 1.5, 0.90), (4, 3.0, 0.97), (6, 4.5, 0.99), (8, 6.0, 0.96)]
    assert time_to_target(trace, 0.97) == (4, 3.0)  # equality counts
    assert time_to_target(trace, 0.98) == (6, 4.5)
    assert time_to_target(trace, 0.995) is None
    assert time_to_target([], 0.5) is None
    with pytest.raises(ValueError, match="target"):
        time_to_target(trace, 0.0)


def _run(mode: str, seed: int, steps: int | None, seconds: float | None) -> dict[str, Any]:
    return {
        "mode": mode,
        "seed": seed,
        "steps_to_target": steps,
        "seconds_to_target": seconds,
        "cpu_seconds_to_target": None if seconds is None else seconds / 2,
        "final_accuracy": 0.9 + seed / 100,
        "seconds_per_step": 1.0 + seed,
        "cpu_seconds_per_step": 0.5 + seed,
        "refresh_fraction": 1.0 if mode == "fixed" else 0.5 + seed / 10,
    }


def test_summary_medians_over_the_seeds_that_reached_the_target() -> None:
    runs = [
        _run("fixed", 0, 10, 5.0),
        _run("adaptive", 0, 12, 4.0),
        _run("fixed", 1, 6, 3.0),
        _run("adaptive", 1, None, None),
        _run("fixed", 2, 8, 9.0),
        _run("adaptive", 2, 14, 6.0),
    ]
    fixed, adaptive = summarise(runs)
    assert fixed["reached"] == "3/3" and adaptive["reached"] == "2/3"
    assert fixed["median_steps_to_target"] == 8 and fixed["median_seconds_to_target"] == 5.0
    assert adaptive["median_steps_to_target"] == 13 and adaptive["median_seconds_to_target"] == 5
    assert adaptive["median_cpu_seconds_to_target"] == 2.5
    assert fixed["mean_final_accuracy"] == pytest.approx(0.91)
    assert adaptive["mean_refresh_fraction"] == pytest.approx(0.6)
    assert fixed["median_seconds_per_step"] == 2.0


def test_tiny_runs_report_their_refresh_fraction() -> None:
    torch.set_num_threads(1)
    opts: argparse.Namespace = build_parser().parse_args(
        ["--batch-size", "128", "--steps", "4", "--eval-every", "2", "--target", "0.1"]
    )
    data = load_digits(seed=0)
    fixed = run_one("fixed", 0, data, opts)
    adaptive = run_one("adaptive", 0, data, opts)
    assert fixed["refresh_fraction"] == 1.0  # every statistic, every step
    # adaptive: everything at step 0, then only the statistics that are due
    assert 0.0 < adaptive["refresh_fraction"] <= 1.0
    for result in (fixed, adaptive):
        assert [t[0] for t in result["trace"]] == [2, 4]
        assert result["final_accuracy"] == result["trace"][-1][2]
        assert result["steps_to_target"] == 2  # 10 classes: 0.1 is reached at once
        assert 0 < result["cpu_seconds_to_target"] <= result["train_seconds"] * 2
    assert fixed["final_intervals"] == {}
    assert len(adaptive["final_intervals"]) == 13  # A and G of 5 layers, F of 3 BatchNorms
