"""Per-layer runtime state: accumulators, running statistics and solver state.

Statistics are *named* (``"A"`` and ``"G"`` for a Kronecker block, ``"F"`` for unit-wise
BatchNorm) and each has a :class:`~dkfac.solvers.statistics.StatisticKind` given by the
layer's solver: how it accumulates, is combined over ranks, averaged over steps and
checkpointed. The state asks the kinds and never which solver it holds.

A *deferred* solver (``method="smw"``/``"auto"``) is decided at the first capture: until
then the layer's accumulators are :class:`PendingSink` placeholders, and the first rows a
block adds (or a precomputed sum, which needs dense sides) resolve the solver
(:meth:`~dkfac.solvers.base.Solver.resolve`) and install its statistic kinds. The decision
is logged at INFO, shown by ``describe()`` and saved in checkpoints (:attr:`LayerState.decided`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dkfac.blocks.base import Block, Rows
from dkfac.solvers.base import Solver, SolverState
from dkfac.solvers.statistics import (
    Accumulator,
    DenseStatistic,
    FactorAccumulator,
    StatisticKind,
)

__all__ = ["LayerState", "PendingSink", "layers_device", "take_means_all", "update_running_all"]

logger = logging.getLogger(__name__)


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer on this rank.

    Build it with :meth:`create`, which installs the solver's statistic kinds and
    accumulators.

    Attributes:
        block: What the layer's statistics are.
        solver: How the layer's damped inverse is applied.
        factor_dtype: Precision the statistics are stored in (``None``: as they come).
        capture_dtype: Precision of the products' inputs of dense statistics.
        kinds: Statistic name -> how the solver keeps it.
        accumulators: Statistic name -> accumulator of the current step's contribution.
        running: Statistic name -> running value; empty on ranks that do not keep it.
        solver_state: The last good solver state, ``None`` before the first inverse update
            and on ranks that do not precondition this layer.
        captures: Whether this rank's hooks build the layer's statistics (a strategy may
            leave all of the capture work to the layer's owner).
        due: The statistics captured this step (set by the refresh policy before a step).
        decided: What a deferred solver decided (``None`` before, or without one).
        deferred_method: The method of its deferred solver (``"smw"`` or ``"auto"``),
            kept after the decision (which saved decisions it could have made); ``None``
            without one.
        moments: A :attr:`~dkfac.solvers.base.Solver.stateful` solver's moments of the
            gradient, kept on every rank that preconditions the layer (identical copies);
            ``None`` before its first preconditioned step and elsewhere.
        g_rows: The rows of its gradient this rank preconditions alone (the sharded
            layout's local mode): the solver then takes ``G``'s diagonal block of them
            (the rows of a low-rank ``U``); ``None``: all of ``G``.
        input_rms: Whether its update is divided by its input's RMS entry
            (``orthogonal_input_rms``, :mod:`~dkfac.engine.input_rms`).
        input_square: With ``input_rms``, the sum over this step's forwards of ``s²``, the
            mean square of the input row (bias included; :mod:`~dkfac.engine.input_rms`;
            ``None``: none yet); ``input_forwards`` counts them.
    """

    block: Block
    solver: Solver
    factor_dtype: torch.dtype | None = None
    capture_dtype: torch.dtype | None = None
    kinds: dict[str, StatisticKind] = field(default_factory=dict)
    accumulators: dict[str, Any] = field(default_factory=dict)
    running: dict[str, Tensor] = field(default_factory=dict)
    solver_state: SolverState | None = None
    captures: bool = True
    due: frozenset[str] = frozenset()
    decided: dict[str, Any] | None = None
    deferred_method: str | None = None
    moments: SolverState | None = None
    g_rows: slice | None = None
    input_rms: bool = False
    input_square: Tensor | None = None
    input_forwards: int = 0
    _names: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        block: Block,
        solver: Solver,
        factor_dtype: torch.dtype | None = None,
        capture_dtype: torch.dtype | None = None,
    ) -> LayerState:
        """A layer with ``solver`` installed (pending sinks for a deferred one)."""
        state = cls(block, solver, factor_dtype, capture_dtype)
        state.install(solver)
        return state

    def install(self, solver: Solver) -> None:
        """Makes ``solver`` the layer's: its statistic kinds and fresh accumulators."""
        self.solver = solver
        self.moments = None
        shapes = self.block.statistic_shapes()
        if solver.deferred:
            self.deferred_method = solver.name
            self.kinds = {}
            self.accumulators = {key: PendingSink(self, key) for key in shapes}
            return
        self.kinds = solver.statistics(shapes)
        self.accumulators = {
            key: kind.accumulator(self.factor_dtype, self.capture_dtype)
            for key, kind in self.kinds.items()
        }

    def restate_kinds(self) -> None:
        """Gives each statistic the kind its solver asks for now, after the solver's options
        changed (the overhead budget's one-sided sides, whose factors only their diagonal
        is kept for): a statistic whose kind changed gets the new kind's accumulator,
        holding what this step already added to the old one, and its running value in the
        new kind's layout (:meth:`~dkfac.solvers.statistics.StatisticKind.restore`: a
        dense value's diagonal, a diagonal's ``diag``); moments are kept."""
        if self.solver.deferred:
            return
        shapes = self.block.statistic_shapes()
        kinds = self.solver.statistics(shapes)
        for key, kind in kinds.items():
            if self.kinds.get(key) == kind:
                continue
            sink = kind.accumulator(self.factor_dtype, self.capture_dtype)
            held = self.accumulators.get(key)
            if isinstance(held, FactorAccumulator) and held.total is not None:
                sink.add_stored(kind.restore(held.total, shapes[key]), held.normaliser)
            if key in self.running:
                self.running[key] = kind.restore(self.running[key], shapes[key]).clone()
            self.kinds[key], self.accumulators[key] = kind, sink

    def resolve(self, rows: int | None) -> None:
        """Decides a deferred solver from the first micro-batch's rows (see the module notes)."""
        if not self.solver.deferred:
            return
        method = self.solver.label
        solver = self.solver.resolve((self.block.a_dim, self.block.g_dim), rows)
        self.install(solver)
        self.decided = solver.decision()
        logger.info(
            "%s: %s -> %s (rows of the first micro-batch %s, a_dim %d, g_dim %d)",
            self.name,
            method,
            solver.label,
            rows,
            self.block.a_dim,
            self.block.g_dim,
        )

    def restore_decision(self, decided: dict[str, Any], solver: Solver) -> None:
        """Installs a decision saved in a checkpoint (``solver`` is its concrete solver)."""
        self.install(solver)
        self.decided = dict(decided)

    def due_sinks(self) -> dict[str, Any]:
        """The accumulators of the statistics due this step."""
        return {key: acc for key, acc in self.accumulators.items() if key in self.due}

    @property
    def name(self) -> str:
        """The module's qualified name."""
        return self.block.name

    @property
    def a(self) -> Tensor | None:
        """Running input factor A (``None`` when not kept here)."""
        return self.running.get("A")

    @property
    def g(self) -> Tensor | None:
        """Running output-gradient factor G (``None`` when not kept here)."""
        return self.running.get("G")

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every statistic (as the block defines it), known without data."""
        return self.block.statistic_shapes()

    def kind(self, key: str) -> StatisticKind:
        """How statistic ``key`` is kept (dense while a deferred solver is pending)."""
        return self.kinds.get(key) or DenseStatistic()

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every statistic's stored value, as its kind keeps it (a one-sided
        side's ``(d,)`` diagonal), known without data (for buffers and bucket sizes)."""
        return {
            key: self.kind(key).stored_shape(shape)
            for key, shape in self.block.statistic_shapes().items()
        }

    def statistic_names(self) -> tuple[str, ...]:
        """The names of :meth:`statistic_shapes` (a block's are fixed: kept after the first
        call, as every step asks which are due)."""
        if self._names is None:
            self._names = tuple(self.block.statistic_shapes())
        return self._names

    def gathered(self) -> frozenset[str]:
        """The statistics that ranks combine by concatenating rows (low-rank sides)."""
        return frozenset(key for key, kind in self.kinds.items() if kind.gathered)

    def take_means(self) -> dict[str, Tensor] | None:
        """This step's averaged statistics (those that were fed, or ``None``); resets the sums."""
        means = {key: acc.mean() for key, acc in self.accumulators.items()}
        self.reset_accumulators()
        present = {key: value for key, value in means.items() if value is not None}
        return present or None

    def update_running(self, new: dict[str, Tensor], decay: float) -> None:
        """Each statistic's running value after ``new``, as its kind averages it.

        Dense: ``F ← decay·F + (1−decay)·F_new`` (a first value is taken as it is); a
        low-rank side: the decayed concatenation of its ``U``'s, never a sum of them.
        """
        for key, value in new.items():
            self.running[key] = self.kinds[key].update_running(self.running.get(key), value, decay)

    @property
    def complete(self) -> bool:
        """Whether every statistic has a running value (the solver can be computed)."""
        return set(self.running) == set(self.block.statistic_shapes())

    def solver_inputs(self) -> dict[str, Any]:
        """The running statistics as the solver takes them (low-rank sides as ``LowRank``;
        ``G`` cut to :attr:`g_rows`)."""
        inputs = {}
        shapes = self.block.statistic_shapes()
        for key, value in self.running.items():
            kind, shape = self.kinds[key], shapes[key]
            if key == "G" and self.g_rows is not None:
                inputs[key] = kind.part(value, shape, self.g_rows)
            else:
                inputs[key] = kind.solver_input(value, shape)
        return inputs

    def factor_kinds(self) -> dict[str, str]:
        """``a_factor`` / ``g_factor``: ``"lowrank"``, ``"dense"``, ``"blockdiag"``,
        ``"diagonal"``, ``"pending"``, or ``"unit-wise"`` for a block without a Kronecker
        pair (its statistic ``"F"``: BatchNorm's and a grouped convolution's)."""
        other = "unit-wise" if "F" in self.kinds else "dense"
        return {
            f"{key.lower()}_factor": "pending"
            if self.solver.deferred
            else (self.kinds[key].label if key in self.kinds else other)
            for key in ("A", "G")
        }

    def _method_label(self) -> str:
        """The solver's label, ``" / input rms"`` inside its note with ``input_rms``."""
        label = self.solver.label
        if self.input_rms and label.endswith(")"):
            return f"{label[:-1]} / input rms)"
        return label

    def summary(self) -> dict[str, Any]:
        """Name, block type, factor dimensions, method and factor kinds (``describe()``)."""
        return {
            "name": self.name,
            "block": type(self.block).__name__,
            "a_dim": self.block.a_dim,
            "g_dim": self.block.g_dim,
            "method": self._method_label(),
            **self.factor_kinds(),
        }

    def memory(self) -> dict[str, int]:
        """Bytes of running ``factors``, solver state (``inverses``), a stateful solver's
        ``moments`` and ``accumulators``. Of the solver state, the part an owner sends
        (:meth:`~dkfac.solvers.base.Solver.shared`) is counted: what every rank derives from
        it (a singular factor's null indicators, ``n_g + n_a`` values beside ``n_g² + n_a²``
        of bases, present only when the data made a factor singular) is not, so that the
        count is what the cost model predicts from the shapes."""
        state = self.solver.shared(self.solver_state) if self.solver_state else {}
        groups = {
            "factors": list(self.running.values()),
            "inverses": list(state.values()),
            "moments": list((self.moments or {}).values()),
            "accumulators": [t for acc in self.accumulators.values() for t in acc.tensors()],
        }
        return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in groups.items()}

    def reset_accumulators(self) -> None:
        """Drops the current step's partial statistics."""
        for acc in self.accumulators.values():
            acc.reset()


