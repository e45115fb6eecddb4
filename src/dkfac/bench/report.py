"""``dkfac bench report``: BENCHMARKS.md and its plots, rebuilt from ``benchmarks/results/``.

The results page is generated, never edited by hand: each :class:`Section` of
:data:`dkfac.bench.results_page.SECTIONS` names the JSON files it reads (paths under
``benchmarks/results/``), a function that turns them into its table, an optional plot, and
prose whose figures are ``{placeholders}`` filled from the same JSON. The page states the
date and machine of every file (from its ``machine`` record) and the command that wrote it
(its ``command`` record, or the section's own ``commands``).

    dkfac bench report                 # writes BENCHMARKS.md and the plots in benchmarks/
    dkfac bench report --check         # exit 1 if BENCHMARKS.md is not what the JSON gives
    dkfac bench report --no-plots      # the page only

``tests/bench/test_results_page.py`` checks that the committed page is the one this command
builds, that every literal figure in a section's prose is a value of its JSON files, and that
every plot the page shows exists.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Section",
    "Table",
    "build_page",
    "json_numbers",
    "load_sources",
    "main",
    "prose_numbers",
]

Payloads = Mapping[str, Any]
"""A section's JSON files, by their path under the results folder."""


@dataclass(frozen=True)
class Table:
    """A markdown table: its header cells and its rows, already formatted."""

    headers: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        """The table as GitHub markdown."""
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Section:
    """One benchmark of the results page.

    Attributes:
        title: The section heading.
        sources: JSON files under the results folder that the section reads.
        text: Markdown before the table; ``{name}`` is replaced by ``values(payloads)[name]``.
            A literal number here must be a value of the sources (the test checks it).
        tables: Functions of the payloads, each giving one table.
        notes: Markdown after the tables, with the same placeholders and rule as ``text``.
        values: Function of the payloads giving the placeholders' formatted figures.
        plot: ``(file name under the plots folder, function(payloads, path))``, or ``None``.
        commands: Commands shown to reproduce it, in addition to each source's own.
    """

    title: str
    sources: tuple[str, ...]
    text: str
    tables: tuple[Callable[[Payloads], Table], ...] = ()
    notes: str = ""
    values: Callable[[Payloads], dict[str, str]] | None = None
    plot: tuple[str, Callable[[Payloads, str], None]] | None = None
    commands: tuple[str, ...] = field(default_factory=tuple)


def load_sources(section: Section, results: Path) -> dict[str, Any]:
    """The section's JSON files, parsed, by their path under ``results``."""
    return {name: json.loads((results / name).read_text()) for name in section.sources}


def _machine(record: Mapping[str, Any]) -> str:
    """A machine record in words: the GPU or the CPU, torch, Python."""
    where = record.get("gpu") or (
        f"{record.get('cpu_count', '?')}-core {record.get('processor', 'CPU')} CPU"
        + (f" ({record['cpu_capability']})" if record.get("cpu_capability") else "")
    )
    return f"{where}, torch {record.get('torch', '?')}, Python {record.get('python', '?')}"


def provenance(payloads: Payloads, extra: Sequence[str]) -> str:
    """The dates, machines and commands of a section's sources, as markdown."""
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    for payload in payloads.values():
        record = payload.get("machine")
        if not record:
            continue
        key = (str(record.get("date", "?"))[:10], _machine(record))
        if key not in seen:
            seen.add(key)
            lines.append(f"- {key[0]}: {key[1]}")
    files = ", ".join(f"`benchmarks/results/{name}`" for name in payloads)
    commands = [*extra, *(str(p["command"]) for p in payloads.values() if p.get("command"))]
    out = "Measured on:\n\n" + "\n".join(lines) + "\n\n" if lines else ""
    out += f"Results: {files}. Reproduce with:\n\n```\n" + "\n".join(commands) + "\n```"
    return out


def render_section(section: Section, payloads: Payloads, plots: str) -> str:
    """One section of the page."""
    values = section.values(payloads) if section.values else {}
    parts = [f"## {section.title}", section.text.format(**values).strip()]
    parts += [table(payloads).markdown() for table in section.tables]
    if section.notes:
        parts.append(section.notes.format(**values).strip())
    if section.plot:
        parts.append(f"![{section.title}]({plots}/{section.plot[0]})")
    parts.append(provenance(payloads, section.commands))
    return "\n\n".join(parts)


def build_page(
    head: str, sections: Sequence[Section], results: Path, plots: str = "benchmarks"
) -> str:
    """The whole results page: ``head``, a list of the sections, then each section."""
    contents = "\n".join(
        f"- [{s.title}](#{re.sub(r'[^a-z0-9 -]', '', s.title.lower()).replace(' ', '-')})"
        for s in sections
    )
    body = [render_section(s, load_sources(s, results), plots) for s in sections]
    return "\n\n".join([head.strip(), contents, *body]) + "\n"


def _walk(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)
    else:
        yield value


NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def json_numbers(payloads: Payloads) -> set[float]:
    """Every number in the payloads: numeric leaves and the numbers written in strings."""
    found: set[float] = set()
    for leaf in _walk(dict(payloads)):
        if isinstance(leaf, bool):
            continue
        if isinstance(leaf, int | float):
            found.add(float(leaf))
        elif isinstance(leaf, str):
            found.update(float(m) for m in NUMBER.findall(leaf))
    return found


NAMES = re.compile(
    r"`[^`]*`|\{[a-z_0-9]+\}|ResNet-\d+|H\d{3}|AVX\d*(?:-\d+)?|bf16|fp\d+|float\d+|"
    r"bfloat16|[A-Z]+\d+\w*|\d+-core|\w+\d+x\d+"
)
"""What a figure check skips: code, placeholders, and names that carry digits."""


def prose_numbers(text: str) -> list[str]:
    """The literal numbers of a section's prose (not in code, placeholders or names)."""
    return NUMBER.findall(NAMES.sub(" ", text))


def matches(token: str, numbers: set[float]) -> bool:
    """Whether ``token`` is one of ``numbers`` written to its own number of decimals."""
    decimals = len(token.partition(".")[2])
    value = float(token)
    return any(round(n, decimals) == value or round(n * 100, decimals) == value for n in numbers)


def main(argv: Sequence[str] | None = None) -> int:
    """Writes (or with ``--check`` compares) BENCHMARKS.md and the plots."""
    from dkfac.bench import results_page

    parser = argparse.ArgumentParser(prog="dkfac bench report", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="the JSON folder")
    parser.add_argument("--page", default="BENCHMARKS.md", help="the page to write")
    parser.add_argument(
        "--plots",
        default="benchmarks",
        help="where to write the plots (the page links benchmarks/)",
    )
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--no-plots", action="store_true", help="write the page only")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        parser.error(f"--results {args.results!r} is not a folder")
    try:
        page = build_page(results_page.HEAD, results_page.SECTIONS, results)
    except (OSError, KeyError, ValueError) as err:
        print(f"dkfac bench report: cannot build the page: {err!r}", file=sys.stderr)
        return 2
    target = Path(args.page)
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != page:
            print(f"{target} is not what `dkfac bench report` builds: rerun it", file=sys.stderr)
            return 1
        return 0
    target.write_text(page)
    if not args.no_plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        for section in results_page.SECTIONS:
            if section.plot:
                name, draw = section.plot
                draw(load_sources(section, results), str(Path(args.plots) / name))
    print(f"wrote {target}" + ("" if args.no_plots else f" and the plots in {args.plots}/"))
    return 0
