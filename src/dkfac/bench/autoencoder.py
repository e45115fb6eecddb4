"""``dkfac bench autoencoder``: training loss against time, digits deep autoencoder.

The Hinton–Salakhutdinov autoencoder (``build_model("autoencoder")``: 64-1000-500-250-30 and
mirrored) reconstructs the 8×8 digits (pixels in [0, 1]) under a mean squared error, for SGD,
Adam and K-FAC, each for the same wall-clock budget, interleaved over seeds. The training
loss over the whole training set is measured every ``--eval-every`` steps outside the clock.
The headline figure is the time K-FAC needs to reach SGD's final training loss (that of the
worst SGD seed, which every SGD run reaches within its budget), against SGD's whole budget.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.data import batches, load_digits
from dkfac.app.models import build_model
from dkfac.bench.common import (
    command_line,
    first_reaching,
    format_table,
    machine_info,
    parse_options,
    write_result,
)
from dkfac.bench.tta import OptimizerSpec, make_optimizer

# The best configuration measured (BENCHMARKS.md §3, update 2): MC Fisher, statistics from
# half of each 512-sample batch, factors every 5 steps and inverses every 10.
DEFAULT_KFAC = (
    "kfac:method=cholesky,fisher=mc,factor_update_interval=5,inverse_update_interval=10,"
    "damping=0.003,kl_clip=0.01,factor_batch_size=256"
)


def full_loss(model: nn.Module, x: Tensor) -> float:
    """Mean squared reconstruction error over ``x`` (no gradients)."""
    with torch.no_grad():
        return float(F.mse_loss(model(x), x.flatten(1)).item())


def train_for(
    spec: OptimizerSpec,
    lr: float,
    seed: int,
    x: Tensor,
    *,
    batch_size: int,
    seconds: float,
    eval_every: int,
    momentum: float,
) -> dict[str, Any]:
    """Trains for ``seconds`` of training time; returns the loss trace.

    Returns:
        ``{"lr", "seed", "trace": [[step, seconds, train_loss], ...], "steps", "final_loss"}``.
    """
    torch.manual_seed(seed)
    model = build_model("autoencoder", in_channels=1, image_size=8, num_classes=0)
    optimizer = make_optimizer(spec, model, lr, momentum)
    mc_fisher = spec.kind == "kfac" and spec.options.get("fisher") == "mc"
    gen = torch.Generator().manual_seed(seed)
    trace = [(0, 0.0, full_loss(model, x))]
    elapsed, step = 0.0, 0
    while elapsed < seconds:
        for xb, _ in batches(x, x, batch_size, shuffle=True, generator=gen, drop_last=True):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            output = model(xb)
            if mc_fisher:  # G from sampled targets: the Gauss-Newton of the squared error
                optimizer.preconditioner.sample_fisher(output, "mse")  # type: ignore[attr-defined]
            F.mse_loss(output, xb.flatten(1)).backward()
            optimizer.step()
            elapsed += time.perf_counter() - start
            step += 1
            if step % eval_every == 0 or elapsed >= seconds:
                trace.append((step, elapsed, full_loss(model, x)))
            if elapsed >= seconds:
                break
    return {
        "lr": lr,
        "seed": seed,
        "trace": [list(t) for t in trace],
        "steps": step,
        "final_loss": trace[-1][2],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the JSON payload."""
    x = load_digits(seed=0, normalize=False).x_train
    name, _, opts = (args.kfac or DEFAULT_KFAC).partition(":")
    specs = [
        OptimizerSpec("sgd", "sgd", [args.sgd_lr]),
        OptimizerSpec("adam", "adam", [args.adam_lr]),
        OptimizerSpec(name, "kfac", [args.kfac_lr], parse_options(opts)),
    ]
    common = {
        "batch_size": args.batch_size,
        "seconds": args.seconds,
        "eval_every": args.eval_every,
        "momentum": args.momentum,
    }
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    for seed in range(args.seeds):
        for s in specs:
            options = dict(common)
            if s.kind == "kfac" and args.kfac_momentum is not None:
                options["momentum"] = args.kfac_momentum
            runs[s.name].append(train_for(s, s.lrs[0], seed, x, **options))
    # The worst SGD seed's final loss: every SGD run reaches it within the budget.
    sgd_final = max(r["final_loss"] for r in runs["sgd"])
    summary: dict[str, Any] = {}
    for s in specs:
        hits = [first_reaching(r["trace"], sgd_final, higher_is_better=False) for r in runs[s.name]]
        secs = [h[1] if h is not None else float("inf") for h in hits]
        summary[s.name] = {
            "lr": s.lrs[0],
            "median_final_loss": statistics.median(r["final_loss"] for r in runs[s.name]),
            "median_seconds_to_sgd_final": statistics.median(secs),
            "time_vs_sgd_budget": statistics.median(secs) / args.seconds,
            "median_steps": statistics.median(r["steps"] for r in runs[s.name]),
        }
    return {
        "benchmark": "autoencoder",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "specs": [vars(s) for s in specs]},
        "sgd_final_loss": sgd_final,
        "runs": runs,
        "summary": summary,
    }


