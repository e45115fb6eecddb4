"""The overhead budget in a running preconditioner: shapes seen, then one choice.

:class:`OverheadBudget` watches the first training forward of every registered layer (the
rows it sees: samples × positions, and the batch), and after the first step chooses the
factor batch and the factor and basis intervals within the budget
(:func:`dkfac.costmodel.budget.choose`, a pure function of the trainable layers' sizes and
those rows: every rank makes the same choice; a frozen layer costs nothing). The first step
itself captures the whole batch and refreshes every basis, as any first step does; the
choice is made before it where the shapes are known, so that the sides it makes one-sided
(too wide for the rows a step sees, :data:`~dkfac.costmodel.budget.ONE_SIDED_SHARE`) already
keep the identity basis at that first refresh. Options the user set are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from dkfac.blocks.embedding import EmbeddingBlock
from dkfac.config.schedules import EarlyRefresh, resolve
from dkfac.costmodel.budget import Choice, LayerShape, basis_limit, choose_for
from dkfac.distributed.control import ControlMessages
from dkfac.engine.layer_state import LayerState, layers_device
from dkfac.engine.micro_batches import computes_gradient, gradient_accumulator
from dkfac.engine.model_hooks import ModelHook
from dkfac.solvers.eigen_moments import EigenMomentsSolver

__all__ = ["BUDGETED_OPTIONS", "LARGER_BATCH_FACTOR", "OverheadBudget"]

logger = logging.getLogger(__name__)

BUDGETED_OPTIONS = (
    "factor_batch_size",
    "factor_update_interval",
    "inverse_update_interval",
    "orthogonal_steps",
    "basis_max_dim",
)
"""The options the budget chooses unless the user set them (``orthogonal_steps`` only where
layers take an orthogonalised update and the budget does not hold; ``basis_max_dim`` per
layer, for the sides of eigenbasis-moment layers whose rotations cost more than
:data:`~dkfac.costmodel.budget.ONE_SIDED_SHARE` of their training step)."""


LARGER_BATCH_FACTOR = 2
"""A captured batch this many times the first one's makes :meth:`OverheadBudget.note_batch`
warn."""


class OverheadBudget:
    """Chooses the budgeted options once the first training forward has been seen.

    Args:
        budget: The most overhead over the training step, e.g. 0.3 (> 0).
        explicit: The budgeted options the user set (kept as given).
    """

    def __init__(self, budget: float, explicit: Mapping[str, Any]) -> None:
        self.budget = budget
        self.explicit = {k: v for k, v in explicit.items() if k in BUDGETED_OPTIONS}
        self.rows: dict[str, int] = {}
        self.step_rows: dict[str, int] = {}
        self.batch: int | None = None
        self.choice: Choice | None = None
        self._handles: list[RemovableHandle] = []
        self._nodes: dict[str, Node | None] = {}  # a running forward's weight accumulator
        self._warned = False

    def watch(self, layers: Mapping[str, LayerState]) -> None:
        """Records each layer's rows and the batch of the first training forward whose
        output gradient arrives, and the rows of all of them before the first step (the
        micro-batches of an accumulated step together); a forward never backpropagated, a
        metric's or a probe's, counts for nothing."""
        for name, layer in layers.items():

            def running(module: nn.Module, inputs: Any, name: str = name) -> None:
                # the weight this forward runs with (FSDP2's unsharded one: its pre-hook ran)
                self._nodes[name] = gradient_accumulator(layers[name].block.parameters()[0])

            def seen(module: nn.Module, inputs: Any, output: Any, name: str = name) -> None:
                node = self._nodes.pop(name, None)
                out = output[0] if isinstance(output, (tuple, list)) else output
                g = layers[name].block.g_dim
                if not module.training or not isinstance(out, Tensor) or g <= 0:
                    return
                if not out.requires_grad:  # (the hooks are removed once the choice is made)
                    return
                first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
                # samples as the capture counts them: an unbatched input (GPT-2's position
                # lookup wpe(arange(T)), a (C, L) sequence) is one, not its first dimension
                batch = layers[name].block.batch_size(first) if first is not None else None
                rows = layers[name].block.forward_rows(first, out)
                out.register_hook(functools.partial(self._arrived, name, rows, batch, node))

            module = layer.block.module
            self._handles.append(module.register_forward_pre_hook(ModelHook(running)))
            self._handles.append(module.register_forward_hook(ModelHook(seen)))

    def _arrived(
        self, name: str, rows: int, batch: int | None, node: Node | None, grad: Tensor
    ) -> None:
        """An output gradient of layer ``name`` arrived: counted where the backward computes
        the weight's gradient (not an input's ``torch.autograd.grad``:
        :mod:`dkfac.engine.micro_batches`)."""
        del grad
        if computes_gradient(node):
            self._seen(name, rows, batch)

    def _seen(self, name: str, rows: int, batch: int | None) -> None:
        """A backpropagated forward of layer ``name`` (:meth:`watch`). The batch and each
        layer's rows are the largest of the forwards before the choice (a layer may see
        none of a batch, an expert of a router): the micro-batches of an accumulated first
        step give the same choice in any order."""
        self.rows[name] = max(self.rows.get(name, 0), rows)
        self.step_rows[name] = self.step_rows.get(name, 0) + rows
        if batch:
            self.batch = max(self.batch or 0, batch)

    def agree(
        self,
        layers: Mapping[str, LayerState],
        control: ControlMessages,
        local_factors: bool = False,
    ) -> None:
        """Makes every rank's record of the first step the same (one small sum over the
        ranks, before :meth:`decide`), so that every rank makes the same choice: ranks whose
        first batches differ in size, or that ran different branches, would otherwise size
        a side differently and then reduce factors of different shapes.

        The batch and each layer's rows become their mean over the ranks that saw them
        (rounded up): a rank's own step is what the budget weighs against. Each layer's
        rows of the step become their sum: the averaged factors are built from all of
        them, as one process would build them from the whole batch; with ``local_factors``
        (``dp``: an owner's own batch) their mean, as the batch's.
        """
        if not control.active or self.choice is not None:
            return
        names = list(layers)
        local = [float(self.batch or 0), float(bool(self.batch))]
        local += [float(self.rows.get(n, 0)) for n in names]
        local += [float(n in self.rows) for n in names]
        local += [float(self.step_rows.get(n, 0)) for n in names]
        device = layers_device(layers)
        total = control.sum_control(torch.tensor(local, dtype=torch.float64, device=device))
        values = [round(v) for v in total.tolist()]
        count = len(names)
        batch, seen = values[0], values[1]
        rows, present, step_rows = (values[2 + i * count : 2 + (i + 1) * count] for i in range(3))
        self.batch = -(-batch // seen) if seen else None
        self.rows = {n: -(-r // k) for n, r, k in zip(names, rows, present, strict=True) if k}
        if local_factors:
            step_rows = [-(-r // k) if k else r for r, k in zip(step_rows, present, strict=True)]
        self.step_rows = {n: r for n, r in zip(names, step_rows, strict=True) if r}

    def decide(
        self, layers: Mapping[str, LayerState], maps: Mapping[str, tuple[int, int]] | None = None
    ) -> Choice | None:
        """The choice, once shapes were seen (``None`` before any training forward);
        ``maps``: the layers with a flattened map's Kronecker input basis."""
        if self.choice is not None:
            return self.choice
        if self.batch is None or not any(self.rows.values()):
            # Nothing seen yet, or only empty batches, which tell nothing of the shapes:
            # the choice waits for a step that is not empty.
            self.rows.clear()
            self.step_rows.clear()
            self.batch = None
            return None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # A frozen layer (a LoRA adapter's base) costs the preconditioner nothing now.
        trainable = {n: x for n, x in layers.items() if x.block.parameters()[0].requires_grad}
        shapes = {
            name: LayerShape(
                layer.block.a_dim,
                layer.block.g_dim,
                self.rows.get(name, self.batch),
                tuple((maps or {}).get(name, ())),
                _polar_steps(layer),
                _solver_option(layer, "max_dim"),  # basis_max_dim, where given
                units=self.batch if _priced_by_units(layer) else 0,
                block=_solver_option(layer, "block_size"),  # basis_block_size
            )
            for name, layer in (trainable or layers).items()
        }
        one_sided: dict[str, int] = {}
        if "basis_max_dim" not in self.explicit:  # sides too wide for the step's rows
            for name, shape in shapes.items():
                limit = basis_limit(self.step_rows.get(name, shape.rows))
                wider = dataclasses.replace(shape, basis_max=limit)
                solver = layers[name].solver
                if isinstance(layers[name].block, EmbeddingBlock):
                    continue  # a diagonal input side; a position table's rows are per batch
                if isinstance(solver, EigenMomentsSolver) and wider.rotated() != shape.rotated():
                    shapes[name], one_sided[name] = wider, limit
        choice = choose_for(list(shapes.values()), self.batch, self.budget, self._priced())
        if one_sided:
            choice = dataclasses.replace(
                choice, basis_max_dims=one_sided, reason=choice.reason + _one_sided_note(one_sided)
            )
        self.choice = choice
        logger.info("overhead budget: %s", self.choice.reason)
        return self.choice

    def adopt(self, choice: Choice) -> None:
        """Takes a loaded checkpoint's choice as this budget's (the resumed run keeps its
        intervals); says so where it was made under another budget than this one's, which
        then does not apply."""
        if choice.budget != self.budget:
            logger.warning(
                "the loaded state's overhead choice (made for overhead=%g: %s) replaces this "
                "preconditioner's overhead=%g (options given explicitly are kept as given)",
                choice.budget,
                choice.reason,
                self.budget,
            )
        self.choice = choice

    def _priced(self) -> dict[str, Any]:
        """The options the user set as the cost model prices them: an interval given as a
        schedule (a callable of the step) at its value at step 0, which it keeps as given."""
        priced = dict(self.explicit)
        for name in ("factor_update_interval", "inverse_update_interval"):
            if callable(value := priced.get(name)):
                priced[name] = int(resolve(name, value, 0) or 1)
        return priced

    def note_batch(self, batch: int) -> None:
        """Warns once when a later step captures a batch at least
        :data:`LARGER_BATCH_FACTOR` times the one the choice was made from (a first step on
        a small batch): the choice, kept for the run, then counts the training step as
        cheaper than it is, and its one-sided sides as wider against their rows."""
        if self.choice is None or self.batch is None or self._warned:
            return
        if batch >= LARGER_BATCH_FACTOR * self.batch:
            self._warned = True
            logger.warning(
                "overhead budget: chosen from a first batch of %d samples, but a step now "
                "captures %d; the choice is kept for the run (%s). Start with a full batch, "
                "or set what it chooses yourself (factor_batch_size, factor_update_interval, "
                "inverse_update_interval, basis_max_dim)",
                self.batch,
                batch,
                self.choice.reason,
            )

    def options(self, choice: Choice | None = None) -> dict[str, Any]:
        """The chosen values of the options the user did not set (of ``choice``, or this
        budget's own choice); a basis interval longer than the factor interval with one
        more refresh at the first factor capture after the first step's
        (:class:`~dkfac.config.schedules.EarlyRefresh`: at the factor interval the user set,
        where set, e.g. for a loaded choice made under another)."""
        choice = choice or self.choice
        if choice is None:
            return {}
        factors, bases = choice.factor_update_interval, choice.inverse_update_interval
        if (given := self.explicit.get("factor_update_interval")) is not None:
            factors = int(resolve("factor_update_interval", given, 0) or factors)
        chosen: dict[str, Any] = {
            "factor_batch_size": choice.factor_batch_size,
            "factor_update_interval": factors,
            "inverse_update_interval": EarlyRefresh(factors, bases) if bases > factors else bases,
        }
        if choice.orthogonal_steps is not None:
            chosen["orthogonal_steps"] = choice.orthogonal_steps
        return {k: v for k, v in chosen.items() if k not in self.explicit}

    def checked(self, choice: Choice, layers: Mapping[str, LayerState], config: Any) -> Choice:
        """A saved ``choice`` as this preconditioner takes it, checked before anything
        changes: without Newton–Schulz steps where no layer orthogonalises its update (a
        checkpoint of another method), without one-sided bases where the user set
        ``basis_max_dim`` (kept as given, as the other options the user set are:
        :meth:`options`), and refused where its options make no valid configuration with
        ``config`` (a ``KFACConfig``).

        Raises:
            ValueError: For chosen options the configuration refuses.
        """
        if choice.orthogonal_steps is not None and not any(map(_polar_steps, layers.values())):
            choice = dataclasses.replace(choice, orthogonal_steps=None)
        if choice.basis_max_dims and "basis_max_dim" in self.explicit:
            note = _one_sided_note(choice.basis_max_dims)
            choice = dataclasses.replace(
                choice, basis_max_dims={}, reason=choice.reason.replace(note, "")
            )
        try:
            dataclasses.replace(config, **self.options(choice))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"'budget' holds a choice this preconditioner refuses: {err}"
            ) from None
        return choice

    def apply(self, layers: Mapping[str, LayerState]) -> None:
        """Gives the layers with an orthogonalised update the chosen Newton–Schulz steps
        (their solvers' options; the intervals and factor batch are the config's)."""
        steps = self.options().get("orthogonal_steps")
        if steps is None:
            return
        for layer in layers.values():
            solver = layer.solver
            if _polar_steps(layer) and isinstance(solver, EigenMomentsSolver):
                solver.options = dataclasses.replace(solver.options, orthogonal_steps=steps)

    def apply_bases(self, layers: Mapping[str, LayerState]) -> None:
        """Gives the layers with a side too wide for their rows (the choice's
        ``basis_max_dims``) that limit as their solvers' ``max_dim``: the sides wider keep
        the identity from their next refresh on, and their factors are captured as the
        solver keeps such a side (its diagonal alone: ``d`` products a row, not ``d²``)."""
        limits = {} if self.choice is None else self.choice.basis_max_dims
        for name, limit in limits.items():
            solver = layers[name].solver if name in layers else None
            if isinstance(solver, EigenMomentsSolver) and solver.options.max_dim != limit:
                solver.options = dataclasses.replace(solver.options, max_dim=limit)
                layers[name].restate_kinds()  # the identity side: only its diagonal

    def remove(self) -> None:
        """Removes the watching hooks (with the preconditioner's)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()

    def forget(self, layers: Mapping[str, LayerState]) -> None:
        """Back to no choice, watching ``layers`` for the shapes again (a state saved before
        the choice was made is loaded: the choice is made anew from the steps after it)."""
        self.remove()
        self.rows, self.step_rows = {}, {}
        self.batch, self.choice, self._warned = None, None, False
        self.watch(layers)


def _one_sided_note(one_sided: Mapping[str, int]) -> str:
    """What a choice's reason adds for its one-sided sides (``basis_max_dims``)."""
    return (
        "; one-sided bases (the identity) on the sides wider than 3/4 of the rows "
        f"of {', '.join(one_sided)}"
    )


def _priced_by_units(layer: LayerState) -> bool:
    """Whether the budget prices the layer as unit-wise (:class:`LayerShape`'s ``units``):
    a grouped convolution's; BatchNorm's ``2 × C`` pair keeps the Kronecker count the
    budget's constants were fitted with (its work is a small share either way)."""
    cost = layer.block.cost_description()
    return cost.unitwise and cost.kind != "batchnorm"


def _solver_option(layer: LayerState, name: str) -> int | None:
    """An eigenbasis solver's ``max_dim`` or ``block_size`` (``None`` for another solver,
    which has neither)."""
    if not isinstance(layer.solver, EigenMomentsSolver):
        return None
    value = getattr(layer.solver.options, name)
    return None if value is None else int(value)


def _polar_steps(layer: LayerState) -> int:
    """The Newton–Schulz steps of the layer's orthogonalised update (0 when it has none)."""
    options = getattr(layer.solver, "options", None)
    if options is None or getattr(options, "orthogonal_rms", None) is None:
        return 0
    return int(getattr(options, "orthogonal_steps", 0))
