"""The Kronecker eigenbasis of the eigenbasis-moment solvers, and its refresh.

:class:`EigenBasisSolver` is what EKFAC and eigen-Adam
(:class:`~dkfac.solvers.eigen_moments.EigenMomentsSolver`) keep of a layer's factors: the
eigenbases of ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` (the columns in descending order
of eigenvalue after an ``eigh``; a power step keeps each column in its place) and their
eigenvalue estimates, as the state ``qa, da, qg, dg``; how a refresh
computes them; and the null indicators of a singular factor, which Adam's rounding floor
reads (:mod:`~dkfac.solvers.null_space`). The moments in the basis, the update and the
carrying of the moments across a refresh are :mod:`dkfac.solvers.eigen_moments`'.

**Basis refresh** (at the inverse interval, on the layer's owner): ``"eigh"`` eigendecomposes
both factors; ``"power"`` follows the previous basis with one step of subspace iteration,
``Q ← qr(F Q_prev)`` (column signs fixed so that ``diag R > 0``, so a converged basis is a
fixed point), eigenvalue estimates the new columns' Rayleigh quotients ``diag(Qᵀ F Q)`` in
the QR's column order (SOAP's update estimates ``diag(Q_prevᵀ F Q_prev)``, which misses the
null space of a factor of low rank whose range moved:
:func:`~dkfac.solvers.basis_refresh.power_refresh`; the null columns are then moved last by
:func:`~dkfac.solvers.null_space.canonical_null_basis`). The first
refresh, or one without a fitting previous state, is a full ``eigh``, except that a factor
at least ``RANGE_MIN_DIM`` wide first tries :func:`range_eigh` (exact when its rank is at
most a quarter of its width, as a factor from a subsample of a wide layer's batch is).
``power_rank = k`` makes the power step follow only the leading ``k`` eigenvectors of a
wider factor and complete them with an orthonormal basis of the rest (unrelated to the
previous one, so it needs the ``"reset"`` or ``"rotate"`` carry: a kept ``v`` would
scale other directions): about a third of the refresh of a 1000-wide factor at
``k = 256``, for the same steps on the digits autoencoder.

**Structured input side** (``input_map``): the input basis is the Kronecker-structured one
of :mod:`dkfac.solvers.kron_basis`, and the state also holds its parts (``qa_channels``,
``qa_positions``, ``qa_order``), through which every rotation by ``Q_A`` runs
(:func:`~dkfac.solvers.rotations.times_input_basis`; a state without them rotates by the
dense ``qa``).

**One-sided** (``max_dim``): a factor wider than ``max_dim`` keeps the identity as its basis
(stored as an empty ``q``/``d`` pair, and never decomposed): the layer's moments live in the
eigenbasis of its other factor only, ``R = Q_Gᵀ ∇W`` for a wide input side (SOAP's
``max_precond_dim``). A layer with both factors wider is Adam (or its EKFAC analogue) on the
raw gradient. Nothing reads such a factor but its width, so it is captured and kept as its
diagonal only (:class:`~dkfac.solvers.statistics.DiagonalStatistic`: ``d`` products a row
instead of ``d²``, and a ``(d,)`` vector accumulated, averaged, combined over ranks and
saved instead of a ``d × d`` matrix); the refresh reads its length.

**Block-diagonal basis** (``block_size``): a factor wider than ``block_size`` (and not
one-sided) gets the basis of its block-diagonal part: its dimension is cut into
consecutive blocks of ``block_size`` (the last one shorter) and each block's basis is
that of the factor's diagonal block (a power step from the previous basis's block, or an
``eigh``), the others zero. The basis is stored whole (``n × n``, for strategies and
checkpoints) with an empty ``(0, block_size)`` tensor beside it (``qa_block``/``qg_block``:
the width is in the shape, so a rotation reads it without waiting for a device), and
every product with it runs block by block (:func:`~dkfac.solvers.rotations.times_blocks`);
the factor itself is captured and kept as its diagonal blocks only
(:class:`~dkfac.solvers.statistics.BlockDiagonalStatistic`: a ``(k, b, b)`` tensor, which
the refresh reads as :class:`~dkfac.solvers.block_layout.DiagonalBlocks`; a dense factor,
as :meth:`EigenBasisSolver.compute` may be given, has its blocks cut out). For a side of
``n = k·b`` that is ``1/k`` of the flops of the capture and the rotations, and of the
factor's memory and traffic, and ``1/k²`` of the refresh's decompositions (Distributed
Shampoo's blocking of a wide
dimension, here of one Kronecker side); ``power_rank`` applies to each block. A power step
follows the previous basis only where it has the same blocks (``_previous_basis``: the
diagonal blocks of a dense basis, from a checkpoint without the option, are not
orthogonal); elsewhere each block gets an ``eigh``. It drops the correlations between
blocks, so it suits a side whose units have no order, such as a transformer MLP's hidden
units.

**Batched refresh** (:meth:`EigenBasisSolver.compute_batch`): the dense decompositions
of the layers of one set of options, whole sides and diagonal blocks, of any layer and either
side, run as one stack a width and kind (one product and QR for the power steps, one ``eigh``,
and one null-space completion). A layer whose decomposition fails is refreshed alone, the
others keeping their results (:meth:`~dkfac.solvers.base.Solver.batch_once`).

The refresh reads nothing on the host once a layer has a state, where the engine asks so
(:attr:`~dkfac.solvers.base.Solver.host_checks` off: it checks the new state on the device),
the null spaces included (:mod:`~dkfac.solvers.null_space`): whether a layer has null
indicators is then decided from its earlier states (:meth:`EigenBasisSolver.completed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from dkfac.solvers.base import Solver, SolverError, SolverState
from dkfac.solvers.basis_refresh import (
    RANGE_MIN_DIM,
    descending_eigh,
    power_refresh,
    range_eigh,
)
from dkfac.solvers.block_layout import DiagonalBlocks, block_bounds
from dkfac.solvers.host_copy import HostFlag, host_reads_now
from dkfac.solvers.kron_basis import check_input_map, structured_basis
from dkfac.solvers.moment_options import MomentOptions
from dkfac.solvers.null_space import any_null, canonical_null_basis, null_masks
from dkfac.solvers.rotations import side_block
from dkfac.solvers.stacking import stacked_calls
from dkfac.solvers.statistics import BlockDiagonalStatistic, DiagonalStatistic, StatisticKind

__all__ = ["EigenBasisSolver"]


class EigenBasisSolver(Solver):
    """The basis part of the eigenbasis-moment solvers: state ``qa, da, qg, dg``
    (descending order after an ``eigh``, each column in its place after a power step),
    refreshed by ``eigh`` or a power step (module notes), and the null
    indicators of its singular factors (:meth:`completed`).

    Args:
        compute_dtype: Precision of the decompositions.
        options: The moment hyperparameters (defaults: :class:`MomentOptions`); the basis
            reads ``basis_refresh``, ``power_rank``, ``max_dim``, ``block_size`` and
            ``rounding_floor``.
        input_map: ``(channels, positions)`` of the flattened map the layer reads: its input
            factor then gets the Kronecker-structured basis of
            :mod:`dkfac.solvers.kron_basis`, recomputed at every refresh (no power step, and
            never one-sided); ``None`` (default): a dense basis.
    """

    def __init__(
        self,
        compute_dtype: torch.dtype = torch.float32,
        options: MomentOptions | None = None,
        input_map: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(compute_dtype)
        if options is not None and not isinstance(options, MomentOptions):
            raise TypeError(f"options must be MomentOptions, got {type(options).__name__}")
        self.options = options or MomentOptions()
        self.input_map = None if input_map is None else check_input_map(input_map)
        self._floored: bool | None = None  # whether states get null indicators (completed)
        self._pending: Callable[[], bool] | None = None  # the flag on its way (completed)

    def statistics(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, StatisticKind]:
        """Dense, except a side with a block-diagonal basis: only its diagonal blocks are
        computed (:class:`~dkfac.solvers.statistics.BlockDiagonalStatistic`); and a
        one-sided side (wider than ``max_dim``), whose factor nothing reads but its width:
        only its diagonal, kept as a ``(d,)`` vector
        (:class:`~dkfac.solvers.statistics.DiagonalStatistic`)."""
        kinds = super().statistics(shapes)
        for key in ("A", "G"):
            if key not in shapes:
                continue
            size, input_side = shapes[key][0], key == "A"
            if self._one_sided(size, input_side):
                kinds[key] = DiagonalStatistic()
            elif (width := self._block_width(size, input_side)) is not None:
                kinds[key] = BlockDiagonalStatistic(width)
        return kinds

    def _one_sided(self, size: int, input_side: bool) -> bool:
        """Whether a side of dimension ``size`` keeps the identity basis (wider than
        ``max_dim``; never the structured input side, whose basis has its own build)."""
        max_dim = self.options.max_dim
        if max_dim is None or size <= max_dim:
            return False
        return not (input_side and self.input_map is not None)

    def _block_width(self, size: int, input_side: bool) -> int | None:
        """The block width of a side of dimension ``size``: ``block_size`` where it is wider
        and neither one-sided (wider than ``max_dim``) nor the structured input side
        (``input_map``); ``None`` where its basis is dense."""
        block = self.options.block_size
        if block is None or size <= block or self._one_sided(size, input_side):
            return None
        return None if input_side and self.input_map is not None else block

    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Eigendecomposes both factors (descending order; ``damping`` is used at apply)."""
        return self.compute_statistics({"A": a, "G": g}, damping)

    def compute_statistics(
        self, stats: Mapping[str, Any], damping: float, previous: SolverState | None = None
    ) -> SolverState:
        """The new basis: ``eigh``, or one power step from ``previous`` (see the module notes)."""
        return self.with_retry(lambda dtype: self._states([stats], [previous], dtype)[0])

    def _states(
        self,
        stats: Sequence[Mapping[str, Any]],
        previous: Sequence[SolverState | None],
        dtype: torch.dtype,
    ) -> list[SolverState]:
        """The new states of several layers in ``dtype`` (stored in their factors' dtype),
        the dense decompositions of one size and kind, of any layer and either side, as one
        stack (:meth:`_sides`); a structured input side is built layer by layer."""
        requests: list[tuple[Any, Tensor | None]] = []
        for one, before in zip(stats, previous, strict=True):
            if self.input_map is None:
                requests.append((one["A"], self._previous_basis(before, "qa")))
            requests.append((one["G"], self._previous_basis(before, "qg")))
        sides = iter(self._sides(requests, dtype))
        states = []
        for one in stats:
            a, g = one["A"], one["G"]
            parts: SolverState = {}
            if self.input_map is not None:
                basis = structured_basis(a, self.input_map, dtype, self.host_checks)
                da, qa = basis.estimates, basis.dense
                parts = {"qa_channels": basis.channels, "qa_positions": basis.positions}
            else:
                da, qa = next(sides)
            dg, qg = next(sides)
            pairs = {"qa": qa, "da": da, "qg": qg, "dg": dg, **parts}
            for key, factor in (("qa", a), ("qg", g)):
                width = self._block_width(factor.shape[0], key == "qa")
                if width is not None:
                    pairs[f"{key}_block"] = torch.empty(
                        0, width, dtype=factor.dtype, device=factor.device
                    )
            state = {key: value.to(a.dtype) for key, value in pairs.items()}
            if self.input_map is not None:
                state["qa_order"] = basis.order  # int64 indices, whatever the storage
            states.append(state)
        return states

    def refresh_key(
        self, stats: Mapping[str, Any], previous: SolverState | None
    ) -> Hashable | None:
        """The class, the options, the compute dtype and the factors' dtypes and device:
        equal keys share :meth:`compute_batch`; ``None`` (the layer alone) for the
        structured input side."""
        del previous
        a, g = stats["A"], stats["G"]
        dense = (Tensor, DiagonalBlocks)
        if self.input_map is not None or not (isinstance(a, dense) and isinstance(g, dense)):
            return None
        return (type(self), self.options, self.compute_dtype, a.dtype, g.dtype, a.device)

    def compute_batch(
        self,
        stats: Sequence[Mapping[str, Any]],
        damping: float,
        previous: Sequence[SolverState | None],
    ) -> list[SolverState | SolverError]:
        """:meth:`compute_statistics` of every layer of one :meth:`refresh_key`, the dense
        decompositions of one size and kind (power steps, ``eigh``; whole sides and blocks
        of any layer, either side) as one batched call and one null-space completion; a
        layer whose state fails is refreshed alone, the others keeping theirs
        (:meth:`~dkfac.solvers.base.Solver.batch_once`)."""
        if len(stats) == 1:
            return super().compute_batch(stats, damping, previous)
        return self.batch_once(
            lambda dtype: self._states(stats, previous, dtype),
            lambda i: self.compute_statistics(stats[i], damping, previous[i]),
            len(stats),
        )

    def shared(self, state: SolverState) -> SolverState:
        """The state without its null indicators (each rank derives them: :meth:`completed`)."""
        return {k: v for k, v in state.items() if not k.startswith("null_")}

    def completed(self, state: SolverState, *, late: bool = False) -> SolverState:
        """The state with the null indicators Adam's rounding floor reads, derived from the
        exact zeros :func:`~dkfac.solvers.null_space.canonical_null_basis` leaves in its
        values (none without a floor). Whether the layer has them is decided on the host:
        without ``late``, or on a device whose reads wait for nothing
        (:data:`~dkfac.solvers.host_copy.HOST_COUNT_DEVICES`), from this state (one read:
        are both sides regular?);
        with ``late`` (a refresh) on another device from the layer's earlier states, so
        that a refresh reads nothing: once a state of the layer was singular, every later
        one has them (zero where nothing is singular, which moves no value), and a layer
        whose factors become singular gets them from the refresh after the one that showed
        it (its flag copied to the host meanwhile:
        :class:`~dkfac.solvers.host_copy.HostFlag`). So on a CPU a layer whose factors
        became regular loses its indicators, and its steps skip the floor's five passes."""
        if not (self.adam_scaled and self.options.rounding_floor) or "null_g" in state:
            return state
        masks = null_masks(state["dg"], None if "qa_order" in state else state["da"])
        reads_now = host_reads_now(state["dg"])
        if not late or self._floored is None or reads_now:
            self._floored, self._pending = bool(any_null(masks)), None
        elif not self._floored and self._pending is not None:
            self._floored = self._pending()
        if self._floored:
            return {**state, **masks}
        if not reads_now:  # the flag for the next refresh, which reads it without waiting
            self._pending = HostFlag(any_null(masks)).read
        return state

    def complete_key(self, state: SolverState) -> Hashable | None:
        """For a state that gets null indicators: the class, the options and the values'
        shapes, dtype and device; else ``None``."""
        if not (self.adam_scaled and self.options.rounding_floor) or "null_g" in state:
            return None
        da = None if "qa_order" in state else tuple(state["da"].shape)
        dg = state["dg"]
        return (type(self), self.options, tuple(dg.shape), da, dg.dtype, dg.device)

    def completed_batch(
        self, solvers: Sequence[Solver], states: Sequence[SolverState], *, late: bool = False
    ) -> list[SolverState]:
        """:meth:`completed` of several layers of equal :meth:`complete_key` (each on its own
        solver, whose rule it follows) on their stacked values: one pass for the masks, one
        read for the layers that decide now and one host copy for those that decide at a
        later refresh."""
        if len(states) == 1:
            return [solvers[0].completed(states[0], late=late)]
        structured = "qa_order" in states[0]
        dg = torch.stack([state["dg"] for state in states])
        da = None if structured else torch.stack([state["da"] for state in states])
        masks = null_masks(dg, da)
        flags = any_null(masks)
        mine = [cast(EigenBasisSolver, solver) for solver in solvers]
        reads_now = host_reads_now(dg)
        now = [not late or solver._floored is None or reads_now for solver in mine]
        values = flags.tolist() if any(now) else []
        parts = {key: value.unbind(0) for key, value in masks.items()}
        copy: HostFlag | None = None
        results = []
        for i, (solver, state) in enumerate(zip(mine, states, strict=True)):
            if now[i]:
                solver._floored, solver._pending = bool(values[i]), None
            elif not solver._floored and solver._pending is not None:
                solver._floored = solver._pending()
            if solver._floored:
                results.append({**state, **{key: part[i] for key, part in parts.items()}})
                continue
            if not reads_now:
                copy = copy or HostFlag(flags)
                solver._pending = functools.partial(copy.read, i)
            results.append(state)
        return results

    def _previous_basis(self, previous: SolverState | None, key: str) -> Tensor | None:
        """The basis ``previous[key]`` that a power step may follow: ``None`` where its
        blocks (:func:`side_block`) differ from the ones this solver builds for that side (a
        dense basis under ``block_size``, or other blocks: a checkpoint of other options),
        whose diagonal blocks would not be orthogonal; each block then gets a full ``eigh``.
        """
        if previous is None or key not in previous:
            return None
        basis = previous[key]
        if side_block(previous, key) != self._block_width(basis.shape[0], key == "qa"):
            return None
        return basis

    def _sides(
        self, requests: Sequence[tuple[Any, Tensor | None]], dtype: torch.dtype
    ) -> list[tuple[Tensor, Tensor]]:
        """``(d, Q)`` of each ``(factor, previous basis)`` (never the structured input side,
        which has its own basis): the identity (empty pair) when wider than ``max_dim``; a
        block-diagonal basis of :meth:`_dense_side` per block when wider than
        ``block_size``; else :meth:`_dense_side` of the whole factor. The dense parts (whole
        sides and blocks) of one size and kind (:meth:`_dense_kind`) are decomposed as one
        stack (:func:`~dkfac.solvers.stacking.stacked_calls`)."""
        jobs: list[tuple[Tensor, Tensor | None]] = []
        spans: list[tuple[int, int, bool] | None] = []  # jobs of each request; blocks?
        for factor, previous in requests:
            size = factor.shape[0]
            if self._one_sided(size, input_side=False):
                spans.append(None)
                continue
            width = self._block_width(size, input_side=False)
            start = len(jobs)
            if width is None:
                jobs.append((factor, previous))
            else:
                if previous is not None and previous.shape != factor.shape:
                    previous = None
                bounds = block_bounds(size, width)
                for (i, j), part in zip(bounds, _blocks(factor, bounds), strict=True):
                    old = None if previous is None else previous[i:j, i:j]
                    jobs.append((part, old))
            spans.append((start, len(jobs), width is not None))
        checked = self.host_checks

        def run(key: tuple[str, int, torch.dtype] | None, *inputs: Tensor) -> tuple[Tensor, Tensor]:
            if key is None:  # alone: as _dense_side takes it
                return self._dense_side(inputs[0], inputs[1] if len(inputs) > 1 else None, dtype)
            if key[0] == "power":
                found = power_refresh(inputs[0], inputs[1], dtype)
            else:
                found = descending_eigh(inputs[0], dtype, checked)
            return canonical_null_basis(*found, key[2], check=checked)

        kinds = [self._dense_kind(f, p) for f, p in jobs]
        found = stacked_calls(
            [
                (kind, (f,) if p is None or (kind is not None and kind[0] == "eigh") else (f, p))
                for kind, (f, p) in zip(kinds, jobs, strict=True)
            ],
            run,
        )
        sides = []
        for (factor, _), span in zip(requests, spans, strict=True):
            if span is None:
                where = {"dtype": dtype, "device": factor.device}
                sides.append((torch.zeros(0, **where), torch.zeros(0, 0, **where)))
            elif not span[2]:
                sides.append((found[span[0]][0], found[span[0]][1]))
            else:
                parts = found[span[0] : span[1]]
                sides.append(
                    (torch.cat([d for d, _ in parts]), torch.block_diag(*(q for _, q in parts)))
                )
        return sides

    def _dense_kind(
        self, factor: Tensor, previous: Tensor | None
    ) -> tuple[str, int, torch.dtype] | None:
        """What :meth:`_dense_side` runs on ``factor`` where a stack can run it too:
        ``("power", n, dtype)`` (a full power step), ``("eigh", n, dtype)``; ``None`` for a
        power step of ``power_rank`` columns and the first decomposition of a wide factor
        (:func:`range_eigh`), which run alone."""
        size = factor.shape[0]
        if self.options.basis_refresh == "power" and previous is not None:
            if previous.shape == factor.shape:
                rank = self.options.power_rank
                return ("power", size, factor.dtype) if rank is None or rank >= size else None
        elif previous is None and size >= RANGE_MIN_DIM:
            return None
        return ("eigh", size, factor.dtype)

    def _dense_side(
        self, factor: Tensor, previous: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """``(d, Q)`` of a factor with a dense basis: one power step from a fitting
        ``previous`` basis, or a full ``eigh`` (the first decomposition of a wide factor of
        low rank: :func:`range_eigh`)."""
        power = self.options.basis_refresh == "power"
        found: tuple[Tensor, Tensor] | None = None
        if power and previous is not None and previous.shape == factor.shape:
            found = power_refresh(factor, previous, dtype, self.options.power_rank)
        elif previous is None and factor.shape[0] >= RANGE_MIN_DIM:
            # The first decomposition of a wide factor: often from fewer rows than n / 4.
            found = range_eigh(factor, dtype, factor.shape[0] // 4)
        checked = self.host_checks
        values, basis = found if found is not None else descending_eigh(factor, dtype, checked)
        return canonical_null_basis(values, basis, factor.dtype, check=checked)


def _blocks(factor: Tensor | DiagonalBlocks, bounds: Sequence[tuple[int, int]]) -> list[Tensor]:
    """The diagonal blocks of ``bounds`` of a factor: those it keeps where it is
    :class:`~dkfac.solvers.block_layout.DiagonalBlocks` of those bounds, else cut out of its
    dense matrix (a dense factor, or blocks of another width)."""
    if isinstance(factor, DiagonalBlocks):
        if block_bounds(factor.size, factor.block) == list(bounds):
            return factor.parts()
        factor = factor.dense()
    return [factor[i:j, i:j] for i, j in bounds]
