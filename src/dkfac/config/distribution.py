"""The distribution group: :class:`DistributionConfig`, how the work is spread over ranks.

The strategies it accepts come from :data:`dkfac.distributed.strategies.STRATEGIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from dkfac.config.checks import check_bool, check_choice, check_int, check_range, python_numbers
from dkfac.distributed.strategies import STRATEGIES, StrategyName

__all__ = [
    "OVERLAP_MODES",
    "PLACEMENT_COSTS",
    "SHARD_EXCHANGES",
    "STRATEGY_CHOICES",
    "DistributionConfig",
    "OverlapMode",
    "PlacementCost",
    "ShardExchange",
    "StrategyChoice",
]

StrategyChoice = Literal[StrategyName, "auto"]
STRATEGY_CHOICES: tuple[str, ...] = get_args(StrategyChoice)
PlacementCost = Literal["compute", "memory"]
PLACEMENT_COSTS: tuple[str, ...] = get_args(PlacementCost)
OverlapMode = Literal["auto", "on", "off"]
OVERLAP_MODES: tuple[str, ...] = get_args(OverlapMode)
ShardExchange = Literal["exact", "local"]
SHARD_EXCHANGES: tuple[str, ...] = get_args(ShardExchange)


@dataclass(frozen=True, kw_only=True)
class DistributionConfig:
    """How the work is spread over ranks (``docs/distributed.md``).

    Attributes:
        strategy: ``"replicated"`` (SC20 / KAISA COMM-OPT), ``"kaisa"`` (gradient-worker
            fraction ``grad_worker_fraction``), ``"mem-opt"`` (one gradient worker per
            layer), ``"dp"`` (DP-KFAC), ``"spngd"`` (SP-NGD; takes an unwrapped model and
            averages every gradient itself) or ``"auto"``: the cost model's
            :func:`dkfac.costmodel.select_strategy` picks the fastest strategy that computes
            the exact global-batch update and fits in memory (spngd when the model is not
            wrapped in DDP on several ranks; the rule of
            :func:`dkfac.distributed.strategies.choose_strategy` for models it cannot
            describe). The table is :data:`dkfac.distributed.strategies.STRATEGIES`.
        grad_worker_fraction: KAISA fraction f in (0, 1] of ranks that precondition each
            layer (``"kaisa"`` only); ``f × world_size`` must divide the world size.
        bucket_bytes: Maximum size in bytes of one flattened communication bucket.
        pack_triangles: Send symmetric factors as upper triangles; ``None`` means the
            strategy's own default (on for ``"spngd"``, off otherwise).
        placement_cost: How layers are balanced over inverse owners: ``"compute"``
            (``a_dim³ + g_dim³``) or ``"memory"`` (``a_dim² + g_dim²``).
        overlap_comm: Launch each layer's statistic (and, for ``"spngd"``, gradient)
            reduction from the backward hooks, in fixed buckets, so it overlaps the rest of
            the backward (:mod:`dkfac.engine.eager`). Only correct when every rank runs
            every registered layer on every step. ``"auto"`` (default): on when that is
            guaranteed, i.e. several ranks and a ``DistributedDataParallel`` model with
            ``find_unused_parameters=False``; ``"on"``: always (a rank that misses a layer
            raises ``RuntimeError`` in ``step()``); ``"off"``: reduce everything in
            ``step()`` after the ranks agree which layers ran (data-dependent branches).
        shard_exchange: For a model sharded with FSDP2 / HSDP (``fully_shard``):
            ``"exact"`` (default) moves gradient rows so that every layer is preconditioned
            whole (the serial update); ``"local"`` has each rank precondition its own rows
            of each Linear / Conv2d layer with the full ``A`` and its own diagonal block of
            ``G`` (no gradient traffic; the serial update with a block-diagonal ``G``),
            other layers (and those of ``orthogonal_layers``) whole as under
            ``"exact"``. ``"local"`` needs a sharded model and
            ``strategy="replicated"`` (or ``"auto"``, which then takes it), and no
            ``basis_block_size`` (its blocks would not line up with a rank's rows).
    """

    strategy: StrategyChoice = "replicated"
    grad_worker_fraction: float = 1.0
    bucket_bytes: int = 25 * 2**20
    pack_triangles: bool | None = None
    placement_cost: PlacementCost = "compute"
    overlap_comm: OverlapMode = "auto"
    shard_exchange: ShardExchange = "exact"

    def __post_init__(self) -> None:
        python_numbers(self)
        self._check_distribution()

    def _check_distribution(self) -> None:
        check_choice("strategy", self.strategy, (*STRATEGIES, "auto"))
        check_range(
            "grad_worker_fraction",
            self.grad_worker_fraction,
            low=0.0,
            high=1.0,
            high_inclusive=True,
        )
        check_int("bucket_bytes", self.bucket_bytes)
        check_bool("pack_triangles", self.pack_triangles, optional=True)
        check_choice("placement_cost", self.placement_cost, PLACEMENT_COSTS)
        check_choice("overlap_comm", self.overlap_comm, OVERLAP_MODES)
        check_choice("shard_exchange", self.shard_exchange, SHARD_EXCHANGES)
