"""``dkfac bench shard-exchange``: K-FAC under FSDP2, the exact and the local mode against serial.

Two tasks, each trained with ``KFACOptimizer.for_model`` (its defaults: ``eigen_adam``, the
basis every 5 steps; no overhead budget, so that every rank takes the same intervals) from
the same initialisation on the same global batches:

* **digits**: the training program's CNN on scikit-learn's digits (global batch 128),
  the test accuracy after every step; the figure is the steps to ``--target`` accuracy;
* **lm**: the byte-level GPT of :mod:`dkfac.app.gpt` (2 layers, width 64, 4 heads,
  context 64) on the default text (:func:`dkfac.app.text.load_text`), global batch 16,
  ``loss_average="positions"``; the figure is the validation loss (nats per byte) after
  ``--lm-steps`` steps, measured every ``--eval-every`` steps on a fixed validation subset.

Three modes: ``serial`` (one process, the whole global batch), ``exact`` (``fully_shard`` on
each block and the root over ``--world`` gloo ranks, each rank its rows of the batch,
``strategy="mem-opt"``: the owner exchange, the serial update to rounding) and ``local``
(the same ranks, ``strategy="replicated"``, ``shard_exchange="local"``: each rank its own
rows with its own diagonal block of ``G``). Each seed changes the initialisation and the
batches; medians over seeds are printed, every run is kept in the JSON file.

    dkfac bench shard-exchange --world 2 --seeds 3 --out benchmarks/results/shard_exchange_cpu.json

In float64, so that the exact mode's first steps visibly equal the serial ones. Over longer
runs ``eigen_adam`` drifts apart from the serial run all the same: Adam's normalisation in
the eigenbasis amplifies rounding (on the language model, measured: 1e-12 in the loss after
one step, 1e-4 after eleven), where ``method="eigen"`` keeps the exact mode equal to serial
to 1e-15 over twelve steps. The exact mode is the serial update; its figures differ from
the serial ones by that drift only. CPU ranks of one thread; the figures are steps and
losses, not times.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer
from dkfac.app.data import load_digits
from dkfac.app.gpt import GPT
from dkfac.app.models import build_model
from dkfac.app.text import load_text
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.gloo_ranks import run_ranks

__all__ = ["MODES", "main"]

MODES = ("serial", "exact", "local")
DIGITS_BATCH, LM_BATCH, LM_CONTEXT, LM_EVAL_WINDOWS = 128, 16, 64, 64
LM_LAYERS, LM_WIDTH, LM_HEADS = 2, 64, 4
MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "serial": {},
    "exact": {"strategy": "mem-opt"},
    "local": {"strategy": "replicated", "shard_exchange": "local"},
}


def _shard(model: nn.Module) -> nn.Module:
    """``fully_shard`` on every child with parameters (every GPT block), then the root."""
    blocks = getattr(model, "blocks", None)
    children = list(blocks) if isinstance(blocks, nn.Sequential) else list(model.children())
    for child in children:
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def _rows(x: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s contiguous share of a global batch (all of it for ``world=0``)."""
    if world == 0:
        return x
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def _digits(seed: int, steps: int, rank: int, world: int, mode: str) -> list[float]:
    """Test accuracy after each step (``world=0``: serial)."""
    data = load_digits()
    torch.manual_seed(seed)
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10).double()
    if world:
        _shard(model)
    opt = KFACOptimizer.for_model(model, overhead=None, **MODE_OPTIONS[mode])
    gen = torch.Generator().manual_seed(seed)
    trace = []
    for _ in range(steps):
        index = torch.randint(0, data.x_train.shape[0], (DIGITS_BATCH,), generator=gen)
        x = _rows(data.x_train[index].double(), rank, world)
        y = _rows(data.y_train[index], rank, world)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            hits = (model(data.x_test.double()).argmax(1) == data.y_test).double().mean()
        trace.append(float(hits))
    return trace


