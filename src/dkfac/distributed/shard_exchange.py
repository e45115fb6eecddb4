"""The owner exchange: gradient rows to the ranks that precondition, results' rows back.

Under FSDP2 / HSDP with a strategy where only some ranks precondition a layer (``mem-opt``,
``dp``, ``kaisa`` with a gradient-worker fraction below 1), :class:`OwnerExchange` runs the
plan of :mod:`~dkfac.distributed.shard_plan`: before the step each grad worker receives the
rows of its layers' gradients it does not hold, and after it every rank receives its own
rows of each layer's result from the grad worker that serves it. Each phase is one
``all_to_all_single`` per bucket of about ``bucket_bytes`` (over the strategy's group, on the
ledger as ``"all_to_all"``: ``"gradients"`` before, ``"preconditioned"`` after), so a rank
holds the full gradient of the layers it preconditions only, never every layer's.

:class:`OwnerDelivery` stands in for the strategy's delivery phase: the layout returns the
rows, so the strategy's broadcast of preconditioned gradients does not run, and the KL-clip
sum adds each layer once, on its owner (which holds its full raw and preconditioned
gradients), over every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dkfac.distributed.comm import Communicator
from dkfac.distributed.ledger import Kind
from dkfac.distributed.shard_plan import (
    LayerRows,
    ShardedParam,
    Transfer,
    gather_plan,
    needed_rows,
    return_plan,
    transfer_bytes,
)
from dkfac.distributed.strategy_base import Strategy

__all__ = ["Delivery", "OwnerDelivery", "OwnerExchange"]


class Delivery(Protocol):
    """What the step's delivery and KL-clip phases ask: a strategy, or :class:`OwnerDelivery`."""

    def distribute(self, finals: Mapping[str, Tensor], ready_finite: Sequence[str]) -> list[str]:
        """Delivers the preconditioned gradients; returns the layers valid on this rank."""
        ...

    def kl_layers(self, ready_finite: Sequence[str]) -> list[str]:
        """Layers whose ``⟨V, ∇W⟩`` this rank adds to the KL-clip sum."""
        ...

    def reduce_kl(self, partial: Tensor) -> Tensor:
        """The KL-clip sum over all layers from this rank's partial sum."""
        ...


