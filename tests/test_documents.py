"""The documents agree with the code: every module, file, link, option, layer type and command
that README.md and docs/*.md name exists, and the README, ``for_model``'s docstring and
docs/transformers.md give one recommendation.

Each test reads the pages as text and checks what they name against the package itself, so
a renamed module, a moved file, a dropped option or a changed default fails here, in the
test that names the page and the phrase. docs/tried.md is left out of the file check: its
paths are files at the commits it cites (``git show <commit>:<path>``), not today's tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.blocks import registry
from dkfac.blocks.base import Block
from dkfac.engine.overhead import BUDGETED_OPTIONS
from dkfac.optimizer import DEFAULT_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = ROOT / "docs" / "tried.md"
PACKAGE_DIRS = ("app", "bench", "blocks", "config", "costmodel", "distributed", "engine", "solvers")
NOT_CONFIG = ("overhead", "grad_scaler", "process_group")
"""Keyword arguments of ``KFACPreconditioner`` that docs/options.md documents beside the
config's fields."""


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _named(pattern: str, pages: list[Path] = PAGES) -> Iterator[tuple[str, str]]:
    """``(page name, match)`` for every match of ``pattern`` on ``pages``."""
    for page in pages:
        for found in re.finditer(pattern, _text(page)):
            yield page.name, found.group(1)


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``dkfac.x.y``) is a module, or an attribute chain of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def test_named_modules_exist() -> None:
    missing = [
        (page, name)
        for page, name in _named(r"\b(dkfac(?:\.[A-Za-z_]\w*)+)")
        if not _resolves(name)
    ]
    assert not missing, f"dkfac names the pages give that do not exist: {missing}"


def test_named_files_exist() -> None:
    pages = [p for p in PAGES if p != HISTORY]
    repo = r"\b((?:src|tests|benchmarks|configs|docs)/[\w./-]*\w)"
    package = rf"(?<![\w/])((?:dkfac/)?(?:{'|'.join(PACKAGE_DIRS)})/[\w/]+\.py)"
    missing = [(page, path) for page, path in _named(repo, pages) if not (ROOT / path).exists()]
    missing += [
        (page, path)
        for page, path in _named(package, pages)
        if not (ROOT / "src" / path).exists() and not (ROOT / "src" / "dkfac" / path).exists()
    ]
    assert not missing, f"files the pages name that do not exist: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", _text(page), flags=re.M)}


def test_links_and_anchors_resolve() -> None:
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", _text(page)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append((page.name, target))
            elif anchor and path.suffix == ".md" and anchor[1:] not in _anchors(path):
                broken.append((page.name, f"{target}{anchor}"))
    assert not broken, f"links to files or headings that do not exist: {broken}"


OPTIONS = ROOT / "docs" / "options.md"


def test_options_page_names_every_field_and_only_fields() -> None:
    text = _text(OPTIONS)
    fields = {f.name for f in dataclasses.fields(KFACConfig)}
    unnamed = sorted(f for f in fields if not re.search(rf"`{f}\b", text))
    assert not unnamed, f"KFACConfig fields docs/options.md does not mention: {unnamed}"
    entries = set(re.findall(r"\*\*`(\w+)", text))
    unknown = sorted(entries - fields - set(NOT_CONFIG))
    assert not unknown, f"options docs/options.md describes that are no KFACConfig field: {unknown}"
    accepted = set(inspect.signature(KFACPreconditioner).parameters)
    assert set(NOT_CONFIG) <= accepted


def _spelled(value: Any) -> str:
    """A default as the page writes it: strings quoted, the rest as Python prints them."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_options_page_gives_for_models_defaults() -> None:
    bullet = re.search(
        r"^- `KFACOptimizer\.for_model\(model\)`(.*?)^- ", _text(OPTIONS), re.S | re.M
    )
    assert bullet is not None, "docs/options.md has no bullet on for_model's defaults"
    text = bullet.group(1)
    fixed = {k: v for k, v in DEFAULT_OPTIONS.items() if k not in BUDGETED_OPTIONS}
    missing = [f"{k}={_spelled(v)}" for k, v in fixed.items() if f"{k}={_spelled(v)}" not in text]
    assert not missing, f"docs/options.md does not give for_model's defaults {missing}"


TRANSFORMERS = ROOT / "docs" / "transformers.md"


def _builtin_blocks() -> set[str]:
    """The classes of the built-in blocks: the registry's, the grouped convolutions' and the
    attention factory's (checked by building one attention)."""
    from torch import nn

    classes = {f for f in [*registry._REGISTRY.values(), *registry._BY_NAME.values()]}
    for conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        classes.add(registry.grouped_variant(registry._REGISTRY[conv], conv(2, 2, 1, groups=2)))
    made = registry.make_block("attn", nn.MultiheadAttention(4, 2))
    assert isinstance(made, list)
    classes.update(type(block) for block in made)
    return {c.__name__ for c in classes if isinstance(c, type) and issubclass(c, Block)}


def test_layer_table_matches_the_registry() -> None:
    table = re.search(r"^## What gets K-FAC\n(.*?)^\*\*", _text(TRANSFORMERS), flags=re.S | re.M)
    assert table is not None
    named = set(re.findall(r"`(\w+Block)`", table.group(1)))
    assert named == _builtin_blocks()


def _fenced(text: str) -> Iterator[tuple[str, str]]:
    """``(language, code)`` of every fenced block of a Markdown page."""
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                yield language, "\n".join(lines)
                language = None
        elif language is not None:
            lines.append(line)


