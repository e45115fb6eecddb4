"""Which gradient rows travel where in the sharded layout's owner exchange: a pure plan.

Under FSDP2 / HSDP each weight's averaged gradient is cut on dim 0 over the shard group;
under a strategy where only some ranks precondition a layer (``mem-opt``, ``dp``, ``kaisa``
with a gradient-worker fraction below 1) the exchange moves, per step:

1. to each rank that preconditions a layer (a *grad worker*), the rows of the layer's
   parameters it does not hold, each from the member of its own shard group that holds
   them (kind ``"gradients"``);
2. back to every rank, its own rows of the result, each from the grad worker that serves
   it (:func:`~dkfac.distributed.assignment.serving_worker`; kind ``"preconditioned"``).

The plan is a function of numbers only (parameter shapes, shards, placement), so every rank
computes the same one, tests check it without a process group, and a cost model prices the
exchange with :func:`exchange_bytes`, the bytes the ledger records.

Ranks are placement indices ``0..P-1``; ``shard[i]`` is rank ``i``'s index along the shard
dimension of the mesh and ``replica[i]`` the shard group it belongs to (HSDP: its
coordinate on the replicate dimension; FSDP2: 0 for all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "LayerRows",
    "ShardedParam",
    "Transfer",
    "exchange_bytes",
    "gather_plan",
    "needed_rows",
    "return_plan",
    "transfer_bytes",
]

Span = tuple[int, int]
"""``[start, stop)`` rows."""


@dataclass(frozen=True)
class ShardedParam:
    """One parameter cut on dim 0.

    Attributes:
        rows: Its dim-0 size.
        row_numel: Entries in one dim-0 row.
        itemsize: Bytes per entry of its gradient.
        parts: Shards along dim 0 (1: every rank holds all of it).
    """

    rows: int
    row_numel: int
    itemsize: int
    parts: int

    def rows_of(self, shard: int) -> Span:
        """Rows of shard ``shard`` (``torch.chunk``'s cut, as DTensor's ``Shard(0)``;
        empty past the end); all rows when the parameter is not cut."""
        if self.parts <= 1:
            return 0, self.rows
        chunk = math.ceil(self.rows / self.parts)
        start = min(shard * chunk, self.rows)
        return start, min(start + chunk, self.rows)

    def nbytes(self, span: Span) -> int:
        """Bytes of the gradient rows ``span``."""
        return (span[1] - span[0]) * self.row_numel * self.itemsize


@dataclass(frozen=True)
class LayerRows:
    """One preconditioned layer, as the exchange sees it.

    Attributes:
        parts: ``(parameter index, start, stop)``: the rows of each parameter it reads.
        workers: The ranks that precondition it.
        sources: ``sources[d]``: the grad worker that returns rank ``d``'s rows.
    """

    parts: tuple[tuple[int, int, int], ...]
    workers: tuple[int, ...]
    sources: tuple[int, ...]


@dataclass(frozen=True, order=True)
class Transfer:
    """Rows ``[start, stop)`` of parameter ``param``'s gradient, from ``src`` to ``dst``."""

    src: int
    dst: int
    param: int
    start: int
    stop: int


def _intersect(a: Span, b: Span) -> Span | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def _merge(spans: Sequence[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def needed_rows(layers: Sequence[LayerRows], rank: int) -> dict[int, list[Span]]:
    """Parameter index -> the rows ``rank`` reads to precondition its layers (merged, sorted);
    parameters it needs nothing of are absent."""
    spans: dict[int, list[Span]] = {}
    for layer in layers:
        if rank in layer.workers:
            for param, start, stop in layer.parts:
                spans.setdefault(param, []).append((start, stop))
    return {param: _merge(s) for param, s in sorted(spans.items())}


def gather_plan(
    params: Sequence[ShardedParam],
    layers: Sequence[LayerRows],
    shard: Sequence[int],
    replica: Sequence[int],
) -> list[Transfer]:
    """The rows each grad worker receives before the step, each from the member of its
    shard group that holds them, sorted.

    Raises:
        ValueError: If ``shard`` and ``replica`` differ in length, or a worker's shard group
            lacks a rank holding rows it needs.
    """
    if len(shard) != len(replica):
        raise ValueError(
            f"shard and replica need one entry per rank: {len(shard)} != {len(replica)}"
        )
    holder = {(replica[i], shard[i]): i for i in range(len(shard))}
    transfers: list[Transfer] = []
    for worker in range(len(shard)):
        for index, spans in needed_rows(layers, worker).items():
            param = params[index]
            if param.parts <= 1:
                continue
            for part in range(param.parts):
                if part == shard[worker]:
                    continue
                for span in spans:
                    rows = _intersect(span, param.rows_of(part))
                    if rows is None:
                        continue
                    src = holder.get((replica[worker], part))
                    if src is None:
                        raise ValueError(
                            f"rank {worker} needs rows {rows} of parameter {index}, and no rank "
                            f"of its shard group holds shard {part}"
                        )
                    transfers.append(Transfer(src, worker, index, *rows))
    return sorted(transfers)


def return_plan(
    params: Sequence[ShardedParam], layers: Sequence[LayerRows], shard: Sequence[int]
) -> list[Transfer]:
    """Each rank's rows of every layer's result, from the grad worker that serves it, sorted
    (a rank that preconditions a layer serves itself and receives nothing for it)."""
    transfers: list[Transfer] = []
    for layer in layers:
        for dst, src in enumerate(layer.sources):
            if src == dst:
                continue
            for index, start, stop in layer.parts:
                rows = _intersect((start, stop), params[index].rows_of(shard[dst]))
                if rows is not None:
                    transfers.append(Transfer(src, dst, index, *rows))
    return sorted(transfers)


def transfer_bytes(transfers: Sequence[Transfer], params: Sequence[ShardedParam]) -> int:
    """Bytes the transfers move (the rows' gradient entries)."""
    return sum(params[t.param].nbytes((t.start, t.stop)) for t in transfers)


def exchange_bytes(
    params: Sequence[ShardedParam],
    layers: Sequence[LayerRows],
    shard: Sequence[int],
    replica: Sequence[int],
) -> Mapping[str, int]:
    """Bytes of one step's owner exchange, as the ledger records them (on every rank, the
    whole exchange's): ``{"gradients": rows to the grad workers, "preconditioned": rows of
    the results back to every rank}``."""
    return {
        "gradients": transfer_bytes(gather_plan(params, layers, shard, replica), params),
        "preconditioned": transfer_bytes(return_plan(params, layers, shard), params),
    }
