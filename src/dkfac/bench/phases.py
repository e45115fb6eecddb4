"""``dkfac bench phases``: where a language-model step's time goes, optimizers interleaved.

Builds the ``dkfac bench lm`` model and data (its defaults; ``--layers --width --heads
--seq-len --batch-size`` change them), then for ``--steps`` steps runs one step of every
variant on the same batch in turn and times its forward, backward and optimizer step apart
(``time.perf_counter``, after ``torch.cuda.synchronize`` on a GPU; the first 5 steps not
counted). Each variant is ``muon``, ``adamw`` or a recipe file, optionally ``+`` a JSON
object of K-FAC options that override the file's. Prints the mean milliseconds of each phase
(and the optimizer step's median: the capture and refresh steps make the mean larger);
``--out`` also writes them as JSON. ``--muon-float32`` runs Muon's Newton–Schulz iteration
in float32 (:mod:`dkfac.bench.muon_precision`: the comparison on a CPU that emulates bf16).
``--block N`` runs ``N`` steps of each variant in a row on the same ``N`` batches instead
of alternating every step, in case alternating charged one variant's cache misses to the
other (each variant trains on the same batches in the same order either way).

    dkfac bench phases --steps 45 --out phases.json muon benchmarks/recipes/gpt-text.toml \\
        'benchmarks/recipes/gpt-text.toml+{"orthogonal_steps": 4}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dkfac.app.devices import device_error, pick_device
from dkfac.app.gpt import add_gpt_arguments, size_problem
from dkfac.app.models import build_model
from dkfac.app.text import BYTE_VOCAB
from dkfac.bench import lm, peers
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, machine_info, synchronize, write_result
from dkfac.bench.muon_precision import use_float32_muon
from dkfac.bench.recipes import load_recipe

__all__ = ["WARMUP", "main", "make", "time_phases"]

WARMUP = 5
"""Steps of each variant not counted."""

Run = tuple[torch.nn.Module, Any]


def make(variant: str, task: lm.TextTask, device: torch.device) -> Run:
    """The model (seed 0, on ``device``) and optimizer of ``variant``.

    Raises:
        ValueError: For a recipe override that is not a JSON object.
    """
    if variant == "muon":
        spec, lr = peers.OptimizerSpec("muon", "muon", [0.05]), 0.05
    elif variant == "adamw":
        spec, lr = peers.OptimizerSpec("adamw", "adamw", [0.001]), 0.001
    else:
        path, _, override = variant.partition("+")
        if not Path(path).is_file():
            raise ValueError(
                f"variant {variant!r}: give muon, adamw or a recipe file "
                f"(RECIPE.toml[+{{json}}]); {path!r} is not a file"
            )
        recipe = load_recipe(path)
        try:
            extra = json.loads(override) if override else {}
        except ValueError as err:
            raise ValueError(f"{variant!r}: the text after '+' is not JSON ({err})") from None
        if not isinstance(extra, dict):
            raise ValueError(f"{variant!r}: the text after '+' must be a JSON object")
        options = {**recipe.options, **extra}
        peers.check_kfac_options(options)
        spec, lr = peers.OptimizerSpec(variant, "kfac", [recipe.lr], options), recipe.lr
    torch.manual_seed(0)
    model = build_model(
        "gpt", in_channels=1, image_size=task.seq_len, num_classes=BYTE_VOCAB, **task.model_options
    ).to(device)
    return model, peers.build_optimizer(spec, model, lr, 0.0)


def time_phases(
    runs: dict[str, Run],
    task: lm.TextTask,
    batch_size: int,
    steps: int,
    block: int,
    device: torch.device,
) -> dict[str, dict[str, list[float]]]:
    """Trains every run ``steps`` steps on the same batches, ``block`` steps of a run at a
    time; returns each run's forward, backward and optimizer milliseconds after
    :data:`WARMUP`."""
    times: dict[str, dict[str, list[float]]] = {v: {"fwd": [], "bwd": [], "opt": []} for v in runs}
    gen = torch.Generator().manual_seed(0)
    for first in range(0, steps, block):
        batches = []
        for _ in range(min(block, steps - first)):
            index = torch.randint(len(task.x_train), (batch_size,), generator=gen)
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
    return times


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench phases", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=45, help=f"steps per variant (> {WARMUP})")
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="steps each variant runs in a row before the next takes the same batches "
        "(1: step by step)",
    )
    parser.add_argument(
        "--muon-float32", action="store_true", help="run Muon's Newton–Schulz iteration in float32"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per step")
    add_gpt_arguments(parser)
    parser.set_defaults(**lm.MODEL_DEFAULTS)
    parser.add_argument("--out", type=Path, help="also write the means and medians to this JSON")
    parser.add_argument("variants", nargs="+", help="muon, adamw or RECIPE.toml[+{json}]")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` (exit 2) for a bad flag value."""
    for name in ("block", "threads", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps <= WARMUP:
        parser.error(f"--steps must be > {WARMUP} (the uncounted warm-up), got {args.steps}")
    if problem := size_problem(args.layers, args.width, args.heads, args.seq_len):
        parser.error(problem)
    if message := device_error(args.device):
        parser.error(message)
    if args.out is not None and args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    if len(set(args.variants)) != len(args.variants):
        parser.error(f"each variant once, got {args.variants}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the arguments, runs the steps, prints the table, writes ``--out``."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    sizes = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in lm.MODEL_DEFAULTS]
    bench_args = lm.build_parser().parse_args(
        ["--threads", str(args.threads), "--batch-size", str(args.batch_size), *sizes]
    )
    try:
        task = lm.load_task(bench_args)
        if problem := lm.batch_problem(args.batch_size, task):
            parser.error(problem)
        runs = {v: make(v, task, device) for v in args.variants}
    except (OSError, ValueError) as error:  # a DataError is a ValueError
        parser.error(str(error).splitlines()[0])
    if args.muon_float32:
        use_float32_muon()
    times = time_phases(runs, task, args.batch_size, args.steps, args.block, device)
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
    if args.out is not None:
        settings = {**vars(args), "out": str(args.out)}
        payload = {"machine": machine_info(device), "settings": settings, "phases": table}
        command = command_line("dkfac bench phases", None if argv is None else list(argv))
        write_result(args.out.stem, payload, args.out.parent, command)
    return 0
