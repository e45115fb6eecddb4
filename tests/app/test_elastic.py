"""Faults under torchrun: a killed rank restarts from the checkpoint; a failing rank stops the job.

Each test launches ``python -m torch.distributed.run`` with 2 gloo ranks on CPU as a
subprocess (as a user would) and injects a fault with the ``DKFAC_FAULT_*`` variables of
:mod:`dkfac.app.faults`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dkfac.app.checkpoint import LATEST, PREVIOUS, load_checkpoint
from dkfac.engine.optimizer_state import unpack

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    "train",
    "--data",
    "digits",
    "--model",
    "mlp",
    "--optimizer",
    "kfac",
    "--batch-size",
    "64",
    "--steps",
    "12",
    "--epochs",
    "1",
    "--log-every",
    "4",
    "--device",
    "cpu",
    "--threads",
    "1",
]
LIMIT_S = 240


def _torchrun(
    out: Path, extra: list[str], fault: dict[str, str], restarts: int
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DKFAC_FAULT")}
    env.update(fault)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "-m",
        "dkfac",
        *TRAIN,
        "--out",
        str(out),
        *extra,
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=ROOT
    )
    return done, time.monotonic() - start


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    out, err = done.stdout[-3000:], done.stderr[-6000:]
    return f"rc={done.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def test_killed_rank_restarts_from_checkpoint_and_matches_uninterrupted(tmp_path: Path) -> None:
    extra = ["--checkpoint-every", "4", "--resume", "auto"]
    clean, _ = _torchrun(tmp_path / "clean", extra, {}, restarts=1)
    assert clean.returncode == 0, _explain(clean)
    # Rank 1 dies by SIGKILL after step 6: the checkpoint of step 4 is the newest, the
    # restarted job loads it (on both ranks) and redoes steps 5-6.
    fault = {"DKFAC_FAULT_KILL_AT_STEP": "6", "DKFAC_FAULT_RANK": "1"}
    killed, _ = _torchrun(tmp_path / "killed", extra, fault, restarts=1)
    assert killed.returncode == 0, _explain(killed)
    assert "rank 1 kills itself (SIGKILL) at step 6" in killed.stderr, _explain(killed)

    want = load_checkpoint(tmp_path / "clean" / LATEST)
    got = load_checkpoint(tmp_path / "killed" / LATEST)
    assert got["position"]["step"] == want["position"]["step"] == 12
    assert want["model"].keys() == got["model"].keys()
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=1e-5, atol=1e-6)
    factors = unpack(want["optimizer"])[1]["layers"]
    for layer, entry in factors.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                mine = unpack(got["optimizer"])[1]["layers"][layer][key]
                torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-6)
    # No checkpoint left corrupt; both kept ones verify (digest) and hold distinct steps.
    for folder in ("clean", "killed"):
        files = sorted((tmp_path / folder).glob("*.pt"))
        assert [f.name for f in files] == sorted([LATEST, PREVIOUS])
        steps = {load_checkpoint(f)["position"]["step"] for f in files}
        assert steps == {8, 12}
        assert not list((tmp_path / folder).glob(".*.tmp"))  # no half-written temp file


def test_raising_rank_stops_the_whole_job(tmp_path: Path) -> None:
    fault = {"DKFAC_FAULT_RAISE_AT_STEP": "3", "DKFAC_FAULT_RANK": "1"}
    done, _ = _torchrun(tmp_path / "run", ["--dist-timeout", "30"], fault, restarts=0)
    assert done.returncode != 0, _explain(done)
    message = "InjectedFaultError: fault injection: rank 1 raises at step 3"
    assert message in done.stderr, _explain(done)


def test_hung_rank_times_out_after_dist_timeout(tmp_path: Path) -> None:
    # Rank 1 stops participating (alive, silent). Rank 0 waits in its next collective for
    # --dist-timeout seconds, then fails; torchrun then stops rank 1. With the default
    # timeout (5 min) this test would run into LIMIT_S instead.
    fault = {"DKFAC_FAULT_HANG_AT_STEP": "3", "DKFAC_FAULT_RANK": "1"}
    done, _ = _torchrun(tmp_path / "run", ["--dist-timeout", "5"], fault, restarts=0)
    assert done.returncode != 0, _explain(done)
    assert "rank 1 hangs at step 3" in done.stderr, _explain(done)
    assert "timed out" in done.stderr.lower() or "timeout" in done.stderr.lower(), _explain(done)


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_dist_timeout_must_be_positive(value: str) -> None:
    from dkfac.app.cli import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args([*TRAIN, "--dist-timeout", value])
    assert info.value.code == 2
