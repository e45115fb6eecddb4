"""The work of each phase of a step; :class:`dkfac.KFACPreconditioner` runs them in order.

A step reads the layers' gradients (:func:`read_gradients`), then runs five phases, each
under a ``torch.profiler.record_function`` label:

1. ``dkfac.factors``: the factors captured by the hooks are reduced as the strategy says
   (all-reduce, reduce-scatter to owners, or nothing) in asynchronous buckets, with any
   gradient reduction the strategy does itself (``spngd``: in the same buffers). With
   ``overlap_comm`` on, the backward hooks already launched each bucket once its layers
   were final (:mod:`~dkfac.engine.eager`); otherwise all is launched here once the
   ranks agree which layers ran (:mod:`~dkfac.engine.presence`; :func:`reduce_statistics`).
   After one wait, ranks agree on which layers have finite factors and gradients
   (:func:`agree_finite`); the ranks that keep a layer's factors update its running
   averages (:func:`update_factors`,
   :meth:`~dkfac.engine.layer_state.LayerState.update_running`), and the refresh policy
   records what changed and, when adaptive, the ranks agree on its intervals
   (:mod:`~dkfac.engine.refresh_step`). Only statistics the policy marked due are captured;
   the hooks do no work on other steps.
2. ``dkfac.inverse``: on inverse-update steps each layer's owner recomputes its solver state
   and the strategy sends it to the layer's gradient workers
   (the preconditioner's ``update_inverses``, :func:`~dkfac.engine.step_math.update_inverses`).
3. ``dkfac.precondition``: each gradient worker replaces its layers' gradients by the damped
   natural gradient (:func:`precondition_gradients`, :func:`~dkfac.engine.step_math.precondition`;
   with ``orthogonal_input_rms`` an orthogonalised update is divided by its input's RMS
   entry, averaged over the ranks first: :mod:`~dkfac.engine.input_rms`).
4. ``dkfac.distribute``: the strategy delivers preconditioned gradients to every rank
   (:meth:`~dkfac.distributed.strategy_base.Strategy.distribute`).
5. ``dkfac.kl_clip``: all preconditioned gradients are scaled by the KL-clip factor ν (the
   sum runs over every layer, whichever rank preconditioned it;
   :func:`~dkfac.engine.step_math.kl_clip_scale`) and written back
   (:func:`clip_and_write`, :func:`~dkfac.engine.step_math.write_back`).

Between 2 and 3, with ``leftover_update`` (the default under ``"eigen_adam"``),
``dkfac.leftover`` replaces the gradients of the parameters no block takes by Adam's
direction on them (:mod:`~dkfac.engine.leftover`). It runs there, after phase 1's
reductions and flags, so that every moment, the layers' and its own, advances only on a
step whose gradients are all finite: the step the optimizer takes. Without it, the layers'
moments wait for the other gradients' flag alone (:func:`others_finite`).

The per-layer math is in :mod:`~dkfac.engine.step_math`; the parts a step runs through,
fixed when the preconditioner is built, travel together as :class:`StepParts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.config import KFACConfig, resolve
from dkfac.distributed.comm import Communicator
from dkfac.distributed.layout import ShardedLayout
from dkfac.distributed.shard_exchange import Delivery
from dkfac.distributed.strategies import Strategy
from dkfac.engine.capture import FactorCapture
from dkfac.engine.device_checks import DeviceGuard
from dkfac.engine.eager import EagerReducer
from dkfac.engine.finite import gradients_finite
from dkfac.engine.input_rms import input_scales
from dkfac.engine.layer_state import LayerState, update_running_all
from dkfac.engine.presence import agree_presence
from dkfac.engine.refresh import RefreshPolicy
from dkfac.engine.refresh_step import agree_intervals, record_refreshes
from dkfac.engine.step_math import (
    finite_flags,
    kept_statistics,
    kl_clip_scale,
    precondition,
    presence_token,
    write_back,
)

__all__ = [
    "StepParts",
    "agree_finite",
    "clip_and_write",
    "g_scale",
    "others_finite",
    "precondition_gradients",
    "read_gradients",
    "reduce_statistics",
    "update_factors",
]


@dataclasses.dataclass(frozen=True)
class StepParts:
    """The parts a preconditioner's step runs through, fixed when it is built."""

    layers: dict[str, LayerState]
    capture: FactorCapture
    comm: Communicator
    layout: ShardedLayout | None
    """The sharded layout of an FSDP2 / HSDP model (``None``: plain parameters)."""
    strategy: Strategy
    delivery: Delivery
    eager: EagerReducer | None
    """The overlapped reduction, where ``overlap_comm`` is on."""
    guard: DeviceGuard
    other_params: list[Tensor]
    """The parameters no layer takes (the preconditioner adds adopted ones to this list)."""

    @property
    def partial(self) -> frozenset[str]:
        """The layers whose gradients this rank holds only rows of (sharded layout)."""
        return self.layout.partial if self.layout is not None else frozenset()


