"""Which factor sides of a layer are held low-rank (SMW / SKFAC), decided at the first capture.

With ``method="smw"`` or ``method="auto"`` a Kronecker layer's sides are not fixed at
registration: the rank of a side is the number of rows one factor update adds, which depends
on the batch. So the layer starts with a :class:`PendingSink` for ``"A"`` and ``"G"``, and the
**first rows added** (the first forward pass of the first factor-update step, the A side)
decide both sides; the G side is assumed to add as many rows as A (true for Linear, Conv2d
under every reduction, and Embedding).

Rows of one step, per side: ``m = r₁ · accumulation_steps · P``, where ``r₁`` is the rows of
that first micro-batch and ``P`` the number of ranks whose rows are gathered (the world size
for every strategy that communicates statistics, 1 for ``dp`` and for one process). The
running concatenation keeps at most ``r = default_max_rank(m, factor_decay)`` columns
(``factor_decay`` resolved at step 0; ``r = m`` when it is 0).

* ``method="smw"``: a side is **low-rank** when ``r < d``; otherwise it stays dense (running
  ``d × d`` average, inverted by Cholesky inside the SMW solver). Under several ranks this
  also means low-rank statistics are all-gathered (``P·m·d`` values) only when that is
  smaller than the ``d × d`` all-reduce.
* ``method="auto"``: :func:`dkfac.solvers.lowrank.auto.choose_method` with ``rows_a = rows_g = r``
  picks the layer's solver and each side's kind.

A low-rank side accumulates rows
(:class:`~dkfac.solvers.lowrank.factor.LowRankRowsAccumulator`), its step statistic is ``U``
(``d × m``) and its running value the decayed concatenation of ``U``'s
(:meth:`~dkfac.engine.layer_state.LayerState.update_running`); no ``d × d`` matrix is formed.
The decision is logged at INFO and shown by ``describe()``; it is saved in checkpoints.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from dkfac.config import KFACConfig, resolve
from dkfac.engine.layer_state import LayerState
from dkfac.solvers import make_solver
from dkfac.solvers.lowrank.auto import choose_method
from dkfac.solvers.lowrank.factor import LowRankRowsAccumulator, default_max_rank
from dkfac.solvers.statistics import FactorAccumulator, Rows

__all__ = ["LowRankPlan", "PendingSink", "decision", "describe_method", "lowrank_eligible"]

logger = logging.getLogger(__name__)

PENDING = "pending"


def lowrank_eligible(layer: LayerState) -> bool:
    """Whether the layer is a plain Kronecker pair (``"A"`` and ``"G"``, configured solver)."""
    block = layer.block
    return block.solver_name is None and set(block.statistic_shapes()) == {"A", "G"}


class PendingSink:
    """Accumulator placeholder: its first contribution decides the layer's sides.

    It then replaces itself (and its sibling) in ``layer.accumulators`` and forwards the
    contribution to the new accumulator.
    """

    takes_sums = False
    """Blocks hand it rows: their count decides the sides."""
    compute_dtype = None
    dtype = None

    def __init__(self, plan: LowRankPlan, layer: LayerState, key: str) -> None:
        self.plan = plan
        self.layer = layer
        self.key = key

    @property
    def has_data(self) -> bool:
        """Always ``False``: contributions go to the accumulator that replaces it."""
        return False

    def add(self, rows: Rows, scale: float = 1.0) -> None:
        """Decides the sides from ``rows``' count, then adds to the chosen accumulator."""
        self.plan.decide(self.layer, int(rows.rows.shape[0]))
        self.layer.accumulators[self.key].add(rows, scale)

    def add_sum(self, total: Tensor, normaliser: float, scale: float = 1.0) -> None:
        """A block that feeds sums needs dense sides: decides dense, then adds."""
        self.plan.decide(self.layer, None)
        self.layer.accumulators[self.key].add_sum(total, normaliser, scale)

    def mean(self) -> Tensor | None:
        """Nothing accumulated here."""
        return None

    def reset(self) -> None:
        """Nothing to forget."""

    def tensors(self) -> list[Tensor]:
        """Holds no tensor."""
        return []


