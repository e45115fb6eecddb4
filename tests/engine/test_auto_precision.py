"""``"auto"`` for ``capture_dtype``, ``rotation_dtype`` and ``gradient_rotation_dtype``: a run
with it is the run with bf16 where the CPU multiplies bf16 natively and the run with the
defaults where it does not, to the bit; a float64 model keeps its precision."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.app import runconfig
from tests.strategy_cases import make_model

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "moment_carry": "reset",
    "inverse_update_interval": 2,
    "orthogonal_layers": ["^3$"],
}
LOWERED = ("capture_dtype", "rotation_dtype", "gradient_rotation_dtype")


def _run(model: nn.Module, **options: Any) -> tuple[list[torch.Tensor], KFACPreconditioner]:
    pre = KFACPreconditioner(model, **{**OPTIONS, **options})
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), pre)
    dtype = next(model.parameters()).dtype
    for step in range(4):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 2, 4, 4, generator=gen).to(dtype)
        y = torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], pre


@pytest.mark.parametrize("native", [True, False], ids=["bf16-native", "bf16-emulated"])
def test_auto_runs_as_bf16_where_native_and_as_the_defaults_elsewhere(
    native: bool, native_bf16: Callable[[bool], None]
) -> None:
    native_bf16(native)
    auto, pre = _run(make_model().float(), **dict.fromkeys(LOWERED, "auto"))
    low = torch.bfloat16 if native else None
    explicit, _ = _run(make_model().float(), **dict.fromkeys(LOWERED, low))
    for got, want in zip(auto, explicit, strict=True):
        assert torch.equal(got, want)
    for layer in pre.layers.values():
        assert layer.capture_dtype is low
        options = layer.solver.options  # type: ignore[attr-defined]
        assert options.rotation_dtype is low and options.gradient_rotation_dtype is low


@pytest.mark.parametrize("native", [True, False])
def test_the_choice_of_auto_is_logged_once_per_option_and_device(
    native: bool, native_bf16: Callable[[bool], None], caplog: pytest.LogCaptureFixture
) -> None:
    native_bf16(native)
    with caplog.at_level(logging.INFO, logger="dkfac.engine.registration"):
        KFACPreconditioner(make_model().float(), **{**OPTIONS, "capture_dtype": "auto"})
    lines = [r.getMessage() for r in caplog.records if '"auto"' in r.getMessage()]
    chosen = "torch.bfloat16" if native else "the default precision"
    assert len(lines) == 1 and lines[0].startswith(f'capture_dtype="auto" on cpu: {chosen}')


def test_auto_keeps_a_float64_model_in_float64(native_bf16: Callable[[bool], None]) -> None:
    native_bf16(True)
    _, pre = _run(make_model(), **dict.fromkeys(LOWERED, "auto"))
    for layer in pre.layers.values():
        assert layer.capture_dtype is None
        assert layer.solver.options.rotation_dtype is None  # type: ignore[attr-defined]


def test_auto_is_a_config_value_and_a_flag_value() -> None:
    config = KFACConfig(**OPTIONS, **dict.fromkeys(LOWERED, "auto"))
    assert all(getattr(config, name) == "auto" for name in LOWERED)
    parser = argparse.ArgumentParser()
    runconfig.add_kfac_arguments(parser, set())
    args = parser.parse_args(["--capture-dtype", "auto", "--rotation-dtype", "bfloat16"])
    assert args.capture_dtype == "auto" and args.rotation_dtype == torch.bfloat16


@pytest.mark.parametrize("name", LOWERED)
def test_other_strings_are_refused_with_what_is_allowed(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be None, 'auto' or .*got 'fast'"):
        KFACConfig(**{**OPTIONS, name: "fast"})
    parser = argparse.ArgumentParser()
    runconfig.add_kfac_arguments(parser, set())
    with pytest.raises(SystemExit):
        parser.parse_args(["--" + name.replace("_", "-"), "fast"])
