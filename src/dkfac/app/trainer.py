"""The training loop behind ``dkfac train`` and ``dkfac compare``.

:func:`train` runs one training from parsed arguments. It works on one process or inside an
already initialised ``torch.distributed`` group (``torchrun`` through :func:`run_command`, or a
test harness): each rank visits its ``DistributedSampler``-style shard of every epoch,
``--batch-size`` is the global batch of one optimizer step, the model is wrapped in DDP
(except for the ``spngd`` strategy, which reduces gradients itself), metrics are averaged
over ranks and only rank 0 writes files or prints.

Randomness that the loop draws (crop/flip offsets, mixup) comes from generators seeded by
``(seed, rank, step)``, so a run resumed from a checkpoint sees the same batches and
augmentations as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app import report
from dkfac.app.checkpoint import LATEST, CheckpointError, load_checkpoint, resolve_resume
from dkfac.app.checkpoint import rng_state, save_checkpoint, set_rng_state
from dkfac.app.data import DataError, Splits, load_dataset, random_crop_flip, shard_indices
from dkfac.app.models import build_model
from dkfac.app.runconfig import kfac_config_from_args, write_resolved_config
from dkfac.app.schedules import make_lr_lambda
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(ValueError):
    """Options that cannot work together, found once the data and world size are known."""


@dataclasses.dataclass
class RunResult:
    """What :func:`train` returns (on every rank).

    Attributes:
        folder: The run folder (``None`` on ranks other than 0 and for quiet runs).
        records: The metric records (every rank keeps them; values are rank averages).
        final: The last evaluation record.
        model: The trained model (unwrapped from DDP).
        steps: Optimizer steps taken in total.
    """

    folder: Path | None
    records: list[report.Record]
    final: report.Record
    model: nn.Module
    steps: int


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums numbers over ranks (identity on one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if _world()[1] > 1:
        dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def _step_generator(seed: int, rank: int, step: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu")
    gen.manual_seed((seed * 1_000_003 + rank * 7_919 + step) % (2**63))
    return gen


@dataclasses.dataclass
class _Run:
    """Everything the loop needs, built once by :func:`_setup`."""

    args: argparse.Namespace
    data: Splits
    model: nn.Module  # maybe DDP-wrapped
    bare: nn.Module
    optimizer: torch.optim.Optimizer
    preconditioner: KFACPreconditioner | None
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: Any
    device: torch.device
    rank: int
    world: int
    micro_batch: int
    steps_per_epoch: int
    total_steps: int
    reconstruct: bool


def _setup(args: argparse.Namespace, device: torch.device) -> _Run:
    rank, world = _world()
    torch.manual_seed(args.seed)
    try:
        data = load_dataset(args.data, args.data_dir, seed=args.seed,
                            num_samples=args.synthetic_samples, in_channels=args.in_channels,
                            image_size=args.image_size, num_classes=args.num_classes)  # fmt: skip
    except DataError as err:
        raise UsageError(str(err)) from None
    per_rank, rest = divmod(args.batch_size, world * args.accumulation_steps)
    if per_rank < 1 or rest:
        raise UsageError(
            f"--batch-size {args.batch_size} must be a multiple of world size ({world}) x "
            f"--accumulation-steps ({args.accumulation_steps})"
        )
    shard = len(shard_indices(len(data.y_train), rank, world, shuffle=False))
    steps_per_epoch = shard // (per_rank * args.accumulation_steps)
    if steps_per_epoch < 1:
        raise UsageError(f"--batch-size {args.batch_size} exceeds the {len(data.y_train)} "
                         f"training samples of {args.data}")  # fmt: skip
    total = args.epochs * steps_per_epoch
    total = total if args.steps is None else min(total, args.steps)
    if args.amp == "fp16" and device.type != "cuda":
        raise UsageError("--amp fp16 needs a CUDA device (use --amp bf16 on CPU)")
    bare = build_model(args.model, in_channels=data.in_channels, image_size=data.image_size,
                       num_classes=data.num_classes).to(device)  # fmt: skip
    model: nn.Module = bare
    if world > 1 and getattr(args, "strategy", None) != "spngd":
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(bare, device_ids=ids)
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    opt: torch.optim.Optimizer
    if args.optimizer in ("sgd", "kfac"):
        opt = torch.optim.SGD(bare.parameters(), lr=args.lr, momentum=args.momentum,
                              nesterov=args.nesterov, weight_decay=args.weight_decay)  # fmt: skip
    else:
        kind = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
        opt = kind(bare.parameters(), lr=args.lr, betas=(args.momentum, 0.999),
                   weight_decay=args.weight_decay)  # fmt: skip
    lam = make_lr_lambda(schedule=args.schedule, steps_per_epoch=steps_per_epoch,
                         total_steps=total, warmup_epochs=args.warmup_epochs,
                         milestones=args.milestones, gamma=args.gamma, power=args.power)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    pre = None
    if args.optimizer.startswith("kfac"):
        config = kfac_config_from_args(args, steps_per_epoch)
        pre = KFACPreconditioner(model, config=config, grad_scaler=scaler)
        opt = KFACOptimizer(opt, pre)
    return _Run(args, data, model, bare, opt, pre, scheduler, scaler, device, rank, world,
                per_rank, steps_per_epoch, total, args.model == "autoencoder")  # fmt: skip


def _loss(run: _Run, out: Tensor, x: Tensor, y: Tensor, y2: Tensor | None, lam: float) -> Tensor:
    out = out.float()
    if run.reconstruct:
        return 0.5 * (out - x.flatten(1).float()).pow(2).sum(1).mean()
    smooth = run.args.label_smoothing
    loss = F.cross_entropy(out, y, label_smoothing=smooth)
    if y2 is not None:
        loss = lam * loss + (1 - lam) * F.cross_entropy(out, y2, label_smoothing=smooth)
    return loss


def _autocast(run: _Run) -> Any:
    dtype = AMP_DTYPES.get(run.args.amp)
    return torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None)


def _train_step(run: _Run, indices: list[int], step: int) -> tuple[list[float], float, float]:
    """One optimizer step over this rank's ``indices``; returns sums, fwd/bwd and opt seconds."""
    args, k = run.args, args_accum(run.args)
    gen = _step_generator(args.seed, run.rank, step, run.device)
    mix = random.Random(args.seed * 1_000_003 + run.rank * 7_919 + step)
    sums = [0.0, 0.0, 0.0]  # loss x samples, correct, samples
    t0 = time.perf_counter()
    for i in range(k):
        idx = torch.tensor(indices[i * run.micro_batch : (i + 1) * run.micro_batch])
        x = run.data.x_train[idx].to(run.device, non_blocking=True)
        y = run.data.y_train[idx].to(run.device, non_blocking=True)
        if args.augment == "on" or (args.augment == "auto" and args.data.startswith("cifar")):
            x = random_crop_flip(x, generator=gen)
        y2, lam = None, 1.0
        if args.mixup > 0:
            lam = mix.betavariate(args.mixup, args.mixup)
            perm = torch.randperm(len(y), generator=gen, device=gen.device).to(run.device)
            x, y2 = lam * x + (1 - lam) * x[perm], y[perm]
        sync = i == k - 1 or not isinstance(run.model, nn.parallel.DistributedDataParallel)
        ctx = run.model.no_sync() if not sync else _null()  # type: ignore[operator]
        with ctx:
            with _autocast(run):
                out = run.model(x)
            loss = _loss(run, out, x, y, y2, lam)
            pre = run.preconditioner
            if pre is not None and pre.config.fisher == "mc":
                pre.sample_fisher(out.float(), "mse" if run.reconstruct else "cross_entropy")
            scaled = loss / k
            (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
        n = len(y)
        sums[0] += float(loss.detach()) * n
        sums[2] += n
        if not run.reconstruct:
            sums[1] += float((out.detach().argmax(1) == y).sum())
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    t1 = time.perf_counter()
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return sums, t1 - t0, time.perf_counter() - t1


def args_accum(args: argparse.Namespace) -> int:
    """Micro-batches per optimizer step."""
    return int(args.accumulation_steps)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@torch.no_grad()
def evaluate(run: _Run) -> tuple[float, float | None]:
    """Test loss and accuracy, each rank on its slice of the test set, summed over ranks."""
    run.bare.eval()
    x_all, y_all = run.data.x_test, run.data.y_test
    mine = torch.arange(run.rank, len(y_all), run.world)
    sums = [0.0, 0.0, 0.0]
    for start in range(0, len(mine), 512):
        idx = mine[start : start + 512]
        x, y = x_all[idx].to(run.device), y_all[idx].to(run.device)
        with _autocast(run):
            out = run.bare(x)
        sums[0] += float(_loss(run, out, x, y, None, 1.0)) * len(y)
        sums[1] += float((out.argmax(1) == y).sum()) if not run.reconstruct else 0.0
        sums[2] += len(y)
    run.bare.train()
    loss, correct, count = _all_sum(sums, run.device)
    return loss / max(count, 1), None if run.reconstruct else correct / max(count, 1)


def _checkpoint_state(run: _Run, position: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": run.bare.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": None if run.scaler is None else run.scaler.state_dict(),
        "rng": rng_state(),
        "position": position,
    }


def _restore(run: _Run, path: Path) -> dict[str, Any]:
    state = load_checkpoint(path)
    try:
        run.bare.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        if run.scaler is not None and state.get("scaler") is not None:
            run.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        position: dict[str, Any] = dict(state["position"])
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} does not match this run: {err}") from None
    return position


