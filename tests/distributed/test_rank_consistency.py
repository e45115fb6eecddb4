"""Every rank must hold bitwise-identical parameters (2 gloo ranks, float32, DDP).

Model copies that differ in the last bit drift apart over a long run. Under ``replicated``
and ``kaisa`` every grad worker applies a solver state that the owner computed and
broadcast; the owner's eigenvectors came out of ``eigh`` column-major while the receivers'
buffers are row-major, and the two layouts ran different matmul kernels (a 3e-8 gap after
8 steps) until solver states were made contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from dkfac.app.models import build_model
from tests.distributed_utils import run_distributed

STRATEGIES = ("replicated", "kaisa", "mem-opt", "dp")


def _train(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = KFACPreconditioner(ddp, strategy=strategy, kl_clip=0.01, damping=0.03)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x = torch.randn(16 * world, 1, 8, 8, generator=gen)
            y = torch.randint(0, 10, (16 * world,), generator=gen)
            part = slice(rank * 16, (rank + 1) * 16)
            opt.zero_grad()
            F.cross_entropy(ddp(x[part]), y[part]).backward()
            pre.step(lr=0.05)
            opt.step()
        out[strategy] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_ranks_hold_bitwise_identical_parameters() -> None:
    results = run_distributed(_train, 2, timeout=120)
    for strategy in STRATEGIES:
        for name, value in results[0][strategy].items():
            assert torch.equal(value, results[1][strategy][name]), f"{strategy}: {name} differs"
