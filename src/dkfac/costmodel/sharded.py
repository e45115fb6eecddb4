"""Bytes and memory per rank of a model sharded with FSDP2 / HSDP: AdamW and K-FAC.

Under FSDP2 (``fully_shard``) every weight, gradient and optimizer state is cut on dim 0
over the ``S`` ranks of the shard group (``S = P`` for FSDP; HSDP: ``P / S`` replicas of
``S`` ranks). Two kinds of traffic follow:

* FSDP2's own (:func:`fsdp_bytes`, not on K-FAC's ledger, like DDP's all-reduce): the
  parameters all-gathered for the forward and, with ``reshard_after_forward``, again for the
  backward; the gradients reduce-scattered; under HSDP each rank's gradient shard also
  all-reduced over the replicas. Logical sizes as the ledger counts a collective (the
  gathered whole for an all-gather, the input for a reduce-scatter), padding ignored.
* K-FAC's (:func:`predict_sharded_ledger_bytes`, on the ledger): the strategy's own traffic,
  exactly as under DDP (:func:`~dkfac.costmodel.traffic.predict_ledger_bytes`: the factors
  are reduced over all ``P`` ranks, inverses and preconditioned gradients as placed), plus
  the *gradient exchange* of the sharded layout, kind ``"gradients"``. The exchange is a
  function of an :class:`ExchangeContext` (the model, world, shard group, strategy and its
  placement) that returns each rank's bytes by kind; :data:`EXCHANGES` names them. Where
  every rank preconditions every layer (``replicated``, ``kaisa`` with fraction 1)
  :func:`gathered_rows_bytes` prices it: every rank all-gathers every preconditioned layer's
  padded rows (``S · ceil(rows / S)`` rows of each weight and bias) over the shard group.
  Where only some do (``mem-opt``, ``dp``, ``kaisa`` below 1) :func:`owner_rows_bytes`
  prices the owner exchange (rows to the grad workers, each rank's rows of the results back,
  :func:`~dkfac.distributed.shard_plan.exchange_bytes`), which replaces the strategy's
  broadcast of preconditioned gradients. A layer is priced as one parameter of its
  :func:`layer_rows` (weight and bias cut alike); attention's ``in_proj`` (q, k and v cut
  together) is not modelled that way.

Memory per rank (:func:`sharded_state_bytes`): the largest rank's shard of the parameters,
gradients and optimizer states (``ceil(rows / S)`` rows of every K-FAC layer, the other
parameters cut evenly), and for K-FAC the strategy's curvature
(:func:`~dkfac.costmodel.traffic.predict_memory`, placed over all ``P`` ranks as under DDP)
plus, during ``step()``, the full gradients of the preconditioned layers the exchange
gathers (:func:`gathered_gradient_bytes`).

``spngd`` is not priced here: it reduces unreduced gradients itself and is refused for
sharded models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dkfac.blocks.base import CostKind
from dkfac.costmodel.layers import KFACLayer, ModelSpec
from dkfac.costmodel.traffic import (
    DtypeBytes,
    placement_for,
    predict_ledger_bytes,
    predict_memory,
    rule_of,
)
from dkfac.distributed.assignment import grad_workers_for, serving_worker
from dkfac.distributed.shard_plan import LayerRows, ShardedParam, exchange_bytes

__all__ = [
    "EXCHANGES",
    "SHARDED_STRATEGIES",
    "ExchangeContext",
    "GradientExchange",
    "fsdp_bytes",
    "gathered_gradient_bytes",
    "gathered_rows_bytes",
    "layer_rows",
    "layout_exchange",
    "owner_rows_bytes",
    "predict_sharded_ledger_bytes",
    "predict_sharded_memory",
    "shard_group_size",
    "sharded_state_bytes",
]

SHARDED_STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp")
"""The strategies offered for sharded models (``spngd`` is refused)."""


def shard_group_size(world_size: int, shard_size: int | None) -> int:
    """Ranks a weight is cut over: ``world_size`` (FSDP) or ``shard_size`` (HSDP).

    Raises:
        ValueError: For a world size below 1 or a shard size that does not divide it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if shard_size is None:
        return world_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")
    if world_size % shard_size:
        raise ValueError(f"shard_size {shard_size} does not divide world_size {world_size}")
    return shard_size


def layer_rows(layer: KFACLayer) -> tuple[int, int]:
    """``(rows, elements per row)`` of a layer's parameters as FSDP2 cuts them on dim 0.

    Weight and bias together: a Linear or Conv2d weight is ``g_dim`` rows (outputs) of
    ``a_dim - 1`` (its bias one more column); BatchNorm's ``γ`` and ``β`` are ``C`` rows
    each (``a_dim = 2`` columns); an Embedding's weight is ``a_dim`` rows (the vocabulary)
    of ``g_dim``.
    """
    if layer.kind == "embedding":
        return layer.a_dim, layer.g_dim
    return layer.g_dim, layer.a_dim


