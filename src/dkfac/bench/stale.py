"""Stale statistics on large-batch digits: K-FAC with ``refresh="fixed"`` vs ``"adaptive"``.

``python -m dkfac.bench.stale`` trains the BatchNorm CNN of :mod:`dkfac.app.models` on
scikit-learn's digits at a large batch with K-FAC (unit-wise BatchNorm on), once with every
statistic refreshed every step and once with SP-NGD's adaptive per-statistic intervals, all
other settings equal, for several seeds, interleaved (seed 0 fixed then adaptive, seed 1
adaptive then fixed, ...), after one untimed two-step run of each. It reports the optimizer
steps, training seconds (wall clock, evaluation excluded) and process-CPU seconds to the
target test accuracy, the final accuracy, wall and CPU seconds per step (CPU time is less
disturbed by other jobs on a shared machine) and the mean fraction of statistics refreshed
per step (``refresh_stats()["refreshed"] / ["total"]``), and
writes ``benchmarks/results/stale-digits.json``.

The loop is its own (a few lines), not the ``dkfac train`` program, so that nothing but the
refresh policy differs between the arms and the timings hold only the training step.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dkfac.app.data import Splits, load_digits
from dkfac.app.models import SmallCNN
from dkfac.app.schedules import lr_factor
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    first_reaching,
    format_table,
    machine_info,
    median,
    write_result,
)
from dkfac.config import KFACConfig
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

logger = logging.getLogger(__name__)

MODES = ("fixed", "adaptive")
Trace = list[tuple[int, float, float]]  # (steps done, training seconds, test accuracy)


def time_to_target(trace: Trace, target: float) -> tuple[int, float] | None:
    """The first ``(step, seconds)`` of ``trace`` whose accuracy is at least ``target``.

    Args:
        trace: Evaluations in the order they were taken.
        target: Accuracy to reach, in (0, 1].

    Returns:
        ``None`` when no evaluation reached the target.

    Raises:
        ValueError: If ``target`` is outside (0, 1].
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    return first_reaching(trace, target)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Splits) -> float:
    """Test accuracy of ``model`` (eval mode for the duration)."""
    model.eval()
    correct = int((model(data.x_test).argmax(1) == data.y_test).sum())
    model.train()
    return correct / len(data.y_test)


