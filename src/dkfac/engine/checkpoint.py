"""World-size independent checkpoints of a :class:`~dkfac.KFACPreconditioner`.

Under ``"mem-opt"``, ``"kaisa"``, ``"dp"`` and ``"spngd"`` a rank keeps factors (and solver
states) only for the layers it owns. :func:`preconditioner_state` gathers every layer's
tensors from its owner (a collective: call it on every rank), so a checkpoint written by
rank 0 holds the whole model's state and loads at any world size and with any strategy;
:func:`load_preconditioner_state` keeps on each rank only what its strategy needs and lets
the owners recompute (and share) any solver state the checkpoint lacks.

Under ``"dp"`` each owner's factors come from its own local batches; the gathered
checkpoint holds those.

With ``method="smw"``/``"auto"`` each layer's entry also holds ``"plan"``: the solver and
the low-rank sides decided at the first capture (:mod:`dkfac.engine.lowrank_plan`), taken from the
owner. A low-rank side is saved as its ``U`` of shape ``(d, r)`` (``r`` varies with the
steps seen, up to the side's bounded rank), which ``load`` accepts in place of ``(d, d)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dkfac.config import resolve
from dkfac.engine.lowrank_plan import decision

if TYPE_CHECKING:
    from dkfac.preconditioner import KFACPreconditioner

__all__ = ["load_preconditioner_state", "preconditioner_state"]


def preconditioner_state(
    pre: KFACPreconditioner, *, include_inverses: bool, gather: bool
) -> dict[str, Any]:
    """The state dict of ``pre`` (see :meth:`KFACPreconditioner.state_dict`)."""
    devices = {name: layer.block.parameters()[0].device for name, layer in pre.layers.items()}
    running: dict[str, dict[str, Tensor] | None] = {
        name: dict(layer.running) or None for name, layer in pre.layers.items()
    }
    inverses: dict[str, dict[str, Tensor] | None] = {
        name: None if layer.solver_state is None else dict(layer.solver_state)
        for name, layer in pre.layers.items()
    }
    plans = {
        name: None if pre.lowrank is None else decision(layer) for name, layer in pre.layers.items()
    }
    if gather:
        running = pre.strategy.gather_to_all(running, devices)
        if include_inverses:
            inverses = pre.strategy.gather_to_all(inverses, devices)
        if pre.lowrank is not None:  # the owner's decision (under dp only owners decide)
            for part in pre.comm.exchange_objects(
                {n: p for n, p in plans.items() if pre.strategy.is_owner(n)}
            ):
                plans.update({n: p for n, p in part.items() if p is not None})
    layers: dict[str, dict[str, Any]] = {}
    for name, layer in pre.layers.items():
        held = running[name] or {}
        entry: dict[str, Any] = {key: held.get(key) for key in layer.statistic_shapes()}
        if plans[name] is not None:
            entry["plan"] = plans[name]
        if include_inverses and inverses[name] is not None:
            entry["inverse"] = inverses[name]
        layers[name] = entry
    generator = None if pre.capture.generator is None else pre.capture.generator.get_state()
    return {"step": pre.steps, "layers": layers, "mc_generator": generator}


def load_preconditioner_state(pre: KFACPreconditioner, state: dict[str, Any]) -> None:
    """Restores a state dict into ``pre`` (see :meth:`KFACPreconditioner.load_state_dict`)."""
    if not isinstance(state, dict) or "layers" not in state or "step" not in state:
        raise ValueError("not a KFACPreconditioner state dict (needs 'step' and 'layers')")
    saved, mine = set(state["layers"]), set(pre.layers)
    if saved != mine:
        raise ValueError(
            f"state dict layers do not match the model: missing {sorted(mine - saved)}, "
            f"unexpected {sorted(saved - mine)}"
        )
    for name, entry in state["layers"].items():
        layer = pre.layers[name]
        plan = entry.get("plan")
        if plan is not None and plan["lowrank"] and pre.lowrank is None:
            raise ValueError(
                f"{name}: the state dict holds a {plan['solver']!r} low-rank plan; load it into "
                "a preconditioner with method='smw' or 'auto'"
            )
        sides = {} if plan is None else dict(plan["lowrank"])
        for key, shape in layer.statistic_shapes().items():
            value = entry.get(key)
            if value is None:
                continue
            got = tuple(value.shape)
            if key in sides:  # U: (d, r) with 1 <= r <= the side's bounded rank
                if len(got) != 2 or got[0] != shape[0] or not 1 <= got[1] <= sides[key]:
                    raise ValueError(
                        f"{name}: saved low-rank {key} has shape {got}, expected "
                        f"({shape[0]}, r) with 1 <= r <= {sides[key]}"
                    )
            elif got != shape:
                raise ValueError(f"{name}: saved {key} has shape {got}, expected {shape}")
    for name, entry in state["layers"].items():
        layer = pre.layers[name]
        if entry.get("plan") is not None and pre.lowrank is not None:
            pre.lowrank.restore(layer, entry["plan"])
        device = layer.block.parameters()[0].device
        values = {key: entry.get(key) for key in layer.statistic_shapes()}
        keep = pre.strategy.keeps_statistics(name) and all(v is not None for v in values.values())
        layer.running = {k: v.to(device).clone() for k, v in values.items() if v is not None}
        if not keep:
            layer.running = {}
        inverse = entry.get("inverse")
        layer.solver_state = (
            None if inverse is None else {k: v.to(device) for k, v in inverse.items()}
        )
        layer.reset_accumulators()
    pre._steps = int(state["step"])
    if state.get("mc_generator") is not None:
        device = next(iter(pre.layers.values())).block.parameters()[0].device
        pre.capture.generator = torch.Generator(device=device)
        pre.capture.generator.set_state(state["mc_generator"])
    stale = [name for name, e in state["layers"].items() if e.get("inverse") is None]
    damping = resolve("damping", pre.config.damping, max(pre.steps - 1, 0))
    assert damping is not None
    # Owners recompute what was not saved; then every grad worker gets its owner's state.
    pre._update_inverses(damping, stale)
    pre.schedule_captures(pre.steps)
