"""``orthogonal_input_rms``: an orthogonalised update divided by its input row's RMS entry.

Oracle: a twin preconditioner with the same ``orthogonal_layers`` but without the option, on
an identical model and the same micro-batches: after each step a picked layer's
preconditioned gradient is the twin's divided by ``s = √((ms(x)·(d − b) + b) / d)``, computed
here from the inputs the layer was fed (recorded by a forward pre-hook: ``ms`` the mean
square of their entries, averaged over the step's micro-batches; ``d`` the input factor's
width, ``b = 1`` with a bias), and every other layer's equals the twin's. The ranks' average
is the FSDP2 / HSDP / DDP tests' (``tests/distributed/test_fsdp.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACConfig, KFACPreconditioner
from dkfac.app.cli import parse_args
from dkfac.app.runconfig import kfac_config_from_args
from tests.oracles import weight_grad_matrix

OPTIONS: dict[str, Any] = {
    "method": "eigen_adam",
    "kl_clip": None,
    "factor_decay": 0.9,
    "inverse_update_interval": 2,
    "orthogonal_rms": 0.4,
    "accumulation_steps": 2,
}


def _model() -> nn.Module:
    """A convolution (bias), a linear layer without a bias and two with one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(48, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


def _expected_scale(inputs: list[Tensor], width: int, bias: bool) -> float:
    square = sum(float(x.square().mean()) for x in inputs) / len(inputs)
    return ((square * (width - bias) + bias) / width) ** -0.5


@pytest.mark.parametrize("patterns", [("Conv2d", "^3$", "^5$"), ("^5$",)])
def test_a_picked_layer_is_divided_by_its_input_rows_rms(patterns: tuple[str, ...]) -> None:
    model, twin = _model(), _model()
    pre = KFACPreconditioner(
        model, orthogonal_layers=patterns, orthogonal_input_rms=True, **OPTIONS
    )
    plain = KFACPreconditioner(twin, orthogonal_layers=patterns, **OPTIONS)
    picked = {name for name, layer in pre.layers.items() if layer.input_rms}
    assert picked == {"0", "3", "5"} if len(patterns) == 3 else picked == {"5"}
    labels = {row["name"]: row["method"] for row in pre.describe()}
    assert all(labels[name].endswith("/ input rms)") for name in picked)
    fed: dict[str, list[Tensor]] = {name: [] for name in pre.layers}
    for name, module in model.named_children():
        if name in fed:
            module.register_forward_pre_hook(
                lambda _, args, name=name: fed[name].append(args[0].detach().clone())
            )
    for step in range(4):
        for inputs in fed.values():
            inputs.clear()
        for m, p in ((model, pre), (twin, plain)):
            m.zero_grad()
            for micro in range(2):
                x = torch.randn(
                    6,
                    2,
                    4,
                    4,
                    generator=torch.Generator().manual_seed(10 * step + micro),
                    dtype=torch.float64,
                ) * (1 + step)
                y = torch.arange(6) % 3
                (F.cross_entropy(m(x), y) / 2).backward()
            p.step()
        for name, layer in pre.layers.items():
            got = weight_grad_matrix(layer.block.module)
            want = weight_grad_matrix(plain.layers[name].block.module)
            if name in picked:
                width = layer.block.statistic_shapes()["A"][0]
                want = want * _expected_scale(fed[name], width, layer.block.has_bias)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"{name} {step}")
        with torch.no_grad():  # both models take the same step
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                a -= 0.1 * a.grad
                b.copy_(a)


def test_an_input_of_zeros_leaves_the_update_as_it_is() -> None:
    """A bias-free layer fed only zeros has ``s = 0``: its update is left unscaled (and
    is zero anyway: no gradient reaches its weight), never NaN."""
    model = nn.Sequential(nn.Linear(4, 5, bias=False), nn.Tanh(), nn.Linear(5, 5), nn.Linear(5, 2))
    model = model.double()
    pre = KFACPreconditioner(
        model,
        orthogonal_layers=("^0$",),
        orthogonal_input_rms=True,
        **{**OPTIONS, "accumulation_steps": 1},
    )
    F.cross_entropy(
        model(torch.zeros(3, 4, dtype=torch.float64)), torch.tensor([0, 1, 0])
    ).backward()
    pre.step()
    assert torch.isfinite(model[0].weight.grad).all()
    assert not model[0].weight.grad.any()


def test_the_option_is_a_choice_of_the_config_and_the_flag() -> None:
    assert KFACConfig().orthogonal_input_rms is False
    flags = ["train", "--method", "eigen_adam", "--orthogonal-layers", "^3$"]
    config = kfac_config_from_args(parse_args([*flags, "--orthogonal-input-rms"]))
    assert config.orthogonal_input_rms is True
    assert kfac_config_from_args(parse_args(flags)).orthogonal_input_rms is False


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"orthogonal_input_rms": 1}, TypeError, "orthogonal_input_rms must be a bool"),
        (
            {"method": "eigen_adam", "orthogonal_input_rms": True},
            ValueError,
            "orthogonal_input_rms sets the update of orthogonal_layers, which names no layer",
        ),
    ],
)
def test_config_refuses_bad_values(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KFACConfig(**options)
