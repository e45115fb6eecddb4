"""Atomic checkpoints that load with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and plain containers (numbers, strings, lists, tuples,
dicts, ``None``): model, optimizer (with the K-FAC factors and inverses), LR scheduler,
gradient scaler, RNG states and the position in the data. It is written to a temporary file
in the destination folder, flushed and ``fsync``-ed, then moved over the destination with
``os.replace``, so a crash leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "checkpoint.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, corrupt or not from dkfac."""


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Writes ``state`` to ``path`` atomically (temporary file, fsync, ``os.replace``).

    Args:
        state: Tensors and plain containers only.
        path: Destination file; its folder is created if needed.

    Returns:
        The destination path.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": "dkfac-checkpoint", "version": FORMAT_VERSION, **state}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, dest)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(dest.parent, os.O_RDONLY)
    except OSError:
        return dest
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return dest


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Reads a checkpoint written by :func:`save_checkpoint` (``weights_only=True``, on CPU).

    Raises:
        CheckpointError: Naming the file, if it is missing, truncated, corrupt or foreign.
    """
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file} does not exist")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # zip / unpickling errors of many kinds
        raise CheckpointError(
            f"checkpoint {file} is truncated or corrupt and cannot be loaded "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != "dkfac-checkpoint":
        raise CheckpointError(f"{file} is not a dkfac checkpoint")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {file} has format version {state.get('version')}, "
            f"this dkfac reads version {FORMAT_VERSION}"
        )
    return state


def resolve_resume(resume: str | None, run_folder: Path) -> Path | None:
    """The checkpoint to resume from: ``None``, a path, or ``"auto"``.

    ``"auto"`` means the run folder's latest checkpoint if there is one, else a fresh start.

    Raises:
        CheckpointError: If an explicit path does not exist.
    """
    if resume is None:
        return None
    if resume == "auto":
        latest = run_folder / LATEST
        return latest if latest.is_file() else None
    file = Path(resume)
    if file.is_dir():
        file = file / LATEST
    if not file.is_file():
        raise CheckpointError(f"--resume: checkpoint {file} does not exist")
    return file


def rng_state() -> dict[str, Any]:
    """Global RNG states (torch CPU, CUDA devices, python ``random``) as tensors and tuples."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores :func:`rng_state` (the CUDA part only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    """Lists back to tuples, recursively (``random.setstate`` wants tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value
