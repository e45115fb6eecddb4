"""The length of the names in a path the programs are given, checked where it enters.

A file system takes at most :data:`NAME_MAX` bytes per file or folder name; a longer one
fails with ``ENAMETOOLONG`` whenever the path is looked at, made or written, which was a
traceback (in ``dkfac bench``, after the run). :func:`long_name` says so before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["NAME_MAX", "long_name"]

NAME_MAX = 255
"""The longest file name, in bytes, of the usual file systems (ext4, XFS, APFS, NTFS)."""


def long_name(path: str | Path, ending: str = "") -> str | None:
    """What is wrong with ``path`` when one of its names is longer than :data:`NAME_MAX`
    bytes, its last name counted with ``ending`` (what the program appends to it when it
    writes it, e.g. a temporary file's ``.tmp``); ``None`` when none is.
    """
    names = Path(path).parts
    for index, name in enumerate(names):
        tail = ending if index == len(names) - 1 else ""
        size = len(os.fsencode(name + tail))
        if size > NAME_MAX:
            shown = name if len(name) <= 24 else name[:20] + "..."
            with_tail = f" with its {tail} ending" if tail else ""
            return (
                f"has a name of {size} bytes{with_tail} ({shown!r}); a file or folder name "
                f"takes at most {NAME_MAX}"
            )
    return None
