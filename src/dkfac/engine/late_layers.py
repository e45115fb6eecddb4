"""Layers that join late: frozen when the preconditioner was built, or unused so far.

A layer with no gradient at a refresh gets no solver state then, and would take its plain
gradient until its next scheduled capture and refresh, which under the overhead budget's
intervals (tens of steps) leaves a just-unfrozen layer nearly still, and a layer used only
on steps the schedule never captures (two heads taking turns, the captures every 8th step)
still for good. Instead, a waiting layer that was seen frozen and now requires a gradient,
or that had a gradient at a step that did not capture it in full, is captured at every step
from the next on whatever the schedule says, refreshed on its own at the first step that
captured all of its statistics with a gradient present, and preconditioned from then on. A
layer that stays frozen (a frozen backbone) costs nothing: it is never captured; nor is one
that trains but never gets a gradient (an unused head), which waits for the schedule's
captures.

A layer in eval mode captures nothing: seen with a gradient there, it is captured from
the first step after it is back in train mode.

Which layers wait depends only on what every rank sees alike (``requires_grad``, the train
mode, whether a layer has a gradient, the captures the agreed schedule marked due, and the
statistics the ranks agreed were skipped), so every rank refreshes the same layers at the
same step (a refresh is a collective).

A layer whose weight gets a gradient while its forward never ran (its parent uses the
weight itself: MobileBERT's output layer is ``h @ cat([decoder.weight.T, dense.weight])``)
is left out at registration where the model's graph shows it
(:func:`~dkfac.engine.tracing.uncalled_layers`). One the graph does not show (a forward fx
cannot trace, a tied weight, a graph ``torch.compile`` captured before the hooks) is never
captured: it waits for good. Where its update has Adam's scale (``eigen_adam``'s) its gradient
does not move it (its plain gradient would be an SGD step at Adam's rate:
:func:`~dkfac.engine.step_math.precondition`; a weight decay still does); elsewhere (a
BatchNorm's unit-wise update, the damped methods) it takes its plain gradient.
:meth:`LateLayers.note_unrun` names each such layer once in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from torch import Tensor

from dkfac.engine.layer_state import LayerState

__all__ = ["LateLayers"]

logger = logging.getLogger(__name__)


class LateLayers:
    """The layers still waiting for a refresh with statistics of their own.

    Args:
        names: Every registered layer (all wait until the first refresh).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.waiting: set[str] = set(names)
        self.frozen: set[str] = set()  # waiting layers seen without a trainable parameter
        self.missed: set[str] = set()  # waiting layers seen with a gradient, not captured
        self.unrun: set[str] = set()  # waiting layers warned of by note_unrun
        self.unrun_once: set[str] = set()  # waiting layers seen so by one step of note_unrun

    def note_unrun(
        self,
        layers: Mapping[str, LayerState],
        grads: Mapping[str, Tensor | None],
        ran: AbstractSet[int],
    ) -> None:
        """Warns once of each waiting layer with a gradient whose forward never ran on this
        rank (``ran``: the ids of the layers whose forward has), at the second step it is
        seen so: its parent applies its weight without calling it, so no hook sees its input
        or output. At the first, the gradient may come from a forward run before the hooks
        were put on (the optimizer built after the model's first forward, as for lazy
        modules). A layer in eval mode is left to
        :class:`~dkfac.engine.eval_mode.EvalModeLayers`' warning (an attention's projections
        run as modules only in training: its own forward otherwise)."""
        for name in sorted(self.waiting - self.unrun):
            layer = layers[name]
            if grads[name] is not None and layer.block.module.training and id(layer) not in ran:
                if name not in self.unrun_once:
                    self.unrun_once.add(name)
                    continue
                self.unrun.add(name)
                logger.warning(
                    "layer %s has a gradient but its forward has never run: its weight is "
                    "used outside it (by its parent, functionally), or it runs inside a graph "
                    "torch.compile captured before the optimizer was built (call "
                    "torch.compiler.reset() after building it), so K-FAC captures no "
                    "factors for it: where its update has Adam's scale (eigen_adam, the "
                    "default) its gradient does not move it (a weight decay still does), "
                    "elsewhere it takes its plain gradient; list it in "
                    "skip_layers (with any layer tied to it) to give it the leftover update",
                    name,
                )

    def mark_due(self, layers: Mapping[str, LayerState]) -> bool:
        """Marks every statistic due of each waiting layer seen frozen that now trains, or
        seen with a gradient its step did not capture and now in train mode (one in eval
        mode is never captured: it waits for train mode, not capturing all along); whether
        any."""
        joining = []
        for name in sorted(self.waiting):
            layer = layers[name]
            if not any(p.requires_grad for p in layer.block.parameters()):
                self.frozen.add(name)
            elif name in self.frozen or (name in self.missed and layer.block.module.training):
                joining.append(layer)
        for layer in joining:
            layer.due = frozenset(layer.statistic_names())
        return bool(joining)

    @staticmethod
    def _captured(
        name: str, layer: LayerState, grad: Tensor | None, skipped: AbstractSet[str]
    ) -> bool:
        """Whether this step gave the layer a gradient and every one of its statistics
        (due, and not ``skipped``: missing on some rank, or never captured)."""
        return (
            grad is not None
            and layer.due == frozenset(layer.statistic_names())
            and name not in skipped
        )

    def note_missed(
        self,
        layers: Mapping[str, LayerState],
        grads: Mapping[str, Tensor | None],
        skipped: AbstractSet[str],
    ) -> None:
        """Records the waiting layers this step gave a gradient without capturing them in
        full: :meth:`mark_due` captures them from the next step on."""
        self.missed.update(
            n
            for n in self.waiting
            if grads[n] is not None and not self._captured(n, layers[n], grads[n], skipped)
        )

    def arrived(
        self,
        layers: Mapping[str, LayerState],
        grads: Mapping[str, Tensor | None],
        skipped: AbstractSet[str],
    ) -> list[str]:
        """The waiting layers this step captured in full, in registration order."""
        return [
            n
            for n in layers
            if n in self.waiting and self._captured(n, layers[n], grads[n], skipped)
        ]

    def refreshed(
        self,
        layers: Mapping[str, LayerState],
        grads: Mapping[str, Tensor | None],
        skipped: AbstractSet[str],
        names: Iterable[str] | None = None,
    ) -> None:
        """Records a refresh of ``names`` (default: every layer) at this step."""
        for name in layers if names is None else names:
            if self._captured(name, layers[name], grads[name], skipped):
                self.waiting.discard(name)
                self.frozen.discard(name)
                self.missed.discard(name)

    def state_dict(self) -> list[str]:
        """The waiting layers, sorted (the same on every rank)."""
        return sorted(self.waiting)

    def load_state_dict(
        self, names: Iterable[str], known: Iterable[str], missed: Iterable[str] = ()
    ) -> None:
        """Restores :meth:`state_dict`, and :attr:`missed` (its saved, sorted list).

        Raises:
            ValueError: If a name is not one of ``known`` (the registered layers), or a
                missed layer is not waiting.
        """
        names, missed = list(names), list(missed)
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"'late_layers' names layers this model does not have: {unknown}")
        if not set(missed) <= set(names):
            raise ValueError(
                f"'late_layers_missed' names layers that are not waiting: "
                f"{sorted(set(missed) - set(names))}"
            )
        self.waiting = set(names)
        self.frozen = set()  # seen again at the next schedule
        self.missed = set(missed)
