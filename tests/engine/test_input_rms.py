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


def _transposed() -> nn.Module:
    """A transposed convolution (its bias not a column of A) before two linear layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.ConvTranspose2d(2, 3, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(108, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


# layer -> (entries of its input row d, whether the bias's 1 is one of them), by hand
ROWS = {
    "conv": {"0": (2 * 9 + 1, True), "3": (48, False), "5": (9, True)},
    "transposed": {"0": (2, False), "3": (109, True)},
}
MODELS = {"conv": _model, "transposed": _transposed}


def _expected_scale(inputs: list[Tensor], width: int, bias: bool) -> float:
    square = sum(float(x.square().mean()) for x in inputs) / len(inputs)
    return ((square * (width - bias) + bias) / width) ** -0.5


@pytest.mark.parametrize(
    ("model", "patterns"),
    [("conv", ("Conv2d", "^3$", "^5$")), ("conv", ("^5$",)), ("transposed", ("^0$", "^3$"))],
)
def test_a_picked_layer_is_divided_by_its_input_rows_rms(
    model: str, patterns: tuple[str, ...]
) -> None:
    net, twin = MODELS[model](), MODELS[model]()
    pre = KFACPreconditioner(net, orthogonal_layers=patterns, orthogonal_input_rms=True, **OPTIONS)
    plain = KFACPreconditioner(twin, orthogonal_layers=patterns, **OPTIONS)
    picked = {name for name, layer in pre.layers.items() if layer.input_rms}
    assert picked == {p.strip("^$") for p in patterns} - {"Conv2d"} | (
        {"0"} if "Conv2d" in patterns else set()
    )
    labels = {row["name"]: row["method"] for row in pre.describe()}
    assert all(labels[name].endswith("/ input rms)") for name in picked)
    fed: dict[str, list[Tensor]] = {name: [] for name in pre.layers}
    for name, module in net.named_children():
        if name in fed:
            module.register_forward_pre_hook(
                lambda _, args, name=name: fed[name].append(args[0].detach().clone())
            )
    for step in range(4):
        for inputs in fed.values():
            inputs.clear()
        for m, p in ((net, pre), (twin, plain)):
            m.zero_grad()
            for micro in range(2):
                generator = torch.Generator().manual_seed(10 * step + micro)
                x = torch.randn(6, 2, 4, 4, generator=generator, dtype=torch.float64) * (1 + step)
                (F.cross_entropy(m(x), torch.arange(6) % 3) / 2).backward()
            p.step()
        for name, layer in pre.layers.items():
            got = layer.block.weight_grad()
            want = plain.layers[name].block.weight_grad()
            if name in picked:
                want = want * _expected_scale(fed[name], *ROWS[model][name])
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"{name} {step}")
        with torch.no_grad():  # both models take the same step
            for a, b in zip(net.parameters(), twin.parameters(), strict=True):
                a -= 0.1 * a.grad
                b.copy_(a)


def test_an_embedding_is_refused_with_the_option() -> None:
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 4))
    with pytest.raises(ValueError, match="'0' \\(EmbeddingBlock\\) reads no input entries"):
        KFACPreconditioner(
            model, orthogonal_layers=("^0$", "^1$"), orthogonal_input_rms=True, **OPTIONS
        )


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


def test_a_loaded_checkpoint_drops_the_unfinished_steps_inputs() -> None:
    model = _model()
    pre = KFACPreconditioner(
        model, orthogonal_layers=("^5$",), orthogonal_input_rms=True, **OPTIONS
    )
    state = pre.state_dict()
    model(torch.randn(4, 2, 4, 4, dtype=torch.float64))  # a forward whose step never comes
    assert pre.layers["5"].input_forwards == 1
    pre.load_state_dict(state)
    assert pre.layers["5"].input_square is None and pre.layers["5"].input_forwards == 0


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
