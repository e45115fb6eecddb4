"""Run configuration: K-FAC flags generated from :class:`KFACConfig`, config files, resolved config.

* :func:`add_kfac_arguments` adds one flag per field of :class:`~dkfac.KFACConfig` (``--damping``,
  also spelled ``--kfac-damping``), typed from the field's annotation, so options added to
  the config later appear on the command line with no change here. A field that shares its
  name with a training flag (``lr``, ``seed``, ``accumulation_steps``) takes that flag's value.
  Every field that accepts a schedule also gets ``--<field>-schedule "VALUE@EPOCH,..."``.
* :func:`config_file_tokens` turns a TOML file whose keys are flag names into command-line
  tokens, so a file value goes through exactly the parsing and checks of the flag, and flags
  given on the command line (parsed after them) win.
* :func:`resolved_config` / :func:`write_resolved_config` save every option of a run as TOML
  and JSON; the TOML file is a valid ``--config`` that reproduces the run.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

import torch

from dkfac.app.pathnames import long_name
from dkfac.app.schedules import parse_piecewise, piecewise_by_step
from dkfac.config import KFACConfig
from dkfac.optimizer import DEFAULT_OPTIONS, method_defaults
from dkfac.solvers.precision import AUTO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

NONE_WORDS = ("none", "null")
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
SKIPPED_KEYS = ("command", "config", "given")

TRAINING_FIELDS = ("lr", "seed", "accumulation_steps")
"""Fields of :class:`KFACConfig` whose flags are the training program's own."""
# Decisions about one launch, not properties of the run: its config.toml saves them off, so
# running that file again never wipes the folder it came from.
ONE_LAUNCH = {"overwrite": False}


class ConfigError(ValueError):
    """A config file that cannot be read or holds keys that are not flags."""


def optional(convert: typing.Callable[[str], Any]) -> typing.Callable[[str], Any]:
    """Wraps an argparse ``type`` so that ``none`` / ``null`` parse to ``None``."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() in NONE_WORDS else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def number(text: str) -> float | int:
    """An ``int`` when the text is integral (``10``), else a ``float`` (``1e-3``)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def boolean(text: str) -> bool:
    """``true`` / ``false`` (also ``yes``/``no``, ``1``/``0``, ``on``/``off``)."""
    word = text.strip().lower()
    if word in ("true", "yes", "1", "on"):
        return True
    if word in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true, false or none, got {text!r}")