class OwnerDelivery:
    """The delivery phase when the sharded layout returns the rows (no traffic here).

    Args:
        strategy: Says which layers this rank preconditions and owns.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def distribute(self, finals: Mapping[str, Tensor], ready_finite: Sequence[str]) -> list[str]:
        """The ready layers this rank preconditioned (their full results are written back;
        the layout sends each rank its rows after the step)."""
        del finals
        return [name for name in ready_finite if self.strategy.preconditions(name)]

    def kl_layers(self, ready_finite: Sequence[str]) -> list[str]:
        """The ready layers this rank owns: each layer once, where its full gradients are."""
        return [name for name in ready_finite if self.strategy.is_owner(name)]

    def reduce_kl(self, partial: Tensor) -> Tensor:
        """Sum of the owners' partial sums over the strategy's group."""
        return self.strategy.comm.sum_control(partial)


class OwnerExchange:
    """Runs the owner exchange's plan for one rank.

    Args:
        params: The sharded parameters (DTensors), in plan order.
        shapes: Their :class:`ShardedParam` numbers, in the same order.
        layers: Layer name -> its :class:`LayerRows` (parameter indices into ``params``).
        shard: Shard index of each rank of ``comm`` (placement indices).
        replica: Shard group of each rank.
        comm: The strategy's communicator (its ranks are the placement indices).
    """

    def __init__(
        self,
        params: Sequence[DTensor],
        shapes: Sequence[ShardedParam],
        layers: Mapping[str, LayerRows],
        shard: Sequence[int],
        replica: Sequence[int],
        comm: Communicator,
    ) -> None:
        self.params = list(params)
        self.shapes = list(shapes)
        self.layers = dict(layers)
        self.shard = tuple(shard)
        self.replica = tuple(replica)
        self.comm = comm
        self.me = comm.ranks.index(comm.rank) if comm.rank in comm.ranks else 0
        self._plans: dict[frozenset[int], tuple[list[Transfer], list[Transfer]]] = {}

    def needed(self, present: frozenset[int]) -> dict[int, list[tuple[int, int]]]:
        """Parameter index -> rows this rank reads to precondition its present layers."""
        return needed_rows(self._present_layers(present), self.me)

    def completed(self, present: frozenset[int]) -> frozenset[int]:
        """``present`` with every parameter of each layer that has one in it (a layer whose
        bias had no gradient takes it as zeros, as the step would)."""
        more = {
            index
            for layer in self.layers.values()
            if any(i in present for i, _, _ in layer.parts)
            for index, _, _ in layer.parts
        }
        return present | more

    def _present_layers(self, present: frozenset[int]) -> list[LayerRows]:
        return [
            layer
            for layer in self.layers.values()
            if all(index in present for index, _, _ in layer.parts)
        ]

    def _plan(self, present: frozenset[int]) -> tuple[list[Transfer], list[Transfer]]:
        if present not in self._plans:
            layers = self._present_layers(present)
            self._plans[present] = (
                gather_plan(self.shapes, layers, self.shard, self.replica),
                return_plan(self.shapes, layers, self.shard),
            )
        return self._plans[present]

    def _local_start(self, index: int) -> int:
        """First global row of this rank's shard of parameter ``index``."""
        return self.shapes[index].rows_of(self.shard[self.me])[0]

    def gather(self, present: frozenset[int], full: Mapping[int, Tensor]) -> None:
        """Fills the rows of ``full`` (parameter index -> full-shape gradient this rank
        reads, its own rows already in) that other ranks hold."""
        transfers = self._plan(present)[0]
        for bucket in self._buckets(transfers):

            def read(t: Transfer) -> Tensor:
                local = _local_grad(self.params[t.param])
                offset = self._local_start(t.param)
                return local[t.start - offset : t.stop - offset]

            def write(t: Transfer, rows: Tensor) -> None:
                full[t.param][t.start : t.stop].copy_(rows)

            self._run(bucket, read, write, "gradients")

    def give_back(self, present: frozenset[int], full: Mapping[int, Tensor]) -> None:
        """Writes into every rank's shard its rows of the results: rows it computed itself
        from ``full`` (where it holds a full gradient), the others received."""
        for index, grad in full.items():
            start, stop = self.shapes[index].rows_of(self.shard[self.me])
            local = _local_grad(self.params[index])
            if local.data_ptr() != grad.data_ptr():
                local.copy_(grad[start:stop])
        for bucket in self._buckets(self._plan(present)[1]):

            def read(t: Transfer) -> Tensor:
                return full[t.param][t.start : t.stop]

            def write(t: Transfer, rows: Tensor) -> None:
                offset = self._local_start(t.param)
                _local_grad(self.params[t.param])[t.start - offset : t.stop - offset].copy_(rows)

            self._run(bucket, read, write, "preconditioned")

    def _buckets(self, transfers: Sequence[Transfer]) -> list[list[Transfer]]:
        """Transfers grouped by parameter into buckets of one dtype and about
        ``bucket_bytes`` (a parameter's transfers stay in one bucket); the same on every rank."""
        by_param: dict[int, list[Transfer]] = {}
        for t in transfers:
            by_param.setdefault(t.param, []).append(t)
        open_: dict[torch.dtype, tuple[list[Transfer], int]] = {}
        buckets: list[list[Transfer]] = []
        for index in sorted(by_param):
            size = transfer_bytes(by_param[index], self.shapes)
            dtype = self.params[index].dtype
            members, used = open_.get(dtype, ([], 0))
            if members and used + size > self.comm.bucket_bytes:
                buckets.append(members)
                members, used = [], 0
            open_[dtype] = ([*members, *by_param[index]], used + size)
        buckets.extend(m for m, _ in open_.values() if m)
        return buckets

    def _run(self, bucket: list[Transfer], read: _Read, write: _Write, kind: Kind) -> None:
        """One ``all_to_all_single`` of a bucket: this rank sends what ``read`` gives for
        its outgoing transfers (by destination, in plan order) and ``write``s each incoming
        one (by source, in plan order)."""
        sends = sorted((t for t in bucket if t.src == self.me), key=lambda t: (t.dst, t))
        recvs = sorted(t for t in bucket if t.dst == self.me)
        world = len(self.shard)
        send_counts, recv_counts = [0] * world, [0] * world
        for t in sends:
            send_counts[t.dst] += (t.stop - t.start) * self.shapes[t.param].row_numel
        for t in recvs:
            recv_counts[t.src] += (t.stop - t.start) * self.shapes[t.param].row_numel
        dtype = self.params[bucket[0].param].dtype
        device = _local_grad(self.params[bucket[0].param]).device
        pieces = [read(t).reshape(-1) for t in sends]
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        out, handle = self.comm.all_to_all(
            flat.to(dtype), send_counts, recv_counts, kind, transfer_bytes(bucket, self.shapes)
        )
        handle.wait()
        offset = 0
        for t in recvs:
            shape = self.shapes[t.param]
            count = (t.stop - t.start) * shape.row_numel
            rows = out[offset : offset + count]
            write(t, rows.view(t.stop - t.start, *self.params[t.param].shape[1:]))
            offset += count


class _Read(Protocol):
    def __call__(self, t: Transfer) -> Tensor: ...


class _Write(Protocol):
    def __call__(self, t: Transfer, rows: Tensor) -> None: ...


def _local_grad(param: DTensor) -> Tensor:
    """This rank's rows of the parameter's (sharded) gradient."""
    grad = param.grad
    assert isinstance(grad, DTensor)
    return grad.to_local()
