"""The moments of several layer groups of one eigenbasis-moment solver in one flat pass.

:meth:`~dkfac.solvers.eigen_moments.EigenMomentsSolver.apply_batch` preconditions the
layers of one shape together; a network has several shapes (ResNet-20: nine), and each
group's moment update and scaling is a dozen or two elementwise passes, each one launch on
a GPU. Elementwise work does not care about shapes: here the rotated gradients of every
group are laid end to end in one flat vector, and the moments of every layer are held the
same way, so each elementwise pass of :meth:`~EigenMomentsSolver.update_moments` and
:meth:`~EigenMomentsSolver.scaled` runs once for all layers. Only the rotations into and
out of each basis stay per group (batched products of one shape). Where the update is
orthogonalised (a polar factor without a split), the groups' scaled updates then take
their polar factors together (:meth:`~EigenMomentsSolver.orthogonalised_all`: one
zero-padded iteration for the small ones, :mod:`dkfac.solvers.padded_polar`), before each
group's rotation out.

The count ``t`` is per layer; its bias corrections are taken per element from ``t``
repeated to each layer's entries (an index made once for a composition of groups, on the
device, from no host data). So is Adam's rounding floor of the layers with a singular factor
(:mod:`~dkfac.solvers.null_space`): each layer's ``‖√v‖_F`` is one multi-tensor norm of
the flat ``v``'s slices, repeated to its entries, and its null coordinates are a flat vector
of weights (0 for a layer without null directions) built when the states change, i.e. at a
refresh. Each layer's result is the same elementwise formula on the same numbers as in its
group's own pass: the updates and moments are equal bit for bit on a CPU (an
orthogonalised update to the rounding of its padded products; a GPU's multi-tensor norm
may sum a layer in another order than its own norm, a rounding apart).

Each layer's new moments are views of the flat vectors (the moments are never changed in
place, so the views are never written through); when the next call is handed exactly those
views, it reads the flat vectors again instead of concatenating them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor

from dkfac.solvers.base import BatchJob, SolverState, select_moments
from dkfac.solvers.null_space import null_weights
from dkfac.solvers.precision import moment_dtype
from dkfac.solvers.rotations import change_basis, dense_side
from dkfac.solvers.stacking import same_tensors

__all__ = ["FlatMoments", "LayerIndex", "MomentSolver"]


class LayerIndex(NamedTuple):
    """The layers of a flat vector: ``entries``, the layer of each entry (int64, on the
    device), and ``sizes``, each layer's number of entries, in order."""

    entries: Tensor
    sizes: tuple[int, ...]


class MomentSolver(Protocol):
    """What the flat pass reads of an eigenbasis-moment solver
    (:class:`~dkfac.solvers.eigen_moments.EigenMomentsSolver`)."""

    keys: ClassVar[tuple[str, ...]]

    def rotation_dtypes(self, grad: Tensor) -> tuple[torch.dtype | None, torch.dtype | None]:
        """The precisions of the rotations into and out of the basis."""
        ...

    def rotation_states(
        self, state: SolverState, into: torch.dtype | None, out: torch.dtype | None
    ) -> tuple[SolverState, SolverState]:
        """The state for each rotation."""
        ...

    def stacked_states(self, states: Sequence[SolverState]) -> SolverState:
        """The states stacked, kept between refreshes."""
        ...

    def zero_moments_like(self, grad: Tensor) -> SolverState:
        """Zero moments of a layer."""
        ...

    @property
    def orthogonalises(self) -> bool:
        """Whether the update in the basis takes a polar factor."""
        ...

    def orthogonalised_all(self, scaled: Sequence[Tensor]) -> list[Tensor]:
        """Each update in the basis after the polar factor, where the options take one."""
        ...

    def moment_step(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        index: LayerIndex | None = None,
        *,
        null: Tensor | None = None,
    ) -> tuple[SolverState, Tensor]:
        """The moments after a rotated gradient and the update in the basis."""
        ...


_NullKey = tuple[tuple[torch.Size, ...], list[tuple[Tensor | None, Tensor | None]]]
"""The groups' shapes and null indicators that :meth:`FlatMoments._null_weights` was built for."""


class _Last(NamedTuple):
    flat: SolverState  # the moment keys flat (N,), "t" per layer
    slices: list[SolverState]  # each layer's views of them, as handed out