def dtype(text: str) -> torch.dtype:
    """A torch floating dtype by name (``float32``, ``torch.float64``, ...)."""
    name = text.strip().removeprefix("torch.")
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def schedule_text(text: str) -> str:
    """Validates ``"VALUE@EPOCH,..."`` (see :func:`~dkfac.app.schedules.parse_piecewise`)."""
    try:
        parse_piecewise(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def dtype_or_auto(text: str) -> torch.dtype | str:
    """A dtype name, or ``auto`` (bf16 where the device multiplies it natively)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return dtype(text)
    except argparse.ArgumentTypeError:
        choices = sorted([*DTYPES, AUTO])
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {choices}") from None


def integer_or(words: tuple[str, ...]) -> typing.Callable[[str], int | str]:
    """An argparse ``type``: an integer, or one of ``words`` (``basis_block_size``'s
    ``widths``)."""

    def parse(text: str) -> int | str:
        word = text.strip().lower()
        if word in words:
            return word
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer or one of {list(words)}, got {text!r}"
            ) from None

    parse.__name__ = "integer"
    return parse


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kfac_hints() -> dict[str, Any]:
    return typing.get_type_hints(KFACConfig)


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _left_at_default(value: Any, field: dataclasses.Field[Any]) -> bool:
    """Whether a flag's value is the field's default (an empty list flag for an empty
    mapping or sequence default too)."""
    default = _field_default(field)
    empty = (tuple, list, dict)
    if isinstance(value, empty) and isinstance(default, empty):
        return not value and not default
    return bool(value == default)


def _is_schedule(hint: Any) -> bool:
    return any(
        typing.get_origin(arg) is collections.abc.Callable or arg is collections.abc.Callable
        for arg in typing.get_args(hint)
    )


def _argument_spec(hint: Any) -> dict[str, Any]:
    """argparse keyword arguments (type, choices, nargs, action) for a field annotation."""
    schedule = _is_schedule(hint)
    args = typing.get_args(hint)
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    nullable = is_union and type(None) in args
    core = [a for a in args if a is not type(None)] if is_union else [hint]
    if len(core) == 1:
        hint = core[0]
    wrap = optional if nullable else (lambda convert: convert)
    if torch.dtype in core and typing.Literal[AUTO] in core:  # a precision the device decides
        metavar = "DTYPE|auto" + ("|none" if nullable else "")
        return {"type": wrap(dtype_or_auto), "metavar": metavar}
    if schedule:
        return {"type": wrap(number), "metavar": "NUMBER" + ("|none" if nullable else "")}
    literals = [a for a in core if typing.get_origin(a) is typing.Literal]
    if int in core and len(core) == 2 and literals:  # an integer or a word: "widths"
        words = tuple(str(word) for word in typing.get_args(literals[0]))
        metavar = "|".join(["INT", *words] + (["none"] if nullable else []))
        return {"type": wrap(integer_or(words)), "metavar": metavar}
    origin = typing.get_origin(hint)
    if origin in (collections.abc.Mapping, dict):  # KFACConfig.flattened_inputs: NAME=CxP ...
        return {"type": str, "nargs": "*", "metavar": "NAME=CxP"}
    if origin is typing.Literal:
        choices = list(typing.get_args(hint)) + ([None] if nullable else [])
        return {"type": wrap(str), "choices": choices}
    if origin is tuple or hint is tuple:
        return {"type": str, "nargs": "*", "metavar": "VALUE"}
    if hint is bool:
        if nullable:  # three states: a value flag, true | false | none
            return {"type": optional(boolean), "metavar": "true|false|none"}
        return {"action": argparse.BooleanOptionalAction}
    if hint is torch.dtype:
        return {"type": wrap(dtype), "metavar": "DTYPE" + ("|none" if nullable else "")}
    if hint in (int, float):
        return {"type": wrap(hint), "metavar": hint.__name__.upper()}
    return {"type": wrap(str), "metavar": "VALUE" + ("|none" if nullable else "")}


def kfac_schedule_fields() -> list[str]:
    """Fields of :class:`KFACConfig` that accept a callable schedule of the step."""
    hints = _kfac_hints()
    return [f.name for f in dataclasses.fields(KFACConfig) if _is_schedule(hints[f.name])]


def add_kfac_arguments(parser: argparse.ArgumentParser, reserved: set[str]) -> None:
    """Adds a flag for every :class:`KFACConfig` field not named in ``reserved``.

    Args:
        parser: The parser (or argument group owner) to extend.
        reserved: Destinations of training flags; a field with one of these names is filled
            from that training flag instead of getting its own flag.
    """
    group = parser.add_argument_group(
        "K-FAC options",
        "fields of dkfac.KFACConfig, used by --optimizer kfac / kfac-adam; the defaults shown "
        "are KFACPreconditioner's: with --optimizer dkfac (KFACOptimizer.for_model) a flag "
        "given replaces for_model's choice, and one not given is for_model's",
    )
    hints = _kfac_hints()
    for field in dataclasses.fields(KFACConfig):
        if field.name in reserved:
            continue
        spec = _argument_spec(hints[field.name])
        default = _field_default(field)
        if isinstance(default, collections.abc.Mapping):  # a list of NAME=CxP, as parsed
            default = _plain(default)
        elif isinstance(default, tuple):  # a list, as parsed and as a config file gives it
            default = list(default)
        group.add_argument(
            _flag(field.name),
            "--kfac-" + field.name.replace("_", "-"),
            dest=field.name,
            default=default,
            help=f"KFACConfig.{field.name} (default: {format_value(default)})",
            **spec,
        )
        if _is_schedule(hints[field.name]):
            group.add_argument(
                _flag(field.name) + "-schedule",
                dest=field.name + "_schedule",
                type=optional(schedule_text),
                default=None,
                metavar="VALUE@EPOCH,...",
                help=f"piecewise-constant {field.name} by epoch, e.g. 1e-2@0,1e-3@5 "
                f"(overrides --{field.name.replace('_', '-')})",
            )


def dkfac_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The defaults ``--optimizer dkfac`` reads the K-FAC flags over: ``for_model``'s, as
    the run's method keeps them (:func:`dkfac.optimizer.method_defaults`; ``--method``
    not given is ``for_model``'s)."""
    field = next(f for f in dataclasses.fields(KFACConfig) if f.name == "method")
    left = _left(args, field, getattr(args, "method", None))
    return method_defaults(str(DEFAULT_OPTIONS["method"] if left else args.method))


def _left(args: argparse.Namespace, field: dataclasses.Field[Any], value: Any) -> bool:
    """Whether the flag of ``field`` was left to its default: not given on the command line
    or in the config file (``args.given``, :func:`dkfac.app.cli.given_flags`), or, for a
    namespace made otherwise, at :class:`KFACConfig`'s default."""
    given = getattr(args, "given", None)
    if given is not None:
        return field.name not in given and f"{field.name}_schedule" not in given
    return _left_at_default(value, field)


def kfac_config_from_args(
    args: argparse.Namespace,
    steps_per_epoch: int = 1,
    defaults: collections.abc.Mapping[str, Any] | None = None,
) -> KFACConfig:
    """The :class:`KFACConfig` of parsed arguments, with schedules bound to the epoch length.

    ``defaults`` (e.g. :data:`dkfac.optimizer.DEFAULT_OPTIONS`) replaces the value of every
    field it names whose flag was not given (:func:`_left`).

    Raises:
        ValueError / TypeError: From :class:`KFACConfig` validation.
    """
    hints = _kfac_hints()
    values: dict[str, Any] = {}
    for field in dataclasses.fields(KFACConfig):
        if not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if isinstance(value, list):
            value = tuple(value)
        text = getattr(args, field.name + "_schedule", None)
        if text is not None:
            integer = "interval" in field.name or hints[field.name] is int
            value = piecewise_by_step(text, steps_per_epoch, integer=integer)
        elif defaults and field.name in defaults and _left(args, field, value):
            value = defaults[field.name]
        values[field.name] = value
    return KFACConfig(**values)


# ----------------------------------------------------------------------- config files
def load_config_file(path: str | Path) -> dict[str, Any]:
    """Reads a TOML config file into ``{dest: value}`` (dashes in keys become underscores).

    Raises:
        ConfigError: If the path is empty, the file is missing or a folder, not valid TOML,
            nests tables, or gives a key in both spellings (``weight-decay``, ``weight_decay``).
    """
    if not str(path).strip():
        raise ConfigError("--config is empty: give the path of a TOML file")
    file = Path(path)
    if problem := long_name(file):
        raise ConfigError(f"--config {str(file)!r} {problem}")
    try:
        with file.open("rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {file} is a folder, not a TOML file") from None
    except (OSError, ValueError) as err:  # TOMLDecodeError and UnicodeDecodeError included
        raise ConfigError(f"config file {file} is not valid TOML: {err}") from None
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            raise ConfigError(
                f"config file {file}: [{key}] tables are not supported; "
                "write every option as a top-level key = value"
            )
        dest = key.replace("-", "_")
        if dest in spelled:  # TOML keeps both spellings; one would silently replace the other
            raise ConfigError(
                f"config file {file}: {spelled[dest]!r} and {key!r} are the same key "
                f"({_flag(dest)}); give it once"
            )
        spelled[dest] = key
        values[dest] = value
    return values


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def config_file_tokens(
    values: dict[str, Any], parser: argparse.ArgumentParser, source: str
) -> list[str]:
    """Command-line tokens equivalent to config-file ``values`` for ``parser``.

    Raises:
        ConfigError: For a key that is not a flag of ``parser``, a value of the wrong shape,
            or a value of another TOML type than its flag reads (:func:`_check_kind`).
    """
    actions = _actions(parser)
    tokens: list[str] = []
    for key, value in values.items():
        action = actions.get(key)
        if action is None or key in SKIPPED_KEYS:
            known = ", ".join(sorted(k for k in actions if k not in SKIPPED_KEYS))
            raise ConfigError(f"{source}: unknown key {key!r}; keys are flag names: {known}")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
            tokens.append(flag if value else "--no-" + flag[2:])
        elif action.nargs in ("*", "+"):
            items = value if isinstance(value, list) else [value]
            for item in items:
                _check_kind(action, key, item, source, listed=True)
            texts = [format_value(v) for v in items]
            for text in texts:  # the parser would read it as a flag (--overwrite), not an item
                if text.startswith("-") and not _is_number(text):
                    raise ConfigError(
                        f"{source}: {key} item {text!r} starts with '-', which the command "
                        f"line reads as a flag; give it on the command line as {flag}={text}"
                    )
            tokens += [flag, *texts]
        else:
            if isinstance(value, (list, dict)):
                raise ConfigError(f"{source}: {key} takes one value, got {value!r}")
            _check_kind(action, key, value, source)
            tokens.append(f"{flag}={format_value(value)}")
    return tokens


def _is_number(text: str) -> bool:
    """Whether ``text`` reads as a number (a negative one is a list item, not a flag)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


NUMBER_TYPES = ("int", "float", "number")
"""The names of the argparse ``type`` converters (bare or :func:`optional`) that read a number."""
TEXT_TYPES = ("str", "schedule_text", "dtype", "dtype_or_auto", "_model_name")
"""The names of those that read a word, a path, a pattern or a schedule: a TOML string."""


def _words(text: str) -> bool:
    """Whether a TOML string stands for a value TOML cannot write: ``none`` (an optional
    flag's ``None``) or a non-finite number (``"inf"``, as :func:`_plain` writes one)."""
    if text.strip().lower() in NONE_WORDS:
        return True
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _check_kind(
    action: argparse.Action, key: str, value: Any, source: str, *, listed: bool = False
) -> None:
    """A config file's value has the TOML type its flag reads, as the Python API takes the
    option: an integer where the flag reads one, a number (not a bool, not a numeric
    string) where it reads a number, a string where it reads a word, a path or a pattern
    (``skip_layers = 3`` is not the pattern ``"3"``), ``true``/``false`` where it reads a
    bool; ``"none"`` (and a non-finite number's spelling) is left to the flag, which takes
    or refuses it.

    Raises:
        ConfigError: Naming the key, what it takes and the value.
    """
    kind = "str" if action.type is None else getattr(action.type, "__name__", "")
    many = " or a list of them" if listed else ""
    if kind in NUMBER_TYPES:
        integer = kind == "int"
        kinds = (int,) if integer else (int, float)
        number = isinstance(value, kinds) and not isinstance(value, bool)
        if not (number or (isinstance(value, str) and _words(value))):
            what = "an integer" if integer else "a number"
            raise ConfigError(f"{source}: {key} must be {what}{many}, got {value!r}")
    elif kind == "integer":  # an integer or a word (integer_or)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{source}: {key} must be an integer or a string, got {value!r}")
    elif kind == "boolean":  # a bool or none (optional(boolean))
        none = isinstance(value, str) and value.strip().lower() in NONE_WORDS
        if not (isinstance(value, bool) or none):
            raise ConfigError(f'{source}: {key} must be true, false or "none", got {value!r}')
    elif kind in TEXT_TYPES and not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a string{many}, got {value!r}")


def format_value(value: Any) -> str:
    """The command-line spelling of a value (``none``, dtype names, ``repr`` of floats)."""
    if value is None:
        return "none"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# ----------------------------------------------------------------------- resolved config
def _plain(value: Any) -> Any:
    """A TOML/JSON-friendly version of an option value."""
    if value is None or isinstance(value, torch.dtype):
        return format_value(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, collections.abc.Mapping):  # {name: (C, P)} -> ["name=CxP", ...]
        return [f"{k}={'x'.join(str(n) for n in v)}" for k, v in value.items()]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def resolved_config(args: argparse.Namespace) -> dict[str, Any]:
    """Every option of a run, in plain values, keyed by flag destination; under
    ``--optimizer dkfac`` the K-FAC flags that were not given are left out: ``for_model``
    and its overhead budget choose them (``describe()`` in the log says what), and a flag
    given is kept over that choice, so the file runs the same."""
    values = {**vars(args), **{k: v for k, v in ONE_LAUNCH.items() if hasattr(args, k)}}
    if getattr(args, "optimizer", None) == "dkfac":
        for field in dataclasses.fields(KFACConfig):
            if field.name not in TRAINING_FIELDS and _left(args, field, values.get(field.name)):
                values.pop(field.name, None)
                values.pop(f"{field.name}_schedule", None)
    return {k: _plain(v) for k, v in sorted(values.items()) if k not in SKIPPED_KEYS}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def to_toml(values: dict[str, Any]) -> str:
    """Serialises a flat ``{key: plain value}`` mapping as TOML."""
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in values.items())


def write_resolved_config(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Writes ``config.toml`` (usable with ``--config``) and ``config.json`` into ``folder``."""
    values = resolved_config(args)
    folder.mkdir(parents=True, exist_ok=True)
    header = "# Resolved configuration of this run; `dkfac train --config` reads it back.\n"
    (folder / "config.toml").write_text(header + to_toml(values))
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    return values
