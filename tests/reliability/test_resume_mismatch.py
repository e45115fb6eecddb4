"""Red team, resuming a checkpoint that does not match the run (issue 20, class 3, app side).

Before: another ``--method`` crashed with ``KeyError: 'qa'``, another dataset or image size
was accepted silently and the run ended at once, and a checkpoint of another optimizer failed
with messages like ``'param_groups'``. Checkpoints now record what they were made with.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app.checkpoint import LATEST, load_checkpoint, save_checkpoint
from dkfac.app.resume import RunMismatchError, convert_method
from dkfac.engine.optimizer_state import unpack
from tests.cli_args import TINY
from tests.reliability.cli_runs import last_line, run_cli

SHORT = [*TINY, "--epochs", "2", "--steps", "4", "--inverse-update-interval", "1"]


def _make(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> None:
    code, err = run_cli(["train", *SHORT, "--steps", "2", *extra, "--out", str(out)], capsys)
    assert code == 0, err


def _resume(
    ckpt: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str]:
    argv = ["train", *SHORT, *extra, "--resume", str(ckpt), "--out", str(out)]
    return run_cli(argv, capsys)


@pytest.mark.parametrize(
    ("made", "resumed", "difference"),
    [
        (["--optimizer", "sgd"], ["--optimizer", "kfac"], "--optimizer sgd there, kfac here"),
        (["--optimizer", "sgd"], ["--optimizer", "adam"], "--optimizer sgd there, adam here"),
        (["--optimizer", "kfac"], ["--optimizer", "sgd"], "--optimizer kfac there, sgd here"),
        (["--model", "cnn"], ["--model", "mlp"], "--model cnn there, mlp here"),
        ([], ["--batch-norm"], "--batch-norm off there, on here"),
        (
            [],
            ["--image-size", "16"],
            "data shape 1x8x8 images, 4 classes, 64 training samples there, "
            "1x16x16 images, 4 classes, 64 training samples here",
        ),
        ([], ["--synthetic-samples", "96"], "64 training samples there, 1x8x8 images"),
    ],
)
def test_checkpoint_of_another_setup_is_refused_naming_both_sides(
    made: list[str],
    resumed: list[str],
    difference: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _make(tmp_path / "a", capsys, *made)
    code, err = _resume(tmp_path / "a" / LATEST, tmp_path / "b", capsys, *resumed)
    assert code == 2, err
    line = last_line(err)
    assert line.startswith(
        f"dkfac train: error: checkpoint {tmp_path / 'a' / LATEST} was made with another setup: "
    )
    assert difference in line
    assert "Traceback" not in err


def test_another_dataset_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make(tmp_path / "a", capsys, "--optimizer", "sgd")
    argv = ["train", "--data", "digits", "--model", "cnn", "--optimizer", "sgd", "--steps", "2"]
    argv += ["--resume", str(tmp_path / "a"), "--out", str(tmp_path / "b")]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert "--data synthetic there, digits here" in last_line(err)


@pytest.mark.parametrize(("old", "new"), [("eigen", "cholesky"), ("cholesky", "eigen")])
def test_another_method_is_converted_from_the_factors(
    old: str,
    new: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _make(tmp_path / "a", capsys, "--method", old)
    saved = unpack(load_checkpoint(tmp_path / "a" / LATEST)["optimizer"])[1]
    # Inverses every 10 steps: the resumed steps 3 and 4 use the inverses made at loading.
    extra = ["--method", new, "--inverse-update-interval", "10"]
    with caplog.at_level(logging.WARNING, logger="dkfac.app.resume"):
        code, err = _resume(tmp_path / "a" / LATEST, tmp_path / "b", capsys, *extra)
    assert code == 0, err
    assert f"made with --method {old}; converted to --method {new}" in caplog.text
    after = load_checkpoint(tmp_path / "b" / LATEST)
    assert after["made_with"]["--method"] == new and after["position"]["step"] == 4
    layers = unpack(after["optimizer"])[1]["layers"]
    assert set(layers) == set(saved["layers"])
    for name, entry in layers.items():  # fresh inverses of the new method for every layer
        assert entry["inverse"].keys() != saved["layers"][name]["inverse"].keys(), name


def _kfac_state(plan: dict[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"A": torch.eye(3), "G": torch.eye(2), "inverse": {"qa": torch.eye(3)}}
    if plan is not None:
        entry["plan"] = plan
    return {"inner": {}, "preconditioner": {"step": 5, "layers": {"fc": entry}}}


def test_convert_method_drops_inverses_and_full_rank_plans() -> None:
    state = _kfac_state({"solver": "smw", "lowrank": {}})
    convert_method(state, "smw", "eigen")
    assert sorted(state["preconditioner"]["layers"]["fc"]) == ["A", "G"]
    kept = _kfac_state({"solver": "smw", "lowrank": {"A": 2}})
    convert_method(kept, "smw", "auto")  # low-rank factors stay usable: the plan is kept
    assert sorted(kept["preconditioner"]["layers"]["fc"]) == ["A", "G", "plan"]


def test_low_rank_factors_cannot_become_full_rank() -> None:
    state = _kfac_state({"solver": "smw", "lowrank": {"A": 2}})
    with pytest.raises(RunMismatchError, match="--method smw there holds low-rank factors of fc"):
        convert_method(state, "smw", "cholesky")


def test_checkpoint_from_before_the_record_still_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make(tmp_path / "a", capsys)
    state = load_checkpoint(tmp_path / "a" / LATEST)
    del state["made_with"]
    save_checkpoint(state, tmp_path / "a" / LATEST)
    code, err = _resume(tmp_path / "a" / LATEST, tmp_path / "b", capsys)
    assert code == 0, err
    assert load_checkpoint(tmp_path / "b" / LATEST)["position"]["step"] == 4
