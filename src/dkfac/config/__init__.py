"""Configuration of the K-FAC preconditioner, grouped by concern.

:class:`KFACConfig` is the four groups in one frozen, keyword-only dataclass. Each group is
a frozen, keyword-only dataclass in its own module that validates its own fields:
:class:`SolverConfig` (method, damping, KL-clip; :mod:`dkfac.config.solver`),
:class:`EstimationConfig` (Fisher type, decay, dtypes, which layers, convolution reductions;
:mod:`dkfac.config.estimation`), :class:`DistributionConfig` (strategy and its
communication; :mod:`dkfac.config.distribution`) and :class:`RefreshConfig` (update
intervals, adaptive refresh; :mod:`dkfac.config.refresh`). Every field is a flat keyword
argument and attribute (``KFACConfig(damping=0.01, strategy="kaisa")``); the groups can also
be built apart and joined with :meth:`KFACConfig.from_groups`, and read back as groups
(``config.solver_config``).

Every hyperparameter that may change during training is a :data:`Schedule` (a constant or a
callable of the step; :mod:`dkfac.config.schedules`), validated when resolved.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any, TypeVar

from dkfac.config.checks import (
    check_bool,
    check_choice,
    check_dtype,
    check_int,
    check_range,
    python_numbers,
)
from dkfac.config.distribution import (
    OVERLAP_MODES,
    PLACEMENT_COSTS,
    SHARD_EXCHANGES,
    STRATEGY_CHOICES,
    DistributionConfig,
    OverlapMode,
    PlacementCost,
    ShardExchange,
    StrategyChoice,
)
from dkfac.config.estimation import FISHER_TYPES, EstimationConfig, FisherType
from dkfac.config.refresh import REFRESH_KINDS, RefreshConfig, RefreshKind
from dkfac.config.schedules import SCHEDULE_DOMAINS, Schedule, check_schedule_value, resolve
from dkfac.config.solver import (
    LEFTOVER_UPDATES,
    METHODS,
    LeftoverUpdate,
    Method,
    SolverConfig,
    leftover_adam,
    unread_moment_fields,
)

__all__ = [
    "FISHER_TYPES",
    "GROUPS",
    "LEFTOVER_UPDATES",
    "METHODS",
    "OVERLAP_MODES",
    "PLACEMENT_COSTS",
    "REFRESH_KINDS",
    "SCHEDULE_DOMAINS",
    "SHARD_EXCHANGES",
    "STRATEGY_CHOICES",
    "DistributionConfig",
    "EstimationConfig",
    "FisherType",
    "KFACConfig",
    "LeftoverUpdate",
    "Method",
    "OverlapMode",
    "PlacementCost",
    "RefreshConfig",
    "RefreshKind",
    "Schedule",
    "ShardExchange",
    "SolverConfig",
    "StrategyChoice",
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_int",
    "check_range",
    "check_schedule_value",
    "leftover_adam",
    "resolve",
    "unknown_options",
    "unread_moment_fields",
]

GROUPS: tuple[type, ...] = (SolverConfig, EstimationConfig, DistributionConfig, RefreshConfig)
"""The concerns, in the order of :class:`KFACConfig`'s fields."""

_Group = TypeVar("_Group", SolverConfig, EstimationConfig, DistributionConfig, RefreshConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KFACConfig(RefreshConfig, DistributionConfig, EstimationConfig, SolverConfig):
    """Hyperparameters of :class:`~dkfac.KFACPreconditioner`: the fields of the four groups.

    See :class:`SolverConfig`, :class:`EstimationConfig`, :class:`DistributionConfig` and
    :class:`RefreshConfig` for each field; every one is a keyword argument here.

    Raises:
        TypeError, ValueError: For a field outside its domain (the message names it).
    """

    def __post_init__(self) -> None:
        python_numbers(self)
        self._check_solver()
        self._check_estimation()
        self._check_distribution()
        self._check_refresh()

    @classmethod
    def from_groups(cls, *groups: Any, **fields: Any) -> KFACConfig:
        """Joins groups (and flat fields for the rest) into one configuration.

        Args:
            *groups: Instances of the group classes, each at most once.
            **fields: Further flat fields; a field may not come from two places.

        Raises:
            TypeError: For something that is not a group, a group given twice, or a field
                given twice.
        """
        values: dict[str, Any] = {}
        seen: set[type] = set()
        for group in groups:
            kind = type(group)
            if kind not in GROUPS or kind in seen:
                raise TypeError(
                    f"from_groups takes one instance of each of "
                    f"{[g.__name__ for g in GROUPS]}, got {kind.__name__}"
                )
            seen.add(kind)
            values.update({f.name: getattr(group, f.name) for f in dataclasses.fields(group)})
        twice = sorted(set(values) & set(fields))
        if twice:
            raise TypeError(f"fields given both in a group and by name: {twice}")
        return cls(**values, **fields)

    def group(self, kind: type[_Group]) -> _Group:
        """This configuration's fields of one concern, as that group's class."""
        if kind not in GROUPS:
            raise TypeError(f"kind must be one of {[g.__name__ for g in GROUPS]}, got {kind!r}")
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    @property
    def solver_config(self) -> SolverConfig:
        """Method, damping, KL-clip, learning rate, decomposition precision."""
        return self.group(SolverConfig)

    @property
    def estimation_config(self) -> EstimationConfig:
        """How the statistics are estimated."""
        return self.group(EstimationConfig)

    @property
    def distribution_config(self) -> DistributionConfig:
        """How the work is spread over ranks."""
        return self.group(DistributionConfig)

    @property
    def refresh_config(self) -> RefreshConfig:
        """When statistics and inverses are recomputed."""
        return self.group(RefreshConfig)


def unknown_options(options: Iterable[str]) -> str | None:
    """What is wrong with the names of ``options`` as :class:`KFACConfig` fields (each
    unknown one, with the closest field names), or ``None``."""
    fields = {each.name for each in dataclasses.fields(KFACConfig)}
    unknown = sorted(set(options) - fields)
    if not unknown:
        return None
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(fields), n=2)
        hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return f"unknown option {', '.join(hints)}; every option: docs/options.md"
