"""World-size independent checkpoints of the registered layers' statistics and solver states.

Under ``"mem-opt"``, ``"kaisa"``, ``"dp"`` and ``"spngd"`` a rank keeps statistics (and
solver states) only for the layers it owns. :func:`layers_state` gathers every layer's
tensors from its owner (a collective: call it on every rank), so a checkpoint written by
rank 0 holds the whole model's state and loads at any world size and with any strategy;
:func:`load_layers_state` keeps on each rank only what its strategy needs and returns the
layers whose solver state the owners must recompute (and share). The preconditioner's own
entries beside the layers' are in :mod:`~dkfac.engine.saved_state`.

Under ``"dp"`` each owner's factors come from its own local batches; the gathered
checkpoint holds those.

Each entry holds the layer's statistics by name, ``"plan"`` where a deferred solver
(``method="smw"``/``"auto"``) has decided (its :meth:`~dkfac.solvers.base.Solver.decision`,
taken from the owner), and with ``include_inverses`` the solver state and the name of the
solver that made it (``"inverse_solver"``). A saved value is checked against its statistic
kind (a low-rank side is saved as its ``U`` of shape ``(d, r)``, a one-sided side as its
``(d,)`` diagonal) and loaded in the layout of the layer's kind now
(:meth:`~dkfac.solvers.statistics.StatisticKind.restore`: a saved ``d × d`` factor where the
side keeps its diagonal, or a saved diagonal where it is dense), and in the layer's factor
dtype (a float64 model's state loaded into a float32 one). A solver state made by another
solver than the layer now has (a method switch) is dropped and recomputed from the saved
factors; dense factors saved without a plan (``eigen``, ``cholesky``) decide a still
undecided deferred solver (``smw``, ``auto``) for dense sides: there are no rows to take a
rank from.

A stateful solver's moments (``"ekfac"``, ``"eigen_adam"``) are saved as ``"moments"``,
taken from the owner (which always preconditions its layers), together with the solver
state whatever ``include_inverses`` says: they are coordinates in its basis. They load on
every rank that preconditions the layer, and only with that basis: when the state is
dropped (a method switch, or a checkpoint without it) the moments start afresh, and a layer
whose solver keeps no moments ignores saved ones.

Where each rank computes its own solver state (a strategy whose ``shares_solver_states``
is false: the sharded layout's local mode) neither solver states nor moments are saved: a
loaded checkpoint recomputes the states from the saved factors and starts the moments afresh.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from dkfac.distributed.comm import Communicator
from dkfac.distributed.strategy_base import Strategy
from dkfac.engine.layer_state import LayerState
from dkfac.engine.refresh import RefreshPolicy
from dkfac.solvers import DenseStatistic, decided_solver
from dkfac.solvers.lowrank.factor import LowRankStatistic

__all__ = ["check_state", "layers_state", "load_layers_state"]

logger = logging.getLogger(__name__)


def _device(layer: LayerState) -> torch.device:
    return layer.block.parameters()[0].device


def layers_state(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    comm: Communicator,
    *,
    include_inverses: bool,
    gather: bool,
) -> dict[str, dict[str, Any]]:
    """Every layer's checkpoint entry (see the module notes); a collective when ``gather``.

    Args:
        layers: The registered layers.
        strategy: Says which rank owns each layer and gathers the owners' tensors.
        comm: The communicator of the training ranks (exchanges the owners' decisions).
        include_inverses: Also save the solver states.
        gather: Gather from the owners; ``False`` saves only what this rank holds.
    """
    devices = {name: _device(layer) for name, layer in layers.items()}
    running: dict[str, dict[str, Tensor] | None] = {
        name: dict(layer.running) or None for name, layer in layers.items()
    }
    inverses: dict[str, dict[str, Tensor] | None] = {
        name: None if layer.solver_state is None else dict(layer.solver_state)
        for name, layer in layers.items()
    }
    plans = {name: layer.decided for name, layer in layers.items()}
    stateful = any(layer.solver.stateful for layer in layers.values())
    moments: dict[str, dict[str, Tensor] | None] = {
        name: None if layer.moments is None else dict(layer.moments)
        for name, layer in layers.items()
    }
    shared = strategy.shares_solver_states
    if not shared:  # each rank's own (the sharded layout's local mode): recomputed at load
        inverses, moments = dict.fromkeys(inverses), dict.fromkeys(moments)
    if gather:
        running = strategy.gather_to_all(running, devices)
        if (include_inverses or stateful) and shared:
            inverses = strategy.gather_to_all(inverses, devices)
        if stateful and shared:
            moments = strategy.gather_to_all(moments, devices)
        # The same answer on every rank: under dp only owners capture, hence decide.
        if any(layer.solver.deferred or layer.decided for layer in layers.values()):
            for part in comm.exchange_objects(
                {n: p for n, p in plans.items() if strategy.is_owner(n)}
            ):
                plans.update({n: p for n, p in part.items() if p is not None})
    entries: dict[str, dict[str, Any]] = {}
    for name, layer in layers.items():
        held = running[name] or {}
        entry: dict[str, Any] = {key: held.get(key) for key in layer.statistic_shapes()}
        if plans[name] is not None:
            entry["plan"] = plans[name]
        if (include_inverses or layer.solver.stateful) and inverses[name] is not None:
            entry["inverse"] = inverses[name]
            entry["inverse_solver"] = layer.solver.name
        if moments[name] is not None:
            entry["moments"] = moments[name]
        entries[name] = entry
    return entries


_PLAN_SOLVERS = ("smw", "eigen", "cholesky")


def _check_plan(name: str, plan: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raises ValueError unless ``plan`` is a decision as :meth:`Solver.decision` saves it."""
    if not isinstance(plan, Mapping) or set(plan) != {"solver", "lowrank"}:
        raise ValueError(
            f"{name}: a saved plan must be a dict with keys 'solver' and 'lowrank', got {plan!r}"
        )
    solver, lowrank = plan["solver"], plan["lowrank"]
    if solver not in _PLAN_SOLVERS:
        raise ValueError(
            f"{name}: a saved plan's solver must be one of {_PLAN_SOLVERS}, got {solver!r}"
        )
    if not isinstance(lowrank, Mapping) or any(
        key not in shapes or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1
        for key, rank in lowrank.items()
    ):
        raise ValueError(
            f"{name}: a saved plan's 'lowrank' must map statistics of {sorted(shapes)} to "
            f"ranks >= 1, got {lowrank!r}"
        )
    if lowrank and solver != "smw":
        raise ValueError(f"{name}: a saved plan gives low-rank sides to {solver!r}, not 'smw'")


def _own_plan(layer: LayerState, plan: Any) -> Any:
    """``plan`` where the layer's method could have made it, else ``None``: ``"smw"``
    decides only the smw solver, so an ``"auto"`` state's ``eigen`` or ``cholesky``
    decision (dense factors) loads into it as dense factors without a plan do, and the
    method the loader was given is the layer's."""
    if plan is not None and layer.deferred_method == "smw" and plan["solver"] != "smw":
        return None
    return plan


def _check_tensors(label: str, values: Mapping[str, Any]) -> None:
    """Raises ValueError unless every value is a finite tensor (a host sync per tensor)."""
    for key, value in values.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"{label} {key} must be a tensor, got {type(value).__name__}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{label} {key} is not finite")