def _lm(seed: int, steps: int, every: int, rank: int, world: int, mode: str) -> list[float]:
    """Validation loss at steps ``every, 2·every, ...`` (``world=0``: serial)."""
    text = load_text(seq_len=LM_CONTEXT + 1)
    held = text.x_test[:: max(1, text.x_test.shape[0] // LM_EVAL_WINDOWS)][:LM_EVAL_WINDOWS]
    torch.manual_seed(seed)
    model = GPT(
        vocab_size=256, context=LM_CONTEXT, layers=LM_LAYERS, width=LM_WIDTH, heads=LM_HEADS
    ).double()
    if world:
        _shard(model)
    opt = KFACOptimizer.for_model(
        model, overhead=None, loss_average="positions", **MODE_OPTIONS[mode]
    )
    gen = torch.Generator().manual_seed(seed)
    trace = []
    for step in range(1, steps + 1):
        index = torch.randint(0, text.x_train.shape[0], (LM_BATCH,), generator=gen)
        ids = _rows(text.x_train[index], rank, world)
        opt.zero_grad()
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        if step % every == 0 or step == steps:
            with torch.no_grad():
                out = model(held[:, :-1])
                loss = F.cross_entropy(out.reshape(-1, 256), held[:, 1:].reshape(-1))
            trace.append(float(loss))
    return trace


def _sharded_runs(rank: int, world: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The exact and local runs of every seed on this rank."""
    runs: dict[str, Any] = {}
    for seed in settings["seeds"]:
        for mode in ("exact", "local"):
            runs[f"digits/{mode}/{seed}"] = _digits(
                seed, settings["digits_steps"], rank, world, mode
            )
            runs[f"lm/{mode}/{seed}"] = _lm(
                seed, settings["lm_steps"], settings["eval_every"], rank, world, mode
            )
    return runs


def steps_to(trace: Sequence[float], target: float) -> int | None:
    """The first step (1-based) whose accuracy reaches ``target``; ``None`` if none does."""
    return next((i + 1 for i, value in enumerate(trace) if value >= target), None)


def summarise(runs: dict[str, list[float]], seeds: Sequence[int], target: float) -> dict[str, Any]:
    """Medians over seeds: steps to ``target`` on digits, final validation loss on lm."""
    summary: dict[str, Any] = {}
    for mode in MODES:
        reached = [steps_to(runs[f"digits/{mode}/{s}"], target) for s in seeds]
        steps = [r for r in reached if r is not None]
        summary[mode] = {
            "digits_steps_to_target": reached,
            "digits_median_steps": statistics.median(steps) if len(steps) == len(seeds) else None,
            "lm_final_loss": [runs[f"lm/{mode}/{s}"][-1] for s in seeds],
            "lm_median_final_loss": statistics.median(runs[f"lm/{mode}/{s}"][-1] for s in seeds),
        }
    return summary


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench shard-exchange", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (>= 2)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1")
    parser.add_argument("--digits-steps", type=int, default=60, help="digits steps per run")
    parser.add_argument("--target", type=float, default=0.97, help="digits test accuracy")
    parser.add_argument("--lm-steps", type=int, default=200, help="language-model steps")
    parser.add_argument("--eval-every", type=int, default=20, help="lm evaluation interval")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the ranks")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file written")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.world < 2:
        parser.error(f"--world must be >= 2 (a sharded model), got {args.world}")
    for name in ("seeds", "digits_steps", "lm_steps", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.target <= 1.0:
        parser.error(f"--target must be in (0, 1], got {args.target}")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        parser.error(f"--timeout must be a finite number > 0, got {args.timeout}")
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    if LM_BATCH % args.world or DIGITS_BATCH % args.world:
        parser.error(f"--world must divide the global batches {DIGITS_BATCH} and {LM_BATCH}")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the serial runs here and the sharded ones on gloo ranks, prints the medians and
    writes ``--out``; 1 if the ranks failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    settings = {
        "seeds": seeds,
        "digits_steps": args.digits_steps,
        "lm_steps": args.lm_steps,
        "eval_every": args.eval_every,
    }
    runs: dict[str, list[float]] = {}
    for seed in seeds:
        runs[f"digits/serial/{seed}"] = _digits(seed, args.digits_steps, 0, 0, "serial")
        runs[f"lm/serial/{seed}"] = _lm(seed, args.lm_steps, args.eval_every, 0, 0, "serial")
    try:
        ranks = run_ranks(_sharded_runs, args.world, (settings,), args.timeout)
    except RuntimeError as error:
        print(f"dkfac bench shard-exchange: {error}")
        return 1
    runs.update(ranks[0])  # every rank holds the same model after each step
    summary = summarise(runs, seeds, args.target)
    print(json.dumps(summary, indent=1))
    report = {
        "machine": machine_info(),
        "settings": {
            **settings,
            "world": args.world,
            "target": args.target,
            "digits_batch": DIGITS_BATCH,
            "lm": {
                "layers": LM_LAYERS,
                "width": LM_WIDTH,
                "heads": LM_HEADS,
                "context": LM_CONTEXT,
                "batch": LM_BATCH,
            },
            "modes": MODE_OPTIONS,
        },
        "summary": summary,
        "runs": runs,
    }
    command = command_line("dkfac bench shard-exchange", None if argv is None else list(argv))
    write_result(args.out.stem, report, args.out.parent, command)
    return 0
