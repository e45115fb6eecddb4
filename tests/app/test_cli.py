"""The command line: generated K-FAC flags, config files, bad input -> exit 2, dispatch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dkfac.app.cli import main, parse_args
from dkfac.app.runconfig import (
    dkfac_defaults,
    kfac_config_from_args,
    resolved_config,
    write_resolved_config,
)
from dkfac.app.schedules import PiecewiseSchedule
from dkfac.config import KFACConfig
from dkfac.optimizer import DEFAULT_OPTIONS

REPO = Path(__file__).resolve().parents[2]


def test_every_kfac_field_is_an_option_with_its_default() -> None:
    args = parse_args(["train"])
    for field in dataclasses.fields(KFACConfig):
        assert hasattr(args, field.name), field.name
    # Fields shared with training flags take those flags' values; the rest keep defaults.
    shared = {"lr": args.lr, "seed": args.seed, "accumulation_steps": args.accumulation_steps}
    assert kfac_config_from_args(args) == KFACConfig(**shared)


def test_kfac_flags_are_typed_from_the_annotations() -> None:
    args = parse_args(
        [
            "train",
            "--method",
            "cholesky",
            "--damping",
            "3e-3",
            "--kfac-inverse-update-interval",
            "25",
            "--kl-clip",
            "none",
            "--eigen-dtype",
            "float64",
            "--factor-dtype",
            "none",
            "--fisher",
            "mc",
            "--skip-layers",
            "fc.*",
            "conv1",
            "--seed",
            "7",
            "--accumulation-steps",
            "2",
            "--batch-size",
            "64",
        ]
    )
    config = kfac_config_from_args(args)
    assert config.method == "cholesky"
    assert config.damping == 3e-3 and isinstance(config.damping, float)
    assert config.inverse_update_interval == 25 and isinstance(config.inverse_update_interval, int)
    assert config.kl_clip is None and config.factor_dtype is None
    assert config.eigen_dtype is torch.float64
    assert config.fisher == "mc"
    assert config.skip_layers == ("fc.*", "conv1")
    assert config.seed == 7 and config.accumulation_steps == 2


@pytest.mark.parametrize(
    ("text", "value"), [("widths", "widths"), ("Widths", "widths"), ("64", 64), ("none", None)]
)
def test_the_block_size_flag_takes_an_integer_or_widths(text: str, value: object) -> None:
    args = parse_args(["train", "--method", "eigen_adam", "--basis-block-size", text])
    assert kfac_config_from_args(args).basis_block_size == value


def test_a_block_size_that_is_neither_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["train", "--basis-block-size", "wide"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected an integer or one of ['widths'], got 'wide'" in error


def test_kfac_schedule_flags_bind_to_the_epoch_length() -> None:
    args = parse_args(
        [
            "train",
            "--damping-schedule",
            "1e-2@0,1e-3@2",
            "--inverse-update-interval-schedule",
            "5@0,20@1",
        ]
    )
    config = kfac_config_from_args(args, steps_per_epoch=10)
    assert isinstance(config.damping, PiecewiseSchedule)
    assert [config.damping(s) for s in (0, 19, 20)] == [1e-2, 1e-2, 1e-3]
    assert callable(config.inverse_update_interval)
    assert [config.inverse_update_interval(s) for s in (9, 10)] == [5, 20]


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "--lr", "abc"], "invalid float value"),
        (["train", "--lr", "-1"], "--lr must be in (0, 1e+38], got -1.0"),
        (["train", "--epochs", "0"], "--epochs must be >= 1"),
        (["train", "--momentum", "1.5"], "--momentum must be in [0, 1)"),
        (["train", "--optimizer", "lbfgs"], "invalid choice: 'lbfgs'"),
        (["train", "--damping", "0"], "damping must be in (0.0, inf)"),
        (["train", "--factor-decay", "1.0"], "factor_decay"),
        (["train", "--method", "qr"], "invalid choice: 'qr'"),
        (["train", "--inverse-update-interval", "2.5"], "inverse_update_interval"),
        (["train", "--eigen-dtype", "int8"], "unknown dtype"),
        (["train", "--damping-schedule", "1e-3@4"], "must start at epoch 0"),
        (["train", "--damping-schedule=-1@0"], "damping must be in"),
        (["train", "--schedule", "step"], "--schedule step needs --milestones"),
        (["train", "--milestones", "5", "2", "--schedule", "step"], "increasing"),
        (["train", "--data", "cifar10"], "needs --data-dir"),
        (["train", "--optimizer", "adam", "--nesterov"], "--nesterov needs SGD"),
        (["train", "--warmup-epochs", "9", "--epochs", "3"], "exceeds --epochs"),
        (["train", "--target-accuracy", "97"], "--target-accuracy must be in (0, 1]"),
        (["train", "--stop-at-target"], "needs --target-accuracy"),
        (["compare", "--optimizers", "sgd,sgd"], "--optimizers must list distinct"),
        (["compare", "--optimizers", "sgd,newton"], "--optimizers must list distinct"),
        (["compare", "--resume", "x.pt"], "compare takes --resume auto"),
        ([], "give a command"),
    ],
)
def test_bad_input_exits_2_with_one_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code(argv, capsys)
    assert code == 2
    assert message in err


def test_bad_input_through_the_real_program() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "dkfac", "train", "--kl-clip", "-3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "kl_clip must be in (0.0, inf)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_kfac_options_that_do_not_fit_the_model_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Valid on their own, rejected by the engine once the model exists: still exit 2, one
    # message, no traceback, before any training step.
    argv = ["train", "--optimizer", "kfac", "--skip-layers", ".*", "--out", str(tmp_path)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "K-FAC options: model has no layer K-FAC can precondition" in err
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or '"kind": "train"' not in metrics.read_text()


# ----------------------------------------------------------------------- config files
def test_config_file_values_with_flag_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'lr = 0.2\nbatch-size = 32\noptimizer = "sgd"\nnesterov = true\n'
        'milestones = [2, 4]\nschedule = "step"\ndamping = 0.01\nkl_clip = "none"\n'
    )
    args = parse_args(["train", "--config", str(cfg), "--lr", "0.3"])
    assert args.lr == 0.3  # the flag wins
    assert args.batch_size == 32 and args.optimizer == "sgd" and args.nesterov is True
    assert args.milestones == [2.0, 4.0] and args.schedule == "step"
    assert args.damping == 0.01 and args.kl_clip is None


def test_resolved_config_round_trip(tmp_path: Path) -> None:
    argv = [
        "train",
        "--optimizer",
        "kfac",
        "--model",
        "mlp",
        "--lr",
        "0.123",
        "--milestones",
        "1",
        "3",
        "--schedule",
        "step",
        "--kl-clip",
        "none",
        "--eigen-dtype",
        "float64",
        "--skip-layers",
        "net\\.0",
        "--damping-schedule",
        "1e-2@0,1e-3@1",
        "--nesterov",
        "--target-accuracy",
        "0.9",
        "--out",
        str(tmp_path / "run"),
    ]
    args = parse_args(argv)
    values = write_resolved_config(args, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == values
    again = parse_args(["train", "--config", str(tmp_path / "config.toml")])
    assert again.config is not None
    mine, theirs = vars(args), vars(again)
    for key in ("config", "given"):  # the file gives every flag
        mine.pop(key)
        theirs.pop(key)
    assert mine == theirs
    assert resolved_config(again) == values


@pytest.mark.parametrize(
    "flags", [[], ["--method", "eigen"], ["--inverse-update-interval", "10", "--damping", "0.1"]]
)
def test_dkfac_keeps_what_is_given_and_its_resolved_config_runs_the_same(
    tmp_path: Path, flags: list[str]
) -> None:
    """Under the default optimizer a flag given at KFACPreconditioner's default is kept
    (`--method eigen` ran eigen_adam), one not given is for_model's, and the resolved
    config, which gives every flag, reads back as the same K-FAC configuration."""
    args = parse_args(["train", *flags])
    config = kfac_config_from_args(args, defaults=dkfac_defaults(args))
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert config.method == given.get("--method", DEFAULT_OPTIONS["method"])
    interval = int(
        given.get("--inverse-update-interval", DEFAULT_OPTIONS["inverse_update_interval"])
    )
    assert config.inverse_update_interval == interval
    assert config.moment_nesterov is (config.method == "eigen_adam")
    values = write_resolved_config(args, tmp_path)
    again = parse_args(["train", "--config", str(tmp_path / "config.toml")])
    assert kfac_config_from_args(again, defaults=dkfac_defaults(again)) == config
    assert resolved_config(again) == values
    assert set(again.given) - {"config"} == set(values)  # no K-FAC flag not given
    assert {"method", "inverse_update_interval"} & set(values) == {
        flag[2:].replace("-", "_") for flag in given if flag != "--damping"
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rate = 0.1\n", "unknown key 'learning_rate'"),
        ("lr = 'fast'\n", "lr must be a number, got 'fast'"),
        ("nesterov = 1\n", "nesterov must be true or false"),
        ("lr = [0.1, 0.2]\n", "lr takes one value"),
        ("lr = \n", "not valid TOML"),
        ("[kfac]\ndamping = 0.1\n", "tables are not supported"),
        ("damping = -1.0\n", "damping must be in"),
        ("skip_layers = 3\n", "skip_layers must be a string or a list of them, got 3"),
        ("skip_layers = [3]\n", "skip_layers must be a string or a list of them, got 3"),
        ('skip_layers = ["^fc", true]\n', "skip_layers must be a string or a list of them"),
        ("orthogonal_layers = 1.5\n", "orthogonal_layers must be a string or a list of them"),
        ('damping = "0.1"\n', "damping must be a number, got '0.1'"),
        ('lr = "0.1"\n', "lr must be a number, got '0.1'"),
        ('moment_beta2 = "0.9"\n', "moment_beta2 must be a number, got '0.9'"),
        ("seed = true\n", "seed must be an integer, got True"),
        ("epochs = 2.5\n", "epochs must be an integer, got 2.5"),
        ('milestones = ["1"]\n', "milestones must be a number or a list of them, got '1'"),
        ('pack_triangles = "true"\n', "pack_triangles must be true, false or \"none\", got 'true'"),
        ("basis_block_size = 2.5\n", "basis_block_size must be an integer or a string, got 2.5"),
        ("method = 3\n", "method must be a string, got 3"),
        ("out = 3\n", "out must be a string, got 3"),
        ("damping_schedule = 3\n", "damping_schedule must be a string, got 3"),
        # a list item the command line would read as a flag: it switched --overwrite on
        ('lrs = ["--overwrite"]\n', "lrs item '--overwrite' starts with '-'"),
        ('skip_layers = ["--overwrite"]\n', "skip_layers item '--overwrite' starts with '-'"),
        # both spellings of one key: the last one was kept, silently
        (
            "weight-decay = 0.1\nweight_decay = 0.2\n",
            "'weight-decay' and 'weight_decay' are the same key (--weight-decay); give it once",
        ),
    ],
)
def test_bad_config_files_exit_2(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    code, err = _exit_code(["train", "--config", str(cfg)], capsys)
    assert code == 2 and message in err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


def test_a_second_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second file replaced the first silently: lr = 0.5 of a.toml was not read.
    (tmp_path / "a.toml").write_text("lr = 0.5\n")
    (tmp_path / "b.toml").write_text("momentum = 0.5\n")
    a, b = str(tmp_path / "a.toml"), str(tmp_path / "b.toml")
    for second in (["--config", b], [f"--config={b}"], ["--conf", b]):
        argv = ["compare", "--config", a, *second, "--steps", "1", "--out", str(tmp_path / "r")]
        code, err = _exit_code(argv, capsys)
        assert code == 2, err
        assert err.strip().splitlines()[-1] == (
            f"dkfac compare: error: --config is given twice ({a!r}, {b!r}): give one file "
            "(flags on the command line override it)"
        )
    assert parse_args(["train", "--config", a]).lr == 0.5


def test_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _exit_code(["train", "--config", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "does not exist" in err


# ----------------------------------------------------------------------- dispatch
def test_bench_and_plan_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("dkfac.app.plan")

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dkfac.app.plan", fake)
    assert main(["plan", "--world-size", "8"]) == 3
    assert seen == [["--world-size", "8"]]


def test_missing_subprogram_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "dkfac.app.plan", None)  # makes the import fail
    assert main(["plan"]) == 2
    assert "dkfac plan: not available" in capsys.readouterr().err


def test_namespace_is_plain() -> None:
    assert isinstance(parse_args(["compare"]), argparse.Namespace)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_files_parse(path: Path) -> None:
    args = parse_args(["train", "--config", str(path), "--data-dir", "unused"])
    assert args.config == str(path)
    values = {k.replace("-", "_") for k in path.read_text().split("\n") if "=" in k}
    assert values  # and every key became an option (unknown keys would have exited)


def test_readme_first_code_block_is_the_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    block = text.split("```")[1]
    lines = [line.strip() for line in block.splitlines()[1:] if line.strip()]
    assert lines == ["make train", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert "configs/digits.toml" in makefile and "compare" in makefile
