"""``dkfac bench tta``: training time and steps to a target test accuracy on digits.

SmallCNN (``build_model("cnn")``) on scikit-learn's digits at a large batch (default 700,
two steps per epoch), for SGD, AdamW, Muon (with AdamW), SOAP (heavyball, optional) and K-FAC
configurations (``dkfac.bench.peers``; Adam on request). The protocol is
``dkfac.bench.sweep``'s: equal-size lr grids, a recorded sweep on ``--sweep-seed`` (the lr
with the least time to target, then the highest final accuracy, wins), then ``--seeds``
seeds interleaved (seed-major, optimizers inner) so that machine noise hits all alike.

Default grids (four learning rates each): SGD 0.05 0.1 0.2 0.4; Adam and AdamW 0.001 0.003
0.01 0.03; Muon 0.05 0.1 0.2 0.4 (its AdamW part at 0.01, ``muon:adamw_lr``); SOAP 0.001
0.003 0.01 0.03; K-FAC 0.1 0.2 0.3 0.6.

Only training steps are timed (forward, backward, preconditioning, update); the test
accuracy and loss are measured after every step outside the clock. The split of the data is
fixed by ``--split-seed`` (default 0; another seed is a second split for confirming a recipe);
the training seed sets the initialisation and the shuffling.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.data import Splits, batches, load_digits
from dkfac.app.models import build_model
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    first_reaching,
    format_table,
    machine_info,
    write_result,
)
from dkfac.bench.peers import OptimizerSpec, build_optimizer
from dkfac.bench.sweep import (
    add_peer_arguments,
    build_specs,
    check_peer_flags,
    digits_batch_problem,
    plot_runs,
    split_available,
    sweep_then_seeds,
)

__all__ = ["GRIDS", "OptimizerSpec", "main", "run", "summarise", "train_to_target"]

logger = logging.getLogger(__name__)

DEFAULT_KFAC = (
    "kfac-chol:method=cholesky,factor_update_interval=5,inverse_update_interval=10,"
    "damping=0.03,kl_clip=0.01",
    "kfac-eigen:method=eigen,factor_update_interval=10,inverse_update_interval=20,"
    "damping=0.03,kl_clip=0.01",
)

GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": (0.05, 0.1, 0.2, 0.4),
    "adam": (0.001, 0.003, 0.01, 0.03),
    "adamw": (0.001, 0.003, 0.01, 0.03),
    "muon": (0.05, 0.1, 0.2, 0.4),
    "soap": (0.001, 0.003, 0.01, 0.03),
    "kfac": (0.1, 0.2, 0.3, 0.6),
}
"""Default learning-rate grids, the same size for every kind. Muon's moved up on 2026-11-25:
its old top lr (0.1) had won, and over seeds 0-9 it takes 17.5 steps at 0.1, 12 at 0.2, 11
at 0.4 and 17 at 0.8."""

TASK_OPTIONS = {"muon": {"adamw_lr": 0.01}}
"""Muon's AdamW part at Adam's best lr on this task."""


def evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``(x, y)`` (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(x)
        acc = (logits.argmax(dim=1) == y).float().mean().item()
        loss = F.cross_entropy(logits, y).item()
    model.train(was_training)
    return float(acc), float(loss)


def task_model(in_channels: int = 1, image_size: int = 8) -> nn.Module:
    """The task's SmallCNN, for images of the digits' shape by default (1 channel, 8x8)."""
    return build_model("cnn", in_channels=in_channels, image_size=image_size, num_classes=10)


def train_to_target(
    spec: OptimizerSpec,
    lr: float,
    seed: int,
    data: Splits,
    *,
    batch_size: int,
    target: float,
    max_steps: int,
    max_seconds: float,
    momentum: float = 0.9,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Trains until the test accuracy reaches ``target`` (or a step / time cap).

    Returns:
        ``{"lr", "seed", "trace": [[step, seconds, test_acc], ...], "loss_trace": [[step,
        seconds, test_loss], ...], "reached": [step, s] | None, "steps", "seconds",
        "final_acc", "diverged"}``.
    """
    torch.manual_seed(seed)
    model = task_model(data.in_channels, data.image_size)
    optimizer = build_optimizer(spec, model, lr, momentum)
    mc_fisher = spec.kind == "kfac" and spec.options.get("fisher") == "mc"  # e.g. a --recipe
    gen = torch.Generator().manual_seed(seed)
    trace: list[tuple[int, float, float]] = []
    losses: list[tuple[int, float, float]] = []
    elapsed, step, diverged = 0.0, 0, False
    while step < max_steps and elapsed < max_seconds and not diverged:
        for xb, yb in batches(
            data.x_train, data.y_train, batch_size, shuffle=True, generator=gen, drop_last=True
        ):
            start = clock()
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            if mc_fisher:  # G from sampled labels
                optimizer.preconditioner.sample_fisher(logits)  # type: ignore[attr-defined]
            loss = F.cross_entropy(logits, yb)
            loss.backward()
            optimizer.step()
            elapsed += clock() - start
            step += 1
            acc, test_loss = evaluate(model, data.x_test, data.y_test)
            trace.append((step, elapsed, acc))
            losses.append((step, elapsed, test_loss))
            diverged = not math.isfinite(loss.item())
            if acc >= target or step >= max_steps or elapsed >= max_seconds or diverged:
                break
        if trace and trace[-1][2] >= target:
            break
    reached = first_reaching(trace, target)
    return {
        "lr": lr,
        "seed": seed,
        "trace": [list(t) for t in trace],
        "loss_trace": [list(t) for t in losses],
        "reached": None if reached is None else list(reached),
        "steps": step,
        "seconds": elapsed,
        "final_acc": trace[-1][2] if trace else 0.0,
        "diverged": diverged,
    }


