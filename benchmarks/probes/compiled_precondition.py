"""The plain step's preconditioning through ``torch.compile``: what it saves on a CPU.

A plain step compiled (or captured as a CUDA graph), with the eager path as its fallback,
is one way to a cheaper ``for_model`` step. This probe measures how far a compiler gets on a
CPU before any of it is built: it runs
:func:`dkfac.engine.step_math.precondition` (the rotations, moments and Newton-Schulz
iterations of every layer, once the gradients are read and before they are written back)
through ``torch.compile`` (default mode, not ``fullgraph``: the engine's Python around the
tensor work breaks the graph where it must) for one arm, ``KFACOptimizer.for_model`` as it
is for the other, and AdamW beside them: the suite's tasks (:mod:`dkfac.bench.suite_tasks`)
timed by :func:`dkfac.bench.suite.step_seconds` (alternated blocks from the same initial
weights, the thread's CPU clock, one thread), its first ``--warm`` steps of each arm in
blocks that are dropped (the compiled arm compiles a graph for every solver and group shape
it meets, and again for the factor and refresh steps' paths). The seconds the first
``--warm`` steps take on a fresh model and optimizer, compilation included, are recorded
beside.

    PYTHONPATH=src python benchmarks/probes/compiled_precondition.py --threads 1 \\
        --out benchmarks/results/compiled_precondition.json

Not a feature: the compiled arm is a monkeypatch of one function with dynamo's recompile
limit raised (the solvers' options differ per instance, and every instance shares the code
of one function, so the default limit of 8 graphs is reached on a model with a few kinds of
layers).
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
import dkfac.engine.step_phases as step_phases
from dkfac.bench.common import command_line, machine_info
from dkfac.bench.peers import Stepper
from dkfac.bench.suite_tasks import Task, load_task
from dkfac.engine import step_math

COMPILED = "dkfac_compiled"
EAGER = "dkfac"


def _install(backend: str) -> None:
    """Routes ``step_phases.precondition`` to the compiled function while an optimizer made
    by :func:`_make` for the compiled arm steps, and to the eager one otherwise."""
    eager = step_math.precondition
    compiled = torch.compile(eager, backend=backend)
    active = [False]

    def routed(*args: Any, **kwargs: Any) -> Any:
        return (compiled if active[0] else eager)(*args, **kwargs)

    step_phases.precondition = routed  # type: ignore[assignment]
    make = suite.make_optimizer

    def _make(name: str, model: torch.nn.Module, lr: float, options: Any = None) -> Stepper:
        if name != COMPILED:
            return make(name, model, lr, options)
        optimizer = make(EAGER, model, lr, options)
        plain_step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            active[0] = True
            try:
                return plain_step(*args, **kwargs)
            finally:
                active[0] = False

        optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    suite.make_optimizer = _make  # type: ignore[assignment]


def _warm_seconds(task: Task, name: str, lr: float, steps: int) -> float:
    """Seconds of the first ``steps`` steps of ``name`` on a fresh model (compilation
    included for the compiled arm)."""
    torch.manual_seed(0)
    model = task.build()
    optimizer = suite.make_optimizer(name, model, lr, None)
    batch = task.batches(torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(steps):
        suite._step(task, model, optimizer, batch)
    return time.perf_counter() - start


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
    torch._dynamo.config.recompile_limit = 256
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
        "first_steps_seconds": {n: round(v, 2) for n, v in warm.items()},
        "blocks_ms": {n: [round(x * 1e3, 3) for x in v] for n, v in cpu.items()},
    }


if __name__ == "__main__":
    main()
