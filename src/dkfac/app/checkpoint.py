"""Atomic checkpoints that load with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and plain containers (numbers, strings, lists, tuples,
dicts, ``None``): model, optimizer (with the K-FAC factors and inverses), LR scheduler,
gradient scaler, RNG states and the position in the data. It is written to a temporary file
in the destination folder, flushed and ``fsync``-ed, then moved over the destination with
``os.replace``, so a crash leaves either the old or the new checkpoint, never half of one.

Every checkpoint carries a BLAKE2b digest of its contents (tensor bytes, dtypes, shapes and
the plain values), checked on load: a file damaged on disk in a way the zip container does
not notice (a flipped byte inside a tensor) is refused like a truncated one.
:func:`save_rotating` keeps the previous checkpoint as ``checkpoint.prev.pt``, and
:func:`choose_resume` with ``"auto"`` or a run folder falls back to it, with a warning naming
the bad file, when the newest one is missing or does not verify. Loading never runs code:
``weights_only=True`` refuses any pickled object other than tensors and plain containers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
FORMAT_VERSION = 1
_HEADER_KEYS = ("format", "version", "digest")

logger = logging.getLogger(__name__)


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
    payload = {
        "format": "dkfac-checkpoint",
        "version": FORMAT_VERSION,
        "digest": content_digest(state),
        **state,
    }
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
    except pickle.UnpicklingError as err:
        if "global" not in str(err).lower():  # not a refused class or function: damage
            raise CheckpointError(
                f"checkpoint {file} is truncated or corrupt and cannot be loaded "
                "(its pickle stream is damaged or holds instructions a safe load refuses)"
            ) from None
        raise CheckpointError(
            f"checkpoint {file} was refused: it holds pickled objects other than tensors and "
            "plain containers, and unpickling them could run code (only load files you trust "
            "with torch.load(weights_only=False))"
        ) from None
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
    digest = state.get("digest")
    body = {k: v for k, v in state.items() if k not in _HEADER_KEYS}
    if digest is not None and digest != content_digest(body):
        raise CheckpointError(
            f"checkpoint {file} is corrupt: its contents do not match the digest stored in it"
        )
    return body


def content_digest(value: Any) -> str:
    """A BLAKE2b digest of nested tensors and plain values (lists and tuples alike).

    Tensors contribute their dtype, shape and bytes (read on the CPU); other leaves their
    ``repr`` (exact for ints, floats, strings, ``None``); dict keys are taken in order.
    """
    hasher = hashlib.blake2b(digest_size=32)

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            flat = item.detach().to("cpu").contiguous().reshape(-1)
            hasher.update(f"T{item.dtype}{tuple(item.shape)}".encode())
            hasher.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            hasher.update(f"D{len(item)}".encode())
            for key, sub in item.items():
                feed(key)
                feed(sub)
        elif isinstance(item, (list, tuple)):
            hasher.update(f"L{len(item)}".encode())
            for sub in item:
                feed(sub)
        else:
            hasher.update(f"V{item!r};".encode())

    feed(value)
    return hasher.hexdigest()


def save_rotating(state: dict[str, Any], folder: str | Path, *, rotate: bool = True) -> Path:
    """Saves ``state`` as the folder's :data:`LATEST`, keeping the one before as :data:`PREVIOUS`.

    The old latest is renamed (atomically) before the new one is written, so at every instant
    the folder holds at least one complete checkpoint once it has held one. Temporary files
    that killed writes left behind are removed first.

    Args:
        state: Tensors and plain containers only.
        folder: The run folder.
        rotate: Keep the current latest as the backup. Pass ``False`` when the latest is not
            known to be good (the run resumed from the backup because the latest was damaged
            or missing): the damaged file is then replaced and the good backup kept.
    """
    base = Path(folder)
    latest = base / LATEST
    remove_temporaries(base)
    if rotate and latest.is_file():
        os.replace(latest, base / PREVIOUS)
    return save_checkpoint(state, latest)


def remove_temporaries(folder: Path) -> list[Path]:
    """Deletes the temporary files of checkpoint writes that never finished; returns them.

    Only one process writes a run folder's checkpoints, so any such file is from a write
    that was killed (a 13 MB file per kill otherwise piles up forever).
    """
    stale = [p for name in (LATEST, PREVIOUS) for p in folder.glob(f".{name}.*.tmp") if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        logger.warning("removed %d unfinished checkpoint file(s) in %s", len(stale), folder)
    return stale


def choose_resume(resume: str | None, run_folder: Path) -> Path | None:
    """The checkpoint to resume from, verified where a folder was named.

    ``"auto"`` and an explicit run folder both mean the newest checkpoint of that folder that
    loads and verifies (:data:`LATEST`, else :data:`PREVIOUS`); each one that does not is
    named in a warning. ``"auto"`` starts afresh (``None``) when the folder holds neither;
    an explicit folder must hold one. An explicit file is returned as it is (loading it
    verifies it).

    Raises:
        CheckpointError: If an explicit file or folder holds no checkpoint, or every
            checkpoint present is damaged (never silently start over from scratch).
    """
    if resume is None:
        return None
    if resume == "auto":
        return newest_good(run_folder, "--resume auto", required=False)
    file = Path(resume)
    if file.is_dir():
        return newest_good(file, f"--resume {file}", required=True)
    if not file.is_file():
        raise CheckpointError(f"--resume: checkpoint {file} does not exist")
    return file


def newest_good(folder: Path, what: str, *, required: bool) -> Path | None:
    """The newest checkpoint of ``folder`` that verifies (see :func:`choose_resume`)."""
    present = [folder / n for n in (LATEST, PREVIOUS) if (folder / n).is_file()]
    problems = []
    for file in present:
        try:
            load_checkpoint(file)
        except CheckpointError as err:
            logger.warning("%s: skipping %s: %s", what, file, err)
            problems.append(str(err))
            continue
        if file.name != LATEST:
            logger.warning("%s: resuming from the previous checkpoint %s", what, file)
        return file
    if problems:
        raise CheckpointError(f"{what}: no usable checkpoint: " + "; ".join(problems))
    if required:
        raise CheckpointError(f"{what}: the folder holds no checkpoint ({LATEST} or {PREVIOUS})")
    return None


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
