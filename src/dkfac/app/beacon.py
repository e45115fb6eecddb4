"""Where every rank of a job is, so that a stalled collective can say which rank it waited on.

A collective that times out says only that it timed out (gloo: "Timed out waiting 300000ms
for recv operation to complete"), on the ranks that waited, not which rank never came. Each
rank therefore keeps a :class:`Beacon`: the trainer calls :meth:`Beacon.enter` with the phase
it starts (``"training step 4"``, ``"evaluation"``, ``"checkpoint"``, ...), which only
stores a tuple; a daemon thread publishes it every ``interval_s`` seconds to the job's
rendezvous store under ``dkfac/beacon/<rank>``. Nothing is added to the training path.

* When a rank fails, the trainer prints :meth:`Beacon.report`: every rank's last published
  phase, and which ranks are behind (every rank runs the same sequence of phases, so the
  ones that entered the fewest are behind), e.g. ``rank 0: training step 4 (for 300 s);
  rank 1: training step 3 (for 302 s); behind: rank 1``.
* The thread also warns once per phase when this rank has stayed in one phase for more than
  ``stall_after_s`` (half the ``--dist-timeout``), with the same report: under NCCL a timed
  out rank is aborted by the watchdog thread, so this warning is what is left to read.

The phase is the trainer's: which K-FAC collective inside a training step is stalled (factor
all-reduce, inverse broadcast, ...) is not visible from here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

KEY = "dkfac/beacon/{rank}"
Where = tuple[str, int, int, float]  # phase, optimizer step, phases entered, since (epoch s)


class Beacon:
    """This rank's phase, published to a ``torch.distributed`` store by a daemon thread.

    Args:
        store: The job's store (any ``torch.distributed.Store``); ``None`` or one rank: the
            beacon only remembers the local phase.
        rank: This rank.
        world: Number of ranks.
        interval_s: Seconds between publications (> 0).
        stall_after_s: Warn when one phase lasts longer than this (``None``: never).
    """

    def __init__(
        self,
        store: Any | None,
        rank: int,
        world: int,
        *,
        interval_s: float = 2.0,
        stall_after_s: float | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.store = store if world > 1 else None
        self.rank, self.world = rank, world
        self.interval_s, self.stall_after_s = interval_s, stall_after_s
        self.where: Where = ("setup", 0, 0, time.time())
        self._published: Where | None = None
        self._warned: Where | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._run, name="dkfac-beacon", daemon=True)
            self._thread.start()

    def enter(self, phase: str, step: int) -> None:
        """Marks the start of ``phase`` at optimizer step ``step`` (no communication).

        Every rank runs the same sequence of phases, so the count of phases entered orders
        the ranks: the ones with the lowest count are behind.
        """
        self.where = (phase, step, self.where[2] + 1, time.time())

    def publish(self) -> None:
        """Writes this rank's phase to the store now (the thread does it every interval)."""
        where = self.where
        if self.store is None or where == self._published:
            return
        self.store.set(KEY.format(rank=self.rank), json.dumps(_as_dict(where)))
        self._published = where

    def positions(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published phase (ranks that never published are left out)."""
        if self.store is None:
            return {self.rank: _as_dict(self.where)}
        found: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            key = KEY.format(rank=rank)
            try:
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
            except (RuntimeError, ValueError) as err:  # the store itself is gone
                logger.debug("beacon: cannot read %s: %s", key, err)
        found[self.rank] = _as_dict(self.where)  # our own, fresher than the store's copy
        return found

    def report(self) -> str:
        """``rank 0: training step 4 (for 6 s); rank 1: ...; behind: rank 1``."""
        now = time.time()
        seen = self.positions()
        parts = [
            f"rank {r}: {p['phase']} (for {now - float(p['since']):.0f} s)"
            for r, p in sorted(seen.items())
        ]
        silent = [r for r in range(self.world) if r not in seen]
        if silent:
            parts.append("never reported: " + ", ".join(f"rank {r}" for r in silent))
        counts = {r: int(p["count"]) for r, p in seen.items()}
        low = min(counts.values())
        if low < max(counts.values()):
            behind = [r for r, c in sorted(counts.items()) if c == low]
            parts.append("behind: " + ", ".join(f"rank {r}" for r in behind))
        return "; ".join(parts)

    def check_stall(self) -> bool:
        """Warns (once per phase) when this rank has been in one phase too long."""
        where = self.where
        if self.stall_after_s is None or where == self._warned:
            return False
        if time.time() - where[3] <= self.stall_after_s:
            return False
        self._warned = where
        logger.warning(
            "rank %d has been in %s for more than %.0f s; %s",
            self.rank,
            where[0],
            self.stall_after_s,
            self.report(),
        )
        return True

    def close(self) -> None:
        """Stops the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
                self.check_stall()
            except Exception as err:  # never let the beacon take the run down
                logger.debug("beacon: %s", err)


def _as_dict(where: Where) -> dict[str, Any]:
    phase, step, count, since = where
    return {"phase": phase, "step": step, "count": count, "since": since}
