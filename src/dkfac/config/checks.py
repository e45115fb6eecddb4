"""Validation helpers: one check per kind of domain, with messages that name the argument.

Every configuration field, and every value a schedule produces, goes through one of these, so
a bad value fails where it enters with what was wrong and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from dkfac.solvers.kron_basis import check_input_map
from dkfac.solvers.precision import AUTO

__all__ = [
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_input_maps",
    "check_int",
    "check_patterns",
    "check_range",
    "python_number",
    "python_numbers",
    "shown",
]

GRAPH = "graph"
"""``flattened_inputs="graph"``: the maps are read off the model's graph."""
GRAPH_MAPS = {"<graph>": (1, 1)}
"""How a config holds ``"graph"`` until the preconditioner resolves it (no layer is named
``<graph>``: module names hold no angle brackets)."""
BLOCK_WIDTHS = "widths"
"""``basis_block_size="widths"``: the block width is read off the model's layer widths."""
INT64_MAX = 2**63 - 1
"""The largest integer an option takes by default: what a torch tensor holds (a count past
float's range, ``10**400``, failed deep inside the cost model at the first step)."""
_INPUT_MAP = re.compile(r"^\s*(\S+?)\s*=\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def python_number(value: Any) -> Any:
    """``value`` as the Python number it holds where it is a number of another kind: a
    numpy scalar or 0-d array (``np.float32(0.1)``, ``np.int64(4)``, ``np.bool_(True)``) as
    its ``item()``, another ``numbers.Integral`` as an ``int``, another ``numbers.Real``
    (``fractions.Fraction``) as a ``float``; anything else (a bool, int or float, a tensor,
    a string, a callable) as it is."""
    kind = type(value)
    if kind in (bool, int, float):
        return value
    if kind.__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def python_numbers(config: Any) -> None:
    """Replaces, in place, every field of the frozen dataclass ``config`` that holds a number
    of another kind (a numpy scalar) by the Python number it holds (:func:`python_number`),
    so that the checks and everything downstream see ints, floats and bools."""
    for each in dataclasses.fields(config):
        value = getattr(config, each.name)
        number = python_number(value)
        if number is not value:
            object.__setattr__(config, each.name, number)


def check_range(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
) -> None:
    """A finite number in the interval (``inf`` as a bound means unbounded, never allowed).

    A number of another kind (a numpy scalar) is checked as the Python number it holds
    (:func:`python_number`).

    Raises:
        TypeError: If ``value`` is not a real number (a bool is not a number here).
        ValueError: If it is not finite or lies outside the interval.
    """
    value = python_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok_low = value >= low if low_inclusive else value > low
    ok_high = value <= high if high_inclusive else value < high
    interval = f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
    if not (_finite(value) and ok_low and ok_high):
        raise ValueError(f"{name} must be in {interval}, got {shown(value)}")


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float: an int past float's range (``10**400``) is not,
    as ``float()`` (and everything downstream that computes with it) cannot take it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value: Any) -> str:
    """``repr(value)``, but an integer of more than 30 digits by its size (``10**400``
    would fill a screen)."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 30:
        return f"an integer of {len(str(abs(value)))} digits"
    return text


def check_int(
    name: str, value: Any, *, low: int = 1, high: int = INT64_MAX, optional: bool = False
) -> None:
    """An integer in ``[low, high]`` (or ``None`` when ``optional``); a bool is not an
    integer here, a numpy integer is (:func:`python_number`).

    Raises:
        ValueError: Otherwise (the message names ``high`` only where it was passed).
    """
    if optional and value is None:
        return
    value = python_number(value)
    integer = isinstance(value, int) and not isinstance(value, bool)
    if not integer or value < low or value > high:
        within = f"in [{low}, {_bound(high)}]" if integer and value > high else f">= {low}"
        allowed = f"{'None or ' if optional else ''}an integer {within}"
        raise ValueError(f"{name} must be {allowed}, got {shown(value)}")


def _bound(high: int) -> str:
    return "2**63 - 1" if high == INT64_MAX else str(high)


def check_choice(name: str, value: Any, choices: Collection[Any]) -> None:
    """One of ``choices``.

    Raises:
        ValueError: Otherwise, listing the choices.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """``True`` or ``False`` (or ``None`` when ``optional``).

    Raises:
        TypeError: Otherwise.
    """
    if optional and value is None:
        return
    if not isinstance(python_number(value), bool):
        allowed = "True, False or None" if optional else "a bool"
        raise TypeError(f"{name} must be {allowed}, got {value!r}")


FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating dtypes a precision option may name: torch's float8 types are floating too,
but hold no products (a float8 matrix product is not implemented on most devices) and keep
two or three significant bits."""


def check_dtype(
    name: str,
    value: Any,
    *,
    allowed: Collection[torch.dtype] | None = None,
    optional: bool = True,
    auto: bool = False,
) -> None:
    """One of ``allowed`` (default :data:`FLOATING_DTYPES`), ``None`` when ``optional``, or
    ``"auto"`` when ``auto`` (:mod:`dkfac.solvers.precision`).

    Raises:
        ValueError: Otherwise.
    """
    if (optional and value is None) or (auto and isinstance(value, str) and value == AUTO):
        return
    allowed = FLOATING_DTYPES if allowed is None else allowed
    if not (isinstance(value, torch.dtype) and value in allowed):
        kinds = ", ".join(str(d) for d in allowed)
        words = (["None"] if optional else []) + (["'auto'"] if auto else [])
        extra = ", ".join(words) + " or " if words else ""
        raise ValueError(f"{name} must be {extra}{kinds}, got {value!r}")


def check_input_maps(name: str, value: Any) -> dict[str, tuple[int, int]]:
    """Layer name -> ``(channels, positions)``, from a mapping or ``"NAME=CxP"`` strings.

    The strings are the command line's spelling (``classifier.0=64x16``); one string alone
    is one entry. ``"graph"`` (alone) asks for the maps found in the model's graph: it is
    kept as the one entry :data:`GRAPH_MAPS` until the preconditioner reads the model.

    Raises:
        TypeError: If ``value`` is neither a mapping nor strings.
        ValueError: For a malformed entry, an empty name, a name given twice, or a count
            that is not an integer >= 1.
    """
    allowed = "'graph', a mapping {layer name: (channels, positions)} or strings 'NAME=CxP'"
    if value == GRAPH or (isinstance(value, (list, tuple)) and list(value) == [GRAPH]):
        return dict(GRAPH_MAPS)
    entries: list[tuple[Any, Any]] = []
    if isinstance(value, Mapping):
        entries = list(value.items())
    elif isinstance(value, (str, list, tuple)):
        for item in (value,) if isinstance(value, str) else value:
            match = _INPUT_MAP.match(item) if isinstance(item, str) else None
            if match is None:
                raise ValueError(f"{name} must be {allowed}, got the entry {item!r}")
            entries.append((match[1], (int(match[2]), int(match[3]))))
    else:
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")
    maps: dict[str, tuple[int, int]] = {}
    for layer, shape in entries:
        if isinstance(shape, (list, tuple)):
            shape = tuple(python_number(count) for count in shape)
        if not isinstance(layer, str) or not layer:
            raise ValueError(f"{name}: a layer name must be a non-empty string, got {layer!r}")
        if layer in maps:
            raise ValueError(f"{name}: layer {layer!r} is given twice")
        try:
            maps[layer] = check_input_map(shape)
        except ValueError:
            raise ValueError(
                f"{name}[{layer!r}] must be (channels, positions), two integers >= 1, got {shape!r}"
            ) from None
    return maps


def check_patterns(name: str, value: Any) -> tuple[str, ...]:
    """Regular expressions, from one string or a sequence of them, as a tuple.

    Raises:
        TypeError: If ``value`` is not a string or a sequence of strings (a mapping is
            not one: its keys would be read as the patterns).
        ValueError: For a string that is not a regular expression.
    """
    message = f"{name} must be a string or a sequence of regex strings"
    if isinstance(value, Mapping):
        raise TypeError(f"{message}, got {type(value).__name__}")
    if isinstance(value, str):
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise TypeError(message) from None
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(message)
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{name}: {pattern!r} is not a regular expression ({err})") from None
    return patterns
