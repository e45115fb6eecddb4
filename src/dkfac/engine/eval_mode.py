"""Layers trained in eval mode: named once, since K-FAC captures nothing from them.

The capture hooks read a layer's statistics only in train mode (``module.training``), as
BatchNorm updates its running statistics only there, so an evaluation forward run with
gradients enabled never enters the factors. A layer that is trained while in eval mode
(``model.eval()`` before the training loop, or ``backbone.eval()`` to hold its BatchNorm
statistics) therefore gets no new statistics: it is preconditioned with those of its
train-mode steps, or, while it has none, is not moved by its gradient where its update has
Adam's scale (``eigen_adam``'s, the default; a weight decay still moves it) and takes its
plain gradient elsewhere (a BatchNorm's unit-wise update, the damped methods), on every
rank alike (the overlapped reduction leaves such a layer out of the step's plan,
:mod:`dkfac.engine.eager`). That is easy to miss, so :class:`EvalModeLayers` names such
layers in one warning, at the first step that would have captured them (a scheduled capture,
or the step after a layer was seen uncaptured).
An affine BatchNorm held in eval mode to freeze its statistics is such a layer too:
``unitwise_bn=False`` leaves its scale and shift to the update of the model's other
parameters instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor

from dkfac.engine.guards import name_list
from dkfac.engine.layer_state import LayerState

__all__ = ["EvalModeLayers"]

logger = logging.getLogger(__name__)


class EvalModeLayers:
    """Warns once for each layer seen with a gradient in eval mode."""

    def __init__(self) -> None:
        self.named: set[str] = set()

    def check(self, layers: Mapping[str, LayerState], grads: Mapping[str, Tensor | None]) -> None:
        """Names the layers that have a gradient this step while their module is in eval
        mode (call it on the steps that capture, and while a waiting layer was seen
        uncaptured); each layer once per run."""
        found = [
            name
            for name, layer in layers.items()
            if grads[name] is not None
            and name not in self.named
            and not layer.block.module.training
        ]
        if not found:
            return
        self.named.update(found)
        logger.warning(
            "%d layer(s) have gradients but are in eval mode at a step that captures their "
            "statistics: %s. K-FAC captures nothing in eval mode, so they are preconditioned "
            "with the statistics of their train-mode steps, or, while they have none, are "
            "not moved by their gradient where their update has Adam's scale (eigen_adam, "
            "the default; a weight decay still moves them) and take their plain gradient "
            "elsewhere (a BatchNorm's unit-wise update). Put the layers being trained in "
            "train mode (.train()); for a BatchNorm held in eval mode, unitwise_bn=False "
            "leaves its scale and shift to the update of the model's other parameters",
            len(found),
            name_list(found),
        )
