"""The training loop: resume == uninterrupted, accumulation == full batch, models, outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dkfac.app import session
from dkfac.app.checkpoint import LATEST
from dkfac.app.cli import main, parse_args
from dkfac.app.trainer import RunResult, UsageError, train
from tests.cli_args import TINY


def _train(*extra: str, out: Path | None = None, write: bool = False) -> RunResult:
    argv = ["train", *TINY, *extra]
    if out is not None:
        argv += ["--out", str(out)]
    return train(parse_args(argv), write=write)


def _params(result: RunResult) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


class _CrashError(Exception):
    pass


@pytest.mark.parametrize("optimizer", ["kfac", "kfac-adam", "sgd"])
def test_resume_equals_uninterrupted(
    optimizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 steps per epoch, 3 epochs; mixup, crop/flip, warm-up, a damping schedule and momentum
    # all draw on state that the checkpoint must carry.
    opts = [
        "--optimizer",
        optimizer,
        "--epochs",
        "3",
        "--mixup",
        "0.4",
        "--augment",
        "on",
        "--warmup-epochs",
        "1",
        "--damping-schedule",
        "3e-2@0,1e-2@1",
        "--inverse-update-interval",
        "3",
        "--checkpoint-every",
        "3",
        "--eval-every",
        "5",
    ]
    straight = _train(*opts, out=tmp_path / "straight", write=True)

    real_step = session.train_step

    def crash_at_7(run: Any, indices: list[int], step: int) -> Any:
        if step == 7:  # the checkpoint of step 6 exists; step 7 dies half-way (mid-epoch)
            raise _CrashError
        return real_step(run, indices, step)

    monkeypatch.setattr(session, "train_step", crash_at_7)
    with pytest.raises(_CrashError):
        _train(*opts, out=tmp_path / "resumed", write=True)
    monkeypatch.setattr(session, "train_step", real_step)
    resumed = _train(*opts, "--resume", "auto", out=tmp_path / "resumed", write=True)

    assert resumed.steps == straight.steps == 12
    a, b = _params(straight), _params(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    def numbers(folder: Path) -> list[tuple[Any, ...]]:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [(r["kind"], r["step"], r["loss"], r["accuracy"], r["lr"]) for r in rows]

    ev_a = [r for r in numbers(tmp_path / "straight") if r[0] == "eval"]
    ev_b = [r for r in numbers(tmp_path / "resumed") if r[0] == "eval"]
    assert ev_a == ev_b and len(ev_a) == 5  # steps 4, 5, 8, 10, 12


@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_accumulation_equals_the_full_batch(optimizer: str) -> None:
    common = ["--optimizer", optimizer, "--steps", "3", "--mixup", "0", "--damping", "0.05"]
    full = _params(_train(*common))
    accumulated = _params(_train(*common, "--accumulation-steps", "4"))
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-5)


SKIP_BIG = {  # keep K-FAC on tiny inputs cheap: skip the layers with 1000+ dimensional factors
    "resnet50": ["layers\\.([3-9]|1[0-9])\\.", "^fc$"],
    "vgg16": ["features\\.([5-9]|1[0-9])\\.", "classifier"],
}


@pytest.mark.parametrize(
    ("model", "size"),
    [("mlp", 8), ("cnn", 8), ("resnet20", 8), ("resnet50", 32), ("vgg16", 32), ("autoencoder", 8)],
)
def test_every_model_trains_with_kfac(model: str, size: int) -> None:
    skip = ["--skip-layers", *SKIP_BIG[model]] if model in SKIP_BIG else []
    result = _train(
        "--model",
        model,
        "--image-size",
        str(size),
        "--in-channels",
        "3",
        "--synthetic-samples",
        "8",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--inverse-update-interval",
        "1",
        *skip,
    )
    assert result.steps == 2
    assert math.isfinite(result.final["loss"])
    if model == "autoencoder":
        assert result.final["accuracy"] is None
    else:
        assert 0.0 <= result.final["accuracy"] <= 1.0
    for name, value in result.model.state_dict().items():
        assert torch.isfinite(value.float()).all(), name


def test_mc_fisher_label_smoothing_and_bf16_autocast() -> None:
    result = _train("--fisher", "mc", "--label-smoothing", "0.1", "--amp", "bf16", "--steps", "3")
    assert result.steps == 3 and math.isfinite(result.final["loss"])


def test_fp16_on_cpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="fp16 needs a CUDA device"):
        _train("--amp", "fp16", "--device", "cpu")
    assert main(["train", *TINY, "--amp", "fp16", "--device", "cpu"]) == 2
    assert "fp16 needs a CUDA device" in capsys.readouterr().err


def test_batch_not_divisible_by_accumulation_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *TINY, "--accumulation-steps", "3"]) == 2
    assert "must be a multiple" in capsys.readouterr().err


def test_run_folder_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *TINY,
                "--optimizer",
                "kfac",
                "--epochs",
                "2",
                "--out",
                str(out),
                "--target-accuracy",
                "0.01",
            ]
        )
        == 0
    )
    names = {p.name for p in out.iterdir()}
    assert {"metrics.jsonl", "metrics.png", "config.toml", "config.json", LATEST} <= names
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = {"kind", "step", "epoch", "loss", "accuracy", "lr", "wall_seconds", "train_seconds"}
    assert all(keys <= set(r) for r in rows)
    assert {"time_forward_backward", "time_optimizer"} <= set(rows[0])
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [4, 8]
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out
    assert "final: test accuracy" in stdout and "target 0.01 reached at step 4" in stdout
    # The saved config reproduces the options.
    again = parse_args(["train", "--config", str(out / "config.toml")])
    assert again.out == str(out) and again.epochs == 2 and again.target_accuracy == 0.01


def test_corrupt_checkpoint_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    assert main(["train", *TINY, "--resume", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "broken.pt is truncated or corrupt" in err and "Traceback" not in err


def test_compare_writes_one_report(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                *TINY,
                "--optimizers",
                "sgd,kfac",
                "--epochs",
                "2",
                "--target-accuracy",
                "0.2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((out / "compare.json").read_text())
    assert [r["optimizer"] for r in rows] == ["sgd", "kfac"]
    for row in rows:
        records = [json.loads(x) for x in (out / row["optimizer"] / "metrics.jsonl").open()]
        evals = [r for r in records if r["kind"] == "eval"]
        hit = next((r for r in evals if r["accuracy"] >= 0.2), None)
        assert row["steps_to_target"] == (hit and hit["step"])
        assert row["final_accuracy"] == evals[-1]["accuracy"]
        assert row["steps"] == 8
    assert "| sgd |" in (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 0


def test_short_digits_run_reduces_the_loss() -> None:
    argv = [
        "train",
        "--data",
        "digits",
        "--model",
        "mlp",
        "--optimizer",
        "kfac",
        "--batch-size",
        "64",
        "--threads",
        "1",
        "--log-every",
        "100",
    ]
    one = train(parse_args([*argv, "--steps", "1"]), write=False)
    epoch = train(parse_args([*argv, "--epochs", "1"]), write=False)
    assert epoch.steps == 22  # 1437 training images // 64
    assert epoch.final["loss"] < 0.5 * one.final["loss"]
    assert epoch.final["accuracy"] > 0.85
