"""``dkfac plan --parallel fsdp|hsdp``: bytes per step and memory per rank of a sharded model.

One row for AdamW under FSDP2 and one per K-FAC strategy offered for sharded models
(:mod:`dkfac.costmodel.sharded`): K-FAC's ledger bytes per step (the gradient exchange and
the strategy's traffic, amortised over the factor and inverse intervals, the largest rank),
FSDP2's own bytes per step (parameter all-gathers, gradient reduce-scatter, HSDP's replica
all-reduce), the model state per rank (the largest rank's shard of parameters, gradients and
optimizer states: AdamW two moments, K-FAC's SGD one momentum), K-FAC's curvature per rank
and the full gradients gathered during ``step()``. The recommendation is the K-FAC strategy
with the fewest bytes per step whose memory fits the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dkfac.costmodel import DtypeBytes, ModelSpec
from dkfac.costmodel.sharded import (
    SHARDED_STRATEGIES,
    fsdp_bytes,
    gathered_gradient_bytes,
    predict_sharded_ledger_bytes,
    predict_sharded_memory,
    sharded_state_bytes,
)

__all__ = ["ShardedRow", "align_table", "recommend_sharded", "sharded_rows", "sharded_table"]


@dataclass(frozen=True)
class ShardedRow:
    """One optimizer's predicted cost on a sharded model (bytes; per rank, per step).

    Attributes:
        label: ``"adamw"`` or the K-FAC strategy (with its fraction for kaisa).
        ledger: K-FAC's ledger bytes per step, amortised, the largest rank.
        fsdp: FSDP2's own bytes per step.
        model_state: Parameters, gradients and optimizer states on the largest rank.
        kfac_memory: K-FAC's curvature on the largest rank.
        transient: Full gradients every rank holds during ``step()``.
    """

    label: str
    ledger: float
    fsdp: int
    model_state: int
    kfac_memory: int
    transient: int

    @property
    def total_bytes(self) -> float:
        """Bytes per step, K-FAC's and FSDP2's."""
        return self.ledger + self.fsdp

    @property
    def memory(self) -> int:
        """Peak bytes per rank counted here."""
        return self.model_state + self.kfac_memory + self.transient


def _amortised(spec: ModelSpec, world: int, strategy: str, **kw: Any) -> float:
    """The largest rank's ledger bytes per step over the factor and inverse intervals."""
    factor_interval, inverse_interval = kw.pop("factor_interval"), kw.pop("inverse_interval")
    full = predict_sharded_ledger_bytes(spec, world, strategy, **kw)
    factors = predict_sharded_ledger_bytes(spec, world, strategy, inverse_step=False, **kw)
    plain = predict_sharded_ledger_bytes(
        spec, world, strategy, inverse_step=False, factor_step=False, **kw
    )

    def rank_bytes(rank: int) -> float:
        total = [sum(step[rank].values()) for step in (plain, factors, full)]
        return (
            total[0]
            + (total[1] - total[0]) / factor_interval
            + (total[2] - total[1]) / inverse_interval
        )

    return max(rank_bytes(r) for r in range(world))


def sharded_rows(
    spec: ModelSpec,
    world: int,
    *,
    shard_size: int | None,
    strategies: Sequence[tuple[str, float]],
    method: str,
    dtypes: DtypeBytes,
    factor_interval: int,
    inverse_interval: int,
) -> list[ShardedRow]:
    """AdamW's row, then one per offered strategy of ``strategies`` (others are dropped).

    Raises:
        ValueError: For a shard size that does not divide the world size.
    """
    frame = fsdp_bytes(spec, world, shard_size=shard_size, grad_bytes=dtypes.grad)
    traffic = sum(frame.values())

    def state(moments: int) -> int:
        parts = sharded_state_bytes(
            spec, world, shard_size=shard_size, optimizer_states=moments, grad_bytes=dtypes.grad
        )
        return sum(parts.values())

    rows = [ShardedRow("adamw", 0.0, traffic, state(2), 0, 0)]
    for strategy, fraction in strategies:
        if strategy not in SHARDED_STRATEGIES:
            continue
        kw: dict[str, Any] = {"grad_worker_fraction": fraction, "method": method}
        memory = predict_sharded_memory(spec, world, strategy, dtypes=dtypes, **kw)
        ledger = _amortised(
            spec,
            world,
            strategy,
            shard_size=shard_size,
            dtypes=dtypes,
            factor_interval=factor_interval,
            inverse_interval=inverse_interval,
            **kw,
        )
        label = f"kaisa(f={fraction:g})" if strategy == "kaisa" else strategy
        rows.append(
            ShardedRow(
                f"kfac {label}",
                ledger,
                traffic,
                state(1),
                max(sum(m.values()) for m in memory.values()),
                gathered_gradient_bytes(spec, dtypes),
            )
        )
    return rows


def recommend_sharded(rows: Sequence[ShardedRow], budget: float | None) -> ShardedRow | None:
    """The K-FAC row with the fewest bytes per step whose memory fits ``budget``."""
    fitting = [r for r in rows if r.label != "adamw" and (budget is None or r.memory <= budget)]
    return min(fitting, key=lambda r: r.total_bytes, default=None)


def sharded_table(rows: Sequence[ShardedRow], budget: float | None) -> str:
    """The rows as an aligned text table (MB)."""
    headers = [
        "optimizer",
        "ledger MB",
        "FSDP MB",
        "total MB",
        "state MB",
        "K-FAC mem MB",
        "step grads MB",
        "fits",
    ]
    table = [headers]
    for r in rows:
        fits = "yes" if budget is None or r.memory <= budget else "NO"
        values = (r.ledger, r.fsdp, r.total_bytes, r.model_state, r.kfac_memory, r.transient)
        table.append([r.label, *(f"{v / 1e6:.2f}" for v in values), fits])
    return align_table(table)


def align_table(rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns, a rule under the first row (the headers)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
