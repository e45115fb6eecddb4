"""After a refresh: each layer's new solver state completed, its moments carried into it.

Every rank adds to a received state what it derives itself
(:meth:`~dkfac.solvers.base.Solver.completed`), the layers of one
:meth:`~dkfac.solvers.base.Solver.complete_key` together
(:meth:`~dkfac.solvers.base.Solver.completed_batch`: one pass on their stacked values).

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

__all__ = ["carry_all", "carry_moments", "complete_all"]


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


def complete_all(layers: Mapping[str, LayerState], received: Mapping[str, SolverState]) -> None:
    """Sets each named layer's state to its ``received`` state completed
    (:meth:`~dkfac.solvers.base.Solver.completed` of a refresh, ``late``), the layers of one
    :meth:`~dkfac.solvers.base.Solver.complete_key` in one
    :meth:`~dkfac.solvers.base.Solver.completed_batch` on the first one's solver."""
    groups: dict[Hashable, list[str]] = {}
    for name, state in received.items():
        key = layers[name].solver.complete_key(state)
        if key is None:
            layers[name].solver_state = layers[name].solver.completed(state, late=True)
        else:
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        solvers = [layers[name].solver for name in names]
        states = [received[name] for name in names]
        done = solvers[0].completed_batch(solvers, states, late=True)
        for name, state in zip(names, done, strict=True):
            layers[name].solver_state = state
