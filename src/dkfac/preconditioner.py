"""KFACPreconditioner: registers blocks and hooks, and runs one K-FAC step.

Construction registers every supported layer (:mod:`~dkfac.engine.registration`), attaches the
capture hooks (:class:`~dkfac.engine.capture.FactorCapture`) and builds the strategy
(:mod:`~dkfac.distributed.strategies`, ``pre.strategy``), which decides where each piece of
work runs and what travels between ranks (:mod:`~dkfac.engine.assembly`); the math never
branches on the rank. A step has five phases, each under a ``torch.profiler.record_function``
label: ``dkfac.factors``, ``dkfac.inverse``, ``dkfac.precondition``, ``dkfac.distribute`` and
``dkfac.kl_clip``, with ``dkfac.leftover`` before ``dkfac.precondition`` under
``leftover_update``. This class sequences them; what each does is in
:mod:`~dkfac.engine.step_phases`, the per-layer math in :mod:`~dkfac.engine.step_math`.

Scale convention (see :class:`~dkfac.engine.capture.FactorCapture`): factors are on the
per-sample Fisher scale whatever the batch size and the number of micro-batches a step
accumulates (counted from the backward passes; each micro-batch's loss divided by their
number, as the frameworks do). With a ``GradScaler`` the factors are divided by the square
of its scale, and ``step()`` must see unscaled gradients (call ``scaler.unscale_(optimizer)``
first, as for gradient clipping); a scaler not given is named in one warning
(:mod:`~dkfac.engine.scaler_check`).
Checkpoints: :mod:`~dkfac.engine.saved_state` and :mod:`~dkfac.engine.checkpoint`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.config import KFACConfig, check_schedule_value, resolve
from dkfac.config.checks import check_bool
from dkfac.distributed.layout import ShardedLayout
from dkfac.distributed.shard_exchange import Delivery
from dkfac.distributed.sharding import refuse_fsdp1, refuse_late_sharding
from dkfac.distributed.strategies import Strategy
from dkfac.engine.arguments import (
    check_layer_names,
    check_sampled_outputs,
    check_step,
    checked_config,
    checked_lr,
)
from dkfac.engine.assembly import adopt_parameters, join_layers, leftover_for, place_blocks
from dkfac.engine.budget_apply import (
    apply_budget_bases,
    make_budget,
    restore_limits,
    solver_limits,
    spend_budget,
)
from dkfac.engine.capture import FactorCapture
from dkfac.engine.device_checks import DeviceGuard
from dkfac.engine.eager import build_eager
from dkfac.engine.eval_mode import EvalModeLayers
from dkfac.engine.guards import (
    GradientMarks,
    HookOwnership,
    check_parameters_kept,
    placements,
    refuse_unhooked_forward,
    warn_if_moved,
)
from dkfac.engine.introspection import describe_table, memory_usage, running_factors
from dkfac.engine.join_check import refuse_join
from dkfac.engine.late_layers import LateLayers
from dkfac.engine.launches import launch_bound
from dkfac.engine.layer_state import LayerState, layers_device
from dkfac.engine.leftover import LeftoverAdam
from dkfac.engine.model_hooks import outside_autocast
from dkfac.engine.overhead import OverheadBudget
from dkfac.engine.phases import phase
from dkfac.engine.refresh import make_refresh_policy
from dkfac.engine.refresh_checks import StateHold
from dkfac.engine.refresh_step import mark_due, refresh_report
from dkfac.engine.registration import graph_input_maps, other_parameters, register, unwrap
from dkfac.engine.roles import layer_roles
from dkfac.engine.saved_state import Saved, check_saved, preconditioner_state, restore_entries
from dkfac.engine.scaler_check import ScalerCheck
from dkfac.engine.step_math import update_inverses
from dkfac.engine.step_phases import (
    StepParts,
    agree_finite,
    clip_and_write,
    others_finite,
    precondition_gradients,
    read_gradients,
    reduce_statistics,
    update_factors,
)


class KFACPreconditioner:
    """Replaces the gradients of supported layers with K-FAC preconditioned gradients.

    A model's layers are preconditioned by one preconditioner: the one built last on them.
    An earlier one holding some of them is retired once this one is built (all its hooks
    detached, its ``step()`` raising), as a framework that builds a new optimizer for each
    run (Lightning's ``configure_optimizers`` at every ``fit`` and in its tuner) expects.

    Args:
        model: The model. Its layers of a type the block registry knows are
            preconditioned (:mod:`dkfac.blocks.registry`: ``nn.Linear``, ``nn.Conv1d/2d/3d``,
            grouped ones unit-wise, ``nn.ConvTranspose1d/2d``,
            ``nn.Embedding``, ``nn.MultiheadAttention``, transformers' ``Conv1D``, affine
            BatchNorm unit-wise, and any type registered with
            :func:`dkfac.blocks.register_block`; ``describe()`` says what each parameter
            gets); every other parameter keeps its plain gradient (under ``"eigen_adam"``: Adam's
            direction on it, ``leftover_update``). For every strategy but ``"spngd"``
            wrap it in ``DistributedDataParallel`` when training on several ranks, so the
            gradients arrive averaged, or shard it with FSDP2 / HSDP (``fully_shard`` on
            its blocks and root: :mod:`~dkfac.distributed.layout`). ``"spngd"`` needs the
            unwrapped model: its ``step()`` averages the gradients of *all* parameters
            itself.
        config: A :class:`KFACConfig`; keyword ``options`` override its fields.
        grad_scaler: The ``torch.amp.GradScaler`` used for mixed precision, if any. A
            scaler created later (by a framework) may be set as ``pre.grad_scaler`` before
            the first step, except under ``strategy="spngd"`` with ``overlap_comm``, whose
            gradient traffic is planned here. One not given is named in a warning.
        process_group: The ranks that train together (default: the default group; none
            needed for one process).
        overhead: An overhead budget (e.g. 0.3: the preconditioner's work at most 30% over
            the training step): after the first step, the factor batch and the factor and
            basis intervals the options do not set are chosen within it from the layer
            sizes and the rows the first step saw, and where the per-step work alone does
            not fit, the Newton–Schulz steps of orthogonalised updates (unless set) are
            cut to 3; a side of an eigenbasis-moment layer wider than 3/4 of the rows it
            sees keeps the identity basis from the first refresh on (unless
            ``basis_max_dim`` is set; :mod:`dkfac.costmodel.budget`);
            ``describe()`` ends with a row that says what was chosen and why. ``None``:
            the options as given.
        **options: Fields of :class:`KFACConfig` (``method``, ``damping``, ``strategy``...).

    Raises:
        ValueError: For a bad option value, a model with no supported layer, a
            DDP-wrapped or sharded model with ``strategy="spngd"``, a sharded model K-FAC
            cannot take (FSDP1, tensor parallelism, DTensor and plain parameters mixed).
        TypeError: For a ``model`` that is not an ``nn.Module``, a ``config`` that is not a
            :class:`KFACConfig`, an unknown option or a value of the wrong type.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: KFACConfig | None = None,
        grad_scaler: Any | None = None,
        process_group: Any | None = None,
        overhead: float | None = None,
        **options: Any,
    ) -> None:
        config = checked_config(model, config, grad_scaler, process_group, options)
        refuse_fsdp1(model)  # before its flat views are taken for computed weights
        registration = register(unwrap(model), config)
        config = graph_input_maps(unwrap(model), config, registration.blocks)
        self.budget: OverheadBudget | None = make_budget(overhead, config, options)
        self._budget_spent = False  # the choice applied (after the first step)
        self.config = config
        self.model = model
        self.grad_scaler = grad_scaler
        self._steps = 0
        self.capture = FactorCapture(config)
        self._scaler_check = ScalerCheck(self.capture, grad_scaler is None)
        self.refresh = make_refresh_policy(
            config.refresh,
            config.factor_update_interval,
            config.refresh_threshold,
            config.refresh_max_interval,
        )
        self.last_refreshed = 0
        self.coverage = registration.coverage
        blocks = registration.blocks
        self._hooks = HookOwnership(self, {name: b.module for name, b in blocks.items()})
        self._hooks.add(self.capture)
        self._marks = GradientMarks()
        roles = layer_roles(unwrap(model))  # read off the graph once, for both below
        placement = place_blocks(model, blocks, config, process_group, roles)
        self.comm = placement.comm
        self.layout: ShardedLayout | None = placement.layout
        self.strategy: Strategy = placement.strategy
        self.delivery: Delivery = placement.delivery
        """Delivers the preconditioned gradients and adds the KL-clip sum: the strategy, or
        the sharded layout's owner exchange (:mod:`~dkfac.distributed.shard_exchange`)."""
        self.layers: dict[str, LayerState]
        self.layers, self._roles = join_layers(
            model, blocks, config, placement, self.capture, roles
        )
        self.late = LateLayers(self.layers)
        self._eval_mode = EvalModeLayers()
        self._set_block_steps()
        scaled = grad_scaler is not None and grad_scaler.is_enabled()
        self.eager = build_eager(
            config, self.layers, self.capture, self.strategy, model=model, grad_scaled=scaled
        )
        if self.eager is not None:
            self._hooks.add(self.eager)
            self.capture.grouping = False  # each layer's statistics leave as its backward ends
        if self.budget is not None:
            self.budget.watch(self.layers)
            self._hooks.add(self.budget)  # its shape watch goes with the other hooks
            self._unbudgeted = (config, solver_limits(self.layers))  # a choice undone
        self._other_params = other_parameters(unwrap(model), self.layers)
        self.leftover: LeftoverAdam | None = leftover_for(model, config, self._other_params)
        self.schedule_captures(0)
        self._stateful = any(layer.solver.stateful for layer in self.layers.values())
        self._kl_scale: Tensor | None = None
        self.gradients_finite: Tensor | bool = True
        """Whether every registered layer's gradient was finite at the last :meth:`step`,
        before it was preconditioned (agreed by the ranks; a 0-d bool tensor where the
        flags stay on the device): :class:`~dkfac.KFACOptimizer` skips on it, so that a
        gradient this step zeroed still skips the inner step."""
        self._guard = DeviceGuard(list(self.layers))
        self._parts = StepParts(
            self.layers,
            self.capture,
            self.comm,
            self.layout,
            self.strategy,
            self.delivery,
            self.eager,
            self._guard,
            self._other_params,
        )
        self._flags_on_device = self._launch_bound_flags()
        self._flags_by_hand = False
        self._settled = False  # _settle_device at this object's first step
        self._registered = self._params()  # the tensors the hooks take statistics for
        self._built_on = placements(self._registered)
        # Last: a construction that failed above leaves an older preconditioner in charge.
        self._hooks.claim()

    @property
    def flags_on_device(self) -> bool:
        """Keep the finiteness guard's flags on the device (masks instead of branches, its
        warnings logged a step late: :mod:`~dkfac.engine.device_checks`), so that a step
        makes no host synchronisation. On by default on a launch-bound (CUDA) device with
        the fixed refresh (the adaptive one reads its statistics' changes), decided again
        at the first step for the device the model is on then (a framework may move it
        after the optimizer is built: accelerate's ``prepare``, the Trainer) unless it was
        set by hand; the values are the same either way."""
        return self._flags_on_device

    @flags_on_device.setter
    def flags_on_device(self, on: bool) -> None:
        self._flags_on_device = on
        self._flags_by_hand = True

    # ----------------------------------------------------------------- hooks and capture
    def _set_block_steps(self) -> None:
        """Tells every block the step counter (seeded conv subsampling agrees across hooks)."""
        for layer in self.layers.values():
            layer.block.set_step(self._steps)

    def __getstate__(self) -> dict[str, Any]:
        """Refuses ``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the
        preconditioner: a copy's hooks on the model would be inert (the model's copy is a
        plain model, :mod:`~dkfac.engine.model_hooks`), so it would capture nothing.

        Raises:
            TypeError: Always; save :meth:`state_dict` and rebuild.
        """
        raise TypeError(
            "a KFACPreconditioner cannot be copied or pickled: it holds hooks on the model and "
            "process-group handles. Save pre.state_dict() (with the model's state_dict()), "
            "then build a new preconditioner on the restored model and call its "
            "load_state_dict()"
        )

    def remove_hooks(self) -> None:
        """Detaches every hook and frees the layers for another preconditioner.

        ``step()`` and ``sample_fisher()`` raise afterwards; ``state_dict()`` still works.
        """
        self._hooks.remove()

    def adopt_parameters(self, params: list[Tensor], prefix: str) -> None:
        """Parameters added to the optimizer after construction (``add_param_group``).

        Those that no registered layer holds get what the model's other parameters get:
        Adam's direction with ``leftover_update`` (named ``prefix.i``), the gradient
        reduction of ``"spngd"``; parameters already known are left as they are.
        """
        adopt_parameters(params, prefix, self.layers, self._other_params, self.leftover)

    def _params(self) -> dict[str, list[Tensor]]:
        return {name: layer.block.parameters() for name, layer in self.layers.items()}

    def has_gradients(self) -> bool:
        """Whether some registered layer's parameter (the module's own now: one replaced
        since the build too) holds a gradient."""
        return any(p.grad is not None for params in self._params().values() for p in params)

    def schedule_captures(self, step: int) -> None:
        """Asks the refresh policy which statistics the hooks capture at ``step``.

        The answer is the same on every rank; a statistic that is not due costs nothing on
        that step (no capture, no communication). A layer waiting for its first refresh
        (:class:`~dkfac.engine.late_layers.LateLayers`) that now trains captures at once.
        """
        due = mark_due(self.refresh, self.layers, step)
        self.capture.active = self.late.mark_due(self.layers) or due
        if self.eager is not None:
            self.eager.plan(self.capture.active)

    def discard_backward(self) -> None:
        """Forgets what the hooks captured since the last step, if a backward pass ran since.

        :meth:`dkfac.KFACOptimizer.zero_grad` calls it: gradients cleared before a step
        that never ran (a ``GradScaler`` that skipped it for an overflow, a closure
        evaluated again) take their statistics with them, so that the next step's factors
        are its own backward passes' only. A forward run before ``zero_grad`` and not yet
        followed by a backward (``loss = f(model(x)); opt.zero_grad(); loss.backward()``)
        keeps what it captured.
        """
        if self.capture.counter.seen:
            self.forget_captures()

    def forget_captures(self) -> None:
        """Forgets what the hooks captured since the last step, a backward pass or not
        (:meth:`discard_backward`'s work; a step with no gradient at all in one process, a
        batch the framework skipped after its forward: :meth:`dkfac.KFACOptimizer.step`)."""
        for layer in self.layers.values():
            layer.reset_accumulators()
            layer.input_square, layer.input_forwards = None, 0
        if self.eager is not None:
            self.eager.discard()
        self.capture.end_step(self._params().values())

    def sample_fisher(self, outputs: Tensor, loss: str = "cross_entropy") -> None:
        """Feeds the G factors from one backward of targets sampled from ``outputs``.

        Call it between the forward pass and ``loss.backward()`` when ``fisher="mc"``. It
        runs ``torch.autograd.grad`` with ``retain_graph=True``, so ``.grad`` and the graph
        the training backward needs are left untouched. Rank ``r`` samples with the seed
        ``seed + r``.

        Args:
            outputs: The model's outputs of this forward pass (logits for cross-entropy).
            loss: ``"cross_entropy"`` (categorical) or ``"mse"`` (unit Gaussian).
        """
        self._hooks.check("sample_fisher")
        check_sampled_outputs(self.config, outputs)
        params = [p for layer in self.layers.values() for p in layer.block.parameters()]
        seed = self.config.seed + self.strategy.index
        self.capture.sample_fisher(outputs, loss, params, seed)

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, lr: float | Mapping[str, float] | None = None) -> None:
        """Preconditions the gradients of every registered layer in place.

        Every rank of the process group must call it (it runs collectives). With
        ``strategy="spngd"`` it also averages the gradients of every other parameter.

        Args:
            lr: The learning rate for the KL-clip (finite, >= 0), or each layer's (a
                mapping naming every registered layer: the lr of the parameter group
                that holds it); defaults to the configured ``lr``.

        Raises:
            RuntimeError: After :meth:`remove_hooks`, when no backward wrote a layer's
                gradients since the last step (they are already preconditioned), or when
                the model was sharded with ``fully_shard`` after it was built, when a
                layer's module holds other parameters than at the build (replaced since:
                :func:`~dkfac.engine.guards.check_parameters_kept`), when no registered
                layer's forward ran through the hooks since the last step while a backward
                reached their parameters (a graph ``torch.compile`` captured before the
                hooks were put on: :func:`~dkfac.engine.guards.refuse_unhooked_forward`;
                not at the first step), or inside ``torch.distributed.algorithms.join.Join`` without
                ``throw_on_early_termination=True`` (:mod:`~dkfac.engine.join_check`).
            ValueError: For a NaN, infinite or negative ``lr``, or a mapping that does not
                name exactly the registered layers (TypeError: not a number).
        """
        with outside_autocast(self._device()):  # a step inside the user's autocast region
            self._step(lr)

    def _step(self, lr: float | Mapping[str, float] | None) -> None:
        """:meth:`step`'s work."""
        self._hooks.check("step")
        refuse_join(self.model)
        lr = checked_lr(lr, self.layers)
        params = self._params()  # the same tensors all step long
        if self.layout is None:
            refuse_late_sharding(params)
        check_parameters_kept(self._registered, params)
        first = not self._settled  # the first step (also of a resumed run)
        if first:
            self._settle_device(params)
        self._marks.check(params)
        if not first:  # the first one's gradients may come from a forward before the build
            refuse_unhooked_forward(self.capture.ran_since_step, self.capture.counter.seen)
        self.capture.ran_since_step = False
        if self.budget is not None and self.budget.choice is None:
            local = self.strategy.factor_reduction == "none"  # dp: an owner's own rows
            apply_budget_bases(self.budget, self.layers, self.config, self.comm, local)
        step = self._steps
        cfg = self.config
        damping = resolve("damping", cfg.damping, step)
        inverse_interval = resolve("inverse_update_interval", cfg.inverse_update_interval, step)
        assert damping is not None and inverse_interval is not None
        with self.layout.full_gradients() if self.layout is not None else nullcontext():
            self._precondition_layers(step, damping, int(inverse_interval), lr)
        self.comm.ledger.end_step()
        self._marks.record(params)
        if self.budget is not None:
            self.budget.note_batch(self.capture.captured_batch)
        self.capture.end_step(params.values())
        self._steps += 1
        if self.budget is not None and not self._budget_spent:
            self._spend_budget()
        self._set_block_steps()
        self.schedule_captures(self._steps)

    def _launch_bound_flags(self) -> bool:
        """:attr:`flags_on_device`'s default for the device the layers are on now."""
        return launch_bound(self._device()) and self.config.refresh == "fixed"

    def _settle_device(self, params: Mapping[str, list[Tensor]]) -> None:
        """At the first step: :attr:`flags_on_device` for the device the layers are on now,
        unless it was set by hand, and a warning naming the layers moved since the build
        (:func:`~dkfac.engine.guards.warn_if_moved`)."""
        warn_if_moved(self._built_on, params)
        if not self._flags_by_hand:
            self._flags_on_device = self._launch_bound_flags()
        self._settled = True

    def _precondition_layers(
        self,
        step: int,
        damping: float,
        inverse_interval: int,
        lr: float | Mapping[str, float] | None,
    ) -> None:
        """Phases 1 to 5 of :meth:`step` on the layers' (full) gradients
        (:mod:`~dkfac.engine.step_phases`), and the leftover Adam's step between the layers'
        flags and their moments: every moment advances only where every gradient is
        finite, the layers' and the other parameters' (the step the optimizer takes; without
        a leftover Adam, :func:`~dkfac.engine.step_phases.others_finite` reads theirs)."""
        parts, cfg = self._parts, self.config
        rows_only = parts.partial | (self.layout.local if self.layout is not None else frozenset())
        world = self.strategy.world_size
        self._scaler_check.step(self.layers, self.grad_scaler, world, skip=rows_only)
        grads = read_gradients(parts, self.flags_on_device)
        capturing = self.capture.active
        if capturing or self.late.missed:  # a layer seen uncaptured may be in eval mode
            self._eval_mode.check(self.layers, grads)
        with phase("dkfac.factors"):
            new, skipped = reduce_statistics(parts, grads, capturing, cfg.fisher, self.grad_scaler)
            finite, keep = agree_finite(parts, new, grads, step, self.flags_on_device)
            # A waiting layer whose statistics were not finite got none: it keeps waiting.
            skipped = skipped | {name for name, (ok, _) in finite.items() if not ok}
            self.last_refreshed = update_factors(parts, new, finite, step, cfg, self.refresh)
            self.gradients_finite = (
                keep.all() if keep is not None else all(flags[1] for flags in finite.values())
            )
        if step % inverse_interval == 0:
            with phase("dkfac.inverse"):
                self.update_inverses(damping)
            self.late.refreshed(self.layers, grads, skipped)
        elif arrived := self.late.arrived(self.layers, grads, skipped):
            with phase("dkfac.inverse"):
                self.update_inverses(damping, arrived)  # just unfrozen: not at the next refresh
            self.late.refreshed(self.layers, grads, skipped, arrived)
        self.late.note_missed(self.layers, grads, skipped)
        self.late.note_unrun(self.layers, grads, self.capture.ran)
        others = None
        if self.leftover is not None:
            with phase("dkfac.leftover"):
                others = self.leftover.step(self.gradients_finite, self.strategy.agree)
        elif self._stateful:  # the other gradients reach the inner optimizer as they are
            others = others_finite(self._other_params, self.strategy.agree)
        with phase("dkfac.precondition"):
            finals, ready = precondition_gradients(
                parts, grads, finite, keep, cfg, damping, step, others
            )
        with phase("dkfac.distribute"):
            delivered = self.delivery.distribute(finals, ready)
        with phase("dkfac.kl_clip"):
            scale = clip_and_write(parts, finals, delivered, ready, grads, keep, cfg, step, lr)
            self._kl_scale = scale  # read as a number only when asked: no host sync a step

    def _spend_budget(self) -> None:
        """Applies the overhead budget's choice once it can be made (after the first step)."""
        assert self.budget is not None
        config = spend_budget(self.budget, self.layers, self.config)
        if config is None:
            return
        self._budget_spent = True
        self._use_config(config)

    def _forget_budget(self) -> None:
        """Undoes the overhead budget's choice: the options as they were before it, the
        budget watching for the shapes again (a state saved before any choice is loaded)."""
        assert self.budget is not None
        config, limits = self._unbudgeted
        restore_limits(self.layers, limits)
        self._use_config(config)
        self.budget.forget(self.layers)
        self._budget_spent = False

    def _use_config(self, config: KFACConfig) -> None:
        """Takes ``config``, a budget's choice applied or undone (nothing where it is the
        configuration already: the user set every option the budget chooses)."""
        if config is self.config:
            return
        self.config = config
        self.capture.config = config
        if config.refresh == "fixed":
            self.refresh = make_refresh_policy("fixed", self.config.factor_update_interval)

    def update_inverses(self, damping: float, names: list[str] | None = None) -> None:
        """Owners recompute solver states (all layers, or ``names``) and share them.

        Phase 2 of a step, and checkpoint loading; a collective with several ranks (see
        :func:`dkfac.engine.step_math.update_inverses`). With :attr:`flags_on_device` the
        new states are checked on the device (:mod:`~dkfac.engine.refresh_checks`).

        Raises:
            ValueError: For a damping that is not a finite number > 0, or a name that is not
                a registered layer's.
            TypeError: For ``names`` that is not a list or tuple of names (a string would be
                read as its characters).
        """
        damping = check_schedule_value("damping", damping)
        check_layer_names(names, self.layers)
        hold = StateHold(self._guard.late, self._steps) if self.flags_on_device else None
        with outside_autocast(self._device()):
            update_inverses(self.layers, self.strategy, damping, names, hold)

    def restore_step(self, step: int) -> None:
        """Sets the step counter (checkpoints) and schedules that step's captures."""
        check_step(step)
        self._steps = step
        self._set_block_steps()
        self.schedule_captures(step)

    def refresh_stats(self) -> dict[str, Any]:
        """Statistics refreshed at the last step, their total, and the adaptive intervals."""
        return refresh_report(self.refresh, self.layers, self.last_refreshed)

    # ----------------------------------------------------------------- inspection and state
    @property
    def last_kl_scale(self) -> float | None:
        """The KL-clip factor ``ν`` of the last step (``None``: no clip applied)."""
        return None if self._kl_scale is None else float(self._kl_scale)

    @property
    def steps(self) -> int:
        """Number of completed ``step()`` calls."""
        return self._steps

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``name -> (A, G)`` running factors kept on this rank, on the per-sample scale.

        Each side as its statistic kind stores it (see ``describe()``): a low-rank side as
        its ``d × r`` ``U`` (factor ``U Uᵀ``), a ``diagonal`` side as its ``(d,)`` diagonal, a
        ``blockdiag`` side as its ``(k, b, b)`` diagonal blocks
        (:mod:`dkfac.solvers.block_layout`: the last one padded with zeros).
        """
        return running_factors(self.layers)

    def comm_stats(self) -> dict[str, Any]:
        """Bytes communicated by kind and collective, cumulative and per step.

        See :meth:`dkfac.distributed.ledger.CommLedger.stats`; all zeros on one process.
        """
        return self.comm.ledger.stats()

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by kind: ``factors``, ``inverses``, ``moments`` (state a
        solver keeps between steps) and ``accumulators`` (with, between a backward and the
        step, the inputs and output gradients of captures held for their groups where the
        device is launch-bound: :mod:`~dkfac.engine.capture_groups`)."""
        return memory_usage(self.layers, self.capture, self.eager, self.leftover)

    def describe(self) -> list[dict[str, Any]]:
        """One row per layer, then one per parameter left to the inner optimizer, then the
        overhead budget's.

        A layer's row: name, block, dimensions, method, factor kinds, ``role`` (its
        layer's role in Muon's split, :func:`~dkfac.engine.roles.layer_roles`: ``"input"``,
        ``"hidden"``, ``"head"``, ``"embedding"``; ``None`` for a normalisation), ``owner``,
        ``grad_workers`` and ``parameters`` (the names of the parameters it preconditions, every
        name of a tied one, ``[a:b]`` for rows of one). ``method``: e.g. ``"eigen"``,
        ``"smw(A=lowrank,G=dense)"``, ``"auto (pending)"`` until the first capture decides
        (:mod:`dkfac.solvers.lowrank.deferred`); likewise ``a_factor``/``g_factor``. A
        parameter's row (:mod:`~dkfac.engine.coverage`) has the same keys: ``name``,
        ``block="inner optimizer"``, ``reason``, ``parameters``, ``numel``, the others
        ``None`` but ``method``: ``"adam"`` where ``leftover_update`` gives it Adam's
        direction (:mod:`~dkfac.engine.leftover`); a layer's ``reason`` is ``None`` and
        ``numel`` its gradient's entries. With an ``overhead`` budget a last row,
        ``name="overhead budget"``, ``block="cost"``, says in ``reason`` what the budget
        chose and why (``"chosen after the first step"`` before it), its other keys ``None``.
        """
        return describe_table(
            self.layers, self._roles, self.strategy, self.coverage, self.leftover, self.budget
        )

    def state_dict(self, include_inverses: bool = False, gather: bool = True) -> dict[str, Any]:
        """Step counter and running factors keyed by module name.

        With several ranks this is a collective (call it on every rank): by default each
        layer's factors (and inverses) are gathered from its owner, so the result is the
        same on every rank and loads at any world size and with any strategy.

        Args:
            include_inverses: Also save the solver states. Without them ``load_state_dict``
                recomputes the inverses from the saved factors, which reproduces the next
                step exactly only when the state was saved right after an inverse update.
            gather: ``False`` saves only what this rank holds (no communication); layers
                held elsewhere are saved as ``None`` and load as "no factors yet".

        Raises:
            TypeError: If ``include_inverses`` or ``gather`` is not a bool.
        """
        check_bool("include_inverses", include_inverses)
        check_bool("gather", gather)
        return preconditioner_state(
            self.layers,
            self.strategy,
            self.comm,
            step=self.steps,
            capture=self.capture,
            refresh=self.refresh,
            late=self.late,
            leftover=self.leftover,
            budget=self.budget,
            include_inverses=include_inverses,
            gather=gather,
        )

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing.

        It checks the layer names, statistic shapes, low-rank plans, that every tensor is
        finite, the step, the refresh and Monte-Carlo generator states.
        """
        self._check_saved(state)

    def _check_saved(self, state: dict[str, Any]) -> Saved:
        device = self._device()
        saved = check_saved(
            state, self.layers, self.refresh, device, self.leftover, self.budget is not None
        )
        if saved.choice is None:
            return saved
        assert self.budget is not None
        choice = self.budget.checked(saved.choice, self.layers, self.config)
        return dataclasses.replace(saved, choice=choice)

    def _device(self) -> torch.device:
        return layers_device(self.layers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (a collective with several ranks).

        Each rank keeps what its strategy needs; inverses are recomputed by the owners
        unless they were saved.

        Raises:
            ValueError: If the state is not a state dict of this model's preconditioner
                (see :meth:`check_state_dict`); nothing is changed then. Past the checks
                only a failing collective can interrupt the load.
        """
        saved = self._check_saved(state)
        step = saved.step
        if self.budget is not None and (self._budget_spent or self.budget.choice is not None):
            self._forget_budget()  # the saved run's choice, or none when it had made none
        if saved.choice is not None:  # the run's chosen intervals, before its refresh state
            assert self.budget is not None
            self.budget.remove()
            self.budget.adopt(saved.choice)
            self._spend_budget()
        stale = restore_entries(
            state,
            self.layers,
            self.strategy,
            capture=self.capture,
            refresh=self.refresh,
            leftover=self.leftover,
            device=self._device(),
        )
        self.late = saved.late
        self.restore_step(step)
        damping = resolve("damping", self.config.damping, max(step - 1, 0))
        assert damping is not None
        # Owners recompute what was not saved; then every grad worker gets its owner's state.
        self.update_inverses(damping, stale)
