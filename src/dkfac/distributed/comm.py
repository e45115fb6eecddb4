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

What each operation records in the ledger, and why, is in :mod:`dkfac.distributed.ledger`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from dkfac.distributed.buckets import bucket_tensors, split_by_owner
from dkfac.distributed.control import ControlMessages
from dkfac.distributed.ledger import KINDS, Collective, CommLedger, Kind

__all__ = ["CommHandle", "Communicator"]

logger = logging.getLogger(__name__)

ReduceOpName = Literal["mean", "sum"]


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


class Communicator(ControlMessages):
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
        by_owner = split_by_owner(len(tensors), owners, self.ranks)
        if not self.active or not tensors:
            return CommHandle()
        if self.rank not in self.ranks:
            raise RuntimeError(f"rank {self.rank} is not a member of this communicator's group")
        plan = [
            (
                o,
                bucket_tensors(
                    [tensors[i] for i in idx],
                    [packs[i] for i in idx],
                    [kinds[i] for i in idx],
                    self.bucket_bytes,
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
