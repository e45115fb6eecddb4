"""SP-NGD's large-batch recipe: running mixup, weight rescaling, momentum rule, configs."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dkfac.app import session
from dkfac.app.cli import parse_args
from dkfac.app.recipe import (
    RunningMixup,
    he_norm,
    mixing_weight,
    rescale_weights,
    scale_momentum,
)
from dkfac.app.trainer import RunResult, train

REPO = Path(__file__).resolve().parents[2]
DIGITS = ["--data", "digits", "--threads", "1", "--log-every", "100"]
RECIPE = [
    "--batch-norm",
    "--mixup",
    "0.4",
    "--mixup-mode",
    "running",
    "--weight-rescale",
    "--weight-decay",
    "0",
    "--momentum-scale-with-lr",
    "--schedule",
    "poly",
    "--power",
    "2",
]


def _session(*extra: str) -> session.Session:
    torch.set_num_threads(1)
    args = parse_args(["train", *DIGITS, "--model", "cnn", *extra])
    return session.build_session(args, torch.device("cpu"))


# ----------------------------------------------------------------------------- running mixup
def test_mixing_weight_is_the_larger_share() -> None:
    assert mixing_weight(0.2) == 0.8
    assert mixing_weight(0.7) == 0.7
    assert mixing_weight(0.5) == 0.5
    with pytest.raises(ValueError, match="draw"):
        mixing_weight(1.5)


def test_running_mixup_equals_the_expanded_recursion() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 1, 3, 3, generator=gen) for _ in range(4)]
    ys = [torch.randint(0, 5, (4,), generator=gen) for _ in range(4)]
    lams = [0.9, 0.6, 0.75, 0.5]  # lams[0] is ignored: the first batch is unmixed
    chain = RunningMixup(num_classes=5)
    got = [chain.mix(x, y, lam) for x, y, lam in zip(xs, ys, lams, strict=True)]
    onehot = [nn.functional.one_hot(y, 5).float() for y in ys]
    l1, l2, l3 = lams[1:]
    # x̃_t = Σ_s w_{t,s} x_s with w_{t,t} = λ_t and w_{t,s} = λ_s Π_{s<r<=t} (1 − λ_r), λ_0 := 1.
    weights = [
        [1.0],
        [1 - l1, l1],
        [(1 - l2) * (1 - l1), (1 - l2) * l1, l2],
        [(1 - l3) * (1 - l2) * (1 - l1), (1 - l3) * (1 - l2) * l1, (1 - l3) * l2, l3],
    ]
    for t, (mixed_x, soft) in enumerate(got):
        want_x = sum(w * x for w, x in zip(weights[t], xs, strict=False))
        want_y = sum(w * o for w, o in zip(weights[t], onehot, strict=False))
        torch.testing.assert_close(mixed_x, want_x)
        torch.testing.assert_close(soft, want_y)
        torch.testing.assert_close(soft.sum(1), torch.ones(4))
    assert torch.equal(got[0][0], xs[0])


def test_running_mixup_validates_and_round_trips() -> None:
    chain = RunningMixup(3)
    with pytest.raises(ValueError, match="lam"):
        chain.mix(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), 0.3)
    chain.mix(torch.ones(2, 1), torch.tensor([0, 1]), 1.0)
    with pytest.raises(ValueError, match="equal batch shapes"):
        chain.mix(torch.ones(3, 1), torch.tensor([0, 1, 2]), 0.7)
    other = RunningMixup(3)
    other.load_state_dict(chain.state_dict())
    assert other.inputs is not None and torch.equal(other.inputs, torch.ones(2, 1))
    with pytest.raises(ValueError, match="classes"):
        RunningMixup(4).load_state_dict(chain.state_dict())
    with pytest.raises(ValueError, match="num_classes"):
        RunningMixup(0)


def test_train_step_mixes_with_the_previous_mixed_batch() -> None:
    run = _session("--mixup", "0.4", "--mixup-mode", "running", "--batch-size", "32")
    assert run.running_mixup is not None
    data = run.data
    b0, b1 = list(range(32)), list(range(100, 132))
    session.train_step(run, b0, 0)
    session.train_step(run, b1, 1)
    # λ of step 1 is drawn exactly as train_step draws it (seeded by seed, rank, step).
    lam = mixing_weight(random.Random(0 * 1_000_003 + 0 + 1).betavariate(0.4, 0.4))
    want = lam * data.x_train[b1] + (1 - lam) * data.x_train[b0]
    onehot = nn.functional.one_hot(data.y_train, 10).float()
    assert run.running_mixup.inputs is not None and run.running_mixup.targets is not None
    torch.testing.assert_close(run.running_mixup.inputs, want)
    torch.testing.assert_close(run.running_mixup.targets, lam * onehot[b1] + (1 - lam) * onehot[b0])


# ----------------------------------------------------------------------------- weight rescaling
def test_rescale_weights_sets_the_he_norm_per_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 7, 3), nn.BatchNorm2d(7), nn.Flatten(), nn.Linear(7 * 4, 5), nn.Linear(5, 2)
    )
    for p in model.parameters():
        p.data.mul_(3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert rescale_weights(model) == 3
    for name, d_out in (("0.weight", 7), ("3.weight", 5), ("4.weight", 2)):
        w = model.state_dict()[name]
        assert he_norm(w) == math.sqrt(2 * d_out)
        torch.testing.assert_close(torch.linalg.vector_norm(w), torch.tensor(math.sqrt(2 * d_out)))
        # direction kept: W is a positive multiple of the old W
        scale = torch.linalg.vector_norm(w) / torch.linalg.vector_norm(before[name])
        torch.testing.assert_close(w, scale * before[name])
    for name in ("0.bias", "1.weight", "1.bias", "3.bias", "4.bias"):
        assert torch.equal(model.state_dict()[name], before[name]), name


@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_weight_norms_after_a_training_step(optimizer: str) -> None:
    run = _session(
        "--optimizer", optimizer, "--weight-rescale", "--weight-decay", "0", "--batch-size", "64"
    )
    session.train_step(run, list(range(64)), 0)
    layers = [m for m in run.bare.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(layers) == 5
    for m in layers:
        norm = float(torch.linalg.vector_norm(m.weight.detach()))
        assert norm == pytest.approx(math.sqrt(2 * m.weight.shape[0]), rel=1e-5)


# ----------------------------------------------------------------------------- momentum rule
@pytest.mark.parametrize("optimizer", ["kfac", "adam"])
def test_momentum_follows_the_poly_learning_rate(optimizer: str) -> None:
    # digits: 1437 // 256 = 5 steps per epoch, 2 epochs = T = 10 steps, poly power 2.
    run = _session(
        "--optimizer",
        optimizer,
        "--batch-size",
        "256",
        "--epochs",
        "2",
        "--schedule",
        "poly",
        "--power",
        "2",
        "--momentum",
        "0.9",
        "--momentum-scale-with-lr",
        "--lr",
        "0.05",
    )
    key = "momentum" if optimizer == "kfac" else "betas"

    def momentum() -> float:
        value: Any = run.optimizer.param_groups[0][key]
        return float(value if key == "momentum" else value[0])

    assert momentum() == pytest.approx(0.9)  # lr_0 / lr_0 = 1 at step 0
    for t in range(1, 4):
        session.train_step(run, list(range(256)), t - 1)
        lr = run.optimizer.param_groups[0]["lr"]
        assert lr == pytest.approx(0.05 * (1 - t / 10) ** 2)
        assert momentum() == pytest.approx(0.9 * (1 - t / 10) ** 2)


def test_scale_momentum_validates() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.5)
    with pytest.raises(ValueError, match="base_momentum"):
        scale_momentum(opt, 1.0)
    opt.param_groups[0]["initial_lr"] = 0.4
    scale_momentum(opt, 0.8)
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.2)


# ----------------------------------------------------------------------------- flags, configs
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mixup-mode", "running"], "--mixup-mode running needs --mixup"),
        (["--weight-rescale"], "replaces weight decay"),
        (["--model", "mlp", "--batch-norm"], "--batch-norm applies to --model cnn"),
    ],
)
def test_recipe_flag_errors_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["train", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_batch_norm_cnn_gets_unitwise_blocks() -> None:
    run = _session("--batch-norm", "--batch-size", "64")
    norms = [m for m in run.bare.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 3
    assert run.preconditioner is not None
    kinds = {type(layer.block).__name__ for layer in run.preconditioner.layers.values()}
    assert any("Norm" in k for k in kinds), kinds


def test_shipped_recipe_configs() -> None:
    large = parse_args(["train", "--config", str(REPO / "configs/digits-large-batch.toml")])
    assert large.batch_size >= 512 and large.refresh == "adaptive" and large.batch_norm
    assert large.mixup_mode == "running" and large.weight_rescale and large.weight_decay == 0
    assert large.momentum_scale_with_lr and large.schedule == "poly"
    cifar = parse_args(
        [
            "train",
            "--config",
            str(REPO / "configs/cifar10-resnet-spngd.toml"),
            "--data-dir",
            "unused",
        ]
    )
    assert cifar.strategy == "spngd" and cifar.mixup_mode == "running" and cifar.weight_rescale
    assert cifar.momentum_scale_with_lr and cifar.schedule == "poly"


# ----------------------------------------------------------------------------- training
def test_short_run_with_every_recipe_flag_reduces_the_loss() -> None:
    argv = ["train", *DIGITS, "--model", "cnn", "--batch-size", "256", *RECIPE]
    argv += ["--refresh", "adaptive", "--damping", "0.03"]
    one = train(parse_args([*argv, "--steps", "1"]), write=False)
    full = train(parse_args([*argv, "--epochs", "3"]), write=False)
    assert full.steps == 15
    assert full.final["loss"] < 0.5 * one.final["loss"]
    assert full.final["accuracy"] > 0.8


def _resume_run(tmp: Path, *extra: str) -> RunResult:
    argv = ["train", "--data", "synthetic", "--synthetic-samples", "64", "--in-channels", "1"]
    argv += ["--image-size", "8", "--num-classes", "4", "--threads", "1", "--model", "cnn"]
    argv += ["--batch-size", "16", "--epochs", "2", "--log-every", "2"]  # 4 steps per epoch
    argv += [*RECIPE, "--checkpoint-every", "3", "--out", str(tmp), *extra]
    return train(parse_args(argv), write=True)


class _CrashError(Exception):
    pass


def test_resume_continues_the_mixup_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    straight = _resume_run(tmp_path / "straight")
    real_step = session.train_step

    def crash_at_4(run: Any, indices: list[int], step: int) -> Any:
        if step == 4:  # the checkpoint after 3 steps holds the mixed batch of step 2
            raise _CrashError
        return real_step(run, indices, step)

    monkeypatch.setattr(session, "train_step", crash_at_4)
    with pytest.raises(_CrashError):
        _resume_run(tmp_path / "resumed")
    monkeypatch.setattr(session, "train_step", real_step)
    resumed = _resume_run(tmp_path / "resumed", "--resume", "auto")
    assert resumed.steps == straight.steps == 8
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
