"""The one place where dkfac runs collectives: bucketed async ops and a byte ledger.

:class:`Communicator` wraps ``torch.distributed`` on the default group or a given one and
never calls ``init_process_group``. When ``torch.distributed`` is not initialised, or the
group has a single rank, every operation is a local no-op that records nothing, so
single-process code runs unchanged (tensors are left untouched, even with
``pack_symmetric``; arguments are still validated). Ranks (``src``, ``owners``) are always
*global* ranks.

Every operation launches all its buckets asynchronously and returns a :class:`CommHandle`;
``handle.wait()`` waits for them and writes the results back into the caller's tensors in
place. Tensors are flattened into buckets of at most ``bucket_bytes`` bytes (a tensor larger
than that gets a bucket of its own); a bucket holds tensors of one dtype and device.

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

import logging
from collections.abc import Callable, Sequence
from copy import deepcopy
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "COLLECTIVES",
    "KINDS",
    "CommHandle",
    "CommLedger",
    "Communicator",
    "Kind",
    "pack_triangle",
    "unpack_triangle",
]

logger = logging.getLogger(__name__)

Kind = Literal["gradients", "factors", "inverses", "preconditioned"]
Collective = Literal[
    "all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce", "all_to_all"
]
ReduceOpName = Literal["mean", "sum"]

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


def pack_triangle(sym: Tensor) -> Tensor:
    """Upper triangle (diagonal included) of a square matrix, row-major, as a 1-D tensor.

    Args:
        sym: ``n×n`` matrix.

    Returns:
        A new 1-D tensor of ``n(n+1)/2`` entries.

    Raises:
        ValueError: If ``sym`` is not a square 2-D tensor.
    """
    if sym.dim() != 2 or sym.shape[0] != sym.shape[1]:
        raise ValueError(f"sym must be a square matrix, got shape {tuple(sym.shape)}")
    n = sym.shape[0]
    rows, cols = torch.triu_indices(n, n, device=sym.device)
    return sym[rows, cols]


def unpack_triangle(flat: Tensor, n: int) -> Tensor:
    """Symmetric ``n×n`` matrix from the output of :func:`pack_triangle`.

    Args:
        flat: 1-D tensor of ``n(n+1)/2`` entries.
        n: Matrix side.

    Returns:
        A new symmetric matrix whose upper and lower triangles both equal ``flat``'s entries.

    Raises:
        ValueError: If ``flat`` has the wrong shape.
    """
    if flat.dim() != 1 or flat.numel() != n * (n + 1) // 2:
        raise ValueError(
            f"flat must be 1-D with n(n+1)/2 = {n * (n + 1) // 2} entries, "
            f"got shape {tuple(flat.shape)}"
        )
    out = flat.new_zeros(n, n)
    rows, cols = torch.triu_indices(n, n, device=flat.device)
    out[rows, cols] = flat
    out[cols, rows] = flat
    return out


class CommHandle:
    """Pending collectives; :meth:`wait` finishes them and writes results back in place."""

    def __init__(self, works: Sequence[Any] = (), finalizers: Sequence[Callable[[], None]] = ()):
        """Wrap launched ``torch.distributed`` works and the callbacks that run after them.

        Args:
            works: Objects with a ``wait()`` method (``dist.Work``).
            finalizers: Callables run once, in order, after every work has completed.
        """
        self._works = list(works)
        self._finalizers = list(finalizers)
        self._done = False

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed."""
        return self._done

    def wait(self) -> None:
        """Block until every collective finished and results are in place (idempotent)."""
        if self._done:
            return
        for work in self._works:
            work.wait()
        for fin in self._finalizers:
            fin()
        self._works.clear()
        self._finalizers.clear()
        self._done = True


