"""The per-layer math of one K-FAC step, as plain functions of the layers and the strategy.

The phases of :class:`~dkfac.preconditioner.KFACPreconditioner`'s step
(:mod:`~dkfac.engine.step_phases`) call them in order:
:func:`finite_flags` and :func:`kept_statistics` (phase 1, before the running averages are
updated), :func:`update_inverses` (phase 2), :func:`precondition` (phase 3), then, after
the strategy has distributed the results (phase 4), :func:`kl_clip_scale` and
:func:`write_back` (phase 5); phase 3 preconditions the layers of one shape and one
solver's options together (:func:`apply_grouped`). The strategy
(:mod:`~dkfac.distributed.strategy_base`) says which layers this rank keeps, owns and
preconditions, and runs every collective; nothing here asks for the rank.

KL-clip: ``ν = min(1, sqrt(κ / |Σ_l lr² ⟨V_l, ∇W_l⟩|))``, the sum running over every
preconditioned layer, whichever rank preconditioned it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.blocks.base import Block
from dkfac.distributed.shard_exchange import Delivery
from dkfac.distributed.strategy_base import Strategy
from dkfac.engine import launches
from dkfac.engine.carry import carry_all, carry_moments, complete_all
from dkfac.engine.finite import finite_each
from dkfac.engine.layer_state import LayerState
from dkfac.solvers import SolverError, SolverState
from dkfac.solvers.base import BatchJob, unchecked

StateCheck = Callable[
    [Mapping[str, LayerState], Mapping[str, SolverState | None], Sequence[str]], None
]
"""Checks the new states of the named layers against their previous ones (``hold``)."""

__all__ = [
    "FACTORS_SKIPPED",
    "GRADIENT_ZEROED",
    "apply_grouped",
    "carry_moments",
    "finite_flags",
    "finite_masks",
    "kept_statistics",
    "kl_clip_scale",
    "precondition",
    "presence_token",
    "read_flags",
    "sum_of_products",
    "update_inverses",
    "write_back",
]

logger = logging.getLogger(__name__)

FACTORS_SKIPPED = "step %d: non-finite factors in %s; their update skipped"
"""The guard's warning for a layer's non-finite statistics (step, layer)."""
GRADIENT_ZEROED = "step %d: non-finite gradient in %s (NaN, Inf, or squares that overflow); zeroed"
"""The guard's warning for a layer's non-finite gradient (step, layer)."""


def finite_flags(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    new: Mapping[str, Mapping[str, Tensor]],
    grads: Mapping[str, Tensor | None],
) -> dict[str, tuple[bool, bool]]:
    """(factors finite, gradient finite) per layer, agreed by every rank.

    One host synchronisation (and one tiny all-reduce with several ranks) per step.

    Args:
        layers: The registered layers.
        strategy: Agrees the flags across ranks (a layer is finite only if it is everywhere).
        new: This step's reduced statistics by layer (absent layers count as finite).
        grads: Gradient matrices by layer (``None`` counts as finite).
    """
    return read_flags(finite_masks(layers, strategy, new, grads), list(layers))


def read_flags(masks: Tensor, names: Sequence[str]) -> dict[str, tuple[bool, bool]]:
    """:func:`finite_masks` read on the host (one synchronisation): per layer, (statistics
    finite, gradient finite)."""
    values = masks.tolist()
    return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(names)}


def finite_masks(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    new: Mapping[str, Mapping[str, Tensor]],
    grads: Mapping[str, Tensor | None],
) -> Tensor:
    """:func:`finite_flags` left on the device: a bool vector, entry ``2i`` whether layer
    ``i``'s statistics are finite everywhere, ``2i + 1`` whether its gradient is (no host
    synchronisation; one tiny all-reduce with several ranks)."""
    names = list(layers)
    device = layers[names[0]].block.parameters()[0].device
    statistics: list[Tensor] = []
    gradients: list[Tensor] = []
    owners: list[int] = []  # 2·layer for a statistic, 2·layer + 1 for the gradient
    for i, name in enumerate(names):
        for tensor in new.get(name, {}).values():
            statistics.append(tensor)
            owners.append(2 * i)
    for i, name in enumerate(names):
        grad = grads[name]
        if grad is not None:
            gradients.append(grad)
            owners.append(2 * i + 1)
    failed = torch.zeros(2 * len(names), dtype=torch.int64, device=device)
    # a check fails where any of its tensors is not finite; a statistic's squares may
    # overflow where it does not (dkfac.engine.finite)
    bad = [~finite_each(statistics, device, squares=False)] if statistics else []
    if gradients:
        bad.append(~finite_each(gradients, device))
    if bad:
        failed.index_add_(0, launches.device_constant(tuple(owners), device), torch.cat(bad).long())
    return strategy.agree(failed == 0)


def kept_statistics(
    strategy: Strategy,
    new: Mapping[str, dict[str, Tensor]],
    finite: Mapping[str, tuple[bool, bool]],
    step: int,
) -> dict[str, dict[str, Tensor]]:
    """The statistics of ``new`` that enter this rank's running averages.

    A layer's are dropped where the strategy does not keep them on this rank, and (with a
    warning) where any of them is not finite.
    """
    kept: dict[str, dict[str, Tensor]] = {}
    for name, stats in new.items():
        if not strategy.keeps_statistics(name):
            continue
        if not finite[name][0]:
            logger.warning(FACTORS_SKIPPED, step, name)
            continue
        kept[name] = stats
    return kept


def update_inverses(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    damping: float,
    names: Sequence[str] | None = None,
    hold: StateCheck | None = None,
) -> None:
    """Owners recompute their layers' solver states; the strategy shares them.

    Layers whose solvers give one :meth:`~dkfac.solvers.base.Solver.refresh_key` are
    recomputed together (:meth:`~dkfac.solvers.base.Solver.compute_batch`: one batched
    decomposition and one check for the group; a failed group is recomputed layer by layer).

    An owner's solver gets its previous state of the layer (a basis refreshed by power
    iteration follows it). Owners send each state's :meth:`~dkfac.solvers.base.Solver.shared`
    part; every rank then adds what it derives (:meth:`~dkfac.solvers.base.Solver.completed`,
    the layers of one :meth:`~dkfac.solvers.base.Solver.complete_key` together).
    A layer whose shared state is the very one it had (not recomputed anywhere) keeps its
    completed state as it is. Afterwards every rank that preconditions a layer with moments
    carries them into the new state (:func:`~dkfac.engine.carry.carry_all`: the layers of
    one :meth:`~dkfac.solvers.base.Solver.carry_key` together).

    Args:
        layers: The registered layers; their ``solver_state`` is replaced.
        strategy: Says which layers this rank owns and sends the states to the workers.
        damping: The damping of this inverse update.
        names: The layers to recompute (default: all); every layer's state is shared.
        hold: The check of new states on the device
            (:class:`~dkfac.engine.refresh_checks.StateHold`): the layers that have a state
            are then refreshed without host checks and handed to it with their previous
            states; ``None``: each solver checks its states on the host.
    """
    previous = {name: layer.solver_state for name, layer in layers.items()}
    groups: dict[Hashable, list[tuple[str, dict[str, Any]]]] = {}
    for name in layers if names is None else names:
        layer = layers[name]
        if not strategy.is_owner(name) or not layer.complete:
            continue
        inputs = layer.solver_inputs()
        key = layer.solver.refresh_key(inputs, previous[name])
        groups.setdefault(("alone", name) if key is None else key, []).append((name, inputs))
    quiet: list[str] = []  # computed without host checks, for ``hold``
    for members in groups.values():
        solvers = [layers[name].solver for name, _ in members]
        off = hold is not None and all(previous[name] is not None for name, _ in members)
        with unchecked(solvers, off):
            _compute_group(layers, members, damping, previous)
        if off:
            quiet += [name for name, _ in members]
    if hold is not None and quiet:
        hold(layers, previous, quiet)
    states = {
        name: None if layer.solver_state is None else layer.solver.shared(layer.solver_state)
        for name, layer in layers.items()
    }
    devices = {name: layer.block.parameters()[0].device for name, layer in layers.items()}
    strategy.share_solver_states(states, devices)
    received: dict[str, SolverState] = {}  # new states, to complete
    for name, layer in layers.items():
        state, before = states[name], previous[name]
        if state is None:
            layer.solver_state = None
        elif not _same_state(state, before, layer):
            received[name] = state
        else:
            layer.solver_state = before  # unchanged: its derived entries as they were
    complete_all(layers, received)
    carry_all(layers, previous)


def _compute_group(
    layers: Mapping[str, LayerState],
    members: Sequence[tuple[str, dict[str, Any]]],
    damping: float,
    previous: Mapping[str, SolverState | None],
) -> None:
    """The new states of one group of :meth:`~dkfac.solvers.base.Solver.refresh_key`: one
    :meth:`~dkfac.solvers.base.Solver.compute_batch`, or layer by layer after its failure;
    a layer whose solver fails keeps its state (with a warning)."""
    if len(members) > 1:
        solver = layers[members[0][0]].solver
        try:
            computed = solver.compute_batch(
                [inputs for _, inputs in members],
                damping,
                [previous[name] for name, _ in members],
            )
        except SolverError:
            pass  # each layer again on its own, with its own warning
        else:
            for (name, _), state in zip(members, computed, strict=True):
                if isinstance(state, SolverError):
                    logger.warning("%s: %s; keeping the last good inverse", name, state)
                else:
                    layers[name].solver_state = state
            return
    for name, inputs in members:
        try:
            layers[name].solver_state = layers[name].solver.compute_statistics(
                inputs, damping, previous[name]
            )
        except SolverError as err:
            logger.warning("%s: %s; keeping the last good inverse", name, err)


def _same_state(received: SolverState, before: SolverState | None, layer: LayerState) -> bool:
    """Whether ``received`` is the shared part of ``before`` itself (the very tensors: no
    tensor work), i.e. the layer's state did not change."""
    if before is None:
        return False
    shared = layer.solver.shared(before)
    return received.keys() == shared.keys() and all(received[k] is shared[k] for k in shared)


