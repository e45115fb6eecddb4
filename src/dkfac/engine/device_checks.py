"""The step's finiteness guard kept on the device: masks instead of branches.

On a CPU the guard reads its flags (:func:`~dkfac.engine.step_math.finite_flags`) and
branches: a layer with non-finite statistics skips its running-average update, a layer with
a non-finite gradient is zeroed and left out, and a stateful solver's moments advance only
on a step whose gradients are all finite. Reading a flag on a GPU is a host
synchronisation: the host waits for the backward and the factor products before it can
queue the next kernel, and a small model's step, which is launches, idles the GPU. The same
decisions taken with masks leave the host free to queue the whole step:

* a gradient ``g`` is replaced by ``where(ok, g, 0)`` before any work, so nothing
  downstream sees a NaN; its preconditioned value is multiplied by ``ok`` at the write-back
  (a solver with moments would otherwise step on its old moments);
* a statistic ``F_new`` is replaced by ``where(ok, F_new, F)``, ``F`` the running value, so
  the running average ``F + (1 − decay)(F_new − F)`` keeps ``F`` exactly (a dense statistic
  with a running value; otherwise the step reads its flags, as on a CPU: the first capture
  of each layer, low-rank sides);
* moments are selected with ``where(all ok, new, old)`` inside the solver's batched pass.

The values equal the branching guard's (``tests/engine/test_device_checks.py`` runs both on
a CPU with NaNs injected). The warnings the guard logs are read one step late
(:class:`LateWarnings`): on a CUDA device from a pinned host copy made behind an event,
polled without waiting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dkfac.distributed.strategy_base import Strategy
from dkfac.engine.grad_writes import GradientWrites
from dkfac.engine.launches import device_constant
from dkfac.engine.layer_state import LayerState
from dkfac.engine.step_math import (
    FACTORS_SKIPPED,
    GRADIENT_ZEROED,
    finite_masks,
    read_flags,
)
from dkfac.solvers.stacking import ALIGNMENT

__all__ = [
    "DeviceGuard",
    "GradientBuffer",
    "HeldStatistics",
    "LateWarnings",
    "guard_messages",
    "hold_statistics",
    "select_where",
    "zero_nonfinite",
]

logger = logging.getLogger(__name__)


class DeviceGuard:
    """The finiteness guard of a preconditioner's steps with its flags left on the device
    (module notes): its late warnings and the buffer of the gradients it selects.

    Args:
        names: The registered layers, in order.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.late = LateWarnings()
        self.writes = GradientWrites()
        """The write-back through one buffer (:mod:`~dkfac.engine.grad_writes`)."""
        self._messages = guard_messages(names)
        self._buffer = GradientBuffer()
        self._held = HeldStatistics()

    def gradients(self, layers: Mapping[str, LayerState]) -> dict[str, Tensor | None]:
        """Each layer's gradient matrix, gathered into the guard's buffer
        (:meth:`GradientBuffer.gather`), where :meth:`run` then zeroes failed ones in place."""
        return self._buffer.gather(layers)

    def run(
        self,
        layers: Mapping[str, LayerState],
        strategy: Strategy,
        new: dict[str, dict[str, Tensor]],
        grads: dict[str, Tensor | None],
        step: int,
    ) -> tuple[dict[str, tuple[bool, bool]], Tensor | None]:
        """Logs the warnings of earlier steps that have arrived; then ``new`` holds its
        failed statistics at their running values and ``grads`` have their failed
        gradients zeroed, in place. Returns flags that pass every layer and the gradient
        flags (``keep``). Where a statistic cannot be held (a first capture, a low-rank
        side) the flags are read as on a CPU, and ``keep`` is ``None``. The held statistics
        are views of the guard's buffers (:class:`HeldStatistics`), valid within the step."""
        self.late.poll()
        names = list(layers)
        masks = finite_masks(layers, strategy, new, grads)
        if not hold_statistics(layers, strategy, new, masks, self._held):
            return read_flags(masks, names), None
        self.late.record(step, masks, self._messages)
        grads.update(self._buffer.zero_nonfinite(grads, masks, names))
        return {name: (True, True) for name in names}, masks[1::2]


