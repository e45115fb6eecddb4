"""The training loop behind ``dkfac train`` and ``dkfac compare``.

:func:`train` runs one training from parsed arguments. It works on one process or inside an
already initialised ``torch.distributed`` group (``torchrun`` through :func:`run_command`, or a
test harness): each rank visits its ``DistributedSampler``-style shard of every epoch,
``--batch-size`` is the global batch of one optimizer step, the model is wrapped in DDP
(except for the ``spngd`` strategy, which reduces gradients itself), metrics are averaged
over ranks and only rank 0 writes files or prints.

Checkpoints: the state is gathered on every rank (the K-FAC state dict is a collective that
collects each layer's factors from its owner, so it loads at any world size) and rank 0
writes it, keeping the previous one. A sharded run (``--parallel fsdp``/``hsdp``) writes a
``torch.distributed.checkpoint`` folder instead, every rank its own shards
(:mod:`dkfac.app.sharded_checkpoint`). ``--resume auto`` is decided on rank 0 (the newest
checkpoint that verifies) and broadcast. The data position is the global step within the
epoch: rank ``r`` of ``P`` takes every ``P``-th sample of the epoch's shared permutation, so
global batch ``k`` holds the same samples at any world size and a run resumed on a different
number of ranks continues with the next global batch (if the new world size gives the epoch
fewer full batches, it moves on to the next epoch).

:func:`run_command` returns the exit code: 0 for a run that trained, :data:`EXIT_USAGE` (2)
for input that cannot work (options, run folder, checkpoint), :data:`EXIT_DIVERGED` (3) for a
run that ended without training (:func:`~dkfac.app.report.diagnose` says why). Weights that
are not finite are never checkpointed, so the last good checkpoint survives a divergence.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dkfac.app import faults, report, session
from dkfac.app import resume as resume_state
from dkfac.app.beacon import Beacon
from dkfac.app.checkpoint import LATEST, CheckpointError, choose_resume, save_rotating
from dkfac.app.cli_checks import DEFAULT_LRS
from dkfac.app.data import shard_indices
from dkfac.app.devices import pick_device
from dkfac.app.runconfig import write_resolved_config
from dkfac.app.runfolder import (
    RunFolderError,
    check_run_folder,
    prepare_run_folder,
    remove_empty_folder,
)
from dkfac.app.session import UsageError
from dkfac.app.sharded_checkpoint import LATEST as SHARDED_LATEST
from dkfac.app.sharded_checkpoint import choose_sharded_resume, save_sharded

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_USAGE",
    "RunResult",
    "UsageError",
    "compare",
    "run_command",
    "train",
]

EXIT_USAGE = 2  # bad input: options, run folder, checkpoint
EXIT_DIVERGED = 3  # the run ended but did not train (report.diagnose)


@dataclasses.dataclass
class RunResult:
    """What :func:`train` returns (on every rank).

    Attributes:
        folder: The run folder (``None`` on ranks other than 0 and for quiet runs).
        records: The metric records (every rank keeps them; values are rank averages).
        final: The last evaluation record.
        model: The trained model (unwrapped from DDP).
        steps: Optimizer steps taken in total.
        problem: Why the run did not train (:func:`~dkfac.app.report.diagnose`), else ``None``.
    """

    folder: Path | None
    records: list[report.Record]
    final: report.Record
    model: nn.Module
    steps: int
    problem: str | None = None


def _on_rank0(decide: Callable[[], Any], world: int) -> Any:
    """Runs ``decide`` on rank 0 and gives every rank its result or its refusal.

    A :class:`UsageError`, :class:`RunFolderError` or :class:`CheckpointError` raised on rank
    0 is raised on every rank, so no rank goes on into a collective that the others left.
    """
    box: list[Any] = [None, None, None]
    if world == 1 or dist.get_rank() == 0:
        try:
            box[0] = decide()
        except (UsageError, RunFolderError, CheckpointError) as err:
            box[1], box[2] = type(err).__name__, str(err)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        kinds = {"UsageError": UsageError, "RunFolderError": RunFolderError}
        raise kinds.get(box[1], CheckpointError)(box[2])
    return box[0]


def _fresh_run_name(stamp: str) -> str:
    """``stamp``, or ``stamp-2``, ``stamp-3``, ... : the first that does not exist, so that
    runs started in the same second without ``--out`` each get a folder of their own."""
    name, count = stamp, 1
    while Path(name).exists():
        count += 1
        name = f"{stamp}-{count}"
    return name


def _run_folder(args: argparse.Namespace, world: int, write: bool) -> Path:
    """Rank 0's run folder (``--out`` or ``runs/<timestamp>``), created and checked when written."""

    def decide() -> str:
        name = args.out or _fresh_run_name(f"runs/{datetime.now():%Y%m%d-%H%M%S}")
        if write:
            overwrite = bool(getattr(args, "overwrite", False))
            prepare_run_folder(Path(name), resume=args.resume, overwrite=overwrite)
        return str(name)

    return Path(_on_rank0(decide, world))


