"""``dkfac bench comm`` / ``dkfac bench memory``: ledger bytes and memory vs the cost model.

A small CNN (two 3×3 convolutions with BatchNorm, two Linear layers; 1×8×8 inputs, fp32)
trains three steps with ``inverse_update_interval=2`` under every strategy on 2 and 4 gloo
ranks (spawned processes on this machine). Per rank it records the ledger's bytes by kind of
step 0 (factors + inverses) and step 1 (factors only), and ``memory_usage()`` just before
``step()`` of step 1, next to :func:`~dkfac.costmodel.predict_ledger_bytes` and
:func:`~dkfac.costmodel.predict_memory`. The model is not DDP-wrapped (DDP's gradient
all-reduce is outside the ledger either way). ``comm`` writes
``benchmarks/results/comm-cnn.json``, ``memory`` writes ``memory-cnn.json``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import format_table, machine_info, write_result
from dkfac.costmodel import DtypeBytes, extract_layers, predict_ledger_bytes, predict_memory

__all__ = ["main", "main_memory", "measure"]

KINDS = ("factors", "inverses", "preconditioned", "gradients")
MEMORY_KINDS = ("factors", "inverses", "accumulators")


def small_cnn() -> nn.Module:
    """The benchmark model (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def configs(world: int) -> list[tuple[str, float]]:
    """``(strategy, fraction)`` pairs at ``world`` ranks (kaisa where ``1 < f·P < P``)."""
    pairs = [("replicated", 1.0)]
    if world >= 4:
        pairs.append(("kaisa", 0.5))
    return [*pairs, ("mem-opt", 1.0), ("dp", 1.0), ("spngd", 1.0)]


def _child(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from dkfac import KFACPreconditioner

    results: dict[str, Any] = {}
    try:
        for strategy, fraction in configs(world):
            model = small_cnn()
            pre = KFACPreconditioner(
                model, strategy=strategy, grad_worker_fraction=fraction, inverse_update_interval=2
            )
            gen = torch.Generator().manual_seed(rank)
            memory: dict[str, int] = {}
            for step in range(3):
                x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,))
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if step == 1:
                    memory = pre.memory_usage()
                pre.step(lr=0.1)
            per_step = [s["by_kind"] for s in pre.comm_stats()["per_step"]]
            results[f"{strategy}/{fraction}"] = {"per_step": per_step, "memory": memory}
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def measure(world: int) -> list[dict[str, Any]]:
    """Runs every strategy on ``world`` gloo ranks; one row per (strategy, rank)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_child, args=(world, port, tmp), nprocs=world, join=True)
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    spec = extract_layers(small_cnn())
    rows = []
    for strategy, fraction in configs(world):
        kw: dict[str, Any] = {"grad_worker_fraction": fraction, "dtypes": DtypeBytes()}
        full = predict_ledger_bytes(spec, world, strategy, **kw)
        factor_only = predict_ledger_bytes(spec, world, strategy, inverse_step=False, **kw)
        memory = predict_memory(spec, world, strategy, **kw)
        for rank in range(world):
            got = per_rank[rank][f"{strategy}/{fraction}"]
            rows.append(
                {
                    "world_size": world,
                    "strategy": strategy if strategy != "kaisa" else f"kaisa(f={fraction:g})",
                    "rank": rank,
                    "ledger_full_step": got["per_step"][0],
                    "predicted_full_step": full[rank],
                    "ledger_factor_step": got["per_step"][1],
                    "predicted_factor_step": factor_only[rank],
                    "memory": got["memory"],
                    "predicted_memory": memory[rank],
                }
            )
    return rows


def _run(kind: str, argv: Sequence[str] | None) -> int:
    parser = BenchParser(prog=f"dkfac bench {kind}", description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out-dir", default=None, help="default benchmarks/results")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if any(w < 2 for w in args.world_sizes):
        parser.error("--world-sizes must be >= 2")
    rows = [row for world in args.world_sizes for row in measure(world)]
    table: list[list[Any]] = []
    if kind == "comm":
        for row in rows:
            for step in ("full", "factor"):
                got, want = row[f"ledger_{step}_step"], row[f"predicted_{step}_step"]
                table.append(
                    [row["world_size"], row["strategy"], row["rank"], step]
                    + [f"{got[k]} / {want[k]}" for k in KINDS]
                    + ["yes" if got == want else "NO"]
                )
        headers = ["P", "strategy", "rank", "step"] + [f"{k} (ledger / model)" for k in KINDS]
    else:
        for row in rows:
            got, want = row["memory"], row["predicted_memory"]
            table.append(
                [row["world_size"], row["strategy"], row["rank"]]
                + [f"{got[k]} / {want[k]}" for k in MEMORY_KINDS]
                + ["yes" if got == want else "NO"]
            )
        headers = ["P", "strategy", "rank"] + [f"{k} (measured / model)" for k in MEMORY_KINDS]
    print(format_table([*headers, "equal"], table))
    payload = {"machine": machine_info("cpu"), "model": "small_cnn", "rows": rows}
    path = write_result(
        f"{kind}-cnn",
        payload,
        args.out_dir,
        command="dkfac bench " + " ".join([kind, *(sys.argv[1:] if argv is None else argv)]),
    )
    print(f"wrote {path}")
    mismatches = sum(1 for row in table if row[-1] == "NO")
    return 1 if mismatches else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``dkfac bench comm``: ledger bytes per strategy and rank vs the cost model."""
    return _run("comm", argv)


def main_memory(argv: Sequence[str] | None = None) -> int:
    """``dkfac bench memory``: K-FAC memory per strategy and rank vs the cost model."""
    return _run("memory", argv)
