"""Fault injection for reliability tests of the training program (off unless asked for).

The trainer calls :func:`maybe_inject` after every optimizer step. Environment variables:

* ``DKFAC_FAULT_KILL_AT_STEP=N``: the chosen rank sends itself ``SIGKILL`` once step ``N``
  is done (before that step's checkpoint is written), as a node failure would.
* ``DKFAC_FAULT_RAISE_AT_STEP=N``: the chosen rank raises :class:`InjectedFaultError` there.
* ``DKFAC_FAULT_HANG_AT_STEP=N``: the chosen rank sleeps forever there (a stuck rank).
* ``DKFAC_FAULT_RANK=r``: the rank that fails (default 0).

Faults fire only in the first attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT``
unset or ``0``), so a job restarted by ``torchrun --max-restarts K`` runs to the end.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping

logger = logging.getLogger(__name__)

KILL = "DKFAC_FAULT_KILL_AT_STEP"
RAISE = "DKFAC_FAULT_RAISE_AT_STEP"
HANG = "DKFAC_FAULT_HANG_AT_STEP"
RANK = "DKFAC_FAULT_RANK"
RESTARTS = "TORCHELASTIC_RESTART_COUNT"


class InjectedFaultError(RuntimeError):
    """The failure that ``DKFAC_FAULT_RAISE_AT_STEP`` asks for."""


def _step_of(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer step, got {text!r}") from None


def maybe_inject(step: int, rank: int, env: Mapping[str, str] | None = None) -> None:
    """Fails as the ``DKFAC_FAULT_*`` variables say, if ``step`` and ``rank`` match.

    Args:
        step: Optimizer steps completed so far.
        rank: This process's rank.
        env: The environment (default ``os.environ``).

    Raises:
        InjectedFaultError: For ``DKFAC_FAULT_RAISE_AT_STEP``.
        ValueError: If a variable is not an integer.
    """
    env = os.environ if env is None else env
    if not any(env.get(k) for k in (KILL, RAISE, HANG)):
        return
    kill, fail, hang = (_step_of(env, name) for name in (KILL, RAISE, HANG))
    if int(env.get(RESTARTS, "0") or 0) != 0 or rank != (_step_of(env, RANK) or 0):
        return
    if kill == step:
        logger.warning("fault injection: rank %d kills itself (SIGKILL) at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)
    if fail == step:
        raise InjectedFaultError(f"fault injection: rank {rank} raises at step {step} ({RAISE})")
    if hang == step:
        logger.warning("fault injection: rank %d hangs at step %d", rank, step)
        while True:
            time.sleep(60)
