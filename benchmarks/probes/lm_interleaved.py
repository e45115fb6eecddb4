"""Probe: ``dkfac bench lm`` with the optimizers' steps interleaved, so drift cancels.

``dkfac bench lm`` trains one optimizer after another, each for its own wall-time budget;
on a shared VM whose speed drifts by 10-20% within minutes (BENCHMARKS.md sections 25-27)
the optimizer that happened to run in a slow minute loses steps for a reason that is not
its own. This probe trains every optimizer of a seed at once: one step of each in turn,
every optimizer on its own model, batches and generator exactly as ``train_for`` would
draw them, each charged only the seconds of its own steps (zero_grad, forward, backward,
optimizer step), and stopped when those reach ``--seconds``. Evaluations are not timed,
as in the bench. A slow minute then slows every optimizer alike, and the steps each gets
in the budget follow the ratio of their step costs measured side by side.

It takes ``dkfac bench lm``'s arguments (``--no-sweep`` is required: each optimizer runs
the first lr of its grid) and writes the bench's JSON (``runs``, ``summary``) with
``"interleaved": true`` in its settings. Muon's Newton-Schulz iteration runs in float32,
as in ``muon_float32.py`` (the AVX2 machine emulates bf16).

    python benchmarks/probes/lm_interleaved.py --threads 1 --seeds 3 --first-seed 70 \\
        --no-sweep --seconds 60 --eval-every 25 --optimizers muon kfac --muon-lrs 0.05 \\
        --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml --name lm_interleaved
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import muon_float32
import torch
import torch.nn.functional as F
import torch.optim._muon as torch_muon
from torch import nn

from dkfac.app.models import build_model
from dkfac.app.text import BYTE_VOCAB
from dkfac.bench import lm
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.peers import OptimizerSpec, build_optimizer
from dkfac.bench.sweep import build_specs, split_available


@dataclass
class Run:
    """One optimizer's training of one seed, advanced a step at a time."""

    spec: OptimizerSpec
    seed: int
    model: nn.Module
    optimizer: Any
    gen: torch.Generator
    trace: list[list[float]] = field(default_factory=list)
    elapsed: float = 0.0
    steps: int = 0
    diverged: bool = False


def start(spec: OptimizerSpec, seed: int, task: lm.TextTask, args: Any) -> Run:
    """The model, optimizer and batch generator ``lm.train_for`` would build."""
    torch.manual_seed(seed)
    model = build_model(
        "gpt", in_channels=1, image_size=task.seq_len, num_classes=BYTE_VOCAB, **task.model_options
    )
    optimizer = build_optimizer(spec, model, spec.lrs[0], args.momentum)
    run = Run(spec, seed, model, optimizer, torch.Generator().manual_seed(seed))
    run.trace.append([0, 0.0, lm.validation_loss(model, task, args.batch_size)])
    return run


def step(run: Run, task: lm.TextTask, args: Any) -> None:
    """One timed step of ``run``, and an (untimed) evaluation where ``train_for`` has one."""
    index = torch.randint(len(task.x_train), (args.batch_size,), generator=run.gen)
    xb, yb = task.x_train[index], task.y_train[index]
    begin = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(run.model(xb).flatten(0, 1), yb.flatten())
    loss.backward()
    run.optimizer.step()
    run.elapsed += time.perf_counter() - begin
    run.steps += 1
    run.diverged = not math.isfinite(loss.item())
    if run.steps % args.eval_every == 0 or run.elapsed >= args.seconds or run.diverged:
        loss_now = lm.validation_loss(run.model, task, args.batch_size)
        run.trace.append([run.steps, run.elapsed, loss_now])


def result(run: Run) -> dict[str, Any]:
    """The per-seed record of ``lm.train_for``."""
    final = run.trace[-1][2] if math.isfinite(run.trace[-1][2]) and not run.diverged else math.inf
    return {
        "lr": run.spec.lrs[0],
        "seed": run.seed,
        "trace": run.trace,
        "steps": run.steps,
        "seconds": run.elapsed,
        "final_loss": final,
        "final_bits_per_byte": final / math.log(2),
        "diverged": run.diverged,
    }


def main(argv: list[str]) -> int:
    """Parses ``dkfac bench lm``'s arguments, trains interleaved, writes the JSON."""
    parser = lm.build_parser()
    args = parser.parse_args(argv)
    if not args.no_sweep:
        parser.error("this probe runs each optimizer's first lr: pass --no-sweep")
    torch_muon._zeropower_via_newtonschulz = muon_float32.float32_newton_schulz  # type: ignore[assignment]
    if args.threads:
        torch.set_num_threads(args.threads)
    task = lm.load_task(args)
    specs, skipped = split_available(build_specs(args, lm.DEFAULT_KFAC, lm.TASK_OPTIONS))
    seeded: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in specs}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs = [start(spec, seed, task, args) for spec in specs]
        while live := [r for r in runs if r.elapsed < args.seconds and not r.diverged]:
            for run in live:
                step(run, task, args)
        for run in runs:
            seeded[run.spec.name].append(result(run))
            print(f"seed {seed} {run.spec.name}: {run.steps} steps, {run.trace[-1][2]:.4f}")
    summary = {
        name: {"lr": runs_[0]["lr"], **lm.summarise(runs_, args.seconds)}
        for name, runs_ in seeded.items()
    }
    lm.add_gap_to_best(summary)
    payload = {
        "benchmark": "lm",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "interleaved": True, "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "runs": seeded,
        "summary": summary,
    }
    command = command_line("python benchmarks/probes/lm_interleaved.py", argv)
    write_result(args.name, payload, args.out_dir, command)
    for name, entry in summary.items():
        print(
            f"{name}: {entry['median_steps']} steps, {entry['seconds_per_step']:.3f} s/step, "
            f"median at {args.seconds:g} s {entry['median_final_loss']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