class GradientBuffer:
    """The layers' gradient matrices in one flat buffer whose views are made once for a
    set of shapes. :meth:`gather` builds the matrices from the parameters' ``.grad`` with
    one multi-tensor copy (:meth:`~dkfac.blocks.base.Block.grad_sources` into
    :meth:`~dkfac.blocks.base.Block.grad_layout`'s views; a block without them by its
    ``weight_grad``), and :meth:`zero_nonfinite` zeroes a failed layer's entries with one
    masked fill (copying other gradients in first): no per-layer views, stacks or
    concatenations a step. The matrices it returns are its views, overwritten at the next
    step: a step reads them only within itself. Gradients of several dtypes or devices take
    the per-layer forms (``weight_grad``, :func:`zero_nonfinite`)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._flat = torch.empty(0)
        self._matrices: dict[str, Tensor] = {}
        self._layout: list[Tensor] = []
        self._flag_index = torch.empty(0, dtype=torch.int64)

    def gather(self, layers: Mapping[str, LayerState]) -> dict[str, Tensor | None]:
        """Each layer's gradient matrix (``None`` without a gradient), as ``weight_grad``."""
        sources: list[list[Tensor]] = []
        entries: list[tuple[str, tuple[int, ...], bool]] = []  # name, shape, by its layout
        for name, layer in layers.items():
            block = layer.block
            parts = block.grad_sources()
            by_layout = parts is not None
            if parts is None:
                matrix = block.weight_grad()
                if matrix is None:
                    continue
                parts, shape = [matrix], tuple(matrix.shape)
            else:
                shape = block.grad_shape()
            sources.append(parts)
            entries.append((name, shape, by_layout))
        flat_sources = [t for parts in sources for t in parts]
        if not flat_sources or len({(t.dtype, t.device) for t in flat_sources}) > 1:
            return {name: layer.block.weight_grad() for name, layer in layers.items()}
        index = {name: i for i, name in enumerate(layers)}
        key = (
            tuple(entries),
            tuple(tuple(t.shape) for t in flat_sources),
            flat_sources[0].dtype,
            flat_sources[0].device,
            tuple(index[name] for name, _, _ in entries),
        )
        if key != self._key:
            shapes = [(name, shape) for name, shape, _ in entries]
            positions = [2 * index[name] + 1 for name, _, _ in entries]
            self._build(key, shapes, positions, flat_sources[0])
            self._layout = [
                view
                for name, _, by_layout in entries
                for view in (
                    layers[name].block.grad_layout(self._matrices[name])
                    if by_layout
                    else [self._matrices[name]]
                )
            ]
        torch._foreach_copy_(self._layout, flat_sources)
        return {name: self._matrices.get(name) for name in layers}

    def zero_nonfinite(
        self, grads: Mapping[str, Tensor | None], masks: Tensor, names: Sequence[str]
    ) -> dict[str, Tensor | None]:
        """Each gradient where its flag (``masks[2i + 1]``) holds, zeros elsewhere: in place
        when ``grads`` are :meth:`gather`'s last matrices, else copied in first."""
        present = [(2 * i + 1, name) for i, name in enumerate(names) if grads[name] is not None]
        tensors: list[Tensor] = [grads[name] for _, name in present]  # type: ignore[misc]
        mine = [self._matrices.get(name) for _, name in present]
        if not (
            len(mine) == len(self._matrices)
            and all(t is m for t, m in zip(tensors, mine, strict=True))
        ):
            if not tensors or len({(t.dtype, t.device) for t in tensors}) > 1:
                return zero_nonfinite(grads, masks, names)
            shapes = [(name, tuple(t.shape)) for (_, name), t in zip(present, tensors, strict=True)]
            where = [p for p, _ in present]
            key = (tuple(shapes), tensors[0].dtype, tensors[0].device, tuple(where))
            if key != self._key:
                self._build(key, shapes, where, tensors[0])
            torch._foreach_copy_([self._matrices[name] for _, name in present], tensors)
        drop = masks.logical_not().index_select(0, self._flag_index)
        self._flat.masked_fill_(drop, 0.0)
        return {**grads, **{name: self._matrices[name] for _, name in present}}

    def _build(
        self,
        key: tuple[object, ...],
        shapes: Sequence[tuple[str, tuple[int, ...]]],
        positions: Sequence[int],
        like: Tensor,
    ) -> None:
        """The buffer, its matrices and the flag of each entry for a new set of shapes."""
        sizes = tuple(math.prod(shape) for _, shape in shapes)
        device = like.device
        self._flat = torch.empty(sum(sizes), dtype=like.dtype, device=device)
        parts = self._flat.split(sizes)
        self._matrices = {
            name: part.view(shape) for (name, shape), part in zip(shapes, parts, strict=True)
        }
        flags = device_constant(tuple(positions), device)
        self._flag_index = flags.repeat_interleave(
            device_constant(sizes, device), output_size=sum(sizes)
        )
        self._layout = []
        self._key = key