def _agree_resume(resume: str | None, folder: Path, world: int, sharded: bool) -> Path | None:
    """Rank 0 picks the checkpoint (:func:`choose_resume`, or a checkpoint folder for a
    sharded run); every rank gets its choice."""
    choose = choose_sharded_resume if sharded else choose_resume
    choice = _on_rank0(lambda: choose(resume, folder), world)
    return None if choice is None else Path(choice)


def train(
    args: argparse.Namespace,
    *,
    write: bool = True,
    label: str = "",
    beacon: Beacon | None = None,
) -> RunResult:
    """Trains as ``args`` (a namespace from :func:`dkfac.app.cli.parse_args`) says.

    Args:
        args: The parsed options.
        write: Write the run folder (rank 0 only); tests may switch it off.
        label: Prefix of progress lines (the optimizer name in ``compare``).
        beacon: Where this rank's phases are announced (:mod:`dkfac.app.beacon`).

    Raises:
        UsageError: For options that do not fit the data or the world size.
        CheckpointError: For a checkpoint that cannot be resumed.
    """
    args = copy.copy(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = session.world_info()
    beacon = beacon or Beacon(None, rank, world)
    beacon.enter(f"{label}setup", 0)
    new_folder = args.out is None or not Path(args.out).exists()
    folder = _run_folder(args, world, write)
    args.out = str(folder)
    pos = {"epoch": 0, "step_in_epoch": 0, "step": 0, "train_seconds": 0.0, "wall_seconds": 0.0}
    try:
        run = session.build_session(args, device)
        resume = _agree_resume(args.resume, folder, run.world, run.sharded)
        if resume is not None:
            beacon.enter(f"{label}resume from {resume.name}", 0)
            pos.update(resume_state.restore(run, resume))
    except (UsageError, CheckpointError):
        if new_folder and write and rank == 0:  # a run that never started leaves no folder
            remove_empty_folder(folder)
        raise
    rank, world = run.rank, run.world
    main = rank == 0 and write
    # Rotate the folder's latest checkpoint into the backup only once it is known good: after
    # a fallback to the backup (latest damaged or missing) the first save replaces it.
    latest = folder / (SHARDED_LATEST if run.sharded else LATEST)
    latest_good = resume is not None and resume.resolve() == latest.resolve()
    if main:
        write_resolved_config(args, folder)
    writer = report.MetricsWriter(
        folder / "metrics.jsonl" if main else None,
        keep_until_step=int(pos["step"]) if resume else None,
    )
    progress = report.Progress(run.total_steps, int(pos["step"]), enabled=rank == 0)
    wall0 = time.perf_counter() - float(pos["wall_seconds"])
    step, train_s = int(pos["step"]), float(pos["train_seconds"])
    window = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # loss*n, correct, n, t_fb, t_opt, steps
    hit = report.target_reached(writer.records, args.target_accuracy)
    epoch, first = int(pos["epoch"]), int(pos["step_in_epoch"])
    if first >= run.steps_per_epoch:  # resumed on a world size with fewer batches per epoch
        epoch, first = epoch + 1, 0

    def record(kind: str, loss: float, acc: float | None, **extra: Any) -> report.Record:
        rec = {
            "kind": kind,
            "step": step,
            "epoch": step / run.steps_per_epoch,
            "loss": loss,
            "accuracy": acc,
            "lr": float(run.optimizer.param_groups[0]["lr"]),
            "wall_seconds": time.perf_counter() - wall0,
            "train_seconds": train_s,
            **extra,
        }
        if run.data.name == "text":  # byte-level: the loss is in nats per byte
            rec["bits_per_byte"] = report.bits_per_byte(loss)
        writer.write(rec)
        return rec

    def do_eval() -> bool:
        nonlocal hit
        beacon.enter(f"{label}evaluation after step {step}", step)
        loss, acc = session.evaluate(run)
        rec = record("eval", loss, acc)
        progress.update(0, rec)
        if hit is None and (reached := report.target_reached([rec], args.target_accuracy)):
            hit = reached
            progress.log(
                f"{label}target accuracy {args.target_accuracy} reached at step "
                f"{step} after {train_s:.1f} s of training"
            )
        return hit is not None and args.stop_at_target

    def checkpoint(next_epoch: int, next_in_epoch: int) -> None:
        nonlocal latest_good
        position = {
            "epoch": next_epoch,
            "step_in_epoch": next_in_epoch,
            "step": step,
            "train_seconds": train_s,
            "wall_seconds": time.perf_counter() - wall0,
        }
        if not write:
            return
        beacon.enter(f"{label}checkpoint after step {step}", step)
        if not session.weights_finite(run):  # keep the last good checkpoint
            progress.log(f"{label}step {step}: the weights are not finite; checkpoint not written")
            return
        if run.sharded:  # every rank writes its shards
            extras = resume_state.checkpoint_extras(run, position)
            save_sharded(run.bare, run.optimizer, extras, folder, rotate=latest_good)
        else:
            state = resume_state.checkpoint_state(run, position)  # a collective: every rank
            if main:
                save_rotating(state, folder, rotate=latest_good)
        latest_good = True
        if world > 1:
            dist.barrier()

    per_step = run.micro_batch * int(args.accumulation_steps)
    stop = step >= run.total_steps
    while not stop and epoch < args.epochs:
        order = shard_indices(len(run.data.y_train), rank, world, epoch, seed=args.seed)
        for k in range(first, run.steps_per_epoch):
            batch = order[k * per_step : (k + 1) * per_step]
            beacon.enter(f"{label}training step {step + 1}", step + 1)
            sums, t_fb, t_opt = session.train_step(run, batch, step)
            step, train_s = step + 1, train_s + t_fb + t_opt
            faults.maybe_inject(step, rank)
            for j, v in enumerate([*sums, t_fb, t_opt, 1.0]):
                window[j] += v
            end_of_epoch = k == run.steps_per_epoch - 1
            stop = step >= run.total_steps
            if step % args.log_every == 0 or stop or end_of_epoch:
                beacon.enter(f"{label}metrics after step {step}", step)
                loss_n, correct, n = session.all_sum(window[:3], device)
                rec = record(
                    "train",
                    loss_n / n,
                    None if run.reconstruct else correct / n,
                    time_forward_backward=window[3] / window[5],
                    time_optimizer=window[4] / window[5],
                )
                progress.update(int(window[5]), rec)
                window = [0.0] * 6
            if (args.eval_every and step % args.eval_every == 0) or end_of_epoch or stop:
                stop = do_eval() or stop
            nxt = (epoch + 1, 0) if end_of_epoch else (epoch, k + 1)
            every_epochs = (
                args.checkpoint_epochs and end_of_epoch and nxt[0] % args.checkpoint_epochs == 0
            )
            if (
                (args.checkpoint_every and step % args.checkpoint_every == 0)
                or every_epochs
                or stop
            ):
                checkpoint(*nxt)
            if stop:
                break
        epoch, first = epoch + 1, 0
    progress.close()
    evals = [r for r in writer.records if r["kind"] == "eval"]
    beacon.enter(f"{label}end of the run", step)
    final = evals[-1] if evals else record("eval", *session.evaluate(run))
    if main:
        report.plot_runs(
            {args.optimizer: writer.records}, folder / "metrics.png", f"{args.model} on {args.data}"
        )
    skipped = int(getattr(run.optimizer, "skipped_steps", 0))
    if rank == 0:
        shown = folder if main else None
        line = report.final_line(label, final, hit, args.target_accuracy, shown, skipped)
        print(line, flush=True)
    classes = None if run.reconstruct else run.data.num_classes
    problem = report.diagnose(writer.records, final, skipped, step, classes)
    return RunResult(folder if main else None, writer.records, final, run.bare, step, problem)


def optimizer_lr(args: argparse.Namespace, name: str) -> float:
    """The learning rate of optimizer ``name``: its ``--lrs`` entry, else ``--lr``, else its
    default (:data:`~dkfac.app.cli_checks.DEFAULT_LRS`)."""
    rates = dict(str(item).split("=", 1) for item in args.lrs)
    if name in rates:
        return float(rates[name])
    return float(DEFAULT_LRS[name] if args.lr is None else args.lr)


def compare(args: argparse.Namespace, beacon: Beacon | None = None) -> dict[str, RunResult]:
    """Trains once per ``--optimizers`` entry on the same data and seed; writes the report."""
    rank, world = session.world_info()
    names = args.optimizers.split(",")
    if args.out is not None:  # every optimizer's folder, before the first one trains
        overwrite = bool(getattr(args, "overwrite", False))

        def check() -> None:
            for name in names:
                check_run_folder(Path(args.out) / name, resume=args.resume, overwrite=overwrite)

        _on_rank0(check, world)
    folder = _run_folder(args, world, write=True)
    results: dict[str, RunResult] = {}
    for name in names:
        sub = copy.copy(args)
        sub.optimizer, sub.out = name, str(folder / name)
        sub.lr = optimizer_lr(args, name)
        results[name] = train(sub, label=f"[{name}] ", beacon=beacon)
    if rank == 0:
        runs = {name: result.records for name, result in results.items()}
        rows = report.write_comparison(
            runs, folder, args.target_accuracy, f"{args.model} on {args.data}"
        )
        print(report.markdown_table(rows) + f"report: {folder}/compare.md, compare.png", flush=True)
    return results


def _init_process_group(backend: str, timeout_s: float) -> dist.Store:
    """``init_process_group`` from torchrun's environment, with a store fresh to this attempt.

    After an elastic restart torchrun hands the new workers the same rendezvous store as the
    failed ones; the peer addresses the old workers left in it can be read before the new
    ones overwrite them, and the connection then fails. A key prefix per restart (as torch's
    launcher once did itself) keeps each attempt's keys apart.
    """
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"dkfac/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return store


def run_command(args: argparse.Namespace) -> int:
    """Runs ``train`` or ``compare``, initialising the process group under ``torchrun``."""
    created, store = False, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.cuda.is_available() and args.device != "cpu"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = _init_process_group("nccl" if cuda else "gloo", float(args.dist_timeout))
        created = True
    rank, world = session.world_info()
    beacon = Beacon(store, rank, world, stall_after_s=float(args.dist_timeout) / 2)
    try:
        if args.command == "compare":
            results = compare(args, beacon)
        else:
            results = {"": train(args, beacon=beacon)}
    except (UsageError, RunFolderError, CheckpointError) as err:
        print(f"dkfac {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        if world > 1:  # say where every rank was; torchrun prints the traceback
            first = str(err).splitlines()[0] if str(err) else ""
            print(
                f"dkfac {args.command}: rank {rank} failed in {beacon.where[0]} "
                f"({type(err).__name__}: {first[:300]}); {beacon.report()}",
                file=sys.stderr,
                flush=True,
            )
        raise
    finally:
        beacon.close()
        if created:
            dist.destroy_process_group()
    failed = [(name, r.problem) for name, r in results.items() if r.problem is not None]
    for name, problem in failed:
        if session.world_info()[0] == 0:
            label = f" [{name}]" if name else ""
            print(f"dkfac {args.command}: error:{label} {problem}", file=sys.stderr)
    return EXIT_DIVERGED if failed else 0
