"""Steps to the suite's targets under bf16 autocast against float32, the default and AdamW.

Under ``torch.autocast(dtype=torch.bfloat16)`` a layer's weight gradient is a bf16 product
rounded to bf16, so it has components of about bf16's rounding (``2⁻⁹`` of each entry) in
the null space of a rank-deficient input factor, where a float32 gradient has none; Adam's
normalisation in the eigenbasis (``"eigen_adam"``) enlarges them up to the rounding floor
(:mod:`dkfac.solvers.null_space`), about 1e-3 of the layer's norm, so part of the update
leaves the span of the layer's inputs (``--leak``: the share of the first layer's update
outside that span on a 64-32-32-4 MLP at batch 8, factors every step from the whole batch,
``overhead=None``, against a dense SVD of the inputs in float64). This probe measures
whether that costs training steps: every family of ``dkfac bench suite``
(:func:`dkfac.bench.suite_tasks.load_task`, its target and its metric) is trained by
``for_model`` and by AdamW, each at the lr the suite's sweep chose
(``benchmarks/results/suite_default_v17.json``), in float32 and with the forward and the loss
under bf16 autocast on the CPU (the metric always in float32, the same yardstick), seeds
``--first-seed`` on (``--seeds`` of them) on both splits, one thread, the suite's step budget
(150) and ``eval_every``. The JSON holds every run and the median steps of each cell.

    PYTHONPATH=src python benchmarks/probes/autocast_bf16.py --leak \\
        --out benchmarks/results/autocast_bf16_suite.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from dkfac.bench.common import machine_info
from dkfac.bench.suite import make_optimizer
from dkfac.bench.suite_tasks import FAMILIES, Task, load_task
from dkfac.solvers.eigen_adam import EigenAdamSolver

LR = {  # the lr of suite_default_v17.json's sweep
    "dkfac": {"vit": 0.02, "resnet": 0.01, "mlp": 0.01, "cnn": 0.005, "autoencoder": 0.01,
              "gpt": 0.01},
    "adamw": {"vit": 0.01, "resnet": 0.01, "mlp": 0.01, "cnn": 0.01, "autoencoder": 0.01,
              "gpt": 0.0025},
}  # fmt: skip


def precision_context(precision: str) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on the CPU, or nothing (float32)."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def null_floor(multiple: float) -> Any:
    """``eigen_adam``'s rounding floor in null coordinates times ``multiple`` (``inf``: their
    update zeroed, the update projected onto the factors' ranges), patched into
    :meth:`EigenAdamSolver._floored_root` for the duration (a probe of the floor's size, not
    an option)."""
    if multiple == 1.0:
        yield
        return
    original = EigenAdamSolver._floored_root

    def floored(self: Any, v: Any, eps: Any, null: Any, layers: Any = None) -> Any:
        if null is None:
            return original(self, v, eps, null, layers)
        if math.isinf(multiple):
            return original(self, v, eps, null, layers) + null * 1e30
        return original(self, v, eps, null * multiple, layers)

    EigenAdamSolver._floored_root = floored  # type: ignore[method-assign]
    try:
        yield
    finally:
        EigenAdamSolver._floored_root = original  # type: ignore[method-assign]


def train(
    task: Task, name: str, lr: float, seed: int, max_steps: int, precision: str,
    options: dict[str, Any] | None = None, floor: float = 1.0,
) -> dict[str, Any]:  # fmt: skip
    """:func:`dkfac.bench.suite.train_to_target` with the forward and the loss under
    ``precision`` (the metric in float32), ``eigen_adam``'s null floor times ``floor``."""
    with null_floor(floor):
        return _train(task, name, lr, seed, max_steps, precision, options)


