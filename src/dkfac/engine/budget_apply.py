"""The overhead budget joined to a preconditioner: made from the options, its choice applied.

:class:`~dkfac.engine.overhead.OverheadBudget` watches the shapes and makes the choice; here
it is built from the options the user set (:func:`make_budget`), and its choice reaches the
layers (one-sided sides as soon as the first training forward was seen,
:func:`apply_budget_bases`) and the configuration (the intervals, factor batch and
Newton–Schulz steps after the first step, :func:`spend_budget`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dkfac.config import KFACConfig
from dkfac.config.checks import check_range
from dkfac.distributed.control import ControlMessages
from dkfac.engine.layer_state import LayerState
from dkfac.engine.overhead import BUDGETED_OPTIONS, OverheadBudget
from dkfac.solvers.eigen_moments import EigenMomentsSolver

__all__ = [
    "SolverLimits",
    "apply_budget_bases",
    "make_budget",
    "restore_limits",
    "solver_limits",
    "spend_budget",
]

SolverLimits = dict[str, tuple[int | None, int]]
"""Each eigenbasis solver's ``max_dim`` and ``orthogonal_steps`` by layer name: the two
options the budget's choice changes in a solver (:func:`solver_limits`)."""


def make_budget(
    overhead: float | None, config: KFACConfig, options: Mapping[str, Any]
) -> OverheadBudget | None:
    """The overhead budget of a preconditioner built with ``config`` (``None``: no budget).

    Args:
        overhead: The most overhead over the training step (> 0), or ``None``.
        config: The preconditioner's configuration.
        options: The keyword options it was given: a budgeted option among them, or one
            ``config`` sets to other than its default, is the user's and kept.

    Raises:
        ValueError: For an ``overhead`` that is not a finite number > 0 (TypeError: not a
            number).
    """
    if overhead is None:
        return None
    check_range("overhead", overhead, low=0.0)
    defaults = KFACConfig()
    given = {
        k: getattr(config, k)
        for k in BUDGETED_OPTIONS
        if k in options or getattr(config, k) != getattr(defaults, k)
    }
    return OverheadBudget(float(overhead), given)


def apply_budget_bases(
    budget: OverheadBudget,
    layers: Mapping[str, LayerState],
    config: KFACConfig,
    control: ControlMessages,
    local_factors: bool = False,
) -> None:
    """Makes the choice as soon as the shapes were seen (the first training forward), from
    what every rank saw (:meth:`OverheadBudget.agree`; ``local_factors``: factors built from
    each owner's own batch, ``dp``), and gives the layers it makes one-sided their limit, so
    that the first refresh already builds their bases so (the rest is applied after the
    first step, :func:`spend_budget`)."""
    budget.agree(layers, control, local_factors)
    if budget.decide(layers, config.flattened_inputs) is not None:
        budget.apply_bases(layers)


def spend_budget(
    budget: OverheadBudget, layers: Mapping[str, LayerState], config: KFACConfig
) -> KFACConfig | None:
    """Applies the choice once it can be made (after the first step).

    Returns:
        ``None`` while the choice cannot be made yet; else the configuration with the chosen
        options (``config`` itself where the user set them all), whose layers got the
        chosen basis limits and Newton–Schulz steps.
    """
    if budget.decide(layers, config.flattened_inputs) is None:
        return None
    budget.apply_bases(layers)
    if not (chosen := budget.options()):
        return config
    budget.apply(layers)
    return dataclasses.replace(config, **chosen)


def solver_limits(layers: Mapping[str, LayerState]) -> SolverLimits:
    """The ``max_dim`` and ``orthogonal_steps`` of each layer's eigenbasis solver, as the
    options set them before any choice (for :func:`restore_limits`)."""
    return {
        name: (layer.solver.options.max_dim, layer.solver.options.orthogonal_steps)
        for name, layer in layers.items()
        if isinstance(layer.solver, EigenMomentsSolver)
    }


def restore_limits(layers: Mapping[str, LayerState], limits: SolverLimits) -> None:
    """Gives each solver of ``limits`` back its ``max_dim`` and ``orthogonal_steps`` (a
    choice undone); a side the choice made one-sided gets its statistic's kind back."""
    for name, (max_dim, steps) in limits.items():
        layer = layers[name]
        solver = layer.solver
        assert isinstance(solver, EigenMomentsSolver)
        options = solver.options
        if (options.max_dim, options.orthogonal_steps) == (max_dim, steps):
            continue
        solver.options = dataclasses.replace(options, max_dim=max_dim, orthogonal_steps=steps)
        if options.max_dim != max_dim:
            layer.restate_kinds()
