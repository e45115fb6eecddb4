"""Run a function on several gloo ranks, each in a process of its own (test helper).

Usage::

    def _check(rank: int, world_size: int, scale: float) -> float:  # module level: picklable
        ...
        return value

    results = run_distributed(_check, 4, 2.0)  # [value of rank 0, ..., value of rank 3]

The ranks are not forks of the test process: they fork from multiprocessing's forkserver,
a process spawned once per test session that only imported torch and dkfac (spawn itself
where the platform has no forkserver). A rank then starts in a fraction of a second instead
of re-importing torch (3-4 s each on a 2-core CPU, most of the multi-rank tests' time).

Each child sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``, initialises a gloo
process group on 127.0.0.1 (a free port per call), runs ``fn(rank, world_size, *args)``,
destroys the group and hands its return value back through a file (``torch.save``, so tensors
are fine). The port is free when chosen, not reserved: if another process (a second pytest
worker) binds it before rank 0 does, the ranks are started again on another port, up to
:data:`PORT_ATTEMPTS` times. If any rank raises, the other ranks are killed and
:class:`DistributedTestError` is raised in the parent with the failing rank and its traceback
text. If the whole run takes longer than ``timeout`` seconds every child is killed and the
error says which ranks hung.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["PORT_ATTEMPTS", "DistributedTestError", "find_free_port", "run_distributed"]

_STARTUP_GRACE_S = 30.0  # starting the forkserver (importing torch) on a busy 2-core machine
_FAILURE_GRACE_S = 3.0  # after a failure, how long the other ranks get to report theirs
PORT_ATTEMPTS = 3  # starts on a fresh port after rank 0 found its port taken


class DistributedTestError(RuntimeError):
    """A rank failed, died or hung.

    Attributes:
        rank: The failing rank (``None`` for an overall timeout).
        child_traceback: The child's formatted traceback, if it reported one.
    """

    def __init__(self, message: str, rank: int | None = None, child_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
) -> None:
    """Entry point of one spawned rank: run ``fn`` and write ``{ok, value | traceback}``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

    def failure(port_taken: bool = False) -> dict[str, Any]:  # stamped before the teardown
        return {
            "ok": False,
            "traceback": traceback.format_exc(),
            "time": time.time(),
            "port_taken": port_taken,
        }

    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException as err:
        result = failure(port_taken=rank == 0 and _address_in_use(err))
    else:
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args)}
        except BaseException:
            result = failure()
        try:
            dist.destroy_process_group()
        except BaseException:
            if result["ok"]:
                result = failure()
    tmp = Path(out_dir) / f"rank{rank}.pt.tmp"
    try:
        torch.save(result, tmp)
    except Exception:  # an unpicklable return value
        torch.save(failure(), tmp)
    tmp.rename(Path(out_dir) / f"rank{rank}.pt")


def _address_in_use(err: BaseException) -> bool:
    """Whether ``err`` (from ``init_process_group``) says the store's port is taken."""
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


class _PortTakenError(Exception):
    """Rank 0 could not bind the chosen port: start the ranks again on another."""


_PRELOAD = ["torch", "torch.distributed", "dkfac", "tests.distributed_utils"]


def _context() -> Any:
    """The forkserver context, its server importing ``_PRELOAD`` (module notes); spawn where
    there is no forkserver. The server starts at the first rank started, with that moment's
    environment (``OMP_NUM_THREADS=1``, set around the starts), which every rank inherits."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of ranks to spawn, at least 1.
        *args: Extra picklable arguments passed to every rank.
        timeout: Seconds for the process group's collective timeout; the whole run is
            killed after ``timeout`` plus a short start-up grace period.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        DistributedTestError: If a rank raised, died without reporting, or the run timed out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"fn must be a picklable module-level function: {exc}") from exc
    ctx = _context()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_once(ctx, fn, world_size, args, float(timeout))
        except _PortTakenError as taken:
            if attempt == PORT_ATTEMPTS:
                raise DistributedTestError(
                    f"rank 0 found its port taken {PORT_ATTEMPTS} times:\n{taken}", rank=0
                ) from None
    raise AssertionError("unreachable")


def _run_once(
    ctx: Any, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float
) -> list[Any]:
    """One start of the ranks on a free port (:func:`run_distributed`)."""
    with tempfile.TemporaryDirectory(prefix="dkfac-dist-") as out_dir:
        port = find_free_port()
        procs = []
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children at spawn
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_child,
                    args=(rank, world_size, port, timeout, fn, args, out_dir),
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        try:
            return _collect(procs, Path(out_dir), timeout + _STARTUP_GRACE_S)
        finally:
            _kill(procs)


def _raise_first_failure(
    failures: dict[int, dict[str, Any]], procs: list[Any], out_dir: Path
) -> None:
    """Give the other ranks a moment to report, then raise for the rank that failed first.

    A rank that raises makes its peers fail too (connection closed by peer), so the root
    cause is the earliest failure, not the lowest failing rank.
    """
    grace = time.monotonic() + _FAILURE_GRACE_S
    while time.monotonic() < grace and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    for rank in range(len(procs)):
        path = out_dir / f"rank{rank}.pt"
        if rank not in failures and path.exists():
            report = torch.load(path, weights_only=False)
            if not report["ok"]:
                failures[rank] = report
    if failures.get(0, {}).get("port_taken"):  # the others' failures follow from it
        raise _PortTakenError(failures[0]["traceback"])
    rank = min(failures, key=lambda r: (failures[r]["time"], r))
    tb = failures[rank]["traceback"]
    others = sorted(set(failures) - {rank})
    also = f" (ranks {others} failed after it)" if others else ""
    raise DistributedTestError(
        f"rank {rank} of {len(procs)} raised{also}:\n{tb}", rank=rank, child_traceback=tb
    )


def _collect(procs: list[Any], out_dir: Path, limit_s: float) -> list[Any]:
    """Wait for every rank's result file; fail fast on the first error."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + limit_s
    while len(results) < world_size:
        for rank, proc in enumerate(procs):
            if rank in results:
                continue
            path = out_dir / f"rank{rank}.pt"
            if path.exists():
                report = torch.load(path, weights_only=False)
                if not report["ok"]:
                    _raise_first_failure({rank: report}, procs, out_dir)
                results[rank] = report["value"]
            elif not proc.is_alive():
                proc.join()
                if not path.exists():  # it may have written the file just before exiting
                    raise DistributedTestError(
                        f"rank {rank} of {world_size} exited with code {proc.exitcode} "
                        "without reporting a result",
                        rank=rank,
                    )
        if len(results) < world_size:
            if time.monotonic() > deadline:
                pending = [r for r in range(world_size) if r not in results]
                raise DistributedTestError(
                    f"distributed run timed out after {limit_s:.0f} s; ranks {pending} "
                    "did not finish (killed)"
                )
            time.sleep(0.02)
    return [results[r] for r in range(world_size)]
