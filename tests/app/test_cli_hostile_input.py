"""Hostile input to ``dkfac train``: each case ended in a traceback (or did the wrong thing
silently) before its check; now one line on stderr, exit 2, and nothing written.

Every call runs in this process (:func:`~tests.reliability.cli_runs.run_cli`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from torch import nn

from dkfac.app import trainer
from tests.reliability.cli_runs import SHORT, last_line, run_cli


def needs_sizes(in_features: int, out_features: int) -> nn.Module:
    """A factory whose arguments are none of the keywords the program offers."""
    return nn.Linear(in_features, out_features)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # torch's optimizers multiply float32 weights by these: past 3.4e38 they raised
        # "value cannot be converted to type float without overflow" (or the KL-clip's
        # lr ** 2 an OverflowError) after the run had started.
        (["--lr", "1e300"], "--lr must be in (0, 1e+38], got 1e+300"),
        (["--optimizer", "kfac", "--lr", "1e300"], "--lr must be in (0, 1e+38], got 1e+300"),
        (["--weight-decay", "1e300"], "--weight-decay must be in [0, 1e+38], got 1e+300"),
        (["--muon-adamw-lr", "1e300"], "--muon-adamw-lr must be in (0, 1e+38], got 1e+300"),
        (["--lrs", "sgd=1e300"], "and an LR in (0, 1e+38], got 'sgd=1e300'"),
        (["--lrs", "sgd=nan"], "and an LR in (0, 1e+38], got 'sgd=nan'"),
        # A factory that needs arguments the program does not give: TypeError from its call.
        (
            ["--model", f"{__name__}:needs_sizes"],
            f"model factory {__name__}:needs_sizes needs in_features, out_features, which "
            "the training program does not give",
        ),
        # Without --out every run gets a new folder: --resume auto resumed nothing, silently.
        (["--resume", "auto"], "--resume auto continues the run in --out: give --out RUN"),
    ],
)
def test_hostile_value_is_one_line_and_exit_2(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = [] if "--resume" in extra else ["--out", str(tmp_path / "run")]
    code, err = run_cli(["train", *SHORT, *extra, *out], capsys)
    assert code == 2, err
    assert message in last_line(err), err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # the factory's case: refused after the folder
    # was prepared, which it removed again (it was left empty)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", *SHORT, "--out", "{long}"],
        ["train", *SHORT, "--out", "{tmp}/{long}/run"],
        ["compare", *SHORT, "--optimizers", "sgd", "--out", "{long}"],
        ["train", *SHORT, "--out", "{tmp}/run", "--resume", "{long}"],
        ["train", "--data", "cifar10", "--data-dir", "{long}", "--out", "{tmp}/run"],
        [
            "train",
            "--model",
            "gpt",
            "--data",
            "text",
            "--text-path",
            "{long}",
            "--out",
            "{tmp}/run",
        ],
        ["train", *SHORT, "--out", "{tmp}/run", "--config", "{long}"],
    ],
)
def test_a_name_longer_than_a_file_system_takes_is_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An OSError (ENAMETOOLONG) traceback: compare's at once, --resume's, --data-dir's and
    # --text-path's after the run folder was made; train's --out was refused only there.
    long = "x" * 300
    code, err = run_cli([a.format(tmp=tmp_path, long=long) for a in argv], capsys)
    assert code == 2, err
    flag = argv[argv.index(next(a for a in argv if "{long}" in a)) - 1]
    assert last_line(err).startswith(f"dkfac {argv[0]}: error: {flag} "), err
    assert last_line(err).endswith(
        "has a name of 300 bytes ('xxxxxxxxxxxxxxxxxxxx...'); a file or folder name takes at "
        "most 255"
    ), err
    assert list(tmp_path.iterdir()) == []


def test_empty_text_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # torch.frombuffer raised "both buffer length (0) and count (-1) must not be 0".
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    gpt = ["--model", "gpt", "--data", "text", "--width", "8", "--heads", "2", "--layers", "1"]
    argv = ["train", *SHORT, *gpt, "--seq-len", "8", "--text-path", str(empty)]
    code, err = run_cli([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err
    want = f"dkfac train: error: --text-path {empty}: the text is empty (0 bytes read)"
    assert last_line(err) == want
    assert not (tmp_path / "run").exists()


def test_a_refused_run_keeps_a_folder_that_was_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    argv = ["train", *SHORT, "--image-size", "1", "--out", str(tmp_path / "run")]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "SmallCNN needs image_size >= 2" in last_line(err)
    assert (tmp_path / "run").is_dir()  # the user's folder, empty or not, is theirs
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    argv = ["train", *SHORT, "--resume", str(corrupt), "--out", str(tmp_path / "new")]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "is truncated or corrupt" in last_line(err)
    assert not (tmp_path / "new").exists()  # created for this run, then refused: removed


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("", "--config is empty: give the path of a TOML file"),  # was "config file . is..."
        ("{tmp}", "config file {tmp} is a folder, not a TOML file"),  # was "[Errno 21] ..."
    ],
)
def test_config_path_that_is_no_file_names_what_it_is(
    config: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["train", "--config", config.format(tmp=tmp_path)], capsys)
    assert code == 2
    assert last_line(err) == "dkfac train: error: " + message.format(tmp=tmp_path)


def test_runs_started_in_the_same_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second run without --out in the same second was refused: "--out runs/<stamp>
    # holds an earlier run ... pass --resume auto", about a folder the user never named.
    monkeypatch.chdir(tmp_path)
    assert trainer._fresh_run_name("runs/stamp") == "runs/stamp"
    (tmp_path / "runs" / "stamp").mkdir(parents=True)
    assert trainer._fresh_run_name("runs/stamp") == "runs/stamp-2"
    (tmp_path / "runs" / "stamp-2").mkdir()
    assert trainer._fresh_run_name("runs/stamp") == "runs/stamp-3"

    class Frozen:
        @staticmethod
        def now() -> datetime:
            return datetime(1999, 1, 1)

    monkeypatch.setattr(trainer, "datetime", Frozen)
    argv = ["train", *SHORT, "--steps", "1"]
    assert run_cli(argv, capsys)[0] == 0
    assert run_cli(argv, capsys)[0] == 0
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert folders == ["19990101-000000", "19990101-000000-2", "stamp", "stamp-2"]
    assert all((tmp_path / "runs" / f / "metrics.jsonl").exists() for f in folders[:2])


def test_a_file_that_is_no_cifar_archive_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tarfile's message spans five lines ("- method gz: ReadError('empty file')" ...).
    empty = tmp_path / "cifar-10-python.tar.gz"
    empty.write_bytes(b"")
    argv = ["train", "--data", "cifar10", "--data-dir", str(empty), "--threads", "1"]
    code, err = run_cli([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("dkfac train: error: "), err
    assert "truncated or not a gzip tar archive" in err and "- method tar: " in err
    assert not (tmp_path / "run").exists()
