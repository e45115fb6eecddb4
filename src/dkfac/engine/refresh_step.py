"""The refresh policy's part in a step: what is due, what was refreshed, agreed intervals.

A :class:`~dkfac.engine.refresh.RefreshPolicy` is a pure schedule keyed by statistic
(``"<layer>/<statistic>"``). These functions connect it with the registered layers:

* :func:`mark_due` sets every layer's ``due`` statistics before a step (the hooks capture
  only those; a statistic not due costs nothing);
* :func:`record_refreshes` tells the policy the old and new values of the statistics this
  rank keeps (before the running averages are updated in place);
* :func:`agree_intervals`: under :class:`~dkfac.engine.refresh.AdaptiveRefresh` only the ranks
  that keep a statistic can measure its change, so after each refresh every rank adopts the
  mean interval of those ranks (one small all-reduce) and the schedule stays the same on
  every rank;
* :func:`refresh_report` reports the last step's refreshes and the adaptive intervals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dkfac.distributed.comm import Communicator
from dkfac.engine.layer_state import LayerState, layers_device
from dkfac.engine.refresh import AdaptiveRefresh, RefreshPolicy

__all__ = ["agree_intervals", "mark_due", "record_refreshes", "refresh_report"]


def mark_due(refresh: RefreshPolicy, layers: Mapping[str, LayerState], step: int) -> bool:
    """Sets each layer's ``due`` statistics at ``step``; whether any statistic is due.

    The answer is the same on every rank (the policy's state is agreed).
    """
    for name, layer in layers.items():
        layer.due = refresh.due_keys(name, layer.statistic_names(), step)
    return any(layer.due for layer in layers.values())


def record_refreshes(
    refresh: RefreshPolicy,
    layers: Mapping[str, LayerState],
    kept: Mapping[str, Mapping[str, Tensor]],
    step: int,
) -> list[str]:
    """Tells ``refresh`` the statistics refreshed at ``step``; their keys.

    Call it before the running averages are updated: the old values are the running
    tensors, which the update changes in place. A statistic whose kind is not
    ``comparable`` (a low-rank side's ``U`` changes shape as it grows) is recorded as a first
    value (its interval stays put).

    Args:
        refresh: The policy.
        layers: The registered layers (their running statistics are the old values).
        kept: The new statistics by layer that enter this rank's running averages.
        step: The step of the refresh.
    """
    refreshed: list[tuple[str, Tensor | None, Tensor]] = []
    for name, stats in kept.items():
        layer = layers[name]
        olds = {k: layer.running.get(k) if layer.kinds[k].comparable else None for k in stats}
        refreshed += [(f"{name}/{k}", olds[k], v) for k, v in stats.items()]
    refresh.record_many(step, refreshed)  # one host synchronisation
    return [key for key, _, _ in refreshed]


def agree_intervals(
    refresh: RefreshPolicy,
    comm: Communicator,
    layers: Mapping[str, LayerState],
    recorded: list[str],
    step: int,
) -> None:
    """Every rank adopts the intervals computed by the ranks that keep each statistic.

    A no-op for a non-adaptive policy, on one process, and on a step that refreshed
    nothing; otherwise a collective over ``comm`` (every rank must call it).

    Args:
        refresh: The policy; under :class:`~dkfac.engine.refresh.AdaptiveRefresh` its intervals
            of this step's due statistics are set to the mean over the keeping ranks.
        comm: The communicator of the ranks that train together.
        layers: The registered layers (their ``due`` statistics are agreed on).
        recorded: The keys this rank recorded (:func:`record_refreshes`).
        step: The step of the refresh.
    """
    if not isinstance(refresh, AdaptiveRefresh):
        return
    keys = sorted(f"{n}/{k}" for n, layer in layers.items() for k in layer.due)
    if not keys or not comm.active:
        return
    intervals = {key: refresh.interval(key) for key in recorded}
    device = layers_device(layers)
    values = torch.tensor(
        [[float(intervals.get(k, 0)), float(k in intervals)] for k in keys],
        dtype=torch.float64,
        device=device,
    )
    totals = comm.sum_control(values)
    for key, (interval_sum, keepers) in zip(keys, totals.tolist(), strict=True):
        if keepers > 0:
            refresh.set_interval(key, step, round(interval_sum / keepers))


def refresh_report(
    refresh: RefreshPolicy, layers: Mapping[str, LayerState], refreshed: int
) -> dict[str, Any]:
    """``refreshed`` (at the last step), the ``total`` of statistics and adaptive ``intervals``.

    ``intervals`` maps every statistic key to its current interval (empty unless the
    policy is :class:`~dkfac.engine.refresh.AdaptiveRefresh`).
    """
    total = sum(len(layer.statistic_shapes()) for layer in layers.values())
    intervals = (
        {
            f"{n}/{k}": refresh.interval(f"{n}/{k}")
            for n, layer in layers.items()
            for k in layer.statistic_shapes()
        }
        if isinstance(refresh, AdaptiveRefresh)
        else {}
    )
    return {"refreshed": refreshed, "total": total, "intervals": intervals}
