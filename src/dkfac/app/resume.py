"""The training program's checkpoint contents, and restoring them into a session, checked first.

:func:`checkpoint_state` gathers what a run needs to continue (a collective for K-FAC);
:func:`restore` loads a checkpoint into a freshly built :class:`~dkfac.app.session.Session`.

A checkpoint's digest proves it is intact, not that its values make sense: a file edited
with its digest recomputed (a string where the step count belongs, NaN weights) passes it.
So before anything is loaded, :func:`restore` checks the plain values the run relies on:

* ``position``: the epoch, step and step within the epoch are integers >= 0, the seconds
  finite and >= 0;
* wherever the live optimizer or LR scheduler holds a number (learning rate, momentum,
  betas, step counters), the saved state holds a finite number;
* every saved model tensor is finite.

A value that fails is a :class:`~dkfac.app.checkpoint.CheckpointError` naming the file and
the field (exit 2), never a traceback later in the run.

Every checkpoint also records what it was made with (:func:`made_with`: model, BatchNorm,
dataset and its shape, optimizer, K-FAC method). Resuming it in a run that differs in any of
these is refused with a message naming both sides, except the K-FAC method, which is
converted: the factors are method-independent statistics, so the saved inverses (and
per-layer solver plans) are dropped and the preconditioner recomputes them from the factors
with the new method (refused when the saved factors are low-rank ``smw`` factors and the new
method needs full ones). Checkpoints from before this record load as before.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from dkfac.app.checkpoint import CheckpointError, load_checkpoint, rng_state, set_rng_state
from dkfac.app.session import Session, local
from dkfac.app.sharded_checkpoint import apply_sharded, load_sharded
from dkfac.engine import optimizer_state as kfac_state

logger = logging.getLogger(__name__)

POSITION_INTEGERS = ("epoch", "step_in_epoch", "step")
LOWRANK_METHODS = ("smw", "auto")
POSITION_SECONDS = ("train_seconds", "wall_seconds")


def checkpoint_state(run: Session, position: dict[str, Any]) -> dict[str, Any]:
    """Everything a run needs to continue (a collective: the K-FAC state is gathered)."""
    return {
        "model": run.bare.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        **checkpoint_extras(run, position),
    }


def checkpoint_extras(run: Session, position: dict[str, Any]) -> dict[str, Any]:
    """What a run needs to continue besides the model and optimizer states."""
    return {
        "scheduler": run.scheduler.state_dict(),
        "scaler": None if run.scaler is None else run.scaler.state_dict(),
        "rng": rng_state(),
        "position": position,
        # Rank 0's chain; with several ranks a resume restarts the chains (see restore).
        "running_mixup": None if run.running_mixup is None else run.running_mixup.state_dict(),
        "made_with": made_with(run),
    }


def made_with(run: Session) -> dict[str, Any]:
    """What a run's checkpoint must match to be resumed in it, keyed by flag."""
    args, data = run.args, run.data
    record: dict[str, Any] = {
        "--model": args.model,
        "--batch-norm": bool(getattr(args, "batch_norm", False)),
        "--data": args.data,
        "data shape": f"{data.in_channels}x{data.image_size}x{data.image_size} images, "
        f"{data.num_classes} classes, {len(data.y_train)} training samples",
        "--optimizer": args.optimizer,
    }
    if run.preconditioner is not None:
        record["--method"] = run.preconditioner.config.method
    return record


def match_run(saved: Any, run: Session) -> None:
    """Refuses a checkpoint made with another model, data or optimizer; converts the method.

    Args:
        saved: The checkpoint's state (its ``made_with`` and optimizer state are read, and
            the optimizer state is converted in place for another K-FAC method).
        run: The session to resume.

    Raises:
        RunMismatchError: Naming each difference, checkpoint side and run side.
    """
    theirs = saved.get("made_with")
    if not isinstance(theirs, dict):  # made before checkpoints recorded it
        return
    mine = made_with(run)
    differ = [k for k in mine if k != "--method" and theirs.get(k) != mine[k]]
    if differ:
        raise RunMismatchError(
            "; ".join(f"{k} {_show(theirs.get(k))} there, {_show(mine[k])} here" for k in differ)
        )
    if "--method" in mine and theirs.get("--method") != mine["--method"]:
        convert_method(saved["optimizer"], str(theirs.get("--method")), mine["--method"])


