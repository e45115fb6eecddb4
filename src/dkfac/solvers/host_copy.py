"""Host reads of solver state: where one waits for nothing, and a device flag read later.

Reading a CUDA tensor on the host waits for every kernel queued before it. A decision that
can wait for the next refresh (the null-space floor of :mod:`dkfac.solvers.null_space`)
starts a copy of its flag into pinned host memory behind an event instead, and reads that
copy when it is needed: by then the event has long passed, so the read does not wait for
the work queued since. On a CPU the copy is a clone. The values read are the same either
way; this module is the only place a solver reads such a copy.

On a device of :data:`HOST_COUNT_DEVICES` (a CPU) a read waits for nothing, so there the
solvers read what they need at once (:func:`host_reads_now`): a layer's moment count for its
bias corrections, and a refresh's null indicators from its own state.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HOST_COUNT_DEVICES", "HostFlag", "host_reads_now"]

HOST_COUNT_DEVICES = frozenset({"cpu"})
"""Device types where a read waits for nothing: a layer's moment count is read there as a
number for its bias corrections
(:meth:`~dkfac.solvers.eigen_moments.EigenMomentsSolver.correction`), and a refresh's null
indicators are decided from its own state
(:meth:`~dkfac.solvers.eigen_basis.EigenBasisSolver.completed`)."""


def host_reads_now(tensor: Tensor) -> bool:
    """Whether a host read on ``tensor``'s device waits for nothing
    (:data:`HOST_COUNT_DEVICES`)."""
    return tensor.device.type in HOST_COUNT_DEVICES


class HostFlag:
    """A copy of a bool tensor (0-d, or a flag a layer) on its way to the host (module notes).

    Args:
        flag: The flag, on any device.
    """

    def __init__(self, flag: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if flag.is_cuda:
            self._host = torch.empty(flag.shape, dtype=torch.bool, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag.detach().to(torch.bool).clone()

    def read(self, index: int | None = None) -> bool:
        """The flag, or entry ``index`` of a vector of them (waits for the copy only if it
        has not arrived yet)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        values = self._host.tolist()
        return bool(values if index is None else values[index])
