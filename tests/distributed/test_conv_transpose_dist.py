"""Transposed convolutions (2-D and 1-D, biased) on 2 gloo ranks equal one process on the
global batch: with DDP, with DDP and micro-batches, with gradients averaged by hand, under
``spngd`` (which reduces the gradients itself), with the default's ``eigen_adam`` method,
and sharded by FSDP2 (their weights cut on dim 0, the input channels) with the gradients
gathered or exchanged with their owners (``mem-opt``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match, once_per_key, train_sharded

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


def _shard(model: nn.Module) -> None:
    """``fully_shard`` on every layer with parameters, then on the root."""
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)


def _train(rank: int | None, world: int, case: dict[str, Any]) -> Any:
    options = {**OPTIONS, **case}
    shard = _shard if options.pop("fsdp", False) and rank is not None else None
    return train_sharded(
        rank,
        world,
        model_fn=make_decoder,
        batch_fn=decoder_batch,
        steps=STEPS,
        shard=shard,
        **options,
    )


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {key: _train(rank, world, case).params() for key, case in CASES.items()}


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=240))


@pytest.mark.parametrize("key", list(CASES))
def test_transposed_convolutions_equal_serial(key: str) -> None:
    results = _spawned(2)
    serial = _train(None, 2, {k: v for k, v in CASES[key].items() if k not in ("ddp", "fsdp")})
    assert set(serial.pre.layers) == {"0", "3", "6"}
    start = list(make_decoder().parameters())
    assert all(not torch.equal(p, q) for p, q in zip(serial.params(), start, strict=True))
    assert_ranks_match([r[key] for r in results], serial.params(), label=key, **TOL)
