"""Shared benchmark plumbing: machine facts, interleaved repeats, medians and JSON output.

Every benchmark measures the things it compares *side by side in one run*, interleaving
their repeats, so a noisy shared machine affects all of them alike; it reports medians and
keeps every repeat in its JSON file under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dkfac.app.runconfig import dtype_or_auto

logger = logging.getLogger(__name__)

RESULTS_DIR = Path("benchmarks/results")


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Facts that make a result interpretable: host, CPU count, torch version, device."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": str(device),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def synchronize(device: torch.device) -> None:
    """Waits for queued kernels so wall-clock timings are honest on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    cases: Mapping[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Times every case ``repeats`` times, interleaving cases within each round.

    Args:
        cases: Name -> a callable that runs one measured unit (e.g. one training step).
        repeats: Rounds; each round runs every case once, in order.
        device: Synchronised around each measurement.
        warmup: Untimed rounds first.

    Returns:
        Name -> the list of measured seconds.
    """
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def check_repeats_and_out(parser: argparse.ArgumentParser, repeats: int, out: Path | None) -> None:
    """``parser.error`` (one line, exit 2) for ``--repeats`` below 1 or an ``--out`` that
    does not name a ``.json`` file."""
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    if out is not None and out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(out)!r}")


def best_seconds(
    call: Callable[[], object],
    repeats: int,
    loop_seconds: float,
    least: int,
    most: int | None = None,
    warmup: int = 1,
) -> float:
    """The best of ``repeats`` timed loops' seconds per ``call``: each loop about
    ``loop_seconds`` long (from one timed call after ``warmup`` untimed ones), of ``least``
    to ``most`` calls."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    call()
    loops = max(least, int(loop_seconds / max(time.perf_counter() - start, 1e-6)))
    loops = loops if most is None else min(most, loops)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            call()
        best = min(best, (time.perf_counter() - start) / loops)
    return best


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    return float(statistics.median(values))


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command that reproduces a run: ``prog`` and its arguments, shell-quoted."""
    return " ".join([prog, *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])


def probe_command() -> str:
    """The command that reproduces a probe script's run (``benchmarks/probes``): its path
    and arguments as given, run with ``src`` on the path."""
    return " ".join(["PYTHONPATH=src python", *(shlex.quote(a) for a in sys.argv)])


def write_result(
    name: str,
    payload: dict[str, Any],
    out_dir: Path | str | None = None,
    command: str | None = None,
) -> Path:
    """Writes ``payload`` (plus the command line) as pretty JSON to ``<out_dir>/<name>.json``.

    Args:
        name: File stem.
        payload: JSON-serialisable results.
        out_dir: Directory (default ``benchmarks/results``).
        command: The command line to record (default: ``dkfac`` + ``sys.argv[1:]``).
    """
    directory = Path(out_dir) if out_dir is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {"command": command or command_line("dkfac", None), **payload}
    tmp = path.with_suffix(".json.tmp")
    # Options may hold torch dtypes (``capture_dtype=bfloat16``): written by name.
    text = json.dumps(payload, indent=2, sort_keys=False, default=_by_name)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    logger.info("wrote %s", path)
    return path


def _by_name(value: object) -> str:
    """JSON for what it cannot encode itself: a torch dtype by its name."""
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-markdown table."""

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def first_reaching(
    trace: list[tuple[int, float, float]], threshold: float, *, higher_is_better: bool = True
) -> tuple[int, float] | None:
    """The first ``(step, seconds)`` of ``trace`` whose value reaches ``threshold``.

    Args:
        trace: ``(step, cumulative training seconds, value)`` in increasing step order, e.g.
            test accuracy after each step, or training loss.
        threshold: Target value.
        higher_is_better: Reached when ``value >= threshold`` (accuracy); otherwise when
            ``value <= threshold`` (loss).

    Returns:
        ``(step, seconds)`` of the first point reaching the threshold, ``None`` if none does.
    """
    for step, seconds, value in trace:
        if (value >= threshold) if higher_is_better else (value <= threshold):
            return step, seconds
    return None


def parse_options(text: str) -> dict[str, Any]:
    """``"a=1,b=x,c=0.5"`` -> ``{"a": 1, "b": "x", "c": 0.5}`` (ints, floats, None, bools, strings).

    ``none``/``true``/``false`` are read in any case (``kl_clip=none``, ``moment_nesterov=true``,
    as a recipe or ``dkfac train`` writes them). A key ending in ``_dtype`` takes a torch dtype
    by name (``capture_dtype=bfloat16``) or ``auto`` (bf16 where the device multiplies it
    natively; the fields that do not take it refuse it).

    Raises:
        ValueError: For an item without ``=``, a key given twice, or an unknown dtype name.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"option {item!r} is not of the form key=value")
        value: Any = raw
        if raw.lower() == "none":
            value = None
        elif raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif key.strip().endswith("_dtype"):
            try:
                value = dtype_or_auto(raw)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"option {item!r}: {error}") from error
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        if key.strip() in out:
            raise ValueError(f"option {key.strip()!r} is given twice")
        out[key.strip()] = value
    return out
