"""Flags the run does not read are named in a warning, once each, and nothing else is."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dkfac.app.cli import build_parser, main, parse_args
from dkfac.app.idle_flags import idle_flags
from tests.cli_args import TINY


def _idle(*argv: str) -> list[str]:
    sub = build_parser()[1][argv[0]]
    return [m.split(" is ")[0] for m in idle_flags(parse_args(list(argv)), sub)]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "--milestones", "3", "--gamma", "0.5"], ["--gamma", "--milestones"]),
        (["train", "--schedule", "step", "--milestones", "3", "--gamma", "0.5"], []),
        (["train", "--power", "3"], ["--power"]),
        (["train", "--schedule", "poly", "--power", "3"], []),
        (["train", "--optimizer", "sgd", "--damping", "0.01"], ["--damping"]),
        (["train", "--optimizer", "adamw", "--damping-schedule", "0.1@0"], ["--damping-schedule"]),
        (["train", "--optimizer", "kfac", "--damping", "0.01"], []),
        (["train", "--damping", "0.01", "--lr", "0.01"], []),
        # K-FAC fields filled from training flags: read by every optimizer
        (["train", "--optimizer", "sgd", "--accumulation-steps", "2", "--seed", "3"], []),
        (["train", "--optimizer", "adamw", "--strategy", "spngd"], ["--strategy"]),
        (["compare", "--optimizers", "adamw,sgd", "--seed", "5"], []),
        (["train", "--optimizer", "adamw", "--muon-adamw-lr", "0.01"], ["--muon-adamw-lr"]),
        (["train", "--optimizer", "muon", "--muon-adamw-lr", "0.01"], []),
        (["train", "--optimizer", "muon", "--nesterov"], ["--nesterov"]),
        (["train", "--momentum", "0.8"], ["--momentum"]),
        (["train", "--momentum", "0.9", "--gamma", "0.1"], []),  # at their defaults
        (["train", "--momentum", "0.8", "--momentum-scale-with-lr"], []),
        (["train", "--optimizer", "adam", "--momentum", "0.8"], []),
        (["train", "--text-path", "/tmp", "--seq-len", "32"], ["--seq-len", "--text-path"]),
        (["train", "--data", "text", "--model", "gpt", "--seq-len", "32", "--layers", "1"], []),
        (["train", "--layers", "3", "--width", "32", "--heads", "2"],
         ["--heads", "--layers", "--width"]),
        (["train", "--image-size", "16", "--num-classes", "3"], ["--image-size", "--num-classes"]),
        (["train", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64"], []),
        (["train", "--data-dir", "/tmp"], ["--data-dir"]),
        # compare: idle only when no optimizer of the run reads it
        (["compare", "--optimizers", "sgd,adamw", "--damping", "0.01"], ["--damping"]),
        (["compare", "--optimizers", "sgd,dkfac", "--damping", "0.01", "--nesterov"], []),
        (["compare", "--optimizers", "dkfac,adamw", "--muon-adamw-lr", "0.01"],
         ["--muon-adamw-lr"]),
        (["compare", "--muon-adamw-lr", "0.01", "--momentum", "0.8"], []),
    ],
)  # fmt: skip
def test_idle_flags_names_exactly_the_flags_the_run_does_not_read(
    argv: list[str], expected: list[str]
) -> None:
    assert _idle(*argv) == expected


def test_a_config_files_flags_count_as_given(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("optimizer = 'adamw'\nmilestones = [2, 4]\ndamping = 0.01\n")
    assert _idle("train", "--config", str(config)) == ["--damping", "--milestones"]


def test_a_run_repeated_from_its_saved_config_names_only_what_it_named(tmp_path: Path) -> None:
    out = tmp_path / "r"
    argv = ["train", *TINY, "--steps", "1", "--optimizer", "sgd", "--out", str(out)]
    assert main([*argv, "--milestones", "1"]) == 0
    again = ["train", "--config", str(out / "config.toml"), "--out", str(tmp_path / "again")]
    assert _idle(*again) == ["--milestones"]


def test_train_warns_once_per_idle_flag_and_still_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["train", *TINY, "--steps", "1", "--optimizer", "sgd", "--out", str(tmp_path / "r")]
    with caplog.at_level(logging.WARNING, logger="dkfac.app.idle_flags"):
        assert main([*argv[:-1], str(tmp_path / "quiet")]) == 0
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="dkfac.app.idle_flags"):
        assert main([*argv, "--damping", "0.01", "--milestones", "1"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "dkfac.app.idle_flags"]
    assert warned == [
        "dkfac train: --damping is a K-FAC option and no optimizer of the run is dkfac, kfac, "
        "kfac-adam: it is not read",
        "dkfac train: --milestones is given but the run's --schedule is not step: it is not read",
    ]
