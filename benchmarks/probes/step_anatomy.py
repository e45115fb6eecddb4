"""Where the default's step goes on the suite's families, against AdamW's and Muon's.

``dkfac bench suite`` gives one number a step. This probe splits it: for each family of the
suite (split 0, its batch) it times AdamW, Muon (its Newton–Schulz iteration in float32) and
``KFACOptimizer.for_model`` in alternated blocks, one thread, every step from the same
initial weights (put back outside the clocks, as the suite does), and for each optimizer the
forward and backward apart from ``optimizer.step()`` (each arm's median block). The
default's mean step over the same steps is split further by timers around its phases: the
statistics (reading, reducing and checking the gradients, the factors' update), the
refreshes of the bases (amortised), the leftover Adam (the parameters no block takes), the
preconditioning (rotations into and out of the bases, the moments, the polar factors), the
KL-clip and write-back, and the rest of the optimizer's step (its finiteness check, the
inner SGD, the bookkeeping). Two references
beside it:

* ``algebra_ms``: the products alone of the preconditioning on random tensors of the
  registered layers' shapes, as dense matrices (two rotations in and two out, and the
  Newton–Schulz steps the default takes on the orthogonalised layers): what any
  implementation of this update pays in arithmetic a step (``None`` on the digits CNN,
  whose first linear layer has a Kronecker-structured basis);
* ``launch_bound_forms``: the default's step with the engine's GPU code paths forced on the
  CPU (the groups' moments in one flat pass, the polar factors zero-padded into one batched
  iteration, multi-tensor checks), which cut the host's work on a launch-bound device.

    PYTHONPATH=src python benchmarks/probes/step_anatomy.py --threads 1 \\
        --out benchmarks/results/step_anatomy.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

import dkfac.preconditioner as preconditioner_module
from dkfac.bench.common import machine_info
from dkfac.bench.suite import make_optimizer
from dkfac.bench.suite_tasks import FAMILIES, Task, load_task
from dkfac.engine import launches
from dkfac.engine.leftover import LeftoverAdam
from dkfac.optimizer import KFACOptimizer
from dkfac.solvers.polar import polar_factor

LRS = {"adamw": 0.01, "muon32": 0.16, "dkfac": 0.01}
"""The rates the blocks step at (the suite's chosen ones on most families; a step's cost
hardly depends on them, every step starting from the same weights)."""

PHASES = {
    "statistics": ("read_gradients", "reduce_statistics", "agree_finite", "update_factors"),
    "refresh": ("update_inverses",),
    "precondition": ("precondition_gradients",),
    "clip_and_write": ("clip_and_write",),
}
"""Phase -> the functions of :mod:`dkfac.preconditioner`'s step timed for it."""


class Timers:
    """Seconds spent in wrapped functions, by label, while :attr:`on`."""

    def __init__(self) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.on = False

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        """``function`` timed under ``label`` (nested calls of one label count once)."""

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def phase_timers(timers: Timers) -> Iterator[None]:
    """The default's phases timed (module notes)."""
    with contextlib.ExitStack() as stack:
        for label, names in PHASES.items():
            for name in names:
                if name == "update_inverses":
                    target: Any = preconditioner_module.KFACPreconditioner
                else:
                    target = preconditioner_module
                original = getattr(target, name)
                stack.enter_context(mock.patch.object(target, name, timers.wrap(original, label)))
        stack.enter_context(
            mock.patch.object(LeftoverAdam, "step", timers.wrap(LeftoverAdam.step, "leftover"))
        )
        yield


@contextlib.contextmanager
def launch_bound_forms() -> Iterator[None]:
    """The engine's code paths for a launch-bound device, on any device."""
    with mock.patch.object(launches, "launch_bound", lambda device: True):
        yield


def _arm(task: Task, name: str) -> tuple[nn.Module, Any, dict[str, torch.Tensor], Any]:
    """A fresh model (seed 0), its optimizer, its initial weights and its batches."""
    torch.manual_seed(0)
    model = task.build()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(name, model, LRS[name])
    return model, optimizer, initial, task.batches(torch.Generator().manual_seed(0))


