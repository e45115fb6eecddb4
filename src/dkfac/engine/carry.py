"""Carrying each layer's moments into its new solver state after a refresh.

Every rank that preconditions a layer with moments (a :attr:`~dkfac.solvers.base.Solver.stateful`
solver) carries them into the layer's new state itself
(:meth:`~dkfac.solvers.base.Solver.carry_moments`). The layers whose solvers give one
:meth:`~dkfac.solvers.base.Solver.carry_key` (a refresh of the layers of one shape) are
carried together by one :meth:`~dkfac.solvers.base.Solver.carry_batch`: the same products
and selections on their stacks, a few calls for the group instead of a dozen a layer (a
GPU refresh is launches).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from dkfac.engine.layer_state import LayerState
from dkfac.solvers import SolverState

__all__ = ["carry_all", "carry_moments"]


def carry_moments(layer: LayerState, previous: SolverState | None) -> None:
    """The layer's moments in its new solver state (dropped where it has none)."""
    if layer.moments is None:
        return
    if layer.solver_state is None:
        layer.moments = None
        return
    layer.moments = layer.solver.carry_moments(previous, layer.solver_state, layer.moments)


def carry_all(layers: Mapping[str, LayerState], previous: Mapping[str, SolverState | None]) -> None:
    """:func:`carry_moments` of every layer (``previous``: its state before the refresh),
    the layers of one :meth:`~dkfac.solvers.base.Solver.carry_key` in one
    :meth:`~dkfac.solvers.base.Solver.carry_batch` on the first one's solver."""
    groups: dict[Hashable, list[str]] = {}
    for name, layer in layers.items():
        before, state, moments = previous[name], layer.solver_state, layer.moments
        key = None
        if state is not None and moments is not None:
            key = layer.solver.carry_key(before, state, moments)
        if key is None:
            carry_moments(layer, before)
        else:
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        olds = [previous[name] for name in names]
        news = [layers[name].solver_state for name in names]
        held = [layers[name].moments for name in names]
        batch = layers[names[0]].solver.carry_batch(olds, news, held)  # type: ignore[arg-type]
        for name, value in zip(names, batch, strict=True):
            layers[name].moments = value
