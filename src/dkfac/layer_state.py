"""Per-layer runtime state: factor accumulators, running factors and the solver state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dkfac.blocks.base import Block, Rows
from dkfac.solvers.base import Solver, SolverState


@dataclass
class FactorAccumulator:
    """Sums ``scale · RᵀR`` and normalisers over the micro-batches of one step.

    Attributes:
        dtype: Precision the sums are kept in.
        total: The running sum of outer products, ``None`` before the first contribution.
        normaliser: The running sum of normalisers.
    """

    dtype: torch.dtype | None = None
    total: Tensor | None = None
    normaliser: float = 0.0

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Adds ``scale · rows.T @ rows`` and the rows' normaliser."""
        matrix = rows.rows if self.dtype is None else rows.rows.to(self.dtype)
        contribution = matrix.T @ matrix
        if scale != 1.0:
            contribution.mul_(scale)
        if self.total is None:
            self.total = contribution
        else:
            self.total.add_(contribution)
        self.normaliser += rows.normaliser

    def mean(self) -> Tensor | None:
        """The averaged factor, or ``None`` when nothing was added."""
        if self.total is None or self.normaliser == 0:
            return None
        return self.total / self.normaliser

    def reset(self) -> None:
        """Forgets every contribution."""
        self.total = None
        self.normaliser = 0.0


@dataclass
class LayerState:
    """Everything the preconditioner keeps for one registered layer.

    Attributes:
        block: What the layer's factors are.
        solver: How the layer's damped inverse is applied.
        a_acc: Accumulator of the current step's input factor.
        g_acc: Accumulator of the current step's output-gradient factor.
        a: Running input factor A.
        g: Running output-gradient factor G.
        solver_state: The last good solver state, ``None`` before the first inverse update.
    """

    block: Block
    solver: Solver
    a_acc: FactorAccumulator = field(default_factory=FactorAccumulator)
    g_acc: FactorAccumulator = field(default_factory=FactorAccumulator)
    a: Tensor | None = None
    g: Tensor | None = None
    solver_state: SolverState | None = None

    @property
    def name(self) -> str:
        """The module's qualified name."""
        return self.block.name

    def update_running(self, new_a: Tensor, new_g: Tensor, decay: float) -> None:
        """``F ← decay·F + (1−decay)·F_new``; the first update takes ``F_new`` as it is."""
        if self.a is None or self.g is None or decay == 0.0:
            self.a, self.g = new_a, new_g
            return
        self.a.mul_(decay).add_(new_a, alpha=1.0 - decay)
        self.g.mul_(decay).add_(new_g, alpha=1.0 - decay)

    def reset_accumulators(self) -> None:
        """Drops the current step's partial factors."""
        self.a_acc.reset()
        self.g_acc.reset()
