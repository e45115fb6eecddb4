"""Bytes of the preconditioner's statistics and the step time against AdamW, where sides
are one-sided or block-diagonal.

An MLP 8192 -> 256 -> 10 at batch 64 under ``KFACOptimizer.for_model`` (its overhead
budget makes every side wider than 3/4 of the 64 rows one-sided: the 8193-wide input side,
both 256/257-wide sides), one thread: the bytes of every running value and accumulator of
the preconditioner's statistics, taken between a backward and the step (the accumulators
then hold the step's sums), and milliseconds per step of AdamW and of ``for_model`` timed in
alternated blocks (wall clock, median block of a round; the figure is the median of the
rounds' ratios). Also the statistic bytes of the suite's GPT
(``dkfac.bench.suite_tasks.load_task("gpt")``) after a few steps, as ``for_model`` keeps it
and with ``basis_block_size=64`` (its MLP's sides block-diagonal). ``as_matrix_bytes``
counts what the same statistics take as ``d × d`` matrices (the block's statistic shapes).

The probe reads only the public API, so the same file measures another checkout: run it
with that checkout's sources first on the path and another ``--label``, into the same
``--out`` (each label's entry is replaced, the others kept):

    PYTHONPATH=src python benchmarks/probes/one_sided_memory.py --threads 1 --label after \\
        --out benchmarks/results/one_sided_memory.json
    git worktree add /tmp/base <commit before> && PYTHONPATH=/tmp/base/src \\
        python benchmarks/probes/one_sided_memory.py --threads 1 --label before \\
        --out benchmarks/results/one_sided_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac import KFACOptimizer
from dkfac.bench.common import machine_info
from dkfac.bench.suite_tasks import load_task

BLOCK = 5  # steps a timed block
GPT_BLOCK = 64
"""``basis_block_size`` given to the GPT's second measurement: its MLP's 256- and 257-wide
sides in blocks of 64 (``for_model`` keeps its bases whole: no side is more than twice its
hidden widths)."""


def statistic_bytes(opt: KFACOptimizer) -> dict[str, Any]:
    """Bytes of every running statistic and accumulator, by layer side, and what they
    would take as ``d × d`` matrices (only the statistics held)."""
    held = 0
    as_matrix = 0
    kinds: dict[str, str] = {}
    for name, layer in opt.preconditioner.layers.items():
        shapes = layer.block.statistic_shapes()
        for key, shape in shapes.items():
            kinds[f"{name}/{key}"] = str(layer.summary().get(f"{key.lower()}_factor", "dense"))
            tensors = [layer.running[key]] if key in layer.running else []
            tensors += list(layer.accumulators[key].tensors())
            held += sum(t.numel() * t.element_size() for t in tensors)
            as_matrix += sum(math.prod(shape) * t.element_size() for t in tensors)
    return {"bytes": held, "as_matrix_bytes": as_matrix, "kinds": kinds}


def _mlp_step(arm: str) -> Callable[[], None]:
    """One training step of a fresh MLP under ``arm`` (``"adamw"`` or ``"dkfac"``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8192, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(64, 8192), torch.randint(0, 10, (64,))
    opt: Any = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if arm == "adamw"
        else KFACOptimizer.for_model(model, lr=1e-3)
    )

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _mlp_bytes(steps: int) -> dict[str, Any]:
    """The statistics' bytes after ``steps`` steps and a backward (sums held)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8192, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(64, 8192), torch.randint(0, 10, (64,))
    opt = KFACOptimizer.for_model(model, lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return statistic_bytes(opt)


def measure_mlp(blocks: int, rounds: int) -> dict[str, Any]:
    """Rounds of alternated timed blocks of AdamW and ``for_model`` (both built afresh
    each round, a few steps first)."""
    done = []
    for _ in range(rounds):
        steps = {arm: _mlp_step(arm) for arm in ("adamw", "dkfac")}
        for step in steps.values():
            for _ in range(3):
                step()
        times: dict[str, list[float]] = {arm: [] for arm in steps}
        for _ in range(blocks):
            for arm, step in steps.items():
                start = time.perf_counter()
                for _ in range(BLOCK):
                    step()
                times[arm].append((time.perf_counter() - start) / BLOCK * 1e3)
        ms = {arm: statistics.median(values) for arm, values in times.items()}
        done.append({"ms_per_step": ms, "dkfac_vs_adamw": ms["dkfac"] / ms["adamw"]})
    return {
        "ms_per_step": {
            arm: statistics.median(r["ms_per_step"][arm] for r in done)
            for arm in ("adamw", "dkfac")
        },
        "dkfac_vs_adamw": statistics.median(r["dkfac_vs_adamw"] for r in done),
        "rounds": done,
        "statistics": _mlp_bytes(3),
    }


def measure_gpt(steps: int, block: int | None = None) -> dict[str, Any]:
    """The suite GPT's statistic bytes after ``steps`` steps of ``for_model`` (given
    ``basis_block_size=block`` where not ``None``) and a backward."""
    task = load_task("gpt")
    torch.manual_seed(0)
    model = task.build()
    options = {} if block is None else {"basis_block_size": block}
    opt = KFACOptimizer.for_model(model, lr=1e-3, **options)
    x, y = task.x_train[: task.batch_size], task.y_train[: task.batch_size]

    def backward() -> None:
        opt.zero_grad()
        task.loss(model(x), y).backward()

    for _ in range(steps):
        backward()
        opt.step()
    backward()
    return statistic_bytes(opt)


def _merge(path: Path, label: str, entry: dict[str, Any]) -> None:
    record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault("results", {})[label] = entry
    record["figure"] = (
        "statistics: bytes of the running values and accumulators between a backward and "
        "the step; step time: wall ms per step, median block of alternated AdamW/for_model "
        "blocks, the median ratio of the rounds"
    )
    record["machine"] = machine_info()
    path.write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpt-steps", type=int, default=3)
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads < 1 or args.blocks < 1 or args.rounds < 1 or args.gpt_steps < 0:
        parser.error("--threads, --blocks and --rounds must be >= 1, --gpt-steps >= 0")
    torch.set_num_threads(args.threads)
    mlp = measure_mlp(args.blocks, args.rounds)
    print(
        f"{args.label}: mlp statistics {mlp['statistics']['bytes'] / 1e6:.3f} MB "
        f"(as matrices {mlp['statistics']['as_matrix_bytes'] / 1e6:.3f} MB); AdamW "
        f"{mlp['ms_per_step']['adamw']:.2f} ms, dkfac {mlp['ms_per_step']['dkfac']:.2f} ms, "
        f"{mlp['dkfac_vs_adamw']:.2f}x",
        flush=True,
    )
    gpt = measure_gpt(args.gpt_steps)
    gpt_blocks = measure_gpt(args.gpt_steps, GPT_BLOCK)
    for label, found in (("gpt", gpt), (f"gpt, blocks of {GPT_BLOCK}", gpt_blocks)):
        print(
            f"{args.label}: {label} statistics {found['bytes'] / 1e6:.3f} MB "
            f"(as matrices {found['as_matrix_bytes'] / 1e6:.3f} MB)",
            flush=True,
        )
    if args.out is not None:
        entry = {
            "command": "PYTHONPATH=<checkout>/src python benchmarks/probes/one_sided_memory.py "
            f"--threads {args.threads} --blocks {args.blocks} --rounds {args.rounds} "
            f"--gpt-steps {args.gpt_steps} --label {args.label} --out {args.out}",
            "dkfac": str(Path(dkfac.__file__).parent),
            "mlp": mlp,
            "gpt": gpt,
            f"gpt_basis_block_size_{GPT_BLOCK}": gpt_blocks,
        }
        _merge(args.out, args.label, entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
