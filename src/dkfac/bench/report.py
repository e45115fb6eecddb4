"""``dkfac bench report``: BENCHMARKS.md and its plots, rebuilt from ``benchmarks/results/``.

    dkfac bench report                 # writes BENCHMARKS.md and the plots in benchmarks/
    dkfac bench report --check         # exit 1 if BENCHMARKS.md is not what the JSON gives
    dkfac bench report --no-plots      # the page only

The sections are :data:`dkfac.bench.results_page.SECTIONS` (how to add one: that module's
docstring); the machinery is :mod:`dkfac.bench.page`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from dkfac.bench import results_page
from dkfac.bench.arguments import BenchParser
from dkfac.bench.page import build_page, load_sources

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Writes (or with ``--check`` compares) BENCHMARKS.md and the plots."""
    parser = BenchParser(prog="dkfac bench report", description=__doc__.split("\n")[0])
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
        page = build_page(
            results_page.HEAD, results_page.SECTIONS, results, aliases=results_page.ALIASES
        )
    except OSError as err:  # a result the page names is missing: say which
        where = f" {err.filename}" if err.filename else ""
        parser.error(f"cannot build the page from {args.results!r}:{where} {err.strerror}")
    except (KeyError, ValueError) as err:
        parser.error(f"cannot build the page from {args.results!r}: {err!r}")
    target = Path(args.page)
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != page:
            print(f"{target} is not what `dkfac bench report` builds: rerun it", file=sys.stderr)
            return 1
        return 0
    if not args.no_plots:  # the folder first: a bad --plots must not cost the page
        try:
            Path(args.plots).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            parser.error(f"--plots {args.plots!r}: cannot be a folder ({err.strerror})")
    try:
        target.write_text(page)
    except OSError as err:
        parser.error(f"--page {args.page!r}: cannot be written ({err.strerror})")
    if not args.no_plots:
        for section in results_page.SECTIONS:
            if section.plot:
                name, draw = section.plot
                draw(load_sources(section, results), str(Path(args.plots) / name))
    print(f"wrote {target}" + ("" if args.no_plots else f" and the plots in {args.plots}/"))
    return 0