def zero_nonfinite(
    grads: Mapping[str, Tensor | None], masks: Tensor, names: Sequence[str]
) -> dict[str, Tensor | None]:
    """Each gradient where its flag (``masks[2i + 1]``) holds, zeros elsewhere."""
    present = [(2 * i + 1, name) for i, name in enumerate(names) if grads[name] is not None]
    chosen = select_where(
        masks,
        [position for position, _ in present],
        [grads[name] for _, name in present],  # type: ignore[misc]
        None,
    )
    return {**grads, **dict(zip((name for _, name in present), chosen, strict=True))}


def hold_statistics(
    layers: Mapping[str, LayerState],
    strategy: Strategy,
    new: dict[str, dict[str, Tensor]],
    masks: Tensor,
    held: HeldStatistics | None = None,
) -> bool:
    """Replaces, in ``new``, each statistic this rank keeps by its running value where its
    layer's flag (``masks[2i]``) fails, so that the running average keeps that value;
    through ``held``'s buffers where given (the values are then its views).

    Returns ``False`` (and changes nothing) when some kept statistic cannot be held so: it
    has no running value yet, or its kind's values change shape (not ``comparable``: a
    low-rank side); the caller then reads the flags.
    """
    index = {name: i for i, name in enumerate(layers)}
    entries = [(name, key) for name in new if strategy.keeps_statistics(name) for key in new[name]]
    for name, key in entries:
        layer = layers[name]
        if key not in layer.running or not layer.kinds[key].comparable:
            return False
    select = select_where if held is None else held.select
    chosen = select(
        masks,
        [2 * index[name] for name, _ in entries],
        [new[name][key] for name, key in entries],
        [layers[name].running[key] for name, key in entries],
    )
    for (name, key), value in zip(entries, chosen, strict=True):
        new[name][key] = value
    return True