class _Bucket:
    """Tensors flattened into one contiguous buffer (packed triangles where ``packed``)."""

    def __init__(self, tensors: list[Tensor], packed: list[bool], kinds: list[Kind]) -> None:
        self.tensors = tensors
        self.packed = packed
        self.kinds = kinds
        parts = [
            pack_triangle(t) if p else t.reshape(-1) for t, p in zip(tensors, packed, strict=True)
        ]
        self.numels = [p.numel() for p in parts]
        self.flat = torch.cat(parts)  # always a fresh buffer: callers' tensors stay intact

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def bytes_by_kind(self) -> dict[Kind, int]:
        """Bytes of the buffer that belong to each kind (they sum to :attr:`nbytes`)."""
        out: dict[Kind, int] = {}
        for kind, numel in zip(self.kinds, self.numels, strict=True):
            out[kind] = out.get(kind, 0) + numel * self.flat.element_size()
        return out

    def unflatten(self, scale: float | None = None) -> None:
        flat = self.flat if scale is None else self.flat.mul_(scale)
        parts = zip(self.tensors, self.packed, flat.split(self.numels), strict=True)
        for t, packed, part in parts:
            if packed:
                t.copy_(unpack_triangle(part, t.shape[0]))
            else:
                t.copy_(part.view(t.shape))


