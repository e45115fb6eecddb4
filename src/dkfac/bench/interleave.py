"""``dkfac bench lm-interleaved``: ``dkfac bench lm`` with the optimizers' steps interleaved.

``dkfac bench lm`` trains one optimizer after another, each for its own wall-time budget; on
a machine whose speed drifts by 10-20% within minutes the optimizer that ran in a slow
minute loses steps for a reason that is not its own. Interleaved, every optimizer of a seed
trains at once: one step of each in turn, each on its own model, batches and generator
exactly as :func:`dkfac.bench.lm.train_for` draws them, each charged only the seconds of its
own steps (zero_grad, forward, backward, optimizer step) and stopped when those reach
``--seconds``. Evaluations are not timed. A slow minute then slows every optimizer alike, and
the steps each gets follow the ratio of their step costs measured side by side. It needs
``--no-sweep`` (each optimizer runs the first lr of its grid) and takes every other flag of
``dkfac bench lm``; the JSON is the bench's, with ``"interleaved": true`` in its settings.

    dkfac bench lm-interleaved --threads 1 --seeds 3 --first-seed 70 --no-sweep --seconds 60 \
        --eval-every 25 --optimizers muon kfac --muon-lrs 0.05 --kfac-lrs 0.006 \
        --recipe benchmarks/recipes/gpt-text.toml --muon-dtype float32
"""

from __future__ import annotations

import argparse
from typing import Any

from dkfac.bench import lm
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.sweep import build_specs, split_available

__all__ = ["main", "run"]


def run(args: argparse.Namespace, task: lm.TextTask) -> dict[str, Any]:
    """Every seed's optimizers trained in turn, a step each; returns the JSON payload."""
    specs, skipped = split_available(build_specs(args, lm.DEFAULT_KFAC, lm.TASK_OPTIONS))
    seeded: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in specs}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs = [
            lm.start_run(
                spec, spec.lrs[0], seed, task, batch_size=args.batch_size, momentum=args.momentum
            )
            for spec in specs
        ]
        while live := [r for r in runs if r.elapsed < args.seconds and not r.diverged]:
            for one in live:
                lm.train_step(
                    one,
                    task,
                    batch_size=args.batch_size,
                    seconds=args.seconds,
                    eval_every=args.eval_every,
                )
        for one in runs:
            seeded[one.spec.name].append(lm.run_record(one))
    summary = {
        name: {"lr": runs_[0]["lr"], **lm.summarise(runs_, args.seconds)}
        for name, runs_ in seeded.items()
    }
    lm.add_gap_to_best(summary)
    return {
        "benchmark": "lm",
        "machine": machine_info(task.x_train.device),
        "settings": {**vars(args), "interleaved": True, "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "runs": seeded,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench lm-interleaved``: ``bench lm``'s flags and output."""
    args, task = lm.prepare(argv, "dkfac bench lm-interleaved", sweeps=False)
    payload = run(args, task)
    write_result(args.name, payload, args.out_dir, command_line("dkfac bench lm-interleaved", argv))
    if args.plot:
        lm.plot(payload, args.plot)
    for name, entry in payload["summary"].items():
        print(
            f"{name}: {entry['median_steps']} steps, {entry['seconds_per_step']:.3f} s/step, "
            f"median at {args.seconds:g} s {entry['median_final_loss']:.4f}"
        )
    return 0
