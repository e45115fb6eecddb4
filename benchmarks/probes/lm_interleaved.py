"""Probe: ``dkfac bench lm`` with the optimizers' steps interleaved, so drift cancels.

``dkfac bench lm`` trains one optimizer after another, each for its own wall-time budget;
on a shared VM whose speed drifts by 10-20% within minutes (BENCHMARKS.md sections 25-27)
the optimizer that happened to run in a slow minute loses steps for a reason that is not
its own. This probe trains every optimizer of a seed at once: one step of each in turn, every
optimizer on its own model, batches and generator exactly as ``lm.train_for`` draws them
(``lm.start_run`` and ``lm.train_step``, the pieces of its loop), each charged only the
seconds of its own steps (zero_grad, forward, backward, optimizer step), and stopped when
those reach ``--seconds``. Evaluations are not timed, as in the bench. A slow minute then
slows every optimizer alike, and the steps each gets in the budget follow the ratio of
their step costs measured side by side.

It takes ``dkfac bench lm``'s arguments (``--no-sweep`` is required: each optimizer runs
the first lr of its grid) and writes the bench's JSON (``runs``, ``summary``) with
``"interleaved": true`` in its settings. Muon's Newton-Schulz iteration runs in float32,
as in ``muon_float32.py`` (the AVX2 machine emulates bf16), unless ``--muon-dtype bfloat16``
keeps ``torch.optim.Muon``'s own bf16 iteration (for a CPU with native bf16 products).

    python benchmarks/probes/lm_interleaved.py --threads 1 --seeds 3 --first-seed 70 \\
        --no-sweep --seconds 60 --eval-every 25 --optimizers muon kfac --muon-lrs 0.05 \\
        --kfac-lrs 0.006 --recipe benchmarks/recipes/gpt-text.toml --name lm_interleaved
"""

from __future__ import annotations

import sys
from typing import Any

import muon_float32
import torch

from dkfac.app.devices import pick_device
from dkfac.bench import lm
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.sweep import build_specs, split_available


def main(argv: list[str]) -> int:
    """Parses ``dkfac bench lm``'s arguments, trains interleaved, writes the JSON."""
    parser = lm.build_parser()
    parser.add_argument(
        "--muon-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of Muon's Newton-Schulz iteration: float32 (muon_float32.py's patch, for "
        "a CPU that emulates bf16) or bfloat16 (torch.optim.Muon as shipped, for one that "
        "multiplies bf16 natively)",
    )
    args = parser.parse_args(argv)
    lm.validate(parser, args)
    if not args.no_sweep:
        parser.error("this probe runs each optimizer's first lr: pass --no-sweep")
    if args.muon_dtype == "float32":
        muon_float32.patch()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    task = lm.load_task(args, device)
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
            for run in live:
                lm.train_step(
                    run,
                    task,
                    batch_size=args.batch_size,
                    seconds=args.seconds,
                    eval_every=args.eval_every,
                )
        for run in runs:
            seeded[run.spec.name].append(lm.run_record(run))
            print(f"seed {seed} {run.spec.name}: {run.steps} steps, {run.trace[-1][2]:.4f}")
    summary = {
        name: {"lr": runs_[0]["lr"], **lm.summarise(runs_, args.seconds)}
        for name, runs_ in seeded.items()
    }
    lm.add_gap_to_best(summary)
    payload = {
        "benchmark": "lm",
        "machine": machine_info(device),
        "settings": {**vars(args), "interleaved": True, "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "runs": seeded,
        "summary": summary,
    }
    command = command_line("python benchmarks/probes/lm_interleaved.py", argv)
    write_result(args.name, payload, args.out_dir, command)
    if args.plot:
        lm.plot(payload, args.plot)
    for name, entry in summary.items():
        print(
            f"{name}: {entry['median_steps']} steps, {entry['seconds_per_step']:.3f} s/step, "
            f"median at {args.seconds:g} s {entry['median_final_loss']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
