"""The budget's basis interval with and without its early refresh, in steps to the target.

Under ``for_model``'s overhead budget a basis may be refreshed only every 20 or 50 steps, so
the first step's basis, built from the initial weights' statistics, preconditions the whole
first interval. :meth:`dkfac.engine.overhead.OverheadBudget.options` therefore refreshes it
once more at the first factor capture after the first step's
(:class:`dkfac.config.schedules.EarlyRefresh`). This probe trains ``for_model`` with the
early refresh (``early``) and with it taken out (``plain``: the chosen interval as a
constant), from the same seeds, on the six families of ``dkfac bench suite`` at the rate
the suite chose for the default, and on two MLPs the suite does not have, at the rate the
suite's grid would give them: six 64-wide ReLU layers with no normalisation (``deepmlp``,
bases every 50 steps) and one 1024-wide hidden layer (``widemlp``). The steps to each task's
target on held-out seeds 0-2 of both splits (steps do not depend on the machine's speed).

    PYTHONPATH=src python benchmarks/probes/early_refresh.py \\
        --out benchmarks/results/early_refresh.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn

from dkfac.bench.common import machine_info, probe_command, write_result
from dkfac.bench.suite import train_to_target
from dkfac.bench.suite_tasks import FAMILIES, Task, load_task
from dkfac.config.schedules import EarlyRefresh
from dkfac.engine.overhead import OverheadBudget

RATES = {
    "vit": 0.01,
    "resnet": 0.01,
    "mlp": 0.01,
    "cnn": 0.005,
    "autoencoder": 0.01,
    "gpt": 0.01,
    "deepmlp": 0.01,
    "widemlp": 0.01,
}
"""The default's rate per family: the suite's choice (``suite_default_v19.json``), and for
the two others the best of the suite's grid on the sweep seed 100 (a separate run)."""

SEEDS = (0, 1, 2)
MAX_STEPS = 150


class _DeepMLP(nn.Module):
    """Six 64-wide linear layers with ReLU, no normalisation, and a 10-way head."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for _ in range(6):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(64, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _WideMLP(nn.Module):
    """One 1024-wide hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def family_task(name: str, split: int) -> Task:
    """A suite task, or one of the two MLPs on the MLP family's data and target."""
    if name in FAMILIES:
        return load_task(name, split)
    base = load_task("mlp", split)
    build = {"deepmlp": _DeepMLP, "widemlp": _WideMLP}[name]
    target = {"deepmlp": 0.95, "widemlp": 0.97}[name]
    return Task(
        name, build, base.x_train, base.y_train, base.x_test, base.y_test, base.batch_size,
        base.loss, True, target,
    )  # fmt: skip


_ORIGINAL = OverheadBudget.options


def _plain_options(self: OverheadBudget, choice: Any = None) -> dict[str, Any]:
    """:meth:`OverheadBudget.options` with the chosen basis interval as a constant."""
    chosen = _ORIGINAL(self, choice)
    interval = chosen.get("inverse_update_interval")
    if isinstance(interval, EarlyRefresh):
        chosen["inverse_update_interval"] = interval.interval
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(RATES), choices=list(RATES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.families:
        row: dict[str, Any] = {"family": name, "lr": RATES[name]}
        for arm in ("early", "plain"):
            patch = (
                mock.patch.object(OverheadBudget, "options", _plain_options)
                if arm == "plain"
                else contextlib.nullcontext()
            )
            with patch:
                for split in (0, 1):
                    task = family_task(name, split)
                    reached = [
                        train_to_target(task, "dkfac", RATES[name], seed, MAX_STEPS, None)[
                            "reached"
                        ]
                        for seed in SEEDS
                    ]
                    steps = [r if r is not None else float("inf") for r in reached]
                    row[f"{arm}_split{split}"] = {
                        "reached": reached,
                        "median": statistics.median(steps),
                    }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine_info(), "seeds": SEEDS, "rows": rows}
    write_result(args.out.stem, result, args.out.parent, probe_command())


if __name__ == "__main__":
    main()
