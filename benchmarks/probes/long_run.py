"""The default past its target: a plain deep MLP trained for 300 steps at two rates.

``dkfac bench suite`` stops each run at its target. This probe trains on past it, on the
six-layer 64-wide ReLU MLP without normalisation of ``early_refresh.py`` (``deepmlp``: the
digits, batch 256, target 95%), at the rate the suite's grid gives the default there (0.01)
and at twice that (0.02, inside the range ``for_model``'s docstring tells a user to sweep),
beside AdamW and Muon (float32 iteration) at their own grids' top rates, each as the suite
builds it (:func:`dkfac.bench.suite.make_optimizer`: torch's defaults, so AdamW's weight
decay 0.01 and Muon's 0.1). It records the steps to the target, the test accuracy every 50
steps and the weights' norm at the end, on seeds 0-3 (nothing here is timed).

    PYTHONPATH=src python benchmarks/probes/long_run.py \\
        --out benchmarks/results/long_run_deepmlp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.common import machine_info, probe_command, write_result
from dkfac.bench.suite import make_optimizer, train_step

sys.path.insert(0, str(Path(__file__).parent))
from early_refresh import family_task

ARMS: tuple[tuple[str, str, float, dict[str, Any] | None], ...] = (
    ("default", "dkfac", 0.01, None),
    ("default", "dkfac", 0.02, None),
    ("orthogonal_rms_power=0.5", "dkfac", 0.02, {"orthogonal_rms_power": 0.5}),
    ("orthogonal_rms=0.75", "dkfac", 0.02, {"orthogonal_rms": 0.75}),
    ("weight_decay=1.0", "dkfac", 0.02, {"weight_decay": 1.0}),
    ("overhead=None", "dkfac", 0.02, {"overhead": None}),
    ("adamw", "adamw", 0.02, None),
    ("muon32", "muon32", 0.32, None),
)
"""(label, optimizer, lr, ``for_model`` options) of each arm."""

SEEDS = (0, 1, 2, 3)
STEPS = 300


def run(name: str, lr: float, options: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    """One run of ``STEPS`` steps: steps to the target, accuracy every 50, final norm."""
    task = family_task("deepmlp", 0)
    torch.manual_seed(seed)
    model = task.build()
    optimizer = make_optimizer(name, model, lr, options)
    batch = task.batches(torch.Generator().manual_seed(seed))
    reached, accuracy = None, []
    for step in range(1, STEPS + 1):
        train_step(task, model, optimizer, batch)
        if reached is None or step % 50 == 0:
            value = task.metric(model)
            if reached is None and value >= task.target:
                reached = step
            if step % 50 == 0:
                accuracy.append(round(value, 4))
    norm = float(sum(p.detach().square().sum() for p in model.parameters()).sqrt())
    return {"seed": seed, "reached": reached, "accuracy_every_50": accuracy, "norm": norm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for label, name, lr, options in ARMS:
        runs = [run(name, lr, options, seed) for seed in SEEDS]
        row = {"arm": label, "optimizer": name, "lr": lr, "runs": runs}
        rows.append(row)
        print(json.dumps(row), flush=True)
    target = family_task("deepmlp", 0).target
    result = {"machine": machine_info(), "steps": STEPS, "target": target, "rows": rows}
    write_result(args.out.stem, result, args.out.parent, probe_command())


if __name__ == "__main__":
    main()
