"""BENCHMARKS.md is what ``dkfac bench report`` builds, and its figures are in the JSON files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dkfac.bench import page, report, results_page
from dkfac.bench.page import Section, Table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"


def test_the_page_is_the_one_built_from_the_json() -> None:
    built = page.build_page(
        results_page.HEAD, results_page.SECTIONS, RESULTS, aliases=results_page.ALIASES
    )
    assert PAGE.read_text() == built, "BENCHMARKS.md is stale: run `dkfac bench report`"


@pytest.mark.parametrize("section", results_page.SECTIONS, ids=lambda s: s.title)
def test_every_figure_of_a_section_is_in_its_json(section: Section) -> None:
    payloads = page.load_sources(section, RESULTS)
    numbers = page.json_numbers(payloads)
    values = section.values(payloads) if section.values else {}
    prose = (section.text + section.notes).format(**values)
    tables = [table(payloads) for table in section.tables]
    # The literal figures of the prose, and the placeholders' values, must be JSON values.
    literal = page.prose_numbers(section.text + section.notes)
    missing = [t for t in literal if not page.matches(t, numbers)]
    assert not missing, f"figures of {section.title!r} that no source holds: {missing}"
    assert prose and all(t.rows for t in tables)


@pytest.mark.parametrize("section", results_page.SECTIONS, ids=lambda s: s.title)
def test_every_plot_and_source_of_the_page_exists(section: Section) -> None:
    for name in section.sources:
        assert (RESULTS / name).is_file(), name
    if section.plot:
        assert (ROOT / "benchmarks" / section.plot[0]).is_file(), section.plot[0]


def test_the_benchmarks_folder_holds_only_the_plots_the_page_shows() -> None:
    shown = set(re.findall(r"\(benchmarks/([\w.-]+\.png)\)", PAGE.read_text()))
    assert {p.name for p in (ROOT / "benchmarks").glob("*.png")} == shown


def test_a_figure_that_no_json_holds_is_caught(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"summary": {"ratio": 1.234, "steps": 7}}))
    payloads = {"run.json": json.loads((tmp_path / "run.json").read_text())}
    numbers = page.json_numbers(payloads)
    # 1.23 and 7 are values (to their decimals); 1.24 and 8 are not; names are skipped.
    assert [page.matches(t, numbers) for t in ("1.23", "7", "1.24", "8")] == [
        True,
        True,
        False,
        False,
    ]
    assert page.prose_numbers("ResNet-20 on an H200 took `3 s`, {x} and 2.5 steps") == ["2.5"]


def test_a_section_renders_its_table_placeholders_and_provenance(tmp_path: Path) -> None:
    payload = {
        "command": "dkfac bench step --model mlp",
        "machine": {"date": "2026-01-02T03:04:05", "gpu": "Some GPU", "torch": "2", "python": "3"},
        "summary": {"x": 0.5},
    }
    (tmp_path / "a.json").write_text(json.dumps(payload))
    section = Section(
        title="A test",
        sources=("a.json",),
        text="Half is {half}.",
        tables=(lambda p: Table(["x"], [[str(p["a.json"]["summary"]["x"])]]),),
        values=lambda p: {"half": str(p["a.json"]["summary"]["x"])},
    )
    text = page.build_page("# Head", [section], tmp_path)
    assert "Half is 0.5." in text and "| 0.5 |" in text
    assert "- 2026-01-02: Some GPU, torch 2, Python 3" in text
    assert "dkfac bench step --model mlp" in text and "`benchmarks/results/a.json`" in text


def test_a_recorded_program_is_shown_by_its_current_command() -> None:
    aliases = {"python old.py": "dkfac bench new --flag"}
    assert page.current_command({"command": "python old.py --x 1"}, aliases) == (
        "dkfac bench new --flag --x 1"
    )
    probe = {"command": "dkfac bench tta --seeds 3", "probe_command": "python old.py tta"}
    assert page.current_command(probe, aliases) == "dkfac bench new --flag tta"
    assert page.current_command({"command": "python older.py"}, aliases) == "python older.py"


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "B.md"
    stale.write_text("old\n")
    args = ["--results", str(RESULTS), "--page", str(stale), "--check"]
    assert report.main(args) == 1
    assert report.main(["--results", str(RESULTS), "--page", str(stale), "--no-plots"]) == 0
    assert report.main(args) == 0


def test_the_default_is_compared_with_the_best_of_the_other_optimizers() -> None:
    """Time over the fastest peer's (the default left out of the peers) for a run to a
    target; the loss minus the best peer's for a run to a time budget."""
    from dkfac.bench.results_tables import default_tasks_table, versus_best_peer

    tta = {
        "adamw": {"lr": 0.01, "median_steps": 30, "median_seconds": 3.0},
        "muon": {"lr": 0.2, "median_steps": 12, "median_seconds": 2.0},
        "default": {"lr": 0.01, "median_steps": 8, "median_seconds": 1.0},
    }
    assert versus_best_peer("tta", tta) == {"adamw": 1.5, "muon": 1.0, "default": 0.5}
    lm = {
        key: {"lr": 1.0, "median_steps": 9, "seconds_per_step": 0.1, "median_final_loss": loss}
        for key, loss in (("adamw", 2.5), ("muon", 2.0), ("default", 2.25))
    }
    assert versus_best_peer("lm", lm) == {"adamw": 0.5, "muon": 0.0, "default": 0.25}
    table = default_tasks_table({"cnn": ("tta", "a.json"), "gpt": ("lm", "b.json")})(
        {"a.json": {"summary": tta}, "b.json": {"summary": lm}}
    )
    assert table.rows[2] == ["cnn", "**dkfac default**", "0.01", "–", "8", "1.00", "0.50×"]
    assert table.rows[5][-1] == "+0.250 nats"


def test_a_target_is_marked_met_only_where_it_is() -> None:
    from dkfac.bench.results_tables import against

    assert against(0.72, 1.0) == "**0.72**"
    assert against(1.0, 1.0) == "**1.00**"
    assert against(1.004, 1.0) == "1.004"  # two decimals would read as met
    assert against(1.304, 1.3) == "1.304"
    assert against(2.5, 1.0) == "2.50"
    assert against(float("inf"), 1.0) == "–"


def test_report_names_the_result_it_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty results folder: one line naming the folder and the first file the page reads
    (it was ``FileNotFoundError(2, 'No such file or directory')``, no path)."""
    with pytest.raises(SystemExit) as exit_:
        report.main(["--check", "--results", str(tmp_path), "--page", str(tmp_path / "p.md")])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"dkfac bench report: error: cannot build the page from '{tmp_path}': ")
    assert f"{tmp_path}/" in last and last.endswith(".json No such file or directory")


def test_a_plots_path_that_cannot_be_a_folder_leaves_the_page_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page, afile = tmp_path / "page.md", tmp_path / "afile"
    page.write_text("KEEP")
    afile.write_text("x")
    with pytest.raises(SystemExit) as info:  # it was FileExistsError, after the page was written
        report.main(["--results", str(RESULTS), "--page", str(page), "--plots", str(afile)])
    assert info.value.code == 2
    assert f"--plots {str(afile)!r}: cannot be a folder" in capsys.readouterr().err
    assert page.read_text() == "KEEP"
