"""Distribution strategies: who builds, reduces, inverts and preconditions each layer.

One class per row of the strategy table below (docs/distributed.md explains them). The
preconditioner's math never asks for its rank; it asks its :class:`Strategy` which layers
this rank captures, keeps, inverts and preconditions, and hands it the tensors to move at
each phase of a step:

==============  =====================  ==============  ==========================================
strategy        statistics built on    statistic       after the inverse / precondition phase
                                       traffic
==============  =====================  ==============  ==========================================
``replicated``  every rank             all-reduce      owner broadcasts solver state to all
``kaisa``       every rank             all-reduce      owner broadcasts solver state within its
                                                       grad-worker group; one worker per receiver
                                                       block broadcasts the preconditioned grad
``mem-opt``     every rank             all-reduce      owner broadcasts the preconditioned grad
``dp``          owner only (local)     none            owner broadcasts the preconditioned grad
``spngd``       every rank             reduce-scatter  owner all-gathers the preconditioned grad;
                                       (with the       the gradients themselves are reduced here
                                       gradients)      (owner-sharded for K-FAC layers,
                                                       all-reduced for every other parameter)
==============  =====================  ==============  ==========================================

Everything the strategies send goes through :class:`~dkfac.distributed.comm.Communicator`;
statistics are named tensors (``{"A": ..., "G": ...}`` for a Kronecker block) and solver
states are flat ``dict[str, Tensor]``, so other blocks and solvers plug in unchanged.
Placement uses indices ``0..P-1`` into the communicator's ranks; collectives use global ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import Literal, get_args

from torch import Tensor

from dkfac.distributed.comm import CommHandle, Communicator
from dkfac.distributed.ledger import Kind
from dkfac.distributed.strategy_base import Strategy, StrategyRule, join_handles

__all__ = [
    "STRATEGIES",
    "STRATEGY_NAMES",
    "DPStrategy",
    "KaisaStrategy",
    "MemOptStrategy",
    "ReplicatedStrategy",
    "SPNGDStrategy",
    "Strategy",
    "StrategyName",
    "StrategyRule",
    "choose_strategy",
    "make_strategy",
    "register_strategy",
]

logger = logging.getLogger(__name__)


StrategyName = Literal["replicated", "kaisa", "mem-opt", "dp", "spngd"]
"""The strategies by name (the keys of :data:`STRATEGIES`)."""


class ReplicatedStrategy(Strategy):
    """SC20 / KAISA COMM-OPT: every rank keeps the factors and preconditions every layer."""

    name = "replicated"
    rule = StrategyRule(
        builders="all",
        factor_collective="all_reduce",
        pack_factors=False,
        inverse_broadcast=True,
        preconditioned="receivers",
        gradients="ddp",
        factors_kept="all",
        fraction="one",
    )


class KaisaStrategy(Strategy):
    """KAISA hybrid: factors all-reduced and kept by the owner, ``f·P`` grad workers per layer."""

    name = "kaisa"
    rule = dataclasses.replace(ReplicatedStrategy.rule, factors_kept="owner", fraction="given")


class MemOptStrategy(Strategy):
    """KAISA MEM-OPT (f = 1/P): only the owner keeps, inverts and preconditions a layer."""

    name = "mem-opt"
    rule = dataclasses.replace(KaisaStrategy.rule, fraction="inverse_p")


class DPStrategy(Strategy):
    """DP-KFAC: a layer's factors are built only on its owner, from its local batch, and never
    sent; the owner inverts and preconditions it and broadcasts the result."""

    name = "dp"
    rule = dataclasses.replace(MemOptStrategy.rule, builders="owner", factor_collective=None)


class SPNGDStrategy(Strategy):
    """SP-NGD: gradients and factors reduce-scattered to owners, results all-gathered."""

    name = "spngd"
    rule = StrategyRule(
        builders="all",
        factor_collective="reduce_scatter",
        pack_factors=True,
        inverse_broadcast=False,
        preconditioned="all_gather",
        gradients="reduce_scatter",
        factors_kept="owner",
        fraction="inverse_p",
    )

    @property
    def reduces_gradients(self) -> bool:
        """SP-NGD averages every gradient itself (the model is not wrapped in DDP)."""
        return True

    def reduce_gradients(
        self, layer_grads: Mapping[str, Tensor], other_grads: Sequence[Tensor]
    ) -> CommHandle:
        """Owner-sharded mean of K-FAC layer gradients, all-reduced mean of the rest."""
        return self.reduce_step({}, None, layer_grads, other_grads)

    def reduce_step(
        self,
        stats: Mapping[str, MutableMapping[str, Tensor]],
        gathered: Mapping[str, Collection[str]] | None,
        layer_grads: Mapping[str, Tensor],
        other_grads: Sequence[Tensor],
    ) -> CommHandle:
        """One reduce-scatter carries each layer's gradient and its statistics to its owner.

        Per layer (in the order given: gradients' layers first, then any layer with
        statistics only) its dense statistics (packed when square and ``pack_triangles``)
        and its gradient go into the same buffers, one ``dist.reduce`` per (owner, bucket);
        gathered statistics (low-rank sides) are all-gathered as in
        :meth:`reduce_statistics`, and the other parameters' gradients all-reduced. The ledger
        records each kind's share.
        """
        skip = gathered or {}
        tensors: list[Tensor] = []
        owners: list[int] = []
        kinds: list[Kind] = []
        packed: list[bool] = []
        for name in dict.fromkeys([*layer_grads, *stats]):
            owner = self._global(self.owner(name))
            layer_stats = stats.get(name, {})
            for key in sorted(k for k in layer_stats if k not in skip.get(name, ())):
                t = layer_stats[key]
                square = t.dim() == 2 and t.shape[0] == t.shape[1]
                tensors.append(t)
                packed.append(self.pack_triangles and square)
                kinds.append("factors")
                owners.append(owner)
            if name in layer_grads:
                tensors.append(layer_grads[name])
                packed.append(False)
                kinds.append("gradients")
                owners.append(owner)
        return join_handles(
            [
                self._gather_rows(stats, skip),
                self.comm.reduce_to_owners_mixed(tensors, owners, kinds, packed),
                self.comm.all_reduce(list(other_grads), "gradients"),
            ]
        )

    def distribute(self, finals: Mapping[str, Tensor], ready_finite: Sequence[str]) -> list[str]:
        """All-gather every finite layer's final gradient (preconditioned where ready)."""
        names = list(finals)
        owners = [self._global(self.owner(n)) for n in names]
        tensors = [finals[n] for n in names]
        self.comm.all_gather_from_owners(tensors, owners, "preconditioned").wait()
        return names

    def kl_layers(self, ready_finite: Sequence[str]) -> list[str]:
        """Only the owner holds the averaged raw gradient, so it adds its layers' terms."""
        return [name for name in ready_finite if self.is_owner(name)]

    def reduce_kl(self, partial: Tensor) -> Tensor:
        """Sum of the owners' partial sums."""
        return self.comm.sum_control(partial)


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (ReplicatedStrategy, KaisaStrategy, MemOptStrategy, DPStrategy, SPNGDStrategy)
}
"""Name -> class: the one table of strategies (the cost model reads their rules)."""
STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)


