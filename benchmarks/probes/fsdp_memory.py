"""Probe: K-FAC under FSDP2 on CPU gloo ranks: memory per rank, bytes per step, step time.

For each world size, every configuration runs in one spawned gloo process group on the
byte-level GPT of the training program (``dkfac.app.gpt.GPT``), ``fully_shard`` on each block
and the root: AdamW, and ``KFACOptimizer.for_model`` (``eigen_adam``) with the ``replicated``
and the ``mem-opt`` strategy, at factor / inverse intervals ``(1, 10)`` and ``(10, 100)``.
Per rank it records K-FAC's bytes (``pre.memory_usage()``: factors, inverses and bases,
moments), the bytes of the rank's parameter shards, the bytes each step sent by kind (the
ledger) and the mean step time over the measured steps (the amortised step: a multiple of
the inverse interval, after warm-up steps; a short AdamW run before all, thrown away,
takes the first run's start-up costs).

    python benchmarks/probes/fsdp_memory.py --worlds 2 4 --steps 100 \\
        --out benchmarks/results/fsdp_memory_cpu.json

Not a benchmark of record: CPU ranks sharing the machine's cores (one thread each), one
seed; step times on a shared 2-core machine are indicative only. Memory and bytes are exact.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from dkfac import KFACOptimizer
from dkfac.app.gpt import GPT
from dkfac.bench.common import machine_info

SIZES = {"layers": 4, "width": 64, "heads": 4}
SEQ, PER_RANK, VOCAB = 32, 8, 256
INTERVALS = [(1, 10), (10, 100)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, context=SEQ, **SIZES)
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


def _run(rank: int, world: int, name: str, intervals: tuple[int, int], steps: int) -> dict:
    model = _model()
    opt = _optimizer(model, name, intervals)
    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    warmup = 2
    for step in range(warmup + steps):
        ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"step_seconds": statistics.fmean(times), "param_shard_bytes": shards}
    if isinstance(opt, KFACOptimizer):
        pre = opt.preconditioner
        out["kfac_memory"] = pre.memory_usage()
        stats = pre.comm_stats()["total"]
        out["bytes_per_step"] = {k: v / (warmup + steps) for k, v in stats.items()}
    else:
        out["adam_state_bytes"] = sum(
            t.to_local().numel() * t.element_size()
            for state in opt.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
    return out


def _worker(rank: int, world: int, port: int, steps: int, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    results = {}
    _run(rank, world, "adamw", INTERVALS[0], 5)  # warm-up, thrown away: the first run pays
    for intervals in INTERVALS:
        for name in ("adamw", "kfac-replicated", "kfac-mem-opt"):
            if name == "adamw" and intervals != INTERVALS[0]:
                continue
            key = name if name == "adamw" else f"{name}@{intervals[0]},{intervals[1]}"
            results[key] = _run(rank, world, name, intervals, steps)
    queue.put((rank, results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=100, help="measured steps per config")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    report: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "model": {**SIZES, "seq_len": SEQ, "vocab": VOCAB, "per_rank_batch": PER_RANK},
        "worlds": {},
    }
    for world in args.worlds:
        queue = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, args.steps, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        per_rank = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
        report["worlds"][str(world)] = [per_rank[r] for r in range(world)]
        print(json.dumps({world: per_rank[0]}, indent=1))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
