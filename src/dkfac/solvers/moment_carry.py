"""The moments in the Kronecker eigenbasis carried across a refresh of the basis.

A refresh replaces the bases ``Q → Q'``; the running moments of the rotated gradient (of
:class:`~dkfac.solvers.eigen_moments.EigenMomentsSolver`) were taken in the old one. With
``P_G = Q_G'ᵀ Q_G`` and ``P_A = Q_A'ᵀ Q_A``, the ``carry`` option chooses:

* ``"reset"``: ``m = v = 0``, ``t = 0`` (the bias correction starts again);
* ``"keep_v"``: ``m ← P_G m P_Aᵀ``, computed as ``Q_G'ᵀ (Q_G m Q_Aᵀ) Q_A'`` (exact:
  ``Q_G' m' Q_A'ᵀ = Q_G m Q_Aᵀ``; no ``n³`` product for ``P``), ``v`` kept as it
  is (SOAP's choice);
* ``"rotate"``: ``m`` as above, ``v ← (P_G∘P_G) v (P_A∘P_A)ᵀ`` (the diagonal second moment
  carried to the new basis, its off-diagonal part dropped).

It runs on every rank that preconditions the layer, with the same inputs, so the copies stay
identical. A refresh that leaves the basis bit-identical (a failed decomposition keeps the
last good one) carries nothing, selected on the device: the bases are never read on the
host. Measured on digits: with a refresh every 1–2 steps ``"keep_v"`` wins; every 5–10 steps
``"reset"`` does. The layers of one shape are carried as one stack (:func:`stack_bases`,
:func:`changed_layers`): every function here takes a leading layer dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import SolverState
from dkfac.solvers.rotations import change_basis, rotate, side_block, transition

__all__ = [
    "basis_changed",
    "basis_key",
    "carried",
    "changed_layers",
    "stack_bases",
    "unchanged",
]


def carried(
    carry: str,
    old: SolverState,
    new: SolverState,
    moments: SolverState,
    zero: Callable[[Tensor], SolverState],
) -> SolverState:
    """The moments carried from the basis ``old`` to ``new`` by ``carry``
    (:data:`~dkfac.solvers.moment_options.MomentCarry`, module notes);
    ``zero(v)``: zero moments of ``v``'s shape (``"reset"``)."""
    if carry == "reset":
        return zero(moments["v"])
    result = dict(moments)
    if "m" in moments:  # through the weight space: 2(g²a + ga²) flops, not a³ + g³ more
        weights = change_basis(moments["m"], old, None, out=True)
        result["m"] = change_basis(weights, new, None)
    if carry == "rotate":
        dtype = moments["v"].dtype
        p_g = transition(new["qg"].to(dtype), old["qg"].to(dtype))
        p_a = transition(new["qa"].to(dtype), old["qa"].to(dtype))
        result["v"] = rotate(moments["v"], p_g * p_g, (p_a * p_a).mT)
    return result


def unchanged(old: SolverState | None, new: SolverState) -> bool:
    """Whether the refresh kept the very basis tensors (nothing to carry), or there was no
    basis before."""
    return old is None or all(old[k] is new[k] for k in ("qa", "qg"))


def basis_changed(old: SolverState, new: SolverState) -> Tensor:
    """Whether either basis of one layer changed its values (bases of equal shapes): a 0-d
    device tensor, never read on the host."""
    changed = (old["qa"] != new["qa"]).any()
    return changed.logical_or_((old["qg"] != new["qg"]).any())


def changed_layers(old: SolverState, new: SolverState) -> Tensor:
    """:func:`basis_changed` of each layer of stacked bases (:func:`stack_bases`)."""
    changed = (old["qa"] != new["qa"]).flatten(1).any(1)
    return changed.logical_or_((old["qg"] != new["qg"]).flatten(1).any(1))


def basis_key(old: SolverState, new: SolverState) -> tuple[Any, ...] | None:
    """What layers carried as one stack must share of their bases: each side's shape, dtype
    and blocks before and after; ``None`` for a layer carried alone (a structured input
    basis, or a side whose shape or dtype the refresh changed)."""
    if "qa_order" in old or "qa_order" in new:
        return None
    key: list[Hashable] = []
    for side in ("qa", "qg"):
        if old[side].shape != new[side].shape or old[side].dtype != new[side].dtype:
            return None
        key.append((tuple(old[side].shape), old[side].dtype, side_block(old, side)))
        key.append(side_block(new, side))
    return tuple(key)


def stack_bases(states: Sequence[SolverState]) -> SolverState:
    """The bases of layers of equal :func:`basis_key` stacked, with their block markers."""
    stacked = {k: torch.stack([s[k] for s in states]) for k in ("qa", "qg")}
    return {**stacked, **{k: v for k, v in states[0].items() if k.endswith("_block")}}