def precondition(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    grads: Mapping[str, Tensor | None],
    finite: Mapping[str, tuple[bool, bool]],
    dampings: Mapping[str, float],
    step: int,
    advance: Tensor | None = None,
    partial: Collection[str] = (),
    scales: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], list[str]]:
    """Final gradient matrices (or receive buffers) and the layers ready to precondition.

    A non-finite gradient is zeroed (with a warning) and the layer left out. A layer whose
    owner has no solver state yet (first used at a step that refreshes nothing, or its
    factors were not finite) keeps its plain gradient, but one whose solver's update has
    Adam's scale (:attr:`~dkfac.solvers.base.Solver.adam_scaled`) gets none. A stateful
    solver's moments advance only on a step whose gradients are finite in every layer (the
    step :class:`~dkfac.optimizer.KFACOptimizer` skips leaves them as they were).

    Args:
        layers: The registered layers.
        strategy: Says which layers this rank preconditions and which are ready.
        grads: Gradient matrices by layer (``None``: the layer had no gradient).
        finite: :func:`finite_flags` of this step.
        dampings: This step's dampings by name (``"damping"``, ``"bn_damping"``); each block
            says which applies to it (``damping_key``).
        step: The step number (for the warning).
        advance: A 0-d bool tensor (the guard on the device, :mod:`~dkfac.engine.device_checks`):
            the moments advance where it holds and keep their values elsewhere, selected
            in the solvers' batched pass; ``None``: advance when every flag in ``finite``
            says the gradient is finite.
        partial: Layers whose ``grads`` entry is only a :func:`presence_token` (this rank
            does not precondition them and never holds their full gradient: the sharded
            layout's owner exchange returns their results, zeros included, after the step).
        scales: Layer -> a 0-d factor its update is multiplied by
            (:func:`~dkfac.engine.input_rms.input_scales`); others: none.

    Returns:
        ``(finals, ready)``: per layer with a gradient, its preconditioned gradient, its
        plain gradient (not ready yet) or an empty buffer the strategy fills (layers this
        rank does not precondition); and the names of the ready layers.
    """
    finals: dict[str, Tensor] = {}
    ready: list[str] = []
    jobs: list[tuple[str, float]] = []
    all_finite = all(flags[1] for flags in finite.values())
    for name, layer in layers.items():
        grad = grads[name]
        if grad is None:
            continue
        if not finite[name][1]:
            logger.warning(GRADIENT_ZEROED, step, name)
            if name not in partial:
                layer.block.set_weight_grad(torch.zeros_like(grad))
            continue
        is_ready = name in strategy.ready and (
            layer.solver_state is not None or not strategy.preconditions(name)
        )
        if is_ready:
            ready.append(name)
        if name in partial:
            finals[name] = grad
        elif layer.solver.adam_scaled and name not in strategy.ready:
            # Its update replaces Adam's: the plain gradient, unnormalised, would be an SGD
            # step at Adam's rate (1.7e6 for a gradient of 1e8), so none until its owner
            # has a state (on every rank alike).
            finals[name] = torch.zeros_like(grad)
            layer.block.set_weight_grad(finals[name])
        elif not strategy.preconditions(name):
            finals[name] = torch.empty_like(grad)
        elif is_ready and layer.solver_state is not None:
            finals[name] = grad  # its place in the order; replaced by its update below
            jobs.append((name, dampings[layer.block.damping_key]))
        else:
            finals[name] = grad
    scales = scales or {}
    for name, (update, moments) in apply_grouped(layers, grads, jobs, advance).items():
        scale = scales.get(name)
        if scale is not None:
            update = update * (scale if scale.dtype == update.dtype else scale.to(update.dtype))
        finals[name] = update
        if all_finite or advance is not None:
            layers[name].moments = moments
    return finals, ready


