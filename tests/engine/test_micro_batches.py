"""The backward passes a step accumulates, counted by the parameters' hooks."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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


def test_reentrant_checkpointed_segments_of_one_backward_are_one_pass() -> None:
    """Each reentrant segment runs a backward of its own inside the outer one: a layer in
    two segments, whose forward hook notes where its recomputation ran, counts one pass
    per outer backward; without the note it would count one per segment."""
    layer = nn.Linear(3, 3)
    counter = BackwardCounter()
    counter.watch(layer.parameters(), every=True)
    layer.register_forward_hook(lambda module, *_: counter.note_forward(module.parameters()))
    x = torch.randn(2, 3, requires_grad=True)
    for passes in (1, 2):
        h = checkpoint(layer, x, use_reentrant=True)
        checkpoint(layer, h, use_reentrant=True).sum().backward()
        assert counter.passes == passes


def test_a_weight_used_in_reentrant_segments_outside_its_module_counts_one_pass() -> None:
    """A segment's inner backward runs inside the outer one, also where the weight's own
    module does not run in the segment (a tied head, ``F.linear(h, emb.weight)``), and
    where the outer backward reaches the weight only after the segments (the last op is a
    segment: its inner backward is the first to run)."""
    layer = nn.Linear(3, 3)
    counter = BackwardCounter()
    counter.watch(layer.parameters(), every=True)
    layer.register_forward_pre_hook(lambda module, _: counter.note_forward(module.parameters()))
    for passes in (1, 2):
        h = checkpoint(
            lambda t: nn.functional.linear(t, layer.weight),
            layer(torch.randn(2, 3)),
            use_reentrant=True,
        )
        checkpoint(
            lambda t: nn.functional.linear(t, layer.weight), h, use_reentrant=True
        ).sum().backward()
        assert counter.passes == passes