def convert_method(optimizer_state: dict[str, Any], old: str, new: str) -> None:
    """Prepares a K-FAC optimizer state made with method ``old`` for method ``new``, in place.

    Drops the saved inverses and solver plans so that loading recomputes them from the
    factors with ``new``.

    Raises:
        RunMismatchError: If the state holds low-rank factors and ``new`` needs full ones.
    """
    preconditioner = kfac_state.unpack(optimizer_state)[1]
    layers = preconditioner["layers"]
    lowrank = sorted(n for n, e in layers.items() if (e.get("plan") or {}).get("lowrank"))
    if lowrank and new not in LOWRANK_METHODS:
        raise RunMismatchError(
            f"--method {old} there holds low-rank factors of {', '.join(lowrank)}, which "
            f"--method {new} here cannot use; resume with --method {old}"
        )
    for name, entry in layers.items():
        entry.pop("inverse", None)
        if name not in lowrank:
            entry.pop("plan", None)
    kfac_state.replace_preconditioner(optimizer_state, preconditioner)
    logger.warning(
        "the checkpoint was made with --method %s; converted to --method %s (inverses "
        "recomputed from the saved factors)",
        old,
        new,
    )


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def restore(run: Session, path: Path) -> dict[str, Any]:
    """Loads the checkpoint at ``path`` into ``run``; returns its position in the data.

    A sharded run (``--parallel fsdp``/``hsdp``) reads a checkpoint folder of
    :mod:`~dkfac.app.sharded_checkpoint` (a collective), any other a checkpoint file.

    Raises:
        CheckpointError: If the file is damaged, holds values the run cannot use, or does
            not match this run's model and optimizer.
    """
    if run.sharded:
        model_state, optim_state, extras = load_sharded(run.bare, run.optimizer, path)
        state = {**extras, "model": model_state, "optimizer": optim_state}
    else:
        state = load_checkpoint(path)
    try:
        match_run(state, run)
        position = check_state(state, run)
        if run.sharded:
            apply_sharded(run.bare, run.optimizer, state["model"], state["optimizer"])
        else:
            run.bare.load_state_dict(state["model"])
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        if run.scaler is not None and state.get("scaler") is not None:
            run.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        mixup_state = state.get("running_mixup")
        if run.running_mixup is not None and mixup_state is not None and run.world == 1:
            kept = mixup_state["inputs"]
            if kept is None or len(kept) == run.micro_batch:
                run.running_mixup.load_state_dict(mixup_state)  # several ranks: chains restart
    except RunMismatchError as err:
        raise CheckpointError(f"checkpoint {path} was made with another setup: {err}") from None
    except UnusableValueError as err:
        raise CheckpointError(f"checkpoint {path} is not usable: {err}") from None
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(f"checkpoint {path} does not match this run: {err}") from None
    return position


class UnusableValueError(ValueError):
    """A plain value of a checkpoint outside what the run can use."""


class RunMismatchError(ValueError):
    """A checkpoint made with another model, dataset, optimizer or (unconvertible) method."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_state(state: dict[str, Any], run: Session) -> dict[str, Any]:
    """Checks the values :func:`restore` relies on (see the module docstring); the position.

    Raises:
        UnusableValueError: Naming the first field that fails.
        KeyError: For a missing part.
    """
    position = state["position"]
    if not isinstance(position, dict):
        raise UnusableValueError(f"position must be a mapping, got {position!r}")
    for name in POSITION_INTEGERS:
        if not _is_count(position.get(name)):
            raise UnusableValueError(
                f"position.{name} must be an integer >= 0, got {position.get(name)!r}"
            )
    for name in POSITION_SECONDS:
        seconds: Any = position.get(name)
        if not (_is_number(seconds) and math.isfinite(seconds) and seconds >= 0):
            raise UnusableValueError(
                f"position.{name} must be finite seconds >= 0, got {seconds!r}"
            )
    saved_opt = state["optimizer"]
    if not isinstance(saved_opt, dict):
        raise UnusableValueError(f"optimizer must be a mapping, got {type(saved_opt).__name__}")
    skipped = saved_opt.get("skipped_steps", 0)
    if not _is_count(skipped):
        raise UnusableValueError(
            f"optimizer.skipped_steps must be an integer >= 0, got {skipped!r}"
        )
    inner = saved_opt.get("inner", saved_opt)
    live_groups = [
        {k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups
    ]
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    check_numbers(groups, live_groups, "optimizer.param_groups")
    check_numbers(state["scheduler"], run.scheduler.state_dict(), "scheduler")
    for name, tensor in dict(state["model"]).items():
        tensor = local(tensor) if isinstance(tensor, torch.Tensor) else tensor
        floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
        if floating and not bool(torch.isfinite(tensor).all()):
            raise UnusableValueError(f"model.{name} holds values that are not finite")
    return dict(position)


def check_numbers(saved: Any, live: Any, where: str) -> None:
    """Wherever ``live`` holds a number, ``saved`` must hold a finite number (recursively).

    Raises:
        UnusableValueError: Naming the first place where it does not.
    """
    if _is_number(live):
        if not (_is_number(saved) and math.isfinite(saved)):
            raise UnusableValueError(f"{where} must be a finite number, got {saved!r}")
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise UnusableValueError(f"{where} must be a mapping, got {type(saved).__name__}")
        for key in live.keys() & saved.keys():
            check_numbers(saved[key], live[key], f"{where}.{key}")
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            raise UnusableValueError(f"{where} must be a list of {len(live)}, got {saved!r}")
        for i, (mine, theirs) in enumerate(zip(saved, live, strict=True)):
            check_numbers(mine, theirs, f"{where}[{i}]")