class LowRankPlan:
    """Applies the rule of the module docstring to the layers of one preconditioner.

    Args:
        config: The preconditioner's configuration (``method`` is ``"smw"`` or ``"auto"``).

    Attributes:
        gathered_ranks: ``P``, the ranks whose rows one reduced statistic holds; set by the
            preconditioner once its strategy exists (1 until then).
    """

    def __init__(self, config: KFACConfig) -> None:
        if config.method not in ("smw", "auto"):
            raise ValueError(f"LowRankPlan needs method 'smw' or 'auto', got {config.method!r}")
        self.config = config
        self.gathered_ranks = 1
        decay = resolve("factor_decay", config.factor_decay, 0)
        assert decay is not None
        self.decay = float(decay)

    def prepare(self, layer: LayerState) -> None:
        """Puts pending sinks on an eligible layer (others keep dense accumulators)."""
        if not lowrank_eligible(layer):
            return
        layer.accumulators = {key: PendingSink(self, layer, key) for key in ("A", "G")}
        layer.method_label = f"{self.config.method} ({PENDING})"

    def bounded_rank(self, rows: int) -> int:
        """``r``: the columns the running concatenation keeps for ``rows`` rows per side."""
        step_rows = rows * self.config.accumulation_steps * self.gathered_ranks
        return default_max_rank(step_rows, self.decay)

    def decide(self, layer: LayerState, rows: int | None) -> None:
        """Chooses the layer's solver and low-rank sides from the first micro-batch's rows."""
        block = layer.block
        dims = {"A": block.a_dim, "G": block.g_dim}
        rank = None if rows is None or rows < 1 else self.bounded_rank(rows)
        if self.config.method == "smw":
            method = "smw"
            sides = {k: rank for k, d in dims.items() if rank is not None and rank < d}
        else:
            f = resolve("factor_update_interval", self.config.factor_update_interval, 0)
            k = resolve("inverse_update_interval", self.config.inverse_update_interval, 0)
            assert f is not None and k is not None
            choice = choose_method(
                dims["A"],
                dims["G"],
                rank or dims["A"],
                rank or dims["G"],
                factor_update_interval=int(f),
                inverse_update_interval=int(k),
            )
            method = choice.method
            picked = {"A": choice.a, "G": choice.g}
            sides = {
                key: rank for key, kind in picked.items() if kind == "lowrank" and rank is not None
            }
        self.apply(layer, method, sides)
        logger.info(
            "%s: method %s (rows per step %s, bounded rank %s, a_dim %d, g_dim %d)",
            block.name,
            layer.method_label,
            None if rows is None else rows * self.config.accumulation_steps * self.gathered_ranks,
            rank,
            dims["A"],
            dims["G"],
        )

    def apply(self, layer: LayerState, method: str, sides: dict[str, int]) -> None:
        """Installs a decision: solver, low-rank sides and their accumulators."""
        dtype = self.config.factor_dtype or layer.block.parameters()[0].dtype
        if layer.solver.name != method:
            layer.solver = make_solver(method, self.config.eigen_dtype)
        layer.lowrank = dict(sides)
        layer.accumulators = {
            key: LowRankRowsAccumulator(dtype)
            if key in sides
            else FactorAccumulator(dtype, self.config.capture_dtype)
            for key in ("A", "G")
        }
        layer.method_label = describe_method(method, sides)

    def restore(self, layer: LayerState, saved: dict[str, Any]) -> None:
        """Applies a decision saved by :func:`decision` (checkpoints)."""
        self.apply(layer, str(saved["solver"]), {k: int(v) for k, v in saved["lowrank"].items()})


def describe_method(method: str, sides: dict[str, int]) -> str:
    """``smw(A=lowrank,G=dense)`` for the SMW solver, else the method's name."""
    if method != "smw":
        return method
    kinds = {key: "lowrank" if key in sides else "dense" for key in ("A", "G")}
    return f"smw(A={kinds['A']},G={kinds['G']})"


def decision(layer: LayerState) -> dict[str, Any] | None:
    """The layer's saved form of its decision; ``None`` while pending or not planned."""
    if not layer.method_label or layer.method_label.endswith(f"({PENDING})"):
        return None
    return {"solver": layer.solver.name, "lowrank": dict(layer.lowrank)}
