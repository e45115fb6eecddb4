"""``dkfac bench fsdp-memory``: K-FAC under FSDP2 on CPU gloo ranks: memory per rank, bytes
per step, step time.

For each world size, every configuration runs in one spawned gloo process group on the
byte-level GPT of the training program (:class:`dkfac.app.gpt.GPT`), ``fully_shard`` on each
block and the root: AdamW, and ``KFACOptimizer.for_model`` (``eigen_adam``) with the
``replicated`` and the ``mem-opt`` strategy, at factor / inverse intervals ``(1, 10)`` and
``(10, 100)``. Per rank it records K-FAC's bytes (``pre.memory_usage()``: factors, inverses
and bases, moments), the bytes of the rank's parameter shards (and AdamW's state), the bytes
each step sent by kind (the ledger) and the mean step time over the measured steps (after
two warm-up steps; a short AdamW run before all, thrown away, takes the first run's start-up
costs).

    dkfac bench fsdp-memory --worlds 2 4 --steps 100 --out benchmarks/results/fsdp_memory_cpu.json

Not a benchmark of record: CPU ranks sharing the machine's cores (one thread each), one
seed; step times on a shared machine are indicative only. Memory and bytes are exact.
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
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer
from dkfac.app.gpt import GPT
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, machine_info, write_result
from dkfac.bench.gloo_ranks import run_ranks

__all__ = ["INTERVALS", "SIZES", "local_bytes", "main", "sharded_gpt"]

SIZES = {"layers": 4, "width": 64, "heads": 4}
SEQ, PER_RANK, VOCAB = 32, 8, 256
INTERVALS = [(1, 10), (10, 100)]
WARMUP = 2


def sharded_gpt() -> torch.nn.Module:
    """The benchmark's GPT, ``fully_shard`` on each block and the root."""
    torch.manual_seed(0)
    model = GPT(
        vocab_size=VOCAB,
        context=SEQ,
        layers=SIZES["layers"],
        width=SIZES["width"],
        heads=SIZES["heads"],
    )
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _optimizer(model: torch.nn.Module, name: str, intervals: tuple[int, int]) -> Any:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    factor, inverse = intervals
    return KFACOptimizer.for_model(
        model,
        strategy=name.removeprefix("kfac-"),
        factor_update_interval=factor,
        inverse_update_interval=inverse,
    )


def local_bytes(tensors: Any) -> int:
    """Bytes of the local shards of ``tensors`` (DTensors or plain tensors)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _run(rank: int, name: str, intervals: tuple[int, int], steps: int) -> dict[str, Any]:
    """One configuration's steps on this rank: its step time, memory and bytes."""
    model = sharded_gpt()
    opt = _optimizer(model, name, intervals)
    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    for step in range(WARMUP + steps):
        ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    out: dict[str, Any] = {
        "step_seconds": statistics.fmean(times),
        "param_shard_bytes": local_bytes(model.parameters()),
    }
    if isinstance(opt, KFACOptimizer):
        pre = opt.preconditioner
        out["kfac_memory"] = pre.memory_usage()
        stats = pre.comm_stats()["total"]
        out["bytes_per_step"] = {k: v / (WARMUP + steps) for k, v in stats.items()}
    else:
        out["adam_state_bytes"] = local_bytes(
            t
            for state in opt.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
    return out


def _record_all(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Every configuration on this rank (inside the process group of :func:`run_world`)."""
    del world
    record = {}
    _run(rank, "adamw", INTERVALS[0], 5)  # warm-up, thrown away: the first run pays
    for intervals in INTERVALS:
        for name in ("adamw", "kfac-replicated", "kfac-mem-opt"):
            if name == "adamw" and intervals != INTERVALS[0]:
                continue
            key = name if name == "adamw" else f"{name}@{intervals[0]},{intervals[1]}"
            record[key] = _run(rank, name, intervals, steps)
    return record


def run_world(world: int, steps: int, timeout: float) -> list[dict[str, Any]]:
    """Every configuration on ``world`` spawned gloo ranks; each rank's record.

    Raises:
        RuntimeError: If a rank does not report within ``timeout`` seconds.
    """
    return run_ranks(_record_all, world, (steps,), timeout)


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench fsdp-memory", description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run")
    parser.add_argument("--steps", type=int, default=100, help="measured steps per config")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file written")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds a world size may take"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every world size, prints rank 0's record, writes ``--out``; 1 if ranks failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.worlds) < 1 or args.steps < 1 or not args.timeout > 0:
        parser.error("--worlds and --steps must be >= 1 and --timeout > 0")
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    report: dict[str, Any] = {
        "machine": machine_info(),
        "model": {**SIZES, "seq_len": SEQ, "vocab": VOCAB, "per_rank_batch": PER_RANK},
        "worlds": {},
    }
    for world in args.worlds:
        try:
            report["worlds"][str(world)] = run_world(world, args.steps, args.timeout)
        except RuntimeError as error:
            print(f"dkfac bench fsdp-memory: {error}")
            return 1
        print(json.dumps({world: report["worlds"][str(world)][0]}, indent=1))
    command = command_line("dkfac bench fsdp-memory", None if argv is None else list(argv))
    write_result(args.out.stem, report, args.out.parent, command)
    return 0
