"""``dkfac bench lm``: validation loss against time, a byte-level GPT language model.

The language-model task of ``dkfac train --model gpt --data text``: the decoder-only GPT of
:mod:`dkfac.app.gpt` (default 4 layers, width 128, 4 heads, context 128) on byte-level text
(:func:`dkfac.app.text.load_text`: by default the first 2,000,000 bytes of the Python
standard library's source, 10% of it held out for validation), loss the token-mean cross
entropy. AdamW, Muon (with AdamW at 0.003 for the embeddings, the head, the biases and the
LayerNorms, :func:`dkfac.bench.peers.muon_split`), SOAP (heavyball, optional) and K-FAC
variants run by default; SGD and Adam on request. The protocol is ``dkfac.bench.sweep``'s:
equal-size lr grids swept for ``--sweep-seconds`` each on ``--sweep-seed`` (the lowest final
validation loss wins), then ``--seconds`` runs on ``--seeds`` seeds interleaved.

Every run of one seed sees the same model initialisation and the same batches (training
windows drawn uniformly with replacement from a generator of that seed). Only training steps
are timed (forward, backward, preconditioning, update); every ``--eval-every`` steps, and
after the last, the validation loss (nats per byte; bits per byte = nats / ln 2) is measured
outside the clock on a fixed subset: ``--eval-batches`` x ``--batch-size`` non-overlapping
validation windows evenly spaced over the validation split, the same for every run.
``--device`` (default ``cpu``) holds the text, the models and the optimizers' state; on a GPU
each timed step starts and ends with a synchronisation, so that its seconds are the GPU's
work and not only the host's launches. The batches are drawn on the CPU (the same windows
on every device) and gathered on the device before the clock starts, as on the CPU.

Default grids (three learning rates each): SGD 0.1 0.3 1.0; Adam, AdamW, SOAP and K-FAC
0.001 0.003 0.01; Muon 0.02 0.05 0.1. Default K-FAC variants: ``kfac-adamw`` (K-FAC wrapping
AdamW: eigen, ``loss_average=positions``, damping 3, factors every 10 steps and the
eigenbasis every 100) and ``eigen-adam`` (Adam's moments in
K-FAC's eigenbasis, ``method=eigen_adam`` over SGD without momentum, ``loss_average=positions``,
damping 3).

Headline figures, medians over seeds: the final validation loss after the whole budget, and
the validation loss each optimizer has at a quarter, half and three quarters of it (the
latest evaluation at or before that time, so to within ``--eval-every`` steps).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.cifar import DataError
from dkfac.app.devices import device_error, pick_device
from dkfac.app.domains import domain_error
from dkfac.app.gpt import add_gpt_arguments, gpt_options, size_problem
from dkfac.app.models import build_model
from dkfac.app.pathnames import long_name
from dkfac.app.text import BYTE_VOCAB, DEFAULT_GLOB, DEFAULT_TEXT_BYTES, load_text
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    format_table,
    machine_info,
    synchronize,
    write_result,
)
from dkfac.bench.peers import OptimizerSpec, Stepper, build_optimizer
from dkfac.bench.sweep import (
    add_peer_arguments,
    build_specs,
    check_peer_flags,
    plot_loss_vs_time_and_steps,
    split_available,
    sweep_then_seeds,
    table_cell,
)

__all__ = ["GRIDS", "TextTask", "load_task", "main", "summarise", "train_for"]

DEFAULT_OPTIMIZERS = ("adamw", "muon", "soap", "kfac")
"""Kinds run unless ``--optimizers`` says otherwise."""

DEFAULT_KFAC = (
    "kfac-adamw:inner=adamw,method=eigen,loss_average=positions,damping=3,"
    "factor_update_interval=10,inverse_update_interval=100",
    "eigen-adam:method=eigen_adam,inner=sgd,inner_momentum=0,loss_average=positions,damping=3",
)

GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": (0.1, 0.3, 1.0),
    "adam": (1e-3, 3e-3, 1e-2),
    "adamw": (1e-3, 3e-3, 1e-2),
    "muon": (0.02, 0.05, 0.1),
    "soap": (1e-3, 3e-3, 1e-2),
    "kfac": (1e-3, 3e-3, 1e-2),
}
"""Default learning-rate grids, the same size for every kind."""

TASK_OPTIONS = {"muon": {"adamw_lr": 3e-3}}
"""Muon's AdamW part (embeddings, head, biases, LayerNorms) at AdamW's middle rate."""

FRACTIONS = (0.25, 0.5, 0.75)
"""Fractions of the budget at which the summary reads every run's validation loss."""

