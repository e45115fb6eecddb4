"""``compile_step``: what compiling each group's update saves per step on a CPU.

``KFACOptimizer.for_model`` with ``compile_step`` set (each group's rotations, moments and
Newton-Schulz iterations through ``torch.compile``, a graph a group) for one arm, as it is
for the other, and AdamW beside them: the suite's tasks (:mod:`dkfac.bench.suite_tasks`)
timed by :func:`dkfac.bench.suite.step_seconds` (alternated blocks from the same initial
weights, the thread's CPU clock, one thread), its first ``--warm`` steps of each arm in
blocks that are dropped (the compiled arm compiles a graph for every group at its first
step). The seconds the first ``--warm`` steps take on a fresh model and optimizer,
compilation included, are recorded beside.

    PYTHONPATH=src python benchmarks/probes/compiled_precondition.py --threads 1 \\
        --families mlp autoencoder cnn gpt vit resnet \\
        --out benchmarks/results/compiled_precondition.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import dkfac.bench.suite as suite
from dkfac.bench.common import command_line, machine_info
from dkfac.bench.peers import Stepper
from dkfac.bench.suite_tasks import Task, load_task
from dkfac.solvers.eigen_moments import EigenMomentsSolver

COMPILED = "dkfac_compiled"
EAGER = "dkfac"


def _install(backend: str) -> None:
    """Makes :data:`COMPILED` a suite optimizer: ``for_model`` with ``compile_step=backend``."""
    make = suite.make_optimizer

    def _make(name: str, model: torch.nn.Module, lr: float, options: Any = None) -> Stepper:
        if name != COMPILED:
            return make(name, model, lr, options)
        return make(EAGER, model, lr, {**(options or {}), "compile_step": backend})

    suite.make_optimizer = _make  # type: ignore[assignment]


def _warm_seconds(task: Task, name: str, lr: float, steps: int) -> tuple[float, list[str]]:
    """Seconds of the first ``steps`` steps of ``name`` on a fresh model (compilation
    included for the compiled arm), and the layers whose update then runs eagerly (none
    compiled for the eager arm; for the compiled one, those whose compilation failed)."""
    torch.manual_seed(0)
    model = task.build()
    optimizer = suite.make_optimizer(name, model, lr, None)
    batch = task.batches(torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(steps):
        suite.train_step(task, model, optimizer, batch)
    seconds = time.perf_counter() - start
    layers = optimizer.preconditioner.layers.items()  # type: ignore[attr-defined]
    solvers = {n: lay.solver for n, lay in layers if isinstance(lay.solver, EigenMomentsSolver)}
    return seconds, [n for n, solver in solvers.items() if not solver._update.active]


def main() -> None:
    """Parses the flags, measures every family, writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["mlp", "autoencoder", "cnn", "gpt"])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warm", type=int, default=60, help="untimed steps of each arm first")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps a timed block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _install(args.backend)
    payload: dict[str, Any] = {
        "command": command_line(
            "PYTHONPATH=src python benchmarks/probes/compiled_precondition.py", None
        ),
        "machine": machine_info(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": [],
    }
    for family in args.families:
        try:
            row = _measure(family, args)
        except Exception as error:  # the compiler's own failures are a result here
            row = {"family": family, "error": f"{type(error).__name__}: {error}"[:500]}
        payload["rows"].append(row)
        print(json.dumps({k: row[k] for k in row if k != "blocks_ms"}), flush=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")


def _measure(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """One family's row: the arms' step costs and their first steps' seconds."""
    task = load_task(family, 0)
    warm = {n: _warm_seconds(task, n, args.lr, args.warm) for n in (EAGER, COMPILED)}
    lrs = {EAGER: args.lr, COMPILED: args.lr, "adamw": args.lr}
    skip = -(-args.warm // args.steps)  # warm blocks on the timed instances, dropped
    _, cpu = suite.step_seconds(task, lrs, blocks=skip + args.blocks, steps=args.steps)
    cpu = {n: v[skip:] for n, v in cpu.items()}
    medians = {n: statistics.median(v) for n, v in cpu.items()}
    return {
        "family": family,
        "ms_per_step": {n: round(v * 1e3, 3) for n, v in medians.items()},
        "vs_adamw": {n: round(v / medians["adamw"], 3) for n, v in medians.items()},
        "compiled_vs_eager": round(medians[COMPILED] / medians[EAGER], 3),
        "first_steps_seconds": {n: round(v[0], 2) for n, v in warm.items()},
        "eager_layers_of_the_compiled_arm": warm[COMPILED][1],
        "blocks_ms": {n: [round(x * 1e3, 3) for x in v] for n, v in cpu.items()},
    }


if __name__ == "__main__":
    main()
