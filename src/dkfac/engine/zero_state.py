"""K-FAC's part of a checkpoint when the inner optimizer is a ``ZeroRedundancyOptimizer``.

ZeRO's rule for a checkpoint: ``consolidate_state_dict(to=r)`` on every rank (a
collective that gathers the optimizer's shards on rank ``r``), then ``state_dict()`` on rank
``r`` alone (it raises elsewhere). :meth:`~dkfac.KFACOptimizer.state_dict` must hold K-FAC's
part too, which is gathered from the layers' owners, another collective. Gathered inside
``state_dict()`` it would leave rank ``r`` waiting for ranks that do not call it (ZeRO's
rule), or that raised in ZeRO's ``state_dict()`` first. So K-FAC's part is gathered where
ZeRO gathers its own, in :meth:`~dkfac.KFACOptimizer.consolidate_state_dict`, and kept on
rank ``r`` until the next step; ``state_dict()`` then runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["Consolidated", "consolidate", "is_zero", "kfac_part"]


class _Preconditioner(Protocol):
    """What is read of a :class:`~dkfac.KFACPreconditioner`."""

    @property
    def steps(self) -> int: ...

    def state_dict(self, include_inverses: bool = False, gather: bool = True) -> dict[str, Any]: ...


def is_zero(inner: Optimizer) -> bool:
    """Whether ``inner`` is ``torch.distributed.optim.ZeroRedundancyOptimizer``."""
    if not dist.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(inner, ZeroRedundancyOptimizer)


@dataclass(frozen=True)
class Consolidated:
    """What :func:`consolidate` kept.

    Attributes:
        to: The rank the state was consolidated on.
        steps: The preconditioner's step count then (a later step makes it stale).
        state: K-FAC's part on rank ``to``, ``None`` on the others.
    """

    to: int
    steps: int
    state: dict[str, Any] | None


def consolidate(inner: Optimizer, preconditioner: _Preconditioner, to: int) -> Consolidated:
    """ZeRO's ``consolidate_state_dict(to)`` and K-FAC's gathered state (collectives: every
    rank calls it).

    Raises:
        TypeError: If ``inner`` is not a ``ZeroRedundancyOptimizer`` or ``to`` not an int.
    """
    if not is_zero(inner):
        raise TypeError(
            "consolidate_state_dict() is ZeroRedundancyOptimizer's; the inner optimizer is "
            f"{type(inner).__name__}, whose state_dict() needs no consolidation: call "
            "state_dict() on every rank"
        )
    if isinstance(to, bool) or not isinstance(to, int):
        raise TypeError(f"to must be a rank (int), got {type(to).__name__}")
    inner.consolidate_state_dict(to=to)  # type: ignore[attr-defined]
    state = preconditioner.state_dict(include_inverses=True)
    mine = dist.get_rank() == to if dist.is_initialized() else True
    return Consolidated(to, preconditioner.steps, state if mine else None)


def kfac_part(
    inner: Optimizer, preconditioner: _Preconditioner, kept: Consolidated | None
) -> dict[str, Any]:
    """K-FAC's part of :meth:`~dkfac.KFACOptimizer.state_dict`: gathered now (a
    collective), or under ZeRO the part :func:`consolidate` kept on this rank.

    Raises:
        RuntimeError: Under ZeRO, before any collective, when this rank holds no part
            consolidated since the last step.
    """
    if not is_zero(inner):
        return preconditioner.state_dict(include_inverses=True)
    if kept is not None and kept.steps == preconditioner.steps and kept.state is not None:
        return kept.state
    where = ""
    if kept is not None and kept.steps == preconditioner.steps:
        where = f" (it was consolidated on rank {kept.to}, not on this one)"
    raise RuntimeError(
        "state_dict() with a ZeroRedundancyOptimizer inside: call "
        "opt.consolidate_state_dict(to=r) on every rank first (it gathers ZeRO's shards and "
        "K-FAC's state), then opt.state_dict() on rank r only, as ZeRO's own state_dict() "
        f"requires{where}"
    )
