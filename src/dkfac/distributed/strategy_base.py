"""The strategy base class: placement queries and the traffic of each phase of a step.

A :class:`Strategy` answers, for every layer, which ranks capture its statistics, keep its
running factors, compute its solver state (the inverse owner) and apply it (the grad
workers), and moves the tensors of each phase through the
:class:`~dkfac.distributed.comm.Communicator`. What a strategy builds, sends and keeps is its
:class:`StrategyRule` (one row of the table in :mod:`dkfac.distributed.strategies`); the
base class reads it, and the cost model reads the same rules, so a strategy is described
once. Each concrete strategy in
:mod:`dkfac.distributed.strategies` is a direct subclass with its rule and the overrides its
traffic needs. Statistics are named tensors and solver states flat
``dict[str, Tensor]``, so blocks and solvers other than the Kronecker pair plug in unchanged.

Placement uses indices ``0..P-1`` into the communicator's ranks; collectives use global ranks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from dkfac.distributed.assignment import plan_placement, serving_worker
from dkfac.distributed.comm import CommHandle, Communicator
from dkfac.distributed.ledger import CommLedger

__all__ = ["FactorReduction", "Strategy", "StrategyRule", "join_handles"]

logger = logging.getLogger(__name__)

FactorReduction = Literal["all_reduce", "reduce_scatter", "none"]
Signature = list[tuple[str, tuple[int, ...], torch.dtype]]
SolverState = dict[str, Tensor]
"""A solver state as strategies move it: named tensors."""


@dataclass(frozen=True)
class StrategyRule:
    """Who builds, communicates and keeps what under one strategy.

    Attributes:
        builders: ``"all"`` ranks build every layer's statistics, or only the ``"owner"``
            (from its local batch).
        factor_collective: How statistics reach the keepers: ``"all_reduce"``,
            ``"reduce_scatter"`` (to the owner, with the gradients) or ``None`` (not sent).
        pack_factors: Square statistics are sent as packed upper triangles by default.
        inverse_broadcast: The owner broadcasts the solver state inside the grad-worker group.
        preconditioned: ``"receivers"`` (the grad worker broadcasts the preconditioned
            gradient inside each grad-receiver block), ``"all_gather"`` (from owners to all)
            or ``None``.
        gradients: ``"ddp"`` (averaged outside, by DDP) or ``"reduce_scatter"`` (by the
            strategy itself).
        factors_kept: Running statistics kept for ``"all"`` layers or only the ``"owner"``'s.
        fraction: Grad-worker fraction: ``"one"`` (1), ``"inverse_p"`` (1/P) or ``"given"``
            (``grad_worker_fraction``).
    """

    builders: Literal["all", "owner"]
    factor_collective: Literal["all_reduce", "reduce_scatter"] | None
    pack_factors: bool
    inverse_broadcast: bool
    preconditioned: Literal["receivers", "all_gather"] | None
    gradients: Literal["ddp", "reduce_scatter"]
    factors_kept: Literal["all", "owner"]
    fraction: Literal["one", "inverse_p", "given"]

    def worker_fraction(self, world_size: int, requested: float) -> float:
        """The grad-worker fraction at ``world_size`` (``requested`` where it is ``given``)."""
        if self.fraction == "one":
            return 1.0
        if self.fraction == "inverse_p":
            return 1.0 / world_size
        return requested


def join_handles(handles: Iterable[CommHandle]) -> CommHandle:
    """One handle that waits for several (a ``CommHandle`` has the ``wait()`` works need)."""
    return CommHandle(works=list(handles))


def _signature(state: Mapping[str, Tensor]) -> Signature:
    return [(key, tuple(t.shape), t.dtype) for key, t in sorted(state.items())]


def _buffers(signature: Signature, device: torch.device) -> dict[str, Tensor]:
    return {key: torch.empty(shape, dtype=dtype, device=device) for key, shape, dtype in signature}


class Strategy:
    """Placement and traffic of one distribution strategy, as its :attr:`rule` says.

    Args:
        comm: The communicator over the ranks that train together.
        costs: Layer name -> placement cost (LPT balances inverse owners by it).
        grad_worker_fraction: Fraction ``f`` of ranks that precondition each layer, used
            where the rule's fraction is ``"given"`` (KAISA); other rules fix it.
        pack_triangles: Send square statistics as upper triangles; ``None``: the rule's
            default.

    Attributes:
        name: The strategy's name in the table of :mod:`dkfac.distributed.strategies`.
        rule: What it builds, sends and keeps (set by every concrete strategy).
    """

    name: ClassVar[str] = "strategy"
    rule: ClassVar[StrategyRule]
    shares_solver_states: ClassVar[bool] = True
    """A layer's solver state is the same on every rank that holds it (so checkpoints
    save the owner's); ``False`` where each rank computes its own (the sharded layout's
    local mode)."""

    def __init__(
        self,
        comm: Communicator,
        costs: Mapping[str, float],
        *,
        grad_worker_fraction: float = 1.0,
        pack_triangles: bool | None = None,
    ) -> None:
        if not hasattr(type(self), "rule"):
            raise TypeError(f"{type(self).__name__} has no StrategyRule (class attribute 'rule')")
        self.comm = comm
        self.world_size = comm.world_size
        self.index = comm.ranks.index(comm.rank) if comm.rank in comm.ranks else 0
        self.pack_triangles = self.rule.pack_factors if pack_triangles is None else pack_triangles
        fraction = self.rule.worker_fraction(self.world_size, grad_worker_fraction)
        self.placement = plan_placement(costs, self.world_size, fraction)
        self.workers_per_layer = max(round(fraction * self.world_size), 1)
        self.ready: set[str] = set()
        self._groups: dict[tuple[int, ...], Communicator] = {}
        self._make_group_communicators()

    @property
    def factor_reduction(self) -> FactorReduction:
        """How statistics are reduced: the rule's collective, or ``"none"``."""
        return self.rule.factor_collective or "none"

    # ------------------------------------------------------------------ placement queries
    def owner(self, name: str) -> int:
        """Placement index of the layer's inverse owner."""
        return self.placement[name].inverse_owner

    def is_owner(self, name: str) -> bool:
        """Whether this rank computes the layer's solver state."""
        return self.owner(name) == self.index

    def captures(self, name: str) -> bool:
        """Whether this rank's hooks build the layer's statistics (every rank, or the owner)."""
        return self.rule.builders == "all" or self.is_owner(name)

    def keeps_statistics(self, name: str) -> bool:
        """Whether this rank keeps the layer's running statistics (every rank, or the owner)."""
        return self.rule.factors_kept == "all" or self.is_owner(name)

    def preconditions(self, name: str) -> bool:
        """Whether this rank applies the layer's solver (is one of its grad workers)."""
        return self.index in self.placement[name].grad_workers

    def source(self, name: str, index: int) -> int:
        """Placement index of the grad worker that delivers the layer's preconditioned
        gradient to rank ``index`` (``index`` itself where it preconditions the layer)."""
        workers = self.placement[name].grad_workers
        return serving_worker(workers, self.world_size, index)

    def describe(self, name: str) -> dict[str, Any]:
        """Owner and grad workers of a layer, as global ranks."""
        placement = self.placement[name]
        return {
            "owner": self._global(placement.inverse_owner),
            "grad_workers": [self._global(i) for i in placement.grad_workers],
        }

    # ------------------------------------------------------------------ traffic
    def reduce_statistics(
        self,
        stats: Mapping[str, MutableMapping[str, Tensor]],
        gathered: Mapping[str, Collection[str]] | None = None,
    ) -> CommHandle:
        """Launches the reduction of this step's statistics (averaged over ranks).

        After ``wait()``, the tensors in ``stats`` of every layer this rank keeps hold the
        group average (for ``reduce_scatter``, only the owner's copies do).

        Gathered statistics (``gathered[name]`` lists their keys; the statistic kinds say
        which, e.g. low-rank sides) are ``U = Rᵀ/√n`` (``d × m``) and cannot be averaged:
        their row blocks ``Uᵀ`` are all-gathered (:meth:`Communicator.all_gather_rows`,
        kind ``"factors"``) and ``stats[name][key]`` is replaced by ``[U_0, …, U_{P-1}] / √P``,
        the ``U`` of the global batch when the local batches are equal. Every rank receives
        them (also under ``reduce_scatter``).
        """
        if self.factor_reduction == "none" or not stats:
            return CommHandle()
        names = list(stats)
        handles = [self._gather_rows(stats, gathered or {})]
        for packed in (True, False):
            tensors: list[Tensor] = []
            owners: list[int] = []
            for name in names:
                skip = (gathered or {}).get(name, ())
                for key in sorted(k for k in stats[name] if k not in skip):
                    t = stats[name][key]
                    square = t.dim() == 2 and t.shape[0] == t.shape[1]
                    if (self.pack_triangles and square) == packed:
                        tensors.append(t)
                        owners.append(self._global(self.owner(name)))
            if not tensors:
                continue
            if self.factor_reduction == "all_reduce":
                handles.append(self.comm.all_reduce(tensors, "factors", "mean", packed))
            else:
                handles.append(
                    self.comm.reduce_to_owners(tensors, owners, "factors", "mean", packed)
                )
        return join_handles(handles)

    def _gather_rows(
        self,
        stats: Mapping[str, MutableMapping[str, Tensor]],
        gathered: Mapping[str, Collection[str]],
    ) -> CommHandle:
        """All-gathers the ``Uᵀ`` row blocks of gathered statistics (see reduce_statistics)."""
        if not self.comm.active:
            return CommHandle()
        handles: list[CommHandle] = []
        scale = self.world_size**-0.5
        for name, keys in gathered.items():
            for key in sorted(keys):
                if key not in stats.get(name, {}):
                    continue
                out, handle = self.comm.all_gather_rows(stats[name][key].T, "factors")

                def finish(target: MutableMapping[str, Tensor], k: str, rows: Tensor) -> None:
                    target[k] = rows.T * scale

                handles.append(
                    CommHandle([handle], [functools.partial(finish, stats[name], key, out)])
                )
        return join_handles(handles)

    def reduce_gradients(
        self, layer_grads: Mapping[str, Tensor], other_grads: Sequence[Tensor]
    ) -> CommHandle:
        """Launches the gradient reduction the strategy does itself (none: DDP did it)."""
        return CommHandle()

    @property
    def reduces_gradients(self) -> bool:
        """Whether :meth:`reduce_gradients` moves anything (the strategy averages gradients)."""
        return False

    def reduce_step(
        self,
        stats: Mapping[str, MutableMapping[str, Tensor]],
        gathered: Mapping[str, Collection[str]] | None,
        layer_grads: Mapping[str, Tensor],
        other_grads: Sequence[Tensor],
    ) -> CommHandle:
        """Launches phase 1's traffic for some layers: their statistics and gradients.

        Called once per step with every layer (non-overlapped path) or once per eager
        bucket (:mod:`dkfac.engine.eager`); every rank must pass the same layers in
        the same order. The default launches :meth:`reduce_statistics` then
        :meth:`reduce_gradients`; a strategy may fuse them.
        """
        return join_handles(
            [
                self.reduce_statistics(stats, gathered),
                self.reduce_gradients(layer_grads, other_grads),
            ]
        )

    def agree(self, flags: Tensor) -> Tensor:
        """Element-wise AND of per-layer boolean flags over every rank."""
        return self.comm.all_true(flags)

    def share_solver_states(
        self, states: dict[str, SolverState | None], devices: Mapping[str, torch.device]
    ) -> None:
        """After the owners' inverse update: every grad worker gets the owner's state.

        ``states`` maps every layer name to this rank's state (meaningful on owners). It is
        updated in place: grad workers receive their layers' states, ranks that do not
        precondition a layer drop it. :attr:`ready` becomes the set of layers whose owner
        has a state, identical on every rank. ``devices`` says where receive buffers go.
        """
        mine = {
            name: None if state is None else _signature(state)
            for name, state in states.items()
            if self.is_owner(name)
        }
        signatures: dict[str, Signature | None] = {}
        for part in self.comm.exchange_objects(mine):
            signatures.update(part)
        self.ready = {name for name in states if signatures.get(name) is not None}
        batches: dict[tuple[tuple[int, ...], int], list[Tensor]] = {}
        receiving: list[tuple[str, dict[str, Tensor]]] = []
        for name in states:
            workers = self.placement[name].grad_workers
            if not self.preconditions(name):
                states[name] = None
                continue
            signature = signatures.get(name)
            if len(workers) == 1 or signature is None:
                continue
            if not self.is_owner(name):
                buffers = _buffers(signature, devices[name])
                receiving.append((name, buffers))
                tensors = [buffers[k] for k, _, _ in signature]
            else:
                state = states[name]
                assert state is not None
                tensors = [state[k] for k, _, _ in signature]
            batches.setdefault((workers, self.owner(name)), []).extend(tensors)
        handles = [
            self._communicator(workers).broadcast(tensors, self._global(owner), "inverses")
            for (workers, owner), tensors in batches.items()
        ]
        join_handles(handles).wait()
        for name, buffers in receiving:
            states[name] = buffers

    def distribute(self, finals: Mapping[str, Tensor], ready_finite: Sequence[str]) -> list[str]:
        """Delivers preconditioned gradients from their grad workers to every rank.

        Args:
            finals: Layer name -> this rank's final gradient matrix: the preconditioned one
                where this rank preconditions the layer, a receive buffer elsewhere.
            ready_finite: Layers (in registration order) with a solver state and a finite
                gradient, the same on every rank.

        Returns:
            The layers whose ``finals`` entry is now valid on this rank.
        """
        workers_n = self.workers_per_layer
        block = self.world_size // workers_n
        if block > 1:
            mine = self.index // block
            receivers = tuple(range(mine * block, (mine + 1) * block))
            by_source: dict[int, list[Tensor]] = {}
            for name in ready_finite:
                source = self.source(name, self.index)
                by_source.setdefault(source, []).append(finals[name])
            comm = self._communicator(receivers)
            join_handles(
                comm.broadcast(tensors, self._global(source), "preconditioned")
                for source, tensors in sorted(by_source.items())
            ).wait()
        return list(ready_finite)

    def kl_layers(self, ready_finite: Sequence[str]) -> list[str]:
        """Layers whose ``⟨V, ∇W⟩`` this rank adds to the KL-clip sum."""
        return list(ready_finite)

    def reduce_kl(self, partial: Tensor) -> Tensor:
        """The KL-clip sum over all layers from this rank's partial sum."""
        return partial

    def gather_to_all(
        self,
        owned: Mapping[str, Mapping[str, Tensor] | None],
        devices: Mapping[str, torch.device],
    ) -> dict[str, dict[str, Tensor] | None]:
        """Every layer's tensors as its owner holds them, on every rank (for checkpoints).

        Collective: every rank must call it. The traffic goes to a private ledger, so
        checkpointing does not show in :meth:`KFACPreconditioner.comm_stats`.

        Args:
            owned: Layer name -> named tensors (read on the layer's owner) or ``None``.
            devices: Layer name -> device of the receive buffers.

        Returns:
            Layer name -> the owner's tensors (``None`` where the owner had none).
        """
        if not self.comm.active:
            return {name: None if t is None else dict(t) for name, t in owned.items()}
        mine = {
            name: None if not t else _signature(t)
            for name, t in owned.items()
            if self.is_owner(name)
        }
        signatures: dict[str, Signature | None] = {}
        for part in self.comm.exchange_objects(mine):
            signatures.update(part)
        result: dict[str, dict[str, Tensor] | None] = {}
        tensors: list[Tensor] = []
        owners: list[int] = []
        for name in owned:
            signature = signatures.get(name)
            if signature is None:
                result[name] = None
                continue
            source = owned[name]
            held = dict(source) if self.is_owner(name) and source else None
            buffers = held if held is not None else _buffers(signature, devices[name])
            result[name] = buffers
            tensors.extend(buffers[key] for key, _, _ in signature)
            owners.extend([self._global(self.owner(name))] * len(signature))
        private = Communicator(
            self.comm.group, ledger=CommLedger(), bucket_bytes=self.comm.bucket_bytes
        )
        private.all_gather_from_owners(tensors, owners, "factors").wait()
        return result

    # ------------------------------------------------------------------ groups
    def _global(self, index: int) -> int:
        return self.comm.ranks[index]

    def _communicator(self, members: tuple[int, ...]) -> Communicator:
        if len(members) == self.world_size:
            return self.comm
        return self._groups[members]

    def _make_group_communicators(self) -> None:
        """Subgroups for KAISA worker / receiver groups strictly between 1 and P ranks.

        ``dist.new_group`` is collective over the whole default group: every rank creates
        every subgroup, in the same order, and keeps the ones it belongs to.
        """
        n = self.workers_per_layer
        if not self.comm.active or n in (1, self.world_size):
            return
        stride = self.world_size // n
        workers = [tuple(k + j * stride for j in range(n)) for k in range(stride)]
        receivers = [tuple(range(j * stride, (j + 1) * stride)) for j in range(n)]
        for members in workers + receivers:
            group = dist.new_group([self._global(i) for i in members])
            if self.index in members:
                self._groups[members] = Communicator(
                    group, ledger=self.comm.ledger, bucket_bytes=self.comm.bucket_bytes
                )
