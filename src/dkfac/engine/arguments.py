"""The arguments a preconditioner's callers pass, checked where they enter.

Each check raises the error :class:`dkfac.KFACPreconditioner` documents for the call, with a
message that says what was wrong and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from dkfac.config import KFACConfig, check_schedule_value, unknown_options
from dkfac.engine.registration import unwrap
from dkfac.engine.roles import apply_model_rules

__all__ = [
    "check_layer_names",
    "check_sampled_outputs",
    "check_step",
    "checked_config",
    "checked_lr",
]


def checked_config(
    model: Any,
    config: Any,
    grad_scaler: Any,
    process_group: Any,
    options: Mapping[str, Any],
) -> KFACConfig:
    """The configuration a preconditioner of ``model`` runs with: ``config`` (or the
    defaults) with ``options`` over it and the model's rules applied
    (:func:`~dkfac.engine.roles.apply_model_rules`).

    Raises:
        TypeError: For a ``model`` that is not an ``nn.Module``, a ``grad_scaler`` with no
            ``get_scale()``, a ``process_group`` that is not one, a ``config`` that is not a
            :class:`KFACConfig`, an unknown option or a value of the wrong type.
        ValueError: For a bad option value.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
        raise TypeError("grad_scaler must be a torch.amp.GradScaler (it has no get_scale())")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if config is not None and not isinstance(config, KFACConfig):
        raise TypeError(f"config must be a KFACConfig or None, got {type(config).__name__}")
    if problem := unknown_options(options):
        raise TypeError(problem)
    if config is None:
        config = KFACConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    return apply_model_rules(unwrap(model), config)


def checked_lr(lr: Any, layers: Collection[str] = ()) -> float | dict[str, float] | None:
    """``step()``'s learning rate (``None``: the configured one), or each layer's: a
    mapping that names every one of ``layers`` (an optimizer's parameter groups may
    differ).

    Raises:
        ValueError: For a NaN, infinite or negative ``lr``, or a mapping that does not name
            exactly ``layers`` (TypeError: not a number).
    """
    try:
        if isinstance(lr, Mapping):
            missing, unknown = sorted(set(layers) - set(lr)), sorted(set(lr) - set(layers))
            if missing or unknown:
                raise ValueError(
                    "a per-layer lr must name every registered layer: missing "
                    f"{missing}, unknown {unknown}"
                )
            return {name: check_schedule_value("lr", rate) for name, rate in lr.items()}
        return None if lr is None else check_schedule_value("lr", lr)
    except (TypeError, ValueError) as err:
        raise type(err)(f"step(): {err}") from None


def check_layer_names(names: Any, layers: Collection[str]) -> None:
    """Checks the layer names an inverse update is asked for (``None``: all of them).

    Raises:
        TypeError: For ``names`` that is not a list or tuple of names (a string would be
            read as its characters).
        ValueError: For a name that is not one of ``layers``.
    """
    if names is None:
        return
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of layer names or None, got {names!r}")
    if unknown := [n for n in names if n not in layers]:
        raise ValueError(f"names {unknown} are not registered layers; they are {list(layers)}")


def check_step(step: Any) -> None:
    """Checks a step counter to restore.

    Raises:
        ValueError: For a step that is not an integer >= 0.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


def check_sampled_outputs(config: KFACConfig, outputs: Any) -> None:
    """Checks a ``sample_fisher()`` call: ``fisher="mc"`` and outputs with a graph.

    Raises:
        RuntimeError: Where the configuration's ``fisher`` is not ``"mc"``.
        ValueError: For ``outputs`` that is not a tensor with a graph.
    """
    if config.fisher != "mc":
        raise RuntimeError('sample_fisher() needs fisher="mc" in the preconditioner config')
    if not isinstance(outputs, Tensor) or not outputs.requires_grad:
        raise ValueError("outputs must be the model's output tensor, with a graph")
