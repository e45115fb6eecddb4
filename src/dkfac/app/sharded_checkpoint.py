"""Checkpoints of sharded models through ``torch.distributed.checkpoint``, safe against kills.

``dcp.save`` into a folder that already holds a checkpoint overwrites its data files in
place (the same ``__<rank>_<n>.distcp`` names) before it writes the new ``.metadata``: a
process killed in between leaves the old metadata over new or half-written data, which may
not load, or load a mix of two steps. So every save here goes to a temporary folder
(:data:`TEMP`), and only once ``dcp.save`` has returned on every rank (its metadata written
by the coordinator) does rank 0 move it into place, keeping the checkpoint before as
:data:`PREVIOUS` (renames of whole folders: at every instant the run folder holds at least
one complete checkpoint once it has held one). A temporary folder left by a killed save is
removed by the next save.

A checkpoint folder holds the model and optimizer state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict`` (DTensor shards: they re-shard to
any world size, one process included), saved with ``dcp.save``, and :data:`EXTRAS`: the plain
rest of the program's checkpoint (scheduler, scaler, RNG, position in the data, what the run
was made with), written by rank 0 with :func:`~dkfac.app.checkpoint.save_checkpoint` (digest,
``weights_only`` loading).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from dkfac.app.checkpoint import LATEST as FILE_LATEST
from dkfac.app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "EXTRAS",
    "LATEST",
    "PREVIOUS",
    "TEMP",
    "apply_sharded",
    "choose_sharded_resume",
    "is_sharded_checkpoint",
    "load_sharded",
    "newest_good_sharded",
    "save_sharded",
]

LATEST = "checkpoint.dcp"
PREVIOUS = "checkpoint.prev.dcp"
TEMP = ".checkpoint.dcp.tmp"
EXTRAS = "extras.pt"
_METADATA = ".metadata"

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fsync_dir(folder: Path) -> None:
    """Makes the renames inside ``folder`` durable (where the platform allows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_sharded(
    model: nn.Module,
    optimizer: Optimizer,
    extras: dict[str, Any],
    folder: str | Path,
    *,
    rotate: bool = True,
) -> Path:
    """Saves a checkpoint of ``model`` and ``optimizer`` as the folder's :data:`LATEST`.

    A collective: every rank calls it (``get_state_dict`` and ``dcp.save``); rank 0 writes
    ``extras`` and moves the finished checkpoint into place.

    Args:
        model: The (sharded) model, unwrapped.
        optimizer: Its optimizer (a :class:`~dkfac.KFACOptimizer` included).
        extras: The plain rest of the checkpoint (tensors and plain containers).
        folder: The run folder, shared by every rank.
        rotate: Keep the current latest as :data:`PREVIOUS`; ``False`` when the latest is
            not known to be good (it is then replaced and the previous one kept).

    Returns:
        The checkpoint folder (:data:`LATEST`).
    """
    base = Path(folder)
    tmp, latest, previous = base / TEMP, base / LATEST, base / PREVIOUS
    if _rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            logger.warning("removed the unfinished checkpoint folder %s", tmp)
            shutil.rmtree(tmp)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    if _rank() == 0:
        save_checkpoint(extras, tmp / EXTRAS)
        _fsync_dir(tmp)
        if latest.exists():
            if rotate:
                if previous.exists():
                    shutil.rmtree(previous)
                os.replace(latest, previous)
            else:
                shutil.rmtree(latest)
        os.replace(tmp, latest)
        _fsync_dir(base)
    _barrier()
    return latest


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder that looks like a checkpoint of :func:`save_sharded`."""
    return path.is_dir() and (path / _METADATA).is_file() and (path / EXTRAS).is_file()


def newest_good_sharded(folder: Path) -> Path | None:
    """The folder's :data:`LATEST` checkpoint if complete, else :data:`PREVIOUS`, else ``None``.

    A checkpoint is complete when its ``.metadata`` and :data:`EXTRAS` are there and the
    extras verify (the data files were written before the folder was moved into place).
    """
    for path in (folder / LATEST, folder / PREVIOUS):
        if not path.exists():
            continue
        if is_sharded_checkpoint(path):
            try:
                load_checkpoint(path / EXTRAS)
            except CheckpointError as err:
                logger.warning("skipping %s: %s", path, err)
                continue
            if path.name != LATEST:
                logger.warning("resuming from the previous checkpoint %s", path)
            return path
        logger.warning("skipping %s: it is not a complete checkpoint", path)
    return None


def choose_sharded_resume(resume: str | None, run_folder: Path) -> Path | None:
    """The sharded checkpoint to resume from (``--resume`` of a ``--parallel fsdp/hsdp`` run).

    ``"auto"``: the run folder's newest complete checkpoint, ``None`` when it holds none; a
    checkpoint folder: itself; a run folder: its newest complete checkpoint.

    Raises:
        CheckpointError: If a named folder holds no complete sharded checkpoint (a single
            file of ``--parallel ddp`` is named as such).
    """
    if resume is None:
        return None
    where = run_folder if resume == "auto" else Path(resume)
    if is_sharded_checkpoint(where):
        return where
    found = newest_good_sharded(where) if where.is_dir() else None
    if found is not None or (resume == "auto" and not (where / FILE_LATEST).exists()):
        return found
    if where.is_file() or (where / FILE_LATEST).is_file():
        raise CheckpointError(
            f"--resume {resume}: {where} holds a single-file checkpoint of --parallel ddp; "
            "resume it with --parallel ddp (a sharded run reads checkpoint folders)"
        )
    raise CheckpointError(f"--resume {resume}: {where} holds no complete sharded checkpoint")


def load_sharded(
    model: nn.Module, optimizer: Optimizer, path: str | Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Reads a checkpoint of :func:`save_sharded` for ``model`` and ``optimizer``.

    A collective (``dcp.load``). Nothing is loaded into the model or optimizer: the caller
    checks the states first, then calls :func:`apply_sharded`.

    Returns:
        The model state dict, the optimizer state dict (in ``get_state_dict``'s form) and
        the extras.

    Raises:
        CheckpointError: If ``path`` is not a complete checkpoint or does not fit the model.
    """
    where = Path(path)
    if not is_sharded_checkpoint(where):
        raise CheckpointError(
            f"{where} is not a sharded checkpoint folder (it needs {_METADATA} and {EXTRAS})"
        )
    extras = load_checkpoint(where / EXTRAS)
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(where))
    except (Exception, CheckpointException) as err:  # a BaseException, carrying every rank's
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"checkpoint {where} does not fit this run: {first}") from None
    return state["model"], state["optim"], extras


def apply_sharded(
    model: nn.Module,
    optimizer: Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
) -> None:
    """Loads states read by :func:`load_sharded` into ``model`` and ``optimizer``."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
