"""Red team, values that wreck a run (issue 20, class 1): refused at entry, or exit 3 at the end.

Before: ``--weight-decay nan`` trained to NaN weights and saved them, ``--gamma -1`` made the
learning rate negative, ``--gamma nan`` skipped every step, ``--mixup nan`` turned mixup
off, ``--power -1`` crashed with ``ZeroDivisionError``, and a run that diverged to NaN (or
to a loss of 1e8) exited 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from dkfac.app.checkpoint import LATEST, load_checkpoint
from dkfac.app.cli import build_parser
from dkfac.app.domains import DOMAINS, Domain, domain_error
from dkfac.app.report import diagnose
from dkfac.app.schedules import lr_factor, make_lr_lambda
from dkfac.config import KFACConfig
from tests.reliability.cli_runs import SHORT, last_line, run_cli


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weight-decay", "nan"], "--weight-decay must be finite and in [0, 1e+38], got nan"),
        (["--weight-decay=-1e-4"], "--weight-decay must be in [0, 1e+38], got -0.0001"),
        (["--gamma=-1"], "--gamma must be in (0, 1] (a decay factor), got -1.0"),
        (["--gamma", "nan"], "--gamma must be finite and in (0, 1] (a decay factor), got nan"),
        (["--gamma", "0"], "--gamma must be in (0, 1] (a decay factor), got 0.0"),
        (["--mixup", "nan"], "--mixup must be finite and >= 0 (Beta(a, a) parameter; 0 = off)"),
        (["--power=-1"], "--power must be > 0 (the poly schedule's exponent), got -1.0"),
        (["--power", "inf"], "--power must be finite and > 0"),
        (["--lr", "inf"], "--lr must be finite and in (0, 1e+38], got inf"),
        (["--lr", "nan"], "--lr must be finite and in (0, 1e+38], got nan"),
        (["--momentum", "nan"], "--momentum must be finite and in [0, 1), got nan"),
        (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
        (["--milestones", "1", "nan"], "--milestones must be finite and >= 0 (epochs), got nan"),
        (["--target-accuracy", "nan"], "--target-accuracy must be finite and in (0, 1]"),
        (["--dist-timeout", "0"], "--dist-timeout must be in (0, 604800] (seconds), got 0.0"),
        (["--checkpoint-every=-1"], "--checkpoint-every must be >= 0, got -1"),
        (["--refresh-threshold", "nan"], "refresh_threshold must be in (0.0, inf), got nan"),
    ],
)
def test_wrecking_value_is_refused_at_entry(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["train", *SHORT, *extra], capsys)
    assert code == 2, err
    assert message in last_line(err), err


def _numeric(action: argparse.Action) -> bool:
    return getattr(action.type, "__name__", None) in ("int", "float")


def test_every_numeric_training_flag_has_a_domain() -> None:
    # The table is the single place: a numeric flag added later without a domain fails here.
    # K-FAC flags are checked by KFACConfig, except the three it shares with training flags.
    kfac_only = {f.name for f in dataclasses.fields(KFACConfig)} - {
        "lr",
        "seed",
        "accumulation_steps",
    }
    _, subs = build_parser()
    for sub in subs.values():
        numeric = {a.dest for a in sub._actions if a.option_strings and _numeric(a)}
        training = numeric - kfac_only
        assert {"gamma", "power", "lr", "seed", "dist_timeout", "steps"} <= training
        assert training <= set(DOMAINS), training - set(DOMAINS)


def test_domain_descriptions_and_edges() -> None:
    unit = Domain(0.0, 1.0, high_open=True)
    assert unit.describe() == "in [0, 1)"
    assert [unit.contains(v) for v in (0.0, 0.999, 1.0, -0.0, math.nan)] == [
        True,
        True,
        False,
        True,
        False,
    ]
    assert Domain(1).describe() == ">= 1" and Domain(0.0, low_open=True).describe() == "> 0"
    assert domain_error("lr", 0.05) is None
    assert domain_error("milestones", [1.0, 2.0]) is None
    assert domain_error("steps", None) is None  # an optional flag left unset


def test_lr_schedule_options_have_domains_and_the_factor_stays_in_0_1() -> None:
    base = {"schedule": "step", "steps_per_epoch": 4, "total_steps": 40, "milestones": [2, 5]}
    for bad in ({"gamma": -1.0}, {"gamma": math.nan}, {"power": -1.0}, {"warmup_epochs": math.inf}):
        with pytest.raises(ValueError, match="must be"):
            lr_factor(0, **{**base, **bad})  # type: ignore[arg-type]
    # gamma 0.5, milestones at epochs 2 and 5 (steps 8 and 20): 1, 0.5, 0.25 by hand.
    factor = make_lr_lambda(**base, gamma=0.5)  # type: ignore[arg-type]
    assert [factor(s) for s in (0, 7, 8, 19, 20, 39)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    poly = make_lr_lambda(
        schedule="poly", steps_per_epoch=4, total_steps=40, warmup_epochs=1, power=0.5
    )
    values = [poly(s) for s in range(41)]
    assert all(0.0 <= v <= 1.0 for v in values) and values[-1] == 0.0  # (1 - 1) ** 0.5


def test_diagnose_by_hand() -> None:
    ok = {"kind": "eval", "loss": 0.9}
    train = [{"kind": "train", "loss": 2.0}, ok]
    assert diagnose(train, ok, skipped=0, steps=10, num_classes=10) is None
    nan = {"kind": "eval", "loss": math.nan}
    assert "the final test loss is nan: the run diverged" in str(diagnose([], nan, 0, 10, 10))
    text = diagnose(train, ok, skipped=6, steps=10, num_classes=10)
    assert text is not None and text.startswith("6 of 10 optimizer steps were skipped")
    assert diagnose(train, ok, skipped=5, steps=10, num_classes=10) is None  # half: not most
    huge = {"kind": "eval", "loss": 100 * math.log(10)}
    assert "over 100 times that of a uniform guess over 10 classes" in str(
        diagnose(train, huge, 0, 10, 10)
    )
    just_below = {"kind": "eval", "loss": 99 * math.log(10)}
    assert diagnose(train, just_below, 0, 10, 10) is None
    # The autoencoder's reference is its first logged training loss (2.0 here).
    assert diagnose(train, {"kind": "eval", "loss": 199.0}, 0, 10, None) is None
    assert "first logged training loss" in str(diagnose(train, {"loss": 200.0}, 0, 10, None))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # SGD at lr 1e30: the weights overflow, the test loss is NaN.
        (["--optimizer", "sgd", "--lr", "1e30"], "the final test loss is nan: the run diverged"),
        # K-FAC with damping 1e-8 (issue: loss 8e8 on digits): finite but exploded.
        (
            ["--optimizer", "kfac", "--damping", "1e-8", "--lr", "1"],
            "is over 100 times that of a uniform guess over 4 classes (1.386)",
        ),
    ],
)
def test_diverged_run_exits_3_with_the_reason(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *SHORT, "--steps", "4", *extra, "--checkpoint-every", "1"]
    code, err = run_cli([*argv, "--out", str(tmp_path)], capsys)
    assert code == 3, err
    assert message in last_line(err) and last_line(err).startswith("dkfac train: error: ")
    # The checkpoint kept holds finite weights: a NaN state is never saved over a good one.
    state = load_checkpoint(tmp_path / LATEST)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_nan_weights_are_not_checkpointed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *SHORT, "--steps", "4", "--optimizer", "sgd", "--lr", "1e30"]
    code, err = run_cli([*argv, "--checkpoint-every", "1", "--out", str(tmp_path)], capsys)
    assert code == 3
    assert "the weights are not finite; checkpoint not written" in err
    saved = load_checkpoint(tmp_path / LATEST)["position"]["step"]
    assert 1 <= saved < 4
