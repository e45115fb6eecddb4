"""Backward passes counted between two steps: the micro-batches a step accumulates.

A training loop that accumulates gradients over ``k`` micro-batches divides each
micro-batch's mean loss by ``k`` (HF's ``Trainer``, Lightning's ``accumulate_grad_batches``,
accelerate, a DDP ``no_sync()`` loop), so each micro-batch's output gradients are ``1 / k``
of the per-sample scale and the output-gradient factors ``1 / k²`` of it. The count comes
from the parameters' post-accumulate-grad hooks, which fire once per backward pass through
a parameter (however often its module ran in the forward, and not for
``torch.autograd.grad``: the Monte-Carlo Fisher's sampled backward is no micro-batch), so
the user never states it. A pass is a backward's graph task, but a reentrant checkpoint
(``use_reentrant=True``) runs an inner backward, a task of its own, for each segment it
recomputes, inside the outer one: every task that ran within another counts as that one
(a block shared by several segments, or a weight used in a segment by another module or
a functional call, ``F.linear(h, emb.weight)``, is then one pass, not one per segment).
Backwards of a step run one after another, so a task ran within another exactly where
both ran at once: the counter sees a task begin running at its first hook (a parameter's,
or a registered layer's forward recomputed inside it) and end through the engine's
callback at the task's end; tasks are numbered in the order they begin, so a task first
seen after one with a higher number was already running when that one began.

Under FSDP2 the registered parameters are the sharded DTensors, which no backward runs
through: a layer's forward runs with its unsharded parameters, and FSDP2 reduce-scatters
their gradients into the sharded ones (firing the sharded parameters' hooks) only on a
micro-batch that synchronises; with ``set_requires_gradient_sync(False)`` on the others
that is once a step. So the tensors a layer's forward runs with (read in a forward
pre-hook: FSDP2's own, which unshards, runs first) are hooked too, as they are met
(:meth:`BackwardCounter.note_forward`), and count each backward through them.

A backward that computes no gradient of a weight (``torch.autograd.grad`` for an input's
gradient, a saliency map or an adversarial example, or ``backward(inputs=...)`` without the
weight) is no micro-batch of that layer either, and its output gradient no sample of the
layer's gradient statistics: :func:`computes_gradient` tells it from one that does, asked
from inside the backward with the weight's gradient accumulator
(:func:`gradient_accumulator`, taken from the tensor the forward ran with). A
``torch.autograd.grad`` that asks for the weight itself (a loop that sets ``.grad`` from
its result) computes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge
from torch.distributed.tensor import DTensor

from dkfac.engine.model_hooks import ModelHook

__all__ = ["BackwardCounter", "computes_gradient", "gradient_accumulator"]


def gradient_accumulator(weight: Tensor) -> Node | None:
    """The autograd node that accumulates into ``weight.grad``.

    Args:
        weight: The tensor a layer's forward ran with.

    Returns:
        Its accumulator where it is a leaf that requires a gradient and no ``DTensor``;
        ``None`` otherwise (nothing to ask :func:`computes_gradient` about: a
        parametrisation's output, a frozen weight, FSDP2's sharded parameter that the
        forward did not run with, a tensor-parallel one).
    """
    if not (weight.is_leaf and weight.requires_grad) or isinstance(weight, DTensor):
        return None
    return get_gradient_edge(weight).node


def computes_gradient(accumulator: Node | None) -> bool:
    """Whether the backward now running computes the gradient of the weight behind
    ``accumulator`` (called from a hook inside the backward).

    Args:
        accumulator: From :func:`gradient_accumulator`.

    Returns:
        False for a ``torch.autograd.grad`` that does not ask for the weight and a
        ``backward(inputs=...)`` that leaves it out; true for any other backward, for a
        ``torch.autograd.grad`` that asks for it (torch refuses to say whether it runs the
        accumulator of a leaf it was asked for: it captures that gradient instead), and for
        ``None``.
    """
    if accumulator is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:  # the leaf autograd.grad asked for (or no answer: as before)
        return True


class BackwardCounter:
    """Counts the backward passes through the registered parameters since :meth:`reset`.

    Hooks go on the parameters that require a gradient; :meth:`watch` is called again at
    every step so that a parameter unfrozen later is counted too (:attr:`waiting` says
    whether one is left to watch for). :meth:`note_forward` hooks the parameters a forward
    ran with, where they are other tensors (FSDP2's unsharded parameters: module notes).
    """

    def __init__(self) -> None:
        self._passes: dict[int, set[int]] = {}
        # graph task -> the outermost task it ran within (itself for a backward of its own)
        self._outer: dict[int, int] = {}
        self._running: set[int] = set()  # the tasks seen whose end has not come yet
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self.waiting = False
        """Whether :meth:`watch` met a parameter that required no gradient (a frozen one,
        which a later :meth:`watch` must look at again)."""

    def watch(self, params: Iterable[Tensor], *, every: bool = False) -> None:
        """Hooks every parameter of ``params`` that requires a gradient and has no hook yet.

        Args:
            params: The parameters.
            every: Whether ``params`` are all the registered parameters (then
                :attr:`waiting` is set anew; else a frozen one only sets it).
        """
        if every:
            self.waiting = False
        for param in params:
            key = id(param)
            if key in self._hooked:
                continue
            if not param.requires_grad:
                self.waiting = True
                continue
            self._hook(param)

    def _hook(self, param: Tensor) -> None:
        key = id(param)
        self._hooked.add(key)
        self._handles.append(
            param.register_post_accumulate_grad_hook(ModelHook(lambda _p: self._count(key)))
        )

    def note_forward(self, params: Iterable[Tensor]) -> None:
        """Hooks those of ``params`` that are new (FSDP2's unsharded parameters) and notes
        the graph task the forward runs inside, if any (a checkpointed segment recomputed
        during a backward: the task its inner backward runs within); see the module notes."""
        for param in params:
            if id(param) not in self._hooked and param.requires_grad and param.is_leaf:
                self._hook(param)
        self._see(torch._C._current_graph_task_id())

    def _count(self, key: int) -> None:
        task = torch._C._current_graph_task_id()
        self._see(task)
        self._passes.setdefault(key, set()).add(task)

    def _see(self, task: int) -> None:
        """Notes that ``task`` is running; joins it with the tasks it ran within or that
        ran within it (see the module notes)."""
        if task < 0 or task in self._outer:
            return
        self._outer[task] = task
        self._running.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._running.discard(task)
        )
        joined = {t for t in self._outer if t in self._running or t > task}
        outers = {self._outer[t] for t in joined}
        outer = min(outers)
        for t, o in self._outer.items():
            if o in outers:
                self._outer[t] = outer

    @property
    def seen(self) -> bool:
        """Whether a backward pass reached a watched parameter since the last reset."""
        return bool(self._passes)

    @property
    def passes(self) -> int:
        """Backward passes since the last reset (the most through any parameter), at least 1."""
        outer = self._outer
        return max((len({outer.get(t, t) for t in ts}) for ts in self._passes.values()), default=1)

    def reset(self) -> None:
        """Starts the count of the next step."""
        self._passes.clear()
        self._outer.clear()
        self._running.clear()

    def remove(self) -> None:
        """Detaches the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._outer.clear()
        self._running.clear()
