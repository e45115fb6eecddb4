"""The byte ledger of the collectives: the payload kinds and collectives it counts, and
:class:`CommLedger`, which records what every operation of
:class:`~dkfac.distributed.comm.Communicator` moves.

Byte-counting convention (what :class:`CommLedger` records)
-----------------------------------------------------------
Each operation records, on every participating rank and at launch time, the size of the
*logical message* it moves: the sum over the tensors it covers of ``numel × element_size``,
where a tensor sent with ``pack_symmetric=True`` counts as its packed upper triangle
(``n(n+1)/2`` elements for an ``n×n`` matrix). Bucketing adds no padding, so this equals the
total size of the flat buffers this rank passes to the underlying ``torch.distributed`` calls.
All ranks record the same number. It is a message size, not wire traffic (a ring all-reduce
of ``M`` bytes sends about ``2(P-1)/P · M`` bytes per rank).

====================================  ===================  ==================================
operation                             recorded collective  bytes recorded on every rank
====================================  ===================  ==================================
``all_reduce(ts)``                    ``all_reduce``       Σ size(t) (what each rank adds in)
``broadcast(ts, src)``                ``broadcast``        Σ size(t) (what ``src`` sends)
``reduce(ts, dst)``                   ``reduce``           Σ size(t) (what each rank adds in)
``reduce_to_owners(ts, owners)``      ``reduce_scatter``   Σ size(t) over *all* tensors
``reduce_to_owners_mixed(...)``       ``reduce_scatter``   Σ size(t) per kind, as above
``all_gather_from_owners(ts, own.)``  ``all_gather``       Σ size(t) over *all* tensors
``all_gather_rows(t)``                ``all_gather``       P · size(t) (the gathered result)
``all_to_all(send, ..., nbytes)``     ``all_to_all``       ``nbytes``: what *all* ranks send to
                                                           others (the caller's plan knows it)
====================================  ===================  ==================================

Example: ``all_reduce`` of a 3×4 and a 5-element float32 tensor records
``(12 + 5) · 4 = 68`` bytes; a packed 4×4 float32 factor records ``10 · 4 = 40`` bytes.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Literal

__all__ = ["COLLECTIVES", "KINDS", "Collective", "CommLedger", "Kind"]

Kind = Literal["gradients", "factors", "inverses", "preconditioned"]
Collective = Literal[
    "all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce", "all_to_all"
]

KINDS: tuple[str, ...] = ("gradients", "factors", "inverses", "preconditioned")
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "broadcast",
    "reduce_scatter",
    "all_gather",
    "reduce",
    "all_to_all",
)


class CommLedger:
    """Counts bytes communicated, by kind and by collective: per step and in total.

    Memory does not grow with the number of steps: the totals are running sums, and only
    the records of the last ``window`` closed steps are kept (a record per step forever
    cost about 560 bytes a step). See the module docstring for exactly what one operation
    records.

    Args:
        window: How many closed steps keep their per-step record (>= 1).

    Raises:
        ValueError: If ``window`` is not an integer >= 1.
    """

    WINDOW = 1024

    def __init__(self, window: int = WINDOW) -> None:
        """Create an empty ledger with an open step 0."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded."""
        self._total = dict.fromkeys(KINDS, 0)
        self._by_collective = dict.fromkeys(COLLECTIVES, 0)
        self._current = self._empty_step()
        self._steps: list[dict[str, Any]] = []
        self._closed = 0

    @staticmethod
    def _empty_step() -> dict[str, Any]:
        return {
            "by_kind": dict.fromkeys(KINDS, 0),
            "by_collective": dict.fromkeys(COLLECTIVES, 0),
            "bytes": 0,
        }

    def record(self, kind: Kind, collective: Collective, nbytes: int) -> None:
        """Add ``nbytes`` to the open step and the cumulative totals.

        Raises:
            ValueError: On an unknown kind or collective or a negative count.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        n = int(nbytes)
        self._total[kind] += n
        self._by_collective[collective] += n
        self._current["by_kind"][kind] += n
        self._current["by_collective"][collective] += n
        self._current["bytes"] += n

    def end_step(self) -> None:
        """Close the open step (keep its record, dropping the oldest beyond the window)."""
        self._steps.append(self._current)
        if len(self._steps) > self.window:
            del self._steps[0]
        self._closed += 1
        self._current = self._empty_step()

    @property
    def total_bytes(self) -> int:
        """All bytes recorded so far, including the open step."""
        return sum(self._total.values())

    @property
    def records_held(self) -> int:
        """Per-step records kept now (at most :attr:`window`)."""
        return len(self._steps)

    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot.

        Returns:
            ``{"total": {kind: bytes}, "total_bytes": int, "by_collective": {coll: bytes},
            "last_step": step, "current_step": step, "per_step": [step, ...],
            "steps": n, "first_step_in_window": k}`` where a step is
            ``{"by_kind": {kind: bytes}, "by_collective": {coll: bytes}, "bytes": int}``.
            Totals include the open step and every step since the start (or
            :meth:`reset`); ``last_step`` is the last closed step (all zeros before the first
            :meth:`end_step`); ``steps`` counts closed steps; ``per_step`` holds the last
            ``min(steps, window)`` closed steps, the first of them step
            ``first_step_in_window`` (0-based), so with fewer than ``window`` steps
            ``per_step[i]`` is step ``i``.
        """

        return {
            "total": dict(self._total),
            "total_bytes": self.total_bytes,
            "by_collective": dict(self._by_collective),
            "last_step": deepcopy(self._steps[-1] if self._steps else self._empty_step()),
            "current_step": deepcopy(self._current),
            "per_step": deepcopy(self._steps),
            "steps": self._closed,
            "first_step_in_window": self._closed - len(self._steps),
        }
