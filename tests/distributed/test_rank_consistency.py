"""Every rank must hold bitwise-identical parameters (2 gloo ranks, float32, DDP).

Model copies that differ in the last bit drift apart over a long run. Under ``replicated``
and ``kaisa`` every grad worker applies a solver state that the owner computed and
broadcast; the owner's eigenvectors came out of ``eigh`` column-major while the receivers'
buffers are row-major, and the two layouts ran different matmul kernels (a 3e-8 gap after
8 steps) until solver states were made contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from dkfac.app.models import build_model
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import Batch, assert_ranks_match, train_sharded

STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp")
PER_RANK = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", in_channels=1, image_size=8, num_classes=10)


def _batches(world: int) -> Callable[[int], Batch]:
    """Global batches drawn one after the other from one generator (seed 1)."""
    gen = torch.Generator().manual_seed(1)

    def batch(step: int) -> Batch:
        x = torch.randn(PER_RANK * world, 1, 8, 8, generator=gen)
        return x, torch.randint(0, 10, (PER_RANK * world,), generator=gen)

    return batch


def _train(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    out = {}
    for strategy in STRATEGIES:
        run = train_sharded(
            rank,
            world,
            model_fn=_model,
            batch_fn=_batches(world),
            steps=6,
            ddp=True,
            lr=0.05,
            strategy=strategy,
            kl_clip=0.01,
            damping=0.03,
        )
        out[strategy] = run.params()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, list[torch.Tensor]]]:
    """Every strategy in one spawn of 2 ranks."""
    return run_distributed(_train, 2, timeout=120)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_hold_bitwise_identical_parameters(
    strategy: str, two_ranks: list[dict[str, list[torch.Tensor]]]
) -> None:
    params = [result[strategy] for result in two_ranks]
    assert_ranks_match(params, params[0], label=f"{strategy}: ranks differ", rtol=0, atol=0)