def presence_token(layer: LayerState) -> Tensor | None:
    """What ``step()`` reads of a layer whose full gradient this rank never holds: an empty
    tensor of its gradient's dtype where it has one, ``None`` where it has none."""
    grad = next((p.grad for p in layer.block.parameters() if p.grad is not None), None)
    return None if grad is None else grad.new_empty(0)


def apply_grouped(
    layers: Mapping[str, LayerState],
    grads: Mapping[str, Tensor | None],
    jobs: Sequence[tuple[str, float]],
    advance: Tensor | None = None,
    fuse: bool | None = None,
) -> dict[str, tuple[Tensor, SolverState | None]]:
    """Each job's ``(update, moments)`` (:meth:`Solver.apply_with_moments`), the layers of
    one :meth:`~dkfac.solvers.base.Solver.batch_key` and damping in one
    :meth:`~dkfac.solvers.base.Solver.apply_batch` on the first one's solver; with ``fuse``,
    the groups whose first solvers give one
    :meth:`~dkfac.solvers.base.Solver.fuse_key` (and one damping) in one
    :meth:`~dkfac.solvers.base.Solver.apply_groups` (their elementwise work as one pass).

    Args:
        layers: The registered layers (each job's has a solver state).
        grads: Gradient matrices by layer (each job's is a tensor).
        jobs: ``(name, damping)`` of the layers to precondition, in order.
        advance: Passed to :meth:`~dkfac.solvers.base.Solver.apply_batch` (see
            :func:`precondition`).
        fuse: Join the groups; ``None`` (default): on a launch-bound device
            (:mod:`~dkfac.engine.launches`), where each elementwise pass is a launch.
    """
    groups: dict[Hashable, list[str]] = {}
    for name, damping in jobs:
        layer, grad = layers[name], grads[name]
        assert layer.solver_state is not None and grad is not None
        key = layer.solver.batch_key(layer.solver_state, grad)
        groups.setdefault(("alone", name) if key is None else (key, damping), []).append(name)
    dampings = dict(jobs)
    together: dict[Hashable, list[tuple[list[str], BatchJob]]] = {}
    for key, names in groups.items():
        first, grad = layers[names[0]], grads[names[0]]
        assert first.solver_state is not None and grad is not None
        joined = launches.launch_bound(grad.device) if fuse is None else fuse
        shared = first.solver.fuse_key(first.solver_state, grad) if joined else None
        job = BatchJob(
            first.solver,
            [layers[n].solver_state for n in names],  # type: ignore[misc]
            [layers[n].moments for n in names],
            [grads[n] for n in names],  # type: ignore[misc]
        )
        place = ("alone", key) if shared is None else (shared, dampings[names[0]])
        together.setdefault(place, []).append((names, job))
    results: dict[str, tuple[Tensor, SolverState | None]] = {}
    for members in together.values():
        batch = [job for _, job in members]
        outputs = batch[0].solver.apply_groups(
            batch,
            dampings[members[0][0][0]],
            **({} if advance is None else {"advance": advance}),
        )
        for (names, _), group in zip(members, outputs, strict=True):
            results.update(zip(names, group, strict=True))
    return results


