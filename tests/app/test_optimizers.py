"""`--optimizer dkfac` is KFACOptimizer.for_model, `--optimizer muon` Muon + AdamW, `--lrs`."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from dkfac.app.cli import parse_args
from dkfac.app.cli_checks import DEFAULT_LRS
from dkfac.app.muon import MuonAdamW
from dkfac.app.report import markdown_table
from dkfac.app.session import build_session
from dkfac.app.trainer import optimizer_lr
from dkfac.bench.peers import MuonWithAdamW
from dkfac.optimizer import DEFAULT_LR, DEFAULT_OPTIONS, KFACOptimizer

REPO = Path(__file__).resolve().parents[2]


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 16),
        nn.ReLU(),
        nn.Linear(16, 10),
    )


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def test_muon_adamw_steps_as_the_benchmarks_muon_with_adamw() -> None:
    mine, twin = _cnn(), _cnn()
    opt = MuonAdamW(mine, 0.05, adamw_lr=3e-3, momentum=0.95, weight_decay=0.1)
    ref = MuonWithAdamW(
        twin, 0.05, {"adamw_lr": 3e-3, "weight_decay": 0.1, "adamw_weight_decay": 0.1}
    )
    ref.adamw.param_groups[0]["betas"] = (0.95, 0.999)
    for seed in range(3):
        _grads(mine, seed)
        _grads(twin, seed)
        opt.step()
        ref.step()
    for a, b in zip(mine.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_muon_adamw_scheduler_and_state_dict() -> None:
    model = _cnn()
    opt = MuonAdamW(model, 0.05, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _grads(model, 0)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.0005]
    assert opt.muon.param_groups[0]["lr"] == 0.025 and opt.adamw.param_groups[0]["lr"] == 0.0005
    state = copy.deepcopy(opt.state_dict())
    other = MuonAdamW(_cnn(), 0.05, adamw_lr=1e-3)
    other.load_state_dict(state)
    assert [g["lr"] for g in other.param_groups] == [0.025, 0.0005]
    with pytest.raises(ValueError, match="not a MuonAdamW state"):
        other.load_state_dict({"muon": state["muon"]})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr must be"),
        ({"adamw_lr": float("nan")}, "adamw_lr"),
        ({"momentum": 1.0}, "momentum"),
    ],
)
def test_muon_adamw_rejects_bad_settings(kwargs: dict[str, float], match: str) -> None:
    settings = {"lr": 0.05, "adamw_lr": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=match):
        MuonAdamW(_cnn(), settings.pop("lr"), **settings)


def _session(argv: list[str]):  # type: ignore[no-untyped-def]
    args = parse_args(["train", "--data", "digits", "--model", "cnn", "--steps", "1", *argv])
    return build_session(args, torch.device("cpu"))


def test_dkfac_is_for_model_at_the_given_lr() -> None:
    run = _session(["--optimizer", "dkfac", "--lr", "0.004", "--weight-decay", "0.01"])
    twin = KFACOptimizer.for_model(copy.deepcopy(run.bare), 0.004, weight_decay=0.01)
    opt = run.optimizer
    assert isinstance(opt, KFACOptimizer) and run.preconditioner is opt.preconditioner
    assert opt.inner.param_groups[0]["momentum"] == 0.0
    assert opt.inner.param_groups[0]["lr"] == 0.004
    assert opt.inner.param_groups[0]["weight_decay"] == 0.01
    for key in DEFAULT_OPTIONS:
        assert getattr(opt.preconditioner.config, key) == getattr(twin.preconditioner.config, key)
    assert DEFAULT_LR == 3e-3


def test_dkfac_takes_the_kfac_flags_that_differ_from_the_defaults() -> None:
    run = _session(
        ["--optimizer", "dkfac", "--inverse-update-interval", "7", "--moment-beta2", "0.9"]
    )
    config = run.optimizer.preconditioner.config
    assert (config.inverse_update_interval, config.moment_beta2) == (7, 0.9)
    assert config.method == "eigen_adam" and config.kl_clip is None


def test_the_programs_default_is_for_model_and_each_optimizer_its_own_lr() -> None:
    """`dkfac train` with no optimizer or lr runs the library's recommendation at its lr;
    every optimizer without a rate takes its own default, in train and in compare."""
    run = _session([])
    twin = KFACOptimizer.for_model(copy.deepcopy(run.bare))
    assert isinstance(run.optimizer, KFACOptimizer)
    assert run.optimizer.inner.param_groups[0]["lr"] == DEFAULT_LR
    for key in DEFAULT_OPTIONS:
        mine = getattr(run.optimizer.preconditioner.config, key)
        assert mine == getattr(twin.preconditioner.config, key)
    for name, lr in DEFAULT_LRS.items():
        assert parse_args(["train", "--optimizer", name]).lr == lr
    args = parse_args(["compare"])
    assert args.optimizers == "dkfac,adamw,muon"
    assert [optimizer_lr(args, n) for n in ("dkfac", "adamw", "muon")] == [DEFAULT_LR, 1e-3, 0.02]
    given = parse_args(["compare", "--lr", "0.02", "--lrs", "adamw=0.003"])
    assert [optimizer_lr(given, n) for n in ("dkfac", "adamw", "muon")] == [0.02, 0.003, 0.02]


@pytest.mark.parametrize("method", ["cholesky", "smw"])
def test_dkfac_with_another_method_keeps_the_defaults_it_reads(method: str) -> None:
    """`--method` under dkfac is for_model's `method=`: the graph's flattened maps and the
    polar factor need a basis of moments, so they are not read (they made the flags an
    error before), as for_model leaves them out."""
    run = _session(["--method", method])
    twin = KFACOptimizer.for_model(copy.deepcopy(run.bare), method=method)
    config = run.optimizer.preconditioner.config
    assert config.method == method and not config.flattened_inputs
    assert config.orthogonal_layers == ()
    same = {"lr": config.lr, "flattened_inputs": config.flattened_inputs}
    assert config == dataclasses.replace(twin.preconditioner.config, **same)


def test_muon_session_and_its_adamw_lr() -> None:
    run = _session(["--optimizer", "muon", "--lr", "0.02", "--muon-adamw-lr", "0.004"])
    assert isinstance(run.optimizer, MuonAdamW)
    assert [g["lr"] for g in run.optimizer.param_groups] == [0.02, 0.004]


def test_lrs_per_optimizer_and_the_command_line_lr_wins(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('lrs = ["adamw=0.003", "muon=0.05"]\nlr = 0.1\n')
    assert parse_args(["train", "--config", str(config), "--optimizer", "muon"]).lr == 0.05
    assert parse_args(["train", "--config", str(config), "--optimizer", "sgd"]).lr == 0.1
    typed = ["train", "--config", str(config), "--optimizer", "muon", "--lr", "0.02"]
    assert parse_args(typed).lr == 0.02
    args = parse_args(["compare", "--config", str(config), "--optimizers", "adamw,muon,sgd"])
    assert [optimizer_lr(args, n) for n in ("adamw", "muon", "sgd")] == [0.003, 0.05, 0.1]


@pytest.mark.parametrize("item", ["adamw", "adam=x", "nope=0.1", "sgd=0", "sgd=inf"])
def test_bad_lrs_exit_2(item: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["train", "--lrs", item])
    assert info.value.code == 2
    assert "--lrs takes OPTIMIZER=LR" in capsys.readouterr().err


def test_make_train_runs_the_default_against_adamw_and_muon() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "--optimizers dkfac,adamw,muon" in makefile
    args = parse_args(["compare", "--config", str(REPO / "configs" / "digits.toml")])
    # No K-FAC key in the config: `dkfac` is for_model's default exactly.
    from dkfac.app.runconfig import kfac_config_from_args
    from dkfac.config import KFACConfig

    args.lr = optimizer_lr(args, "dkfac")
    config = kfac_config_from_args(args, defaults=DEFAULT_OPTIONS)
    shared = {"lr": args.lr, "seed": args.seed, "accumulation_steps": args.accumulation_steps}
    assert config == KFACConfig(**{**shared, **DEFAULT_OPTIONS})
    # Each optimizer runs at its own lr for the task, said in the config.
    assert {item.split("=")[0] for item in args.lrs} == {"dkfac", "adamw", "muon"}


def test_the_comparison_leads_with_the_time_to_the_target() -> None:
    rows = [
        {"optimizer": name, "seconds_to_target": s, "steps_to_target": n, "target_accuracy": 0.9}
        | {k: None for k in ("final_accuracy", "best_accuracy", "final_loss")}
        | {"final_bits_per_byte": None, "steps": 10, "train_seconds": 1.0, "seconds_per_step": 0.1}
        for name, s, n in (("slow", 3.0, 8), ("never", None, None), ("fast", 1.0, 4))
    ]
    table = markdown_table(rows)
    assert table.startswith("Time to test accuracy 0.9")
    header, _, *body = table.split("\n\n", 1)[1].splitlines()
    assert header.split(" | ")[1:3] == ["s to target", "steps to target"]
    assert [line.split(" | ")[0] for line in body if line] == ["| fast", "| slow", "| never"]
