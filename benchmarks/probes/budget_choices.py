"""What the overhead budget chooses on the suite's families, budget by budget.

``for_model``'s budget prices its work from the layers' shapes (:mod:`dkfac.costmodel.budget`),
so its choice for a family is known without training: this probe builds each family of
``dkfac bench suite`` (split 0, its batch), takes one step so that the budget sees the rows,
and records, for each budget, the factor batch, the factor and basis intervals, the
Newton–Schulz steps, the cost model's overhead of that choice, the per-step part alone (the
rotations, moments and polar factors that no interval makes rarer) and the cheapest choice.
Where the per-step part alone is at or over a budget, no smaller budget can make the step
cheaper than that part::

    PYTHONPATH=src python benchmarks/probes/budget_choices.py \\
        --out benchmarks/results/budget_choices.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

import dkfac.engine.overhead as overhead_module
from dkfac.bench.common import machine_info
from dkfac.bench.suite_tasks import FAMILIES, load_task
from dkfac.costmodel.budget import (
    LayerShape,
    choose,
    choose_for,
    layer_costs,
    min_factor_batch,
)
from dkfac.optimizer import KFACOptimizer

BUDGETS = (0.1, 0.2, 0.25, 0.3, 0.4, 0.5)


def _layer_shapes(family: str) -> tuple[list[LayerShape], int, dict[str, Any]]:
    """The shapes, batch and kept options the budget of ``for_model`` chose from."""
    seen: list[tuple[list[LayerShape], int, dict[str, Any]]] = []
    real = overhead_module.choose_for

    def spy(layers: Any, batch: int, budget: float, fixed: Any = None) -> Any:
        seen.append((list(layers), batch, dict(fixed or {})))
        return real(layers, batch, budget, fixed)

    task = load_task(family)
    torch.manual_seed(0)
    model = task.build()
    overhead_module.choose_for = spy  # type: ignore[assignment]
    try:
        opt = KFACOptimizer.for_model(model, lr=0.01)
        x, y = task.x_train[: task.batch_size], task.y_train[: task.batch_size]
        task.loss(model(x), y).backward()
        opt.step()
    finally:
        overhead_module.choose_for = real
    return seen[-1]


def family_choices(family: str) -> dict[str, Any]:
    """Each budget's choice for ``family`` and the cost model's figures for it."""
    layers, batch, fixed = _layer_shapes(family)
    rows = []
    for budget in BUDGETS:
        choice = choose_for(layers, batch, budget, fixed)
        polar = choice.orthogonal_steps
        priced = [
            dataclasses.replace(x, polar_steps=min(x.polar_steps, polar))
            if polar and x.polar_steps
            else x
            for x in layers
        ]
        costs = layer_costs(priced)
        cheapest = choose(costs, batch, 1e-9, fixed, min_factor_batch(layers, batch))
        rows.append(
            {
                "budget": budget,
                "factor_batch_size": choice.factor_batch_size or batch,
                "factor_update_interval": choice.factor_update_interval,
                "inverse_update_interval": choice.inverse_update_interval,
                "orthogonal_steps": polar,
                "overhead": choice.overhead,
                "per_step_part": costs.fixed / costs.step,
                "cheapest": cheapest.overhead,
            }
        )
    return {"family": family, "batch": batch, "layers": len(layers), "budgets": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    logging.getLogger("dkfac").setLevel(logging.ERROR)
    result: dict[str, Any] = {
        "command": "PYTHONPATH=src python benchmarks/probes/budget_choices.py --out "
        + str(args.out),
        "machine": machine_info(),
        "families": [family_choices(family) for family in FAMILIES],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for fam in result["families"]:
        for row in fam["budgets"]:
            logging.getLogger(__name__).warning(
                "%s %.2f: %.0f%% (per step %.0f%%, cheapest %.0f%%)",
                fam["family"],
                row["budget"],
                100 * row["overhead"],
                100 * row["per_step_part"],
                100 * row["cheapest"],
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
