"""Moments of the gradient in the Kronecker eigenbasis: EKFAC and eigen-Adam.

With ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` (the columns in descending order of
eigenvalue), the rotated gradient is ``R = Q_Gᵀ ∇W Q_A``. Instead of ``λ_G λ_Aᵀ`` (the
``"eigen"`` solver), running moments of ``R`` scale it, one per entry, kept between steps on
every rank that preconditions the layer (:meth:`Solver.apply_with_moments`). ``t`` counts the
moment updates since the moments started.

``"eigen_adam"`` (Adam in K-FAC's eigenbasis; what SOAP does with Shampoo's bases)::

    m ← β₁ m + (1−β₁) R        v ← β₂ v + (1−β₂) R∘R        t ← t + 1
    m̂ = m / (1−β₁ᵗ)            v̂ = v / (1−β₂ᵗ)               (bias correction; off: m̂ = m, v̂ = v)
    Nesterov: m̂ = (β₁ m + (1−β₁) R) / (1−β₁ᵗ⁺¹)
    V = Q_G [m̂ ⊘ (√v̂ + ε + φ)] Q_Aᵀ

where a factor is singular its null space gets a canonical basis, and ``φ``, a floor at the
rounding level of the rotated gradient, is added in the null directions only (0 elsewhere;
:mod:`~dkfac.solvers.null_space`): without them Adam's per-coordinate normalisation turns
rounding, and an arbitrary choice of basis, into whole steps (a batch and the same batch
accumulated in two halves ended 1e-2 apart after 8 steps, where AdamW's end 4e-6 apart).

The damping is not used (``ε`` plays its part). Run it under an inner SGD without momentum
whose learning rate is the step size; the inner SGD's ``weight_decay`` then acts on ``V``
plus the weights, i.e. it is AdamW's decoupled decay (``W ← W − lr·(V + wd·W)``).

``"ekfac"`` (eigenvalue-corrected K-FAC, George et al. 2018)::

    v ← β₂ v + (1−β₂) R∘R      t ← t + 1      v̂ = v / (1−β₂ᵗ)   (or v̂ = v)
    V = Q_G [R ⊘ (v̂ + λ)] Q_Aᵀ

George et al. take ``v`` from the per-sample gradients; the engine captures ``A`` and ``G``,
not per-sample gradients, so ``v`` here is the second moment of the mini-batch gradient
(smaller than the per-sample one, by up to the batch size when the gradient is noise).

**Basis refresh** (at the inverse interval, on the layer's owner): ``"eigh"`` eigendecomposes
both factors; ``"power"`` follows the previous basis with one step of subspace iteration,
``Q ← qr(F Q_prev)`` (column signs fixed so that ``diag R > 0``, so a converged basis is a
fixed point), eigenvalue estimates ``diag(Q_prevᵀ F Q_prev)`` (SOAP's update). The first
refresh, or one without a fitting previous state, is a full ``eigh``, except that a factor
at least ``RANGE_MIN_DIM`` wide first tries :func:`range_eigh` (exact when its rank is at
most a quarter of its width, as a factor from a subsample of a wide layer's batch is).
``power_rank = k`` makes the power step follow only the leading ``k`` eigenvectors of a
wider factor and complete them with an orthonormal basis of the rest (unrelated to the
previous one, so it needs the ``"reset"`` or ``"rotate"`` carry: a kept ``v`` would
scale other directions): about a third of the refresh of a 1000-wide factor at
``k = 256``, for the same steps on the digits autoencoder.

**Carrying the moments across a refresh** (``Q → Q'``; on every rank that preconditions the
layer, :meth:`Solver.carry_moments`), with ``P_G = Q_G'ᵀ Q_G`` and ``P_A = Q_A'ᵀ Q_A``:

* ``"reset"``: ``m = v = 0``, ``t = 0`` (the bias correction starts again);
* ``"keep_v"``: ``m ← P_G m P_Aᵀ``, computed as ``Q_G'ᵀ (Q_G m Q_Aᵀ) Q_A'`` (exact:
  ``Q_G' m' Q_A'ᵀ = Q_G m Q_Aᵀ``; no ``n³`` product for ``P``), ``v`` kept as it
  is (SOAP's choice);
* ``"rotate"``: ``m`` as above, ``v ← (P_G∘P_G) v (P_A∘P_A)ᵀ`` (the diagonal second moment
  carried to the new basis, its off-diagonal part dropped).

**Structured input side** (``input_map``): the input basis is the Kronecker-structured one
of :mod:`dkfac.solvers.kron_basis`, and the state also holds its parts (``qa_channels``,
``qa_positions``, ``qa_order``), through which every rotation by ``Q_A`` runs
(:func:`times_input_basis`; a state without them rotates by the dense ``qa``).

**One-sided** (``max_dim``): a factor wider than ``max_dim`` keeps the identity as its basis
(stored as an empty ``q``/``d`` pair, and never decomposed): the layer's moments live in the
eigenbasis of its other factor only, ``R = Q_Gᵀ ∇W`` for a wide input side (SOAP's
``max_precond_dim``). A layer with both factors wider is Adam (or its EKFAC analogue) on the
raw gradient. Nothing reads such a factor but its width, so it is captured as its diagonal
only (:class:`~dkfac.solvers.statistics.BlockDiagonalStatistic` of blocks of 1: ``d``
products a row instead of ``d²``), still kept, combined and saved as a ``d × d`` statistic.

**Block-diagonal basis** (``block_size``): a factor wider than ``block_size`` (and not
one-sided) gets the basis of its block-diagonal part: its dimension is cut into
consecutive blocks of ``block_size`` (the last one shorter) and each block's basis is
that of the factor's diagonal block (a power step from the previous basis's block, or an
``eigh``), the others zero. The basis is stored whole (``n × n``, for strategies and
checkpoints) with an empty ``(0, block_size)`` tensor beside it (``qa_block``/``qg_block``:
the width is in the shape, so a rotation reads it without waiting for a device), and
every product with it runs block by block (:func:`times_blocks`); the factor itself is
captured as its diagonal blocks only (:class:`~dkfac.solvers.statistics.BlockDiagonalStatistic`).
For a side of ``n = k·b`` that is ``1/k`` of the flops of the capture and the rotations and
``1/k²`` of the refresh's decompositions (Distributed Shampoo's blocking of a wide
dimension, here of one Kronecker side); ``power_rank`` applies to each block. A power step
follows the previous basis only where it has the same blocks (``_previous_basis``: the
diagonal blocks of a dense basis, from a checkpoint without the option, are not
orthogonal); elsewhere each block gets an ``eigh``. It drops the correlations between
blocks, so it suits a side whose units have no order, such as a transformer MLP's hidden
units.

**Rotation precision** (``rotation_dtype``): the rotation of the update out of the basis,
``V = Q_G S Q_Aᵀ``, may run in a lower precision than the gradient, e.g. ``torch.bfloat16``
(inputs cast to it, the result cast back): half the per-step cost of these solvers
(``2(g²a + ga²)`` of the ``4(g²a + ga²)`` flops), 2-3x faster on CPUs with bf16 matrix
instructions and on GPUs, for an error of about 1% of ``V``'s size (bf16 keeps 8
significant bits; Muon's whole update has that precision). The rotation *into* the basis
and the carry of ``m`` keep the moments' precision: ``m̂ ⊘ √v̂`` divides by the scale of each
entry, so an error of 1% of the gradient's size becomes a large error in the entries whose
``v`` is small (measured: bf16 there made updates 10⁴ times too large after a carry).
``gradient_rotation_dtype`` lowers the rotation *into* the basis too, and is allowed only
with ``carry="reset"``: then every ``m`` and ``v`` since the last refresh come from gradients
rotated with the same rounding, and each entry of the step stays bounded whatever the
rounding (by Cauchy–Schwarz, ``|m̂| / √v̂`` by a constant of β₁ and β₂; EKFAC's
``|r| / (v̂ + λ)`` by ``1 / (2√((1−β₂)λ))``): the error changes which small entries move,
not how far. Which ones is then decided by the rounding: Adam moves every entry by up to
about the learning rate whatever its size, so the entries whose rotated gradient lies below
the rounding of the products take their sign from it (on a small test CNN, three steps with
a float32 rotation of float64 gradients differ from exact ones by up to half of the
movement; a distributed run matches a serial one only to the rounding, as the all-reduce
sums in another order). Measured on the digits autoencoder and the language model: the same
loss per step, 5-15% less time a step, on a CPU with
bf16 instructions; where bf16 is emulated it costs many times float32 (section 24). The
engine's options take ``"auto"`` as well (:mod:`dkfac.solvers.precision`): bf16 where the
layer's device multiplies it natively, the default precision elsewhere; it reaches this
solver resolved, as a dtype or ``None``.

**Orthogonalised update** (``orthogonal_rms``): the update ``V`` (of the whole parameter
matrix, the bias as its last column) is replaced by ``rms · √max(g, a) · O(V)``, ``O`` the
orthogonal polar factor by Muon's Newton–Schulz iteration (:mod:`dkfac.solvers.polar`):
every singular value of the step set to one, an RMS entry of ``rms`` per unit of learning
rate. Orthogonalising the raw momentum is Muon; here the singular vectors are those of the
preconditioned ``V``, which K-FAC's eigenbasis and Adam's second moment there have turned.
The moments are those of ``"eigen_adam"`` / ``"ekfac"`` unchanged. Meant for a transformer's
hidden layers (the engine's ``orthogonal_layers`` picks them; Muon's convention leaves the
embeddings and the head out). ``orthogonal_steps``
sets the Newton–Schulz steps (default 5, Muon's): the preconditioned update's spectrum is
flatter than a raw momentum's, and three steps (a softer polar factor,
:mod:`dkfac.solvers.polar`) took the autoencoder to its target in the same steps as five.
``orthogonal_split`` ``S`` moves a share of the scaling behind the polar factor: with
``V = m̂ ⊘ D`` (``D = √v̂ + ε`` for eigen_adam, ``v̂ + λ`` for EKFAC), the update becomes
``D^-S ⊙ O(D^(S-1) ⊙ m̂)`` (:func:`dkfac.solvers.polar.weighted_polar`), rescaled to RMS
``rms``, so that the second moment still shapes the step after the polar factor has
flattened its singular values (eigen_adam forms both factors from ``√v`` and ``m`` with
its bias corrections folded into one constant per matrix:
:meth:`~dkfac.solvers.eigen_adam.EigenAdamSolver.split_parts`). ``S = 0`` is the plain
polar factor of ``V``;
``S = 1/2`` takes the momentum's polar factor between two halves of Adam's scale, ``W ⊙
O(W ⊙ m̂)`` with ``W = D^-1/2`` (the steepest-descent direction under the spectral norm
weighted by ``D^1/2`` where ``D`` is a product of a row and a column weight). On the
language model ``S = 0.5`` was 0.05–0.09 nats lower than ``S = 0`` at 50, 75 and 125 steps,
level at 100.
The polar factor is taken in the basis and then rotated out: ``O(Q_G S Q_Aᵀ) = Q_G O(S)
Q_Aᵀ`` for orthogonal bases (block-diagonal, one-sided and structured ones included; the
Newton–Schulz iteration commutes with them exactly, as the SVD does), and the rotation out
of a matrix whose singular values are all about one runs in a low precision at no loss
(its entries are that close to the iteration's anyway): bfloat16 where the device
multiplies bf16 natively, float32 where it does not, float64 for float64
(:func:`~dkfac.solvers.precision.low_precision`; ``rotation_dtype`` when set). On a CPU
bf16 is taken only for a layer whose rotation products reach
:data:`~dkfac.solvers.precision.CPU_BF16_MIN_WORK` multiply-adds (``g · a · max(g, a)``),
as the iteration only for a smaller side of 128 (:func:`~dkfac.solvers.polar.polar_dtype`):
on small products bf16 is slower there. The order used to be the other one, with the
rotation out in the gradient's precision (float32 products cost about 2.2x bf16 ones on
the AVX512-BF16 benchmark CPU).

**Moment precision**: the moments and the arithmetic on them are float32 at least: a
float16 or bfloat16 gradient is cast to float32 before its rotation (which then runs in
float32, or in ``gradient_rotation_dtype``), and only the update is cast back. In float16 a
gradient's square underflows below 6e-8 (any entry under 2.4e-4), and ``m̂ ⊘ (√v̂ + ε)``
over a flushed ``v`` is ``m̂ / ε``: a step of thousands; in bfloat16 ``v``'s running average
would keep 8 significant bits. A float32 or float64 gradient is unchanged by this.

**Batched apply** (:meth:`EigenMomentsSolver.apply_batch`): the layers of one shape and
one set of options (a transformer's query, key, value and output projections) are
preconditioned in one pass over stacked tensors: the rotations, the moments and the
Newton–Schulz steps of ``L`` layers as ``L``-batched products and elementwise passes,
instead of ``L`` passes of small calls. Each layer's result is its own (the same formulas
on its own slice; the batched products may round in another order than single ones, which
on this CPU they do not at the shapes measured); the engine groups the layers by
:meth:`EigenMomentsSolver.batch_key`. A structured input side is applied layer by layer.
On a launch-bound device the groups of one set of options (all shapes) go further: their
moments and scaling run as one flat elementwise pass (:meth:`EigenMomentsSolver.apply_groups`,
:mod:`dkfac.solvers.flat_moments`), the same values bit for bit. The products with the
bases are in :mod:`dkfac.solvers.rotations`.

**Batched refresh** (:meth:`EigenMomentsSolver.compute_batch`): the dense decompositions
of the layers of one set of options, whole sides and diagonal blocks, of any layer and either
side, run as one stack a width and kind (one product and QR for the power steps, one ``eigh``,
and one null-space completion), and the moments of the layers of one shape are carried as one
stack (:meth:`EigenMomentsSolver.carry_batch`). A layer whose decomposition fails is refreshed
alone, the others keeping their results (:meth:`~dkfac.solvers.base.Solver.batch_once`).

A refresh that leaves the basis bit-identical (a failed decomposition keeps the last good
one) carries nothing (selected on the device: the bases are never read on the host). The
refresh itself reads nothing on the host once a layer has a state, where the engine asks
so (:attr:`~dkfac.solvers.base.Solver.host_checks` off: it checks the new state on the
device), the null spaces included (:mod:`~dkfac.solvers.null_space`). Measured on
digits: with a refresh every 1–2 steps ``"keep_v"`` (the default) wins; every 5–10 steps
``"reset"`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from dkfac.solvers.base import BatchJob, Solver, SolverError, SolverState, select_moments
from dkfac.solvers.basis_refresh import (
    RANGE_MIN_DIM,
    descending_eigh,
    power_refresh,
    range_eigh,
)
from dkfac.solvers.compiled import Compiled
from dkfac.solvers.flat_moments import FlatMoments, LayerIndex
from dkfac.solvers.host_copy import HostFlag
from dkfac.solvers.kron_basis import check_input_map, structured_basis
from dkfac.solvers.moment_options import (
    BASIS_REFRESHES,
    MOMENT_CARRIES,
    BasisRefresh,
    MomentCarry,
    MomentOptions,
    check_moment_combinations,
)
from dkfac.solvers.null_space import (
    any_null,
    canonical_null_basis,
    null_masks,
    null_weights,
)
from dkfac.solvers.polar import (
    NS_STEPS,
    orthogonal_update,
    weighted_polar,
)
from dkfac.solvers.precision import low_precision, moment_dtype
from dkfac.solvers.rotations import (
    bases,
    change_basis,
    lowered_bases,
    rotate,
    side_block,
    times_blocks,
    times_input_basis,
    transition,
    with_transposes,
)
from dkfac.solvers.stacking import StateStack, same_tensors, stack_key, stacked_calls
from dkfac.solvers.statistics import BlockDiagonalStatistic, StatisticKind, block_bounds

__all__ = [
    "BASIS_REFRESHES",
    "HOST_COUNT_DEVICES",
    "MOMENT_CARRIES",
    "BasisRefresh",
    "EigenMomentsSolver",
    "MomentCarry",
    "MomentOptions",
    "change_basis",
    "check_moment_combinations",
    "lowered_bases",
    "power_refresh",
    "range_eigh",
    "rotate",
    "side_block",
    "times_blocks",
    "times_input_basis",
]

_Rotations = tuple[torch.dtype | None, SolverState, SolverState, SolverState]
"""``(out, the bases, state in, state out)``: :meth:`EigenMomentsSolver.rotation_states`'s last."""