def _check_inverse(name: str, entry: Mapping[str, Any]) -> None:
    """Raises ValueError unless a saved solver state is a dict of finite tensors."""
    inverse = entry.get("inverse")
    if inverse is not None and not isinstance(inverse, Mapping):
        raise ValueError(f"{name}: a saved inverse must be a dict of tensors")
    _check_tensors(f"{name}: saved inverse", inverse or {})
    made_by = entry.get("inverse_solver")
    if made_by is not None and not isinstance(made_by, str):
        raise ValueError(f"{name}: 'inverse_solver' must be a solver name, got {made_by!r}")


def _check_entries(layers: Mapping[str, LayerState], saved: Mapping[str, Any]) -> None:
    """Raises ValueError unless every saved entry fits its layer (nothing is changed)."""
    if set(saved) != set(layers):
        raise ValueError(
            "state dict layers do not match the model: missing "
            f"{sorted(set(layers) - set(saved))}, unexpected {sorted(set(saved) - set(layers))}"
        )
    for name, entry in saved.items():
        layer = layers[name]
        if not isinstance(entry, Mapping):
            raise ValueError(f"{name}: a layer entry must be a dict, got {type(entry).__name__}")
        shapes = layer.statistic_shapes()
        plan = entry.get("plan")
        if plan is not None:
            _check_plan(name, plan, shapes)
        plan = _own_plan(layer, plan)
        _check_inverse(name, entry)
        deferrable = layer.solver.deferred or layer.decided is not None
        if plan is not None and plan["lowrank"] and not deferrable:
            raise ValueError(
                f"{name}: the state dict holds a {plan['solver']!r} low-rank plan; load it into "
                "a preconditioner with method='smw' or 'auto'"
            )
        if plan is not None and deferrable:
            kinds = decided_solver(plan["solver"], torch.float32, plan["lowrank"]).statistics(
                shapes
            )
        else:
            kinds = layer.kinds
        absent = sorted(set(shapes) - set(entry))
        if absent:
            raise ValueError(
                f"{name}: the saved entry lacks {absent} (a statistic that was not saved is "
                "held as None)"
            )
        for key, shape in shapes.items():
            value = entry[key]
            if value is None:
                continue
            if not isinstance(value, Tensor) or not value.is_floating_point():
                got = value.dtype if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"{name}: saved {key} must be a floating tensor or None, got {got}"
                )
            kind = kinds.get(key, DenseStatistic())  # a pending layer's sides are dense
            kind.check_saved(f"{name}: saved {key}", shape, tuple(value.shape))
            if plan is None and isinstance(kind, LowRankStatistic):
                _check_planless_lowrank(f"{name}: saved {key}", kind, tuple(value.shape))
            _check_tensors(f"{name}: saved", {key: value})
        _check_moments(name, layer, entry.get("moments"))
        _check_moment_keys(name, layer, entry)


