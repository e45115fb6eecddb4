"""Checkpoints written by 2 ranks load on 1 rank and on 2 ranks with another strategy.

The trainer saves the K-FAC state through the collective ``state_dict`` (every layer's
factors gathered from its owner). Oracle: each owner's own running statistics, read on the
2 ranks right after saving, equal what the file holds; after loading elsewhere (1 rank, or 2
ranks with another strategy) every rank that keeps a layer's statistics holds exactly the
saved ones, and training then continues to the planned step count with finite weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dkfac.app import resume, session
from dkfac.app.checkpoint import LATEST, load_checkpoint
from dkfac.app.cli import parse_args
from dkfac.app.trainer import train
from dkfac.engine.optimizer_state import unpack
from tests.distributed_utils import run_distributed

BASE = [
    "train",
    *("--data", "digits", "--model", "mlp", "--optimizer", "kfac", "--batch-size", "32"),
    *("--threads", "1", "--device", "cpu", "--log-every", "2", "--epochs", "1"),
    *("--inverse-update-interval", "2", "--factor-decay", "0.9"),
]
STRATEGIES = {
    "replicated": ["--strategy", "replicated"],
    "kaisa": ["--strategy", "kaisa", "--grad-worker-fraction", "0.5"],
    "mem-opt": ["--strategy", "mem-opt"],
    "dp": ["--strategy", "dp"],
    "spngd": ["--strategy", "spngd"],
}
# The strategy the 2-rank checkpoint is re-loaded with, still on 2 ranks.
OTHER = {
    "replicated": "spngd",
    "kaisa": "dp",
    "mem-opt": "replicated",
    "dp": "kaisa",
    "spngd": "mem-opt",
}


def _running(run: session.Session) -> dict[str, dict[str, torch.Tensor]]:
    assert run.preconditioner is not None
    return {
        name: {k: v.detach().clone() for k, v in layer.running.items()}
        for name, layer in run.preconditioner.layers.items()
        if layer.running
    }


def _save_then_reload(
    rank: int, world_size: int, root: str
) -> dict[str, dict[str, dict[str, dict[str, torch.Tensor]]]]:
    """For every strategy (one spawn for all): train, save, restore with it and another."""
    out = {}
    for strategy in STRATEGIES:
        folder = str(Path(root) / strategy)
        argv = [*BASE, *STRATEGIES[strategy], "--steps", "4", "--out", folder]
        train(parse_args(argv))  # checkpoint at the end (step 4), written by rank 0
        # What this rank keeps, read from a session restored on the same 2 ranks.
        same = session.build_session(parse_args(argv), torch.device("cpu"))
        resume.restore(same, Path(folder) / LATEST)
        other_argv = [*BASE, *STRATEGIES[OTHER[strategy]], "--steps", "4", "--out", folder]
        other = session.build_session(parse_args(other_argv), torch.device("cpu"))
        resume.restore(other, Path(folder) / LATEST)
        out[strategy] = {"same": _running(same), "other": _running(other)}
    return out


def _assert_held_equal_saved(
    held: dict[str, dict[str, torch.Tensor]], saved: dict[str, dict[str, Any]]
) -> int:
    for name, stats in held.items():
        for key, value in stats.items():
            assert torch.equal(value, saved[name][key]), (name, key)
    return sum(len(stats) for stats in held.values())


def test_two_ranks_to_one_and_to_another_strategy(tmp_path: Path) -> None:
    everything = run_distributed(_save_then_reload, 2, str(tmp_path))
    for strategy in STRATEGIES:
        _check(strategy, tmp_path / strategy, [result[strategy] for result in everything])


def _check(strategy: str, folder: Path, ranks: list[dict[str, Any]]) -> None:
    state = load_checkpoint(folder / LATEST)
    saved = unpack(state["optimizer"])[1]["layers"]
    assert state["position"]["step"] == 4
    statistics = sum(
        len([k for k in e if k not in ("inverse", "inverse_solver")]) for e in saved.values()
    )
    # The file is world-size independent: every layer's statistics are in it ...
    for entry in saved.values():
        assert all(
            isinstance(v, torch.Tensor)
            for k, v in entry.items()
            if k not in ("inverse", "inverse_solver")
        )
    # ... and they are what the ranks that keep them hold (owners at least, for every layer).
    kept: set[str] = set()
    for result in ranks:
        _assert_held_equal_saved(result["same"], saved)
        _assert_held_equal_saved(result["other"], saved)
        kept |= set(result["same"])
    assert kept == set(saved), strategy

    # 2 ranks -> 1 process (replicated there): all statistics land, training goes on.
    argv = [*BASE, "--steps", "8", "--out", str(folder), "--resume", str(folder / LATEST)]
    single = session.build_session(parse_args(argv), torch.device("cpu"))
    position = resume.restore(single, folder / LATEST)
    assert position["step"] == 4 and position["step_in_epoch"] == 4
    assert _assert_held_equal_saved(_running(single), saved) == statistics, strategy
    result = train(parse_args(argv))
    assert result.steps == 8
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert load_checkpoint(folder / LATEST)["position"]["step"] == 8