def read_gradients(parts: StepParts, flags_on_device: bool) -> dict[str, Tensor | None]:
    """Each layer's gradient matrix (``None``: none this step); a presence token for a
    layer whose rows this rank holds only part of. With the flags on the device (and plain
    parameters) one copy into the guard's buffer."""
    if flags_on_device and parts.layout is None:  # one copy into the guard's buffer
        return parts.guard.gradients(parts.layers)
    partial = parts.partial
    return {
        name: layer.block.weight_grad() if name not in partial else presence_token(layer)
        for name, layer in parts.layers.items()
    }


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
    parts: StepParts,
    grads: dict[str, Tensor | None],
    capturing: bool,
    fisher: str,
    grad_scaler: Any | None,
) -> tuple[dict[str, dict[str, Tensor]], set[str]]:
    """Phase 1's traffic (overlapped or not); this step's reduced statistics by layer, and
    the layers with a due statistic skipped on every rank (not captured everywhere:
    :func:`~dkfac.engine.presence.agree_presence`; on the overlapped path the due layers
    held in eval mode).

    Args:
        parts: The step's parts.
        grads: Each layer's gradient (``None``: it has none this step).
        capturing: Whether the hooks captured any statistic this step.
        fisher: The Fisher kind (``"empirical"``: G is averaged over the micro-batches).
        grad_scaler: The GradScaler, if any (G was captured from scaled gradients).
    """
    layers, capture, other_params = parts.layers, parts.capture, parts.other_params
    if parts.eager is not None:
        # Every rank has every layer whose factors it sends (or it raised); what a dp owner
        # alone lacks no other rank can know without a host read, so only the layers every
        # rank holds in eval mode count as skipped on this path.
        new, handle = parts.eager.finish(grads, other_params)
        skipped = set(parts.eager.held)
    else:
        new = capture.collect(layers, 1.0) if capturing else {}
        skipped = agree_presence(
            parts.comm, layers, new, grads, other_params, empty=capture.zero_filled
        )
        present = {name: g for name, g in grads.items() if g is not None}
        others = [p.grad for p in other_params if p.grad is not None]
        gathered = {n: x.gathered() for n, x in layers.items() if x.gathered()}
        handle = parts.strategy.reduce_step(new, gathered, present, others)
    handle.wait()
    if parts.eager is not None:
        skipped |= _rowless_everywhere(parts, new)
    if new:
        capture.scale_grad_statistics(layers, new, g_scale(capture, fisher, grad_scaler))
    return new, skipped


def _rowless_everywhere(parts: StepParts, new: dict[str, dict[str, Tensor]]) -> set[str]:
    """On the overlapped path, the layers no rank gave a row (their statistics averaged from
    zeros alone), removed from ``new``: skipped as one process skips a step without rows
    (the presence agreement finds them after the backward). Only a rank that sent zeros for
    a layer reads whether its average is zero (a host read, rare); every rank that did gets
    the same average under an all-reduce. Under a reduction to the owners the others get
    none, so there the zeros stay averaged in (the factors decay by ``factor_decay``)."""
    filled = parts.capture.zero_filled & new.keys()
    if not filled or parts.strategy.factor_reduction != "all_reduce":
        return set()
    rowless = {name for name in filled if not any(bool(t.any()) for t in new[name].values())}
    for name in rowless:
        del new[name]
    return rowless


