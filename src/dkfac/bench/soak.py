"""Soak benchmark: thousands of K-FAC steps on 2 gloo ranks, resident memory sampled along.

``python -m dkfac.bench.soak [--steps 3000 --sample-every 50 ...]`` spawns ``--world-size``
processes (gloo on CPU), builds the training program's session on each (the same
:func:`dkfac.app.session.build_session` / :func:`~dkfac.app.session.train_step` as
``dkfac train``), and runs ``--steps`` optimizer steps over ``--data`` (the digits by
default), epoch after epoch. Every ``--checkpoint-every`` steps each rank gathers the full
checkpoint state (the collective K-FAC state dict) and rank 0 writes it (rotating), every
``--eval-every`` steps the test set is evaluated, so the long-lived paths of a real run are
exercised too.
``--method`` soaks one K-FAC method (eigen, cholesky, smw, auto).

Each rank samples its resident set size (``VmRSS`` of ``/proc/self/status``) every
``--sample-every`` steps. The result, written to
``benchmarks/results/soak-<data>-<N>ranks.json`` with a PNG plot, holds every sample and,
per rank, the growth from the end of the first 10% of the steps (after warm-up allocations)
to the end and the least-squares slope over that span (MiB per 1000 steps), plus how many
per-step records the communication ledger holds at the end (bounded by its window): a leak
shows as steady growth, a healthy run as a flat line. ``--steps 10000`` is the soak of
issue 20.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dkfac.app.data import DATASETS
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import RESULTS_DIR, machine_info
from dkfac.config import METHODS

DATA = tuple(name for name in DATASETS if not name.startswith("cifar"))
"""The data sets a soak run reads: ``dkfac train``'s, but for CIFAR, whose archive it has
no flag for."""


def rss_mib() -> float:
    """This process's resident set size in MiB, from ``/proc/self/status`` (0 if unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _train_argv(opts: argparse.Namespace, folder: str) -> list[str]:
    return [
        "train",
        *("--data", opts.data, "--model", opts.model, "--optimizer", "kfac"),
        *("--strategy", opts.strategy, "--batch-size", str(opts.batch_size)),
        *("--epochs", "100000", "--steps", str(opts.steps), "--schedule", "cosine"),
        *("--lr", str(opts.lr), "--damping", str(opts.damping), "--kl-clip", "0.01"),
        *("--inverse-update-interval", "10", "--device", "cpu", "--threads", "1"),
        *("--method", opts.method, "--out", folder),
    ]


def _train_problem(opts: argparse.Namespace) -> str | None:
    """What ``dkfac train`` refuses in the run the ranks would make of ``opts`` (a
    ``--strategy``, ``--lr``, ``--damping``, ``--model`` or ``--data`` it does not take),
    found before any rank starts (each rank's own refusal ended in a traceback)."""
    from dkfac.app.cli import parse_args

    stream = io.StringIO()
    try:
        with contextlib.redirect_stderr(stream):
            parse_args(_train_argv(opts, "soak-run"))
    except SystemExit:
        lines = stream.getvalue().strip().splitlines() or ["dkfac train refused it"]
        return lines[-1].partition("error: ")[2] or lines[-1]
    return None


def _worker(rank: int, opts: argparse.Namespace, port: int, folder: str, queue: Any) -> None:
    from dkfac.app import resume, session
    from dkfac.app.checkpoint import save_rotating
    from dkfac.app.cli import parse_args
    from dkfac.app.data import shard_indices

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.world_size
    )
    try:
        args = parse_args(_train_argv(opts, folder))
        run = session.build_session(args, torch.device("cpu"))
        per_step = run.micro_batch * int(args.accumulation_steps)
        samples: list[dict[str, float]] = []
        start = time.perf_counter()
        losses = [0.0, 0.0]
        for step in range(opts.steps):
            epoch, k = divmod(step, run.steps_per_epoch)
            if k == 0:
                order = shard_indices(len(run.data.y_train), rank, run.world, epoch, seed=0)
            sums, _, _ = session.train_step(run, order[k * per_step : (k + 1) * per_step], step)
            losses[0] += sums[0]
            losses[1] += sums[2]
            done = step + 1
            if opts.eval_every and done % opts.eval_every == 0:
                session.evaluate(run)
            if opts.checkpoint_every and done % opts.checkpoint_every == 0:
                state = resume.checkpoint_state(run, {"step": done})
                if rank == 0:
                    save_rotating(state, folder)
                del state
                dist.barrier()
            if done == 1 or done % opts.sample_every == 0 or done == opts.steps:
                samples.append(
                    {
                        "step": done,
                        "rss_mib": rss_mib(),
                        "seconds": time.perf_counter() - start,
                        "train_loss": losses[0] / max(losses[1], 1.0),
                    }
                )
                losses = [0.0, 0.0]
        _, accuracy = session.evaluate(run)
        assert run.preconditioner is not None
        ledger = run.preconditioner.comm.ledger  # bounded: at most ledger.window records
        mine = {"samples": samples, "ledger_records": ledger.records_held}
        gathered: list[Any] = [None] * run.world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            queue.put({"ranks": gathered, "test_accuracy": accuracy})
    finally:
        dist.destroy_process_group()