COMMAND = re.compile(r"^(?:python -m |torchrun .*?-m )?(dkfac (?:train|compare|plan|bench)\b.*)")
PLACEHOLDER = re.compile(r"^[A-Z_]+(/|$)|[<>]|\.\.\.")
"""A word that stands for something the reader fills in (``DIR/config.toml``, ``FILE``)."""


def _commands() -> Iterator[tuple[str, str, bool]]:
    """``(page name, command, typed)``: every ``dkfac`` command the pages name, continuation
    lines joined and comments cut; ``typed``: one a reader is told to run (a shell block's
    line, or inline code with its flags), not only a command's name in prose."""
    for page in PAGES:
        text = _text(page)
        shell = [code for lang, code in _fenced(text) if lang in ("", "bash", "sh")]
        lines = [(line, True) for code in shell for line in code.replace("\\\n", " ").splitlines()]
        inline = re.findall(r"`([^`\n]+)`", text)  # typed with a flag, not `... --config`
        lines += [
            (code, " --" in code and not code.split()[-1].startswith("--")) for code in inline
        ]
        for line, typed in lines:
            found = COMMAND.match(line.split(" #")[0].strip())
            if found and not found.group(1).startswith(("dkfac train:", "dkfac compare:")):
                yield page.name, found.group(1), typed


def test_commands_exist() -> None:
    """Every ``dkfac bench`` benchmark a page names is one."""
    from dkfac.bench import SUBCOMMANDS

    unknown = []
    for page, command, _ in _commands():
        words = command.split()
        bench = len(words) > 2 and words[1] == "bench" and not words[2].startswith("-")
        if bench and words[2] not in SUBCOMMANDS:
            unknown.append((page, command))
    assert not unknown, f"benchmarks the pages name that dkfac bench does not have: {unknown}"


TYPED = sorted(
    {
        (page, command)
        for page, command, typed in _commands()
        if typed
        and "--help" not in command.split()
        and not any(PLACEHOLDER.search(word) for word in shlex.split(command))
    }
)


class _ParsedError(Exception):
    """Raised once a command's arguments parsed: nothing of it runs."""


@pytest.mark.parametrize(("page", "command"), TYPED)
def test_command_parses(
    page: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's words parse (flags, choices, types); nothing runs."""
    from dkfac.app import cli

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        original(self, *args, **kwargs)
        raise _ParsedError

    for page_path in PAGES:  # the pages' own example modules (``# mymodels.py``)
        for language, code in _fenced(_text(page_path)):
            named = re.match(r"# (\w+\.py)\n", code + "\n")
            if language == "python" and named:
                (tmp_path / named.group(1)).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = shlex.split(command)[1:]
    with pytest.raises(_ParsedError):
        cli.main(argv)


def _lr_range(text: str, where: str) -> tuple[float, float]:
    found = re.search(r"over about (\d[\d.e-]*\d) to (\d[\d.e-]*\d)", " ".join(text.split()))
    assert found is not None, f"{where} says no learning-rate range to sweep"
    return float(found.group(1)), float(found.group(2))


def test_one_recommendation() -> None:
    """README, ``for_model``'s docstring and the transformer page recommend ``for_model`` with
    only the lr swept, over one range that holds the suite's grid and the default lr; the
    README's signature is the method's."""
    from dkfac.bench.suite import GRIDS

    readme, transformers = _text(ROOT / "README.md"), _text(TRANSFORMERS)
    docstring = inspect.getdoc(KFACOptimizer.for_model) or ""
    ranges = {
        _lr_range(readme, "README.md"),
        _lr_range(docstring, "for_model's docstring"),
        _lr_range(transformers, "docs/transformers.md"),
    }
    assert len(ranges) == 1, ranges
    ((low, high),) = ranges
    grid = GRIDS["dkfac"]
    signature = inspect.signature(KFACOptimizer.for_model).parameters
    assert low <= min(grid) and max(grid) <= high
    assert low <= signature["lr"].default <= high
    start = re.search(r"^## The recommended start\n(.*?)^## ", transformers, flags=re.S | re.M)
    assert start is not None and "KFACOptimizer.for_model(model)" in start.group(1)
    stated = re.search(r"`KFACOptimizer\.for_model\(model, ([^`]*), \*\*options\)`", readme)
    assert stated is not None
    for item in stated.group(1).split(", "):
        name, _, value = item.partition("=")
        assert signature[name].default == float(value), item


def test_make_targets_exist() -> None:
    """Every ``make X`` the pages give (in code) is a target of the Makefile."""
    targets = set(re.findall(r"^([a-z][\w-]*):", _text(ROOT / "Makefile"), flags=re.M))
    missing = [
        (page, target)
        for page, target in _named(r"(?m)(?:`|^)make ([a-z][\w-]*)")
        if target not in targets
    ]
    assert not missing, f"make targets the pages name that the Makefile lacks: {missing}"


def test_describe_rows_are_documented() -> None:
    """Every kind of row ``describe()`` gives besides a layer's (a left-out parameter's, the
    overhead budget's) is named, as ``block="..."``, by its docstring and by the coverage
    section of docs/transformers.md."""
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    rows = KFACOptimizer.for_model(model).preconditioner.describe()
    kinds = {row["block"] for row in rows if row["a_dim"] is None}
    section = re.search(r"^## Checking the coverage\n(.*?)^## ", _text(TRANSFORMERS), re.S | re.M)
    assert section is not None
    docstring = inspect.getdoc(KFACPreconditioner.describe) or ""
    assert kinds == {"inner optimizer", "cost"}, kinds
    for kind in kinds:
        assert f'`block="{kind}"`' in section.group(1), kind
        assert f'``block="{kind}"``' in docstring, kind
