"""The hyperparameters of a :class:`~dkfac.KFACOptimizer`'s parameter groups, checked where
they enter: the inner optimizer's groups when the wrapper is built, a group added with
``add_param_group``, the groups of a state dict before anything loads, and the groups as a
step finds them (a user or a scheduler may have edited them since the last one).

torch checks a group's values only in an optimizer's constructor; a value written into a
group later (``opt.param_groups[0]["weight_decay"] = float("nan")``), added with a new
group or loaded from a state dict reached the inner step as it was: a NaN weight decay or
momentum put NaN in the weights, and a string lr failed inside torch after the
preconditioner had already stepped. Here:

- ``lr`` is required (the KL-clip reads each layer's) and is a finite number (or a
  one-element floating tensor) in ``[0, float32's largest]``;
- ``weight_decay``, where a group holds one, a finite number in the same range;
- ``"betas"``, where they drive the eigenbasis moments
  (:meth:`~dkfac.KFACOptimizer.for_model`), two numbers in ``[0, 1)``;
- ``differentiable``, where a group holds it, is not ``True``: K-FAC preconditions under
  ``torch.no_grad()``, so no graph runs through its step, and torch's differentiable step
  updates the model's leaf parameters in place with gradients enabled, which autograd
  refuses;
- every other value of the group has the kind of its reference (the inner optimizer's
  default, or for a state dict the current group's value): a bool where that is a bool, a
  finite number (or a tensor) where that is a number, as many finite numbers where that is a
  tuple of numbers (Adam's own ``betas``); a key without a reference, or whose reference is
  ``None`` or anything else, is the inner optimizer's business.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

from dkfac.config.checks import check_range, python_number

__all__ = ["check_group", "check_groups", "check_weight_decay", "lr_number"]

LARGEST: Final = float(torch.finfo(torch.float32).max)
"""The largest ``lr`` and ``weight_decay``: the inner optimizer multiplies float32 weights by
them, and a larger one fails inside torch."""
_CHECKED_APART: Final = frozenset({"params", "param_names", "lr", "weight_decay", "betas"})


def check_weight_decay(value: Any) -> None:
    """A weight decay: a number in ``[0, float32's largest]``.

    Raises:
        TypeError: If it is not a number.
        ValueError: If it is not finite or outside that range.
    """
    check_range(
        "weight_decay", value, low=0.0, high=LARGEST, low_inclusive=True, high_inclusive=True
    )


def lr_number(lr: Any) -> Any:
    """``lr`` as it is checked: a one-element floating tensor (torch's optimizers take one)
    as its number, anything else as it is.

    Raises:
        TypeError: For a tensor of several elements or of integers.
    """
    if not isinstance(lr, torch.Tensor):
        return lr
    if lr.numel() != 1 or not lr.is_floating_point():
        raise TypeError(
            f"lr must be a number or a one-element floating tensor, got a {lr.dtype} tensor "
            f"of shape {tuple(lr.shape)}"
        )
    return float(lr.item())


def _check_lr(value: Any) -> None:
    """A group's learning rate: a number or a one-element floating tensor (as torch's
    optimizers take it, :func:`lr_number`) in ``[0, float32's largest]``."""
    lr = lr_number(value)
    check_range("lr", lr, low=0.0, high=LARGEST, low_inclusive=True, high_inclusive=True)


def _check_betas(pair: Any) -> None:
    """The moments' ``(β₁, β₂)``: two numbers in ``[0, 1)``."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"betas must be a pair (moment_beta1, moment_beta2), got {pair!r}")
    for position, value in enumerate(pair):
        check_range(f"betas[{position}]", value, low=0.0, high=1.0, low_inclusive=True)


def _check_finite(key: str, value: Any) -> None:
    """A finite number (or a tensor, read by the inner optimizer as it is)."""
    if isinstance(value, torch.Tensor):
        return
    number = python_number(value)
    if not _is_number(number):
        raise TypeError(f"{key} must be a number, as the optimizer's, got {type(value).__name__}")
    if not math.isfinite(number):
        raise ValueError(f"{key} must be a finite number, got {value!r}")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_like(key: str, value: Any, reference: Any) -> None:
    """``value`` has the kind of ``reference`` (see the module notes)."""
    if isinstance(reference, bool):
        if not isinstance(python_number(value), bool):
            raise TypeError(f"{key} must be a bool, as the optimizer's, got {value!r}")
    elif _is_number(reference):
        _check_finite(key, value)
    elif isinstance(reference, tuple) and reference and all(map(_is_number, reference)):
        if not isinstance(value, (tuple, list)) or len(value) != len(reference):
            raise ValueError(f"{key} must be {len(reference)} numbers, got {value!r}")
        for position, each in enumerate(value):
            _check_finite(f"{key}[{position}]", each)


def check_group(group: Any, reference: Mapping[str, Any], betas: bool) -> None:
    """One parameter group's hyperparameters (see the module notes).

    Args:
        group: The group (a dict).
        reference: What each other key's value is checked against.
        betas: Whether the group's ``"betas"`` drive the moments.

    Raises:
        TypeError: For a group that is not a dict, or a value of the wrong kind.
        ValueError: For a group without ``lr``, a value outside its range, or
            ``differentiable=True``.
    """
    if not isinstance(group, dict):
        raise TypeError(f"a parameter group must be a dict, got {type(group).__name__}")
    if "lr" not in group:
        raise ValueError(
            "a parameter group must hold 'lr' (the KL-clip and the inner step read it), got "
            f"the keys {sorted(map(str, group))}"
        )
    _check_lr(group["lr"])
    if "weight_decay" in group:
        check_weight_decay(group["weight_decay"])
    if betas and "betas" in group:
        _check_betas(group["betas"])
    for key, value in group.items():
        if key not in _CHECKED_APART and key in reference:
            _check_like(str(key), value, reference[key])
    if python_number(group.get("differentiable", False)) is True:
        raise ValueError(
            "differentiable=True is not supported: K-FAC preconditions the gradients under "
            "torch.no_grad() (no graph runs through its step), and a differentiable step "
            "updates the model's leaf parameters in place with gradients enabled, which "
            "autograd refuses; build the inner optimizer with differentiable=False (the "
            "default)"
        )


def check_groups(
    groups: Any, references: Sequence[Mapping[str, Any]], defaults: Mapping[str, Any], betas: bool
) -> None:
    """Every group of ``groups`` (:func:`check_group`), group ``i`` against
    ``references[i]`` over ``defaults`` (``defaults`` alone past the references' end).

    Raises:
        TypeError, ValueError: As :func:`check_group`, the message naming the group
            (``param_groups[i]: ...``); ValueError for ``groups`` that is not a list.
    """
    if not isinstance(groups, list):
        raise ValueError(f"param_groups must be a list of dicts, got {type(groups).__name__}")
    for index, group in enumerate(groups):
        reference = references[index] if index < len(references) else {}
        try:
            check_group(group, {**defaults, **reference}, betas)
        except (TypeError, ValueError) as err:
            raise type(err)(f"param_groups[{index}]: {err}") from None