def kl_clip_scale(
    strategy: Delivery,
    finals: Mapping[str, Tensor],
    ready: Sequence[str],
    grads: Mapping[str, Tensor | None],
    kl_clip: float | None,
    lr: float | Mapping[str, float] | None,
) -> Tensor | None:
    """The KL-clip factor ``ν = min(1, √(κ / |Σ_l lr_l² ⟨V_l, ∇W_l⟩|))`` (a 0-d tensor), or
    ``None`` when there is nothing to clip.

    Args:
        strategy: Picks the layers this rank sums over and adds the partial sums of all ranks
            (the strategy, or the sharded layout's owner delivery).
        finals: Preconditioned gradients by layer (after :meth:`Strategy.distribute`).
        ready: The preconditioned layers.
        grads: The raw gradient matrices by layer.
        kl_clip: ``κ``; ``None`` disables the clip.
        lr: The learning rate, or each layer's (the parameter groups of an optimizer may
            differ); ``None`` or every rate ``<= 0`` disables the clip.
    """
    if isinstance(lr, Mapping) and len(set(lr.values())) == 1:
        lr = next(iter(lr.values()))  # one rate: the scalar form below, to the bit
    rates = set(lr.values()) if isinstance(lr, Mapping) else {lr}
    if kl_clip is None or not ready or lr is None or all(r is None or r <= 0 for r in rates):
        return None
    names = strategy.kl_layers(ready)
    by_rate: dict[float, list[Tensor]] = {}  # each rate's (V, ∇W) pairs, interleaved
    for name in names:
        raw = grads[name]
        assert raw is not None
        by_rate.setdefault(lr[name] if isinstance(lr, Mapping) else lr, []).extend(
            (finals[name], raw)
        )
    # min(1, √(κ / max(|s|, 1e-30))) as 1 / √max(|s| / κ, 1, 1e-30 / κ), s = Σ lr² ⟨V, ∇W⟩.
    # lr² / κ is capped at the sum's largest number (lr ** 2 raises past 1.3e154, and an
    # infinite factor times a zero sum is NaN): a larger one clips the step to zero. So is
    # the floor (1e-30 / κ passes float32's range from κ = 3e-69 on; clamp_ refused it).
    like = finals[ready[0]]
    floor = max(1.0, 1e-30 / kl_clip)
    parts = {
        rate: sum_of_products(pairs[0::2], pairs[1::2], like) for rate, pairs in by_rate.items()
    }
    if not isinstance(lr, Mapping):
        partial = parts.get(lr, sum_of_products([], [], like))
        largest = torch.finfo(partial.dtype).max
        factor = min(lr * lr / kl_clip, largest)
        clipped = strategy.reduce_kl(partial).abs().mul_(factor)
        return clipped.clamp_(min=min(floor, largest)).rsqrt_()
    weighted = [
        part.mul_(min(rate * rate / kl_clip, torch.finfo(part.dtype).max))
        for rate, part in parts.items()
    ]
    partial = torch.stack(weighted).sum() if weighted else sum_of_products([], [], like)
    largest = torch.finfo(partial.dtype).max
    return strategy.reduce_kl(partial).abs().clamp_(min=min(floor, largest)).rsqrt_()


