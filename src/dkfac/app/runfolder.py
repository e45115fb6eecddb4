"""The run folder of ``dkfac train`` (``--out``): created and checked before any work starts.

:func:`prepare_run_folder` runs on rank 0 before the data is loaded, so that an ``--out``
that is a file, lies under a file or cannot be written ends the run at once with one
message (exit 2) instead of a traceback after the data and model were built.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


class RunFolderError(ValueError):
    """An ``--out`` folder that cannot hold this run."""


def prepare_run_folder(folder: Path) -> None:
    """Creates ``folder`` (and its parents) and checks that files can be written in it.

    Raises:
        RunFolderError: If ``folder`` is a file, lies under one, or cannot be created or
            written.
    """
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--out {folder} is a file, not a folder")
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
