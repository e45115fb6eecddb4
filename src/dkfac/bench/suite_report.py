"""The figures of ``dkfac bench suite``: per-task summaries against the best peer, and plots.

A task's summary takes, for every optimizer, the median steps to the target over the
held-out seeds of each split (a missed target counts as infinite), the median seconds per
step of the alternated timing blocks, its ratio to AdamW's, and seconds to the target =
median steps x seconds per step. The Muon peer is the better (fewer seconds to the target
on the first split) of ``muon`` and ``muon32``; the best peer is the fastest of AdamW, the
Muon peer and SOAP. ``dkfac`` is then compared with it: its time and steps over the best
peer's, and whether it meets the targets (time at most the best peer's, steps at most the
fewest any peer takes, a step at most :data:`STEP_BUDGET` x AdamW's).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["STEP_BUDGET", "plot_task", "summarise_task"]

STEP_BUDGET = 1.3
"""The most a ``dkfac`` step may cost, as a multiple of AdamW's."""

DEFAULT = "dkfac"
PEERS = ("adamw", "muon", "muon32", "soap")


def _steps(runs: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["reached"] or math.inf for r in runs)) if runs else math.inf


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def summarise_task(record: dict[str, Any]) -> dict[str, Any]:
    """The summary of one task's record (see the module docstring).

    Args:
        record: ``{"chosen_lr": {name: lr}, "runs": {"0": {name: runs}, "1": {...}},
            "step_seconds": {name: [seconds per step of each block]}}``, optionally
            ``"step_cpu_seconds"`` (the same blocks on the thread's CPU clock: then
            ``step_vs_adamw_cpu`` too, beside the wall clock's ``step_vs_adamw``).

    Returns:
        ``{"optimizers": {name: figures}, "muon_peer", "best_peer", "verdict"}``; the
        verdict is ``None`` without ``dkfac`` or without any peer.
    """
    runs, timing = record["runs"], record["step_seconds"]
    names = list(record["chosen_lr"])
    per_step = {n: float(statistics.median(timing[n])) for n in names}
    adamw = per_step.get("adamw")
    cpu_timing = record.get("step_cpu_seconds") or {}
    per_cpu = {n: float(statistics.median(cpu_timing[n])) for n in names if cpu_timing.get(n)}
    table: dict[str, dict[str, Any]] = {}
    for n in names:
        steps = _steps(runs["0"][n])
        table[n] = {
            "lr": record["chosen_lr"][n],
            "median_steps": steps,
            "median_steps_split1": _steps(runs.get("1", {}).get(n, [])),
            "reached": sum(r["reached"] is not None for r in runs["0"][n]),
            "runs": len(runs["0"][n]),
            "step_seconds": per_step[n],
            "step_vs_adamw": _ratio(per_step[n], adamw),
            "seconds_to_target": steps * per_step[n] if math.isfinite(steps) else math.inf,
            "raw_median_seconds": float(statistics.median(r["seconds"] for r in runs["0"][n])),
        }
        if n in per_cpu:
            table[n]["step_cpu_seconds"] = per_cpu[n]
            table[n]["step_vs_adamw_cpu"] = _ratio(per_cpu[n], per_cpu.get("adamw"))

    def seconds(name: str) -> float:
        return float(table[name]["seconds_to_target"])

    muons: list[str] = [n for n in ("muon", "muon32") if n in table]
    muon_peer = min(muons, key=seconds) if muons else None
    peers: list[str] = [n for n in ("adamw", muon_peer or "", "soap") if n in table]
    best = min(peers, key=seconds) if peers else None
    for entry in table.values():
        base = table[best]["seconds_to_target"] if best else None
        entry["time_vs_best_peer"] = _ratio(entry["seconds_to_target"], base)
    verdict = None
    if DEFAULT in table and peers:
        mine = table[DEFAULT]
        fewest = min(table[n]["median_steps"] for n in peers)
        step_ratio = mine["step_vs_adamw"]
        verdict = {
            "time_vs_best_peer": mine["time_vs_best_peer"],
            "steps": mine["median_steps"],
            "fewest_peer_steps": fewest,
            "steps_vs_fewest_peer": _ratio(mine["median_steps"], fewest),
            "time_at_most_best_peer": (mine["time_vs_best_peer"] or math.inf) <= 1.0,
            "steps_at_most_fewest_peer": mine["median_steps"] <= fewest,
            "step_within_budget": step_ratio is not None and step_ratio <= STEP_BUDGET,
        }
    return {"optimizers": table, "muon_peer": muon_peer, "best_peer": best, "verdict": verdict}


def plot_task(record: dict[str, Any], path: str) -> None:
    """Saves a PNG: the task's metric against steps and against seconds (steps x the
    measured seconds per step), every held-out seed of the first split, one colour per
    optimizer, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    summary = record["summary"]["optimizers"]
    for i, (name, runs) in enumerate(record["runs"]["0"].items()):
        per_step = summary[name]["step_seconds"]
        for j, run in enumerate(runs):
            steps = [t[0] for t in run["trace"]]
            values = [t[2] for t in run["trace"]]
            label = f"{name} (lr {summary[name]['lr']:g})" if j == 0 else None
            ax_s.plot(steps, values, color=f"C{i}", alpha=0.8, lw=1.0, label=label)
            ax_t.plot([s * per_step for s in steps], values, color=f"C{i}", alpha=0.8, lw=1.0)
    ylabel = "held-out accuracy" if record["higher_is_better"] else "held-out loss"
    for ax, xlabel in ((ax_s, "steps"), (ax_t, "seconds (steps x measured s/step)")):
        ax.axhline(record["target"], color="grey", linestyle="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not record["higher_is_better"]:
            ax.set_yscale("log")
        else:
            ax.set_ylim(max(0.0, record["target"] - 0.3), 1.0)
    ax_s.legend(fontsize=8)
    fig.suptitle(f"suite: {record['task']} (batch {record['batch_size']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