def plot(payload: dict[str, Any], path: str) -> None:
    """Training loss against seconds (every seed), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colors = dict(zip(payload["runs"], ("C0", "C1", "C2", "C3"), strict=False))
    for name, runs in payload["runs"].items():
        for i, r in enumerate(runs):
            ax.plot(
                [t[1] for t in r["trace"]],
                [t[2] for t in r["trace"]],
                color=colors[name],
                alpha=0.8,
                label=name if i == 0 else None,
            )
    ax.axhline(payload["sgd_final_loss"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("training MSE")
    ax.set_title("digits deep autoencoder")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench autoencoder``."""
    p = argparse.ArgumentParser(prog="dkfac bench autoencoder", description=__doc__)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seconds", type=float, default=40.0, help="training budget per run")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--kfac-momentum",
        type=float,
        default=0.0,
        help="momentum of the SGD inside K-FAC (default 0: the KL-clip sets the step)",
    )
    # Learning rates: the best found in BENCHMARKS.md §3 (the recorded 8 s sweep for Adam,
    # by-hand runs, not recorded as JSON, for SGD 0.5 and K-FAC 1.0).
    p.add_argument("--sgd-lr", type=float, default=0.5)
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--kfac-lr", type=float, default=1.0)
    p.add_argument("--kfac", default=None, help="NAME:key=value,... preconditioner options")
    p.add_argument("--name", default="autoencoder_digits")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.seconds <= 0 or args.eval_every < 1 or args.seeds < 1:
        p.error("--batch-size, --seconds, --eval-every and --seeds must be positive")
    if min(args.sgd_lr, args.adam_lr, args.kfac_lr) <= 0:
        p.error("learning rates must be > 0")
    for flag, value in (("--momentum", args.momentum), ("--kfac-momentum", args.kfac_momentum)):
        if value is not None and not 0 <= value < 1:
            p.error(f"{flag} must be in [0, 1), got {value}")
    if args.threads:
        torch.set_num_threads(args.threads)
    payload = run(args)
    write_result(args.name, payload, args.out_dir, command_line("dkfac bench autoencoder", argv))
    if args.plot:
        plot(payload, args.plot)
    print(f"SGD final training loss (worst seed): {payload['sgd_final_loss']:.4g}")
    rows = [
        [
            name,
            e["lr"],
            e["median_steps"],
            e["median_final_loss"],
            e["median_seconds_to_sgd_final"],
            e["time_vs_sgd_budget"],
        ]
        for name, e in payload["summary"].items()
    ]
    headers = ["optimizer", "lr", "steps", "final loss", "s to SGD final", "× SGD time"]
    print(format_table(headers, rows))
    return 0