class PendingSink:
    """Accumulator placeholder of a deferred solver: its first contribution decides it.

    It resolves the layer's solver (which installs real accumulators) and forwards the
    contribution to the new accumulator.
    """

    takes_sums = False
    """Blocks hand it rows: their count decides the sides."""
    compute_dtype = None
    dtype = None

    def __init__(self, layer: LayerState, key: str) -> None:
        self.layer = layer
        self.key = key

    @property
    def has_data(self) -> bool:
        """Always ``False``: contributions go to the accumulator that replaces it."""
        return False

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Decides the solver from ``rows``' count, then adds to the chosen accumulator."""
        self.layer.resolve(int(rows.rows.shape[0]))
        self._target().add(rows, scale)

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """A block that feeds sums needs dense sides: decides dense, then adds."""
        self.layer.resolve(None)
        self._target().add_sum(total, normaliser, scale)

    def _target(self) -> Accumulator:
        target: Accumulator = self.layer.accumulators[self.key]
        return target

    def mean(self) -> Tensor | None:
        """Nothing accumulated here."""
        return None

    def reset(self) -> None:
        """Nothing to forget."""

    def tensors(self) -> list[Tensor]:
        """Holds no tensor."""
        return []


def layers_device(layers: Mapping[str, LayerState]) -> torch.device:
    """The device of the layers' parameters (the first layer's): where the ranks' small
    control tensors are built, since NCCL reduces CUDA tensors only."""
    return next(iter(layers.values())).block.parameters()[0].device


