"""``strategy="auto"``: the cost model's recommendation among the strategies that may be used.

:func:`auto_candidates` says which ``(strategy, fraction)`` pairs are allowed and
:func:`select_strategy` asks :func:`~dkfac.costmodel.recommend` for the fastest of them that
fits the memory budget. Rules:

1. One rank: ``"replicated"`` (every strategy is the serial engine there).
2. Only strategies that compute the exact update of the global batch: ``"dp"`` (factors
   from one rank's local batch) is left out unless ``allow_local_factors=True``.
3. A model wrapped in ``DistributedDataParallel`` has its gradients averaged by DDP, so
   ``"spngd"`` (which averages them itself and refuses a DDP model) is left out. An unwrapped
   model on several ranks gets ``"spngd"`` only: every other strategy expects averaged
   gradients, and ``"auto"`` cannot know whether the caller averages them by hand (who does
   can name the strategy, or call this function with ``ddp_wrapped=True``).
4. Among those, :func:`~dkfac.costmodel.recommend`'s choice; when nothing fits the budget,
   the candidate that needs the least memory (logged as a warning).

The time model's defaults (:class:`~dkfac.costmodel.DeviceRates`, a local batch of 32 and one
output position per layer) are used as given: the choice depends on ratios of layer sizes,
world size and interval settings far more than on the absolute rates.
"""

from __future__ import annotations

import logging

from dkfac.costmodel.layers import ModelSpec
from dkfac.costmodel.predict import (
    DeviceRates,
    StrategyPrediction,
    candidate_strategies,
    recommend,
)
from dkfac.costmodel.traffic import DtypeBytes

__all__ = ["AUTO_BATCH_PER_RANK", "auto_candidates", "select_strategy"]

logger = logging.getLogger(__name__)

AUTO_BATCH_PER_RANK = 32
"""Local batch the time model assumes when the caller does not know it."""


def auto_candidates(
    world_size: int, *, ddp_wrapped: bool, allow_local_factors: bool = False
) -> list[tuple[str, float]]:
    """The ``(strategy, fraction)`` pairs ``"auto"`` chooses from (rules 1–3 above).

    Raises:
        ValueError: If ``world_size`` is not an integer >= 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size == 1:
        return [("replicated", 1.0)]
    if not ddp_wrapped:
        return [("spngd", 1.0 / world_size)]
    return [
        (name, fraction)
        for name, fraction in candidate_strategies(world_size)
        if name != "spngd" and (name != "dp" or allow_local_factors)
    ]


def select_strategy(
    spec: ModelSpec,
    world_size: int,
    *,
    ddp_wrapped: bool,
    memory_budget_bytes: float | None = None,
    allow_local_factors: bool = False,
    batch_per_rank: int = AUTO_BATCH_PER_RANK,
    rates: DeviceRates | None = None,
    method: str = "eigen",
    dtypes: DtypeBytes | None = None,
    factor_interval: int = 1,
    inverse_interval: int = 1,
) -> tuple[str, float]:
    """The strategy and grad-worker fraction ``strategy="auto"`` uses.

    Args:
        spec: The model (:func:`~dkfac.costmodel.extract_layers` or
            :func:`~dkfac.costmodel.spec_from_blocks`).
        world_size: Ranks.
        ddp_wrapped: Whether the model is a ``DistributedDataParallel``.
        memory_budget_bytes: Per-rank memory budget (free accelerator memory), ``None`` for
            unlimited.
        allow_local_factors: Also consider ``"dp"``.
        batch_per_rank: Local batch for the time model.
        rates: Device rates (default :class:`DeviceRates`).
        method: ``"eigen"`` or ``"cholesky"``.
        dtypes: Element sizes.
        factor_interval: Steps between factor updates.
        inverse_interval: Steps between inverse updates.

    Returns:
        ``(strategy name, grad_worker_fraction)``.

    Raises:
        ValueError: For a bad argument (named in the message).
    """
    pairs = auto_candidates(
        world_size, ddp_wrapped=ddp_wrapped, allow_local_factors=allow_local_factors
    )
    if world_size == 1:
        return pairs[0]

    def run(budget: float | None) -> tuple[StrategyPrediction, list[StrategyPrediction]]:
        return recommend(
            spec,
            world_size,
            batch_per_rank=batch_per_rank,
            rates=rates,
            memory_budget_bytes=budget,
            strategies=pairs,
            method=method,
            dtypes=dtypes,
            factor_interval=factor_interval,
            inverse_interval=inverse_interval,
        )

    try:
        choice, _ = run(memory_budget_bytes)
    except ValueError as err:
        if memory_budget_bytes is None or "fits memory_budget_bytes" not in str(err):
            raise
        choice = min(run(None)[1], key=_need)
        logger.warning("%s; using %s, which needs the least", err, choice.label)
    return choice.strategy, choice.grad_worker_fraction


def _need(pred: StrategyPrediction) -> int:
    return pred.memory_max + pred.model_state_bytes
