"""``dkfac bench tta``: training time and steps to a target test accuracy on digits.

SmallCNN (``build_model("cnn")``) on scikit-learn's digits at a large batch (default 700,
two steps per epoch), for SGD, Adam and K-FAC configurations. Procedure:

1. **Sweep** (recorded): every optimizer runs once per learning rate of its grid on the
   sweep seed; the lr with the least time to target (then the highest final accuracy) wins.
2. **Seeds**: every optimizer runs with its chosen lr on ``--seeds`` seeds, interleaved
   (seed-major, optimizers inner) so that machine noise hits all alike.

Only training steps are timed (forward, backward, preconditioning, update); the test
accuracy is measured after every step outside the clock. The split of the data is fixed
(seed 0); the training seed sets the initialisation and the shuffling.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.data import Splits, batches, load_digits
from dkfac.app.models import build_model
from dkfac.bench.common import (
    command_line,
    first_reaching,
    format_table,
    machine_info,
    parse_options,
    write_result,
)
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

logger = logging.getLogger(__name__)

DEFAULT_KFAC = (
    "kfac-chol:method=cholesky,factor_update_interval=5,inverse_update_interval=10,"
    "damping=0.03,kl_clip=0.01",
    "kfac-eigen:method=eigen,factor_update_interval=10,inverse_update_interval=20,"
    "damping=0.03,kl_clip=0.01",
)


@dataclass
class OptimizerSpec:
    """One optimizer under test: ``kind`` is sgd, adam or kfac (with preconditioner options)."""

    name: str
    kind: str
    lrs: list[float]
    options: dict[str, Any] = field(default_factory=dict)


def make_optimizer(
    spec: OptimizerSpec, model: nn.Module, lr: float, momentum: float
) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` over ``model`` at learning rate ``lr``."""
    if spec.kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if spec.kind == "sgd":
        return sgd
    if spec.kind == "kfac":
        return KFACOptimizer(sgd, KFACPreconditioner(model, lr=lr, **spec.options))
    raise ValueError(f"optimizer kind must be sgd, adam or kfac, got {spec.kind!r}")


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Fraction of ``x`` classified as ``y`` (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train(was_training)
    return float(acc)


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
        ``{"lr", "seed", "trace": [[step, seconds, test_acc], ...], "reached": [step, s] |
        None, "steps", "seconds", "final_acc", "diverged"}``.
    """
    torch.manual_seed(seed)
    model = build_model(
        "cnn", in_channels=data.in_channels, image_size=data.image_size, num_classes=10
    )
    optimizer = make_optimizer(spec, model, lr, momentum)
    gen = torch.Generator().manual_seed(seed)
    trace: list[tuple[int, float, float]] = []
    elapsed, step, diverged = 0.0, 0, False
    while step < max_steps and elapsed < max_seconds and not diverged:
        for xb, yb in batches(
            data.x_train, data.y_train, batch_size, shuffle=True, generator=gen, drop_last=True
        ):
            start = clock()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            elapsed += clock() - start
            step += 1
            acc = accuracy(model, data.x_test, data.y_test)
            trace.append((step, elapsed, acc))
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
    """Sets each entry's ``time_vs_sgd``: its median time over SGD's.

    ``None`` when SGD's median is not a finite positive time (SGD missed the target in most
    seeds): a ratio to an infinite time would read as 0, a win it does not measure.
    """
    base = summary.get("sgd", {}).get("median_seconds")
    valid = base is not None and math.isfinite(base) and base > 0
    for entry in summary.values():
        entry["time_vs_sgd"] = entry["median_seconds"] / base if valid else None


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


def build_specs(args: argparse.Namespace) -> list[OptimizerSpec]:
    """The optimizers of the run, from the command line."""
    specs = [
        OptimizerSpec("sgd", "sgd", list(args.sgd_lrs)),
        OptimizerSpec("adam", "adam", list(args.adam_lrs)),
    ]
    for text in args.kfac or DEFAULT_KFAC:
        name, _, opts = text.partition(":")
        specs.append(OptimizerSpec(name, "kfac", list(args.kfac_lrs), parse_options(opts)))
    only = set(args.only or [])
    return [s for s in specs if not only or s.name in only]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the JSON payload."""
    data = load_digits(seed=0)
    specs = build_specs(args)
    common = {
        "batch_size": args.batch_size,
        "target": args.target,
        "max_steps": args.max_steps,
        "max_seconds": args.max_seconds,
        "momentum": args.momentum,
    }
    sweep: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    if args.no_sweep:  # the first lr of each grid, e.g. a winner of an earlier recorded sweep
        specs = [OptimizerSpec(s.name, s.kind, s.lrs[:1], s.options) for s in specs]
    for i in range(0 if args.no_sweep else max(len(s.lrs) for s in specs)):
        for s in specs:
            if i < len(s.lrs):
                result = train_to_target(s, s.lrs[i], args.sweep_seed, data, **common)
                logger.info("sweep %s lr=%g: %s", s.name, s.lrs[i], result["reached"])
                sweep[s.name].append(result)
    chosen = {
        s.name: min(sweep[s.name], key=_score)["lr"] if sweep[s.name] else s.lrs[0] for s in specs
    }
    seeded: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    for seed in range(args.seeds):
        for s in specs:
            seeded[s.name].append(train_to_target(s, chosen[s.name], seed, data, **common))
    summary = {name: {"lr": chosen[name], **summarise(runs)} for name, runs in seeded.items()}
    add_time_ratios(summary)
    return {
        "benchmark": "tta",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "specs": [vars(s) for s in specs]},
        "sweep": {name: [_strip(r) for r in runs] for name, runs in sweep.items()},
        "runs": seeded,
        "summary": summary,
    }


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    """A sweep run without its per-step trace (kept small in the JSON)."""
    return {k: v for k, v in run.items() if k != "trace"}