class Communicator:
    """Bucketed asynchronous collectives over a process group, with a byte ledger.

    Args:
        group: Process group; ``None`` means the default group.
        ledger: Where bytes are recorded; a new :class:`CommLedger` if ``None``.
        bucket_bytes: Maximum size of one flat bucket in bytes (after packing).

    Attributes:
        rank: This process's global rank (0 without a process group).
        ranks: Global ranks of the group, ascending as the group orders them.
        world_size: Number of ranks in the group.
        active: False when every operation is a local no-op (no process group, or 1 rank).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ledger: CommLedger | None = None,
        bucket_bytes: int = 25 * 2**20,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.group = group
        self.ledger = ledger if ledger is not None else CommLedger()
        self.bucket_bytes = int(bucket_bytes)
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.ranks: list[int] = [0]
        if initialized:
            self.ranks = (
                dist.get_process_group_ranks(group)
                if group is not None
                else list(range(dist.get_world_size()))
            )
        self.world_size = len(self.ranks)
        self.active = initialized and self.world_size > 1

    def all_reduce(
        self,
        tensors: Sequence[Tensor],
        kind: Kind,
        op: ReduceOpName = "mean",
        pack_symmetric: bool = False,
    ) -> CommHandle:
        """Sum or average ``tensors`` across the group, in place after ``wait()``.

        Args:
            tensors: Tensors to reduce (any shapes and order, the same on every rank).
            kind: Ledger kind.
            op: ``"mean"`` (sum / world size, floating tensors) or ``"sum"``.
            pack_symmetric: Send only upper triangles; every tensor must be square and the
                results are exactly symmetric (built from the reduced upper triangle).

        Returns:
            A handle; results are in ``tensors`` after ``handle.wait()``.
        """
        return self._launch("all_reduce", tensors, None, kind, op, pack_symmetric)

    def broadcast(
        self, tensors: Sequence[Tensor], src: int, kind: Kind, pack_symmetric: bool = False
    ) -> CommHandle:
        """Copy ``src``'s ``tensors`` to every rank of the group, in place after ``wait()``.

        Args:
            tensors: Tensors (same shapes on every rank); read on ``src``, overwritten elsewhere.
            src: Global rank of the sender.
            kind: Ledger kind.
            pack_symmetric: Send only upper triangles (square matrices); every rank, ``src``
                included, ends with the symmetric matrix built from ``src``'s upper triangle.

        Returns:
            A handle; results are in ``tensors`` after ``handle.wait()``.
        """
        owners = [src] * len(tensors)
        return self._launch("broadcast", tensors, owners, kind, None, pack_symmetric)

    def reduce(
        self,
        tensors: Sequence[Tensor],
        dst: int,
        kind: Kind,
        op: ReduceOpName = "mean",
        pack_symmetric: bool = False,
    ) -> CommHandle:
        """Reduce ``tensors`` onto ``dst``; other ranks' tensors are left unchanged.

        Args:
            tensors: Tensors to reduce (same list on every rank).
            dst: Global rank that receives the result.
            kind: Ledger kind.
            op: ``"mean"`` or ``"sum"``.
            pack_symmetric: Send only upper triangles (square matrices).

        Returns:
            A handle; ``dst``'s ``tensors`` hold the result after ``handle.wait()``.
        """
        owners = [dst] * len(tensors)
        return self._launch("reduce", tensors, owners, kind, op, pack_symmetric)

    def reduce_to_owners(
        self,
        tensors: Sequence[Tensor],
        owners: Sequence[int],
        kind: Kind,
        op: ReduceOpName = "mean",
        pack_symmetric: bool = False,
    ) -> CommHandle:
        """Owner-sharded reduce-scatter: each tensor is reduced onto its owner only.

        Implemented as one async ``dist.reduce`` per (owner, bucket), so shards need not be
        equal and nothing is padded. After ``wait()`` only the owner's copy of a tensor holds
        the reduced value; non-owners' copies are left unchanged.

        Args:
            tensors: Tensors to reduce (same list on every rank).
            owners: Global owner rank of each tensor.
            kind: Ledger kind.
            op: ``"mean"`` or ``"sum"``.
            pack_symmetric: Send only upper triangles (square matrices, e.g. factors).

        Returns:
            A handle to wait on.
        """
        return self._launch("reduce_scatter", tensors, owners, kind, op, pack_symmetric)

    def all_gather_from_owners(
        self,
        tensors: Sequence[Tensor],
        owners: Sequence[int],
        kind: Kind,
        pack_symmetric: bool = False,
    ) -> CommHandle:
        """Make every tensor, valid on its owner, valid on every rank.

        Implemented as one async ``dist.broadcast`` per (owner, bucket) from the owner.

        Args:
            tensors: Tensors (same shapes on every rank); read on the owner, overwritten
                elsewhere.
            owners: Global owner rank of each tensor.
            kind: Ledger kind.
            pack_symmetric: Send only upper triangles (square matrices).

        Returns:
            A handle; every rank's ``tensors`` hold the owners' values after ``wait()``.
        """
        return self._launch("all_gather", tensors, owners, kind, None, pack_symmetric)

    def reduce_to_owners_mixed(
        self,
        tensors: Sequence[Tensor],
        owners: Sequence[int],
        kinds: Sequence[Kind],
        pack_symmetric: Sequence[bool],
        op: ReduceOpName = "mean",
    ) -> CommHandle:
        """:meth:`reduce_to_owners` of tensors of several kinds in the same buffers.

        One collective per (owner, bucket) carries, e.g., a layer's gradient and its
        statistics together; the ledger records each kind's share of the buffers under
        ``reduce_scatter``, exactly what separate calls per kind would record.

        Args:
            tensors: Tensors to reduce (same list on every rank).
            owners: Global owner rank of each tensor.
            kinds: Ledger kind of each tensor.
            pack_symmetric: Per tensor, send only its upper triangle (square matrices).
            op: ``"mean"`` or ``"sum"``.

        Returns:
            A handle; the owners' ``tensors`` hold the results after ``wait()``.
        """
        return self._launch("reduce_scatter", tensors, owners, kinds, op, pack_symmetric)

    def all_gather_rows(self, tensor: Tensor, kind: Kind) -> tuple[Tensor, CommHandle]:
        """Concatenates every rank's ``(m, d)`` row block along dim 0, in group order.

        Used for low-rank factors ``U`` (their ``Uᵀ`` row blocks): the concatenation of the
        ranks' rows is the rows of the global batch. ``tensor`` must have the same shape and
        dtype on every rank (equal local batches).

        Args:
            tensor: A 2-D ``(m, d)`` tensor.
            kind: Ledger kind.

        Returns:
            ``(out, handle)``: ``out`` is ``(P·m, d)`` and valid after ``handle.wait()``
            (``tensor`` itself, with a no-op handle, when the communicator is inactive).
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"tensor must be a (m, d) matrix, got shape {tuple(tensor.shape)}")
        if not self.active:
            return tensor, CommHandle()
        if self.rank not in self.ranks:
            raise RuntimeError(f"rank {self.rank} is not a member of this communicator's group")
        source = tensor.contiguous()
        out = torch.empty(
            (self.world_size * source.shape[0], source.shape[1]),
            dtype=source.dtype,
            device=source.device,
        )
        parts = list(out.chunk(self.world_size, dim=0))
        self.ledger.record(kind, "all_gather", out.numel() * out.element_size())
        with torch.profiler.record_function("dkfac.comm.all_gather"):
            work = dist.all_gather(parts, source, group=self.group, async_op=True)
        return out, CommHandle([work])

    def all_to_all(
        self,
        send: Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        kind: Kind,
        nbytes: int,
    ) -> tuple[Tensor, CommHandle]:
        """Sends ``send_counts[j]`` entries of the flat ``send`` to the ``j``-th rank of the
        group (in order) and receives ``recv_counts[j]`` from it (one ``all_to_all_single``).

        Args:
            send: A 1-D tensor of ``sum(send_counts)`` entries.
            send_counts: Entries for each rank of the group (this rank's own included).
            recv_counts: Entries from each rank of the group.
            kind: Ledger kind.
            nbytes: What the ledger records: the bytes every rank together sends to others,
                the same on every rank (the plan that made the counts knows it).

        Returns:
            ``(out, handle)``: ``out`` holds the received entries, by sending rank, after
            ``handle.wait()`` (``send`` itself, with a no-op handle, when inactive).
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if len(send_counts) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(
                f"send_counts and recv_counts need one entry per rank ({self.world_size}), got "
                f"{len(send_counts)} and {len(recv_counts)}"
            )
        if send.dim() != 1 or send.numel() != sum(send_counts):
            raise ValueError(
                f"send must be 1-D with sum(send_counts) = {sum(send_counts)} entries, got shape "
                f"{tuple(send.shape)}"
            )
        if not self.active:
            return send, CommHandle()
        out = send.new_empty(sum(recv_counts))
        self.ledger.record(kind, "all_to_all", nbytes)
        with torch.profiler.record_function("dkfac.comm.all_to_all"):
            work = dist.all_to_all_single(
                out,
                send,
                list(recv_counts),
                list(send_counts),
                group=self.group,
                async_op=True,
            )
        return out, CommHandle([work])

    # ------------------------------------------------------------- control messages
    # A few bytes per step that keep ranks in agreement (finite flags, KL-clip partial sums,
    # shapes of solver states). They are blocking and NOT recorded in the ledger, which
    # counts only the payload kinds in KINDS.

    def all_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical AND of a boolean vector across the group (blocking).

        Args:
            flags: 1-D bool tensor, the same length on every rank.

        Returns:
            A bool tensor on ``flags``' device, ``True`` where every rank had ``True``.
        """
        if flags.dtype != torch.bool:
            raise TypeError(f"flags must be a bool tensor, got {flags.dtype}")
        if not self.active:
            return flags.clone()
        bad = (~flags).to(torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=self.group)
        return bad == 0

    def sum_control(self, values: Tensor) -> Tensor:
        """Sum of a small floating tensor over the group (blocking, not in the ledger)."""
        out = values.clone()
        if self.active:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def exchange_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, indexed by position in :attr:`ranks` (blocking)."""
        if not self.active:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def _launch(
        self,
        collective: Collective,
        tensors: Sequence[Tensor],
        owners: Sequence[int] | None,
        kind: Kind | Sequence[Kind],
        op: str | None,
        packed: bool | Sequence[bool],
    ) -> CommHandle:
        """Validate, bucket per owner, record bytes per kind, launch every bucket async.

        ``kind`` and ``packed`` are one value for every tensor or one value per tensor.
        """
        kinds = [kind] * len(tensors) if isinstance(kind, str) else list(kind)
        packs = [packed] * len(tensors) if isinstance(packed, bool) else list(packed)
        if len(kinds) != len(tensors) or len(packs) != len(tensors):
            raise ValueError(
                f"kinds and pack flags need one entry per tensor: {len(kinds)}, {len(packs)} "
                f"!= {len(tensors)}"
            )
        for k in kinds:
            if k not in KINDS:
                raise ValueError(f"kind must be one of {KINDS}, got {k!r}")
        if op is not None and op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        for i, (t, p) in enumerate(zip(tensors, packs, strict=True)):
            if not isinstance(t, Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if p and (t.dim() != 2 or t.shape[0] != t.shape[1]):
                raise ValueError(
                    f"pack_symmetric needs square matrices; tensors[{i}] has shape {tuple(t.shape)}"
                )
        by_owner = self._split_by_owner(len(tensors), owners)
        if not self.active or not tensors:
            return CommHandle()
        if self.rank not in self.ranks:
            raise RuntimeError(f"rank {self.rank} is not a member of this communicator's group")
        plan = [
            (
                o,
                self._buckets(
                    [tensors[i] for i in idx], [packs[i] for i in idx], [kinds[i] for i in idx]
                ),
            )
            for o, idx in by_owner.items()
        ]
        buckets = [b for _, bs in plan for b in bs]
        by_kind: dict[Kind, int] = {}
        for b in buckets:
            for k, n in b.bytes_by_kind().items():
                by_kind[k] = by_kind.get(k, 0) + n
        for k in sorted(by_kind, key=KINDS.index):  # a fixed order of kinds
            self.ledger.record(k, collective, by_kind[k])
        logger.debug(
            "%s kinds=%s buckets=%d world=%d",
            *(collective, by_kind, len(buckets), self.world_size),
        )
        scale = 1.0 / self.world_size if op == "mean" else None
        reduce_op = dist.ReduceOp.SUM
        works: list[Any] = []
        fins: list[Callable[[], None]] = []
        with torch.profiler.record_function(f"dkfac.comm.{collective}"):
            for owner, bs in plan:
                for b in bs:
                    if collective == "all_reduce":
                        work = dist.all_reduce(
                            b.flat, op=reduce_op, group=self.group, async_op=True
                        )
                        fins.append(partial(b.unflatten, scale))
                    elif op is not None:  # reduce / reduce_scatter: result only on the owner
                        work = dist.reduce(
                            b.flat, dst=owner, op=reduce_op, group=self.group, async_op=True
                        )
                        if owner == self.rank:
                            fins.append(partial(b.unflatten, scale))
                    else:  # broadcast / all_gather: the owner's copy is already right
                        work = dist.broadcast(b.flat, src=owner, group=self.group, async_op=True)
                        if any(b.packed) or owner != self.rank:
                            fins.append(partial(b.unflatten, None))
                    works.append(work)
        return CommHandle(works, fins)

    def _split_by_owner(self, count: int, owners: Sequence[int] | None) -> dict[int, list[int]]:
        """Tensor indices grouped by owner, owners ascending (identical on all ranks)."""
        if owners is None:
            return {-1: list(range(count))}
        if len(owners) != count:
            raise ValueError(f"owners must have one entry per tensor: {len(owners)} != {count}")
        by_owner: dict[int, list[int]] = {}
        for i, owner in enumerate(owners):
            if owner not in self.ranks:
                raise ValueError(
                    f"owner/src rank {owner!r} of tensors[{i}] is not in the group {self.ranks}"
                )
            by_owner.setdefault(owner, []).append(i)
        return {o: by_owner[o] for o in sorted(by_owner)}

    def _buckets(
        self, tensors: Sequence[Tensor], packed: Sequence[bool], kinds: Sequence[Kind]
    ) -> list[_Bucket]:
        """Group tensors (order kept within each dtype/device) into size-capped buckets.

        ``packed`` and ``kinds`` (ledger kinds) hold one entry per tensor.
        """
        Entry = tuple[Tensor, bool, Kind]
        open_: dict[tuple[torch.dtype, torch.device], tuple[list[Entry], int]] = {}
        groups: list[list[Entry]] = []
        for entry in zip(tensors, packed, kinds, strict=True):
            t, pack, _ = entry
            n = t.shape[0] if pack else 0
            size = (n * (n + 1) // 2 if pack else t.numel()) * t.element_size()
            key = (t.dtype, t.device)
            members, used = open_.get(key, ([], 0))
            if members and used + size > self.bucket_bytes:
                groups.append(members)
                members, used = [], 0
            members.append(entry)
            open_[key] = (members, used + size)
        groups.extend(m for m, _ in open_.values() if m)
        return [
            _Bucket([t for t, _, _ in g], [p for _, p, _ in g], [k for _, _, k in g])
            for g in groups
        ]
