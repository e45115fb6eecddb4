"""Probe: where a language-model step's time goes, Muon and K-FAC recipes interleaved.

Builds the ``dkfac bench lm`` model and data (its defaults), then for ``--steps`` steps
runs one step of every optimizer on the same batch in turn and times its forward, backward
and optimizer step apart (``time.perf_counter``, after ``torch.cuda.synchronize`` on a GPU;
the first 5 steps not counted). Each argument after the options is ``muon``, ``adamw`` or a
recipe file, optionally ``+`` a JSON object of K-FAC options that override the file's.
Prints the mean milliseconds of each phase (and the optimizer step's median: the capture
and refresh steps make the mean larger); ``--out`` also writes them as JSON.
``--muon-float32`` runs Muon's iteration in float32 (as ``muon_float32.py``: the
comparison on a CPU that emulates bf16). ``--block N`` runs ``N`` steps of each variant in
a row on the same ``N`` batches instead of alternating every step, in case alternating
charged one variant's cache misses to the other: measured, it does not (BENCHMARKS.md
section 23: recipe ÷ Muon 1.044 with blocks of 20 against 1.049 step by step, within the
machine's drift).

    python benchmarks/probes/lm_step_phases.py --steps 45 muon benchmarks/recipes/gpt-text.toml \\
        'benchmarks/recipes/gpt-text.toml+{"orthogonal_steps": 4}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import muon_float32
import torch
import torch.nn.functional as F

from dkfac.app.models import build_model
from dkfac.app.text import BYTE_VOCAB
from dkfac.bench import lm, peers
from dkfac.bench.common import command_line, machine_info, synchronize
from dkfac.bench.recipes import load_recipe

WARMUP = 5


def make(variant: str, task: lm.TextTask, device: torch.device) -> tuple[Any, Any]:
    """The model (seed 0, on ``device``) and optimizer of ``variant``."""
    if variant == "muon":
        spec, lr = peers.OptimizerSpec("muon", "muon", [0.05]), 0.05
    elif variant == "adamw":
        spec, lr = peers.OptimizerSpec("adamw", "adamw", [0.001]), 0.001
    else:
        path, _, override = variant.partition("+")
        recipe = load_recipe(path)
        options = {**recipe.options, **(json.loads(override) if override else {})}
        spec, lr = peers.OptimizerSpec(variant, "kfac", [recipe.lr], options), recipe.lr
    torch.manual_seed(0)
    model = build_model(
        "gpt", in_channels=1, image_size=task.seq_len, num_classes=BYTE_VOCAB, **task.model_options
    ).to(device)
    return model, peers.build_optimizer(spec, model, lr, 0.0)


def main() -> None:
    """Parses the arguments, runs the steps, prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="steps each variant runs in a row before the next takes the same batches "
        "(1: step by step)",
    )
    parser.add_argument(
        "--muon-float32",
        action="store_true",
        help="run Muon's Newton-Schulz iteration in float32 (muon_float32.py's patch)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (synchronised timers)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--out", help="also write the means and medians to this JSON file")
    parser.add_argument("variants", nargs="+")
    args = parser.parse_args()
    if args.muon_float32:
        muon_float32.patch()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bench_args = lm.build_parser().parse_args(["--threads", str(args.threads)])
    task = lm.load_task(bench_args)
    runs = {v: make(v, task, device) for v in args.variants}
    times: dict[str, dict[str, list[float]]] = {v: {"fwd": [], "bwd": [], "opt": []} for v in runs}
    gen = torch.Generator().manual_seed(0)
    for first in range(0, args.steps, args.block):
        batches = []
        for _ in range(min(args.block, args.steps - first)):
            index = torch.randint(len(task.x_train), (bench_args.batch_size,), generator=gen)
            batches.append((task.x_train[index].to(device), task.y_train[index].to(device)))
        for variant, (model, optimizer) in runs.items():
            for step, (xb, yb) in enumerate(batches, start=first):
                synchronize(device)
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
                synchronize(device)
                t1 = time.perf_counter()
                loss.backward()
                synchronize(device)
                t2 = time.perf_counter()
                optimizer.step()
                synchronize(device)
                t3 = time.perf_counter()
                if step >= WARMUP:
                    for key, value in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2)):
                        times[variant][key].append(value * 1e3)
    print("| variant | forward ms | backward ms | optimizer step ms (median) | total ms |")
    print("|---|---|---|---|---|")
    table = {}
    for variant, phases in times.items():
        means = {k: statistics.mean(v) for k, v in phases.items()}
        table[variant] = {
            **{f"{k}_ms": m for k, m in means.items()},
            "opt_median_ms": statistics.median(phases["opt"]),
            "total_ms": sum(means.values()),
        }
        print(
            f"| {variant} | {means['fwd']:.1f} | {means['bwd']:.1f} | {means['opt']:.1f} "
            f"({statistics.median(phases['opt']):.1f}) | {sum(means.values()):.1f} |"
        )
    if args.out:
        command = command_line("python benchmarks/probes/lm_step_phases.py", None)
        payload = {"command": command, "machine": machine_info(device)}
        with open(args.out, "w") as handle:
            json.dump({**payload, "settings": vars(args), "phases": table}, handle, indent=1)


if __name__ == "__main__":
    main()