def measure_family(family: str, blocks: int, steps: int) -> dict[str, Any]:
    """Alternated blocks of every arm on ``family``; each arm's median block, per step."""
    task = load_task(family, 0)
    timers = Timers()
    arms: dict[str, Callable[[], tuple[float, float]]] = {}
    kfac: KFACOptimizer | None = None
    for arm in ("adamw", "muon32", "dkfac", "launch_bound_forms"):
        forced = arm == "launch_bound_forms"
        with launch_bound_forms() if forced else contextlib.nullcontext():
            model, opt, initial, draw = _arm(task, "dkfac" if forced else arm)
        if arm == "dkfac":
            kfac = opt

        def block(
            model: nn.Module = model,
            opt: Any = opt,
            initial: dict[str, torch.Tensor] = initial,
            draw: Any = draw,
            forced: bool = forced,
            timed: bool = arm == "dkfac",
        ) -> tuple[float, float]:
            passes, stepping = 0.0, 0.0
            with launch_bound_forms() if forced else contextlib.nullcontext():
                for _ in range(steps):
                    model.load_state_dict(initial)  # outside the clocks
                    x, y = draw()
                    timers.on = timed
                    start = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    task.loss(model(x), y).backward()
                    middle = time.perf_counter()
                    opt.step()
                    end = time.perf_counter()
                    timers.on = False
                    if timed:
                        timers.seconds["step"] += end - middle
                    passes += middle - start
                    stepping += end - middle
            return passes / steps, stepping / steps

        arms[arm] = block
    assert kfac is not None
    results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    with phase_timers(timers):
        for round_ in range(1 + blocks):  # one untimed round first
            if round_ == 1:
                timers.seconds.clear()
            for arm, run_block in arms.items():
                measured = run_block()
                if round_:
                    results[arm].append(measured)
    record: dict[str, Any] = {"batch_size": task.batch_size}
    for arm, times in results.items():
        passes = statistics.median(t[0] for t in times) * 1e3
        stepping = statistics.median(t[1] for t in times) * 1e3
        record[arm] = {"forward_backward_ms": passes, "step_ms": stepping}
    adamw = record["adamw"]["forward_backward_ms"] + record["adamw"]["step_ms"]
    for arm in arms:
        total = record[arm]["forward_backward_ms"] + record[arm]["step_ms"]
        record[arm]["total_ms"] = total
        record[arm]["total_vs_adamw"] = total / adamw
    taken = blocks * steps
    mean_step = timers.seconds.pop("step") / taken * 1e3
    phases = {label: seconds / taken * 1e3 for label, seconds in sorted(timers.seconds.items())}
    phases["rest_of_step"] = mean_step - sum(phases.values())
    record["dkfac"]["mean_step_ms"] = mean_step
    record["dkfac"]["phases_ms"] = phases
    record["dkfac"]["hooks_and_captures_ms"] = (
        record["dkfac"]["forward_backward_ms"] - record["adamw"]["forward_backward_ms"]
    )
    record["algebra_ms"] = algebra_ms(kfac)
    return record


def algebra_ms(optimizer: KFACOptimizer, repeats: int = 50) -> float | None:
    """The products of one plain step on random dense tensors of the registered layers'
    shapes (module notes), the median of ``repeats`` timings; ``None`` where a layer has a
    Kronecker-structured side (the digits CNN's first linear layer), whose rotations are
    not two dense products."""
    shapes = []
    for row in optimizer.preconditioner.describe():
        if row["block"] in ("cost", "inner optimizer") or row["a_dim"] is None:
            continue
        method = str(row["method"])
        if "A basis" in method:
            return None
        steps = 0
        if "orthogonal" in method:
            steps = int(method.split(" steps")[0].rsplit(" ", 1)[-1])
        shapes.append((int(row["g_dim"]), int(row["a_dim"]), steps))
    tensors = [
        (torch.randn(g, g), torch.randn(a, a), torch.randn(g, a), steps) for g, a, steps in shapes
    ]

    def once() -> None:
        for qg, qa, grad, steps in tensors:
            inside = qg.T @ grad @ qa
            if steps:
                inside = polar_factor(inside, steps, torch.float32)
            qg @ inside @ qa.T

    for _ in range(5):
        once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="steps a block")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("dkfac").setLevel(logging.ERROR)
    record: dict[str, Any] = {
        "command": "PYTHONPATH=src python benchmarks/probes/step_anatomy.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "threads": args.threads,
        "lrs": LRS,
        "families": {},
    }
    for family in args.families:
        result = measure_family(family, args.blocks, args.steps)
        record["families"][family] = result
        dk = result["dkfac"]
        logging.warning(
            "%s: step x AdamW %.2f (Muon %.2f, launch-bound forms %.2f); dkfac step %.2f ms, "
            "algebra %s ms, hooks+captures %.2f ms, phases %s",
            family,
            dk["total_vs_adamw"],
            result["muon32"]["total_vs_adamw"],
            result["launch_bound_forms"]["total_vs_adamw"],
            dk["step_ms"],
            "-" if result["algebra_ms"] is None else f"{result['algebra_ms']:.2f}",
            dk["hooks_and_captures_ms"],
            {k: round(v, 2) for k, v in dk["phases_ms"].items()},
        )
    text = json.dumps(record, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
