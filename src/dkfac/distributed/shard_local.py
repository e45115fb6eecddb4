"""The sharded layout's local mode: each rank preconditions its own rows, no gradient traffic.

With ``shard_exchange="local"`` a layer whose sharded rows are output rows of its gradient
matrix (Linear, Conv2d) is preconditioned by every rank on its own rows only, with the full
``A`` factor and the diagonal block of ``G`` that its rows span: the serial update with a
block-diagonal ``G`` (the off-diagonal blocks, which couple rows held by different ranks,
taken as zero). Nothing of its gradient travels; the factors are all-reduced as under
``replicated``, and each rank computes its own rows' solver state (no inverse broadcast).
Layers whose rows are not output rows (embeddings, HF Conv1D, unit-wise BatchNorm) are
all-gathered and preconditioned whole on every rank, as under ``"exact"``.

:class:`LocalRowsStrategy` is the ``replicated`` strategy with every rank the inverse
owner and grad worker of its own rows of every layer; :class:`LocalDelivery` delivers
nothing and adds the KL-clip sum of the rows once over the shard group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from dkfac.distributed.strategies import ReplicatedStrategy
from dkfac.distributed.strategy_base import SolverState

__all__ = ["LocalDelivery", "LocalRowsStrategy"]


class LocalRowsStrategy(ReplicatedStrategy):
    """``replicated`` with every rank computing and applying the solver of its own rows.

    Every rank keeps every layer's factors (all-reduced), computes each layer's solver
    state from them (its own rows' block of ``G`` for a local layer, all of it for an
    all-gathered one) and preconditions it; no solver state travels, and none is saved in
    checkpoints (:attr:`shares_solver_states`): they differ by rank, and a loaded
    checkpoint recomputes them from the saved factors.
    """

    shares_solver_states = False

    def is_owner(self, name: str) -> bool:
        """Every rank computes its own solver state of every layer."""
        del name
        return True

    def preconditions(self, name: str) -> bool:
        """Every rank preconditions its rows of every layer."""
        del name
        return True

    def source(self, name: str, index: int) -> int:
        """Every rank serves itself."""
        del name
        return index

    def share_solver_states(
        self, states: dict[str, SolverState | None], devices: Mapping[str, torch.device]
    ) -> None:
        """Nothing travels; :attr:`ready` becomes the layers with a state on every rank."""
        if not states:
            self.ready = set()
            return
        names = list(states)
        device = devices[names[0]]
        flags = torch.tensor([states[n] is not None for n in names], device=device)
        agreed = self.agree(flags).tolist()
        self.ready = {name for name, ok in zip(names, agreed, strict=True) if ok}


class LocalDelivery:
    """The delivery and KL-clip phases of the local mode.

    Args:
        strategy: The :class:`LocalRowsStrategy`.
        local: The layers each rank preconditions on its own rows.
        first_replica: Whether this rank is in the first shard group (whose ranks hold
            every row once).
    """

    def __init__(
        self, strategy: LocalRowsStrategy, local: Collection[str], first_replica: bool
    ) -> None:
        self.strategy = strategy
        self.local = frozenset(local)
        self.first_replica = first_replica

    def distribute(self, finals: Mapping[str, Tensor], ready_finite: Sequence[str]) -> list[str]:
        """Every ready layer: each rank computed its own result (nothing travels)."""
        del finals
        return list(ready_finite)

    def kl_layers(self, ready_finite: Sequence[str]) -> list[str]:
        """Each layer once over all ranks: a local layer's rows on the first shard group
        (together they are the layer), an all-gathered layer on its placement owner."""
        placement = self.strategy.placement
        index = self.strategy.index
        return [
            name
            for name in ready_finite
            if (
                self.first_replica if name in self.local else placement[name].inverse_owner == index
            )
        ]

    def reduce_kl(self, partial: Tensor) -> Tensor:
        """Sum of every rank's partial sum."""
        return self.strategy.comm.sum_control(partial)
