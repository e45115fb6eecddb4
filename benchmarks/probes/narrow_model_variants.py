"""The default's other choices on the suite's families where a target is missed.

On ``dkfac bench suite``'s MLP (64-128-128-128-10) and autoencoder (64-256-64-16, mirrored),
at batch 256, ``for_model``'s step costs about twice AdamW's and the autoencoder takes more
steps than Muon; on the residual CNN and the digits CNN it sits at about 1.3x. This probe
measures, for each variant of ``for_model``'s options at the default's swept lr (0.01 by
default), the steps to the suite's target (seeds ``--first-seed`` on, ``--seeds`` of them, on
both splits; their median) and the step against AdamW's (``dkfac.bench.suite.step_seconds``:
alternated blocks, every step from the same initial weights, one thread; the median block):

* ``default``: ``for_model`` as it ships;
* ``fresh``: ``overhead=None`` (factors every step from the whole batch, a basis every 5
  steps, 5 Newton-Schulz steps, no one-sided side);
* ``fresh within the budget``: the budget's per-step choices with factors every step from
  the whole batch and a basis every 5 steps;
* ``no one-sided side``: ``basis_max_dim`` above every width;
* ``no basis``: ``basis_max_dim=1``, the identity on every side (Adam's moments and the
  polar factor in the weights' own coordinates, as Muon's and AdamW's);
* ``no polar factor``, ``polar factor everywhere``: ``orthogonal_layers`` empty, or every
  layer;
* ``input and head to Adam``: ``skip_layers`` of the first layer and the head;
* ``blocks from the widths``: ``basis_block_size="widths"`` (whole bases on these two; on
  the digits CNN blocks of 128 for its 289- and 577-wide convolution inputs);
* ``reduce-sum convolutions``: ``conv_reduction="sum"`` (SKFAC's reduction, K-FAC-reduce's
  factors: one row per image, so a capture costs ``1/T`` of the expand one's products);
* ``bases every 5``, ``moments kept at a refresh`` (``moment_carry="keep_v"``), and
  ``bases every 5, no one-sided side``.

    PYTHONPATH=src python benchmarks/probes/narrow_model_variants.py \\
        --out benchmarks/results/narrow_model_variants.json
    PYTHONPATH=src python benchmarks/probes/narrow_model_variants.py --families cnn \\
        --lr 0.005 --variants default "blocks from the widths" \\
        --out benchmarks/results/cnn_block_widths.json
    PYTHONPATH=src python benchmarks/probes/narrow_model_variants.py --families resnet \\
        --seeds 10 --first-seed 10 --variants default "reduce-sum convolutions" \\
        --out benchmarks/results/resnet_reduce_sum.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.common import machine_info
from dkfac.bench.suite import step_seconds, train_to_target
from dkfac.bench.suite_tasks import load_task

ENDS = {
    "mlp": ["net.1", "net.10"],
    "autoencoder": ["encoder.1", "decoder.4"],
    "cnn": ["features.0", "classifier.2"],
    "resnet": ["stem.0", "head"],
}


def variants(family: str) -> dict[str, dict[str, Any]]:
    """Each variant's options over ``for_model``'s."""
    return {
        "default": {},
        "fresh": {"overhead": None},
        "fresh within the budget": {
            "factor_batch_size": 256,
            "factor_update_interval": 1,
            "inverse_update_interval": 5,
        },
        "no one-sided side": {"basis_max_dim": 100_000},
        "no basis": {"basis_max_dim": 1},
        "no polar factor": {"orthogonal_layers": []},
        "polar factor everywhere": {"orthogonal_layers": ".*"},
        "input and head to Adam": {"skip_layers": ENDS[family]},
        "blocks from the widths": {"basis_block_size": "widths"},
        "reduce-sum convolutions": {"conv_reduction": "sum"},
        "bases every 5": {"inverse_update_interval": 5},
        "moments kept at a refresh": {"moment_carry": "keep_v"},
        "bases every 5, no one-sided side": {
            "inverse_update_interval": 5,
            "basis_max_dim": 100_000,
        },
    }


def measure(
    family: str, options: dict[str, Any], lr: float, seeds: range, blocks: int
) -> dict[str, Any]:
    """Steps to the target on both splits and the step against AdamW's."""
    steps = []
    for split in (0, 1):
        task = load_task(family, split)
        for seed in seeds:
            reached = train_to_target(task, "dkfac", lr, seed, 150, options)["reached"]
            steps.append(reached)
    _, cpu = step_seconds(
        load_task(family, 0),
        {"adamw": 0.01, "dkfac": lr},
        blocks=blocks,
        steps=10,
        dkfac_options=options,
    )
    ratio = statistics.median(cpu["dkfac"]) / statistics.median(cpu["adamw"])
    median = statistics.median(s if s is not None else float("inf") for s in steps)
    return {"steps": steps, "median_steps": median, "step_vs_adamw_cpu": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", nargs="+", choices=sorted(ENDS), default=["mlp", "autoencoder"]
    )
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for family in args.families:
        results[family] = {}
        for name, options in variants(family).items():
            if args.variants is not None and name not in args.variants:
                continue
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            found = measure(family, options, args.lr, seeds, args.blocks)
            results[family][name] = {"options": options, **found}
            print(
                f"{family} {name}: median steps {found['median_steps']} {found['steps']}, "
                f"step {found['step_vs_adamw_cpu']:.2f}x AdamW's",
                flush=True,
            )
    if args.out is not None:
        record = {
            "command": "PYTHONPATH=src python benchmarks/probes/narrow_model_variants.py "
            f"--families {' '.join(args.families)} --lr {args.lr} --seeds {args.seeds} "
            f"--first-seed {args.first_seed} "
            f"--blocks {args.blocks}"
            + (
                ""
                if args.variants is None
                else " --variants " + " ".join(f'"{v}"' for v in args.variants)
            )
            + f" --out {args.out}",
            "machine": machine_info(),
            "lr": args.lr,
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