def select_where(
    flags: Tensor,
    positions: Sequence[int],
    tensors: Sequence[Tensor],
    others: Sequence[Tensor] | None,
    aligned: bool = False,
) -> list[Tensor]:
    """``where(flags[positions[i]], tensors[i], others[i] or 0)`` for every ``i``, in a few
    launches for any number of tensors: the tensors of one dtype are concatenated, selected
    against the flags repeated to their sizes, and split back (views of one new buffer).

    ``aligned``: each result starts on a :data:`ALIGNMENT`-byte boundary of that buffer
    (its segment padded), as a tensor of its own does: some CPU kernels round by the
    alignment of their operands, so a solver state selected here then multiplies as the
    one a host-checked refresh hands out (:func:`~dkfac.solvers.stacking.stacked_calls`).
    """
    results: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(i)
    for (dtype, device), members in groups.items():
        sizes = tuple(tensors[i].numel() for i in members)
        unit = max(1, ALIGNMENT // tensors[members[0]].element_size()) if aligned else 1
        spans = tuple(-(-size // unit) * unit for size in sizes)
        pad = torch.zeros(unit, dtype=dtype, device=device) if spans != sizes else None
        flat = _joined(tensors, members, spans, pad)
        where = device_constant(tuple(positions[i] for i in members), device)
        wanted = flags.index_select(0, where)
        keep = wanted.repeat_interleave(device_constant(spans, device), output_size=sum(spans))
        if others is None:
            chosen = torch.where(keep, flat, 0.0)
        else:
            chosen = torch.where(keep, flat, _joined(others, members, spans, pad))
        for i, size, part in zip(members, sizes, chosen.split(spans), strict=True):
            results[i] = (part[:size] if size < part.numel() else part).view(tensors[i].shape)
    return results  # type: ignore[return-value]


def _joined(
    values: Sequence[Tensor], members: Sequence[int], spans: Sequence[int], pad: Tensor | None
) -> Tensor:
    """The ``members`` of ``values`` flattened end to end, each padded with zeros of ``pad``
    to its span."""
    pieces = []
    for i, span in zip(members, spans, strict=True):
        pieces.append(values[i].reshape(-1))
        if span > values[i].numel() and pad is not None:
            pieces.append(pad[: span - values[i].numel()])
    return torch.cat(pieces)


@dataclass
class _HeldGroup:
    """The statistics of one dtype and device in :class:`HeldStatistics`' buffers."""

    members: list[int]
    new: list[Tensor]  # views of one buffer, shaped as the statistics
    old: list[Tensor]  # views of another, shaped as the running values
    chosen: list[Tensor]  # views of the result
    flat: tuple[Tensor, Tensor, Tensor]  # the three buffers (new, old, result)
    flag_index: Tensor  # each entry's flag


class HeldStatistics:
    """:func:`select_where` on buffers kept from step to step: the statistics and their
    running values are copied in with one multi-tensor copy each and selected with one
    ``where``, and the results are views of a kept buffer, made once for a set of shapes
    (no per-statistic views, concatenations or splits a step). The results are
    overwritten at the next :meth:`select`: a step reads them only within itself (the
    running averages copy them, :func:`~dkfac.engine.layer_state.update_running_all`).
    Statistics whose running value has another shape, dtype or device take
    :func:`select_where`.
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._groups: list[_HeldGroup] = []

    def select(
        self,
        flags: Tensor,
        positions: Sequence[int],
        tensors: Sequence[Tensor],
        others: Sequence[Tensor] | None,
    ) -> list[Tensor]:
        """:func:`select_where` of the same arguments, the same values."""
        if others is None or any(
            (t.shape, t.dtype, t.device) != (o.shape, o.dtype, o.device)
            for t, o in zip(tensors, others, strict=True)
        ):
            return select_where(flags, positions, tensors, others)
        key = (tuple(positions), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))
        if key != self._key:
            self._build(key, positions, tensors)
        results: list[Tensor | None] = [None] * len(tensors)
        for group in self._groups:
            new, old, chosen = group.flat
            torch._foreach_copy_(group.new, [tensors[i] for i in group.members])
            torch._foreach_copy_(group.old, [others[i] for i in group.members])
            torch.where(flags.index_select(0, group.flag_index), new, old, out=chosen)
            for i, view in zip(group.members, group.chosen, strict=True):
                results[i] = view
        return results  # type: ignore[return-value]

    def _build(
        self,
        key: tuple[object, ...],
        positions: Sequence[int],
        tensors: Sequence[Tensor],
    ) -> None:
        """The buffers and their views for a new set of shapes."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, tensor in enumerate(tensors):
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(i)
        self._groups = []
        for (dtype, device), members in by_kind.items():
            sizes = tuple(tensors[i].numel() for i in members)
            new, old, chosen = (
                torch.empty(sum(sizes), dtype=dtype, device=device) for _ in range(3)
            )
            shapes = [tensors[i].shape for i in members]
            flags = device_constant(tuple(positions[i] for i in members), device)
            index = flags.repeat_interleave(device_constant(sizes, device), output_size=sum(sizes))
            self._groups.append(
                _HeldGroup(
                    members,
                    _views(new, sizes, shapes),
                    _views(old, sizes, shapes),
                    _views(chosen, sizes, shapes),
                    (new, old, chosen),
                    index,
                )
            )
        self._key = key


def _views(flat: Tensor, sizes: Sequence[int], shapes: Sequence[torch.Size]) -> list[Tensor]:
    """``flat`` cut into parts of ``sizes``, each viewed as its shape."""
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


@dataclass
class _Pending:
    step: int
    messages: Sequence[str]
    host: Tensor
    event: torch.cuda.Event | None


class LateWarnings:
    """Warnings for failed flags, read from a host copy of the flags once it is ready.

    :meth:`record` starts the copy (on a CUDA device: into pinned memory, with an event);
    :meth:`poll` logs, for every recorded step whose copy has arrived and without waiting,
    ``messages[i]`` where flag ``i`` failed; :meth:`flush` waits for all.
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def record(self, step: int, flags: Tensor, messages: Sequence[str]) -> None:
        """Starts the host copy of the bool vector ``flags`` of ``step``; ``messages[i]``
        (with ``%d`` for the step) is logged if ``flags[i]`` fails."""
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event: torch.cuda.Event | None = torch.cuda.Event()
            event.record()  # type: ignore[union-attr]
        else:
            host, event = flags.clone(), None
        self._pending.append(_Pending(step, messages, host, event))

    def poll(self) -> None:
        """Logs the warnings of every recorded step whose copy has arrived, in order."""
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            pending = self._pending.pop(0)
            for ok, message in zip(pending.host.tolist(), pending.messages, strict=True):
                if not ok:  # a host tensor: no device is read here
                    logger.warning(message, pending.step)

    def flush(self) -> None:
        """Waits for every copy and logs its warnings."""
        for pending in self._pending:
            if pending.event is not None:
                pending.event.synchronize()
        self.poll()


def guard_messages(names: Sequence[str]) -> list[str]:
    """The guard's warnings in the layout of :func:`~dkfac.engine.step_math.finite_masks`."""
    return [
        message.replace("%s", name.replace("%", "%%"))
        for name in names
        for message in (FACTORS_SKIPPED, GRADIENT_ZEROED)
    ]
