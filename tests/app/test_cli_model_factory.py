"""``--model package.module:factory``, the language-model flag checks, and ``dkfac --help``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from dkfac.app.cli import HelpFormatter, build_parser, main, parse_args
from dkfac.app.models import ModelError, build_model
from tests.cli_args import TINY

SEEN: list[dict[str, Any]] = []
NOT_CALLABLE = 42


def flat_classifier(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A factory naming every shape keyword: a linear classifier of the flattened image."""
    SEEN.append({"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes})
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))


def takes_anything(**kwargs: int) -> nn.Module:
    SEEN.append(kwargs)
    return nn.Linear(2, 2)


def takes_nothing() -> nn.Module:
    return nn.Linear(3, 1)


def returns_int(num_classes: int) -> int:
    return num_classes


def _without_model(argv: list[str]) -> list[str]:
    at = argv.index("--model")
    return argv[:at] + argv[at + 2 :]


def test_factory_model_trains_through_the_cli(tmp_path: Path) -> None:
    SEEN.clear()
    argv = ["train", *_without_model(TINY), "--model", f"{__name__}:flat_classifier"]
    assert main([*argv, "--steps", "2", "--optimizer", "kfac", "--out", str(tmp_path)]) == 0
    assert SEEN == [{"in_channels": 1, "image_size": 8, "num_classes": 4}]
    assert 'model = "' + f"{__name__}:flat_classifier" in (tmp_path / "config.toml").read_text()


def test_factory_gets_the_keywords_its_signature_names() -> None:
    SEEN.clear()
    sizes = {"in_channels": 3, "image_size": 5, "num_classes": 7}
    build_model(f"{__name__}:takes_anything", **sizes, seq_len=5)
    assert [{**sizes, "seq_len": 5}] == SEEN
    assert isinstance(build_model(f"{__name__}:takes_nothing", **sizes), nn.Linear)
    with pytest.raises(ModelError, match=r"returned int, not a torch\.nn\.Module"):
        build_model(f"{__name__}:returns_int", **sizes)


@pytest.fixture
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "dkfac_broken_factory.py").write_text("raise RuntimeError('boom\\nagain')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "dkfac_broken_factory"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_dkfac:f", "no module named 'no_such_module_dkfac'"),
        (f"{__name__}:missing", f"module {__name__} has no 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "NOT_CALLABLE is an int, not a callable"),
        ("pkg.mod:", "a model factory is written package.module:function"),
        ("BROKEN:f", "importing dkfac_broken_factory failed: RuntimeError: boom again"),
        ("resnet18", "unknown model 'resnet18'; choose from autoencoder, cnn, gpt"),
    ],
)
def test_factory_errors_exit_2_with_one_line(
    spec: str, message: str, broken_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec.replace("BROKEN", broken_module)
    with pytest.raises(SystemExit) as info:
        main(["train", "--model", spec])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err
    assert message in errors[0] and errors[0].startswith("dkfac train: error: argument --model")


def test_factory_returning_no_module_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *_without_model(TINY), "--model", f"{__name__}:returns_int"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dkfac train: error: model factory {__name__}:returns_int returned int, "
        "not a torch.nn.Module\n"
    )


@pytest.mark.parametrize(
    ("factory", "optimizer", "message"),
    [
        ("torch.nn:Identity", "sgd", "--model torch.nn:Identity: the model has no trainable"),
        ("torch.nn:Flatten", "adamw", "--model torch.nn:Flatten: the model has no trainable"),
        (f"{__name__}:takes_nothing", "muon", "--optimizer muon: "),
    ],
)
def test_a_model_its_optimizer_cannot_train_exits_2(
    factory: str, optimizer: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No parameters at all, or no hidden matrix for Muon: each was a traceback from the
    optimizer's constructor (``optimizer got an empty parameter list``)."""
    argv = ["train", *_without_model(TINY), "--model", factory, "--optimizer", optimizer]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt"], "--model gpt reads token ids: use it with --data text"),
        (["--data", "text"], "--data text needs a language model: --model gpt"),
        (["--model", "gpt", "--data", "text", "--width", "30"], "--width (30) must be a multiple"),
        (
            ["--model", "gpt", "--data", "text", "--heads", "0"],
            "--heads must be in [1, 4096], got 0",
        ),
        (
            ["--model", "gpt", "--data", "text", "--seq-len", "0"],
            "--seq-len must be in [1, 1000000]",
        ),
        (
            ["--model", "gpt", "--data", "text", "--text-bytes", "0"],
            "--text-bytes must be in [1, 1000000000000]",
        ),
        (["--model", "gpt", "--data", "text", "--mixup", "0.2"], "apply to images"),
    ],
)
def test_language_model_flags_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["train", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_four_commands_one_line_each(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^    (\w+) +(\S.*)$", out, re.M)}
    assert list(lines) == ["train", "compare", "bench", "plan"]
    following = out.split("    plan", 1)[1].splitlines()[1]
    assert not following.startswith("      ")  # plan's line did not wrap (nor any before it)


def _option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", ["train", "compare"])
def test_every_flag_shows_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, subs = build_parser()
    parser = subs[command]
    actions = _option_actions(parser)
    formatter = HelpFormatter(command)
    for action in actions:
        text = formatter._get_help_string(action)
        assert "(default:" in text and len(text) > len("(default: x)"), action.dest
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert capsys.readouterr().out.count("(default:") == len(actions)