def sum_of_products(
    lefts: Sequence[Tensor], rights: Sequence[Tensor], like: Tensor, fused: bool | None = None
) -> Tensor:
    """``Σ_l ⟨lefts[l], rights[l]⟩``, a 0-d tensor on ``like``'s device (``like``'s zero
    for no pairs; float32 at least in the fused form); each right is cast to its left's
    dtype.

    A GPU step is launches: the fused form is a few multi-tensor calls for any number of
    layers, ``Σ x = 2 Σ max(x, 0) − Σ |x|`` over the products ``x`` (each layer's two sums
    as 1-norms in one multi-tensor call, combined by one dot product with ``(−1, 2)``
    weights; its rounding is a plain sum's, ``ε Σ |x|``). A CPU takes one dot product per
    layer, a single pass each.

    Args:
        lefts: Tensors, each the shape of its right.
        rights: Tensors.
        like: Gives the device (and the dtype of an empty sum).
        fused: The multi-tensor form; ``None`` (default): on a launch-bound device
            (:mod:`~dkfac.engine.launches`).
    """
    if not lefts:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    rights = [right.to(left.dtype) for left, right in zip(lefts, rights, strict=True)]
    if fused is None:
        fused = launches.launch_bound(like.device)
    if not fused:
        dots = [
            torch.dot(left.reshape(-1), right.reshape(-1))
            for left, right in zip(lefts, rights, strict=True)
        ]
        return torch.stack(dots).sum()
    products = torch._foreach_mul(list(lefts), rights)
    # Half-precision products are summed into float32 (their own range ends at 65504).
    wide = None if any(p.dtype == torch.float64 for p in products) else torch.float32
    positives = torch._foreach_clamp_min(products, 0.0)
    norms = torch.stack(torch._foreach_norm([*products, *positives], 1, dtype=wide))
    weights = (-1.0,) * len(products) + (2.0,) * len(products)
    return torch.dot(norms, launches.device_constant(weights, norms.device, norms.dtype))


