"""How a preconditioner's parts are put together when it is built.

After registration (:mod:`~dkfac.engine.registration`) the blocks are placed on the ranks
(:func:`place_blocks`: the communicator, the sharded layout if any, the strategy and who
delivers the preconditioned gradients), their layers' states created and joined to the
capture hooks (:func:`join_layers`), and the parameters no block takes given Adam's
direction where ``leftover_update`` says so (:func:`leftover_for`), with those added later
(:func:`adopt_parameters`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from dkfac.blocks.base import Block
from dkfac.config import KFACConfig, leftover_adam
from dkfac.distributed.comm import Communicator
from dkfac.distributed.layout import ShardedLayout
from dkfac.distributed.shard_exchange import Delivery
from dkfac.distributed.sharding import find_layout
from dkfac.distributed.strategies import Strategy
from dkfac.engine.capture import FactorCapture, rank_mean
from dkfac.engine.layer_state import LayerState
from dkfac.engine.leftover import LeftoverAdam
from dkfac.engine.registration import (
    create_layers,
    ddp_wrapper,
    orthogonal_layers,
    rows_rule,
    unwrap,
)
from dkfac.engine.roles import block_roles
from dkfac.engine.strategy_choice import build_strategy, local_layers

__all__ = ["Placement", "adopt_parameters", "join_layers", "leftover_for", "place_blocks"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a preconditioner's work runs and what travels between the ranks."""

    comm: Communicator
    layout: ShardedLayout | None
    """The sharded layout of an FSDP2 / HSDP model (``None``: plain parameters)."""
    strategy: Strategy
    delivery: Delivery
    """The strategy, or the sharded layout's owner exchange in front of it."""


def place_blocks(
    model: nn.Module,
    blocks: Mapping[str, Block],
    config: KFACConfig,
    process_group: Any | None,
    roles: Mapping[str, str],
) -> Placement:
    """The communicator of ``process_group``, the model's layout and the strategy for
    ``blocks`` (:func:`~dkfac.engine.strategy_choice.build_strategy`); ``roles`` are the
    model's :func:`~dkfac.engine.roles.layer_roles` (which layers are orthogonalised).

    Raises:
        ValueError: For a sharded model K-FAC cannot take, or a strategy that cannot take
            the model (``"spngd"`` with a DDP-wrapped or sharded one).
    """
    comm = Communicator(process_group, bucket_bytes=config.bucket_bytes)
    layout = find_layout(
        model,
        {name: b.parameters() for name, b in blocks.items()},
        strategy=config.strategy,
        ledger=comm.ledger,
        bucket_bytes=config.bucket_bytes,
        shard_exchange=config.shard_exchange,
    )
    strategy = build_strategy(
        config,
        comm,
        blocks,
        ddp_wrapped=ddp_wrapper(model) is not None or layout is not None,
    )
    delivery: Delivery = (
        strategy
        if layout is None
        else layout.attach(
            strategy,
            {name: b.parameter_parts() for name, b in blocks.items()},
            local_layers(config, blocks, _orthogonalised(blocks, config, roles)),
        )
    )
    return Placement(comm, layout, strategy, delivery)


def _orthogonalised(
    blocks: Mapping[str, Block], config: KFACConfig, roles: Mapping[str, str]
) -> set[str]:
    """The layers whose updates are orthogonalised, where the local mode needs to know."""
    if config.shard_exchange != "local" or not config.orthogonal_layers:
        return set()
    return orthogonal_layers(blocks, config, roles)


def join_layers(
    model: nn.Module,
    blocks: Mapping[str, Block],
    config: KFACConfig,
    placement: Placement,
    capture: FactorCapture,
    roles: Mapping[str, str],
) -> tuple[dict[str, LayerState], dict[str, str]]:
    """Every block's layer state, attached to the capture hooks; the layers' roles
    (``roles``: the model's :func:`~dkfac.engine.roles.layer_roles`, per block).

    The capture averages over the ranks where the strategy gathers statistics, each layer
    captures what its strategy says it keeps, and under the sharded layout's local mode
    each rank keeps its rows' G block.
    """
    strategy = placement.strategy
    gathered = 1 if strategy.factor_reduction == "none" else strategy.world_size
    if gathered > 1 and placement.comm.active:
        capture.rank_mean = functools.partial(rank_mean, placement.comm)
    layers = create_layers(blocks, config, rows_rule(config, gathered), roles)
    if placement.layout is not None:  # shard_exchange="local": each rank its rows' G block
        for name, rows in placement.layout.local_rows().items():
            layers[name].g_rows = rows
    for name, layer in layers.items():
        layer.captures = strategy.captures(name)
        capture.attach(layer.block.module, layer)
    return layers, block_roles(roles, layers)


def leftover_for(
    model: nn.Module, config: KFACConfig, other_params: Sequence[Tensor]
) -> LeftoverAdam | None:
    """Adam for ``other_params`` (the parameters no layer takes) where ``leftover_update``
    is on, named as in ``model``; ``None`` where it is off.

    Raises:
        ValueError: If one of them is the weight of a module with sparse gradients
            (``nn.Embedding(sparse=True)``): Adam's moments are dense, its direction would
            not be a sparse gradient.
    """
    if not leftover_adam(config):
        return None
    ids = {id(p) for p in other_params}
    named = {n: p for n, p in unwrap(model).named_parameters() if id(p) in ids}
    sparse = _sparse_weights(unwrap(model), ids)
    if sparse:
        raise ValueError(
            f"{', '.join(sparse)}: a sparse=True embedding's gradient cannot take Adam's "
            f"direction (leftover_update={config.leftover_update!r} under method="
            f"{config.method!r}): build it with sparse=False (K-FAC then preconditions it), "
            'or pass leftover_update="gradient" to leave its sparse gradient to the inner '
            "optimizer"
        )
    return LeftoverAdam(named, config)


def _sparse_weights(model: nn.Module, ids: set[int]) -> list[str]:
    """The names of the parameters whose ids are in ``ids`` and that are the weight of a
    module with sparse gradients (``nn.Embedding`` or ``nn.EmbeddingBag``, ``sparse=True``)."""
    return [
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if getattr(module, "sparse", False) is True and id(getattr(module, "weight", None)) in ids
    ]


def adopt_parameters(
    params: Sequence[Tensor],
    prefix: str,
    layers: Mapping[str, LayerState],
    other_params: list[Tensor],
    leftover: LeftoverAdam | None,
) -> None:
    """Adds to ``other_params`` (in place) each of ``params`` that neither a layer nor
    ``other_params`` holds yet, and gives it to ``leftover`` (named ``prefix.i``) if any."""
    known = {id(p) for p in other_params}
    known.update(id(p) for layer in layers.values() for p in layer.block.parameters())
    for i, param in enumerate(params):
        if id(param) in known:
            continue
        other_params.append(param)
        if leftover is not None:
            leftover.params[f"{prefix}.{i}"] = param
