"""The benchmarks' argument parser: output paths checked before any run starts.

A benchmark runs for minutes to hours and writes its JSON, plots or page at the end; a path
it cannot write must fail at once, with one line and exit 2, not as a traceback after the
run. :class:`BenchParser` is ``argparse.ArgumentParser`` with those checks applied to the
arguments every benchmark names alike:

* ``--name``: a result's file stem, without a folder (``--out-dir`` says where);
* ``--out-dir``, ``--plot-dir``: folders made when missing, so their nearest existing
  ancestor must be a folder, and they must not be files;
* ``--out``, ``--plot``, ``--page``: files, in a folder that exists, and not folders;
* every one of these: in a folder where a file can be made (one is made and removed);
* ``--results``: a folder that exists (read, not written);
* every one of these: no name longer than a file system takes (with ``--out``'s ``.tmp``);
* ``--world-size``, ``--world-sizes``, ``--worlds``: at most :data:`MAX_LOCAL_RANKS` (each
  rank is a process started on this machine);
* ``--threads``: in ``dkfac train``'s range, [1, 4096] (``0`` too where that is the
  default, "torch's own"): torch's ``set_num_threads`` raised past 2**63;
* ``--seed``, ``--first-seed``, ``--sweep-seed``, ``--split-seed``: seeds as ``dkfac
  train`` takes them, [0, 2**32 - 1] (numpy's and scikit-learn's, which split the digits),
  and the last of ``--seeds`` (``--sweep-seeds``) runs from the first no further.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dkfac.app.domains import DOMAINS, SEED_MAX, domain_error
from dkfac.app.pathnames import NAME_MAX, long_name

__all__ = ["MAX_LOCAL_RANKS", "BenchParser", "path_problem"]

MAX_LOCAL_RANKS = 64
"""The most ranks a benchmark starts, each a process on this machine (a billion was taken,
and spawned until the machine gave out)."""
_WORLDS = ("world_size", "world_sizes", "worlds")

_SEEDS = ("seed", "first_seed", "sweep_seed", "split_seed")
_SEED_COUNTS = (("first_seed", "seeds"), ("sweep_seed", "sweep_seeds"))
_FOLDERS = ("out_dir", "plot_dir")
_FILES = ("out", "plot", "page")
_ENDINGS = {"out": ".tmp"}
"""What is appended to a path's last name when it is written: ``--out``'s JSON goes through
a ``.json.tmp`` file (:func:`~dkfac.bench.common.write_result`)."""


def path_problem(kind: str, value: str | Path, ending: str = "") -> str | None:
    """What is wrong with ``value`` as a ``kind`` path (``"folder"``: made when missing,
    ``"file"``: written, ``"input folder"``: read), or ``None``; its last name counted
    with ``ending`` (what the program appends to it, :func:`~dkfac.app.pathnames.long_name`)."""
    path = Path(value)
    if str(value) == "":
        return "is empty"
    if problem := long_name(value, ending):
        return problem
    if kind == "input folder":
        return None if path.is_dir() else "is not a folder that exists"
    if kind == "file":
        if path.is_dir():
            return "is a folder, not a file"
        parent = path.parent
        if parent.exists() and not parent.is_dir():
            return f"is inside a file ({str(parent)!r})"
        if not parent.is_dir():
            return f"is in a folder that does not exist ({str(parent)!r})"
        return _unwritable(parent)
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    ancestor = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if ancestor.exists() and not ancestor.is_dir():
        return f"is inside a file ({str(ancestor)!r})"
    return _unwritable(ancestor) if ancestor.is_dir() else None


def _unwritable(folder: Path) -> str | None:
    """Why no file can be made in the existing ``folder`` (``None``: one can): a file is
    made and removed again, the one test that holds for root and read-only mounts too."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"is in a folder where no file can be made ({str(folder)!r}: {err.strerror})"
    return None


class BenchParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose ``parse_args`` checks the output paths (module
    notes) and answers a bad one with ``error`` (one line, exit 2)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        name = getattr(parsed, "name", None)
        if isinstance(name, str) and (not name or Path(name).name != name or name in ("..", ".")):
            self.error(f"--name must be a file name without a folder (--out-dir), got {name!r}")
        if isinstance(name, str) and len(f"{name}.json.tmp".encode()) > NAME_MAX:
            self.error(  # the run went whole, then its result could not be written
                f"--name is {len(name.encode())} bytes; a file name takes at most {NAME_MAX} "
                f"with its .json.tmp ending"
            )
        checks = [(key, "folder") for key in _FOLDERS] + [(key, "file") for key in _FILES]
        checks.append(("results", "input folder"))
        for key, kind in checks:
            value = getattr(parsed, key, None)
            if value is None or (key in ("plot", "plot_dir") and value == ""):
                continue  # not given ('' turns a default plot off)
            problem = path_problem(kind, value, _ENDINGS.get(key, ""))
            if problem:
                self.error(f"--{key.replace('_', '-')} {str(value)!r} {problem}")
        if problem := self._number_problem(parsed):
            self.error(problem)
        for key in _WORLDS:
            value = getattr(parsed, key, None)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, int) and v > MAX_LOCAL_RANKS for v in values):
                self.error(
                    f"--{key.replace('_', '-')} must be at most {MAX_LOCAL_RANKS} (ranks are "
                    f"processes started on this machine), got {max(values)}"
                )
        return parsed

    def _number_problem(self, parsed: argparse.Namespace) -> str | None:
        """What is wrong with ``--threads`` or a seed of ``parsed`` (``None``: nothing)."""
        threads = getattr(parsed, "threads", None)
        own = threads == 0 == self.get_default("threads")  # 0 as the default: torch's own
        if isinstance(threads, int) and not own and (problem := domain_error("threads", threads)):
            return problem
        seeds = DOMAINS["seed"]
        for key in _SEEDS:
            value = getattr(parsed, key, None)
            if isinstance(value, int) and not seeds.contains(value):
                return f"--{key.replace('_', '-')} must be {seeds.describe()}, got {value}"
        for start, count in _SEED_COUNTS:
            first, many = getattr(parsed, start, 0), getattr(parsed, count, None)
            if isinstance(first, int) and isinstance(many, int) and first + many - 1 > SEED_MAX:
                return (
                    f"--{count.replace('_', '-')} {many} from seed {first} run past seed "
                    f"{SEED_MAX}, the last a seed may be"
                )
        return None
