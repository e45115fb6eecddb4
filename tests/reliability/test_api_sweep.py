"""Hostile arguments to the Python API (``KFACPreconditioner``, ``KFACOptimizer.for_model``)
and to ``dkfac train --config``: each is refused where it enters, with the argument's name
and what is allowed, or trains finitely where it is a legitimate value.

The refused ones ended in an ``OverflowError`` that named nothing (an int past float's
range), in a step that never ended (``orthogonal_steps=2**62``), in an error from inside
torch or the cost model at the first step, or in a config file's value read as another
type (``skip_layers = 3`` as the pattern ``"3"``, ``damping = "0.1"`` as a number).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner

HUGE = 10**400
"""An int past float's range."""
STEPS = "orthogonal_steps must be an integer in [1, 100]"
ORTHOGONAL = {"method": "eigen_adam", "kl_clip": None, "orthogonal_layers": ("0",)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _train(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """Three steps; the weights stay finite."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"damping": HUGE}, "damping must be in (0.0, inf), got an integer of 401 digits"),
        ({"kl_clip": HUGE}, "kl_clip must be in (0.0, inf), got an integer of 401 digits"),
        ({"factor_decay": HUGE}, "factor_decay must be in [0.0, 1.0)"),
        ({"refresh_threshold": HUGE}, "refresh_threshold must be in (0.0, inf)"),
        ({"inverse_update_interval": HUGE}, "inverse_update_interval must be in [1, inf)"),
        ({**ORTHOGONAL, "moment_eps": HUGE}, "moment_eps must be in (0.0, inf)"),
        ({"accumulation_steps": HUGE}, "accumulation_steps must be an integer in [1, 2**63 - 1]"),
        ({"factor_batch_size": 2**63}, "factor_batch_size must be None or an integer in [1, 2**63"),
        ({"bucket_bytes": HUGE}, "bucket_bytes must be an integer in [1, 2**63 - 1]"),
        ({**ORTHOGONAL, "orthogonal_steps": 2**62}, STEPS),  # a step that never ended
        ({**ORTHOGONAL, "orthogonal_steps": np.int64(2**40)}, STEPS),
        ({**ORTHOGONAL, "orthogonal_steps": 101}, STEPS),
        ({"overhead": HUGE}, "overhead must be in (0.0, inf), got an integer of 401 digits"),
    ],
)
def test_a_number_past_its_range_is_refused_at_construction(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        KFACPreconditioner(_model(), **options)
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["skip_layers", "orthogonal_layers"])
def test_a_mapping_is_not_a_list_of_patterns(name: str) -> None:
    options = {**ORTHOGONAL, name: {"0": 1}} if name == "orthogonal_layers" else {name: {"0": 1}}
    with pytest.raises(TypeError, match=f"{name} must be a string or a sequence of regex strings"):
        KFACPreconditioner(_model(), **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": HUGE}, "lr must be in (0.0, 3.4028234663852886e+38], got an integer of 401"),
        ({"weight_decay": HUGE}, "weight_decay must be in [0.0, 3.4028234663852886e+38]"),
        ({"orthogonal_steps": 2**62}, STEPS),
        ({"factor_batch_size": HUGE}, "factor_batch_size must be None or an integer in [1, 2**63"),
    ],
)
def test_for_model_refuses_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        KFACOptimizer.for_model(_model(), **options)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "options",
    [
        {"lr": 10**30},  # an int the inner SGD's step could not convert
        {"weight_decay": 2**64},
        {"kl_clip": 1e-300, "method": "eigen"},  # the KL-clip's floor passed float32's range
    ],
)
def test_a_value_in_its_domain_trains_finitely(options: dict[str, Any]) -> None:
    model = _model()
    _train(KFACOptimizer.for_model(model, **options), model)


@pytest.mark.parametrize(
    "options",
    [
        {"lr": np.int64(3)},
        {"lr": torch.tensor(3e-3)},
        {"orthogonal_steps": 100},
        {"orthogonal_steps": np.int64(3)},
        {"bucket_bytes": 2**63 - 1, "accumulation_steps": 2**62},
        {"damping": 10**30, "overhead": 10**30},
    ],
)
def test_the_bounds_keep_what_worked(options: dict[str, Any]) -> None:
    """The edges of the bounds above: numpy scalars, tensors and large ints within range."""
    model = _model()
    _train(KFACOptimizer.for_model(model, **options), model)


@pytest.mark.parametrize("kl_clip", [1e-300, 5e-324])
def test_a_tiny_kl_clip_clips_to_almost_no_step(kl_clip: float) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    pre = KFACPreconditioner(model, kl_clip=kl_clip)
    _train(KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pre), model)
    moved = max((p - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True))
    assert moved < 1e-12  # clipped to ~1 / sqrt(float32's largest number) of the step


@pytest.mark.parametrize(
    "text",
    [
        'skip_layers = "^0$"',
        'skip_layers = ["^0$", "^2$"]',
        "lr = 1",  # an integer where a number is read
        'bn_damping = "none"',  # TOML has no null: an optional flag's None
        'kl_clip = "none"',
        'eigen_dtype = "float64"',
        'method = "eigen_adam"\nkl_clip = "none"\nbasis_block_size = "widths"',
        'method = "eigen_adam"\nkl_clip = "none"\nbasis_block_size = 4',
        "pack_triangles = false",
        "milestones = 1",
    ],
)
def test_a_config_file_value_of_its_type_is_read(text: str, tmp_path: Path) -> None:
    from dkfac.app.cli import parse_args

    config = tmp_path / "good.toml"
    config.write_text(text + "\n")
    parse_args(["train", "--optimizer", "kfac", "--config", str(config)])