def register_strategy(cls: type[Strategy]) -> None:
    """Adds (or replaces) a strategy users pick with ``KFACConfig(strategy=cls.name)``.

    Built-in strategies are written into :data:`STRATEGIES` and :data:`StrategyName`
    instead (see ``docs/adding-a-strategy.md``); this is for strategies defined outside.

    Raises:
        TypeError: If ``cls`` is not a Strategy subclass with a :class:`StrategyRule`.
        ValueError: If its name is empty or ``"auto"``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"cls must be a Strategy subclass, got {cls!r}")
    if not isinstance(getattr(cls, "rule", None), StrategyRule):
        raise TypeError(f"{cls.__name__} needs a class attribute rule = StrategyRule(...)")
    if not isinstance(cls.name, str) or not cls.name or cls.name in ("auto", "strategy"):
        raise ValueError(f"a strategy's name must be a new non-empty string, got {cls.name!r}")
    STRATEGIES[cls.name] = cls


def choose_strategy(
    world_size: int,
    *,
    ddp_wrapped: bool,
    replicated_state_bytes: int,
    memory_budget_bytes: int | None = None,
) -> str:
    """The rule behind ``strategy="auto"`` for models the cost model cannot describe.

    1. One rank: ``"replicated"`` (every strategy is the serial engine there).
    2. A model not wrapped in DDP: ``"spngd"``, the only strategy that averages the gradients
       itself (it is never chosen for a DDP-wrapped model).
    3. Memory-bound, i.e. the K-FAC state every rank would hold under ``"replicated"``
       (factors plus solver states) exceeds a quarter of ``memory_budget_bytes``:
       ``"mem-opt"``, which keeps only the owned layers' state.
    4. Otherwise ``"replicated"``, which communicates least per step.

    Args:
        world_size: Number of ranks.
        ddp_wrapped: Whether the model is a ``DistributedDataParallel``.
        replicated_state_bytes: Bytes of factors and solver states of every layer.
        memory_budget_bytes: Free accelerator memory, or ``None`` when unknown (CPU).

    Returns:
        A strategy name.
    """
    if world_size <= 1:
        return "replicated"
    if not ddp_wrapped:
        return "spngd"
    if memory_budget_bytes is not None and replicated_state_bytes * 4 > memory_budget_bytes:
        return "mem-opt"
    return "replicated"


def make_strategy(
    name: str,
    comm: Communicator,
    costs: Mapping[str, float],
    *,
    grad_worker_fraction: float = 1.0,
    pack_triangles: bool | None = None,
) -> Strategy:
    """Builds the strategy ``name`` (not ``"auto"``: resolve it with :func:`choose_strategy`).

    Args:
        name: ``"replicated"``, ``"kaisa"``, ``"mem-opt"``, ``"dp"`` or ``"spngd"``.
        comm: The communicator over the training ranks.
        costs: Layer name -> placement cost.
        grad_worker_fraction: KAISA fraction (``"kaisa"`` only).
        pack_triangles: ``None``: the strategy's default (its rule's ``pack_factors``).

    Raises:
        ValueError: For an unknown name or a fraction that does not fit the world size.
    """
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name](
        comm, costs, grad_worker_fraction=grad_worker_fraction, pack_triangles=pack_triangles
    )