HOST_COUNT_DEVICES = frozenset({"cpu"})
"""Device types where a read waits for nothing: a layer's moment count is read there as a
number for its bias corrections (:meth:`EigenMomentsSolver.correction`), and a refresh's
null indicators are decided from its own state (:meth:`EigenMomentsSolver.completed`)."""


class EigenMomentsSolver(Solver):
    """Shared part of :class:`~dkfac.solvers.eigen_adam.EigenAdamSolver` and
    :class:`~dkfac.solvers.ekfac.EKFACSolver`: the basis, its
    refresh and the carrying of the moments. State ``qa, da, qg, dg`` (descending order).

    Args:
        compute_dtype: Precision of the decompositions.
        options: The moment hyperparameters (defaults: :class:`MomentOptions`).
        input_map: ``(channels, positions)`` of the flattened map the layer reads: its input
            factor then gets the Kronecker-structured basis of
            :mod:`dkfac.solvers.kron_basis`, recomputed at every refresh (no power step, and
            never one-sided); ``None`` (default): a dense basis.
    """

    stateful = True
    keys: ClassVar[tuple[str, ...]] = ("v",)
    """The moment matrices the solver keeps (besides the count ``t``)."""

    def __init__(
        self,
        compute_dtype: torch.dtype = torch.float32,
        options: MomentOptions | None = None,
        input_map: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(compute_dtype)
        self._last_batch: tuple[SolverState, list[SolverState]] | None = None
        self._state_stack = StateStack()
        self._last_lowered: _Rotations | None = None
        self._flat = FlatMoments()
        self._floored: bool | None = None  # whether states get null indicators (completed)
        self._pending: Callable[[], bool] | None = None  # the flag on its way (completed)
        if options is not None and not isinstance(options, MomentOptions):
            raise TypeError(f"options must be MomentOptions, got {type(options).__name__}")
        self.options = options or MomentOptions()
        self._moment_step = Compiled(self._eager_moment_step, self.options.compile_backend)
        self.input_map = None if input_map is None else check_input_map(input_map)

    @property
    def label(self) -> str:
        """The method, the input map of a structured input basis, an orthogonalised update."""
        notes = []
        if self.input_map is not None:
            notes.append(f"A basis {self.input_map[0]}x{self.input_map[1]}")
        if self.options.orthogonal_rms is not None:
            steps = self.options.orthogonal_steps
            shown = "" if steps == NS_STEPS else f", {steps} steps"
            if self.options.orthogonal_split:
                shown += f", split {self.options.orthogonal_split:g}"
            notes.append(f"orthogonal, rms {self.options.orthogonal_rms:g}{shown}")
        return f"{self.name} ({', '.join(notes)})" if notes else self.name

    @classmethod
    def moment_elements(cls, a_dim: int, g_dim: int) -> int:
        """Each moment matrix (``g_dim × a_dim``) and the count ``t``."""
        return len(cls.keys) * a_dim * g_dim + 1

    def statistics(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, StatisticKind]:
        """Dense, except a side with a block-diagonal basis: only its diagonal blocks are
        computed (:class:`~dkfac.solvers.statistics.BlockDiagonalStatistic`); and a
        one-sided side (wider than ``max_dim``), whose factor nothing reads but its width:
        only its diagonal (blocks of 1, ``d`` products a row instead of ``d²``)."""
        kinds = super().statistics(shapes)
        for key in ("A", "G"):
            if key not in shapes:
                continue
            size, input_side = shapes[key][0], key == "A"
            if self._one_sided(size, input_side):
                kinds[key] = BlockDiagonalStatistic(1)
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
        requests: list[tuple[Tensor, Tensor | None]] = []
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
                    pairs[f"{key}_block"] = factor.new_empty(0, width)
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
        if self.input_map is not None or not (isinstance(a, Tensor) and isinstance(g, Tensor)):
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
        (:data:`HOST_COUNT_DEVICES`), from this state (one read: are both sides regular?);
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
        reads_now = _reads_now(state["dg"])
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
        mine = [cast(EigenMomentsSolver, solver) for solver in solvers]
        reads_now = _reads_now(dg)
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
        self, requests: Sequence[tuple[Tensor, Tensor | None]], dtype: torch.dtype
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
                for i, j in block_bounds(size, width):
                    old = None if previous is None else previous[i:j, i:j]
                    jobs.append((factor[i:j, i:j], old))
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
                empty = factor.new_zeros(0, dtype=dtype), factor.new_zeros(0, 0, dtype=dtype)
                sides.append(empty)
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

    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """The update from fresh moments (:meth:`apply_with_moments` with none)."""
        return self.apply_with_moments(state, None, grad, damping)[0]

    def apply_with_moments(
        self, state: SolverState, moments: SolverState | None, grad: Tensor, damping: float
    ) -> tuple[Tensor, SolverState]:
        """``(V, moments after this gradient)``; ``None`` moments start from zero.

        Every tensor may carry a leading layer dimension (a stack of layers of one shape:
        :meth:`apply_batch`); each layer's slice is its own result. A half-precision
        gradient is worked on in float32 (module notes) and its update returned in its own
        dtype."""
        work = moment_dtype(grad.dtype)  # the moments' precision
        rms = self.options.orthogonal_rms
        into, out = self.rotation_dtypes(grad)
        state, state_out = self.rotation_states(state, into, out)
        rotated = change_basis(grad.to(work), state, into)
        if moments is None:
            moments = self.zero_moments(rotated)
        steps, split = self.options.orthogonal_steps, self.options.orthogonal_split
        null = null_weights(state)
        if rms is None:
            new, scaled = self.moment_step(moments, rotated, damping, null=null)
        elif split:  # in the basis, then out (module notes)
            new = self.update_moments(moments, rotated)
            ratio, weight = self.split_parts(new, rotated, damping, split, null=null)
            scaled = weighted_polar(ratio, weight, rms, steps)
        else:
            new = self.update_moments(moments, rotated)
            scaled = orthogonal_update(self.scaled(new, rotated, damping, null=null), rms, steps)
        update = change_basis(scaled, state_out, out, out=True)
        return update.to(grad.dtype), new

    def moment_step(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        index: LayerIndex | None = None,
        *,
        null: Tensor | None = None,
    ) -> tuple[SolverState, Tensor]:
        """``(moments after rotated, the update in the basis)``: :meth:`update_moments` and
        :meth:`scaled`, through ``torch.compile`` where ``compile_backend`` is set
        (:mod:`dkfac.solvers.compiled`). ``index``: for flat moments
        (:mod:`dkfac.solvers.flat_moments`), the layer of each entry, whose count ``t``
        (one a layer) and rounding floor the scaling reads per entry. ``null``: as
        :meth:`scaled` takes it (flat too with ``index``)."""
        return self._moment_step(moments, rotated, damping, index, null)

    def _eager_moment_step(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        index: LayerIndex | None,
        null: Tensor | None,
    ) -> tuple[SolverState, Tensor]:
        """:meth:`moment_step` itself."""
        new = self.update_moments(moments, rotated)
        if index is None:
            return new, self.scaled(new, rotated, damping, null=null)
        counts = {**new, "t": new["t"].index_select(0, index.entries)}
        return new, self.scaled(counts, rotated, damping, null=null, layers=index)

    def rotation_dtypes(self, grad: Tensor) -> tuple[torch.dtype | None, torch.dtype | None]:
        """The precisions of the rotations into and out of the basis for ``grad`` (``None``:
        the moments'; the polar factor goes out in its own precision)."""
        into, out = self.options.gradient_rotation_dtype, self.options.rotation_dtype
        if self.options.orthogonal_rms is not None and out is None:
            g, a = grad.shape[-2:]
            out = low_precision(grad.device, moment_dtype(grad.dtype), g * a * max(g, a))
        return into, out

    def rotation_states(
        self, state: SolverState, into: torch.dtype | None, out: torch.dtype | None
    ) -> tuple[SolverState, SolverState]:
        """``state`` for the rotation into and out of the basis: with a lowered rotation out,
        its dense bases cast to ``out`` (once for both rotations where ``into`` is the
        same), with their transposes as views (:func:`~dkfac.solvers.rotations.with_transposes`),
        and kept for the next call while the state holds the same bases (states are
        replaced at a refresh, never changed in place): no cast or transpose of a basis a
        step."""
        last = self._last_lowered
        if last is not None and last[0] == out and same_tensors([last[1]], [bases(state)]):
            return last[2], last[3]
        lowered = state if out is None else lowered_bases(state, out)
        state_in = with_transposes(lowered if into == out else state)
        state_out = with_transposes(lowered)
        self._last_lowered = (out, bases(state), state_in, state_out)
        return state_in, state_out

    def batch_key(self, state: SolverState, grad: Tensor) -> tuple[Any, ...] | None:
        """The class, the options, the gradient's shape, dtype and device and every state
        tensor's name, shape and dtype: equal keys may share :meth:`apply_batch`; ``None``
        for a structured input side (applied layer by layer)."""
        if "qa_order" in state or grad.dim() != 2:
            return None
        return (type(self), self.options, *stack_key(state, grad))

    def apply_batch(
        self,
        states: Sequence[SolverState],
        moments: Sequence[SolverState | None],
        grads: Sequence[Tensor],
        damping: float,
        *,
        advance: Tensor | None = None,
    ) -> list[tuple[Tensor, SolverState | None]]:
        """:meth:`apply_with_moments` of several layers of equal :meth:`batch_key` in one
        pass over stacked tensors (module notes); each layer's update and moments are
        slices of the stacked results. Moments that are exactly the slices this solver
        returned last time are read from that stack instead of being stacked again, and so
        are states that are exactly the last call's (between two refreshes). When the
        states are stacked anew, each dict in ``states`` gets its tensors replaced by its
        slices of the stack (the same values): the group's bases are then held once, in
        the stack, and the next call is handed the very same tensors. ``advance``: as
        :meth:`~dkfac.solvers.base.Solver.apply_batch` says, selected once on the stack."""
        if len(states) == 1:
            return super().apply_batch(states, moments, grads, damping, advance=advance)
        grad = torch.stack(list(grads))
        state = self.stacked_states(states)
        stacked = self._restacked(moments)
        if stacked is None:
            stacked = self.stack_moments(moments, grads)
        update, new = self.apply_with_moments(state, stacked, grad, damping)
        if advance is not None:
            new = select_moments(advance, new, stacked)  # type: ignore[assignment]
        parts = {key: value.unbind(0) for key, value in new.items()}  # one call a key
        slices = [{key: part[i] for key, part in parts.items()} for i in range(len(grads))]
        self._last_batch = (new, slices)
        return list(zip(update.unbind(0), slices, strict=True))

    def fuse_key(self, state: SolverState, grad: Tensor) -> Hashable | None:
        """The class, the options and the gradient's dtype and device, for a state and
        gradient that :meth:`batch_key` batches and an update that is not orthogonalised
        (the polar factor is per matrix); else ``None``. A layer floored in a null space
        (:mod:`~dkfac.solvers.null_space`) joins too: the flat pass takes its floor per
        layer."""
        if self.options.orthogonal_rms is not None or self.batch_key(state, grad) is None:
            return None
        return (type(self), self.options, grad.dtype, grad.device)

    def apply_groups(
        self, groups: Sequence[BatchJob], damping: float, *, advance: Tensor | None = None
    ) -> list[list[tuple[Tensor, SolverState | None]]]:
        """The groups' elementwise work as one flat pass (:mod:`dkfac.solvers.flat_moments`);
        the same values as each group's :meth:`apply_batch`."""
        if len(groups) == 1:
            return super().apply_groups(groups, damping, advance=advance)
        return self._flat.apply(self, groups, damping, advance)

    def stacked_states(self, states: Sequence[SolverState]) -> SolverState:
        """The states of a batch stacked key by key, kept between refreshes
        (:class:`~dkfac.solvers.stacking.StateStack`)."""
        return self._state_stack.stacked(states)

    def stack_moments(
        self, moments: Sequence[SolverState | None], likes: Sequence[Tensor]
    ) -> SolverState:
        """The layers' moments stacked key by key, zero moments of ``likes[i]``'s shape
        where ``moments[i]`` is ``None`` (the input :meth:`apply_with_moments` takes for a
        stack)."""
        present = [
            m if m is not None else self.zero_moments(like)
            for m, like in zip(moments, likes, strict=True)
        ]
        return {key: torch.stack([m[key] for m in present]) for key in present[0]}

    def _restacked(self, moments: Sequence[SolverState | None]) -> SolverState | None:
        """The stack of :meth:`apply_batch`'s last moments when ``moments`` are exactly its
        slices, in order (the moments are never changed in place); else ``None``."""
        last = self._last_batch
        return last[0] if last is not None and same_tensors(moments, last[1]) else None

    def zero_moments_like(self, grad: Tensor) -> SolverState:
        """Zero moments of a layer with gradient ``grad``, in the moments' precision."""
        work = moment_dtype(grad.dtype)
        return self.zero_moments(torch.empty(grad.shape, dtype=work, device=grad.device))

    def zero_moments(self, like: Tensor) -> SolverState:
        """Zero moments of the shape of ``like`` and ``t = 0``."""
        zeros = {key: torch.zeros_like(like) for key in self.keys}
        count = torch.zeros((*like.shape[:-2], 1), dtype=torch.float64, device=like.device)
        return {**zeros, "t": count}

    def update_moments(self, moments: SolverState, rotated: Tensor) -> SolverState:
        """The moments after the rotated gradient ``rotated`` (new tensors; the old kept)."""
        beta2 = self.options.beta2
        return {
            "v": (moments["v"].to(rotated.dtype) * beta2).addcmul_(
                rotated, rotated, value=1.0 - beta2
            ),
            "t": moments["t"] + 1.0,
        }

    def correction(
        self, beta: float, t: Tensor, like: Tensor, ahead: float = 0.0
    ) -> Tensor | float:
        """``1 − β^(t + ahead)`` in ``like``'s dtype, shaped to broadcast over ``like`` (``t``
        is ``(1,)``, or ``(L, 1)`` for a stack of layers; 1 without bias correction).

        Counts on a CPU (:data:`HOST_COUNT_DEVICES`) that are all the same (one layer's, or a
        stack's that started together) give a Python number: reading them there waits for
        nothing, and the scalar arithmetic of the scaling is then host arithmetic, not a
        dozen dispatched operations on one-entry tensors a group a step (a GPU, counts that
        differ, the flat moments' counts per entry and a compiled step keep it on the
        device)."""
        if not self.options.bias_correction:
            return 1.0
        per_layer = t.shape != like.shape  # else one count per entry (flat moments)
        if per_layer and _reads_now(t) and not torch.compiler.is_compiling():
            if t.numel() == 1:
                return 1.0 - beta ** (float(t) + ahead)
            counts = t.tolist() if t.dim() == 2 else []  # (L, 1): a count a layer of a stack
            if counts and all(count == counts[0] for count in counts):
                return 1.0 - beta ** (counts[0][0] + ahead)
        t = t + ahead if ahead else t
        t = t[..., None] if per_layer else t
        return (1.0 - torch.pow(beta, t)).to(like.dtype)

    def scaled(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        *,
        null: Tensor | None = None,
        layers: LayerIndex | None = None,
    ) -> Tensor:
        """The update in the eigenbasis (each method's formula); ``null``: 1.0 on the
        coordinates in a factor's null space (:func:`~dkfac.solvers.null_space.null_weights`),
        read by Adam's rounding floor; ``layers``: the layers of flat moments (the floor is
        then each layer's, :func:`~dkfac.solvers.null_space.flat_rounding_floor`)."""
        raise NotImplementedError

    def denominator(self, moments: SolverState, damping: float) -> Tensor:
        """``D``, the entries :meth:`scaled` divides by (a new tensor; each method's)."""
        raise NotImplementedError

    def split_parts(
        self,
        moments: SolverState,
        rotated: Tensor,
        damping: float,
        split: float,
        *,
        null: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(V ⊘ W, W)`` with ``W = D^-S`` (``S = split``), the inputs of
        :func:`~dkfac.solvers.polar.weighted_polar` for ``orthogonal_split``, each matrix's
        values up to a positive scale of its own (which ``weighted_polar`` drops)."""
        weight = self.denominator(moments, damping).pow_(-split)
        return self.scaled(moments, rotated, damping, null=null) / weight, weight

    def carry_moments(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> SolverState:
        """The moments in the basis ``new`` after a refresh from ``old`` (module notes): kept
        where the bases are equal, selected on the device (no host read of the bases)."""
        if old is None or all(old[k] is new[k] for k in ("qa", "qg")):
            return moments
        carried = self._carried(old, new, moments)
        if any(old[k].shape != new[k].shape for k in ("qa", "qg")):
            return carried
        changed = (old["qa"] != new["qa"]).any().logical_or_((old["qg"] != new["qg"]).any())
        return select_moments(changed, carried, moments)  # type: ignore[return-value]

    def carry_key(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> Hashable | None:
        """For bases that changed (not the very tensors), dense, blocked or one-sided alike
        and of the same shapes before and after: the class, the options, the bases'
        shapes, dtypes and blocks and the moments' shapes and dtypes; else ``None``."""
        if old is None or all(old[k] is new[k] for k in ("qa", "qg")):
            return None
        if "qa_order" in old or "qa_order" in new:
            return None
        bases: list[Any] = []
        for key in ("qa", "qg"):
            if old[key].shape != new[key].shape or old[key].dtype != new[key].dtype:
                return None
            bases.append((tuple(old[key].shape), old[key].dtype, side_block(old, key)))
            bases.append(side_block(new, key))
        held = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in moments.items())
        return (type(self), self.options, tuple(bases), held)

    def carry_batch(
        self,
        olds: Sequence[SolverState],
        news: Sequence[SolverState],
        moments: Sequence[SolverState],
    ) -> list[SolverState | None]:
        """:meth:`carry_moments` of several layers of equal :meth:`carry_key` as one pass over
        their stacked bases and moments (the moments read from :meth:`apply_batch`'s last
        stack where they are its slices); each layer's moments are slices of the result,
        which the next :meth:`apply_batch` reads as its last stack."""
        if len(olds) == 1:
            return super().carry_batch(olds, news, moments)
        old, new = (
            {
                **{k: torch.stack([s[k] for s in states]) for k in ("qa", "qg")},
                **{k: v for k, v in states[0].items() if k.endswith("_block")},
            }
            for states in (olds, news)
        )
        stacked = self._restacked(moments) or {
            k: torch.stack([m[k] for m in moments]) for k in moments[0]
        }
        changed = (old["qa"] != new["qa"]).flatten(1).any(1)
        changed.logical_or_((old["qg"] != new["qg"]).flatten(1).any(1))
        carried = self._carried(old, new, stacked)
        chosen = {
            k: torch.where(changed.view(-1, *[1] * (v.dim() - 1)), v, stacked[k])
            for k, v in carried.items()
        }
        parts = {k: v.unbind(0) for k, v in chosen.items()}
        slices = [{k: part[i] for k, part in parts.items()} for i in range(len(olds))]
        self._last_batch = (chosen, slices)
        return list(slices)

    def _carried(self, old: SolverState, new: SolverState, moments: SolverState) -> SolverState:
        """The moments carried from the basis ``old`` to ``new`` (the ``carry`` option)."""
        if self.options.carry == "reset":
            return self.zero_moments(moments["v"])
        carried = dict(moments)
        if "m" in moments:  # through the weight space: 2(g²a + ga²) flops, not a³ + g³ more
            weights = change_basis(moments["m"], old, None, out=True)
            carried["m"] = change_basis(weights, new, None)
        if self.options.carry == "rotate":
            dtype = moments["v"].dtype
            p_g = transition(new["qg"].to(dtype), old["qg"].to(dtype))
            p_a = transition(new["qa"].to(dtype), old["qa"].to(dtype))
            carried["v"] = rotate(moments["v"], p_g * p_g, (p_a * p_a).mT)
        return carried


def _reads_now(tensor: Tensor) -> bool:
    """Whether a host read on ``tensor``'s device waits for nothing
    (:data:`HOST_COUNT_DEVICES`): moment counts are then read as numbers, and a refresh
    decides its null indicators from its own state."""
    return tensor.device.type in HOST_COUNT_DEVICES