def _check_moments(name: str, layer: LayerState, moments: Any) -> None:
    """Raises ValueError unless saved moments are named finite floating tensors, matrices of the
    gradient's ``g_dim × a_dim`` shape or 1-element counts, with no negative second moment
    ``v`` or count ``t``."""
    if moments is None:
        return
    if not isinstance(moments, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) and v.is_floating_point()
        for k, v in moments.items()
    ):
        raise ValueError(f"{name}: saved moments must be a dict of named floating tensors")
    grad_shape = (layer.block.g_dim, layer.block.a_dim)
    for key, value in moments.items():
        if tuple(value.shape) not in (grad_shape, (1,)):
            raise ValueError(
                f"{name}: saved moments {key!r} has shape {tuple(value.shape)}, expected "
                f"{grad_shape} or (1,)"
            )
    _check_tensors(f"{name}: saved moments", moments)
    for key in ("v", "t"):
        if key in moments and bool((moments[key] < 0).any()):
            raise ValueError(f"{name}: saved moments {key!r} has negative entries")


def _check_moment_keys(name: str, layer: LayerState, entry: Mapping[str, Any]) -> None:
    """Raises ValueError unless saved moments that will be kept (a stateful solver's, with
    the state of the solver that made them) hold exactly the moments that solver keeps:
    one missing would be a KeyError at the next step."""
    moments, inverse = entry.get("moments"), entry.get("inverse")
    made_by = entry.get("inverse_solver", layer.solver.name)
    if moments is None or inverse is None or not layer.solver.stateful:
        return
    if made_by != layer.solver.name:
        return  # dropped at load (_loaded_moments)
    zero = layer.solver.zero_moments_like(torch.zeros(1, 1))
    wanted = set(zero or ())
    if set(moments) != wanted:
        raise ValueError(
            f"{name}: saved moments hold {sorted(moments)}, but the {layer.solver.name} "
            f"solver keeps {sorted(wanted)}"
        )


