"""Reading and writing the official CIFAR-10 / CIFAR-100 "python version" archives.

The archives (``cifar-10-python.tar.gz``, ``cifar-100-python.tar.gz``) hold Python-2 pickles
of dicts with bytes keys: ``b"data"`` is a ``uint8`` array of shape ``(N, 3072)`` (1024 red,
then green, then blue values of a 32x32 image, row-major) and ``b"labels"`` (CIFAR-10) or
``b"fine_labels"`` (CIFAR-100) a list of ints.

Unpickling can run arbitrary code, so batches are read with :class:`RestrictedUnpickler`,
which resolves only the few numpy globals an array needs. Archives are read member by member
straight from the tar file, never extracted to disk. Every failure (missing, truncated or
malformed file, forbidden global) raises :class:`DataError` naming the file.
"""

from __future__ import annotations

import codecs
import importlib
import io
import logging
import pickle
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

PathLike = str | Path


class DataError(ValueError):
    """A dataset is missing, truncated, malformed or unsafe to load."""


class CifarArrays(NamedTuple):
    """Raw CIFAR arrays: ``uint8`` images ``(N, 3, 32, 32)`` and ``int64`` labels ``(N,)``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class CifarLayout:
    """File names of one CIFAR variant."""

    name: str
    archive: str
    folder: str
    train: tuple[str, ...]
    test: str
    label_key: bytes
    num_classes: int

    def expected(self) -> str:
        """Human-readable description of what a ``--data-dir`` must contain."""
        return (
            f"{self.archive}, or the extracted folder {self.folder}/ with "
            f"{', '.join(self.train)} and {self.test}"
        )


CIFAR10 = CifarLayout(
    "CIFAR-10",
    "cifar-10-python.tar.gz",
    "cifar-10-batches-py",
    tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test_batch",
    b"labels",
    10,
)
CIFAR100 = CifarLayout(
    "CIFAR-100",
    "cifar-100-python.tar.gz",
    "cifar-100-python",
    ("train",),
    "test",
    b"fine_labels",
    100,
)
_CIFAR10_NAMES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog")
_CIFAR10_NAMES += ("frog", "horse", "ship", "truck")


def layout(num_classes: int) -> CifarLayout:
    """The layout for ``num_classes`` (10 or 100); raises :class:`DataError` otherwise."""
    if num_classes == 10:
        return CIFAR10
    if num_classes == 100:
        return CIFAR100
    raise DataError(f"CIFAR num_classes must be 10 or 100, got {num_classes}")


def _numpy_global(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _frombuffer() -> Any:
    for module in ("numpy._core.numeric", "numpy.core.numeric"):
        try:
            return _numpy_global(module, "_frombuffer")
        except (ImportError, AttributeError):
            continue
    return None  # pragma: no cover - every supported numpy has one of them


_RECONSTRUCT = np.ndarray((0,), np.uint8).__reduce__()[0]
_FROMBUFFER = _frombuffer()
_ALLOWED: dict[tuple[str, str], Any] = {
    # Python-2 era files (the official archives) and numpy 1.x pickles.
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    # numpy 2.x pickles (protocol <= 4), and protocol-5 pickles of either major version.
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 writes bytes as ``_codecs.encode(str, "latin1")`` under protocol 2.
    ("_codecs", "encode"): codecs.encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the numpy globals needed to rebuild a plain array.

    Any other global (``os.system``, ``builtins.eval``, ...) raises :class:`DataError` before
    it can be called; persistent ids are refused too. Besides the numpy array reconstructors,
    only ``_codecs.encode`` is allowed (Python 3 protocol-2 pickles use it for ``bytes``).

    Args:
        file: Binary file holding the pickle.
        source: Name of the file, used in error messages.
    """

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, source: str) -> None:
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """Returns an allowed global; raises :class:`DataError` for anything else."""
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise DataError(
                f"{self.source}: refusing to unpickle global {module}.{name}: a CIFAR batch may "
                f"only reference numpy array reconstruction (file is corrupt or malicious)"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        """Refuses persistent ids, which no CIFAR batch uses."""
        raise DataError(f"{self.source}: refusing to unpickle a persistent id")


def parse_batch(raw: bytes, source: str, lay: CifarLayout) -> tuple[np.ndarray, np.ndarray]:
    """Parses one pickled batch into images ``(N, 3, 32, 32)`` and labels ``(N,)``.

    Args:
        raw: The pickle bytes.
        source: File name for error messages.
        lay: Which CIFAR variant the batch belongs to.

    Returns:
        ``uint8`` images and ``int64`` labels.

    Raises:
        DataError: If the bytes are not a safe, well-formed CIFAR batch.
    """
    key = lay.label_key
    want = f"expected a pickled dict with keys b'data' and {key!r} ({lay.name} python format)"
    try:
        obj = RestrictedUnpickler(io.BytesIO(raw), source).load()
    except DataError:
        raise
    except Exception as exc:  # pickle raises many types on garbage input
        raise DataError(f"{source}: not a readable pickle, {want} ({exc!r})") from None
    if not isinstance(obj, dict) or b"data" not in obj or key not in obj:
        found = sorted(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{source}: {want}; found {found}")
    data, labels = obj[b"data"], obj[key]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        raise DataError(f"{source}: b'data' must be a uint8 array of shape (N, 3072); {want}")
    if data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{source}: b'data' has shape {data.shape}, expected (N, 3072)")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"{source}: {key!r} must be a list of ints") from None
    if y.shape != (data.shape[0],):
        raise DataError(f"{source}: {key!r} has shape {y.shape}, expected ({data.shape[0]},)")
    if y.size and (y.min() < 0 or y.max() >= lay.num_classes):
        raise DataError(f"{source}: labels outside [0, {lay.num_classes}) in {key!r}")
    return data.reshape(-1, 3, 32, 32).copy(), y


def _read_tar(path: Path, lay: CifarLayout) -> dict[str, tuple[str, bytes]]:
    """Reads the needed members of an archive: ``{file name: (source, bytes)}``."""
    wanted = {f"{lay.folder}/{name}": name for name in (*lay.train, lay.test)}
    found: dict[str, tuple[str, bytes]] = {}
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                name = wanted.get(member.name.removeprefix("./"))
                if name is None or not member.isfile():
                    continue
                handle = tar.extractfile(member)
                if handle is None:  # pragma: no cover - isfile() members always have data
                    continue
                found[name] = (f"{path} (member {member.name})", handle.read())
            # Read to the end so that gzip checks its CRC and length trailer.
            while tar.fileobj is not None and tar.fileobj.read(1 << 20):
                pass
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise DataError(
            f"{path}: truncated or not a gzip tar archive (expected the official "
            f"{lay.archive}): {' '.join(str(exc).split())}"  # tarfile's text spans lines
        ) from None
    for member_name, name in wanted.items():
        if name not in found:
            raise DataError(
                f"{path}: archive has no member {member_name} (truncated archive, or not the "
                f"official {lay.archive} layout)"
            )
    return found


def _read_folder(folder: Path, lay: CifarLayout) -> dict[str, tuple[str, bytes]]:
    found: dict[str, tuple[str, bytes]] = {}
    for name in (*lay.train, lay.test):
        path = folder / name
        try:
            found[name] = (str(path), path.read_bytes())
        except OSError as exc:
            raise DataError(
                f"{path}: missing or unreadable {lay.name} batch file (expected {lay.expected()})"
                f": {exc.strerror or exc}"
            ) from None
    return found


def _locate(root: Path, lay: CifarLayout) -> dict[str, tuple[str, bytes]]:
    if root.is_file():
        return _read_tar(root, lay)
    if not root.is_dir():
        raise DataError(f"{root}: no such file or directory (expected {lay.expected()})")
    if (root / lay.folder).is_dir():
        return _read_folder(root / lay.folder, lay)
    if (root / lay.archive).is_file():
        return _read_tar(root / lay.archive, lay)
    if root.name == lay.folder or (root / lay.test).is_file():
        return _read_folder(root, lay)
    raise DataError(f"{root}: contains neither {lay.expected()}")


def read_cifar(root: PathLike, num_classes: int = 10) -> CifarArrays:
    """Reads a CIFAR-10 or CIFAR-100 python archive without normalising it.

    Args:
        root: The ``.tar.gz`` archive, a directory holding it or its extracted folder, or the
            extracted folder itself.
        num_classes: 10 for CIFAR-10, 100 for CIFAR-100 (fine labels).

    Returns:
        ``uint8`` images ``(N, 3, 32, 32)`` and ``int64`` labels for train and test.

    Raises:
        DataError: If anything is missing, truncated, malformed or unsafe.
    """
    lay = layout(num_classes)
    files = _locate(Path(root), lay)
    parts = [parse_batch(raw, src, lay) for src, raw in (files.pop(n) for n in lay.train)]
    x_test, y_test = parse_batch(files[lay.test][1], files[lay.test][0], lay)
    x_train = np.concatenate([x for x, _ in parts])
    y_train = np.concatenate([y for _, y in parts])
    logger.info("read %s from %s: %d train, %d test", lay.name, root, len(y_train), len(y_test))
    return CifarArrays(x_train, y_train, x_test, y_test)


def _py2_pickle(obj: object) -> bytes:
    """Pickles ``obj`` exactly as Python 2's ``cPickle`` (protocol 2) wrote the CIFAR files.

    Supports dicts, lists, ints, bytes (Python 2 ``str``) and 2-D ``uint8`` arrays, which are
    written with the ``numpy.core.multiarray._reconstruct`` reduction of the official files.
    """
    out = bytearray(b"\x80\x02")

    def string(b: bytes) -> None:
        out.extend(
            b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b
        )

    def integer(i: int) -> None:
        out.extend(b"K" + bytes([i]) if 0 <= i < 256 else b"J" + struct.pack("<i", i))

    def emit(o: object) -> None:
        if isinstance(o, bool) or o is None:
            raise TypeError(f"unsupported {type(o).__name__}")
        if isinstance(o, int):
            integer(o)
        elif isinstance(o, bytes):
            string(o)
        elif isinstance(o, list):
            out.extend(b"](")
            for item in o:
                emit(item)
            out.extend(b"e")
        elif isinstance(o, dict):
            out.extend(b"}(")
            for k, v in o.items():
                emit(k)
                emit(v)
            out.extend(b"u")
        elif isinstance(o, np.ndarray) and o.dtype == np.uint8 and o.ndim == 2:
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85")
            string(b"b")
            out.extend(b"\x87R(K\x01")  # REDUCE, then the state tuple (version 1, shape, ...)
            integer(o.shape[0])
            integer(o.shape[1])
            out.extend(b"\x86cnumpy\ndtype\n")
            string(b"u1")
            out.extend(b"K\x00K\x01\x87R(K\x03")
            string(b"|")
            out.extend(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")
            string(np.ascontiguousarray(o).tobytes())
            out.extend(b"tb")
        else:
            raise TypeError(f"unsupported {type(o).__name__}")

    emit(obj)
    out.extend(b".")
    return bytes(out)


def _batch_bytes(
    lay: CifarLayout, label: str, x: np.ndarray, y: np.ndarray, rng: np.random.Generator
) -> bytes:
    d: dict[bytes, object] = {b"batch_label": label.encode()}
    if lay.num_classes == 100:
        d[b"fine_labels"] = y.tolist()
        d[b"coarse_labels"] = (y // 5).tolist()
    else:
        d[b"labels"] = y.tolist()
    d[b"data"] = x.reshape(len(x), -1)
    d[b"filenames"] = [f"img_{int(v):05d}.png".encode() for v in rng.integers(0, 10**5, len(x))]
    return _py2_pickle(d)


def write_cifar_archive(
    path: PathLike,
    num_classes: int = 10,
    n_train_per_batch: int = 10,
    n_test: int = 10,
    seed: int = 0,
) -> CifarArrays:
    """Writes a tiny random CIFAR archive in the official python format.

    Member names, pickle layout (Python-2 protocol 2, bytes keys) and ``uint8`` data match the
    official files, so the result loads with :func:`read_cifar` and with any other CIFAR
    reader. CIFAR-10 gets five training batches of ``n_train_per_batch`` images; CIFAR-100,
    whose official archive has a single ``train`` file, gets ``5 * n_train_per_batch`` images
    in it, so both have the same training-set size.

    Args:
        path: Ends with ``.tar.gz`` or ``.tgz``: the archive to write. Anything else: a
            directory in which the extracted folder (``cifar-10-batches-py/`` or
            ``cifar-100-python/``) is written.
        num_classes: 10 or 100.
        n_train_per_batch: Images per CIFAR-10 training batch.
        n_test: Test images.
        seed: Seed of the random images and labels.

    Returns:
        The arrays written, as :func:`read_cifar` will return them.
    """
    lay = layout(num_classes)
    rng = np.random.default_rng(seed)
    n_train = 5 * n_train_per_batch
    x = rng.integers(0, 256, size=(n_train + n_test, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, num_classes, size=n_train + n_test).astype(np.int64)
    arrays = CifarArrays(x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    members: dict[str, bytes] = {}
    chunks = np.array_split(np.arange(n_train), len(lay.train))
    for i, (name, idx) in enumerate(zip(lay.train, chunks, strict=True)):
        label = f"training batch {i + 1} of {len(lay.train)}"
        members[name] = _batch_bytes(lay, label, x[idx], y[idx], rng)
    members[lay.test] = _batch_bytes(lay, "testing batch 1 of 1", x[n_train:], y[n_train:], rng)
    if num_classes == 10:
        meta = {b"num_cases_per_batch": n_train_per_batch, b"num_vis": 3072}
        members["batches.meta"] = _py2_pickle(
            {**meta, b"label_names": [n.encode() for n in _CIFAR10_NAMES]}
        )
    else:
        members["meta"] = _py2_pickle(
            {
                b"fine_label_names": [f"fine_{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"coarse_{i}".encode() for i in range(20)],
            }
        )
    out = Path(path)
    if out.name.endswith((".tar.gz", ".tgz")):
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, mode="w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(f"{lay.folder}/{name}")
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    else:
        folder = out / lay.folder
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in members.items():
            (folder / name).write_bytes(data)
    logger.info("wrote a %d-image %s archive to %s", n_train + n_test, lay.name, out)
    return arrays
