"""The backward passes a step accumulates, counted by the parameters' hooks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac.engine.micro_batches import BackwardCounter, computes_gradient, gradient_accumulator


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


def _answers(
    run: Callable[[Tensor, nn.Linear, Tensor], bool], frozen: bool = False
) -> tuple[list[bool], bool]:
    """What :func:`computes_gradient` says for the weight of a linear layer, asked from its
    output's gradient hook during ``run(loss, layer, x)``, and what ``run`` says: whether
    the weight's gradient was computed (into ``.grad`` or as ``torch.autograd.grad``'s)."""
    layer = nn.Linear(3, 2)
    layer.weight.requires_grad_(not frozen)
    x = torch.randn(4, 3, requires_grad=True)
    out = layer(x)
    node = gradient_accumulator(layer.weight)
    answers: list[bool] = []
    out.register_hook(lambda _g: answers.append(computes_gradient(node)))
    return answers, run(out.square().sum(), layer, x)


def _backward(loss: Tensor, layer: nn.Linear, inputs: list[Tensor] | None) -> bool:
    loss.backward(inputs=inputs)
    return layer.weight.grad is not None


def _grad(loss: Tensor, layer: nn.Linear, inputs: list[Tensor]) -> bool:
    torch.autograd.grad(loss, inputs)
    return any(t is layer.weight for t in inputs)


@pytest.mark.parametrize(
    "run",
    [
        lambda loss, layer, x: _backward(loss, layer, None),
        lambda loss, layer, x: _backward(loss, layer, [layer.weight]),
        lambda loss, layer, x: _backward(loss, layer, [x]),
        lambda loss, layer, x: _backward(loss, layer, [layer.bias]),
        lambda loss, layer, x: _grad(loss, layer, [x]),
        lambda loss, layer, x: _grad(loss, layer, [x, layer.bias]),
        lambda loss, layer, x: _grad(loss, layer, [layer.weight]),
        lambda loss, layer, x: _grad(loss, layer, [x, layer.weight, layer.bias]),
    ],
    ids=[
        "backward",
        "backward-inputs-weight",
        "backward-inputs-input",
        "backward-inputs-bias",
        "grad-input",
        "grad-input-bias",
        "grad-weight",
        "grad-all",
    ],
)
def test_the_answer_is_whether_the_weights_gradient_is_computed(
    run: Callable[[Tensor, nn.Linear, Tensor], bool],
) -> None:
    answers, computed = _answers(run)
    assert answers == [computed]


def test_what_has_no_accumulator_always_counts() -> None:
    """A frozen weight or a non-leaf (a parametrisation's output) has nothing to ask:
    every backward counts, as before the question existed."""
    assert gradient_accumulator(nn.Linear(2, 2).weight.detach()) is None
    assert gradient_accumulator(nn.Linear(2, 2).weight * 2) is None
    assert computes_gradient(None)
    answers, _ = _answers(lambda loss, layer, x: _grad(loss, layer, [x]), frozen=True)
    assert answers == [True]


def test_a_reentrant_checkpoints_inner_backward_computes_the_gradient() -> None:
    layer = nn.Linear(3, 3)
    node = gradient_accumulator(layer.weight)
    answers: list[bool] = []

    def segment(x: Tensor) -> Tensor:
        out = layer(x)
        if torch._C._current_graph_task_id() >= 0:  # the recomputation, inside the backward
            out.register_hook(lambda _g: answers.append(computes_gradient(node)))
        return out

    checkpoint(segment, torch.randn(2, 3, requires_grad=True), use_reentrant=True).sum().backward()
    assert answers == [True]
