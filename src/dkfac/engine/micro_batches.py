"""Backward passes counted between two steps: the micro-batches a step accumulates.

A training loop that accumulates gradients over ``k`` micro-batches divides each
micro-batch's mean loss by ``k`` (HF's ``Trainer``, Lightning's ``accumulate_grad_batches``,
accelerate, a DDP ``no_sync()`` loop), so each micro-batch's output gradients are ``1 / k``
of the per-sample scale and the output-gradient factors ``1 / k²`` of it. The count comes
from the parameters' post-accumulate-grad hooks, which fire once per backward pass through
a parameter (however often its module ran in the forward, and not for
``torch.autograd.grad``: the Monte-Carlo Fisher's sampled backward is no micro-batch), so
the user never states it. A pass is a backward's graph task: a reentrant checkpoint
(``use_reentrant=True``) runs an inner backward, a task of its own, for each segment it
recomputes, so a parameter whose module's forward last ran inside a backward (the
recomputation) counts for the task that forward ran in, the outer backward (a block shared
by several segments is then one pass, not one per segment).

Under FSDP2 the registered parameters are the sharded DTensors, which no backward runs
through: a layer's forward runs with its unsharded parameters, and FSDP2 reduce-scatters
their gradients into the sharded ones (firing the sharded parameters' hooks) only on a
micro-batch that synchronises; with ``set_requires_gradient_sync(False)`` on the others
that is once a step. So the tensors a layer's forward runs with (read in a forward
pre-hook: FSDP2's own, which unshards, runs first) are hooked too, as they are met
(:meth:`BackwardCounter.note_forward`), and count each backward through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from dkfac.engine.model_hooks import ModelHook

__all__ = ["BackwardCounter"]


class BackwardCounter:
    """Counts the backward passes through the registered parameters since :meth:`reset`.

    Hooks go on the parameters that require a gradient; :meth:`watch` is called again at
    every step so that a parameter unfrozen later is counted too (:attr:`waiting` says
    whether one is left to watch for). :meth:`note_forward` hooks the parameters a forward
    ran with, where they are other tensors (FSDP2's unsharded parameters: module notes).
    """

    def __init__(self) -> None:
        self._passes: dict[int, set[int]] = {}
        # id(param) -> the graph task its module's last forward ran inside (a recomputation
        # during a backward); absent where that forward ran outside any backward.
        self._recomputed_in: dict[int, int] = {}
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
        """Notes the graph task the forward through ``params`` ran inside, if any (a
        checkpointed segment recomputed during a backward), and hooks those of ``params``
        that are new (FSDP2's unsharded parameters); see the module notes."""
        params = list(params)
        for param in params:
            if id(param) not in self._hooked and param.requires_grad and param.is_leaf:
                self._hook(param)
        task = torch._C._current_graph_task_id()
        if task < 0:
            if self._recomputed_in:
                for param in params:
                    self._recomputed_in.pop(id(param), None)
            return
        for param in params:
            self._recomputed_in[id(param)] = task

    def _count(self, key: int) -> None:
        task = self._recomputed_in.get(key, torch._C._current_graph_task_id())
        self._passes.setdefault(key, set()).add(task)

    @property
    def seen(self) -> bool:
        """Whether a backward pass reached a watched parameter since the last reset."""
        return bool(self._passes)

    @property
    def passes(self) -> int:
        """Backward passes since the last reset (the most through any parameter), at least 1."""
        return max(map(len, self._passes.values()), default=1)

    def reset(self) -> None:
        """Starts the count of the next step."""
        self._passes.clear()

    def remove(self) -> None:
        """Detaches the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._recomputed_in.clear()