class FlatMoments:
    """One solver's flat pass over groups of layers (module notes), with the last flat
    moments and layer index kept for the next call."""

    def __init__(self) -> None:
        self._last: _Last | None = None
        self._index: LayerIndex | None = None
        self._null: tuple[_NullKey, Tensor | None] | None = None

    def apply(
        self,
        solver: MomentSolver,
        groups: Sequence[BatchJob],
        damping: float,
        advance: Tensor | None,
    ) -> list[list[tuple[Tensor, SolverState | None]]]:
        """Each group's ``[(update, moments)]`` per layer, as its own
        :meth:`~EigenMomentsSolver.apply_batch` would give (module notes).

        Args:
            solver: The solver whose formulas run (the groups' solvers share its options).
            groups: Layer groups of one ``fuse_key``; each group's own solver keeps its
                stacked states and cast bases.
            damping: The damping.
            advance: As :meth:`~dkfac.solvers.base.Solver.apply_batch` says.
        """
        first = groups[0].grads[0]
        work = moment_dtype(first.dtype)
        rotated: list[Tensor] = []
        outs: list[tuple[torch.dtype | None, SolverState]] = []
        states: list[SolverState] = []
        for job in groups:
            own: MomentSolver = job.solver  # type: ignore[assignment]
            many = len(job.grads) > 1
            grad = torch.stack(list(job.grads)) if many else job.grads[0]
            state = own.stacked_states(job.states) if many else job.states[0]
            states.append(state)
            into, out = own.rotation_dtypes(job.grads[0])  # out: by shape when orthogonalised
            state_in, state_out = own.rotation_states(state, into, out)
            rotated.append(change_basis(grad.to(work), state_in, into))
            outs.append((out, state_out))
        sizes = tuple(len(job.grads) * job.grads[0].numel() for job in groups)
        layers = tuple(n for job in groups for n in [job.grads[0].numel()] * len(job.grads))
        flat_r = torch.cat([r.reshape(-1) for r in rotated])
        given = [m for job in groups for m in job.moments]
        old = self._stacked(solver, given, groups, work)
        index = self._layer_index(layers, flat_r.device)
        null = self._null_weights(states, [r.shape for r in rotated])
        new, scaled = solver.moment_step(old, flat_r, damping, index, null=null)
        polar = solver.orthogonalises  # per group, below
        out = outs[0][0]
        one_cast = not polar and all(o == out and dense_side(st) for o, st in outs)
        if out is not None and one_cast:
            scaled = scaled.to(out)  # what each group's rotation out casts its part to
        if advance is not None:
            new = select_moments(advance, new, old)  # type: ignore[assignment]
        results: list[list[tuple[Tensor, SolverState | None]]] = []
        counts = [len(job.grads) for job in groups]
        views = {
            key: _layer_views(value, groups, sizes) for key, value in new.items() if key != "t"
        }
        each_t = new["t"].split(1)  # each layer's count, one call for all
        starts = [sum(counts[:g]) for g in range(len(counts))]
        views["t"] = [each_t[start : start + n] for start, n in zip(starts, counts, strict=True)]
        slices: list[SolverState] = []
        in_basis = [
            part.view(r.shape) for part, r in zip(scaled.split(sizes), rotated, strict=True)
        ]
        if polar:  # every group's polar factor in one padded iteration where small
            in_basis = solver.orthogonalised_all(in_basis)
        for g, job in enumerate(groups):
            group_out, state_out = outs[g]
            update = change_basis(in_basis[g], state_out, group_out, out=True).to(first.dtype)
            mine = [{key: views[key][g][i] for key in new} for i in range(len(job.grads))]
            slices += mine
            updates = update.unbind(0) if len(job.grads) > 1 else [update]
            results.append(list(zip(updates, mine, strict=True)))
        self._last = _Last(new, slices)
        return results

    def _stacked(
        self,
        solver: MomentSolver,
        given: Sequence[SolverState | None],
        groups: Sequence[BatchJob],
        work: torch.dtype,
    ) -> SolverState:
        """The layers' moments flat: the last call's flat vectors when ``given`` are
        exactly its views, else concatenated (zero moments where a layer has none)."""
        last = self._last
        if last is not None and same_tensors(given, last.slices):
            return last.flat
        grads = [grad for job in groups for grad in job.grads]
        present = [
            m if m is not None else solver.zero_moments_like(grad)
            for m, grad in zip(given, grads, strict=True)
        ]
        flat = {
            key: torch.cat([m[key].to(work).reshape(-1) for m in present]) for key in solver.keys
        }
        flat["t"] = torch.cat([m["t"].reshape(-1) for m in present])
        return flat

    def _layer_index(self, layers: tuple[int, ...], device: torch.device) -> LayerIndex:
        """The layer of each flat entry (``layers`` holds each layer's entries), made on
        the device once for a composition."""
        last = self._index
        if last is not None and last.sizes == layers and last.entries.device == device:
            return last
        parts = [
            torch.full((n,), i, dtype=torch.int64, device=device) for i, n in enumerate(layers)
        ]
        self._index = LayerIndex(torch.cat(parts), layers)
        return self._index

    def _null_weights(
        self, states: Sequence[SolverState], shapes: Sequence[torch.Size]
    ) -> Tensor | None:
        """Each group's :func:`~dkfac.solvers.null_space.null_weights` (its rotated
        gradient's ``shapes``; zeros for a group without null directions) flat, in the
        indicators' precision; ``None`` where no group has any. Kept while the groups have
        the same shapes and their states hold the very same indicator tensors (they are
        replaced at a refresh, never changed in place)."""
        present = [(state.get("null_g"), state.get("null_a")) for state in states]
        last = self._null
        if (
            last is not None
            and last[0][0] == tuple(shapes)
            and len(last[0][1]) == len(present)
            and all(
                a is b
                for old, now in zip(last[0][1], present, strict=True)
                for a, b in zip(old, now, strict=True)
            )
        ):
            return last[1]
        weights = [null_weights(state) for state in states]
        found = [w for w in weights if w is not None]
        flat: Tensor | None = None
        if found:
            dtype = found[0].dtype
            for w in found[1:]:
                dtype = torch.promote_types(dtype, w.dtype)
            flat = torch.cat(
                [
                    found[0].new_zeros(math.prod(shape), dtype=dtype)
                    if w is None
                    else w.to(dtype).expand(shape).reshape(-1)
                    for w, shape in zip(weights, shapes, strict=True)
                ]
            )
        self._null = ((tuple(shapes), present), flat)
        return flat


def _layer_views(
    flat: Tensor, groups: Sequence[BatchJob], sizes: tuple[int, ...]
) -> list[Sequence[Tensor]]:
    """Per group, each layer's view of a flat moment vector."""
    views: list[Sequence[Tensor]] = []
    for job, part in zip(groups, flat.split(sizes), strict=True):
        shape = job.grads[0].shape
        views.append(
            part.view(len(job.grads), *shape).unbind(0)
            if len(job.grads) > 1
            else [part.view(shape)]
        )
    return views
