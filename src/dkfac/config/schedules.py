"""Schedules: hyperparameters that may change with the step, and the domain of each.

A :data:`Schedule` is a constant or a callable of the preconditioner's step counter (the
number of completed ``step()`` calls). Constants are checked when a configuration is built;
a callable's values each time they are resolved (:func:`resolve`), so a bad schedule fails
with a message naming the argument and the step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import torch

from dkfac.config.checks import check_range, python_number

__all__ = [
    "SCHEDULE_DOMAINS",
    "Domain",
    "EarlyRefresh",
    "Schedule",
    "check_schedule_value",
    "resolve",
]

Schedule: TypeAlias = float | int | Callable[[int], float]


class Domain(NamedTuple):
    """The values a schedule may take: ``low``/``high`` bounds and whether it is an integer."""

    low: float
    high: float = math.inf
    low_inclusive: bool = False
    high_inclusive: bool = False
    integer: bool = False


SCHEDULE_DOMAINS: dict[str, Domain] = {
    "damping": Domain(0.0),
    "factor_decay": Domain(0.0, 1.0, low_inclusive=True),
    "factor_update_interval": Domain(1, low_inclusive=True, integer=True),
    "inverse_update_interval": Domain(1, low_inclusive=True, integer=True),
    "kl_clip": Domain(0.0),
    "lr": Domain(0.0, low_inclusive=True),
    "bn_damping": Domain(0.0),
}
"""Schedule field -> its domain: the one table of what a schedule may produce."""


def check_schedule_value(name: str, value: float) -> float:
    """Validates one resolved hyperparameter value against its domain.

    Args:
        name: Hyperparameter name, a key of :data:`SCHEDULE_DOMAINS`.
        value: The resolved value (a one-element tensor or a numpy scalar is read as its
            number).

    Returns:
        The value, as an ``int`` for the update intervals and a ``float`` otherwise.

    Raises:
        TypeError: If the value is not a number.
        ValueError: If it is not finite, outside the domain, or not an integer where one is
            required.
    """
    domain = SCHEDULE_DOMAINS[name]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{name} must be a number or a one-element tensor, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        value = value.item()
    value = python_number(value)
    check_range(
        name,
        value,
        low=domain.low,
        high=domain.high,
        low_inclusive=domain.low_inclusive,
        high_inclusive=domain.high_inclusive,
    )
    if domain.integer:
        if int(value) != value:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return int(value)
    return float(value)


def resolve(name: str, value: Schedule | None, step: int) -> float | None:
    """Resolves a schedule at ``step`` and validates the result (``None`` passes through)."""
    if value is None:
        return None
    raw = value(step) if callable(value) else value
    try:
        return check_schedule_value(name, raw)
    except (TypeError, ValueError) as err:
        if callable(value):
            raise type(err)(f"{err} (returned by the {name} schedule at step {step})") from None
        raise


@dataclass(frozen=True)
class EarlyRefresh:
    """An ``inverse_update_interval`` schedule: a refresh every ``interval`` steps, and one
    more at step ``first_capture``, the first factor capture after the first step's (the
    factor interval, where it is shorter than ``interval``).

    The first step's basis comes from the statistics of the initial weights, which the
    first steps change the most; kept for a whole long interval it preconditions those
    steps with a stale basis. Refreshed again once new statistics are in: a plain
    6 × 64 MLP on digits (bases every 50 steps, factors every 8) reached its target in 14
    and 15 steps instead of 22 and 20 (median of three held-out seeds, two splits:
    ``benchmarks/results/early_refresh.json``).
    Its value is ``first_capture`` before step ``2 · first_capture`` and ``interval`` from
    there; a step refreshes where its value divides the step.
    """

    first_capture: int
    interval: int

    def __call__(self, step: int) -> int:
        return self.first_capture if step < 2 * self.first_capture else self.interval

    def __str__(self) -> str:
        return f"{self.interval} (and at step {self.first_capture})"


def _check_takes_the_step(name: str, schedule: Callable[..., object]) -> None:
    """A callable schedule can be called with the step alone (its values are checked when
    resolved); one whose signature cannot be read (some builtins) is taken as it is.

    Raises:
        TypeError: For a callable that cannot take one positional argument (``lambda:
            0.1`` failed at the first step, with a TypeError that did not name the option).
    """
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            f"{name} must be a number or a callable of the step (one argument, the number "
            f"of completed steps), got {schedule!r} with the signature {signature}"
        ) from None


def check_schedules(config: object, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Checks the schedules among ``names`` of ``config``: the constants' values, and that
    the callables take the step (their values are checked when resolved); ``optional`` ones
    may be ``None``."""
    for name in names:
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if callable(value):
            _check_takes_the_step(name, value)
        else:
            check_schedule_value(name, value)
