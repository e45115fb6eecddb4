"""Hyperparameter schedules of the training program, as pure functions of the step.

Learning rate: :func:`lr_factor` is the multiplier of the base learning rate at an optimizer
step (``torch.optim.lr_scheduler.LambdaLR`` takes :func:`make_lr_lambda`). With ``S`` steps per
epoch, ``T`` total steps and ``W = round(warmup_epochs * S)`` warm-up steps:

* warm-up (any schedule): the factor is multiplied by ``(step + 1) / W`` while ``step < W``;
* ``constant``: 1;
* ``step``: ``gamma ** k`` where ``k`` counts the milestones ``m`` with ``step >= m * S``
  (milestones are epochs);
* ``cosine``: ``0.5 * (1 + cos(pi * p))`` with ``p = clamp((step - W) / (T - W), 0, 1)``;
* ``poly``: ``(1 - p) ** power`` with the same ``p``.

K-FAC hyperparameters: :func:`parse_piecewise` reads ``"VALUE@EPOCH,VALUE@EPOCH,..."``
(e.g. ``"1e-2@0,1e-3@5"``: 0.01 from epoch 0, 0.001 from epoch 5 on) and
:func:`piecewise_by_step` turns it into a callable of the optimizer step that
:class:`~dkfac.KFACConfig` accepts for ``damping`` and the update intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SCHEDULES = ("constant", "step", "cosine", "poly")


def lr_factor(
    step: int,
    *,
    schedule: str,
    steps_per_epoch: int,
    total_steps: int,
    warmup_epochs: float = 0.0,
    milestones: Sequence[float] = (),
    gamma: float = 0.1,
    power: float = 2.0,
) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based).

    Args:
        step: Completed optimizer steps.
        schedule: One of :data:`SCHEDULES`.
        steps_per_epoch: Optimizer steps per epoch (>= 1).
        total_steps: Optimizer steps of the whole run (>= 1).
        warmup_epochs: Length of the linear warm-up in epochs (>= 0).
        milestones: Epochs at which ``step`` decay multiplies the rate by ``gamma``.
        gamma: Decay factor of the ``step`` schedule.
        power: Exponent of the ``poly`` schedule.

    Returns:
        The factor, in [0, 1].

    Raises:
        ValueError: For an unknown schedule, out-of-range sizes, or options outside their
            domains (non-finite values, ``gamma`` outside (0, 1], ``power <= 0``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if steps_per_epoch < 1 or total_steps < 1:
        raise ValueError(
            f"steps_per_epoch and total_steps must be >= 1, got {steps_per_epoch}, {total_steps}"
        )
    _check_lr_options(warmup_epochs, milestones, gamma, power)
    warmup = round(warmup_epochs * steps_per_epoch)
    factor = 1.0
    if schedule == "step":
        passed = sum(1 for m in milestones if step >= round(m * steps_per_epoch))
        factor = gamma**passed
    elif schedule in ("cosine", "poly"):
        span = max(total_steps - warmup, 1)
        progress = min(max((step - warmup) / span, 0.0), 1.0)
        if schedule == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            factor = (1.0 - progress) ** power
    if step < warmup:
        factor *= (step + 1) / warmup
    return factor


def _check_lr_options(
    warmup_epochs: float, milestones: Sequence[float], gamma: float, power: float
) -> None:
    """The domains of :func:`lr_factor`'s options (every one finite)."""
    if not (math.isfinite(warmup_epochs) and warmup_epochs >= 0):
        raise ValueError(f"warmup_epochs must be finite and >= 0, got {warmup_epochs}")
    if not all(math.isfinite(m) and m >= 0 for m in milestones):
        raise ValueError(f"milestones must be finite epochs >= 0, got {list(milestones)}")
    if not (math.isfinite(gamma) and 0 < gamma <= 1):
        raise ValueError(f"gamma must be a decay factor in (0, 1], got {gamma}")
    if not (math.isfinite(power) and power > 0):
        raise ValueError(f"power must be finite and > 0, got {power}")


def make_lr_lambda(
    *,
    schedule: str,
    steps_per_epoch: int,
    total_steps: int,
    warmup_epochs: float = 0.0,
    milestones: Sequence[float] = (),
    gamma: float = 0.1,
    power: float = 2.0,
) -> Callable[[int], float]:
    """:func:`lr_factor` with its options bound, for ``LambdaLR`` (validated once, here)."""
    lr_factor(
        0,
        schedule=schedule,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_epochs=warmup_epochs,
        milestones=milestones,
        gamma=gamma,
        power=power,
    )
    bound = tuple(milestones)

    def factor(step: int) -> float:
        value = lr_factor(
            step,
            schedule=schedule,
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            warmup_epochs=warmup_epochs,
            milestones=bound,
            gamma=gamma,
            power=power,
        )
        if not (math.isfinite(value) and 0 <= value <= 1):  # cannot happen with valid options
            raise ValueError(f"the learning-rate schedule gave factor {value} at step {step}")
        return value

    return factor


def parse_piecewise(text: str) -> list[tuple[float, float]]:
    """Parses ``"VALUE@EPOCH,VALUE@EPOCH,..."`` into ``[(epoch, value), ...]`` sorted by epoch.

    A bare ``"VALUE"`` means ``"VALUE@0"``. The first piece must start at epoch 0.

    Raises:
        ValueError: For malformed text, negative or repeated epochs, or no piece at epoch 0.
    """
    pieces: list[tuple[float, float]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty piece in schedule {text!r} (expected VALUE@EPOCH,...)")
        value_text, _, epoch_text = item.partition("@")
        try:
            value = float(value_text)
            epoch = float(epoch_text) if epoch_text else 0.0
        except ValueError:
            raise ValueError(
                f"bad piece {item!r} in schedule {text!r}; expected VALUE@EPOCH, e.g. 1e-3@5"
            ) from None
        if not (math.isfinite(value) and math.isfinite(epoch)) or epoch < 0:
            raise ValueError(f"bad piece {item!r} in schedule {text!r}: need finite, epoch >= 0")
        pieces.append((epoch, value))
    pieces.sort()
    epochs = [e for e, _ in pieces]
    if len(set(epochs)) != len(epochs):
        raise ValueError(f"schedule {text!r} names an epoch twice")
    if epochs[0] != 0.0:
        raise ValueError(f"schedule {text!r} must start at epoch 0 (e.g. 1e-2@0,1e-3@5)")
    return pieces


@dataclass(frozen=True)
class PiecewiseSchedule:
    """A piecewise-constant value of the optimizer step (picklable, unlike a closure).

    Attributes:
        pieces: ``(epoch, value)`` pairs sorted by epoch, the first at epoch 0.
        steps_per_epoch: Optimizer steps per epoch.
        integer: Return ``int`` values (update intervals).
    """

    pieces: tuple[tuple[float, float], ...]
    steps_per_epoch: int
    integer: bool = False

    def __call__(self, step: int) -> float:
        """The value in force at optimizer step ``step``."""
        current = self.pieces[0][1]
        for epoch, value in self.pieces:
            if step >= round(epoch * self.steps_per_epoch):
                current = value
        return int(current) if self.integer and current == int(current) else current


def piecewise_by_step(text: str, steps_per_epoch: int, integer: bool = False) -> PiecewiseSchedule:
    """:func:`parse_piecewise` bound to a number of steps per epoch."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    return PiecewiseSchedule(tuple(parse_piecewise(text)), steps_per_epoch, integer)
