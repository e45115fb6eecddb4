"""Which strategy a preconditioner uses: ``strategy="auto"`` resolved by the cost model.

The engine joins the axes here: the configuration, the blocks' cost descriptions
(:mod:`dkfac.costmodel`) and the strategy table (:mod:`dkfac.distributed.strategies`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping

import torch

from dkfac.blocks.base import Block
from dkfac.config import KFACConfig
from dkfac.costmodel import DtypeBytes, select_strategy, spec_from_blocks
from dkfac.distributed.comm import Communicator
from dkfac.distributed.shard_local import LocalRowsStrategy
from dkfac.distributed.strategies import Strategy, choose_strategy, make_strategy

__all__ = ["build_strategy", "local_layers", "resolve_auto"]

logger = logging.getLogger(__name__)


def build_strategy(
    config: KFACConfig,
    comm: Communicator,
    blocks: Mapping[str, Block],
    *,
    ddp_wrapped: bool,
) -> Strategy:
    """The strategy a preconditioner with ``config`` uses for ``blocks``.

    Resolves ``"auto"`` with :func:`resolve_auto` (the cost model's recommendation) and
    balances inverse owners by ``config.placement_cost``. With ``shard_exchange="local"``
    it is the local mode's :class:`~dkfac.distributed.shard_local.LocalRowsStrategy`
    (``"replicated"`` and ``"auto"`` only).

    Raises:
        ValueError: For ``"spngd"`` with a DDP-wrapped model, a fraction that does not fit
            the world size, or ``shard_exchange="local"`` with a strategy that places
            layers on owners.
    """
    name: str = config.strategy
    costs = {layer: block.placement_cost(config.placement_cost) for layer, block in blocks.items()}
    if config.shard_exchange == "local":
        return _local_rows_strategy(config, comm, costs)
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
    return make_strategy(
        name,
        comm,
        costs,
        grad_worker_fraction=fraction,
        pack_triangles=config.pack_triangles,
    )


def local_layers(
    config: KFACConfig, blocks: Mapping[str, Block], orthogonal: Collection[str] = ()
) -> list[str]:
    """The layers ``shard_exchange="local"`` has each rank precondition on its own rows:
    those whose rows are output rows (:attr:`~dkfac.blocks.base.Block.rows_are_outputs`)
    and whose update is not orthogonalised (``orthogonal``: a polar factor couples every
    row of the update, so those layers are preconditioned whole); none under ``"exact"``.

    Raises:
        ValueError: For ``"local"`` with ``basis_block_size`` (its ``G`` blocks would not
            line up with a rank's rows).
    """
    if config.shard_exchange != "local":
        return []
    if config.basis_block_size is not None:
        raise ValueError(
            "shard_exchange=\"local\" cuts G at each rank's rows, which basis_block_size's "
            "blocks do not line up with: leave basis_block_size=None, or use "
            'shard_exchange="exact"'
        )
    return [
        name for name, block in blocks.items() if block.rows_are_outputs and name not in orthogonal
    ]


def _local_rows_strategy(
    config: KFACConfig, comm: Communicator, costs: Mapping[str, float]
) -> Strategy:
    """``replicated`` with every rank its rows' owner (``shard_exchange="local"``)."""
    if config.strategy not in ("replicated", "auto"):
        raise ValueError(
            f'shard_exchange="local" has every rank precondition its own rows of every '
            f'layer, which strategy="{config.strategy}" cannot (it places each layer on '
            'owners): use strategy="replicated" with it, or shard_exchange="exact" with '
            f'strategy="{config.strategy}"'
        )
    return LocalRowsStrategy(comm, costs, pack_triangles=config.pack_triangles)


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
