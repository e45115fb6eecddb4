"""Checkpoint files: atomic writes, weights_only loading, clear errors, RNG round trip."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app import checkpoint as ckpt
from dkfac.app.checkpoint import (
    LATEST,
    CheckpointError,
    load_checkpoint,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6.0).view(2, 3), "b": torch.zeros(2, dtype=torch.float64)},
        "position": {"epoch": 3, "step_in_epoch": 5, "step": 29, "train_seconds": 1.5},
        "nested": [1, (2, "x"), None, True],
    }


def test_round_trip_with_weights_only(tmp_path: Path) -> None:
    path = save_checkpoint(_state(), tmp_path / "sub" / LATEST)
    # The file loads with the strict unpickler on its own, too.
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "dkfac-checkpoint"
    back = load_checkpoint(path)
    assert torch.equal(back["model"]["w"], _state()["model"]["w"])
    assert back["model"]["b"].dtype == torch.float64
    assert back["position"] == _state()["position"]
    assert back["nested"] == [1, (2, "x"), None, True]
    assert [p.name for p in path.parent.iterdir()] == [LATEST]  # no temporary files left


def test_replace_is_atomic_when_writing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint(_state(), tmp_path / LATEST)
    before = path.read_bytes()

    def broken_save(obj: object, f: Any) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"other": 1}, path)
    assert path.read_bytes() == before  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == [LATEST]


def test_truncated_checkpoint_names_the_file(tmp_path: Path) -> None:
    path = save_checkpoint(_state(), tmp_path / LATEST)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"checkpoint .*checkpoint\.pt is truncated or corrupt"
    ):
        load_checkpoint(path)


def test_garbage_missing_and_foreign_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"junk\.pt is truncated or corrupt"):
        load_checkpoint(junk)
    with pytest.raises(CheckpointError, match=r"nope\.pt does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {}}, foreign)
    with pytest.raises(CheckpointError, match="not a dkfac checkpoint"):
        load_checkpoint(foreign)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"format": "dkfac-checkpoint", "version": 1, "obj": object()}, unsafe)
    with pytest.raises(CheckpointError, match=r"unsafe\.pt"):
        load_checkpoint(unsafe)


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: fresh start
    save_checkpoint(_state(), tmp_path / LATEST)
    assert resolve_resume("auto", tmp_path) == tmp_path / LATEST
    assert resolve_resume(str(tmp_path), tmp_path / "elsewhere") == tmp_path / LATEST
    with pytest.raises(CheckpointError, match=r"missing\.pt does not exist"):
        resolve_resume(str(tmp_path / "missing.pt"), tmp_path)


def test_rng_state_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(5)
    save_checkpoint({"rng": rng_state()}, tmp_path / LATEST)
    first = (torch.rand(4), random.random())
    set_rng_state(load_checkpoint(tmp_path / LATEST)["rng"])
    second = (torch.rand(4), random.random())
    assert torch.equal(first[0], second[0]) and first[1] == second[1]
