"""Spawned CPU gloo ranks for the benchmarks that run a process group of their own.

:func:`run_ranks` starts ``world`` processes (``spawn``), each joining one gloo group on a
free local port with one thread, calls ``target(rank, world, *args)`` in every one and
returns each rank's result, in rank order; a rank that fails or does not report in time is
an error, never a hang.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _worker(
    rank: int,
    world: int,
    port: int,
    target: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    results.put((rank, target(rank, world, *args)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    target: Callable[..., Any], world: int, args: Sequence[Any], timeout: float
) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` spawned gloo ranks; each rank's result.

    Args:
        target: A module-level function (it is pickled for ``spawn``).
        world: Number of ranks.
        args: Its further arguments (picklable).
        timeout: Seconds every rank together may take.

    Raises:
        RuntimeError: If a rank does not report within ``timeout`` seconds or exits with an
            error.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, target, tuple(args), results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(per_rank) < world:
            left = deadline - time.monotonic()
            try:
                rank, record = results.get(timeout=min(max(left, 0.1), 1.0))
            except queues.Empty:
                if left <= 0 or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"{world} ranks: {world - len(per_rank)} did not report within "
                        f"{timeout:g} s (exit codes {[p.exitcode for p in procs]})"
                    ) from None
                continue
            per_rank[rank] = record
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    return [per_rank[r] for r in range(world)]
