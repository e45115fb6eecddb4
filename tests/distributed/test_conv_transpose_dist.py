"""Transposed convolutions (2-D and 1-D, biased) on 2 gloo ranks equal one process on the
global batch: with DDP, with DDP and micro-batches, with gradients averaged by hand, under
``spngd`` (which reduces the gradients itself), with the default's ``eigen_adam`` method,
and sharded by FSDP2 (their weights cut on dim 0, the input channels) with the gradients
gathered or exchanged with their owners (``mem-opt``)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import matches_serial, once_per_key, params_of_cases, train_case

ROWS, STEPS = 8, 4  # the global batch, cut into the ranks' shards
CASES: dict[str, dict[str, Any]] = {
    "ddp": {"ddp": True},
    "ddp-micro2": {"ddp": True, "micro": 2},
    "bare": {},
    "spngd": {"strategy": "spngd"},
    "ddp-adam": {"ddp": True, "method": "eigen_adam"},
    "fsdp": {"fsdp": True},
    "fsdp-mem-opt": {"fsdp": True, "strategy": "mem-opt"},
}
OPTIONS: dict[str, Any] = {"method": "eigen", "damping": 1e-3, "inverse_update_interval": 2}
TOL = {"rtol": 1e-9, "atol": 1e-11}


def make_decoder() -> nn.Module:
    """A biased ConvTranspose2d (stride, padding, output padding) into a ConvTranspose1d
    (stride, dilation) and a Linear head over 3 classes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
        nn.Tanh(),
        nn.Flatten(2),  # (B, 3, 36)
        nn.ConvTranspose1d(3, 2, 3, stride=2, dilation=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(2 * 75, 3),
    ).double()


def decoder_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and class targets."""
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(ROWS, 2, 3, 3, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (ROWS,), generator=gen)


_train = functools.partial(
    train_case, model_fn=make_decoder, batch_fn=decoder_batch, steps=STEPS, options=OPTIONS
)


_spawned = once_per_key(
    lambda world: run_distributed(params_of_cases, world, _train, CASES, timeout=240)
)


@pytest.mark.parametrize("key", list(CASES))
def test_transposed_convolutions_equal_serial(key: str) -> None:
    serial = matches_serial(_spawned(2), key, _train, CASES, make_decoder, **TOL)
    assert set(serial.pre.layers) == {"0", "3", "6"}
