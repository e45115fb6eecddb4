"""Adam's ``(β₁, β₂)`` of the eigenbasis moments, changed during training.

``torch.optim.lr_scheduler.OneCycleLR`` and ``CyclicLR`` cycle an optimizer's momentum
with its learning rate: the first ``β`` of a group's ``"betas"`` where the optimizer has
them (Adam's), else the group's ``"momentum"``. :meth:`KFACOptimizer.for_model
<dkfac.KFACOptimizer.for_model>` gives its groups the ``"betas"`` of the moments it keeps,
so such a scheduler cycles the first moment, as it does AdamW's, instead of adding SGD's
momentum on top of it (which multiplied the step by up to 20 and diverged where the
default's best learning rate lies); :func:`set_moment_betas` applies them to the solvers
before each step.

A solver whose update has compiled (``compile_step``, ``compile_moments``) reads the betas
as constants of its graphs, and a cycled β₁ is a new value every step: each would compile
a graph (seconds with inductor) until dynamo's limit stopped it. Betas changed after a
solver compiled make it run eagerly from then on (:meth:`~dkfac.solvers.base.Solver.run_eagerly`),
logged once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from dkfac.solvers import MomentOptions

__all__ = ["set_moment_betas"]

logger = logging.getLogger(__name__)


def set_moment_betas(solvers: Iterable[object], beta1: float, beta2: float) -> int:
    """Gives every solver of ``solvers`` that keeps moments (its ``options`` a
    :class:`~dkfac.solvers.MomentOptions`) ``beta1`` and ``beta2``; returns how many
    changed (none when they already had them: the usual step).

    Raises:
        TypeError, ValueError: For a ``beta`` that is not a number in ``[0, 1)``
            (:class:`~dkfac.solvers.MomentOptions`' checks), before any solver changes.
    """
    moments: list[Any] = [
        s for s in solvers if isinstance(getattr(s, "options", None), MomentOptions)
    ]
    if type(beta1) is float and type(beta2) is float:  # the usual step: floats the solvers
        # already hold are not checked again (a MomentOptions built a step, for nothing)
        moments = [s for s in moments if (s.options.beta1, s.options.beta2) != (beta1, beta2)]
        if not moments:
            return 0
    wanted = MomentOptions(beta1=beta1, beta2=beta2)  # checks both
    changed = stopped = 0
    for solver in moments:
        options = solver.options
        if (options.beta1, options.beta2) == (wanted.beta1, wanted.beta2):
            continue
        solver.options = dataclasses.replace(options, beta1=wanted.beta1, beta2=wanted.beta2)
        changed += 1
        stopped += bool(getattr(solver, "run_eagerly", lambda: False)())
    if stopped:
        logger.warning(
            "the moments' betas changed during training (a scheduler cycling the momentum, "
            "such as OneCycleLR): %d compiled updates run eagerly from now on, since every "
            "new value would compile a graph of its own",
            stopped,
        )
    return changed
