"""Parameter layouts: where the weights and their averaged gradients live.

With DDP (or one process) every rank holds every weight and its whole averaged gradient: the
*replicated* layout, which needs nothing from this module. Under FSDP2
(``torch.distributed.fsdp.fully_shard``) and HSDP (``fully_shard`` on a 2-D mesh, replicate
× shard) each weight and its averaged gradient are DTensors cut on dim 0 (output rows /
output channels) over the shard dimension of the mesh: the *sharded* layout,
:class:`ShardedLayout` (found and checked by :func:`~dkfac.distributed.sharding.find_layout`).

The hooks see full activations and full output gradients either way (a layer runs on
unsharded weights), so factors are built and reduced as with DDP. What the sharded layout
adds is the gradient exchange around the step (:meth:`ShardedLayout.full_gradients`),
chosen for the strategy by :meth:`ShardedLayout.attach`:

* where every rank preconditions every layer, every rank's rows of the preconditioned
  layers' gradients are all-gathered (one all-gather per bucket of about ``bucket_bytes``,
  over the shard group, recorded as ``"gradients"``), the step runs on the full averaged
  gradients exactly as under DDP, and each rank keeps its own rows of the result;
* where only some ranks precondition a layer, the owner exchange
  (:mod:`~dkfac.distributed.shard_exchange`) sends the rows only to them and each rank's
  rows of the results back.

Either way the strategy's math is the serial math, so every strategy that is exact under
DDP stays exact.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Collection, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from dkfac.distributed.comm import Communicator
from dkfac.distributed.ledger import CommLedger
from dkfac.distributed.shard_exchange import Delivery, OwnerDelivery, OwnerExchange
from dkfac.distributed.shard_local import LocalDelivery, LocalRowsStrategy
from dkfac.distributed.shard_params import (
    ShardedParameter,
    grad_local,
    keep_local,
    keep_rows,
    own_rows,
    row_numel,
    set_local_grad,
)
from dkfac.distributed.shard_plan import LayerRows, ShardedParam
from dkfac.distributed.strategy_base import Strategy

__all__ = ["ShardedLayout"]

ParameterPart = tuple[Tensor, slice | None]
"""A parameter a layer reads and its rows (``None``: all), as blocks describe them."""


class ShardedLayout:
    """Full gradients for the step from the dim-0 shards of FSDP2/HSDP, rows back after.

    Args:
        model: The sharded model.
        layer_params: The parameters each preconditioned layer takes, by layer name.
        ledger: Where the gradient exchange records its bytes.
        bucket_bytes: Size of one all-gather bucket (after padding the shards).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_params: Mapping[str, Sequence[Tensor]],
        *,
        ledger: CommLedger,
        bucket_bytes: int,
    ) -> None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, attr))
        self.params: list[ShardedParameter] = []
        seen: set[int] = set()
        for params in layer_params.values():
            for tensor in params:
                if id(tensor) in seen or not isinstance(tensor, DTensor):
                    continue
                seen.add(id(tensor))
                dims = [i for i, p in enumerate(tensor.placements) if p == Shard(0)]
                self.params.append(
                    ShardedParameter(
                        names[id(tensor)], tensor, slots[id(tensor)], dims[0] if dims else None
                    )
                )
        mesh = self.params[0].param.device_mesh if self.params else None
        cut = {s.mesh_dim for s in self.params if s.mesh_dim is not None}
        self.mesh_dim = cut.pop() if cut else None
        group = None if mesh is None or self.mesh_dim is None else mesh.get_group(self.mesh_dim)
        self.comm = Communicator(group, ledger=ledger, bucket_bytes=bucket_bytes)

        self.exchange: OwnerExchange | None = None
        self.local: frozenset[str] = frozenset()
        """Layers each rank preconditions on its own rows (``shard_exchange="local"``)."""
        self.local_params: frozenset[int] = frozenset()
        self._local_rows: dict[str, slice] = {}
        self.partial: frozenset[str] = frozenset()
        """Layers whose full gradient this rank never holds (the owner exchange's layers it
        does not precondition): ``step()`` reads only whether they have a gradient, and
        their results arrive as rows after it."""

    def attach(
        self,
        strategy: Strategy,
        parts: Mapping[str, Sequence[ParameterPart]],
        local: Collection[str] = (),
    ) -> Delivery:
        """Chooses how gradients move for ``strategy``; returns what delivers its results.

        Where every rank preconditions every layer (``replicated``, ``kaisa`` with fraction
        1) each rank all-gathers every full gradient and keeps its rows: the strategy
        delivers (nothing travels). With ``local`` layers (``shard_exchange="local"``,
        :mod:`~dkfac.distributed.shard_local`) each rank keeps its own rows of theirs and
        preconditions those alone; the other layers are all-gathered. Otherwise the owner
        exchange (:mod:`~dkfac.distributed.shard_exchange`) moves rows to the grad workers
        and each rank's rows of the results back, and :class:`OwnerDelivery` replaces the
        strategy's broadcast of preconditioned gradients.

        Args:
            strategy: The built strategy (its communicator's ranks are placement indices);
                a :class:`LocalRowsStrategy` with ``local`` layers.
            parts: Layer name -> the parameters it reads, with their rows (``None``: all).
            local: Layers each rank preconditions on its own rows (whose parameters no
                other layer reads).

        Raises:
            ValueError: If rows must travel between ranks and the strategy's group is not
                the set of ranks of the model's mesh.
        """
        if local:
            return self._attach_local(strategy, parts, local)
        if strategy.workers_per_layer >= strategy.world_size or not self.params:
            return strategy
        shard, replica = self._positions(strategy.comm.ranks, strategy.name)
        index = {id(s.param): i for i, s in enumerate(self.params)}
        shapes = [
            ShardedParam(
                rows=s.param.shape[0],
                row_numel=row_numel(s.param),
                itemsize=s.param.element_size(),
                parts=s.parts,
            )
            for s in self.params
        ]
        layers: dict[str, LayerRows] = {}
        for name, layer_parts in parts.items():
            rows = []
            for param, cut in layer_parts:
                if id(param) not in index:
                    continue
                start, stop = (0, param.shape[0]) if cut is None else (cut.start, cut.stop)
                rows.append((index[id(param)], start, stop))
            workers = strategy.placement[name].grad_workers
            sources = tuple(strategy.source(name, d) for d in range(strategy.world_size))
            layers[name] = LayerRows(tuple(rows), workers, sources)
        self.partial = frozenset(name for name in parts if not strategy.preconditions(name))
        self.exchange = OwnerExchange(
            [s.param for s in self.params], shapes, layers, shard, replica, strategy.comm
        )
        return OwnerDelivery(strategy)

    def _attach_local(
        self,
        strategy: Strategy,
        parts: Mapping[str, Sequence[ParameterPart]],
        local: Collection[str],
    ) -> Delivery:
        """The local mode: see :meth:`attach`."""
        assert isinstance(strategy, LocalRowsStrategy)
        index = {id(s.param): i for i, s in enumerate(self.params)}
        shared = {
            index[id(param)]
            for name, layer_parts in parts.items()
            if name not in local
            for param, _ in layer_parts
            if id(param) in index
        }
        self.local = frozenset(
            name for name in local if all(index.get(id(p)) not in shared for p, _ in parts[name])
        )
        self.local_params = frozenset(
            index[id(p)] for name in self.local for p, _ in parts[name] if id(p) in index
        )
        self._local_rows = {}
        for name in self.local:
            first = next((index[id(p)] for p, _ in parts[name] if id(p) in index), None)
            if first is not None:
                s = self.params[first]
                self._local_rows[name] = slice(*own_rows(s))
        _, replica = self._positions(strategy.comm.ranks, "replicated")
        return LocalDelivery(strategy, self.local, replica[strategy.index] == 0)

    def local_rows(self) -> dict[str, slice]:
        """Layer name -> the rows of it this rank preconditions alone (local mode)."""
        return dict(self._local_rows)

    def _positions(self, ranks: Sequence[int], strategy: str) -> tuple[list[int], list[int]]:
        """Each rank's shard index and shard group on the model's mesh (placement order)."""
        mesh = self.params[0].param.device_mesh
        grid = mesh.mesh
        coords = {
            int(grid[coord].item()): coord for coord in itertools.product(*map(range, grid.shape))
        }
        if set(coords) != set(ranks):
            raise ValueError(
                f'strategy="{strategy}" on a sharded model sends gradient rows between the '
                f"ranks of the model's mesh {sorted(coords)}, and the preconditioner's process "
                f"group holds ranks {sorted(ranks)}: give it the mesh's ranks (the default "
                'group for one mesh over every rank), or use strategy="replicated"'
            )
        shard = [0 if self.mesh_dim is None else coords[rank][self.mesh_dim] for rank in ranks]
        rest = [tuple(c for i, c in enumerate(coords[r]) if i != self.mesh_dim) for r in ranks]
        groups = {key: i for i, key in enumerate(dict.fromkeys(rest))}
        return shard, [groups[key] for key in rest]

    @property
    def shards(self) -> int:
        """Ranks a weight is cut over (the shard group's size)."""
        return self.comm.world_size

    def _gather(self, present: list[ShardedParameter]) -> dict[int, Tensor]:
        """Full gradients of ``present`` (their ``.grad`` set), in buckets of padded shards."""
        full: dict[int, Tensor] = {}
        cut = [s for s in present if s.parts > 1 and self.comm.active]
        for s in present:
            if s not in cut:  # replicated, or one shard: the local tensor is the whole
                full[id(s.param)] = s.param.grad.to_local()  # type: ignore[union-attr]
        buckets: list[list[ShardedParameter]] = []
        size = 0
        for s in cut:
            nbytes = s.chunk_rows() * row_numel(s.param) * s.param.element_size()
            if not buckets or size + nbytes > self.comm.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(s)
            size += nbytes
        for bucket in buckets:
            full.update(self._gather_bucket(bucket))
        return full

    def _gather_bucket(self, bucket: list[ShardedParameter]) -> dict[int, Tensor]:
        """One all-gather of the bucket's padded shards; the full gradients it yields."""
        grads = [s.param.grad.to_local() for s in bucket]  # type: ignore[union-attr]
        sizes = [s.chunk_rows() * row_numel(s.param) for s in bucket]
        flat = grads[0].new_zeros(1, sum(sizes))
        offset = 0
        for grad, size in zip(grads, sizes, strict=True):
            flat[0, offset : offset + grad.numel()] = grad.reshape(-1)
            offset += size
        gathered, handle = self.comm.all_gather_rows(flat, "gradients")
        handle.wait()
        out: dict[int, Tensor] = {}
        offset = 0
        for s, size in zip(bucket, sizes, strict=True):
            pieces = []
            for index in range(s.parts):
                start, end = s.rows_of(index)
                count = (end - start) * row_numel(s.param)
                pieces.append(gathered[index, offset : offset + count])
            shape = (s.param.shape[0], *s.param.shape[1:])
            out[id(s.param)] = torch.cat(pieces).reshape(shape)
            offset += size
        return out

    @contextlib.contextmanager
    def full_gradients(self) -> Iterator[None]:
        """Within it, the preconditioned layers' parameters are plain stand-ins whose
        ``.grad`` is the full averaged gradient; on leaving, each rank's rows of the
        (preconditioned) gradients are written into its shards and the parameters put back.

        The stand-ins hold no weights (a zero-stride view of the parameter's shape: the
        step reads only gradients), so the exchange moves gradients only.
        """
        if self.exchange is not None:
            with self._exchanged():
                yield
            return
        kept = self.local_params  # their own rows only (local mode)
        present = [
            s for i, s in enumerate(self.params) if s.param.grad is not None and i not in kept
        ]
        full = self._gather(present)
        stand_ins: dict[int, Tensor] = {}
        for i, s in enumerate(self.params):
            local = s.param.to_local()
            stand_in = _stand_in(s, local.shape if i in kept else s.param.shape)
            if i in kept and s.param.grad is not None:
                stand_in.grad = grad_local(s)
            elif id(s.param) in full:
                stand_in.grad = full[id(s.param)]
            stand_ins[id(s.param)] = stand_in
            for module, attr in s.slots:
                module._parameters[attr] = stand_in  # type: ignore[assignment]
        try:
            yield
        finally:
            for i, s in enumerate(self.params):
                for module, attr in s.slots:
                    module._parameters[attr] = s.param  # type: ignore[assignment]
                grad = stand_ins[id(s.param)].grad
                if i in kept:
                    keep_local(s, grad)
                else:
                    keep_rows(s, grad)

    @contextlib.contextmanager
    def _exchanged(self) -> Iterator[None]:
        """:meth:`full_gradients` with the owner exchange: a parameter this rank reads to
        precondition a layer gets a full-shape stand-in whose ``.grad`` holds its rows and
        the rows received (others stay zero); every other one a stand-in of its own rows
        whose ``.grad`` is its shard's gradient itself. On leaving, each rank's rows of the
        results arrive from the grad workers that serve it."""
        exchange = self.exchange
        assert exchange is not None
        present = frozenset(i for i, s in enumerate(self.params) if s.param.grad is not None)
        created = exchange.completed(present) - present
        for index in created:
            set_local_grad(self.params[index], self.params[index].param.to_local().new_zeros(()))
        present = exchange.completed(present)
        full: dict[int, Tensor] = {}
        for index in exchange.needed(present):
            s = self.params[index]
            local = grad_local(s)
            grad = local.new_zeros(s.param.shape)
            start, stop = own_rows(s)
            grad[start:stop] = local
            full[index] = grad
        exchange.gather(present, full)
        for i, s in enumerate(self.params):
            local = s.param.to_local()
            stand_in = _stand_in(s, s.param.shape if i in full else local.shape)
            if i in full:
                stand_in.grad = full[i]
            elif i in present:
                stand_in.grad = grad_local(s)
            for module, attr in s.slots:
                module._parameters[attr] = stand_in  # type: ignore[assignment]
        try:
            yield
        finally:
            for s in self.params:
                for module, attr in s.slots:
                    module._parameters[attr] = s.param  # type: ignore[assignment]
            exchange.give_back(present, full)
            for index in created:  # a frozen one keeps no gradient, as torch leaves it
                if not self.params[index].param.requires_grad:
                    self.params[index].param.grad = None


def _stand_in(s: ShardedParameter, shape: torch.Size) -> Tensor:
    """A parameter's stand-in of ``shape`` for the step: no weights (a zero-stride view: the
    step reads gradients only); for a frozen parameter an ``nn.Parameter`` without
    ``requires_grad``, so that the blocks write it no update
    (:func:`~dkfac.blocks.base.gradient_write`) and its shard keeps the gradient it had."""
    stand_in = s.param.to_local().new_zeros(()).expand(shape)
    return stand_in if s.param.requires_grad else nn.Parameter(stand_in, requires_grad=False)