MODEL_DEFAULTS = {"layers": 4, "width": 128, "heads": 4, "seq_len": 128}


@dataclass(frozen=True)
class TextTask:
    """The data of a benchmark run: training windows and the fixed validation subset."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    seq_len: int
    model_options: dict[str, int]


def evenly_spaced(available: int, wanted: int) -> Tensor:
    """``min(available, wanted)`` distinct indices in ``[0, available)``, evenly spaced,
    the first and the last included."""
    count = min(available, wanted)
    return torch.linspace(0, available - 1, count).round().long()


def load_task(args: argparse.Namespace, device: torch.device | str = "cpu") -> TextTask:
    """The text of ``--text-path`` cut into windows, and the validation subset, on ``device``.

    Raises:
        DataError: For a missing path, no matching file or too little text.
    """
    data = load_text(args.text_path, args.seq_len, args.text_bytes, args.text_glob)
    subset = evenly_spaced(len(data.x_test), args.eval_batches * args.batch_size)
    return TextTask(
        data.x_train.to(device),
        data.y_train.to(device),
        data.x_test[subset].to(device),
        data.y_test[subset].to(device),
        args.seq_len,
        gpt_options(args),
    )


def validation_loss(model: nn.Module, task: TextTask, batch_size: int) -> float:
    """Token-mean cross entropy (nats per byte) of ``model`` on the validation subset."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(task.x_val), batch_size):
            logits = model(task.x_val[start : start + batch_size])
            target = task.y_val[start : start + batch_size]
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
            total += float(loss.item())
    return total / task.y_val.numel()


@dataclass
class TrainingRun:
    """One optimizer's training of one seed, advanced a step at a time (:func:`train_for`
    runs one to its budget; a caller may interleave several, each on its own clock)."""

    spec: OptimizerSpec
    lr: float
    seed: int
    model: nn.Module
    optimizer: Stepper
    gen: torch.Generator
    trace: list[list[float]]
    elapsed: float = 0.0
    steps: int = 0
    diverged: bool = False


def task_model(seq_len: int, options: dict[str, int]) -> nn.Module:
    """The task's byte-level GPT of ``options``' sizes (:func:`~dkfac.app.gpt.gpt_options`)."""
    return build_model("gpt", in_channels=1, image_size=seq_len, num_classes=BYTE_VOCAB, **options)


def start_run(
    spec: OptimizerSpec, lr: float, seed: int, task: TextTask, *, batch_size: int, momentum: float
) -> TrainingRun:
    """The model of ``seed`` (initialised on the CPU, then moved to the task's device: the
    same weights on every device), ``spec``'s optimizer, the batch generator of ``seed`` and
    the validation loss before the first step."""
    torch.manual_seed(seed)
    model = task_model(task.seq_len, task.model_options).to(task.x_train.device)
    optimizer = build_optimizer(spec, model, lr, momentum)
    trace = [[0, 0.0, validation_loss(model, task, batch_size)]]
    return TrainingRun(spec, lr, seed, model, optimizer, torch.Generator().manual_seed(seed), trace)


