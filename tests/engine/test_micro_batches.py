"""The backward passes a step accumulates, counted by the parameters' hooks."""

from __future__ import annotations

import torch
from torch import nn

from dkfac.engine.micro_batches import BackwardCounter


def test_a_parameter_unfrozen_later_is_counted_once_watched_again() -> None:
    frozen, trained = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    frozen.requires_grad_(False)
    counter = BackwardCounter()
    counter.watch([frozen, trained], every=True)
    assert counter.waiting  # a frozen parameter is left to look at again
    for _ in range(2):
        (trained * 2).sum().backward()
    assert counter.passes == 2
    counter.reset()
    frozen.requires_grad_(True)
    counter.watch([trained])  # a part: waiting stays as it was
    assert counter.waiting
    counter.watch([frozen, trained], every=True)
    assert not counter.waiting
    for _ in range(3):
        (frozen * 2).sum().backward()
    assert counter.passes == 3
    counter.remove()
    counter.reset()
    (frozen * 2).sum().backward()
    assert counter.passes == 1  # no hooks: at least 1
