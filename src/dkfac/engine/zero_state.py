"""A checkpoint gathered on one rank: ZeRO's rule, which Lightning and Fabric follow.

``torch.distributed.optim.ZeroRedundancyOptimizer`` checkpoints in two calls:
``consolidate_state_dict(to=r)`` on every rank (a collective that gathers the optimizer's
shards on rank ``r``), then ``state_dict()`` on rank ``r`` alone (it raises elsewhere).
Lightning and Fabric save any optimizer that has ``consolidate_state_dict`` that way.
:meth:`~dkfac.KFACOptimizer.state_dict` must hold K-FAC's part too, which is gathered from
the layers' owners, another collective: gathered inside ``state_dict()`` it would leave rank
``r`` waiting for ranks that do not call it. So :meth:`~dkfac.KFACOptimizer.consolidate_state_dict`
gathers K-FAC's part (and ZeRO's shards, with ZeRO inside) and keeps it on rank ``r`` until
the next step; ``state_dict()`` there runs no collective. Without a consolidation,
``state_dict()`` gathers on every rank, except with ZeRO inside, whose own
``state_dict()`` needs one.
"""

from __future__ import annotations

import sys
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
    """Whether ``inner`` is ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    Read from the module only where something imported it already (no instance exists
    otherwise): importing ``torch.distributed.optim`` scripts functions with
    ``torch.jit.script``, which warns of its deprecation, an error under
    ``-W error::DeprecationWarning``.
    """
    module = sys.modules.get(_ZERO_MODULE)
    return module is not None and isinstance(inner, module.ZeroRedundancyOptimizer)


_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"
"""Where ``ZeroRedundancyOptimizer`` is defined."""


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
    """K-FAC's gathered state kept on rank ``to``, after ZeRO's ``consolidate_state_dict(to)``
    where ``inner`` is ZeRO (collectives: every rank calls it).

    Raises:
        TypeError: If ``to`` is not an int.
    """
    if isinstance(to, bool) or not isinstance(to, int):
        raise TypeError(f"to must be a rank (int), got {type(to).__name__}")
    if is_zero(inner):
        inner.consolidate_state_dict(to=to)  # type: ignore[attr-defined]
    state = preconditioner.state_dict(include_inverses=True)
    mine = dist.get_rank() == to if dist.is_initialized() else True
    return Consolidated(to, preconditioner.steps, state if mine else None)


def kfac_part(
    inner: Optimizer, preconditioner: _Preconditioner, kept: Consolidated | None
) -> dict[str, Any]:
    """K-FAC's part of :meth:`~dkfac.KFACOptimizer.state_dict`: the part :func:`consolidate`
    kept on this rank since the last step, else gathered now (a collective: every rank
    calls it), except under ZeRO.

    Raises:
        RuntimeError: Under ZeRO, before any collective, when this rank holds no part
            consolidated since the last step.
    """
    if kept is not None and kept.steps == preconditioner.steps and kept.state is not None:
        return kept.state
    if not is_zero(inner):
        return preconditioner.state_dict(include_inverses=True)
    where = ""
    if kept is not None and kept.steps == preconditioner.steps:
        where = f" (it was consolidated on rank {kept.to}, not on this one)"
    raise RuntimeError(
        "state_dict() with a ZeroRedundancyOptimizer inside: call "
        "opt.consolidate_state_dict(to=r) on every rank first (it gathers ZeRO's shards and "
        "K-FAC's state), then opt.state_dict() on rank r only, as ZeRO's own state_dict() "
        f"requires{where}"
    )
