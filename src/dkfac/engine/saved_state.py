"""A preconditioner's state dict: the layers' entries and the preconditioner's own beside them.

The layers' entries (statistics, plans, solver states, moments) are
:mod:`~dkfac.engine.checkpoint`'s. Beside them a state dict holds the step counter, the
Monte-Carlo generator's state, the refresh policy's, the layers still waiting for their first
refresh (:class:`~dkfac.engine.late_layers.LateLayers`), the leftover optimizer's moments
(:mod:`~dkfac.engine.leftover`) and the overhead budget's choice. Everything is checked
(:func:`check_saved`) before anything is loaded (:func:`restore_entries`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dkfac.costmodel.budget import Choice
from dkfac.distributed.comm import Communicator
from dkfac.distributed.strategy_base import Strategy
from dkfac.engine.capture import FactorCapture
from dkfac.engine.checkpoint import check_state, layers_state, load_layers_state
from dkfac.engine.late_layers import LateLayers
from dkfac.engine.layer_state import LayerState, layers_device
from dkfac.engine.leftover import LeftoverAdam
from dkfac.engine.overhead import OverheadBudget
from dkfac.engine.refresh import RefreshPolicy

__all__ = [
    "Saved",
    "check_saved",
    "preconditioner_state",
    "restore_entries",
    "saved_choice",
    "saved_late_layers",
]


def preconditioner_state(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    comm: Communicator,
    *,
    step: int,
    capture: FactorCapture,
    refresh: RefreshPolicy,
    late: LateLayers,
    leftover: LeftoverAdam | None,
    budget: OverheadBudget | None,
    include_inverses: bool,
    gather: bool,
) -> dict[str, Any]:
    """The state dict of a preconditioner at ``step`` (a collective when ``gather``).

    Args:
        layers: The registered layers (:func:`~dkfac.engine.checkpoint.layers_state`).
        strategy: Says which rank owns each layer and gathers the owners' tensors.
        comm: The communicator of the training ranks.
        step: The step counter.
        capture: Holds the Monte-Carlo generator.
        refresh: The refresh policy.
        late: The layers still waiting for their first refresh.
        leftover: The leftover optimizer, if any (the same on every rank: no gathering).
        budget: The overhead budget, if any (its choice once made).
        include_inverses: Also save the solver states.
        gather: Gather from the owners; ``False`` saves only what this rank holds.
    """
    entries = layers_state(layers, strategy, comm, include_inverses=include_inverses, gather=gather)
    generator = capture.generator
    state = {
        "step": step,
        "layers": entries,
        "mc_generator": None if generator is None else generator.get_state(),
        "mc_generators": _every_rank_generator(comm, generator, layers) if gather else None,
        "refresh": refresh.state_dict(),
        "late_layers": late.state_dict(),
        "late_layers_missed": sorted(late.missed),
    }
    if leftover is not None:  # the same on every rank: no gathering
        state["leftover"] = leftover.state_dict()
    if budget is not None and budget.choice is not None:
        state["budget"] = dataclasses.asdict(budget.choice)
    return state


def _every_rank_generator(
    comm: Communicator, generator: torch.Generator | None, layers: Mapping[str, LayerState]
) -> list[Tensor] | None:
    """Every rank's Monte-Carlo generator state in the group's order (a collective on
    several ranks; one entry on one; ``None`` before the first sampled backward, which
    every rank runs alike): each rank samples from its own stream (seeded ``seed +
    index``), which a resume gives back to each (:func:`own_generator_state`)."""
    if generator is None:
        return None
    local = generator.get_state()
    if not comm.active:
        return [local.clone()]
    device = layers_device(layers)  # NCCL gathers device tensors only
    rows, handle = comm.all_gather_rows(local.to(device).reshape(1, -1), "factors")
    handle.wait()
    return [row.cpu().clone() for row in rows]


def own_generator_state(state: Mapping[str, Any], comm: Communicator) -> Tensor | None:
    """This rank's saved Monte-Carlo generator state: the entry of ``mc_generators`` at its
    index (the saving run's rank of that index; on another number of ranks the first ranks
    take the saved streams in order), ``None`` for a rank beyond them (it starts its own
    stream, :func:`restore_entries`: two ranks never sample alike), and ``mc_generator``
    where the state holds no list (saved without gathering: each rank's own)."""
    every = state.get("mc_generators")
    if every is None:
        single: Tensor | None = state.get("mc_generator")
        return single
    index = comm.ranks.index(comm.rank) if comm.active else 0
    chosen: Tensor | None = every[index] if index < len(every) else None
    return chosen


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a checked state dict restores beside the layers' entries."""

    step: int
    choice: Choice | None
    """The overhead budget's saved choice (``None``: none, or no budget loading it)."""
    late: LateLayers
    """The layers still waiting for their first refresh."""


def check_saved(
    state: Any,
    layers: Mapping[str, LayerState],
    refresh: RefreshPolicy,
    device: torch.device,
    leftover: LeftoverAdam | None,
    budgeted: bool,
) -> Saved:
    """Checks a whole preconditioner state dict; changes nothing.

    Args:
        state: What ``KFACPreconditioner.state_dict()`` returned.
        layers: The registered layers.
        refresh: The refresh policy (its state is tried on a copy).
        device: Where the Monte-Carlo generator lives.
        leftover: The leftover optimizer, if any (saved moments are checked against it;
            absent ones are fine).
        budgeted: Whether the preconditioner loading it has an overhead budget.

    Raises:
        ValueError: If loading ``state`` would fail
            (:func:`~dkfac.engine.checkpoint.check_state`, the leftover moments, the
            budget's choice or the late layers).
    """
    step = check_state(state, layers, refresh, device)
    saved = state.get("leftover")
    if saved is not None and leftover is not None:
        leftover.check_state_dict(saved)
    choice = saved_choice(state, layers, budgeted)
    late = saved_late_layers(state, layers)
    return Saved(step, choice, late)


def restore_entries(
    state: Mapping[str, Any],
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    *,
    capture: FactorCapture,
    refresh: RefreshPolicy,
    leftover: LeftoverAdam | None,
    device: torch.device,
) -> list[str]:
    """Loads a checked state dict's layers' entries, leftover moments, refresh state and
    Monte-Carlo generator; the layers whose solver state the owners must recompute.

    Args:
        state: A state dict :func:`check_saved` accepted.
        layers: The registered layers.
        strategy: Says what each rank keeps.
        capture: Gets the Monte-Carlo generator.
        refresh: The refresh policy.
        leftover: The leftover optimizer, if any.
        device: Where the Monte-Carlo generator lives.
    """
    stale = load_layers_state(layers, strategy, state["layers"])
    if leftover is not None:
        leftover.load_state_dict(state.get("leftover") or {})
    if state.get("refresh"):
        refresh.load_state_dict(dict(state["refresh"]))
    generator = own_generator_state(state, strategy.comm)
    if generator is not None:
        capture.generator = torch.Generator(device=device)
        capture.generator.set_state(generator)
    elif state.get("mc_generators") is not None:  # more ranks than saved: a stream of its own
        capture.generator = torch.Generator(device=device)  # now, as every rank has one
        capture.generator.manual_seed(capture.config.seed + strategy.index)  # (next save)
    return stale


def saved_late_layers(state: Mapping[str, Any], layers: Mapping[str, LayerState]) -> LateLayers:
    """The layers still waiting for their first refresh in a preconditioner's ``state`` (none
    when the entry is absent: a checkpoint from before it was saved), and those of them seen
    with a gradient their step did not capture (``late_layers_missed``).

    Raises:
        ValueError: If the entry is not a list of the names of ``layers``.
    """
    late = LateLayers(())
    saved = {key: state.get(key) or [] for key in ("late_layers", "late_layers_missed")}
    for key, names in saved.items():
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{key!r} must be a list of layer names, got {names!r}")
    late.load_state_dict(saved["late_layers"], layers, saved["late_layers_missed"])
    return late


def saved_choice(
    state: Mapping[str, Any], layers: Mapping[str, LayerState], budgeted: bool
) -> Choice | None:
    """The overhead budget's saved choice in a preconditioner's ``state`` (``None``: none
    saved, or no budget in the preconditioner loading it: ``budgeted`` false).

    Raises:
        ValueError: If the saved entry is not a choice for ``layers``.
    """
    saved = state.get("budget")
    if saved is None or not budgeted:
        return None
    try:
        choice = Choice(**saved)
    except TypeError as err:
        raise ValueError(f"'budget' is not an overhead budget's choice: {err}") from None
    limits = choice.basis_max_dims
    if not isinstance(limits, dict) or not all(
        name in layers and type(limit) is int and limit >= 1 for name, limit in limits.items()
    ):
        raise ValueError(
            "'budget' basis_max_dims must map this model's layer names to integers >= 1, "
            f"got {limits!r}"
        )
    return choice
