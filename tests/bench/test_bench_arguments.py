"""The benchmarks' output paths are checked before a run starts (``dkfac.bench.arguments``).

Oracle: the file system of a temporary folder, each path made by hand; and every
benchmark's own parser, which must answer a bad path with one line and exit 2 before it
runs (a path it cannot write used to be a traceback after the run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dkfac.bench import SUBCOMMANDS, main
from dkfac.bench.arguments import MAX_LOCAL_RANKS, BenchParser, path_problem


def test_path_problems(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert path_problem("folder", tmp_path) is None
    assert path_problem("folder", tmp_path / "new" / "deeper") is None  # made when missing
    assert path_problem("folder", afile) == "is a file, not a folder"
    assert path_problem("folder", afile / "sub") == f"is inside a file ({str(afile)!r})"
    assert path_problem("file", tmp_path / "out.json") is None
    assert path_problem("file", tmp_path) == "is a folder, not a file"
    assert path_problem("file", afile / "o.json") == f"is inside a file ({str(afile)!r})"
    missing = tmp_path / "missing"
    assert path_problem("file", missing / "o.json") == (
        f"is in a folder that does not exist ({str(missing)!r})"
    )
    assert path_problem("input folder", tmp_path) is None
    assert path_problem("input folder", missing) == "is not a folder that exists"
    assert path_problem("file", "") == "is empty"
    longest = "n" * 250 + ".json"  # 255 bytes: the longest name a file system takes
    assert path_problem("file", tmp_path / longest) is None
    assert path_problem("file", tmp_path / longest, ".tmp") == (
        f"has a name of 259 bytes with its .tmp ending ({'n' * 20 + '...'!r}); a file or "
        "folder name takes at most 255"
    )
    assert path_problem("folder", tmp_path / ("é" * 128) / "x") == (  # bytes, not characters
        f"has a name of 256 bytes ({'é' * 20 + '...'!r}); a file or folder name takes at most 255"
    )


def _parser() -> BenchParser:
    parser = BenchParser(prog="dkfac bench x")
    for flag in ("--name", "--out-dir", "--plot", "--out", "--plot-dir", "--page", "--results"):
        parser.add_argument(flag, default=None)
    return parser


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--name", "../x"], "--name must be a file name without a folder (--out-dir), got '../x'"),
        (["--name", "a" * 250], "--name is 250 bytes; a file name takes at most 255"),
        (["--name", ""], "--name must be a file name"),
        (["--out-dir", "{file}"], "--out-dir '{file}' is a file, not a folder"),
        (["--plot", "{file}/p.png"], "--plot '{file}/p.png' is inside a file ('{file}')"),
        (["--out", "{dir}"], "--out '{dir}' is a folder, not a file"),
        (["--page", "{dir}/no/p.md"], "--page '{dir}/no/p.md' is in a folder that does not exist"),
        (["--plot-dir", "{file}/d"], "--plot-dir '{file}/d' is inside a file"),
        (["--results", "{dir}/no"], "--results '{dir}/no' is not a folder that exists"),
        # A name longer than the file system takes: an OSError traceback (ENAMETOOLONG).
        (["--out-dir", "{dir}/" + "d" * 300 + "/x"], "has a name of 300 bytes ('dddd"),
        (["--plot-dir", "{dir}/" + "d" * 256], "has a name of 256 bytes"),
        (["--plot", "{dir}/" + "p" * 252 + ".png"], "has a name of 256 bytes ('pppp"),
        (["--page", "{dir}/" + "p" * 300 + "/p.md"], "has a name of 300 bytes"),
        (["--results", "{dir}/" + "r" * 256], "has a name of 256 bytes"),
        # --out's JSON is written to <name>.json.tmp first: 251 + 4 bytes are one too many
        (["--out", "{dir}/" + "o" * 247 + ".json"], "has a name of 256 bytes with its .tmp ending"),
    ],
)
def test_a_bad_path_is_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    fill = {"file": str(afile), "dir": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([arg.format(**fill) for arg in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dkfac bench x: error: ") and message.format(**fill) in err[-1]


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("memory", ["--world-sizes", "2", "1000000000"]),
        ("comm", ["--world-sizes", "65"]),
        ("fsdp-memory", ["--worlds", "100", "--out", "x.json"]),
        ("fsdp-step", ["--worlds", "2", "999", "--out", "x.json"]),
        ("soak", ["--world-size", "4096"]),
    ],
)
def test_the_ranks_a_benchmark_starts_are_bounded(
    command: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench memory --world-sizes 1000000000`` spawned processes until it was killed."""
    assert _exit_code([command, *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"must be at most {MAX_LOCAL_RANKS} (ranks are processes" in last, last


def test_good_paths_and_an_empty_plot_pass(tmp_path: Path) -> None:
    argv = ["--name", "run_1", "--out-dir", str(tmp_path / "new"), "--plot", ""]
    argv += ["--out", str(tmp_path / "o.json"), "--results", str(tmp_path)]
    args = _parser().parse_args(argv)
    assert args.name == "run_1" and args.plot == ""
    assert not (tmp_path / "new").exists()  # made by the run, not by the check


@pytest.mark.parametrize("command", sorted(set(SUBCOMMANDS) - {"report"}))
def test_every_benchmark_refuses_an_output_inside_a_file(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each benchmark's parser checks its output flag before it runs anything (the run
    would take minutes; a required positional or flag it lacks would fail first, so each
    gets its output flag only)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    helptext = _help(command, capsys)
    flag = next(f for f in ("--out-dir", "--out", "--plot") if f"{f} " in helptext)
    argv = [command, flag, str(afile / ("x" if flag == "--out-dir" else "x.json"))]
    argv += _required(command, tmp_path)
    assert _exit_code(argv) == 2
    assert "is inside a file" in capsys.readouterr().err


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def _required(command: str, tmp_path: Path) -> list[str]:
    """The arguments a benchmark needs besides its output (none run: the check fails first)."""
    if command == "paired":
        return ["--first", "a", "--second", "b", str(tmp_path / "r.json")]
    if command == "phases":
        return ["adamw"]
    if command == "accumulation":
        return ["--label", "a"]
    return []


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A width of 10⁸ ran until it was killed; -1 and a repeated option were taken.
        (["solvers", "--widths", "100000000"], "expected comma-separated ints in [1, 65536]"),
        (["solvers", "--widths", "abc"], "expected comma-separated ints in [1, 65536], got 'abc'"),
        (["solvers", "--large-dim", "-1"], "--large-dim must be >= 1, got -1"),
        (["dispatches", "--options", "damping=1,damping=2"], "option 'damping' is given twice"),
        (["step", "--autocast", "fp16", "--device", "cpu"], "--autocast fp16 needs a CUDA device"),
    ],
)
def test_values_a_benchmark_cannot_run_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