def slope_mib_per_1000_steps(samples: list[dict[str, float]]) -> float:
    """Least-squares slope of RSS against the step, in MiB per 1000 steps (0 for < 2 samples)."""
    if len(samples) < 2:
        return 0.0
    xs = [s["step"] for s in samples]
    ys = [s["rss_mib"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return 1000.0 * sxy / sxx if sxx else 0.0


def _growth(samples: list[dict[str, float]], steps: int) -> dict[str, float]:
    """RSS at the first sample at or after 10% of the steps, at the end, the change, the slope."""
    early = next(s for s in samples if s["step"] >= 0.1 * steps)
    end = samples[-1]
    later = [s["rss_mib"] for s in samples if s["step"] >= early["step"]]
    return {
        "slope_mib_per_1000_steps": slope_mib_per_1000_steps(
            [s for s in samples if s["step"] >= early["step"]]
        ),
        "rss_mib_at_10pct": early["rss_mib"],
        "rss_mib_at_end": end["rss_mib"],
        "growth_mib": end["rss_mib"] - early["rss_mib"],
        "growth_percent": 100.0 * (end["rss_mib"] - early["rss_mib"]) / early["rss_mib"],
        "max_mib_after_10pct": max(later),
        "step_at_10pct": early["step"],
    }


def _plot(per_rank: list[list[dict[str, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for rank, samples in enumerate(per_rank):
        steps = [s["step"] for s in samples]
        top.plot(steps, [s["rss_mib"] for s in samples], label=f"rank {rank}")
        bottom.plot(steps, [s["train_loss"] for s in samples], label=f"rank {rank}")
    top.set_ylabel("resident memory (MiB)")
    top.set_ylim(bottom=0)
    top.legend()
    top.set_title(title)
    bottom.set_ylabel("train loss (window mean)")
    bottom.set_xlabel("optimizer step")
    bottom.set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    summary = (__doc__ or "soak").split("\n")[0]
    p = BenchParser(prog="dkfac bench soak", description=summary)
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps (default: 3000)")
    p.add_argument("--sample-every", type=int, default=50, help="steps between RSS samples")
    p.add_argument("--checkpoint-every", type=int, default=500, help="0: never")
    p.add_argument("--eval-every", type=int, default=250, help="0: never")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default: 32)")
    p.add_argument("--model", default="mlp")
    p.add_argument(
        "--data",
        choices=DATA,
        default="digits",
        help="dkfac train's data sets but CIFAR (its archive needs --data-dir, which soak "
        "does not take)",
    )
    p.add_argument("--strategy", default="replicated")
    p.add_argument(
        "--method", choices=METHODS, default="eigen", help="K-FAC --method (default: eigen)"
    )
    p.add_argument("--lr", type=float, default=0.02, help="peak of a cosine schedule")
    p.add_argument("--damping", type=float, default=0.03)
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="folder of the JSON result")
    p.add_argument("--plot", default="benchmarks/soak.png", help="PNG path ('' for none)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the soak benchmark; returns 0 (2 for bad arguments, through argparse)."""
    parser = build_parser()
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("steps", "sample_every", "world_size", "batch_size"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    for name in ("checkpoint_every", "eval_every"):
        if getattr(opts, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(opts, name)}")
    if opts.batch_size % opts.world_size:  # each rank's refusal ended in a traceback
        parser.error(
            f"--batch-size {opts.batch_size} must be a multiple of --world-size "
            f"({opts.world_size}): every rank takes an equal share"
        )
    if problem := _train_problem(opts):
        parser.error(problem)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dkfac-soak-") as folder:
        mp.start_processes(
            _worker,
            args=(opts, _free_port(), folder, queue),
            nprocs=opts.world_size,
            start_method="spawn",
        )
        outcome = queue.get()
    per_rank: list[list[dict[str, float]]] = [r["samples"] for r in outcome["ranks"]]
    growth = [_growth(samples, opts.steps) for samples in per_rank]
    suffix = "" if opts.method == "eigen" else f"-{opts.method}"
    name = f"soak-{opts.data}-{opts.world_size}ranks{suffix}"
    payload = {
        "command": " ".join(["python -m dkfac.bench.soak", *(argv or sys.argv[1:])]),
        "machine": machine_info("cpu"),
        "config": vars(opts),
        "wall_seconds": time.perf_counter() - start,
        "test_accuracy": outcome["test_accuracy"],
        "growth_after_first_10pct": growth,
        "ledger_records_at_end": [r["ledger_records"] for r in outcome["ranks"]],
        "samples": per_rank,
    }
    out = Path(opts.out_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    if opts.plot:
        _plot(
            per_rank,
            Path(opts.plot),
            f"{opts.steps} K-FAC steps, {opts.model} on {opts.data}, {opts.world_size} gloo ranks",
        )
    for rank, g in enumerate(growth):
        print(
            f"rank {rank}: RSS {g['rss_mib_at_10pct']:.1f} MiB at step {g['step_at_10pct']} -> "
            f"{g['rss_mib_at_end']:.1f} MiB at step {opts.steps} "
            f"({g['growth_mib']:+.1f} MiB, {g['growth_percent']:+.2f}%; slope "
            f"{g['slope_mib_per_1000_steps']:+.2f} MiB per 1000 steps); "
            f"{outcome['ranks'][rank]['ledger_records']} ledger records held"
        )
    print(f"test accuracy {outcome['test_accuracy']:.4f}; wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