def run_one(mode: str, seed: int, data: Splits, opts: argparse.Namespace) -> dict[str, Any]:
    """Trains one arm; returns its trace, time to target, final accuracy, refresh fraction."""
    torch.manual_seed(seed)
    model = SmallCNN(data.in_channels, data.num_classes, data.image_size, batch_norm=True)
    inner = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9)
    config = KFACConfig(
        damping=opts.damping,
        kl_clip=opts.kl_clip,
        factor_decay=opts.factor_decay,
        inverse_update_interval=opts.inverse_update_interval,
        factor_update_interval=1,
        refresh=mode,  # type: ignore[arg-type]
        refresh_threshold=opts.refresh_threshold,
        refresh_max_interval=opts.refresh_max_interval,
    )
    pre = KFACPreconditioner(model, config=config)
    opt = KFACOptimizer(inner, pre)
    gen = torch.Generator().manual_seed(seed)
    n_train = len(data.y_train)
    per_epoch = n_train // opts.batch_size
    trace: Trace = []
    cpu_at_eval: list[float] = []
    fractions: list[float] = []
    seconds = cpu_seconds = 0.0
    order = torch.randperm(n_train, generator=gen)
    for step in range(opts.steps):
        k = step % per_epoch
        if k == 0 and step:
            order = torch.randperm(n_train, generator=gen)
        idx = order[k * opts.batch_size : (k + 1) * opts.batch_size]
        for group in opt.param_groups:
            group["lr"] = opts.lr * lr_factor(
                step,
                schedule="poly",
                steps_per_epoch=per_epoch,
                total_steps=opts.steps,
                warmup_epochs=opts.warmup_steps / per_epoch,
                power=2.0,
            )
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu_start
        stats = pre.refresh_stats()
        fractions.append(stats["refreshed"] / stats["total"])
        if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
            trace.append((step + 1, seconds, accuracy(model, data)))
            cpu_at_eval.append(cpu_seconds)
    hit = time_to_target(trace, opts.target)
    cpu_to_target = None if hit is None else cpu_at_eval[[t[0] for t in trace].index(hit[0])]
    return {
        "mode": mode,
        "seed": seed,
        "steps_to_target": None if hit is None else hit[0],
        "seconds_to_target": None if hit is None else hit[1],
        "cpu_seconds_to_target": cpu_to_target,
        "final_accuracy": trace[-1][2],
        "train_seconds": seconds,
        "seconds_per_step": seconds / opts.steps,
        "cpu_seconds_per_step": cpu_seconds / opts.steps,
        "refresh_fraction": statistics.fmean(fractions),
        "final_intervals": pre.refresh_stats()["intervals"],
        "trace": trace,
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode: medians over the seeds that reached the target, means of the rest."""
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        reached = [r for r in mine if r["steps_to_target"] is not None]
        rows.append(
            {
                "mode": mode,
                "reached": f"{len(reached)}/{len(mine)}",
                "median_steps_to_target": (
                    median([float(r["steps_to_target"]) for r in reached]) if reached else None
                ),
                "median_seconds_to_target": (
                    median([r["seconds_to_target"] for r in reached]) if reached else None
                ),
                "mean_final_accuracy": statistics.fmean(r["final_accuracy"] for r in mine),
                "median_cpu_seconds_to_target": (
                    median([r["cpu_seconds_to_target"] for r in reached]) if reached else None
                ),
                "median_seconds_per_step": median([r["seconds_per_step"] for r in mine]),
                "median_cpu_seconds_per_step": median([r["cpu_seconds_per_step"] for r in mine]),
                "mean_refresh_fraction": statistics.fmean(r["refresh_fraction"] for r in mine),
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="python -m dkfac.bench.stale", description=__doc__)
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (default: 3)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--target", type=float, default=0.97, help="test accuracy target")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--damping", type=float, default=0.03)
    p.add_argument("--kl-clip", type=float, default=0.01)
    p.add_argument("--factor-decay", type=float, default=0.0)
    p.add_argument("--inverse-update-interval", type=int, default=2)
    p.add_argument("--refresh-threshold", type=float, default=0.1)
    p.add_argument("--refresh-max-interval", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--name", default="stale-digits", help="result file name (no .json)")
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results")
    return p


def _check(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("seeds", "batch_size", "steps", "eval_every", "threads"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < opts.target <= 1:
        parser.error(f"--target must be in (0, 1], got {opts.target}")
    if opts.warmup_steps < 0 or opts.warmup_steps > opts.steps:
        parser.error(f"--warmup-steps must be in [0, --steps], got {opts.warmup_steps}")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; prints a markdown table and writes the JSON result."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    opts = parser.parse_args(words)
    _check(opts, parser)
    torch.set_num_threads(opts.threads)
    data = load_digits(seed=0)
    if opts.batch_size > len(data.y_train):
        parser.error(f"--batch-size exceeds the {len(data.y_train)} training images")
    short = argparse.Namespace(**{**vars(opts), "steps": 2, "warmup_steps": 0})
    for mode in MODES:  # untimed: the first steps of a process pay one-time costs
        run_one(mode, 0, data, short)
    runs: list[dict[str, Any]] = []
    for seed in range(opts.seeds):
        for mode in MODES if seed % 2 == 0 else MODES[::-1]:
            result = run_one(mode, seed, data, opts)
            logger.info("%s seed %d: %s", mode, seed, result["steps_to_target"])
            runs.append(result)
    rows = summarise(runs)
    headers = list(rows[0])
    table = format_table(headers, [[row[h] for h in headers] for row in rows])
    payload = {
        "invocation": " ".join(["python -m dkfac.bench.stale", *words]),
        "benchmark": "stale statistics (refresh fixed vs adaptive), SmallCNN+BN on digits",
        "settings": vars(opts),
        "machine": machine_info("cpu"),
        "summary": rows,
        "runs": runs,
    }
    command = command_line("python -m dkfac.bench.stale", words)
    path = write_result(opts.name, payload, opts.out_dir, command)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
