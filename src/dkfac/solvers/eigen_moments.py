"""Moments of the gradient in the Kronecker eigenbasis: EKFAC and eigen-Adam.

With ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` (the columns in descending order of
eigenvalue after an ``eigh``, in place after a power step), the rotated gradient is ``R =
Q_Gᵀ ∇W Q_A``. Instead of ``λ_G λ_Aᵀ`` (the ``"eigen"`` solver), running moments of ``R``
scale it, one per entry, kept between steps on every rank that preconditions the layer
(:meth:`Solver.apply_with_moments`). ``t`` counts the moment updates since the moments
started.

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

**The basis** (:mod:`dkfac.solvers.eigen_basis`, this solver's base class): its refresh
(``"eigh"``, or one power step from the previous basis), the one-sided, block-diagonal and
Kronecker-structured sides, the batched refresh and the null indicators.

**Carrying the moments across a refresh** (``moment_carry``: reset, or the first moment
rotated into the new basis and the second kept or rotated too): :mod:`dkfac.solvers.moment_carry`;
the layers of one shape carry as one stack (:meth:`EigenMomentsSolver.carry_batch`).

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
bf16 instructions; where bf16 is emulated it costs many times float32. The
engine's options take ``"auto"`` as well (:mod:`dkfac.solvers.precision`): bf16 where the
layer's device multiplies it natively, the default precision elsewhere; it reaches this
solver resolved, as a dtype or ``None``.

**Orthogonalised update** (``orthogonal_rms``): the update ``V`` (of the whole parameter
matrix, the bias as its last column) is replaced by ``rms · √max(g, a) · O(V)``, ``O`` the
orthogonal polar factor by Muon's Newton–Schulz iteration (:mod:`dkfac.solvers.polar`):
every singular value of the step set to one, an RMS entry of ``rms`` per unit of learning
rate. Orthogonalising the raw momentum is Muon; here the singular vectors are those of the
preconditioned ``V``, which K-FAC's eigenbasis and Adam's second moment there have turned.
``orthogonal_rms_power`` ``p`` lets that length follow ``V``'s own RMS entry ``r``:
``rms^(1−p) · r^p`` (:func:`dkfac.solvers.polar.orthogonal_update`).
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
:mod:`dkfac.solvers.flat_moments`), the same values bit for bit, and an orthogonalised
update's polar factors (without a split) as one zero-padded batched iteration for the small
ones (:mod:`dkfac.solvers.padded_polar`), the same values to the rounding. The products
with the bases are in :mod:`dkfac.solvers.rotations`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dkfac.solvers.base import BatchJob, SolverState, select_moments, unstack
from dkfac.solvers.compiled import Compiled
from dkfac.solvers.eigen_basis import EigenBasisSolver
from dkfac.solvers.flat_moments import FlatMoments, LayerIndex
from dkfac.solvers.host_copy import host_reads_now
from dkfac.solvers.moment_carry import (
    basis_changed,
    basis_key,
    carried,
    changed_layers,
    stack_bases,
    unchanged,
)
from dkfac.solvers.moment_options import MomentOptions
from dkfac.solvers.null_space import null_weights
from dkfac.solvers.padded_polar import orthogonal_updates
from dkfac.solvers.polar import NS_STEPS, orthogonal_update, weighted_polar
from dkfac.solvers.precision import low_precision, moment_dtype
from dkfac.solvers.rotations import (
    bases,
    change_basis,
    lowered_bases,
    with_transposes,
)
from dkfac.solvers.stacking import StateStack, same_tensors, stack_key

__all__ = ["EigenMomentsSolver"]

logger = logging.getLogger(__name__)

_Rotations = tuple[torch.dtype | None, SolverState, SolverState, SolverState]
"""``(out, the bases, state in, state out)``: :meth:`EigenMomentsSolver.rotation_states`'s last."""


