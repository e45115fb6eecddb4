"""When each statistic is refreshed: fixed intervals or SP-NGD's adaptive stale statistics.

A *statistic* is one factor of one layer (``"conv1/A"``, ``"conv1/G"``, a BatchNorm Fisher,
...). A refresh policy answers, at every step, which statistics are due; the preconditioner
captures and communicates only those, so a skipped statistic costs nothing on that step.

* :class:`FixedRefresh`: every statistic is due when ``step % interval == 0``, with
  ``interval`` a constant or a schedule of the step (``factor_update_interval``).
* :class:`AdaptiveRefresh` (Osawa et al., SP-NGD): every statistic keeps its own interval
  ``Δ``. When it is refreshed, the relative change since its previous refresh,
  ``‖X_new − X_old‖_F / ‖X_old‖_F``, is compared with a threshold ``α``: below it the
  statistic is deemed stable and ``Δ ← min(2Δ, max_interval)``; otherwise
  ``Δ ← max(1, Δ // 2)``. The next refresh is due ``Δ`` steps later.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dkfac.config import Schedule, check_int, check_range, resolve

REFRESH_POLICIES = ("fixed", "adaptive")


def make_refresh_policy(
    kind: str, interval: Schedule, threshold: float = 0.1, max_interval: int = 64
) -> RefreshPolicy:
    """The policy named ``kind``: ``"fixed"`` (every ``interval`` steps) or ``"adaptive"``.

    Raises:
        ValueError: For an unknown kind or a bad threshold / maximum interval.
    """
    if kind == "fixed":
        return FixedRefresh(interval)
    if kind == "adaptive":
        return AdaptiveRefresh(threshold=threshold, max_interval=max_interval)
    raise ValueError(f"refresh must be one of {REFRESH_POLICIES}, got {kind!r}")


def relative_change(old: Tensor, new: Tensor) -> float:
    """``‖new − old‖_F / ‖old‖_F`` (infinite when ``old`` is zero and ``new`` is not), the
    norms taken in float64 (:func:`_norm`)."""
    return _ratio(float(_norm(new - old)), float(_norm(old)))


def _norm(tensor: Tensor) -> Tensor:
    """The Frobenius norm in float64: a float32 factor's entries may pass 10¹⁹ (inputs near
    10¹⁰, :mod:`~dkfac.engine.finite`), whose squares overflow float32; its norm would be
    Inf and every relative change 0 (the interval doubled whatever the factor did)."""
    return torch.linalg.vector_norm(tensor, dtype=torch.float64)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else math.inf
    return numerator / denominator


class RefreshPolicy(ABC):
    """Decides which statistics are refreshed at each step."""

    @abstractmethod
    def due(self, key: str, step: int) -> bool:
        """Whether statistic ``key`` is captured at ``step``."""

    def due_keys(self, layer: str, keys: Sequence[str], step: int) -> frozenset[str]:
        """Which of layer ``layer``'s statistics ``keys`` are captured at ``step``
        (:meth:`due` of each ``"<layer>/<key>"``)."""
        return frozenset(key for key in keys if self.due(f"{layer}/{key}", step))

    def record(self, key: str, step: int, old: Tensor | None, new: Tensor) -> None:  # noqa: B027
        """Tells the policy that ``key`` was refreshed at ``step`` from ``old`` to ``new``."""

    def record_many(
        self, step: int, refreshed: Sequence[tuple[str, Tensor | None, Tensor]]
    ) -> None:
        """:meth:`record` for every ``(key, old, new)`` refreshed at ``step``."""
        for key, old, new in refreshed:
            self.record(key, step, old, new)

    def state_dict(self) -> dict[str, object]:
        """The policy's mutable state (empty for stateless policies)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:  # noqa: B027
        """Restores :meth:`state_dict`."""