def update_running_all(
    layers: Mapping[str, LayerState], kept: Mapping[str, Mapping[str, Tensor]], decay: float
) -> None:
    """Every kept statistic's running value after this step's (``update_running`` of each
    layer), the dense ones that already have a value in one multi-tensor
    ``F ← F + (1 − decay)(F_new − F)`` (one launch on a GPU for any number of layers; the
    same arithmetic as each kind's own update). With ``decay`` 0 those take the new value
    by one multi-tensor copy into the running one: a new value may be a view that the step
    reuses (:class:`~dkfac.engine.device_checks.HeldStatistics`), never kept itself."""
    olds: list[Tensor] = []
    news: list[Tensor] = []
    for name, stats in kept.items():
        layer = layers[name]
        for key, value in stats.items():
            old = layer.running.get(key)
            kind = layer.kinds[key]
            fusable = type(kind).update_running is DenseStatistic.update_running
            if fusable and old is not None and (old.dtype, old.shape) == (value.dtype, value.shape):
                olds.append(old)
                news.append(value)
            else:
                layer.running[key] = kind.update_running(old, value, decay)
    if olds and decay == 0.0:
        torch._foreach_copy_(olds, news)
    elif olds:
        torch._foreach_lerp_(olds, news, 1.0 - decay)


def take_means_all(layers: Mapping[str, LayerState]) -> dict[str, dict[str, Tensor]]:
    """Every layer's :meth:`LayerState.take_means` (layers without statistics left out),
    the dense sums divided by their normalisers in one multi-tensor call (one launch on a
    GPU for any number of layers; the same division as each accumulator's ``mean``)."""
    means: dict[str, dict[str, Tensor]] = {}
    sums: list[Tensor] = []
    counts: list[float] = []
    places: list[tuple[str, str]] = []
    for name, layer in layers.items():
        taken: dict[str, Tensor] = {}
        for key, acc in layer.accumulators.items():
            dense = type(acc).mean is FactorAccumulator.mean
            if dense and acc.total is not None and acc.normaliser != 0:
                sums.append(acc.total)
                counts.append(acc.normaliser)
                places.append((name, key))
            elif (value := acc.mean()) is not None:
                taken[key] = value
        layer.reset_accumulators()
        if taken:
            means[name] = taken
    divided = torch._foreach_div(sums, counts) if sums else []
    for (name, key), value in zip(places, divided, strict=True):
        means.setdefault(name, {})[key] = value
    # In the layers' order, each layer's statistics in its accumulators' order.
    order = {name: list(layers[name].accumulators) for name in means}
    return {
        name: {key: means[name][key] for key in order[name] if key in means[name]}
        for name in layers
        if name in means
    }