def plot(payload: dict[str, Any], path: str) -> None:
    """Test accuracy against training seconds and steps, seed 0 of every optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    target = payload["settings"]["target"]
    for name, runs in payload["runs"].items():
        trace = runs[0]["trace"]
        lr = payload["summary"][name]["lr"]
        ax_t.plot([t[1] for t in trace], [t[2] for t in trace], label=f"{name} (lr {lr:g})")
        ax_s.plot([t[0] for t in trace], [t[2] for t in trace], label=name)
    for ax, xlabel in ((ax_t, "training seconds"), (ax_s, "steps")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.8, 1.0)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"digits SmallCNN, batch {payload['settings']['batch_size']} (seed 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench tta`` flags."""
    p.add_argument("--batch-size", type=int, default=700)
    p.add_argument("--target", type=float, default=0.975)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--max-seconds", type=float, default=40.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sweep-seed", type=int, default=100)
    p.add_argument("--sgd-lrs", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument("--adam-lrs", type=float, nargs="+", default=[0.001, 0.003, 0.01])
    p.add_argument("--kfac-lrs", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--kfac", action="append", help="NAME:key=value,... (repeatable)")
    p.add_argument("--only", nargs="+", help="run only these optimizer names")
    p.add_argument(
        "--no-sweep", action="store_true", help="skip the sweep: use the first lr of each grid"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--name", default="tta_digits")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the accuracy-vs-time plot")


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.max_steps < 1 or args.seeds < 1 or args.max_seconds <= 0:
        p.error("--batch-size, --max-steps, --seeds and --max-seconds must be positive")
    if not 0 < args.target <= 1:
        p.error(f"--target must be in (0, 1], got {args.target}")
    if any(lr <= 0 for lr in [*args.sgd_lrs, *args.adam_lrs, *args.kfac_lrs]):
        p.error("learning rates must be > 0")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench tta``."""
    parser = argparse.ArgumentParser(prog="dkfac bench tta", description=__doc__)
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
        ]
        for name, e in payload["summary"].items()
    ]
    print(f"target test accuracy {args.target}, batch {args.batch_size}, median over seeds")
    headers = ["optimizer", "lr", "reached", "steps", "seconds", "s/step", "time × SGD"]
    print(format_table(headers, rows))
    return 0
