"""The refresh group: :class:`RefreshConfig`, when statistics and inverses are recomputed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from dkfac.config.checks import check_choice, check_int, check_range, python_numbers
from dkfac.config.schedules import Schedule, check_schedules

__all__ = ["REFRESH_KINDS", "RefreshConfig", "RefreshKind"]

RefreshKind = Literal["fixed", "adaptive"]
REFRESH_KINDS: tuple[str, ...] = get_args(RefreshKind)


@dataclass(frozen=True, kw_only=True)
class RefreshConfig:
    """When statistics and inverses are recomputed.

    Attributes:
        factor_update_interval: Steps between factor updates (>= 1, constant or schedule).
        inverse_update_interval: Steps between inverse updates (>= 1, constant or schedule).
        refresh: ``"fixed"`` (all statistics every ``factor_update_interval`` steps) or
            ``"adaptive"`` (SP-NGD stale statistics: each statistic's own interval, doubled
            when its relative Frobenius change is below ``refresh_threshold`` and halved
            otherwise; ``factor_update_interval`` is then unused).
        refresh_threshold: α of the adaptive policy, a finite number > 0 (SP-NGD's: 0.1).
        refresh_max_interval: Cap of an adaptive interval, an integer >= 1.
    """

    factor_update_interval: Schedule = 1
    inverse_update_interval: Schedule = 10
    refresh: RefreshKind = "fixed"
    refresh_threshold: float = 0.1
    refresh_max_interval: int = 64

    def __post_init__(self) -> None:
        python_numbers(self)
        self._check_refresh()

    def _check_refresh(self) -> None:
        check_schedules(self, ("factor_update_interval", "inverse_update_interval"))
        check_choice("refresh", self.refresh, REFRESH_KINDS)
        check_range("refresh_threshold", self.refresh_threshold, low=0.0)
        check_int("refresh_max_interval", self.refresh_max_interval)