def _score(run: dict[str, Any]) -> tuple[float, float]:
    """Sort key of a sweep run: time to target (inf if missed), then -final accuracy."""
    seconds = run["reached"][1] if run["reached"] is not None else math.inf
    return seconds, -run["final_acc"]


def add_time_ratios(summary: dict[str, dict[str, Any]]) -> None:
    """Sets each entry's ``time_vs_sgd`` and ``time_vs_fastest``: its median time over SGD's,
    and over the least median time of any optimizer.

    ``None`` when the base is not a finite positive time (e.g. SGD missed the target in most
    seeds): a ratio to an infinite time would read as 0, a win it does not measure.
    """
    fastest = min((e["median_seconds"] for e in summary.values()), default=math.inf)
    bases = {
        "time_vs_sgd": summary.get("sgd", {}).get("median_seconds"),
        "time_vs_fastest": fastest,
    }
    for key, base in bases.items():
        valid = base is not None and math.isfinite(base) and base > 0
        for entry in summary.values():
            entry[key] = entry["median_seconds"] / base if valid else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median time and steps to target over seeds (a missed target counts as infinite)."""
    seconds = [r["reached"][1] if r["reached"] else math.inf for r in runs]
    steps = [r["reached"][0] if r["reached"] else math.inf for r in runs]
    return {
        "median_seconds": float(statistics.median(seconds)),
        "median_steps": float(statistics.median(steps)),
        "reached": sum(r["reached"] is not None for r in runs),
        "runs": len(runs),
        "seconds_per_step": float(
            statistics.median(r["seconds"] / max(r["steps"], 1) for r in runs)
        ),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the JSON payload."""
    data = load_digits(seed=args.split_seed)
    specs, skipped = split_available(build_specs(args, DEFAULT_KFAC, TASK_OPTIONS))
    common = {
        "batch_size": args.batch_size,
        "target": args.target,
        "max_steps": args.max_steps,
        "max_seconds": args.max_seconds,
        "momentum": args.momentum,
    }

    def train(spec: OptimizerSpec, lr: float, seed: int, sweeping: bool) -> dict[str, Any]:
        return train_to_target(spec, lr, seed, data, **common)

    runs = sweep_then_seeds(
        specs,
        train,
        _score,
        sweep_seed=args.sweep_seed,
        seeds=args.seeds,
        no_sweep=args.no_sweep,
        first_seed=args.first_seed,
        sweep_seeds=args.sweep_seeds,
    )
    summary = {name: {"lr": runs.chosen[name], **summarise(r)} for name, r in runs.seeded.items()}
    add_time_ratios(summary)
    return {
        "benchmark": "tta",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "sweep": {name: [_strip(r) for r in sweep] for name, sweep in runs.sweep.items()},
        "runs": runs.seeded,
        "summary": summary,
    }


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    """A sweep run without its per-step traces (kept small in the JSON)."""
    return {k: v for k, v in run.items() if k not in ("trace", "loss_trace")}