def write_back(
    layers: Mapping[str, LayerState],
    finals: Mapping[str, Tensor],
    delivered: Sequence[str],
    ready: Sequence[str],
    scale: Tensor | None,
    keep: Mapping[str, Tensor] | None = None,
) -> None:
    """Sets each delivered layer's gradient to its final value, ready ones times ``scale``,
    or times ``keep[name]`` (a 0-d tensor: the scale times 0 or 1) where ``keep`` is given
    (the guard on the device, :mod:`~dkfac.engine.device_checks`).

    A GPU step is launches: the scaled values are one multi-tensor product and every
    block's :meth:`~dkfac.blocks.base.Block.grad_writes` one multi-tensor copy. A block
    that overrides ``set_weight_grad`` itself (the way before ``grad_writes``) is written
    by it, layer by layer.
    """
    preconditioned = set(ready)
    destinations: list[Tensor] = []
    values: list[Tensor] = []
    scaled: list[int] = []  # positions in ``values``
    factors: list[Tensor] = []  # their factors
    for name in delivered:
        block, value = layers[name].block, finals[name]
        factor = scale if keep is None else keep[name]
        if type(block).set_weight_grad is not Block.set_weight_grad:
            block.set_weight_grad(
                value if factor is None or name not in preconditioned else value * factor
            )
            continue
        for destination, part in block.grad_writes(value):
            if name in preconditioned and factor is not None:
                scaled.append(len(values))
                factors.append(factor)
            destinations.append(destination)
            values.append(part)
    if scaled:
        # One multi-tensor product; the per-layer factors only with the device guard.
        by = factors if keep is not None else scale
        products = torch._foreach_mul([values[i] for i in scaled], by)  # type: ignore[arg-type]
        for i, product in zip(scaled, products, strict=True):
            values[i] = product
    if destinations:
        torch._foreach_copy_(destinations, values)
