"""The control messages of a :class:`~dkfac.distributed.comm.Communicator`: the few blocking
bytes per step that keep ranks in agreement, which the byte ledger does not count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ControlMessages"]


class ControlMessages:
    """Blocking control collectives over ``group``, local when not ``active``.

    A few bytes per step that keep ranks in agreement (finite flags, KL-clip partial sums,
    shapes of solver states). They are blocking and NOT recorded in the ledger, which counts
    only the payload kinds in :data:`~dkfac.distributed.ledger.KINDS`.

    Attributes:
        group: Process group; ``None`` means the default group.
        world_size: Number of ranks in the group.
        active: False when every operation is a local no-op (no process group, or 1 rank).
    """

    group: dist.ProcessGroup | None
    world_size: int
    active: bool

    def all_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical AND of a boolean vector across the group (blocking).

        Args:
            flags: 1-D bool tensor, the same length on every rank.

        Returns:
            A bool tensor on ``flags``' device, ``True`` where every rank had ``True``.
        """
        if flags.dtype != torch.bool:
            raise TypeError(f"flags must be a bool tensor, got {flags.dtype}")
        if not self.active:
            return flags.clone()
        bad = (~flags).to(torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=self.group)
        return bad == 0

    def sum_control(self, values: Tensor) -> Tensor:
        """Sum of a small floating tensor over the group (blocking, not in the ledger)."""
        out = values.clone()
        if self.active:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def exchange_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, indexed by rank in ``group`` (blocking)."""
        if not self.active:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