def _shard_elements(spec: ModelSpec, shard: int) -> int:
    """Parameter elements on the rank with the most (``ceil(rows / S)`` rows per layer)."""
    rows = 0
    for layer in spec.layers:
        n, per_row = layer_rows(layer)
        rows += math.ceil(n / shard) * per_row
    return rows + math.ceil(spec.other_param_numel / shard)


@dataclass(frozen=True, kw_only=True)
class ExchangeContext:
    """What a gradient exchange is priced from.

    Attributes:
        spec: The model.
        world_size: Ranks ``P``.
        shard: Ranks a weight is cut over (``S``).
        strategy: The K-FAC strategy (its placement decides the owners).
        grad_worker_fraction: KAISA's ``f``.
        dtypes: Element sizes.
        cost_kind: Placement cost kind.
    """

    spec: ModelSpec
    world_size: int
    shard: int
    strategy: str
    grad_worker_fraction: float
    dtypes: DtypeBytes
    cost_kind: CostKind


GradientExchange = Callable[[ExchangeContext], dict[int, dict[str, int]]]
"""Each rank's ledger bytes by kind of one step's gradient exchange: ``"gradients"`` adds to
the strategy's; a ``"preconditioned"`` entry replaces the strategy's (its broadcast does
not run)."""


def gathered_rows_bytes(ctx: ExchangeContext) -> dict[int, dict[str, int]]:
    """Every rank all-gathers the padded rows of every preconditioned layer over its shard
    group, ``S · ceil(rows / S) · elements per row`` per layer (the gathered whole, as the
    ledger counts an all-gather); nothing when ``S = 1``."""
    elements = 0
    for layer in ctx.spec.layers if ctx.shard > 1 else ():
        n, per_row = layer_rows(layer)
        elements += ctx.shard * math.ceil(n / ctx.shard) * per_row
    return {rank: {"gradients": elements * ctx.dtypes.grad} for rank in range(ctx.world_size)}


