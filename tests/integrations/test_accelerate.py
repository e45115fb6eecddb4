"""accelerate's own gradient accumulation (``accumulate`` and ``backward``, a prepared
optimizer that steps on the last micro-batch only) with ``KFACOptimizer``, against the
hand-written loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference

accelerate = pytest.importorskip("accelerate")

ACCUMULATE = 2


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def test_accumulate_equals_the_hand_loop() -> None:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = _net()
    opt = KFACOptimizer.for_model(net, method="eigen", inverse_update_interval=1)
    model, prepared, loader = accelerator.prepare(net, opt, _loader())
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            prepared.step()
            prepared.zero_grad()
    assert opt.preconditioner.steps == 2

    hand = _net()
    hand_opt = KFACOptimizer.for_model(hand, method="eigen", inverse_update_interval=1)
    for index, (x, y) in enumerate(_loader()):
        (F.cross_entropy(hand(x), y) / ACCUMULATE).backward()
        if (index + 1) % ACCUMULATE == 0:
            hand_opt.step()
            hand_opt.zero_grad()
    assert max_difference(net, hand) == 0.0
