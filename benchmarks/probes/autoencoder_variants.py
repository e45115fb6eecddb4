"""Probe: steps and seconds to the autoencoder's target for variants of its recipe, and Muon.

Each variant is the recipe ``benchmarks/recipes/digits-autoencoder.toml`` with some K-FAC
options replaced (``NAME=LR:JSON``, the JSON an object of ``KFACConfig`` fields, dtypes as
strings such as ``"bfloat16"``); ``muon=LR:JSON`` runs ``torch.optim.Muon`` (with AdamW for
the rest, ``dkfac.bench.peers``) at the bench's settings with the given options changed.
Every run is ``dkfac.bench.autoencoder.train_for`` at batch 512 for ``--seconds``, the
training loss evaluated after every step (outside the clock), so the step and the time at
which MSE 0.02 is first reached are exact rather than rounded up to the bench's evaluation
interval. Seeds ``--first-seed`` .. ``+ --seeds``; the recipes are tuned on 100-102.

    python benchmarks/probes/autoencoder_variants.py --first-seed 100 \\
        --out benchmarks/results/autoencoder_fewer_steps_tuning.json \\
        'recipe=0.003:{}' 'ns3=0.003:{"orthogonal_steps": 3}' 'muon=0.05:{}'

Not a benchmark of record: one thread, runs one after another (not interleaved), seconds
noisy to ~5%; the interleaved bench runs in BENCHMARKS.md are the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dkfac.app.data import load_digits
from dkfac.bench.autoencoder import TASK_OPTIONS, train_for
from dkfac.bench.common import machine_info
from dkfac.bench.peers import DEFAULT_OPTIONS, OptimizerSpec
from dkfac.bench.recipes import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits-autoencoder.toml"
TARGET = 0.02
DTYPE_FIELDS = ("gradient_rotation_dtype", "rotation_dtype", "capture_dtype", "factor_dtype")


def spec_of(name: str, lr: float, changes: dict[str, Any]) -> OptimizerSpec:
    """The variant's optimizer: Muon with the bench's options, or the recipe's K-FAC."""
    if name.startswith("muon"):
        options = {**DEFAULT_OPTIONS["muon"], **TASK_OPTIONS["muon"], **changes}
        return OptimizerSpec(name=name, kind="muon", lrs=(lr,), options=options)
    options = {**load_recipe(str(RECIPE)).options, **changes}
    for key in DTYPE_FIELDS:
        if isinstance(options.get(key), str) and options[key] != "auto":
            options[key] = getattr(torch, options[key])
    return OptimizerSpec(name=name, kind="kfac", lrs=(lr,), options=options)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="NAME=LR:JSON")
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = load_digits(seed=args.split_seed, normalize=False).x_train
    results: dict[str, Any] = {}
    for item in args.variants:
        name, _, rest = item.partition("=")
        lr_text, _, changes_text = rest.partition(":")
        lr, changes = float(lr_text), json.loads(changes_text or "{}")
        spec = spec_of(name, lr, changes)
        momentum = 0.9 if spec.kind == "muon" else 0.0
        hits = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run = train_for(
                spec,
                lr,
                seed,
                x,
                batch_size=512,
                seconds=args.seconds,
                eval_every=1,
                momentum=momentum,
            )
            hit = next((t for t in run["trace"] if t[2] <= TARGET), None)
            hits.append(None if hit is None else {"step": hit[0], "seconds": hit[1]})
        reached = [h for h in hits if h is not None]
        results[name] = {
            "lr": lr,
            "changes": changes,
            "per_seed": hits,
            "median_steps": statistics.median(h["step"] for h in reached) if reached else None,
            "median_seconds": statistics.median(h["seconds"] for h in reached) if reached else None,
        }
        row = results[name]
        print(
            f"{name}: steps {[h and h['step'] for h in hits]} median {row['median_steps']}, "
            f"{row['median_seconds'] and round(row['median_seconds'], 2)} s",
            flush=True,
        )
    if args.out:
        payload = {
            "command": "python benchmarks/probes/autoencoder_variants.py " + " ".join(argv),
            "machine": machine_info(),
            "target_loss": TARGET,
            "results": results,
        }
        with open(args.out, "w") as handle:
            json.dump(payload, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
