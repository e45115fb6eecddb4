"""The run folder of ``dkfac train`` (``--out``): created and checked before any work starts.

:func:`prepare_run_folder` runs on rank 0 before the data is loaded, so that an ``--out``
that is a file, lies under a file or cannot be written ends the run at once with one
message (exit 2) instead of a traceback after the data and model were built.

A folder that holds an earlier run (a checkpoint or ``metrics.jsonl``) is refused unless the
run resumes (``--resume``) or the user asks to start afresh there (``--overwrite``, which
deletes the old checkpoints so that no later ``--resume auto`` can pick one of them up).
A folder the run created is removed again (:func:`remove_empty_folder`) when the run is
refused before it wrote anything (data, model or checkpoint that do not fit).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from dkfac.app import sharded_checkpoint as sharded
from dkfac.app.checkpoint import LATEST, PREVIOUS, remove_temporaries

METRICS = "metrics.jsonl"
RUN_FILES = (LATEST, PREVIOUS, sharded.LATEST, sharded.PREVIOUS, METRICS)


class RunFolderError(ValueError):
    """An ``--out`` folder that cannot hold this run."""


def prepare_run_folder(folder: Path, *, resume: str | None, overwrite: bool) -> None:
    """Creates ``folder`` (and its parents), checks that it can be written and is free.

    Args:
        folder: The run folder.
        resume: The ``--resume`` value; any resume may use a folder that holds a run.
        overwrite: Start afresh in a folder that holds a run, deleting its checkpoints.

    Raises:
        RunFolderError: If ``folder`` is a file, lies under one, cannot be created or
            written, or holds a run while neither ``resume`` nor ``overwrite`` is given.
    """
    check_run_folder(folder, resume=resume, overwrite=overwrite)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(
            f"--out {folder}: cannot create the run folder ({err.strerror or err})"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise RunFolderError(
            f"--out {folder}: cannot write in the run folder ({err.strerror or err})"
        ) from None
    if resume is None and overwrite and any((folder / name).exists() for name in RUN_FILES):
        for name in (LATEST, PREVIOUS):
            (folder / name).unlink(missing_ok=True)
        for name in (sharded.LATEST, sharded.PREVIOUS, sharded.TEMP):
            shutil.rmtree(folder / name, ignore_errors=True)
    remove_temporaries(folder)


def check_run_folder(folder: Path, *, resume: str | None, overwrite: bool) -> None:
    """Checks, changing nothing, that ``folder`` can be this run's folder as far as what is
    there goes: not a file, and holding no earlier run unless ``resume`` or ``overwrite``
    lets this run use it (``dkfac compare`` checks every optimizer's folder so before it
    trains the first).

    Raises:
        RunFolderError: Saying what is wrong and what to pass instead.
    """
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--out {folder} is a file, not a folder")
    held = [name for name in RUN_FILES if (folder / name).exists()]
    if held and resume is None and not overwrite:
        raise RunFolderError(
            f"--out {folder} holds an earlier run ({', '.join(held)}); pass --resume auto "
            "to continue it, --overwrite to start afresh there, or another --out"
        )


def remove_empty_folder(folder: Path) -> None:
    """Removes ``folder`` if it is empty (a run folder prepared for a run that was then
    refused); a folder that holds anything, or cannot be removed, is left as it is."""
    with contextlib.suppress(OSError):
        folder.rmdir()
