"""The solver interface: how the damped inverse of a Kronecker pair is applied.

A solver turns the factors of one layer into a *state* (eigenpairs, inverses, ...) in
:meth:`Solver.compute`, which is the expensive, infrequent part, and applies the damped
inverse to a gradient matrix in :meth:`Solver.apply`, which runs every step. The state is a
flat ``dict[str, Tensor]`` so that strategies can communicate it and memory can be counted.

A solver also says how each statistic it consumes is kept (:meth:`Solver.statistics`):
dense by default; the SMW solver keeps low-rank sides as ``U`` with ``F = U Uᵀ``
(:class:`~dkfac.solvers.lowrank.factor.LowRankStatistic`). The engine, the strategies,
checkpoints and the refresh policy ask those kinds, never which solver a layer has.
A *deferred* solver (:attr:`Solver.deferred`, ``method="smw"``/``"auto"``) cannot know its
statistics before it has seen data: :meth:`Solver.resolve` turns it into a concrete solver
from the rows of the first capture.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from dkfac.solvers.statistics import DenseStatistic, StatisticKind

logger = logging.getLogger(__name__)

SolverState = dict[str, Tensor]


class BatchJob(NamedTuple):
    """The layers of one :meth:`Solver.batch_key`, as :meth:`Solver.apply_batch` takes
    them, with the solver of the first (which keeps the group's stacks between steps)."""

    solver: Solver
    states: Sequence[SolverState]
    moments: Sequence[SolverState | None]
    grads: Sequence[Tensor]


class SolverError(RuntimeError):
    """A decomposition failed even in float64; the caller keeps the last good state."""


class Solver(ABC):
    """Applies ``(A ⊗ G + damping)^{-1}`` (in some approximation) to gradient matrices.

    Args:
        compute_dtype: Precision of the decompositions (float32 or float64); a failure in
            float32 is retried once in float64.
    """

    name: str = "solver"
    accepts_lowrank: bool = False
    """Whether :meth:`compute` also takes :class:`~dkfac.solvers.lowrank.factor.LowRank` factors."""
    deferred: bool = False
    """Whether the solver is only decided at the first capture (:meth:`resolve`)."""
    fixed_size_state: ClassVar[bool] = True
    """Whether :meth:`state_elements` follows from the shapes alone (a low-rank state's size
    depends on the rows seen, so the cost model cannot price it)."""
    cost_rate: ClassVar[str] = "eigh"
    """Which measured speed prices :meth:`compute` in the cost model: ``"eigh"`` (symmetric
    eigendecompositions) or ``"cholesky"`` (Cholesky inverses); ``n³`` per second either way."""
    apply_products: ClassVar[int] = 4
    """``c`` in the cost model's ``c·(a²g + ag²)`` flops of one :meth:`apply` (two products
    per side for a change of basis, one for an inverse)."""
    stateful: ClassVar[bool] = False
    """Whether the solver keeps *moments* between steps on every rank that preconditions a
    layer (:meth:`apply_with_moments`, :meth:`carry_moments`, :meth:`moment_elements`)."""
    adam_scaled: ClassVar[bool] = False
    """Whether its update has Adam's scale (entries of about one, stepped at the lr): the
    parameters no block takes then get Adam's direction too by default
    (``KFACConfig.leftover_update="auto"``), and only then may they ask for it."""

    @classmethod
    def state_elements(cls, a_dim: int, g_dim: int) -> int:
        """Elements of the solver state of one ``a_dim × g_dim`` Kronecker layer, as stored
        and sent (the cost model's bytes and memory): eigenvectors and eigenvalues by default."""
        return a_dim * a_dim + a_dim + g_dim * g_dim + g_dim

    @classmethod
    def moment_elements(cls, a_dim: int, g_dim: int) -> int:
        """Elements of per-layer state kept between steps where the layer is preconditioned
        (none by default; a solver with moments of the gradient counts them here)."""
        del a_dim, g_dim
        return 0

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_dtype = compute_dtype
        self.host_checks = True
        """Whether a new state is checked on the host (:meth:`with_retry`: non-finite
        results retried in float64, then refused). ``False`` (set by the engine around a
        refresh whose flags stay on the device, :mod:`dkfac.engine.refresh_checks`): no
        host read, the state returned as computed, for the engine to select on the device."""

    @property
    def label(self) -> str:
        """The method as ``describe()`` shows it."""
        return self.name

    def statistics(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, StatisticKind]:
        """How each of a block's statistics (name -> shape) is kept: dense by default."""
        return {key: DenseStatistic() for key in shapes}

    def resolve(self, dims: tuple[int, int], rows: int | None) -> Solver:
        """The concrete solver of a deferred one, from ``(a_dim, g_dim)`` and the rows of
        the first capture (``None``: a block that feeds sums, which need dense sides)."""
        del dims, rows
        return self

    def decision(self) -> dict[str, Any]:
        """What a deferred solver decided, as checkpoints save it (see :meth:`resolve`)."""
        return {"solver": self.name, "lowrank": {}}

    @abstractmethod
    def compute(self, a: Tensor, g: Tensor, damping: float) -> SolverState:
        """Builds the solver state from the factors ``A`` (d_in×d_in) and ``G``."""

    def compute_statistics(
        self, stats: Mapping[str, Any], damping: float, previous: SolverState | None = None
    ) -> SolverState:
        """Builds the solver state from a layer's named running statistics.

        Kronecker solvers take ``stats["A"]`` and ``stats["G"]``; other solvers (unit-wise
        BatchNorm) override this to read the statistics their block produces.

        Args:
            stats: The running statistics by name.
            damping: The damping of this update.
            previous: The owner's last state of the layer (``None`` before the first), for
                a solver that updates its state from the previous one instead of anew.
        """
        del previous
        return self.compute(stats["A"], stats["G"], damping)

    def refresh_key(
        self, stats: Mapping[str, Any], previous: SolverState | None
    ) -> Hashable | None:
        """Layers whose solvers give equal keys (not ``None``) for their statistics and
        previous states are refreshed together by one :meth:`compute_batch`, on the first
        one's solver; so a key must hold whatever that call reads of the solver. ``None``
        (the default): this layer alone."""
        del stats, previous
        return None

    def compute_batch(
        self,
        stats: Sequence[Mapping[str, Any]],
        damping: float,
        previous: Sequence[SolverState | None],
    ) -> list[SolverState | SolverError]:
        """:meth:`compute_statistics` of several layers of equal :meth:`refresh_key`, in
        order, each layer's new state or the :class:`SolverError` of its failure (the
        default computes them one by one; a solver may decompose them as one batch: one
        call, and one check of the results, for the group, :meth:`batch_once`). Raising
        :class:`SolverError` fails the whole group (the engine then refreshes each layer
        alone)."""
        results: list[SolverState | SolverError] = []
        for one, before in zip(stats, previous, strict=True):
            try:
                results.append(self.compute_statistics(one, damping, before))
            except SolverError as err:
                results.append(err)
        return results

    @abstractmethod
    def apply(self, state: SolverState, grad: Tensor, damping: float) -> Tensor:
        """Returns the preconditioned ``g_dim × a_dim`` gradient matrix."""

    def apply_with_moments(
        self, state: SolverState, moments: SolverState | None, grad: Tensor, damping: float
    ) -> tuple[Tensor, SolverState | None]:
        """The preconditioned gradient and the layer's moments after ``grad`` (pure).

        A :attr:`stateful` solver reads ``moments`` (``None``: start from zero) and returns
        new ones, leaving the given tensors unchanged so that the caller can drop the result
        (a step whose gradient is not finite). The default is :meth:`apply` and no moments.
        """
        return self.apply(state, grad, damping), moments

    def batch_key(self, state: SolverState, grad: Tensor) -> Hashable | None:
        """Layers whose solvers give equal keys (not ``None``) for their state and gradient
        are preconditioned together by one :meth:`apply_batch`, on the first one's solver;
        so a key must hold whatever that call reads of the solver (its class and options).
        ``None`` (the default): this layer alone."""
        del state, grad
        return None

    def apply_batch(
        self,
        states: Sequence[SolverState],
        moments: Sequence[SolverState | None],
        grads: Sequence[Tensor],
        damping: float,
        *,
        advance: Tensor | None = None,
    ) -> list[tuple[Tensor, SolverState | None]]:
        """:meth:`apply_with_moments` of each layer of one :meth:`batch_key`, in order (the
        default calls it layer by layer; a solver may run them as one batched pass).

        ``advance`` (a 0-d bool tensor, or ``None`` for always): where it fails, each
        layer's returned moments are its given ones (zero moments for ``None``), selected
        on the device (:func:`select_moments`) so that no flag is read on the host."""
        results = [
            self.apply_with_moments(state, moment, grad, damping)
            for state, moment, grad in zip(states, moments, grads, strict=True)
        ]
        if advance is None:
            return results
        return [
            (
                update,
                select_moments(advance, new, self.zero_moments_like(grad) if old is None else old),
            )
            for (update, new), old, grad in zip(results, moments, grads, strict=True)
        ]

    def fuse_key(self, state: SolverState, grad: Tensor) -> Hashable | None:
        """Groups of layers (each of one :meth:`batch_key`) whose first solvers give equal
        keys (not ``None``) may be preconditioned together by one :meth:`apply_groups`, on
        the first group's solver; ``None`` (the default): the group alone."""
        del state, grad
        return None

    def apply_groups(
        self, groups: Sequence[BatchJob], damping: float, *, advance: Tensor | None = None
    ) -> list[list[tuple[Tensor, SolverState | None]]]:
        """:meth:`apply_batch` of each group (on its own solver), in order; a solver may
        run the groups' elementwise work as one pass (the default runs them one by one)."""
        extra = {} if advance is None else {"advance": advance}
        return [
            job.solver.apply_batch(job.states, job.moments, job.grads, damping, **extra)
            for job in groups
        ]

    def zero_moments_like(self, grad: Tensor) -> SolverState | None:
        """The moments a layer with gradient ``grad`` starts from (``None``: the solver keeps
        none)."""
        del grad
        return None

    def shared(self, state: SolverState) -> SolverState:
        """The part of ``state`` an owner sends to the other ranks (default: all of it)."""
        return state

    def completed(self, state: SolverState, *, late: bool = False) -> SolverState:
        """``state`` with what every rank derives from its :meth:`shared` part itself
        (default: nothing), so that derived entries never travel. ``late``: a refresh of the
        step, where whatever is decided on the host from the values is taken from an
        earlier refresh's host copy instead of a read (a solver's own rule; the default
        derives nothing)."""
        del late
        return state

    def complete_key(self, state: SolverState) -> Hashable | None:
        """Layers whose solvers give equal keys (not ``None``) for their received states are
        completed together by one :meth:`completed_batch`, on the first one's solver; so a
        key must hold whatever that call reads of the solver. ``None`` (the default): this
        layer alone."""
        del state
        return None

    def completed_batch(
        self, solvers: Sequence[Solver], states: Sequence[SolverState], *, late: bool = False
    ) -> list[SolverState]:
        """:meth:`completed` of several layers of equal :meth:`complete_key`, each on its own
        solver (``solvers[i]``), in order (the default completes them one by one)."""
        return [
            solver.completed(state, late=late)
            for solver, state in zip(solvers, states, strict=True)
        ]

    def run_eagerly(self) -> bool:
        """Stops running compiled code, after its options changed during training; returns
        whether any had compiled (the default compiles nothing)."""
        return False

    def carry_moments(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> SolverState | None:
        """The moments after the state changed from ``old`` to ``new`` (an inverse update).

        Runs on every rank that preconditions the layer, with the same inputs, so the
        copies stay identical. The default keeps them.
        """
        del old, new
        return moments

    def carry_key(
        self, old: SolverState | None, new: SolverState, moments: SolverState
    ) -> Hashable | None:
        """Layers whose solvers give equal keys (not ``None``) carry their moments together
        by one :meth:`carry_batch`, on the first one's solver; so a key must hold whatever
        that call reads of the solver. ``None`` (the default): this layer alone."""
        del old, new, moments
        return None

    def carry_batch(
        self,
        olds: Sequence[SolverState],
        news: Sequence[SolverState],
        moments: Sequence[SolverState],
    ) -> list[SolverState | None]:
        """:meth:`carry_moments` of several layers of equal :meth:`carry_key`, in order (the
        default carries them one by one; a solver may carry them as one batched pass)."""
        return [
            self.carry_moments(old, new, moment)
            for old, new, moment in zip(olds, news, moments, strict=True)
        ]

    def with_retry(self, fn: Callable[[torch.dtype], SolverState]) -> SolverState:
        """Runs ``fn(dtype)`` in the compute dtype, then once more in float64 on failure.

        A failure is a raised linear-algebra error or a non-finite result; without
        :attr:`host_checks` only a raised error (a non-finite result is returned as it is,
        for the caller to check on the device).

        Raises:
            SolverError: If float64 fails too.
        """
        dtypes = [self.compute_dtype]
        if self.compute_dtype != torch.float64:
            dtypes.append(torch.float64)
        last: Exception | None = None
        for dtype in dtypes:
            try:
                # Contiguous, so that ranks that receive a state by broadcast (row-major
                # buffers) and the owner run the same kernels and round identically.
                state = {key: value.contiguous() for key, value in fn(dtype).items()}
            except (RuntimeError, torch.linalg.LinAlgError) as err:
                last = err
            else:
                if not self.host_checks:
                    return state
                # One host synchronisation for the state, not one a tensor.
                checks = [torch.isfinite(t).all() for t in state.values()]
                if not checks or bool(torch.stack(checks).all()):
                    return state
                last = FloatingPointError("non-finite decomposition")
            if dtype != torch.float64:
                logger.warning(
                    "%s decomposition failed in %s (%s); retrying", self.name, dtype, last
                )
        raise SolverError(f"{self.name} decomposition failed in float64: {last}")

    def batch_once(
        self,
        fn: Callable[[torch.dtype], list[SolverState]],
        alone: Callable[[int], SolverState],
        count: int,
    ) -> list[SolverState | SolverError]:
        """The states ``fn(dtype)`` of a batch of layers (:meth:`compute_batch`), tried once,
        in the compute dtype; a layer whose state fails is refreshed alone by ``alone(i)``
        (:meth:`compute_statistics`, with its own retries), the others keeping theirs from
        the batch: one layer's failure changes no other's result (a float64 retry of the
        whole batch would), and a batch on the device, which selects each layer's state
        where it is finite (no host read), ends with the same states.

        A failure: a raised error (it cannot be told to a layer: every layer alone), or
        with :attr:`host_checks` a non-finite tensor in a layer's state (one host read for
        the batch).

        Args:
            fn: The states of the ``count`` layers in a dtype.
            alone: Layer ``i``'s state computed alone (raises :class:`SolverError`).
            count: The layers.

        Returns:
            Each layer's state, or the :class:`SolverError` of its failure alone.
        """
        try:
            states = [
                {key: value.contiguous() for key, value in state.items()}
                for state in fn(self.compute_dtype)
            ]
        except (RuntimeError, torch.linalg.LinAlgError) as err:
            logger.warning("%s batched decomposition failed (%s); layer by layer", self.name, err)
            return [self._alone(alone, i) for i in range(count)]
        failed: set[int] = set()
        if self.host_checks:  # one read of a flag a tensor (no copy of the states)
            owners = [i for i, state in enumerate(states) for _ in state]
            checks = [torch.isfinite(value).all() for state in states for value in state.values()]
            flags = torch.stack(checks).tolist() if checks else []
            failed = {i for i, flag in zip(owners, flags, strict=True) if not flag}
        return [self._alone(alone, i) if i in failed else s for i, s in enumerate(states)]

    @staticmethod
    def _alone(alone: Callable[[int], SolverState], index: int) -> SolverState | SolverError:
        """``alone(index)``, or its :class:`SolverError`."""
        try:
            return alone(index)
        except SolverError as err:
            return err


@contextlib.contextmanager
def unchecked(solvers: Sequence[Solver], on: bool = True) -> Iterator[None]:
    """Turns the solvers' :attr:`Solver.host_checks` off inside (nothing where ``on`` is
    false), and back to what they were after."""
    before = [solver.host_checks for solver in solvers]
    for solver in solvers:
        solver.host_checks = solver.host_checks and not on
    try:
        yield
    finally:
        for solver, value in zip(solvers, before, strict=True):
            solver.host_checks = value


def select_moments(
    advance: Tensor, new: SolverState | None, before: SolverState | None
) -> SolverState | None:
    """``new`` where ``advance`` holds, else ``before``, key by key with ``torch.where``
    (no host read); ``None`` for a solver that keeps no moments (``new`` is ``None``)."""
    if new is None or before is None:
        return new
    return {key: torch.where(advance, value, before[key]) for key, value in new.items()}


def unstack(state: SolverState, count: int) -> list[SolverState]:
    """The ``count`` states of a state whose tensors carry a leading layer dimension (one
    ``unbind`` a key)."""
    parts = {key: value.unbind(0) for key, value in state.items()}
    return [{key: part[i] for key, part in parts.items()} for i in range(count)]