def owner_rows_bytes(ctx: ExchangeContext) -> dict[int, dict[str, int]]:
    """The owner exchange (module notes): the bytes of
    :func:`~dkfac.distributed.shard_plan.exchange_bytes`, the whole exchange's on every
    rank, as the ledger records them. Ranks are laid out as ``init_device_mesh`` numbers a
    ``(replicas, S)`` mesh: rank ``r`` is shard ``r % S`` of replica ``r // S``."""
    world = ctx.world_size
    place = placement_for(ctx.spec, world, ctx.strategy, ctx.grad_worker_fraction, ctx.cost_kind)
    fraction = rule_of(ctx.strategy).worker_fraction(world, ctx.grad_worker_fraction)
    params, layers = [], []
    for index, (layer, owner) in enumerate(zip(ctx.spec.layers, place.owners, strict=True)):
        rows, per_row = layer_rows(layer)
        params.append(ShardedParam(rows, per_row, ctx.dtypes.grad, ctx.shard))
        workers = tuple(grad_workers_for(owner, world, fraction))
        sources = tuple(serving_worker(workers, world, d) for d in range(world))
        layers.append(LayerRows(((index, 0, rows),), workers, sources))
    shard = [r % ctx.shard for r in range(world)]
    replica = [r // ctx.shard for r in range(world)]
    moved = dict(exchange_bytes(params, layers, shard, replica))
    return {rank: dict(moved) for rank in range(world)}


def layout_exchange(ctx: ExchangeContext) -> dict[int, dict[str, int]]:
    """The exchange the sharded layout runs for ``ctx``'s strategy (``shard_exchange=
    "exact"``): the owner exchange where only some ranks precondition a layer, else the
    all-gather."""
    place = placement_for(
        ctx.spec, ctx.world_size, ctx.strategy, ctx.grad_worker_fraction, ctx.cost_kind
    )
    if ctx.shard > 1 and place.n_workers < ctx.world_size:
        return owner_rows_bytes(ctx)
    return gathered_rows_bytes(ctx)


EXCHANGES: dict[str, GradientExchange] = {
    "exact": layout_exchange,
    "all-gather": gathered_rows_bytes,
    "owner": owner_rows_bytes,
}
"""The sharded layout's gradient exchanges by name (``"exact"``: the one it runs)."""


def _strategy(strategy: str) -> str:
    if strategy not in SHARDED_STRATEGIES:
        raise ValueError(
            f"strategy {strategy!r} is not offered for sharded models; use one of "
            f"{SHARDED_STRATEGIES}"
        )
    return strategy


def predict_sharded_ledger_bytes(
    spec: ModelSpec,
    world_size: int,
    strategy: str,
    *,
    shard_size: int | None = None,
    exchange: GradientExchange = layout_exchange,
    grad_worker_fraction: float = 1.0,
    method: str = "eigen",
    dtypes: DtypeBytes | None = None,
    factor_step: bool = True,
    inverse_step: bool = True,
    cost_kind: CostKind = "compute",
) -> dict[int, dict[str, int]]:
    """Bytes each rank's ledger records in one K-FAC step on a sharded model.

    The strategy's traffic as under DDP plus ``exchange``'s bytes (its ``"gradients"``
    added, its ``"preconditioned"`` in place of the strategy's broadcast).
    Arguments as :func:`~dkfac.costmodel.traffic.predict_ledger_bytes`, and:

    Args:
        shard_size: HSDP's shard group (``None``: FSDP, every rank).
        exchange: The gradient exchange (:data:`EXCHANGES`).

    Raises:
        ValueError: For ``spngd``, an unknown strategy or method, a bad world or shard size.
    """
    dt = dtypes or DtypeBytes()
    shard = shard_group_size(world_size, shard_size)
    out = predict_ledger_bytes(
        spec,
        world_size,
        _strategy(strategy),
        grad_worker_fraction=grad_worker_fraction,
        method=method,
        dtypes=dt,
        factor_step=factor_step,
        inverse_step=inverse_step,
        cost_kind=cost_kind,
    )
    ctx = ExchangeContext(
        spec=spec,
        world_size=world_size,
        shard=shard,
        strategy=strategy,
        grad_worker_fraction=grad_worker_fraction,
        dtypes=dt,
        cost_kind=cost_kind,
    )
    for rank, moved in exchange(ctx).items():
        out[rank]["gradients"] += moved.get("gradients", 0)
        if "preconditioned" in moved:
            out[rank]["preconditioned"] = moved["preconditioned"]
    return out


def fsdp_bytes(
    spec: ModelSpec,
    world_size: int,
    *,
    shard_size: int | None = None,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> dict[str, int]:
    """FSDP2's own bytes per rank and step (the same for AdamW and K-FAC; not on the ledger).

    Returns:
        ``{"param_all_gather", "grad_reduce_scatter", "replica_all_reduce"}``: the
        parameters gathered for the forward (and again for the backward when resharded
        after the forward), the gradients reduce-scattered over the shard group, and under
        HSDP each rank's gradient shard all-reduced over the replicas. All 0 when no
        collective runs (``S = 1`` and one replica).
    """
    shard = shard_group_size(world_size, shard_size)
    numel = spec.param_numel
    gathers = 2 if reshard_after_forward else 1
    cut = shard > 1
    return {
        "param_all_gather": gathers * numel * param_bytes if cut else 0,
        "grad_reduce_scatter": numel * grad_bytes if cut else 0,
        "replica_all_reduce": (
            math.ceil(numel / shard) * grad_bytes if world_size // shard > 1 else 0
        ),
    }


def sharded_state_bytes(
    spec: ModelSpec,
    world_size: int,
    *,
    shard_size: int | None = None,
    optimizer_states: int,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    state_bytes: int = 4,
) -> dict[str, int]:
    """The largest rank's shard of parameters, gradients and optimizer states, in bytes.

    Args:
        optimizer_states: Tensors the optimizer keeps per parameter (AdamW 2, SGD with
            momentum 1, without 0).

    Returns:
        ``{"params", "grads", "optimizer"}``.
    """
    elements = _shard_elements(spec, shard_group_size(world_size, shard_size))
    return {
        "params": elements * param_bytes,
        "grads": elements * grad_bytes,
        "optimizer": optimizer_states * elements * state_bytes,
    }


def gathered_gradient_bytes(spec: ModelSpec, dtypes: DtypeBytes | None = None) -> int:
    """The full gradients of the preconditioned layers a rank holds during ``step()`` under
    the all-gather (gathered, then dropped once its rows are written back); under the owner
    exchange a rank holds only its own layers' (at most this)."""
    return spec.kfac_param_numel * (dtypes or DtypeBytes()).grad


def predict_sharded_memory(
    spec: ModelSpec, world_size: int, strategy: str, **options: Any
) -> dict[int, dict[str, int]]:
    """K-FAC state per rank on a sharded model, by ``pre.memory_usage()``'s kinds.

    Curvature is placed over all ranks by the strategy as under DDP, so this is
    :func:`~dkfac.costmodel.traffic.predict_memory` (same keyword options) for the
    strategies offered.

    Raises:
        ValueError: For ``spngd`` or as :func:`~dkfac.costmodel.traffic.predict_memory`.
    """
    return predict_memory(spec, world_size, _strategy(strategy), **options)
