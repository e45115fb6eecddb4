"""``orthogonal_layers``: the picked layers take the scaled polar factor of their update.

Oracle: a twin preconditioner without the option on an identical model and batch; after
each step the picked layer's preconditioned gradient is
:func:`~dkfac.solvers.polar.orthogonal_update` of the twin's (float64: the iteration runs
in float64, so the match is to rounding), and every other layer's equals the twin's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import build_parser, parse_args
from dkfac.app.runconfig import config_file_tokens, kfac_config_from_args, resolved_config
from dkfac.solvers.polar import orthogonal_update
from tests.oracles import weight_grad_matrix
from tests.strategy_cases import global_batch, make_model

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "factor_decay": 0.9,
    "inverse_update_interval": 2,
    "basis_refresh": "power",
}


@pytest.mark.parametrize(
    ("patterns", "picked", "steps"),
    [(("^3$",), {"3"}, 5), (("Conv2d", "^6"), {"0", "6"}, 5), (("^3$",), {"3"}, 3)],
)
def test_picked_layers_take_the_polar_factor_of_the_plain_update(
    patterns: tuple[str, ...], picked: set[str], steps: int
) -> None:
    model, twin = make_model(), make_model()
    pre = KFACPreconditioner(
        model, orthogonal_layers=patterns, orthogonal_rms=0.4, orthogonal_steps=steps, **OPTIONS
    )
    plain = KFACPreconditioner(twin, **OPTIONS)
    labels = {row["name"]: row["method"] for row in pre.describe()}
    assert {n for n, label in labels.items() if "orthogonal, rms 0.4" in (label or "")} == picked
    for step in range(3):
        x, y = global_batch(step, 1)
        for m, p in ((model, pre), (twin, plain)):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            p.step()
        for name, layer in pre.layers.items():
            got = weight_grad_matrix(layer.block.module)
            want = weight_grad_matrix(plain.layers[name].block.module)
            if name in picked:
                want = orthogonal_update(want, 0.4, steps)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"{name} {step}")
        with torch.no_grad():  # both models take the same (picked) step
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                a -= 0.1 * a.grad
                b.copy_(a)


def test_a_split_reaches_the_picked_layers_only() -> None:
    """``orthogonal_split`` is an option of the picked layers' solvers; the others keep the
    plain method (their update equals a twin's without the option)."""
    model, twin = make_model(), make_model()
    pre = KFACPreconditioner(
        model, orthogonal_layers=("^3$",), orthogonal_rms=0.4, orthogonal_split=0.5, **OPTIONS
    )
    plain = KFACPreconditioner(twin, orthogonal_layers=("^3$",), orthogonal_rms=0.4, **OPTIONS)
    labels = {row["name"]: row["method"] for row in pre.describe()}
    assert labels["3"] == "eigen_adam (orthogonal, rms 0.4, split 0.5)"
    assert {pre.layers[n].solver.options.orthogonal_split for n in ("0", "6")} == {0.0}
    x, y = global_batch(0, 1)
    for m, p in ((model, pre), (twin, plain)):
        F.cross_entropy(m(x), y).backward()
        p.step()
    for name in pre.layers:
        got = weight_grad_matrix(pre.layers[name].block.module)
        want = weight_grad_matrix(plain.layers[name].block.module)
        assert torch.equal(got, want) == (name != "3"), name
    assert weight_grad_matrix(pre.layers["3"].block.module).square().mean().sqrt().item() == (
        pytest.approx(0.4, rel=1e-9)
    )


def test_a_pattern_that_matches_no_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'\^blocks' matches none of .*\['0', '3', '6'\]"):
        KFACPreconditioner(make_model(), orthogonal_layers=("^3$", "^blocks"), **OPTIONS)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"method": "eigen", "orthogonal_layers": ("^3$",)}, ValueError, "needs method"),
        ({"method": "eigen_adam", "orthogonal_layers": ("(",)}, ValueError, "not a regular"),
        ({"method": "eigen_adam", "orthogonal_layers": (3,)}, TypeError, "regex strings"),
        ({"method": "eigen_adam", "orthogonal_rms": 0.0}, ValueError, "orthogonal_rms"),
        ({"method": "eigen_adam", "orthogonal_rms": "1"}, TypeError, "orthogonal_rms"),
        ({"method": "eigen_adam", "orthogonal_rms": [1.0]}, TypeError, "orthogonal_rms"),
        (
            {
                "method": "eigen_adam",
                "orthogonal_layers": ("^3$",),
                "orthogonal_rms_power": 0.5,
                "orthogonal_split": 0.5,
            },
            ValueError,
            "drop one of them",
        ),
        ({"method": "eigen_adam", "orthogonal_rms_power": -0.5}, ValueError, "rms_power"),
        ({"method": "eigen_adam", "orthogonal_rms_power": 0.5}, ValueError, "power sets .* no"),
        ({"method": "eigen_adam", "orthogonal_steps": 0}, ValueError, "orthogonal_steps"),
        ({"method": "eigen_adam", "orthogonal_steps": 2.5}, ValueError, "orthogonal_steps"),
        ({"method": "eigen_adam", "orthogonal_split": 1.5}, ValueError, "orthogonal_split"),
        ({"method": "eigen_adam", "orthogonal_split": "0.5"}, TypeError, "orthogonal_split"),
        ({"method": "eigen_adam", "orthogonal_split": 0.5}, ValueError, "split sets .* names no"),
        ({"method": "eigen_adam", "orthogonal_rms": 2.0}, ValueError, "rms sets .* names no"),
        (
            {"method": "eigen", "moment_carry": "reset", "gradient_rotation_dtype": torch.float32},
            ValueError,
            "gradient_rotation_dtype needs method",
        ),
        (
            {"method": "eigen_adam", "orthogonal_rms": 2.0, "orthogonal_steps": 3},
            ValueError,
            "orthogonal_rms and orthogonal_steps set the update",
        ),
    ],
)
def test_config_refuses_bad_values(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KFACConfig(**options)


def test_the_length_power_is_a_choice_of_the_config_and_the_flag() -> None:
    pre = KFACPreconditioner(make_model(), **{**OPTIONS, "orthogonal_layers": ("^3$",)})
    assert pre.config.orthogonal_rms_power == 0.0
    assert pre.layers["3"].solver.label.endswith("(orthogonal, rms 1.5)")
    following = KFACPreconditioner(
        make_model(), **{**OPTIONS, "orthogonal_layers": ("^3$",), "orthogonal_rms_power": 0.5}
    )
    assert following.layers["3"].solver.label.endswith("(orthogonal, rms 1.5 ^ 0.5 x own ^ 0.5)")
    assert following.layers["6"].solver.options.orthogonal_rms_power == 0.0  # not picked
    flags = ["train", "--method", "eigen_adam", "--orthogonal-layers", "^3$"]
    config = kfac_config_from_args(parse_args([*flags, "--orthogonal-rms-power", "0.5"]))
    assert config.orthogonal_rms_power == 0.5
    assert kfac_config_from_args(parse_args([*flags, "--orthogonal-rms", "2"])).orthogonal_rms == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--orthogonal-rms", "adam"], "invalid float value: 'adam'"),
        (["--orthogonal-rms-power", "half"], "invalid float value: 'half'"),
    ],
)
def test_a_bad_length_flag_is_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["train", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_config_takes_one_string_as_one_pattern() -> None:
    config = KFACConfig(method="ekfac", orthogonal_layers="^3$")  # type: ignore[arg-type]
    assert config.orthogonal_layers == ("^3$",)
    assert KFACConfig().orthogonal_layers == ()


def test_the_command_line_flags_and_the_resolved_config_round_trip() -> None:
    flags = ["train", "--method", "eigen_adam", "--orthogonal-layers", "^blocks\\.", "mlp"]
    more = ["--orthogonal-steps", "3", "--moment-carry", "reset"]
    more += ["--gradient-rotation-dtype", "bfloat16", "--basis-refresh", "power"]
    more += ["--power-rank", "256", "--orthogonal-split", "0.5"]
    args = parse_args([*flags, "--orthogonal-rms", "0.5", *more])
    config = kfac_config_from_args(args)
    assert config.orthogonal_layers == ("^blocks\\.", "mlp") and config.orthogonal_rms == 0.5
    assert config.orthogonal_steps == 3 and config.gradient_rotation_dtype == torch.bfloat16
    assert config.power_rank == 256 and config.orthogonal_split == 0.5
    _, subs = build_parser()
    tokens = config_file_tokens(resolved_config(args), subs["train"], "config.toml")
    assert kfac_config_from_args(parse_args(["train", *tokens])) == config


def test_a_bad_flag_value_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kfac_config_from_args(
            parse_args(["train", "--method", "eigen", "--orthogonal-layers", "x"])
        )
    assert exit_info.value.code == 2
    assert "orthogonal_layers needs method" in capsys.readouterr().err.strip().splitlines()[-1]
