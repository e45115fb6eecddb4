"""3-D convolutions (a dense strided one and a depthwise one) on 2 gloo ranks equal one
process on the global batch: with DDP, with DDP and micro-batches, with gradients averaged
by hand, with SKFAC's Reduce Sum, under ``spngd`` (which reduces the gradients itself), with
the default's ``eigen_adam`` method, and sharded by FSDP2 (weights cut on dim 0, the output
channels) with the gradients gathered or exchanged with their owners (``mem-opt``)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import matches_serial, once_per_key, params_of_cases, train_case

ROWS, STEPS = 32, 4  # the global batch, cut into the ranks' shards
CASES: dict[str, dict[str, Any]] = {
    "ddp": {"ddp": True},
    "ddp-micro2": {"ddp": True, "micro": 2},
    "bare": {},
    "ddp-sum": {"ddp": True, "conv_reduction": "sum"},
    "spngd": {"strategy": "spngd"},
    "ddp-adam": {"ddp": True, "method": "eigen_adam"},
    "fsdp": {"fsdp": True},
    "fsdp-mem-opt": {"fsdp": True, "strategy": "mem-opt"},
}
OPTIONS: dict[str, Any] = {"method": "eigen", "damping": 1e-3, "inverse_update_interval": 2}
TOL = {"rtol": 1e-9, "atol": 1e-11}


def make_volume_net() -> nn.Module:
    """A biased strided Conv3d, a depthwise Conv3d (unit-wise) and a Linear head over 3
    classes. The dense layer's A (side 25, 256 rows a step) is well conditioned: with an
    ill-conditioned one (side 55 over 64 rows) ``eigen_adam`` turns the ranks' other order
    of summation into differences above the tolerance, as it does for a Conv2d of that
    shape and for one process with two micro-batches."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(2, 4, (2, 2, 3), stride=2, padding=(0, 0, 1)),
        nn.Tanh(),
        nn.Conv3d(4, 4, 3, padding="same", groups=4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2 * 2, 3),
    ).double()


def volume_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: volumes and class targets."""
    gen = torch.Generator().manual_seed(700 + step)
    x = torch.randn(ROWS, 2, 4, 4, 3, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (ROWS,), generator=gen)


_train = functools.partial(
    train_case, model_fn=make_volume_net, batch_fn=volume_batch, steps=STEPS, options=OPTIONS
)


_spawned = once_per_key(
    lambda world: run_distributed(params_of_cases, world, _train, CASES, timeout=240)
)


@pytest.mark.parametrize("key", list(CASES))
def test_3d_convolutions_equal_serial(key: str) -> None:
    serial = matches_serial(_spawned(2), key, _train, CASES, make_volume_net, **TOL)
    blocks = {name: type(layer.block).__name__ for name, layer in serial.pre.layers.items()}
    assert blocks == {"0": "Conv3dBlock", "2": "GroupedConv3dBlock", "5": "LinearBlock"}