class EigenMomentsSolver(EigenBasisSolver):
    """Shared part of :class:`~dkfac.solvers.eigen_adam.EigenAdamSolver` and
    :class:`~dkfac.solvers.ekfac.EKFACSolver`: the moments in the basis of
    :class:`~dkfac.solvers.eigen_basis.EigenBasisSolver`, the update, and the carrying of
    the moments across a refresh. State ``qa, da, qg, dg``
    (:class:`~dkfac.solvers.eigen_basis.EigenBasisSolver`).

    Args:
        compute_dtype: Precision of the decompositions.
        options: The moment hyperparameters (defaults: :class:`MomentOptions`).
        input_map: ``(channels, positions)`` of the flattened map the layer reads (its
            Kronecker-structured input basis, :mod:`dkfac.solvers.eigen_basis`); ``None``
            (default): a dense basis.
    """

    stateful = True
    keys: ClassVar[tuple[str, ...]] = ("v",)
    """The moment matrices the solver keeps (besides the count ``t``)."""
    reads_damping: ClassVar[bool] = True
    """Whether the scaling reads the damping (EKFAC's ``v̂ + λ``; eigen_adam's ``ε`` stands
    in for it): a compiled update then holds it as a constant."""
    _damping_said: ClassVar[bool] = False

    def __init__(
        self,
        compute_dtype: torch.dtype = torch.float32,
        options: MomentOptions | None = None,
        input_map: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(compute_dtype, options, input_map)
        self._last_batch: tuple[SolverState, list[SolverState]] | None = None
        self._state_stack = StateStack()
        self._last_lowered: _Rotations | None = None
        self._flat = FlatMoments()
        self._moment_step = Compiled(self._eager_moment_step, self.options.compile_backend)
        self._update = Compiled(self._eager_update, self.options.step_compile_backend)
        self._damping: float | None = None  # the last damping a compiled update read

    def run_eagerly(self) -> bool:
        """The compiled update and moment step run eagerly from now on (:meth:`Compiled.stop
        <dkfac.solvers.compiled.Compiled.stop>`); whether either had compiled."""
        stopped = self._update.stop()
        return self._moment_step.stop() or stopped

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
            rms, power = self.options.orthogonal_rms, self.options.orthogonal_rms_power
            length = f"rms {rms:g}" + (f" ^ {1 - power:g} x own ^ {power:g}" if power else "")
            notes.append(f"orthogonal, {length}{shown}")
        return f"{self.name} ({', '.join(notes)})" if notes else self.name

    @classmethod
    def moment_elements(cls, a_dim: int, g_dim: int) -> int:
        """Each moment matrix (``g_dim × a_dim``) and the count ``t``."""
        return len(cls.keys) * a_dim * g_dim + 1

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
        self._note_damping(damping)
        into, out = self.rotation_dtypes(grad)
        state_in, state_out = self.rotation_states(state, into, out)
        if moments is None:
            moments = self.zero_moments_like(grad)
        work = moment_dtype(grad.dtype)  # the moments' precision
        result: tuple[Tensor, SolverState]
        result = self._update(state_in, state_out, moments, grad, damping, work, into, out)
        return result

    def _eager_update(
        self,
        state: SolverState,
        state_out: SolverState,
        moments: SolverState,
        grad: Tensor,
        damping: float,
        work: torch.dtype,
        into: torch.dtype | None,
        out: torch.dtype | None,
    ) -> tuple[Tensor, SolverState]:
        """:meth:`apply_with_moments` once the bases for the rotations into (``state``) and
        out of (``state_out``) the basis and the moments' precision (``work``) are chosen:
        a pure function of tensors, run through ``torch.compile`` where
        ``step_compile_backend`` is set, with the moment step traced into it."""
        rms = self.options.orthogonal_rms
        rotated = change_basis(grad.to(work), state, into)
        steps, split = self.options.orthogonal_steps, self.options.orthogonal_split
        null = null_weights(state)
        if rms is None:
            if self._update.active:  # traced whole: the moment step's eager code inside
                new, scaled = self._eager_moment_step(moments, rotated, damping, None, null)
            else:
                new, scaled = self.moment_step(moments, rotated, damping, null=null)
        elif split:  # in the basis, then out (module notes)
            new = self.update_moments(moments, rotated)
            ratio, weight = self.split_parts(new, rotated, damping, split, null=null)
            scaled = weighted_polar(ratio, weight, rms, steps)
        else:
            new = self.update_moments(moments, rotated)
            scaled = self.orthogonalised(self.scaled(new, rotated, damping, null=null))
        update = change_basis(scaled, state_out, out, out=True)
        return update.to(grad.dtype), new

    @property
    def orthogonalises(self) -> bool:
        """Whether the update in the basis is replaced by its polar factor with no split
        (:meth:`orthogonalised`)."""
        return self.options.orthogonal_rms is not None and not self.options.orthogonal_split

    def orthogonalised(self, scaled: Tensor) -> Tensor:
        """The update in the basis ``scaled`` (a matrix or a stack) replaced by its polar
        factor at ``orthogonal_rms`` where :attr:`orthogonalises` (module notes);
        ``scaled`` itself otherwise."""
        options = self.options
        if not self.orthogonalises or options.orthogonal_rms is None:
            return scaled
        return orthogonal_update(
            scaled, options.orthogonal_rms, options.orthogonal_steps, options.orthogonal_rms_power
        )

    def orthogonalised_all(self, scaled: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`orthogonalised` of each update of several groups, the small ones as one
        zero-padded batched iteration (:mod:`~dkfac.solvers.padded_polar`: the same values
        to the rounding, a few launches for all)."""
        options = self.options
        if not self.orthogonalises or options.orthogonal_rms is None:
            return list(scaled)
        return orthogonal_updates(
            scaled, options.orthogonal_rms, options.orthogonal_steps, options.orthogonal_rms_power
        )

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
        self._note_damping(damping)
        return self._moment_step(moments, rotated, damping, index, null)

    def _note_damping(self, damping: float) -> None:
        """A damping that changed since the compiled code read it (a schedule) makes this
        solver run eagerly from now on, as changed betas do (:meth:`run_eagerly`): each value
        would compile a graph of its own. Said once a process."""
        if not self.reads_damping or damping == self._damping:
            return
        if self._damping is not None and self.run_eagerly():
            level = logging.DEBUG if EigenMomentsSolver._damping_said else logging.WARNING
            EigenMomentsSolver._damping_said = True
            logger.log(
                level,
                "the damping changed during training (a schedule): %s's compiled updates run "
                "eagerly from now on, since every new value would compile a graph of its own",
                self.name,
            )
        self._damping = damping

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
        with a split (whose weights come from the moments within the pass); else ``None``.
        An orthogonalised update joins: its moments and scaling run in the flat pass and
        the groups' polar factors together (:meth:`orthogonalised_all`). A layer floored in
        a null space
        (:mod:`~dkfac.solvers.null_space`) joins too: the flat pass takes its floor per
        layer."""
        split = self.options.orthogonal_rms is not None and self.options.orthogonal_split
        if split or self.batch_key(state, grad) is None:
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

        Counts on a CPU (:data:`~dkfac.solvers.host_copy.HOST_COUNT_DEVICES`) that are all
        the same (one layer's, or a stack's that started together) give a Python number:
        reading them there waits for nothing, and the scalar arithmetic of the scaling is
        then host arithmetic, not a dozen dispatched operations on one-entry tensors a group
        a step (a GPU, counts that differ, the flat moments' counts per entry and a compiled
        step keep it on the device)."""
        if not self.options.bias_correction:
            return 1.0
        per_layer = t.shape != like.shape  # else one count per entry (flat moments)
        if per_layer and host_reads_now(t) and not torch.compiler.is_compiling():
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
        """The moments in the basis ``new`` after a refresh from ``old``
        (:mod:`~dkfac.solvers.moment_carry`): kept where the bases are equal, selected on the
        device (no host read of the bases)."""
        if old is None or unchanged(old, new):
            return moments
        result = carried(self.options.carry, old, new, moments, self.zero_moments)
        if any(old[k].shape != new[k].shape for k in ("qa", "qg")):
            return result
        return select_moments(basis_changed(old, new), result, moments)  # type: ignore[return-value]

    def carry_key(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> Hashable | None:
        """For bases that changed (not the very tensors), dense, blocked or one-sided alike
        and of the same shapes before and after: the class, the options, the bases'
        shapes, dtypes and blocks and the moments' shapes and dtypes; else ``None``."""
        bases = None if old is None or unchanged(old, new) else basis_key(old, new)
        if bases is None:
            return None
        held = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in moments.items())
        return (type(self), self.options, bases, held)

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
        old, new = stack_bases(olds), stack_bases(news)
        stacked = self._restacked(moments) or {
            k: torch.stack([m[k] for m in moments]) for k in moments[0]
        }
        changed = changed_layers(old, new)
        result = carried(self.options.carry, old, new, stacked, self.zero_moments)
        chosen = {
            k: torch.where(changed.view(-1, *[1] * (v.dim() - 1)), v, stacked[k])
            for k, v in result.items()
        }
        slices = unstack(chosen, len(olds))
        self._last_batch = (chosen, slices)
        return list(slices)