def _train(
    task: Task, name: str, lr: float, seed: int, max_steps: int, precision: str,
    options: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(seed)
    model = task.build()
    optimizer = make_optimizer(name, model, lr, options)
    batch = task.batches(torch.Generator().manual_seed(seed))
    trace = [[0, task.metric(model)]]
    step, diverged, reached = 0, False, None
    start = time.perf_counter()
    while step < max_steps:
        x, y = batch()
        optimizer.zero_grad(set_to_none=True)
        with precision_context(precision):
            loss = task.loss(model(x), y)
        loss.float().backward()
        optimizer.step()
        step += 1
        diverged = not math.isfinite(float(loss.detach()))
        if step % task.eval_every == 0 or step == max_steps or diverged:
            value = task.metric(model)
            trace.append([step, value])
            good = value >= task.target if task.higher_is_better else value <= task.target
            if good and not diverged:
                reached = step
                break
        if diverged:
            break
    return {
        "seed": seed, "reached": reached, "steps": step, "final": trace[-1][1],
        "diverged": diverged, "seconds": time.perf_counter() - start, "trace": trace,
    }  # fmt: skip


def leak(precision: str, steps: int = 6, **options: Any) -> list[float]:
    """The share of the first layer's update outside the span of its inputs, each step
    (64-32-32-4 MLP, batch 8, the same batch every step, ``overhead=None``)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    opt = KFACOptimizer.for_model(model, lr=1e-2, overhead=None, **options)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
    rows = torch.cat([x, torch.ones(8, 1)], 1).double()
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    span = vh[: int((s > s[0] * 1e-10).sum())]
    first = model[0]
    assert isinstance(first, nn.Linear)
    shares = []
    for _ in range(steps):
        before = torch.cat([first.weight, first.bias[:, None]], 1).detach().double()
        opt.zero_grad()
        with precision_context(precision):
            loss = F.cross_entropy(model(x), y)
        loss.float().backward()
        opt.step()
        d = torch.cat([first.weight, first.bias[:, None]], 1).detach().double() - before
        shares.append(float((d - d @ span.T @ span).norm() / d.norm()))
    return shares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--optimizers", nargs="+", default=["dkfac", "adamw"])
    parser.add_argument("--precisions", nargs="+", default=["float32", "bf16"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--dkfac-options", type=json.loads, default=None)
    parser.add_argument(
        "--floors", nargs="+", type=float, default=[1.0],
        help="multiples of eigen_adam's null floor to run (dkfac only; inf: zeroed)",
    )  # fmt: skip
    parser.add_argument("--leak", action="store_true", help="also the first layer's leak")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    record: dict[str, Any] = {
        "command": "PYTHONPATH=src python benchmarks/probes/autocast_bf16.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "lr": LR},
    }
    if args.leak:
        record["leak"] = {
            "float32": leak("float32"),
            "bf16 autocast": leak("bf16"),
            "capture_dtype=bf16": leak("float32", capture_dtype=torch.bfloat16),
            "gradient_rotation_dtype=bf16": leak("float32", gradient_rotation_dtype=torch.bfloat16),
        }
        for key, value in record["leak"].items():
            print(f"leak {key}: " + " ".join(f"{v:.3g}" for v in value), flush=True)
    results: dict[str, Any] = {}
    for family in args.families:
        cells: dict[str, Any] = {}
        for split in (0, 1):
            task = load_task(family, split)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for name, precision, floor in itertools.product(
                    args.optimizers, args.precisions, args.floors
                ):
                    if name != "dkfac" and floor != args.floors[0]:
                        continue
                    options = args.dkfac_options if name == "dkfac" else None
                    lr = LR[name][family]
                    run = train(task, name, lr, seed, args.max_steps, precision, options, floor)
                    key = f"{name} {precision}"
                    if name == "dkfac" and floor != 1.0:
                        key += f" floor x{floor:g}"
                    cell = cells.setdefault(key, {"0": [], "1": []})
                    cell[str(split)].append(run)
                    print(
                        f"{family} split {split} seed {seed} {key}: "
                        f"{run['reached']} ({run['final']:.4g}, {run['seconds']:.1f} s)",
                        flush=True,
                    )
        summary = {}
        for key, cell in cells.items():
            summary[key] = {
                f"median_steps_split{split}": statistics.median(
                    r["reached"] if r["reached"] is not None else math.inf for r in runs
                )
                for split, runs in cell.items()
            }
        results[family] = {"summary": summary, "runs": cells}
        print(family, json.dumps(summary), flush=True)
        if args.out:
            record["families"] = results
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
