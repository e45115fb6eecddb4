"""``dkfac bench suite``: the default judged on model families no recipe was tuned for.

Every task of :mod:`dkfac.bench.suite_tasks` (a vision transformer, a residual CNN with
BatchNorm, an MLP with LayerNorm and GELU, the digits CNN, an autoencoder, a byte-level GPT)
is trained by every optimizer to its target:

* ``dkfac``: :meth:`dkfac.KFACOptimizer.for_model` ``(model, lr=lr)``, nothing else set;
* ``adamw``: ``torch.optim.AdamW`` (torch's defaults);
* ``muon``: ``torch.optim.Muon`` as shipped on the hidden matrices, AdamW (lr 0.003) on the
  rest (:class:`~dkfac.bench.peers.MuonWithAdamW`); ``muon32``: the same with the
  Newton–Schulz iteration in float32 (:mod:`dkfac.bench.muon_float32`), for CPUs that
  emulate bf16; the better of the two is the Muon peer;
* ``soap``: heavyball's SOAP (skipped, and recorded so, without heavyball).

Protocol, per task: the lr grids (:data:`GRIDS`, the same size for every optimizer) are swept
on one seed (``--sweep-seed``), the lr with the fewest steps to the target (then the best
final metric) wins; every optimizer then runs at its lr on ``--seeds`` held-out seeds on the
sweep's split and on a second split, interleaved (seed-major, optimizers inner). The metric
is measured outside the clock every ``eval_every`` steps. Steps to the target are the
headline; the cost of a step is measured separately and side by side: every optimizer at its
lr steps a fresh model in blocks of ``--timing-steps`` steps, blocks of all optimizers
alternated, ``--timing-blocks`` rounds after one untimed round, every step taken from the
same initial weights for every optimizer (put back outside the clocks; the optimizer's own
state goes on): the forward and backward pass then cost every optimizer the same, as a ReLU
network's kernels run faster the more of its units an optimizer has left at zero (AdamW at
lr 0.01 leaves 96-98% of the digits CNN's pooled units at zero from its fifth step on,
against about half at initialisation and under ``for_model``, and its max pool then runs
in half the time). A step's seconds are the
median block over its steps (so refreshes every few steps are counted, amortised), on the
wall clock and, beside it, on the thread's CPU clock (``step_vs_adamw_cpu``: what the step
computed, less moved by other processes on shared cores). Seconds to the target = median
steps x seconds per step (the raw timed seconds of every run are in the JSON too). Writes
``benchmarks/results/<name>.json`` and a plot per task. ``--batch-size`` runs every task at
another batch than its own (the protocol and the grids unchanged).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dkfac.app.pathnames import long_name
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    format_table,
    machine_info,
    parse_options,
    write_result,
)
from dkfac.bench.peers import (
    OptimizerSpec,
    Stepper,
    build_optimizer,
    resolve_options,
    unavailable_reason,
)
from dkfac.bench.suite_report import plot_task, summarise_task
from dkfac.bench.suite_tasks import FAMILIES, Task, load_task
from dkfac.optimizer import KFACOptimizer

__all__ = [
    "GRIDS",
    "OPTIMIZERS",
    "add_protocol_flags",
    "check_protocol_flags",
    "main",
    "make_optimizer",
    "measure_task",
    "run_task",
    "train_step",
    "train_to_target",
]

logger = logging.getLogger(__name__)

OPTIMIZERS = ("dkfac", "adamw", "muon", "muon32", "soap")
"""Every optimizer of the suite, in the order they interleave."""

_ADAM_GRID = (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2)
_MUON_GRID = (0.02, 0.04, 0.08, 0.16, 0.32)

GRIDS: dict[str, tuple[float, ...]] = {
    "dkfac": _ADAM_GRID,
    "adamw": _ADAM_GRID,
    "muon": _MUON_GRID,
    "muon32": _MUON_GRID,
    "soap": _ADAM_GRID,
}
"""Learning-rate grids, five rates doubling over a 16x range for every optimizer and task
(no task is tuned for), each placed where that optimizer's best rates lie on these
families: on the sweep seed a rate beyond the top end (dkfac and AdamW: 0.03; Muon: 0.64)
took more steps, or as many, on every family, and so did Muon's 0.01 below its bottom end
(float32 iteration). Muon's best rate spans 16x across the families (0.02 on the vision
transformer, 0.16 on the autoencoder, 0.32 on the CNN), which a narrower grid cuts off."""

MAX_BATCH = 1024
"""The largest ``--batch-size``: the digits tasks train on 1437 images (an epoch is drawn
in whole batches; 2 is the least BatchNorm trains with)."""

MUON_ADAMW_LR = 3e-3
"""The lr of Muon's AdamW part (embeddings, the first layer, the head, norms, biases)."""


