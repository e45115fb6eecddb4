"""The states of a batch of same-shape layers, stacked once and kept between refreshes.

A solver that preconditions the layers of one shape in one batched pass
(:meth:`~dkfac.solvers.base.Solver.apply_batch`) needs their states stacked key by key.
States are replaced at a refresh, never changed in place, so a stack stays valid while the
layers hand the very same tensors: :class:`StateStack` keeps the last stack and checks
that by identity (no tensor work). A new stack becomes the states' storage: each state's
tensors are replaced by its slices of it (the same values), so the old tensors can be freed
and the group's states are held once.

A refresh stacks the other way round: :func:`stacked_calls` runs the decompositions of
one size (of any layers, either side) as one call on their stack.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.solvers.base import SolverState

__all__ = ["ALIGNMENT", "StateStack", "matmul", "same_tensors", "stack_key", "stacked_calls"]

ALIGNMENT = 64
"""Bytes: each slice :func:`stacked_calls` hands out starts on such a boundary, as a tensor
of its own does (PyTorch's CPU allocator aligns to 64 bytes): some CPU kernels round by the
alignment of their operands, so a state that is a slice then multiplies as a lone one."""


def stack_key(state: SolverState, grad: Tensor) -> tuple[Any, ...]:
    """What layers stacked together must share: the gradient's shape, dtype and device and
    every state tensor's name, shape and dtype (a solver's ``batch_key`` adds what its
    batched pass reads of the solver itself)."""
    tensors = tuple((key, tuple(value.shape), value.dtype) for key, value in state.items())
    return (tuple(grad.shape), grad.dtype, grad.device, tensors)


def matmul(left: Tensor, right: Tensor) -> Tensor:
    """``left @ right``; two stacks (3-d) go straight to ``torch.bmm``: the same kernel and
    values, one dispatched operation where ``@`` first expands and views both operands
    (six; a GPU step of small layers is launches and host time)."""
    if left.dim() == 3 and right.dim() == 3:
        return torch.bmm(left, right)
    return left @ right


def same_tensors(given: Sequence[SolverState | None], mine: Sequence[SolverState]) -> bool:
    """Whether ``given`` are, in order, states with ``mine``'s keys holding the very same
    tensor objects (identity, not equal values: a check that costs no tensor work)."""
    return len(given) == len(mine) and all(
        state is not None and state.keys() == own.keys() and all(state[k] is own[k] for k in own)
        for state, own in zip(given, mine, strict=True)
    )


class StateStack:
    """The last stack of states one solver built (module notes)."""

    def __init__(self) -> None:
        self._last: tuple[SolverState, list[SolverState]] | None = None

    def stacked(self, states: Sequence[SolverState]) -> SolverState:
        """The states stacked key by key: the last stack when they hold the very tensors
        they held then, else a new one, which each dict in ``states`` then holds as
        slices (module notes)."""
        last = self._last
        if last is not None and same_tensors(states, last[1]):
            return last[0]
        stacked = {key: torch.stack([s[key] for s in states]) for key in states[0]}
        parts = {key: value.unbind(0) for key, value in stacked.items()}  # one call a key
        for i, state in enumerate(states):
            state.update({key: part[i] for key, part in parts.items()})
        self._last = (stacked, [dict(s) for s in states])  # a snapshot of each
        return stacked


def stacked_calls(
    jobs: Sequence[tuple[Hashable | None, Sequence[Tensor]]],
    run: Callable[..., Sequence[Tensor]],
) -> list[tuple[Tensor, ...]]:
    """Each job's outputs ``run(key, *inputs)``, the jobs of one key (not ``None``) as one
    call on their stacked inputs, whose outputs carry the leading job dimension and are
    unbound (one copy an output into rows that start on :data:`ALIGNMENT` boundaries:
    each slice is then contiguous and aligned, as a lone result is); a job whose key is
    ``None`` or shared by no other job is run on its own inputs. Jobs of one key must have
    inputs of equal shapes, and ``run`` take a stack wherever it takes a key.

    Args:
        jobs: ``(key, inputs)`` per job, in order.
        run: Runs one job, or the stacked jobs of one key.
    """
    results: list[tuple[Tensor, ...] | None] = [None] * len(jobs)
    groups: dict[Hashable, list[int]] = {}
    for i, (key, inputs) in enumerate(jobs):
        if key is None:
            results[i] = tuple(run(None, *inputs))
        else:
            groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        if len(members) == 1:
            results[members[0]] = tuple(run(key, *jobs[members[0]][1]))
            continue
        count = len(jobs[members[0]][1])
        stacks = [torch.stack([jobs[i][1][k] for i in members]) for k in range(count)]
        parts = [_aligned_rows(output) for output in run(key, *stacks)]
        for j, i in enumerate(members):
            results[i] = tuple(part[j] for part in parts)
    return results  # type: ignore[return-value]


def _aligned_rows(output: Tensor) -> tuple[Tensor, ...]:
    """The slices of ``output`` along its first dimension, each contiguous and starting on
    an :data:`ALIGNMENT`-byte boundary (one copy into a buffer whose rows are padded)."""
    count, size = output.shape[0], output[0].numel()
    unit = max(1, ALIGNMENT // output.element_size())
    span = -(-size // unit) * unit
    if span == size or size == 0:
        return output.contiguous().unbind(0)
    # Zero pads: torch.save writes a slice's whole storage, so its bytes are reproducible.
    rows = output.new_zeros(count, span)[:, :size].view(output.shape)
    return rows.copy_(output).unbind(0)
