"""Verified checkpoints: damage is detected and named, ``--resume auto`` falls back, no code runs.

Oracles: the damaged files below are ones plain ``torch.load`` accepts (a flipped tensor byte)
or ones plain ``pickle`` executes (a ``__reduce__`` payload), shown first in each test, so the
refusals are the checkpoint layer's doing.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app import faults
from dkfac.app.checkpoint import (
    LATEST,
    PREVIOUS,
    CheckpointError,
    choose_resume,
    load_checkpoint,
    save_checkpoint,
    save_rotating,
)
from dkfac.app.cli import parse_args
from dkfac.app.trainer import train


def _state(step: int) -> dict[str, Any]:
    return {"weights": torch.arange(64.0) + step, "position": {"step": step}}


class _Payload:
    """Unpickling this runs ``exec`` on code that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_flipped_tensor_byte_is_caught_by_the_digest(tmp_path: Path) -> None:
    path = save_checkpoint(_state(3), tmp_path / LATEST)
    data = bytearray(path.read_bytes())
    at = data.find((torch.tensor([40.0]) + 3).numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    raw = torch.load(path, weights_only=True)  # the zip container does not notice ...
    assert raw["weights"][40] != 43.0
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt is corrupt: .*digest"):
        load_checkpoint(path)  # ... the digest does


def test_save_rotating_keeps_two_and_auto_prefers_the_newest(tmp_path: Path) -> None:
    assert choose_resume("auto", tmp_path) is None  # nothing yet: fresh start
    for step in (1, 2, 3):
        save_rotating(_state(step), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LATEST, PREVIOUS])
    assert load_checkpoint(tmp_path / LATEST)["position"]["step"] == 3
    assert load_checkpoint(tmp_path / PREVIOUS)["position"]["step"] == 2
    assert choose_resume("auto", tmp_path) == tmp_path / LATEST


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_auto_falls_back_to_previous_and_names_the_bad_file(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_rotating(_state(1), tmp_path)
    save_rotating(_state(2), tmp_path)
    latest = tmp_path / LATEST
    data = latest.read_bytes()
    latest.write_bytes(
        {"truncate": data[: len(data) * 2 // 3], "garbage": b"\x00junk" * 50, "empty": b""}[damage]
    )
    with caplog.at_level(logging.WARNING):
        chosen = choose_resume("auto", tmp_path)
    assert chosen == tmp_path / PREVIOUS
    assert load_checkpoint(chosen)["position"]["step"] == 1
    assert f"skipping {latest}" in caplog.text and "previous checkpoint" in caplog.text
    # Both damaged: refuse rather than silently start from scratch.
    (tmp_path / PREVIOUS).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*checkpoint\.prev\.pt"):
        choose_resume("auto", tmp_path)


def test_code_carrying_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    probe = tmp_path / "probe-ran"
    pickle.loads(pickle.dumps(_Payload(probe)))  # the payload is live under plain pickle
    assert probe.exists()

    marker = tmp_path / "payload-ran"
    crafted = {"format": "dkfac-checkpoint", "version": 1, "model": _Payload(marker)}
    as_zip = tmp_path / "zip.pt"
    torch.save(crafted, as_zip)
    as_pickle = tmp_path / "plain.pt"  # the legacy (non-zip) format torch.load also reads
    with as_pickle.open("wb") as handle:
        pickle.dump(crafted, handle, protocol=2)
    for file in (as_zip, as_pickle):
        with pytest.raises(CheckpointError, match=rf"{file.name} was refused: .*could run code"):
            load_checkpoint(file)
    newer = tmp_path / "protocol5.pt"  # opcodes the safe unpickler stops at even earlier
    newer.write_bytes(pickle.dumps(crafted, protocol=5))
    with pytest.raises(CheckpointError, match=r"protocol5\.pt"):
        load_checkpoint(newer)
    # Under --resume auto a crafted newest checkpoint is skipped, the previous one used.
    run = tmp_path / "run"
    save_rotating(_state(1), run)
    save_rotating(_state(2), run)
    os.replace(as_zip, run / LATEST)
    assert choose_resume("auto", run) == run / PREVIOUS
    assert not marker.exists()


def test_fault_variables_are_validated_and_respect_restarts() -> None:
    env = {faults.RAISE: "3", faults.RANK: "1"}
    faults.maybe_inject(3, 0, env)  # another rank: nothing
    faults.maybe_inject(2, 1, env)  # another step: nothing
    faults.maybe_inject(3, 1, {**env, faults.RESTARTS: "1"})  # a restarted job: nothing
    with pytest.raises(faults.InjectedFaultError, match="rank 1 raises at step 3"):
        faults.maybe_inject(3, 1, env)
    with pytest.raises(ValueError, match="DKFAC_FAULT_RAISE_AT_STEP must be an integer"):
        faults.maybe_inject(3, 1, {faults.RAISE: "soon"})


def test_trainer_resumes_from_previous_when_latest_is_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = [
        "train",
        *("--data", "digits", "--model", "mlp", "--optimizer", "kfac", "--batch-size", "64"),
        *("--threads", "1", "--device", "cpu", "--log-every", "2", "--epochs", "1"),
        *("--inverse-update-interval", "2", "--checkpoint-every", "2"),
    ]
    full = train(parse_args([*base, "--steps", "8", "--out", str(tmp_path / "full")]))
    part = tmp_path / "part"
    with pytest.raises(faults.InjectedFaultError):
        os.environ[faults.RAISE] = "7"
        try:
            train(parse_args([*base, "--steps", "8", "--out", str(part)]))
        finally:
            del os.environ[faults.RAISE]
    # Checkpoints of steps 4 (previous) and 6 (latest); damage the latest.
    assert load_checkpoint(part / LATEST)["position"]["step"] == 6
    (part / LATEST).write_bytes((part / LATEST).read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        resumed = train(parse_args([*base, "--steps", "8", "--out", str(part), "--resume", "auto"]))
    assert f"skipping {part / LATEST}" in caplog.text
    assert resumed.steps == full.steps == 8
    want, got = full.model.state_dict(), resumed.model.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