def agree_finite(
    parts: StepParts,
    new: dict[str, dict[str, Tensor]],
    grads: dict[str, Tensor | None],
    step: int,
    flags_on_device: bool,
) -> tuple[dict[str, tuple[bool, bool]], Tensor | None]:
    """Each layer's (statistics, gradient) finiteness agreed by the ranks, and with the flags
    on the device the guard's gradient flags (``None`` otherwise)."""
    if flags_on_device:
        return parts.guard.run(parts.layers, parts.strategy, new, grads, step)
    return finite_flags(parts.layers, parts.strategy, new, grads), None


def update_factors(
    parts: StepParts,
    new: dict[str, dict[str, Tensor]],
    finite: dict[str, tuple[bool, bool]],
    step: int,
    config: KFACConfig,
    refresh: RefreshPolicy,
) -> int:
    """Updates the running averages this rank keeps; the refresh policy learns of them.

    Returns:
        The statistics refreshed at this step (those due, on every layer).
    """
    layers = parts.layers
    decay = resolve("factor_decay", config.factor_decay, step)
    assert decay is not None
    refreshed = sum(len(layer.due) for layer in layers.values())
    kept = kept_statistics(parts.strategy, new, finite, step)
    recorded = record_refreshes(refresh, layers, kept, step)  # before updates
    update_running_all(layers, kept, decay)
    agree_intervals(refresh, parts.comm, layers, recorded, step)
    return refreshed


def others_finite(params: Sequence[Tensor], agree: Callable[[Tensor], Tensor]) -> Tensor | None:
    """Whether the gradients of the parameters no layer takes are all finite, where no
    leftover Adam reads that on its way (:meth:`~dkfac.engine.leftover.LeftoverAdam.step`):
    a 0-d bool tensor (``agree`` ands it over the ranks where they are shards, FSDP2's
    ``DTensor``); ``None`` where none has a gradient."""
    found = gradients_finite([p.grad for p in params])
    if found is None:
        return None
    flag, sharded = found
    return agree(flag.reshape(1)).reshape(()) if sharded else flag


def precondition_gradients(
    parts: StepParts,
    grads: Mapping[str, Tensor | None],
    finite: Mapping[str, tuple[bool, bool]],
    keep: Tensor | None,
    config: KFACConfig,
    damping: float,
    step: int,
    others: Tensor | None = None,
) -> tuple[dict[str, Tensor], list[str]]:
    """Phase 3: each gradient worker's preconditioned gradients and the layers ready
    (:func:`~dkfac.engine.step_math.precondition`, with the BatchNorm damping where set).
    ``others``: a 0-d bool tensor, the other parameters' gradients (the leftover Adam's)
    are finite; the moments advance only where they are, as the optimizer skips the step
    elsewhere (on the host path it is read only to hold the moments on a failing step)."""
    bn_damping = resolve("bn_damping", config.bn_damping, step)
    dampings = {"damping": damping, "bn_damping": bn_damping or damping}
    advance = None if keep is None else keep.all()
    if others is not None:
        if advance is not None:
            advance = advance & others
        elif not bool(others):  # the host path: hold every moment on this step
            advance = others
    scales = input_scales(parts.layers, parts.comm)
    return precondition(
        parts.layers, parts.strategy, grads, finite, dampings, step, advance, parts.partial, scales
    )


def clip_and_write(
    parts: StepParts,
    finals: dict[str, Tensor],
    delivered: list[str],
    ready: list[str],
    grads: Mapping[str, Tensor | None],
    keep: Tensor | None,
    config: KFACConfig,
    step: int,
    lr: float | Mapping[str, float] | None,
) -> Tensor | None:
    """Phase 5: the preconditioned gradients scaled by the KL-clip factor ``ν`` and written
    back (times 0 where the guard on the device found a gradient not finite); ``ν``
    (``None``: no clip), left on the device."""
    kl_clip = resolve("kl_clip", config.kl_clip, step)
    lr = lr if lr is not None else resolve("lr", config.lr, step)
    scale = kl_clip_scale(parts.delivery, finals, ready, grads, kl_clip, lr)
    factors = None
    if keep is not None:  # the scale times 0 where a gradient was not finite
        both = keep.to(torch.float32) if scale is None else keep * scale  # 1 call
        # Through the guard's buffer; write_back takes the layers it leaves.
        delivered = parts.guard.writes.write(parts.layers, finals, delivered, ready, both)
        if delivered:
            factors = dict(zip(parts.layers, both.unbind(0), strict=True))
    write_back(parts.layers, finals, delivered, ready, scale, factors)
    return scale