def _run_folder(args: argparse.Namespace, rank: int, world: int) -> Path:
    name = args.out or f"runs/{datetime.now():%Y%m%d-%H%M%S}"
    if world > 1:  # every rank uses rank 0's folder name
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return Path(name)


def train(args: argparse.Namespace, *, write: bool = True, label: str = "") -> RunResult:
    """Trains as ``args`` (a namespace from :func:`dkfac.app.cli.parse_args`) says.

    Args:
        args: The parsed options.
        write: Write the run folder (rank 0 only); tests may switch it off.
        label: Prefix of progress lines (the optimizer name in ``compare``).

    Raises:
        UsageError: For options that do not fit the data or the world size.
        CheckpointError: For a checkpoint that cannot be resumed.
    """
    args = copy.copy(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = _setup(args, device)
    rank, world = run.rank, run.world
    folder = _run_folder(args, rank, world)
    args.out = str(folder)
    main = rank == 0 and write
    resume = resolve_resume(args.resume, folder)
    pos = {"epoch": 0, "step_in_epoch": 0, "step": 0, "train_seconds": 0.0, "wall_seconds": 0.0}
    if resume is not None:
        pos.update(_restore(run, resume))
    if main:
        write_resolved_config(args, folder)
    writer = report.MetricsWriter(folder / "metrics.jsonl" if main else None,
                                  keep_until_step=pos["step"] if resume else None)  # fmt: skip
    progress = report.Progress(run.total_steps, int(pos["step"]), enabled=rank == 0)
    wall0 = time.perf_counter() - float(pos["wall_seconds"])
    step, train_s = int(pos["step"]), float(pos["train_seconds"])
    window = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # loss*n, correct, n, t_fb, t_opt, steps
    hit = report.target_reached(writer.records, args.target_accuracy)
    epoch, first = int(pos["epoch"]), int(pos["step_in_epoch"])

    def record(kind: str, loss: float, acc: float | None, **extra: Any) -> report.Record:
        rec = {"kind": kind, "step": step, "epoch": step / run.steps_per_epoch, "loss": loss,
               "accuracy": acc, "lr": float(run.optimizer.param_groups[0]["lr"]),
               "wall_seconds": time.perf_counter() - wall0, "train_seconds": train_s, **extra}  # fmt: skip
        writer.write(rec)
        return rec

    def do_eval() -> bool:
        nonlocal hit
        loss, acc = evaluate(run)
        rec = record("eval", loss, acc)
        progress.update(0, rec)
        if hit is None and (reached := report.target_reached([rec], args.target_accuracy)):
            hit = reached
            progress.log(f"{label}target accuracy {args.target_accuracy} reached at step "
                         f"{step} after {train_s:.1f} s of training")  # fmt: skip
        return hit is not None and args.stop_at_target

    def checkpoint(next_epoch: int, next_in_epoch: int) -> None:
        position = {"epoch": next_epoch, "step_in_epoch": next_in_epoch, "step": step,
                    "train_seconds": train_s, "wall_seconds": time.perf_counter() - wall0}  # fmt: skip
        if main:
            save_checkpoint(_checkpoint_state(run, position), folder / LATEST)
        if world > 1:
            dist.barrier()

    per_step = run.micro_batch * args_accum(args)
    stop = step >= run.total_steps
    while not stop and epoch < args.epochs:
        order = shard_indices(len(run.data.y_train), rank, world, epoch, seed=args.seed)
        for k in range(first, run.steps_per_epoch):
            sums, t_fb, t_opt = _train_step(run, order[k * per_step : (k + 1) * per_step], step)
            step, train_s = step + 1, train_s + t_fb + t_opt
            for j, v in enumerate([*sums, t_fb, t_opt, 1.0]):
                window[j] += v
            end_of_epoch = k == run.steps_per_epoch - 1
            stop = step >= run.total_steps
            if step % args.log_every == 0 or stop or end_of_epoch:
                loss_n, correct, n = _all_sum(window[:3], device)
                rec = record("train", loss_n / n, None if run.reconstruct else correct / n,
                             time_forward_backward=window[3] / window[5],
                             time_optimizer=window[4] / window[5])  # fmt: skip
                progress.update(int(window[5]), rec)
                window = [0.0] * 6
            if (args.eval_every and step % args.eval_every == 0) or end_of_epoch or stop:
                stop = do_eval() or stop
            nxt = (epoch + 1, 0) if end_of_epoch else (epoch, k + 1)
            every_epochs = args.checkpoint_epochs and end_of_epoch and nxt[0] % args.checkpoint_epochs == 0
            if (args.checkpoint_every and step % args.checkpoint_every == 0) or every_epochs or stop:
                checkpoint(*nxt)
            if stop:
                break
        epoch, first = epoch + 1, 0
    progress.close()
    evals = [r for r in writer.records if r["kind"] == "eval"]
    final = evals[-1] if evals else record("eval", *evaluate(run))
    if main:
        report.plot_runs({args.optimizer: writer.records}, folder / "metrics.png",
                         f"{args.model} on {args.data}")  # fmt: skip
    if rank == 0:
        print(final_line(label, final, hit, args.target_accuracy, folder if main else None),
              flush=True)
    return RunResult(folder if main else None, writer.records, final, run.bare, step)


def final_line(label: str, final: report.Record, hit: report.Record | None,
               target: float | None, folder: Path | None) -> str:  # fmt: skip
    """The one-line summary printed at the end of a run."""
    acc = "" if final["accuracy"] is None else f"test accuracy {final['accuracy']:.4f}, "
    text = (f"{label}final: {acc}test loss {final['loss']:.4f}, {final['step']} steps, "
            f"{final['train_seconds']:.1f} s training")  # fmt: skip
    if target is not None:
        text += (f", target {target} reached at step {hit['step']} ({hit['train_seconds']:.1f} s)"
                 if hit else f", target {target} not reached")  # fmt: skip
    return text + (f"; run folder {folder}" if folder is not None else "")


def compare(args: argparse.Namespace) -> list[report.Record]:
    """Trains once per ``--optimizers`` entry on the same data and seed; writes the report."""
    rank, world = _world()
    folder = _run_folder(args, rank, world)
    runs: dict[str, list[report.Record]] = {}
    for name in args.optimizers.split(","):
        sub = copy.copy(args)
        sub.optimizer, sub.out = name, str(folder / name)
        if args.resume not in (None, "auto"):
            raise UsageError("dkfac compare takes --resume auto (or none), not a path")
        runs[name] = train(sub, label=f"[{name}] ").records
    rows: list[report.Record] = []
    if rank == 0:
        rows = report.write_comparison(runs, folder, args.target_accuracy,
                                       f"{args.model} on {args.data}")  # fmt: skip
        print(report.markdown_table(rows) + f"report: {folder}/compare.md, compare.png", flush=True)
    return rows


def run_command(args: argparse.Namespace) -> int:
    """Runs ``train`` or ``compare``, initialising the process group under ``torchrun``."""
    created = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.cuda.is_available() and args.device != "cpu"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        created = True
    entry: Callable[[argparse.Namespace], Any] = compare if args.command == "compare" else train
    try:
        entry(args)
    except (UsageError, CheckpointError) as err:
        print(f"dkfac {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if created:
            dist.destroy_process_group()
    return 0
