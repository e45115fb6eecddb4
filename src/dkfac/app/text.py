"""Byte-level text for the language-model task (``--data text``), offline.

The text is a byte stream read from ``--text-path``: one file, or every file under a folder
whose name matches ``--text-glob`` (default ``*.py``), concatenated in the sorted order of
their paths relative to the folder (hidden folders, ``site-packages`` and ``dist-packages``
skipped). By default it is the Python standard library's own source folder, real text that
is present on every machine. At most ``--text-bytes`` bytes are read, from the start of the
stream, so start-up stays fast.

The vocabulary is the 256 byte values. The last :data:`VALIDATION_FRACTION` of the stream
is the validation split and the rest the training split (disjoint, deterministic):

* a training sample is the window of ``seq_len + 1`` bytes starting at any position of the
  training split (input: its first ``seq_len`` bytes, target: its last ``seq_len``); an
  epoch visits every start position once in a random order, which is about ``seq_len``
  passes over the training bytes, so language-model runs are usually bounded by ``--steps``;
* the validation windows do not overlap (stride ``seq_len``), so every validation byte after
  the first is predicted exactly once (a final partial window is left out) and the mean loss
  is the loss per byte.

The windows are views of the stream (``Tensor.unfold``): no byte is copied until a batch is
gathered.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from dkfac.app.cifar import DataError, PathLike
from dkfac.app.splits import Splits

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256
VALIDATION_FRACTION = 0.1
DEFAULT_TEXT_BYTES = 2_000_000
DEFAULT_GLOB = "*.py"
SKIPPED_FOLDERS = ("site-packages", "dist-packages", "__pycache__")


def default_text_path() -> Path:
    """The Python standard library's source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(root: PathLike, pattern: str = DEFAULT_GLOB) -> list[Path]:
    """The files :func:`read_text_bytes` reads from ``root``, in reading order.

    Args:
        root: A file (returned alone) or a folder (searched recursively).
        pattern: ``fnmatch`` pattern of the file names to read from a folder.

    Returns:
        The files, sorted by their POSIX path relative to ``root``.

    Raises:
        DataError: If ``root`` does not exist or a folder holds no matching file.
    """
    base = Path(root)
    if base.is_file():
        return [base]
    if base.exists() and not base.is_dir():
        raise DataError(f"--text-path {base} is neither a regular file nor a folder")
    if not base.is_dir():
        raise DataError(f"--text-path {base} does not exist (give a text file or a folder)")
    found: list[tuple[str, Path]] = []
    for folder, subfolders, names in os.walk(base):
        subfolders[:] = [
            d for d in subfolders if not d.startswith(".") and d not in SKIPPED_FOLDERS
        ]
        for name in names:
            path = Path(folder, name)
            if fnmatch.fnmatch(name, pattern) and path.is_file():
                found.append((path.relative_to(base).as_posix(), path))
    if not found:
        raise DataError(f"--text-path {base}: no file matching {pattern!r} in this folder")
    return [path for _, path in sorted(found)]


def read_text_bytes(root: PathLike, max_bytes: int, pattern: str = DEFAULT_GLOB) -> bytes:
    """The first ``max_bytes`` bytes of the concatenated files of ``root`` (see module doc).

    Raises:
        DataError: For a missing path, a folder without matching files, an unreadable file,
            files that are all empty, or ``max_bytes < 1``.
    """
    if max_bytes < 1:
        raise DataError(f"--text-bytes must be >= 1, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in text_files(root, pattern):
        try:
            with path.open("rb") as handle:
                chunk = handle.read(max_bytes - total)
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror or err}") from None
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if total == 0:
        raise DataError(f"--text-path {root}: the text is empty (0 bytes read)")
    return b"".join(chunks)


def byte_tensor(data: bytes) -> Tensor:
    """The bytes as an int64 tensor of token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split_point(n: int, seq_len: int) -> int:
    """Where the validation split starts in a stream of ``n`` bytes.

    Raises:
        DataError: If either split would hold less than one window of ``seq_len + 1`` bytes.
    """
    cut = n - max(seq_len + 1, math.ceil(n * VALIDATION_FRACTION))
    if cut < seq_len + 1:
        raise DataError(
            f"the text has {n} bytes; --seq-len {seq_len} needs at least {2 * (seq_len + 1)} "
            f"(one window of seq_len + 1 bytes in each split; raise --text-bytes or use "
            f"more text)"
        )
    return cut


def windows(stream: Tensor, seq_len: int, stride: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets of the windows of ``seq_len + 1`` tokens every ``stride`` tokens.

    Returns:
        ``(x, y)``, views of shape ``(count, seq_len)``: ``y`` is ``x`` shifted by one token.
    """
    win = stream.unfold(0, seq_len + 1, stride)
    return win[:, :-1], win[:, 1:]


def load_text(
    path: PathLike | None = None,
    seq_len: int = 128,
    max_bytes: int = DEFAULT_TEXT_BYTES,
    pattern: str = DEFAULT_GLOB,
) -> Splits:
    """The byte-level language-model dataset (see the module docstring).

    Args:
        path: A text file or a folder; ``None`` for :func:`default_text_path`.
        seq_len: Tokens per sample (the model's context).
        max_bytes: At most this many bytes are read.
        pattern: File-name pattern for a folder.

    Returns:
        :class:`~dkfac.app.splits.Splits` with int64 token windows ``(N, seq_len)`` as inputs
        and targets, ``num_classes`` 256 (the vocabulary), ``image_size`` ``seq_len`` and
        ``in_channels`` 1; the test split is the validation split.

    Raises:
        DataError: For a bad path, no matching files, too little text or ``seq_len < 1``.
    """
    if seq_len < 1:
        raise DataError(f"--seq-len must be >= 1, got {seq_len}")
    root = default_text_path() if path is None else Path(path)
    stream = byte_tensor(read_text_bytes(root, max_bytes, pattern))
    cut = split_point(len(stream), seq_len)
    x_train, y_train = windows(stream[:cut], seq_len, 1)
    x_val, y_val = windows(stream[cut:], seq_len, seq_len)
    logger.info(
        "text %s: %d bytes, %d train windows, %d validation windows of %d bytes",
        root, len(stream), len(x_train), len(x_val), seq_len + 1,
    )  # fmt: skip
    return Splits(
        "text",
        x_train,
        y_train,
        x_val,
        y_val,
        in_channels=1,
        image_size=seq_len,
        num_classes=BYTE_VOCAB,
    )