def train_step(
    run: TrainingRun,
    task: TextTask,
    *,
    batch_size: int,
    seconds: float,
    eval_every: int,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """One timed training step of ``run``; then, outside the clock, the validation loss
    every ``eval_every`` steps, once ``seconds`` are spent, and when the loss diverged."""
    mc_fisher = run.spec.kind == "kfac" and run.spec.options.get("fisher") == "mc"
    device = task.x_train.device
    index = torch.randint(len(task.x_train), (batch_size,), generator=run.gen).to(device)
    xb, yb = task.x_train[index], task.y_train[index]
    synchronize(device)
    start = clock()
    run.optimizer.zero_grad(set_to_none=True)
    logits = run.model(xb)
    if mc_fisher:  # G from sampled next bytes
        run.optimizer.preconditioner.sample_fisher(logits, "cross_entropy")  # type: ignore[attr-defined]
    loss = F.cross_entropy(logits.flatten(0, 1), yb.flatten())
    loss.backward()
    run.optimizer.step()
    synchronize(device)
    run.elapsed += clock() - start
    run.steps += 1
    run.diverged = not math.isfinite(loss.item())
    if run.steps % eval_every == 0 or run.elapsed >= seconds or run.diverged:
        run.trace.append([run.steps, run.elapsed, validation_loss(run.model, task, batch_size)])


def run_record(run: TrainingRun) -> dict[str, Any]:
    """``{"lr", "seed", "trace": [[step, seconds, validation_loss], ...], "steps",
    "seconds", "final_loss", "final_bits_per_byte", "diverged"}``; a diverged run's final
    loss is ``inf``."""
    last = run.trace[-1][2]
    final = last if math.isfinite(last) and not run.diverged else math.inf
    return {
        "lr": run.lr,
        "seed": run.seed,
        "trace": [list(t) for t in run.trace],
        "steps": run.steps,
        "seconds": run.elapsed,
        "final_loss": final,
        "final_bits_per_byte": final / math.log(2),
        "diverged": run.diverged,
    }


def train_for(
    spec: OptimizerSpec,
    lr: float,
    seed: int,
    task: TextTask,
    *,
    batch_size: int,
    seconds: float,
    eval_every: int,
    momentum: float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Trains for ``seconds`` of training time (or until the loss is not finite).

    Returns:
        :func:`run_record` of the finished run.
    """
    run = start_run(spec, lr, seed, task, batch_size=batch_size, momentum=momentum)
    while run.elapsed < seconds and not run.diverged:
        train_step(
            run, task, batch_size=batch_size, seconds=seconds, eval_every=eval_every, clock=clock
        )
    return run_record(run)


def loss_at(trace: list[list[float]], seconds: float) -> float:
    """The latest validation loss of ``trace`` measured at or before ``seconds`` (``inf``
    for a loss that is not finite: a diverged run)."""
    loss = [point[2] for point in trace if point[1] <= seconds][-1]
    return loss if math.isfinite(loss) else math.inf


def summarise(runs: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """Medians over seeds: final validation loss (nats and bits per byte), steps, seconds per
    step, and the validation loss at each of :data:`FRACTIONS` of ``budget``."""
    final = statistics.median(r["final_loss"] for r in runs)
    at = {
        f"{fraction:g}": statistics.median(loss_at(r["trace"], fraction * budget) for r in runs)
        for fraction in FRACTIONS
    }
    return {
        "median_final_loss": final,
        "median_final_bits_per_byte": final / math.log(2),
        "median_loss_at_fraction": at,
        "median_steps": statistics.median(r["steps"] for r in runs),
        "seconds_per_step": statistics.median(r["seconds"] / max(r["steps"], 1) for r in runs),
        "diverged": sum(bool(r["diverged"]) for r in runs),
    }


def add_gap_to_best(summary: dict[str, dict[str, Any]]) -> None:
    """Sets ``gap_to_best``: median final loss minus the lowest of any optimizer (nats)."""
    best = min((e["median_final_loss"] for e in summary.values()), default=math.inf)
    for entry in summary.values():
        entry["gap_to_best"] = entry["median_final_loss"] - best if math.isfinite(best) else None


def run(args: argparse.Namespace, task: TextTask) -> dict[str, Any]:
    """The whole benchmark; returns the JSON payload."""
    specs, skipped = split_available(build_specs(args, DEFAULT_KFAC, TASK_OPTIONS))

    def train(spec: OptimizerSpec, lr: float, seed: int, sweeping: bool) -> dict[str, Any]:
        return train_for(
            spec,
            lr,
            seed,
            task,
            batch_size=args.batch_size,
            seconds=args.sweep_seconds if sweeping else args.seconds,
            eval_every=args.eval_every,
            momentum=args.momentum,
        )

    runs = sweep_then_seeds(
        specs,
        train,
        lambda r: (r["final_loss"],),
        sweep_seed=args.sweep_seed,
        seeds=args.seeds,
        no_sweep=args.no_sweep,
        first_seed=args.first_seed,
        sweep_seeds=args.sweep_seeds,
    )
    summary = {
        name: {"lr": runs.chosen[name], **summarise(seeded, args.seconds)}
        for name, seeded in runs.seeded.items()
    }
    add_gap_to_best(summary)
    text = {
        "train_windows": len(task.x_train),
        "validation_windows_used": len(task.x_val),
        "validation_bytes_used": task.y_val.numel(),
    }
    return {
        "benchmark": "lm",
        "machine": machine_info(task.x_train.device),
        "settings": {**vars(args), "text": text, "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "sweep": runs.sweep,
        "runs": runs.seeded,
        "summary": summary,
    }


def plot(payload: dict[str, Any], path: str) -> None:
    """Validation loss against training seconds and steps, every seed of every optimizer."""
    s = payload["settings"]
    title = (
        f"byte-level GPT {s['layers']}x{s['width']}, context {s['seq_len']}, batch "
        f"{s['batch_size']} ({s['seeds']} seeds)"
    )
    plot_loss_vs_time_and_steps(payload, path, ylabel="validation loss (nats/byte)", title=title)


def build_parser() -> argparse.ArgumentParser:
    """The ``bench lm`` flags."""
    p = BenchParser(prog="dkfac bench lm", description=__doc__)
    p.add_argument("--batch-size", type=int, default=32, help="windows per step (default: 32)")
    p.add_argument("--seconds", type=float, default=90.0, help="training budget per run")
    p.add_argument("--sweep-seconds", type=float, default=30.0, help="budget of a sweep run")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument(
        "--eval-batches", type=int, default=8, help="validation subset, in --batch-size windows"
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--momentum", type=float, default=0.9, help="of SGD, and of K-FAC's SGD without inner_*"
    )
    add_gpt_arguments(p)
    p.set_defaults(**MODEL_DEFAULTS)
    p.add_argument("--text-path", default=None, help="text file or folder (default: stdlib)")
    p.add_argument("--text-bytes", type=int, default=DEFAULT_TEXT_BYTES, help="bytes read")
    p.add_argument("--text-glob", default=DEFAULT_GLOB, help="file names read from a folder")
    add_peer_arguments(p, GRIDS, optimizers=DEFAULT_OPTIMIZERS)
    p.add_argument("--name", default="lm_text")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the loss-vs-time plot")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, cuda:N or auto (the GPU where there is one)",
    )
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``p.error`` (one line, exit 2) for a bad flag value."""
    check_peer_flags(
        p,
        args,
        positive=(
            "batch_size",
            "seconds",
            "sweep_seconds",
            "eval_every",
            "eval_batches",
            "seeds",
            "text_bytes",
        ),
        problems=(size_problem(args.layers, args.width, args.heads, args.seq_len),),
        default_kfac=DEFAULT_KFAC,
        task_options=TASK_OPTIONS,
        model=lambda: task_model(args.seq_len, gpt_options(args)),
    )
    if message := device_error(args.device):
        p.error(message)
    if args.text_path == "":  # Path("") is the current folder
        p.error("--text-path is empty: give a path (or leave it out)")
    if args.text_path and (message := long_name(args.text_path)):
        p.error(f"--text-path {args.text_path!r} {message}")
    if message := domain_error("text_bytes", args.text_bytes):
        p.error(message)


def batch_problem(batch_size: int, task: TextTask) -> str | None:
    """Why ``--batch-size`` does not fit the training windows of ``task`` (``None``: it
    does), as ``dkfac train`` refuses a batch larger than its training samples."""
    if batch_size > (windows := len(task.x_train)):
        return f"--batch-size {batch_size} exceeds the {windows} training windows of the text"
    return None


def prepare(
    argv: list[str] | None, prog: str = "dkfac bench lm", sweeps: bool = True
) -> tuple[argparse.Namespace, TextTask]:
    """Parses and checks the flags, sets the threads and loads the text (exit 2 on bad input;
    without ``sweeps``, ``--no-sweep`` is required)."""
    p = build_parser()
    p.prog = prog
    args = p.parse_args(argv)
    validate(p, args)
    if not sweeps and not args.no_sweep:
        p.error("this bench runs each optimizer's first lr: pass --no-sweep")
    try:
        task = load_task(args, pick_device(args.device))
    except DataError as error:
        p.error(str(error))
    if problem := batch_problem(args.batch_size, task):
        p.error(problem)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, task


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench lm``."""
    args, task = prepare(argv)
    payload = run(args, task)
    write_result(args.name, payload, args.out_dir, command_line("dkfac bench lm", argv))
    if args.plot:
        plot(payload, args.plot)
    rows = [
        [
            name,
            e["lr"],
            e["median_steps"],
            e["seconds_per_step"],
            *(table_cell(e["median_loss_at_fraction"][f"{f:g}"]) for f in FRACTIONS),
            table_cell(e["median_final_loss"]),
            table_cell(e["median_final_bits_per_byte"]),
            table_cell(e["gap_to_best"]),
            f"{e['diverged']}/{args.seeds}",
        ]
        for name, e in payload["summary"].items()
    ]
    print(f"validation loss (nats/byte), {args.seconds:g} s per run, median over seeds")
    headers = ["optimizer", "lr", "steps", "s/step"]
    headers += [f"loss at {f:.0%}" for f in FRACTIONS]
    headers += ["final loss", "bits/byte", "gap to best", "diverged"]
    print(format_table(headers, rows))
    for name, reason in payload["skipped"].items():
        print(f"{name}: skipped ({reason})")
    return 0