def plot(payload: dict[str, Any], path: str) -> None:
    """Test accuracy and loss against training seconds, accuracy against steps: every seed
    of every optimizer on one figure, one colour per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l, ax_s) = plt.subplots(1, 3, figsize=(16, 4.5))
    lrs = {name: entry["lr"] for name, entry in payload["summary"].items()}
    plot_runs(ax_t, payload["runs"], "trace", 1, 2, lrs)
    plot_runs(ax_l, payload["runs"], "loss_trace", 1, 2, lrs)
    plot_runs(ax_s, payload["runs"], "trace", 0, 2, lrs)
    target = payload["settings"]["target"]
    for ax, xlabel in ((ax_t, "training seconds"), (ax_s, "steps")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.8, 1.0)
    ax_l.set_xlabel("training seconds")
    ax_l.set_ylabel("test cross-entropy")
    ax_l.set_yscale("log")
    for ax in (ax_t, ax_l, ax_s):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    seeds = payload["settings"]["seeds"]
    fig.suptitle(f"digits SmallCNN, batch {payload['settings']['batch_size']} ({seeds} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench tta`` flags."""
    p.add_argument("--batch-size", type=int, default=700)
    p.add_argument("--target", type=float, default=0.975)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--max-seconds", type=float, default=40.0)
    p.add_argument("--momentum", type=float, default=0.9, help="of SGD and K-FAC's SGD")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split")
    add_peer_arguments(p, GRIDS)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--name", default="tta_digits")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the accuracy/loss-vs-time plot")


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    target = None if 0 < args.target <= 1 else f"--target must be in (0, 1], got {args.target}"
    check_peer_flags(
        p,
        args,
        positive=("batch_size", "max_steps", "seeds", "max_seconds"),
        problems=(target, digits_batch_problem(args.batch_size, args.split_seed)),
        default_kfac=DEFAULT_KFAC,
        task_options=TASK_OPTIONS,
        model=task_model,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench tta``."""
    parser = BenchParser(prog="dkfac bench tta", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    _validate(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    payload = run(args)
    write_result(args.name, payload, args.out_dir, command_line("dkfac bench tta", argv))
    if args.plot:
        plot(payload, args.plot)
    rows = [
        [
            name,
            e["lr"],
            f"{e['reached']}/{e['runs']}",
            e["median_steps"],
            e["median_seconds"],
            e["seconds_per_step"],
            "-" if e["time_vs_sgd"] is None else e["time_vs_sgd"],
            "-" if e["time_vs_fastest"] is None else e["time_vs_fastest"],
        ]
        for name, e in payload["summary"].items()
    ]
    print(f"target test accuracy {args.target}, batch {args.batch_size}, median over seeds")
    headers = ["optimizer", "lr", "reached", "steps", "seconds", "s/step", "× SGD", "× fastest"]
    print(format_table(headers, rows))
    for name, reason in payload["skipped"].items():
        print(f"{name}: skipped ({reason})")
    return 0