def make_optimizer(
    name: str, model: nn.Module, lr: float, dkfac_options: dict[str, Any] | None = None
) -> Stepper:
    """The optimizer ``name`` of :data:`OPTIMIZERS` over ``model`` at ``lr``
    (``dkfac_options``: keyword options of ``for_model``, none by default)."""
    if name == "dkfac":
        return KFACOptimizer.for_model(model, lr=lr, **(dkfac_options or {}))
    if name in ("muon", "muon32"):
        options = resolve_options("muon", {"adamw_lr": MUON_ADAMW_LR})
        if name == "muon32":
            from dkfac.bench.muon_float32 import MuonFloat32

            return MuonFloat32(model, lr, options)
        return build_optimizer(OptimizerSpec("muon", "muon", [lr], options), model, lr, 0.0)
    if name in ("adamw", "soap"):
        return build_optimizer(OptimizerSpec(name, name, [lr]), model, lr, 0.0)
    raise ValueError(f"unknown suite optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def train_step(task: Task, model: nn.Module, optimizer: Stepper, batch: Callable[[], Any]) -> float:
    """One training step on the next batch; returns its loss."""
    x, y = batch()
    optimizer.zero_grad(set_to_none=True)
    loss = task.loss(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def train_to_target(
    task: Task,
    name: str,
    lr: float,
    seed: int,
    max_steps: int,
    dkfac_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains ``name`` at ``lr`` from seed ``seed`` until the metric reaches the target.

    Returns:
        ``{"lr", "seed", "trace": [[step, seconds, metric], ...], "reached": step | None,
        "steps", "seconds", "final", "diverged"}``; seconds are the timed training steps.
    """
    torch.manual_seed(seed)
    model = task.build()
    optimizer = make_optimizer(name, model, lr, dkfac_options)
    batch = task.batches(torch.Generator().manual_seed(seed))
    trace = [[0, 0.0, task.metric(model)]]
    elapsed, step, diverged, reached = 0.0, 0, False, None
    while step < max_steps:
        start = time.perf_counter()
        loss = train_step(task, model, optimizer, batch)
        elapsed += time.perf_counter() - start
        step += 1
        diverged = not math.isfinite(loss)
        if step % task.eval_every == 0 or step == max_steps or diverged:
            value = task.metric(model)
            trace.append([step, elapsed, value])
            good = value >= task.target if task.higher_is_better else value <= task.target
            if good and not diverged:
                reached = step
                break
        if diverged:
            break
    return {
        "lr": lr,
        "seed": seed,
        "trace": trace,
        "reached": reached,
        "steps": step,
        "seconds": elapsed,
        "final": trace[-1][2],
        "diverged": diverged,
    }


def _score(run: dict[str, Any], higher_is_better: bool) -> tuple[float, float]:
    """Sweep order: steps to the target (inf if missed), then the final metric."""
    steps = run["reached"] if run["reached"] is not None else math.inf
    final = run["final"] if math.isfinite(run["final"]) else math.inf
    return steps, -final if higher_is_better else final


def step_seconds(
    task: Task,
    lrs: dict[str, float],
    *,
    blocks: int,
    steps: int,
    dkfac_options: dict[str, Any] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step of every optimizer at its lr, measured in alternated blocks, every
    step from the models' common initial weights (module notes).

    Returns:
        Name -> the per-step seconds of each timed block (the block's timed seconds /
        ``steps``), on the wall clock and on this thread's CPU clock (the second: what the
        step itself computed, less sensitive to other processes sharing the cores; with one
        torch thread the whole step runs on this thread on a CPU).
    """
    cases: dict[str, Callable[..., tuple[float, float]]] = {}
    for name, lr in lrs.items():
        torch.manual_seed(0)
        model = task.build()
        initial = {key: value.detach().clone() for key, value in model.state_dict().items()}
        optimizer = make_optimizer(name, model, lr, dkfac_options)
        batch = task.batches(torch.Generator().manual_seed(0))

        def block(
            model: nn.Module = model,
            opt: Stepper = optimizer,
            draw: Any = batch,
            initial: dict[str, torch.Tensor] = initial,
        ) -> tuple[float, float]:
            wall = cpu = 0.0
            for _ in range(steps):
                model.load_state_dict(initial)  # outside the clocks
                start, start_cpu = time.perf_counter(), time.thread_time()
                train_step(task, model, opt, draw)
                wall += time.perf_counter() - start
                cpu += time.thread_time() - start_cpu
            return wall / steps, cpu / steps

        cases[name] = block
    wall_times: dict[str, list[float]] = {name: [] for name in cases}
    cpu_times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(1 + blocks):  # one untimed round first
        for name, block in cases.items():
            wall, cpu = block()
            if round_:
                wall_times[name].append(wall)
                cpu_times[name].append(cpu)
    return wall_times, cpu_times


def run_task(args: argparse.Namespace, family: str, names: Sequence[str]) -> dict[str, Any]:
    """Sweep, seeds on both splits, and the per-step timing of one task."""
    tasks = {split: load_task(family, split, tiny=args.tiny) for split in (0, 1)}
    if args.batch_size is not None:
        tasks = {k: dataclasses.replace(t, batch_size=args.batch_size) for k, t in tasks.items()}
    return measure_task(args, tasks, names)


def measure_task(
    args: argparse.Namespace, tasks: Mapping[int, Task], names: Sequence[str]
) -> dict[str, Any]:
    """The suite's protocol on one task given on its two splits (``tasks[0]``, the sweep's,
    and ``tasks[1]``): the sweep, the held-out seeds and the per-step timing, as
    :func:`run_task` runs it on a family of the suite (``args``: the ``bench suite`` flags
    ``sweep_seed``, ``max_steps``, ``dkfac_options``, ``first_seed``, ``seeds``,
    ``timing_blocks`` and ``timing_steps``)."""
    task = tasks[0]
    family = task.name
    sweep: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(len(GRIDS[names[0]])):
        for name in names:
            run = train_to_target(
                task, name, GRIDS[name][i], args.sweep_seed, args.max_steps, args.dkfac_options
            )
            sweep[name].append({k: v for k, v in run.items() if k != "trace"})
            logger.info("%s sweep %s lr=%g: %s steps", family, name, run["lr"], run["reached"])
    chosen = {n: min(sweep[n], key=lambda r: _score(r, task.higher_is_better))["lr"] for n in names}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(split): {n: [] for n in names} for split in tasks
    }
    for split, split_task in tasks.items():
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name in names:
                run = train_to_target(
                    split_task, name, chosen[name], seed, args.max_steps, args.dkfac_options
                )
                runs[str(split)][name].append(run)
    timing, cpu_timing = step_seconds(
        task,
        chosen,
        blocks=args.timing_blocks,
        steps=args.timing_steps,
        dkfac_options=args.dkfac_options,
    )
    record = {
        "task": family,
        "target": task.target,
        "higher_is_better": task.higher_is_better,
        "batch_size": task.batch_size,
        "eval_every": task.eval_every,
        "parameters": sum(p.numel() for p in task.build().parameters()),
        "chosen_lr": chosen,
        "sweep": sweep,
        "runs": runs,
        "step_seconds": timing,
        "step_cpu_seconds": cpu_timing,
    }
    record["summary"] = summarise_task(record)
    return record


def build_parser() -> argparse.ArgumentParser:
    """The ``bench suite`` flags."""
    p = BenchParser(prog="dkfac bench suite", description=__doc__)
    p.add_argument("--tasks", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    add_protocol_flags(p, OPTIMIZERS, max_steps=150, name="suite")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"samples (text windows) per step of every task, 2 to {MAX_BATCH} (default: each "
        "task's own, 256 images and 32 windows)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny models (tests of the mechanics)")
    p.add_argument("--plot-dir", default=None, help="one PNG per task: <dir>/<name>_<task>.png")
    return p


def add_protocol_flags(
    p: argparse.ArgumentParser, optimizers: Sequence[str], *, max_steps: int, name: str
) -> None:
    """The flags of the protocol :func:`measure_task` runs (the optimizers, seeds, step
    budget, timing, ``for_model``'s options, threads and the result's name and folder), with
    the given defaults; :func:`check_protocol_flags` checks their ranges."""
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(optimizers))
    p.add_argument("--seeds", type=int, default=3, help="held-out seeds per split")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--sweep-seed", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=max_steps, help="step budget of every run")
    p.add_argument("--timing-blocks", type=int, default=5)
    p.add_argument("--timing-steps", type=int, default=10)
    p.add_argument(
        "--dkfac-options",
        type=_options,
        default={},
        metavar="KEY=VALUE,...",
        help="options of for_model over its defaults (none: the default as a user gets it), "
        "e.g. overhead=none or orthogonal_layers=role:hidden",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--name", default=name)
    p.add_argument("--out-dir", default=None)


def _options(text: str) -> dict[str, Any]:
    """``--dkfac-options``: ``key=value,...`` (:func:`~dkfac.bench.common.parse_options`)."""
    try:
        return parse_options(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_protocol_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors for the flags of :func:`add_protocol_flags` out of range (``--threads``
    is checked by the parser itself, :class:`~dkfac.bench.arguments.BenchParser`)."""
    for flag in ("seeds", "max_steps", "timing_blocks", "timing_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("first_seed", "sweep_seed"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")


def _check_dkfac_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line error for ``--dkfac-options`` that ``for_model`` refuses on a task's model
    (an unknown option, a value of the wrong type, a pattern that matches no layer), found
    on the tasks' small models before any run."""
    # make_optimizer passes these itself: for_model's TypeError "got multiple values"
    given = {"lr": "the learning rate", "model": "the model"}
    for key, what in given.items():
        if key in args.dkfac_options:
            source = "the suite's grid" if key == "lr" else "each task"
            p.error(f"--dkfac-options {key}: {what} is set by {source}, not an option")
    if not args.dkfac_options or "dkfac" not in args.optimizers:
        return
    for family in dict.fromkeys(args.tasks):
        model = load_task(family, tiny=True).build()
        try:
            make_optimizer("dkfac", model, 1e-3, args.dkfac_options)
        except (TypeError, ValueError) as error:
            p.error(f"--dkfac-options on the {family} task: {error}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench suite``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_protocol_flags(parser, args)
    if args.batch_size is not None and not 2 <= args.batch_size <= MAX_BATCH:
        parser.error(f"--batch-size must be in [2, {MAX_BATCH}], got {args.batch_size}")
    _check_dkfac_options(parser, args)
    longest = max(args.tasks, key=len)
    if args.plot_dir and (problem := long_name(args.name, f"_{longest}.png")):
        parser.error(f"--name {args.name!r} {problem} (the {longest} task's plot)")
    if args.plot_dir:  # made before the runs, so that a bad folder fails now, not after them
        try:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--plot-dir {args.plot_dir!r} cannot be made: {error}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in dict.fromkeys(args.optimizers) if unavailable_reason(n) is None]
    skipped = {n: unavailable_reason(n) for n in args.optimizers if n not in names}
    tasks = [run_task(args, family, names) for family in dict.fromkeys(args.tasks)]
    payload = {
        "benchmark": "suite",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "grids": {n: GRIDS[n] for n in names}},
        "skipped": skipped,
        "tasks": tasks,
    }
    path = write_result(args.name, payload, args.out_dir, command_line("dkfac bench suite", argv))
    if args.plot_dir:
        for record in tasks:
            plot_task(record, str(Path(args.plot_dir) / f"{args.name}_{record['task']}.png"))
    headers = ["task", "optimizer", "lr", "steps", "steps split 1", "s/step", "x AdamW step",
               "x AdamW step (CPU)", "s to target", "x best peer"]  # fmt: skip
    rows = [
        [t["task"], n, e["lr"], e["median_steps"], e["median_steps_split1"], e["step_seconds"],
         _cell(e["step_vs_adamw"]), _cell(e.get("step_vs_adamw_cpu")),
         _cell(e["seconds_to_target"]), _cell(e["time_vs_best_peer"])]
        for t in tasks
        for n, e in t["summary"]["optimizers"].items()
    ]  # fmt: skip
    print(format_table(headers, rows))
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    print(f"wrote {path}")
    return 0


def _cell(value: float | None) -> float | str:
    return "-" if value is None or not math.isfinite(value) else value


def median(values: Sequence[float]) -> float:
    """The median (inf counts as a value: a missed target)."""
    return float(statistics.median(values))
