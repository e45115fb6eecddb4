"""Distribution strategies: who builds, reduces, inverts and preconditions each layer.

One class per row of the strategy table (DESIGN.md section 4). The preconditioner's math never
asks for its rank; it asks its :class:`Strategy` which layers this rank captures, keeps,
inverts and preconditions, and hands it the tensors to move at each phase of a step:

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

import logging
import math
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.blocks.base import Block
from dkfac.config import KFACConfig
from dkfac.distributed.comm import CommHandle, Communicator, Kind
from dkfac.distributed.strategy_base import Strategy, join_handles

__all__ = [
    "DPStrategy",
    "KaisaStrategy",
    "MemOptStrategy",
    "ReplicatedStrategy",
    "SPNGDStrategy",
    "Strategy",
    "build_strategy",
    "choose_strategy",
    "make_strategy",
    "resolve_auto",
]

logger = logging.getLogger(__name__)


class KaisaStrategy(Strategy):
    """KAISA hybrid: factors all-reduced, ``f·P`` grad workers per layer."""

    name = "kaisa"


class ReplicatedStrategy(KaisaStrategy):
    """SC20 / KAISA COMM-OPT: every rank keeps the factors and preconditions every layer."""

    name = "replicated"

    def __init__(
        self, comm: Communicator, costs: Mapping[str, float], *, pack_triangles: bool = False
    ) -> None:
        super().__init__(comm, costs, grad_worker_fraction=1.0, pack_triangles=pack_triangles)

    def keeps_statistics(self, name: str) -> bool:
        """Every rank keeps every layer's factors (they arrive all-reduced anyway)."""
        return True


class MemOptStrategy(KaisaStrategy):
    """KAISA MEM-OPT (f = 1/P): only the owner keeps, inverts and preconditions a layer."""

    name = "mem-opt"

    def __init__(
        self, comm: Communicator, costs: Mapping[str, float], *, pack_triangles: bool = False
    ) -> None:
        fraction = 1.0 / comm.world_size
        super().__init__(comm, costs, grad_worker_fraction=fraction, pack_triangles=pack_triangles)


class DPStrategy(MemOptStrategy):
    """DP-KFAC: a layer's factors are built only on its owner, from its local batch."""

    name = "dp"
    factor_reduction = "none"

    def captures(self, name: str) -> bool:
        """Only the owner's hooks do any work for the layer."""
        return self.is_owner(name)


class SPNGDStrategy(MemOptStrategy):
    """SP-NGD: gradients and factors reduce-scattered to owners, results all-gathered."""

    name = "spngd"
    factor_reduction = "reduce_scatter"

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


_STRATEGIES: dict[str, type[Strategy]] = {
    "replicated": ReplicatedStrategy,
    "kaisa": KaisaStrategy,
    "mem-opt": MemOptStrategy,
    "dp": DPStrategy,
    "spngd": SPNGDStrategy,
}


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
        pack_triangles: ``None``: on for ``"spngd"`` only.

    Raises:
        ValueError: For an unknown name or a fraction that does not fit the world size.
    """
    if name not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {tuple(_STRATEGIES)}, got {name!r}")
    pack = (name == "spngd") if pack_triangles is None else pack_triangles
    if name == "kaisa":
        return KaisaStrategy(
            comm, costs, grad_worker_fraction=grad_worker_fraction, pack_triangles=pack
        )
    klass: Any = _STRATEGIES[name]
    strategy: Strategy = klass(comm, costs, pack_triangles=pack)
    return strategy


def build_strategy(
    config: KFACConfig,
    comm: Communicator,
    blocks: Mapping[str, Block],
    *,
    ddp_wrapped: bool,
) -> Strategy:
    """The strategy a preconditioner with ``config`` uses for ``blocks``.

    Resolves ``"auto"`` with :func:`resolve_auto` (the cost model's recommendation) and
    balances inverse owners by ``config.placement_cost``.

    Raises:
        ValueError: For ``"spngd"`` with a DDP-wrapped model, or a fraction that does not
            fit the world size.
    """
    name: str = config.strategy
    if name == "spngd" and ddp_wrapped:
        raise ValueError(
            'strategy="spngd" averages the gradients itself (reduce-scatter to owners, '
            "all-gather of the results): pass the unwrapped model, not a "
            "DistributedDataParallel (use model.module)"
        )
    fraction = config.grad_worker_fraction
    if name == "auto":
        name, fraction = resolve_auto(config, comm.world_size, blocks, ddp_wrapped=ddp_wrapped)
        logger.info("strategy='auto' chose %r (grad_worker_fraction=%g)", name, fraction)
    costs = {layer: block.placement_cost(config.placement_cost) for layer, block in blocks.items()}
    return make_strategy(
        name,
        comm,
        costs,
        grad_worker_fraction=fraction,
        pack_triangles=config.pack_triangles,
    )


def resolve_auto(
    config: KFACConfig,
    world_size: int,
    blocks: Mapping[str, Block],
    *,
    ddp_wrapped: bool,
) -> tuple[str, float]:
    """``(strategy, grad_worker_fraction)`` for ``strategy="auto"``.

    The cost model's :func:`~dkfac.costmodel.select_strategy` (exact global-batch strategies
    only: no ``"dp"``; no ``"spngd"`` for a DDP model, only ``"spngd"`` without one) on the
    blocks' shapes, the factor dtype, the configured method and constant intervals, with the
    free memory of the CUDA device holding the first layer as the budget (none on CPU). When
    the blocks cannot be described (a user-registered block type), :func:`choose_strategy`.
    """
    from dkfac.costmodel import DtypeBytes, select_strategy, spec_from_blocks

    first = next(iter(blocks.values())).parameters()[0]
    budget = int(torch.cuda.mem_get_info(first.device)[0]) if first.is_cuda else None
    try:
        spec = spec_from_blocks(blocks)
    except ValueError as err:
        logger.info("strategy='auto': %s; using the rule of choose_strategy", err)
        state_bytes = 0
        for block in blocks.values():
            param = block.parameters()[0]
            numel = sum(math.prod(shape) for shape in block.statistic_shapes().values())
            state_bytes += 2 * numel * param.element_size()
        name = choose_strategy(
            world_size,
            ddp_wrapped=ddp_wrapped,
            replicated_state_bytes=state_bytes,
            memory_budget_bytes=budget,
        )
        return name, 1.0 / world_size if name in ("mem-opt", "dp", "spngd") else 1.0
    factor_size = torch.empty((), dtype=config.factor_dtype or first.dtype).element_size()
    intervals = [
        v if isinstance(v, int) and not isinstance(v, bool) else 1
        for v in (config.factor_update_interval, config.inverse_update_interval)
    ]
    return select_strategy(
        spec,
        world_size,
        ddp_wrapped=ddp_wrapped,
        memory_budget_bytes=budget,
        method=config.method if config.method in ("eigen", "cholesky") else "eigen",
        dtypes=DtypeBytes(factor=factor_size, inverse=factor_size, grad=first.element_size()),
        factor_interval=intervals[0],
        inverse_interval=intervals[1],
    )
