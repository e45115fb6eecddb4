"""Red team, run folders and backups (issue 20, class 4), with real runs of ``dkfac train``.

Before: an explicit ``--resume RUN_DIR`` ignored a good ``checkpoint.prev.pt`` when
``checkpoint.pt`` was missing; after a fallback to the backup, the next save rotated the
damaged file over it; killed writes left their temporary files forever; a second run into
the same ``--out`` silently truncated the first one's metrics and rotated its checkpoint
away; a checkpoint edited with its digest recomputed ended in a ``ValueError`` traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app import faults
from dkfac.app.checkpoint import (
    LATEST,
    PREVIOUS,
    load_checkpoint,
    remove_temporaries,
    save_checkpoint,
    save_rotating,
)
from tests.cli_args import TINY
from tests.reliability.cli_runs import last_line, run_cli

REPO = Path(__file__).resolve().parents[2]
# 4 steps per epoch, 2 epochs, checkpoints every 2 steps.
BASE = ["train", *TINY, "--epochs", "2", "--checkpoint-every", "2", "--optimizer", "kfac"]


def _run(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    return run_cli([*BASE, "--out", str(out), *extra], capsys)


def _crashed_run(
    out: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """A run that raises after step ``at`` (checkpoints of the even steps before it exist)."""
    monkeypatch.setenv(faults.RAISE, str(at))
    with pytest.raises(faults.InjectedFaultError):
        _run(out, capsys)
    monkeypatch.delenv(faults.RAISE)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def _step(path: Path) -> int:
    return int(load_checkpoint(path)["position"]["step"])


def test_explicit_run_folder_falls_back_when_latest_is_missing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _run(tmp_path / "full", capsys)[0] == 0
    part = tmp_path / "part"
    _crashed_run(part, capsys, monkeypatch, at=5)  # checkpoints of steps 2 and 4
    # Killed between the rename of the old latest and the write of the new one:
    os.replace(part / LATEST, part / PREVIOUS)
    assert not (part / LATEST).exists() and _step(part / PREVIOUS) == 4
    code, err = _run(part, capsys, "--resume", str(part))
    assert code == 0, err
    assert f"resuming from the previous checkpoint {part / PREVIOUS}" in caplog.text
    want, got = _weights(tmp_path / "full" / LATEST), _weights(part / LATEST)
    for name, value in want.items():  # continued to the same weights as an uninterrupted run
        assert torch.equal(got[name], value), name


def test_explicit_folder_without_checkpoint_or_file_missing_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _run(tmp_path / "run", capsys, "--resume", str(empty))
    assert code == 2
    assert f"--resume {empty}: the folder holds no checkpoint" in last_line(err)
    code, err = _run(tmp_path / "run", capsys, "--resume", str(empty / "x.pt"))
    assert (code, last_line(err)) == (
        2,
        f"dkfac train: error: --resume: checkpoint {empty / 'x.pt'} does not exist",
    )


def test_after_a_fallback_the_good_backup_is_not_rotated_away(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _crashed_run(run, capsys, monkeypatch, at=5)  # latest: step 4, previous: step 2
    (run / LATEST).write_bytes(b"\x00damaged" * 100)
    # Resume from the backup (step 2) and save once (step 4), then crash again at step 5.
    monkeypatch.setenv(faults.RAISE, "5")
    with pytest.raises(faults.InjectedFaultError):
        _run(run, capsys, "--resume", "auto")
    monkeypatch.delenv(faults.RAISE)
    assert _step(run / LATEST) == 4
    assert _step(run / PREVIOUS) == 2  # still the good backup, not the damaged file


def test_temporary_files_of_killed_writes_are_removed(tmp_path: Path) -> None:
    # A real killed write: a child process dies (SIGKILL) between writing and renaming.
    code = (
        "import os, signal, torch\n"
        "from dkfac.app import checkpoint\n"
        "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"checkpoint.save_checkpoint({{'w': torch.zeros(100_000)}}, {str(tmp_path / LATEST)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
        assert done.returncode == -9
    left = sorted(tmp_path.glob(f".{LATEST}.*.tmp"))
    assert len(left) == 2 and all(p.stat().st_size > 100_000 for p in left)
    assert not (tmp_path / LATEST).exists()
    save_rotating({"w": torch.ones(3)}, tmp_path)  # the next save cleans them up
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]
    assert remove_temporaries(tmp_path) == []


def test_second_run_into_the_same_out_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "metrics.png"}
    code, err = _run(tmp_path, capsys)
    assert code == 2
    assert last_line(err) == (
        f"dkfac train: error: --out {tmp_path} holds an earlier run (checkpoint.pt, "
        "checkpoint.prev.pt, metrics.jsonl); pass --resume auto to continue it, --overwrite "
        "to start afresh there, or another --out"
    )
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "metrics.png"}
    assert after == before  # nothing truncated, nothing rotated


def test_compare_checks_every_optimizers_folder_before_training_any(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # adamw trained in tmp/adamw first, then sgd's folder was refused: adamw's run was left.
    (tmp_path / "sgd").mkdir()
    (tmp_path / "sgd" / "metrics.jsonl").write_text("{}\n")
    argv = ["compare", *TINY, "--steps", "1", "--optimizers", "adamw,sgd"]
    code, err = run_cli([*argv, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert last_line(err) == (
        f"dkfac compare: error: --out {tmp_path / 'sgd'} holds an earlier run (metrics.jsonl); "
        "pass --resume auto to continue it, --overwrite to start afresh there, or another --out"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sgd"]
    assert (tmp_path / "sgd" / "metrics.jsonl").read_text() == "{}\n"


def test_overwrite_starts_afresh_and_is_not_saved_in_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, capsys)[0] == 0
    code, err = _run(tmp_path, capsys, "--overwrite", "--steps", "1", "--checkpoint-every", "0")
    assert code == 0, err
    assert not (tmp_path / PREVIOUS).exists()  # the old run's checkpoints were deleted
    assert _step(tmp_path / LATEST) == 1
    assert "overwrite = false" in (tmp_path / "config.toml").read_text()
    code, err = run_cli(["train", "--config", str(tmp_path / "config.toml")], capsys)
    assert code == 2 and "holds an earlier run" in last_line(err)  # the config never wipes
    code, err = _run(tmp_path, capsys, "--overwrite", "--resume", "auto")
    assert code == 2
    assert "--overwrite starts the run folder afresh; it cannot go with --resume" in err


def _set_step(state: dict[str, Any]) -> None:
    state["position"]["step"] = "4"


def _set_lr(state: dict[str, Any]) -> None:
    state["optimizer"]["param_groups"][0]["lr"] = "fast"


def _set_nan_weight(state: dict[str, Any]) -> None:
    state["model"]["classifier.2.bias"][0] = float("nan")


def _set_seconds(state: dict[str, Any]) -> None:
    state["position"]["wall_seconds"] = float("inf")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_step, "position.step must be an integer >= 0, got '4'"),
        (_set_lr, "optimizer.param_groups[0].lr must be a finite number, got 'fast'"),
        (_set_nan_weight, "model.classifier.2.bias holds values that are not finite"),
        (_set_seconds, "position.wall_seconds must be finite seconds >= 0, got inf"),
    ],
)
def test_tampered_field_with_a_matching_digest_is_refused(
    edit: Callable[[dict[str, Any]], None],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _crashed_run(tmp_path, capsys, monkeypatch, at=3)  # latest: step 2
    state = load_checkpoint(tmp_path / LATEST)
    edit(state)
    save_checkpoint(state, tmp_path / LATEST)  # digest recomputed: the file verifies
    load_checkpoint(tmp_path / LATEST)
    code, err = _run(tmp_path, capsys, "--resume", str(tmp_path / LATEST))
    assert code == 2, err
    assert last_line(err) == (
        f"dkfac train: error: checkpoint {tmp_path / LATEST} is not usable: {message}"
    )
