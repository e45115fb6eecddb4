"""Red team, hangs (issue 20, class 7): a bounded default wait, and which rank was waited on.

Before: with the default ``--dist-timeout`` (1800 s) a hung rank held the whole job for half
an hour, and the rank that timed out said only "Timed out waiting ... for recv".
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dkfac.app.beacon import Beacon
from dkfac.app.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_default_dist_timeout_is_five_minutes() -> None:
    assert parse_args(["train"]).dist_timeout == 300.0


def test_report_names_the_rank_behind() -> None:
    store = dist.HashStore()
    beacons = [Beacon(store, r, 3, interval_s=60.0) for r in range(3)]
    try:
        for beacon in beacons[:2]:
            beacon.enter("training step 3", 3)
        beacons[0].enter("metrics after step 3", 3)  # same step, one phase further
        for beacon in beacons[:2]:
            beacon.publish()  # rank 2 never publishes (died before its first beacon)
        text = beacons[0].report()
        assert re.fullmatch(
            r"rank 0: metrics after step 3 \(for \d+ s\); rank 1: training step 3 \(for \d+ s\); "
            r"never reported: rank 2; behind: rank 1",
            text,
        ), text
        beacons[1].enter("metrics after step 3", 3)
        beacons[1].publish()
        assert "behind" not in beacons[0].report()  # level again
    finally:
        for beacon in beacons:
            beacon.close()


def test_one_process_reports_only_itself_and_starts_no_thread() -> None:
    beacon = Beacon(dist.HashStore(), 0, 1)
    beacon.enter("evaluation after step 2", 2)
    assert beacon._thread is None
    assert beacon.report().startswith("rank 0: evaluation after step 2 (for ")


def test_stall_is_warned_once_per_phase(caplog: pytest.LogCaptureFixture) -> None:
    beacon = Beacon(dist.HashStore(), 1, 2, interval_s=0.02, stall_after_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="dkfac.app.beacon"):
            beacon.enter("training step 7", 7)
            time.sleep(0.5)
        stalls = [r.message for r in caplog.records if "has been in" in r.message]
        assert len(stalls) == 1
        assert stalls[0].startswith("rank 1 has been in training step 7 for more than 0 s; ")
        assert "never reported: rank 0" in stalls[0]
    finally:
        beacon.close()


def test_hung_rank_is_named_by_the_rank_that_timed_out(tmp_path: Path) -> None:
    # 2 gloo ranks under torchrun; rank 1 hangs after step 3; rank 0 times out in step 4.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DKFAC_FAULT")}
    env.update({"DKFAC_FAULT_HANG_AT_STEP": "3", "DKFAC_FAULT_RANK": "1", "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    train = ["train", "--data", "digits", "--model", "mlp", "--batch-size", "64", "--steps", "8"]
    train += ["--log-every", "4", "--device", "cpu", "--threads", "1", "--dist-timeout", "6"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "--max-restarts", "0", "-m", "dkfac", *train]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode != 0
    line = next(
        (x for x in done.stderr.splitlines() if x.startswith("dkfac train: rank 0 failed")), ""
    )
    assert line.startswith("dkfac train: rank 0 failed in training step 4 ("), done.stderr[-4000:]
    assert "rank 1: training step 3 (for " in line and line.endswith("; behind: rank 1"), line