def check_state(
    state: Any,
    layers: Mapping[str, LayerState],
    refresh: RefreshPolicy,
    device: torch.device,
) -> int:
    """Checks a preconditioner state dict against the layers; its step. Changes nothing.

    Args:
        state: What ``KFACPreconditioner.state_dict()`` returned.
        layers: The registered layers.
        refresh: The refresh policy (its state is tried on a copy).
        device: Where the Monte-Carlo generator lives.

    Raises:
        ValueError: If loading ``state`` would fail: not such a dict, a bad step, layer
            names, statistic shapes, plans, non-finite tensors, refresh or generator state.
    """
    if not isinstance(state, Mapping) or "layers" not in state or "step" not in state:
        raise ValueError("not a KFACPreconditioner state dict (needs 'step' and 'layers')")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state dict 'step' must be an integer >= 0, got {step!r}")
    if not isinstance(state["layers"], Mapping):
        raise ValueError("state dict 'layers' must be a dict of layer entries")
    _check_entries(layers, state["layers"])
    if state.get("refresh"):
        try:
            copy.copy(refresh).load_state_dict(dict(state["refresh"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"state dict 'refresh' is not usable: {err}") from None
    saved = [("mc_generator", state.get("mc_generator"))]
    every = state.get("mc_generators")
    if every is not None and not isinstance(every, list | tuple):
        kind = type(every).__name__
        raise ValueError(
            f"state dict 'mc_generators' must be a list of generator states, got a {kind}"
        )
    saved += [(f"mc_generators[{i}]", value) for i, value in enumerate(every or [])]
    for key, value in saved:
        if value is None and key == "mc_generator":
            continue
        if value is None:  # a rank given none would skip the gather the others run next
            raise ValueError(f"state dict {key!r} is None: every rank's entry is a state")
        try:
            torch.Generator(device=device).set_state(value)
        except (TypeError, RuntimeError) as err:
            raise ValueError(f"state dict {key!r} is not a generator state: {err}") from None
    return step


def _check_planless_lowrank(where: str, kind: LowRankStatistic, got: tuple[int, ...]) -> None:
    """A saved value for a side this layer already decided low-rank, from an entry without
    a plan this layer's method makes (:func:`_own_plan`): a ``U`` wider than the side's
    bound is a dense factor from another method (an entry of a decided low-rank side always
    carries its plan, and only then may ``U`` hold more columns than the bound,
    :func:`~dkfac.solvers.lowrank.factor.decay_concat`), which read as ``U`` would make the
    factor ``A Aᵀ``."""
    if got[1] > kind.max_rank:
        raise ValueError(
            f"{where} has shape {got}, a dense factor (no plan this method makes), but this "
            f"layer's side is low-rank (at most {kind.max_rank} columns): load it before the "
            "first step (the sides are then decided dense) or with the method that saved it"
        )


def load_layers_state(
    layers: Mapping[str, LayerState], strategy: Strategy, saved: Mapping[str, Any]
) -> list[str]:
    """Restores :func:`layers_state` entries; the layers whose solver state must be recomputed.

    Every entry is checked before anything changes. Each rank keeps what its strategy
    needs; a saved decision is installed; a solver state is taken only when the solver that
    made it is the layer's (older checkpoints, without ``"inverse_solver"``, are trusted).

    Raises:
        ValueError: If the layer names, shapes or plans do not fit the layers.
    """
    _check_entries(layers, saved)
    stale: list[str] = []
    for name, entry in saved.items():
        layer = layers[name]
        plan = _own_plan(layer, entry.get("plan"))
        shapes = layer.statistic_shapes()
        values = {key: entry.get(key) for key in shapes}
        if plan is not None and (layer.solver.deferred or layer.decided is not None):
            solver = decided_solver(plan["solver"], layer.solver.compute_dtype, plan["lowrank"])
            layer.restore_decision(plan, solver)
        elif layer.solver.deferred and any(v is not None for v in values.values()):
            layer.resolve(None)  # dense factors of a solver that decides nothing: dense sides
        device = _device(layer)
        place = _placement(layer, values, device)
        keep = strategy.keeps_statistics(name) and all(v is not None for v in values.values())
        layer.running = {
            k: layer.kind(k).restore(place(v), shapes[k]).clone()
            for k, v in values.items()
            if v is not None
        }
        if not keep:
            layer.running = {}
        inverse = entry.get("inverse")
        made_by = entry.get("inverse_solver", layer.solver.name)
        if inverse is not None and made_by != layer.solver.name:
            logger.info(
                "%s: the saved %s state is recomputed for the %s solver from the saved factors",
                name,
                made_by,
                layer.solver.name,
            )
            inverse = None
        layer.solver_state = (
            None
            if inverse is None
            else layer.solver.completed({k: place(v) for k, v in inverse.items()})
        )
        if inverse is None:
            stale.append(name)
        layer.moments = _loaded_moments(layer, strategy, entry.get("moments"), inverse)
        layer.reset_accumulators()
        layer.input_square, layer.input_forwards = None, 0  # a step left unfinished
    return stale


def _placement(
    layer: LayerState, values: Mapping[str, Tensor | None], device: torch.device
) -> Callable[[Tensor], Tensor]:
    """Moves a saved statistic or solver state tensor to ``device``; one in the saved
    statistics' precision (a checkpoint of a float64 model loaded into a float32 one) also
    to the layer's :attr:`~LayerState.factor_dtype`, where a fresh run keeps them."""
    saved = next((v.dtype for v in values.values() if v is not None), None)
    dtype = layer.factor_dtype if saved is not None and saved.is_floating_point else None

    def place(value: Tensor) -> Tensor:
        if dtype is not None and value.dtype == saved:
            return value.to(device, dtype)
        return value.to(device)

    return place


def _loaded_moments(
    layer: LayerState, strategy: Strategy, saved: Mapping[str, Tensor] | None, inverse: Any
) -> dict[str, Tensor] | None:
    """The moments this rank keeps of a saved entry (see the module notes)."""
    if saved is None or not strategy.preconditions(layer.name):
        return None
    if not layer.solver.stateful or inverse is None:
        logger.info(
            "%s: saved moments dropped (%s)",
            layer.name,
            "the solver keeps none" if not layer.solver.stateful else "their basis was not kept",
        )
        return None
    device = _device(layer)
    return {key: value.to(device).clone() for key, value in saved.items()}
