"""The default with a decoupled weight decay on its hidden matrices, as Muon applies it.

Past its target, the default at twice its best rate collapses on a plain deep MLP, where
Muon, held by torch's weight decay of 0.1, does not (``long_run.py``). This probe puts a
decoupled decay ``--decay`` on the weights of the layers ``for_model`` orthogonalises (role
``hidden`` in ``describe()``: no bias, no norm, no first layer, no head; the rest keep
``for_model``'s 0) and measures it twice:

* ``suite``: ``dkfac bench suite``'s protocol for the default alone (the same grid, sweep
  seed and held-out seeds; nothing timed beyond one block), every family;
* ``long``: ``long_run.py``'s 300 steps on the deep MLP, at the rates ``--lrs``, seeds 0-3.

    PYTHONPATH=src python benchmarks/probes/hidden_decay.py suite --decay 1.0 \\
        --out benchmarks/results/hidden_decay_suite_10.json
    PYTHONPATH=src python benchmarks/probes/hidden_decay.py long --decay 0.5 1.0 \\
        --lrs 0.01 0.02 0.04 --out benchmarks/results/hidden_decay_long.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dkfac.bench.suite as suite
from dkfac import KFACOptimizer
from dkfac.bench.common import machine_info, probe_command, write_result

sys.path.insert(0, str(Path(__file__).parent))
import long_run

PLAIN = suite.make_optimizer
"""The suite's own ``make_optimizer``, before this probe replaces it."""


def hidden_weights(optimizer: KFACOptimizer, model: nn.Module) -> list[nn.Parameter]:
    """The weights of the layers ``optimizer`` orthogonalises (a fused projection's
    slices name its whole weight once)."""
    names = set()
    for row in optimizer.preconditioner.describe():
        if row.get("role") == "hidden" and "orthogonal" in str(row.get("method")):
            names.update(re.sub(r"\[.*\]$", "", p) for p in row["parameters"])
    named = dict(model.named_parameters())
    return [named[n] for n in sorted(names) if not n.endswith("bias")]


def decayed_default(decay: float) -> Any:
    """``suite.make_optimizer`` whose ``dkfac`` puts ``decay`` on its hidden weights."""

    def make(name: str, model: nn.Module, lr: float, options: Any = None) -> Any:
        optimizer = PLAIN(name, model, lr, options)
        if name != "dkfac":
            return optimizer
        hidden = hidden_weights(optimizer, model)
        ids = {id(p) for p in hidden}
        group = optimizer.inner.param_groups[0]
        group["params"] = [p for p in group["params"] if id(p) not in ids]
        optimizer.inner.add_param_group({"params": hidden, "weight_decay": decay})
        return optimizer

    return make


def run_suite(decay: float) -> dict[str, Any]:
    """The suite's protocol, the default alone, with ``decay`` on its hidden weights."""
    suite.make_optimizer = decayed_default(decay)
    args = suite.build_parser().parse_args(["--optimizers", "dkfac", "--timing-blocks", "1"])
    tasks = [suite.run_task(args, family, ["dkfac"]) for family in args.tasks]
    return {"decay": decay, "grid": suite.GRIDS["dkfac"], "tasks": tasks}


def run_long(decays: list[float], lrs: list[float]) -> dict[str, Any]:
    """``long_run.run`` on the deep MLP for each decay and rate, seeds ``long_run.SEEDS``."""
    rows = []
    for decay in decays:
        long_run.make_optimizer = decayed_default(decay)
        for lr in lrs:
            runs = [long_run.run("dkfac", lr, None, seed) for seed in long_run.SEEDS]
            rows.append({"decay": decay, "lr": lr, "runs": runs})
    return {"steps": long_run.STEPS, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("suite", "long"))
    parser.add_argument("--decay", type=float, nargs="+", required=True)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.02])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "suite":
        result = {"runs": [run_suite(decay) for decay in args.decay]}
    else:
        result = run_long(args.decay, args.lrs)
    result["machine"] = machine_info()
    write_result(args.out.stem, result, args.out.parent, probe_command())


if __name__ == "__main__":
    main()
