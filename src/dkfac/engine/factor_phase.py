"""Phase 1 of a step (``dkfac.factors``): the captured statistics reduced, the averages updated.

The statistics the hooks captured travel as the strategy says, in the same buffers as the
gradient reduction a strategy does itself: launched by the backward hooks with
``overlap_comm`` (:mod:`~dkfac.engine.eager`), else here once the ranks agree which layers
ran (:mod:`~dkfac.engine.presence`); :func:`reduce_statistics` waits for them and puts the
gradient statistics on the per-sample scale. :func:`update_factors` then updates the
running averages this rank keeps and tells the refresh policy what changed
(:mod:`~dkfac.engine.refresh_step`). The preconditioner agrees on the finiteness flags in
between (:func:`~dkfac.engine.step_math.finite_flags`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from dkfac.config import KFACConfig, resolve
from dkfac.distributed.comm import Communicator
from dkfac.distributed.strategies import Strategy
from dkfac.engine.capture import FactorCapture
from dkfac.engine.eager import EagerReducer
from dkfac.engine.layer_state import LayerState, update_running_all
from dkfac.engine.presence import agree_presence
from dkfac.engine.refresh import RefreshPolicy
from dkfac.engine.refresh_step import agree_intervals, record_refreshes
from dkfac.engine.step_math import kept_statistics

__all__ = ["g_scale", "reduce_statistics", "update_factors"]


def g_scale(capture: FactorCapture, fisher: str, grad_scaler: Any | None) -> float:
    """``k²`` for the ``k`` micro-batches of the step (each one's loss is divided by ``k``;
    a sampled Fisher backward's is not), over the square of an enabled GradScaler's scale
    (G was captured from scaled gradients)."""
    passes = capture.backward_passes() if fisher == "empirical" else 1
    scale = float(passes) ** 2
    if grad_scaler is not None and grad_scaler.is_enabled():
        return scale * float(grad_scaler.get_scale()) ** -2
    return scale


def reduce_statistics(
    layers: dict[str, LayerState],
    grads: dict[str, Tensor | None],
    capturing: bool,
    *,
    capture: FactorCapture,
    eager: EagerReducer | None,
    comm: Communicator,
    strategy: Strategy,
    other_params: Sequence[Tensor],
    fisher: str,
    grad_scaler: Any | None,
) -> dict[str, dict[str, Tensor]]:
    """Phase 1's traffic (overlapped or not); this step's reduced statistics by layer.

    Args:
        layers: The registered layers.
        grads: Each layer's gradient (``None``: it has none this step).
        capturing: Whether the hooks captured any statistic this step.
        capture: The capture hooks' sums.
        eager: The overlapped reduction, if ``overlap_comm`` is on.
        comm: The communicator of the training ranks.
        strategy: Reduces the statistics (and, for ``"spngd"``, the gradients).
        other_params: The parameters no layer takes (their gradients travel too under a
            strategy that reduces gradients itself).
        fisher: The Fisher kind (``"empirical"``: G is averaged over the micro-batches).
        grad_scaler: The GradScaler, if any (G was captured from scaled gradients).
    """
    if eager is not None:
        new, handle = eager.finish(grads, other_params)
    else:
        new = capture.collect(layers, 1.0) if capturing else {}
        agree_presence(comm, layers, new, grads, other_params)
        present = {name: g for name, g in grads.items() if g is not None}
        others = [p.grad for p in other_params if p.grad is not None]
        gathered = {n: x.gathered() for n, x in layers.items() if x.gathered()}
        handle = strategy.reduce_step(new, gathered, present, others)
    handle.wait()
    if new:
        capture.scale_grad_statistics(layers, new, g_scale(capture, fisher, grad_scaler))
    return new


def update_factors(
    layers: Mapping[str, LayerState],
    new: dict[str, dict[str, Tensor]],
    finite: dict[str, tuple[bool, bool]],
    step: int,
    *,
    config: KFACConfig,
    strategy: Strategy,
    refresh: RefreshPolicy,
    comm: Communicator,
) -> int:
    """Updates the running averages this rank keeps; the refresh policy learns of them.

    Returns:
        The statistics refreshed at this step (those due, on every layer).
    """
    decay = resolve("factor_decay", config.factor_decay, step)
    assert decay is not None
    refreshed = sum(len(layer.due) for layer in layers.values())
    kept = kept_statistics(strategy, new, finite, step)
    recorded = record_refreshes(refresh, layers, kept, step)  # before updates
    update_running_all(layers, kept, decay)
    agree_intervals(refresh, comm, layers, recorded, step)
    return refreshed
