"""Per-layer runtime state: accumulators, running statistics and solver state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dkfac.blocks.base import Block
from dkfac.solvers.base import Solver, SolverState
from dkfac.solvers.lowrank.factor import LowRank, decay_concat
from dkfac.solvers.statistics import Accumulator, FactorAccumulator


def _pair() -> dict[str, Accumulator]:
    return {"A": FactorAccumulator(), "G": FactorAccumulator()}


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer on this rank.

    Statistics are *named* (``"A"`` and ``"G"`` for a Kronecker block) so that strategies
    can reduce, keep and checkpoint them without knowing what they are.

    Attributes:
        block: What the layer's factors are.
        solver: How the layer's damped inverse is applied.
        accumulators: Statistic name -> accumulator of the current step's contribution.
        running: Statistic name -> running average; empty on ranks that do not keep it.
        solver_state: The last good solver state, ``None`` before the first inverse update
            and on ranks that do not precondition this layer.
        captures: Whether this rank's hooks build the layer's statistics (a strategy may
            leave all of the capture work to the layer's owner).
        due: The statistics captured this step (set by the refresh policy before a step).
        lowrank: Statistic name -> bounded rank, for the sides held as ``U`` (``d × m``,
            factor ``U Uᵀ``) instead of a ``d × d`` matrix (SMW; see
            :mod:`dkfac.engine.lowrank_plan`). Their step statistic and running value are ``U``.
        method_label: The method as ``describe()`` shows it (e.g. ``smw(A=lowrank,G=dense)``).
    """

    block: Block
    solver: Solver
    accumulators: dict[str, Accumulator] = field(default_factory=_pair)
    running: dict[str, Tensor] = field(default_factory=dict)
    solver_state: SolverState | None = None
    captures: bool = True
    lowrank: dict[str, int] = field(default_factory=dict)
    method_label: str = ""
    due: frozenset[str] = frozenset()

    def due_sinks(self) -> dict[str, Any]:
        """The accumulators of the statistics due this step."""
        return {key: acc for key, acc in self.accumulators.items() if key in self.due}

    @property
    def name(self) -> str:
        """The module's qualified name."""
        return self.block.name

    @property
    def a_acc(self) -> Accumulator:
        """Accumulator of the input factor A."""
        return self.accumulators["A"]

    @property
    def g_acc(self) -> Accumulator:
        """Accumulator of the output-gradient factor G."""
        return self.accumulators["G"]

    @property
    def a(self) -> Tensor | None:
        """Running input factor A (``None`` when not kept here)."""
        return self.running.get("A")

    @property
    def g(self) -> Tensor | None:
        """Running output-gradient factor G (``None`` when not kept here)."""
        return self.running.get("G")

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every statistic, known without data (used to allocate receive buffers)."""
        return self.block.statistic_shapes()

    def take_means(self) -> dict[str, Tensor] | None:
        """This step's averaged statistics (those that were fed, or ``None``); resets the sums."""
        means = {key: acc.mean() for key, acc in self.accumulators.items()}
        self.reset_accumulators()
        present = {key: value for key, value in means.items() if value is not None}
        return present or None

    def update_running(self, new: dict[str, Tensor], decay: float) -> None:
        """``F ← decay·F + (1−decay)·F_new`` per statistic; a first value is taken as it is.

        Low-rank sides keep ``U ← [√decay·U, √(1−decay)·U_new]`` (bounded rank, oldest
        columns dropped first; :func:`~dkfac.solvers.lowrank.factor.decay_concat`), never a
        sum of ``U``'s.
        """
        for key, value in new.items():
            if key in self.lowrank:
                old = self.running.get(key)
                self.running[key] = decay_concat(old, value, decay, self.lowrank[key])
            elif key not in self.running or decay == 0.0:
                self.running[key] = value
            else:
                self.running[key].mul_(decay).add_(value, alpha=1.0 - decay)

    @property
    def complete(self) -> bool:
        """Whether every statistic has a running value (the solver can be computed)."""
        return set(self.running) == set(self.block.statistic_shapes())

    def solver_inputs(self) -> dict[str, Any]:
        """The running statistics as the solver takes them (low-rank sides as ``LowRank``)."""
        return {
            key: LowRank(value) if key in self.lowrank else value
            for key, value in self.running.items()
        }

    def factor_kinds(self) -> dict[str, str]:
        """``a_factor`` / ``g_factor``: ``"lowrank"``, ``"dense"`` or ``"pending"``."""
        pending = self.method_label.endswith("(pending)")
        return {
            f"{key.lower()}_factor": "pending"
            if pending
            else ("lowrank" if key in self.lowrank else "dense")
            for key in ("A", "G")
        }

    def summary(self) -> dict[str, Any]:
        """Name, block type, factor dimensions, method and factor kinds (``describe()``)."""
        return {
            "name": self.name,
            "block": type(self.block).__name__,
            "a_dim": self.block.a_dim,
            "g_dim": self.block.g_dim,
            "method": self.method_label or self.solver.name,
            **self.factor_kinds(),
        }

    def memory(self) -> dict[str, int]:
        """Bytes of running ``factors``, solver state (``inverses``) and ``accumulators``."""
        groups = {
            "factors": list(self.running.values()),
            "inverses": list((self.solver_state or {}).values()),
            "accumulators": [t for acc in self.accumulators.values() for t in acc.tensors()],
        }
        return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in groups.items()}

    def reset_accumulators(self) -> None:
        """Drops the current step's partial statistics."""
        for acc in self.accumulators.values():
            acc.reset()