class FixedRefresh(RefreshPolicy):
    """Every statistic is refreshed every ``interval`` steps (a constant or a schedule).

    Args:
        interval: ``factor_update_interval``: an integer >= 1 or a callable of the step.
    """

    def __init__(self, interval: Schedule) -> None:
        self.interval = interval
        self._last: tuple[int, Schedule, bool] | None = None  # (step, interval, due)

    def due(self, key: str, step: int) -> bool:
        """``step % interval(step) == 0``."""
        value = resolve("factor_update_interval", self.interval, step)
        assert value is not None
        return step % int(value) == 0

    def due_keys(self, layer: str, keys: Sequence[str], step: int) -> frozenset[str]:
        """All of ``keys`` or none: one interval for every statistic, resolved once a
        step (the last answer is kept for its step and interval)."""
        last = self._last
        if last is None or last[0] != step or last[1] is not self.interval:
            last = self._last = (step, self.interval, self.due(layer, step))
        return frozenset(keys) if last[2] else frozenset()


@dataclass
class _Entry:
    interval: int = 1
    next_step: int = 0
    refreshes: int = 0


@dataclass
class AdaptiveRefresh(RefreshPolicy):
    """SP-NGD's stale statistics: a per-statistic interval doubled or halved at each refresh.

    Attributes:
        threshold: ``α``: a relative Frobenius change below it doubles the interval.
        max_interval: Upper bound of any interval.
    """

    threshold: float = 0.1
    max_interval: int = 64
    _entries: dict[str, _Entry] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_range("refresh_threshold", self.threshold, low=0.0)
        check_int("refresh_max_interval", self.max_interval)

    def _entry(self, key: str) -> _Entry:
        return self._entries.setdefault(key, _Entry())

    def due(self, key: str, step: int) -> bool:
        """Whether ``key``'s next refresh step has been reached."""
        return step >= self._entry(key).next_step

    def interval(self, key: str) -> int:
        """The current interval of ``key``."""
        return self._entry(key).interval

    def set_interval(self, key: str, step: int, interval: int) -> None:
        """Sets ``key``'s interval after a refresh at ``step`` (agreement between ranks)."""
        entry = self._entry(key)
        entry.interval = int(interval)
        entry.next_step = step + entry.interval

    def record(self, key: str, step: int, old: Tensor | None, new: Tensor) -> None:
        """Doubles or halves ``key``'s interval from the change between ``old`` and ``new``."""
        self._update(key, step, None if old is None else relative_change(old, new))

    def record_many(
        self, step: int, refreshed: Sequence[tuple[str, Tensor | None, Tensor]]
    ) -> None:
        """:meth:`record` for all of them with one host synchronisation (not one per key)."""
        pairs = [(old, new) for _, old, new in refreshed if old is not None]
        norms: list[list[float]] = []
        if pairs:
            device = pairs[0][0].device
            stacked = [torch.stack([_norm(old), _norm(new - old)]).to(device) for old, new in pairs]
            norms = torch.stack(stacked).tolist()
        values = iter(norms)
        for key, old, _ in refreshed:
            change = None
            if old is not None:
                denominator, numerator = next(values)
                change = _ratio(numerator, denominator)
            self._update(key, step, change)

    def _update(self, key: str, step: int, change: float | None) -> None:
        """Doubles or halves the interval from the relative ``change`` (None: first value)."""
        entry = self._entry(key)
        if change is not None:
            if change < self.threshold:
                entry.interval = min(2 * entry.interval, self.max_interval)
            else:
                entry.interval = max(1, entry.interval // 2)
        entry.next_step = step + entry.interval
        entry.refreshes += 1

    def state_dict(self) -> dict[str, object]:
        """Intervals and next refresh steps by statistic."""
        return {
            key: [entry.interval, entry.next_step, entry.refreshes]
            for key, entry in self._entries.items()
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores :meth:`state_dict`."""
        self._entries = {}
        for key, value in state.items():
            if not isinstance(value, (list, tuple)) or len(value) != 3:
                raise ValueError(f"bad adaptive refresh state for {key!r}: {value!r}")
            self._entries[key] = _Entry(*(int(v) for v in value))
