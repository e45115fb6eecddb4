"""The refresh's check of new solver states, left on the device.

On a CPU each solver checks the state it computes on the host
(:meth:`~dkfac.solvers.base.Solver.with_retry`): a non-finite result is computed again in
float64, and one that fails there too is refused, the layer keeping its last good state
with a warning. On a CUDA device each of those checks is a host synchronisation in the
middle of the refresh step. With the flags on the device
(:attr:`~dkfac.preconditioner.KFACPreconditioner.flags_on_device`), a layer that already has
a state is refreshed unchecked instead (:attr:`~dkfac.solvers.base.Solver.host_checks`
off: :func:`~dkfac.solvers.base.unchecked`), and :func:`hold_states` selects, on the
device, each new state where all of its tensors are finite and the layer's last state
elsewhere (``torch.where``,
as the step's guard holds statistics: :mod:`~dkfac.engine.device_checks`); the warning is
logged a step late (:class:`~dkfac.engine.device_checks.LateWarnings`).

What differs from the host path, and only where a decomposition fails: no float64 retry
(deciding to retry is a read), so the layer keeps its last state until the next refresh.
A layer's first state (nothing to keep) is checked on the host, as the guard reads the
flags of a layer's first capture. A decomposition that raises (LAPACK's non-convergence on
a CPU) still retries, as an error needs no read; on a CUDA device ``torch.linalg.eigh``
itself checks its convergence on the host, which only a ``"power"`` refresh (a product
and a QR) avoids.

Read-free this way (tested with an instrumented run, ``tests/engine/test_device_checks.py``):
the refreshes of ``"eigen"``, ``"cholesky"``, ``"eigen_adam"`` and ``"ekfac"`` (``"eigh"``
and ``"power"`` bases, structured and block-diagonal ones, null spaces included) and of
BatchNorm's unit-wise state. Still read on the host: a layer's first refresh (the first
decomposition of a wide factor tries :func:`~dkfac.solvers.basis_refresh.range_eigh`,
whose acceptance is a read), the low-rank (SMW) solvers' states, and the adaptive refresh
policy's intervals (that policy keeps the flags on the host altogether).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from dkfac.engine import launches
from dkfac.engine.device_checks import LateWarnings, select_where
from dkfac.engine.finite import finite_each
from dkfac.engine.layer_state import LayerState
from dkfac.solvers import SolverState

__all__ = ["STATE_KEPT", "StateHold", "hold_states"]

logger = logging.getLogger(__name__)

STATE_KEPT = "step %d: non-finite solver state of %s; keeping the last good inverse"
"""The warning for a refresh whose new state was not finite (step, layer)."""


class StateHold:
    """:func:`hold_states` with the preconditioner's late warnings and the step.

    Args:
        late: Where the warnings wait for their flags.
        step: The step of the refresh (in the warnings).
    """

    def __init__(self, late: LateWarnings, step: int) -> None:
        self.late = late
        self.step = step

    def __call__(
        self,
        layers: Mapping[str, LayerState],
        previous: Mapping[str, SolverState | None],
        names: Sequence[str],
    ) -> None:
        hold_states(layers, previous, names, self.late, self.step)


def hold_states(
    layers: Mapping[str, LayerState],
    previous: Mapping[str, SolverState | None],
    names: Sequence[str],
    late: LateWarnings,
    step: int,
) -> None:
    """Replaces each named layer's new ``solver_state`` by its last one (``previous``)
    where any of its tensors is not finite, on the device, and records the warnings.

    A state whose tensors do not match the last one's (names, shapes, dtypes: another
    layout) is checked on the host instead (a read, and an immediate warning).
    """
    matched: list[tuple[str, list[str]]] = []
    for name in names:
        new, old = layers[name].solver_state, previous[name]
        if new is None or old is None:
            continue
        kept = layers[name].solver.shared(old)
        if kept.keys() == new.keys() and all(
            (new[k].shape, new[k].dtype, new[k].device)
            == (kept[k].shape, kept[k].dtype, kept[k].device)
            for k in new
        ):
            matched.append((name, list(new)))
        elif not bool(finite_each(list(new.values()), _device(layers[name]), squares=False).all()):
            logger.warning(STATE_KEPT, step, name)
            layers[name].solver_state = old
    if not matched:
        return
    device = _device(layers[matched[0][0]])
    tensors, olds, owners = [], [], []
    for i, (name, keys) in enumerate(matched):
        new, old = layers[name].solver_state, previous[name]
        assert new is not None and old is not None
        tensors += [new[k] for k in keys]
        olds += [old[k] for k in keys]
        owners += [i] * len(keys)
    bad = (~finite_each(tensors, device, squares=False)).long()
    failed = torch.zeros(len(matched), dtype=torch.int64, device=device)
    failed.index_add_(0, launches.device_constant(tuple(owners), device), bad)
    ok = failed == 0
    chosen = iter(select_where(ok, owners, tensors, olds, aligned=True))
    for name, keys in matched:
        layers[name].solver_state = {k: next(chosen) for k in keys}
    messages = [STATE_KEPT.replace("%s", name.replace("%", "%%")) for name, _ in matched]
    late.record(step, ok, messages)


def _device(layer: LayerState) -> torch.device:
    return layer.block.parameters()[0].device
