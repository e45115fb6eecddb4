"""Counts the host reads of device values a piece of code makes (the synchronisations a GPU
step would wait on), on any device: every ``.item()``, ``.tolist()``, ``.numpy()`` and
``bool`` / ``float`` / ``int`` / ``index`` conversion of a tensor, by the source line that
made it."""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}


class HostReads(TorchFunctionMode):
    """A context manager; ``reads`` counts ``(function, "file:line")`` of each read inside.

    ``exempt`` names source files (their path's end) whose reads are of host copies made
    for the purpose (e.g. :mod:`dkfac.engine.device_checks`' late warnings) and not counted.
    """

    def __init__(self, exempt: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.exempt = exempt

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            caller = traceback.extract_stack(limit=2)[0]  # the frame that called the read
            if not caller.filename.endswith(self.exempt):
                where = f"{caller.filename.rsplit('/', 2)[-1]}:{caller.lineno}"
                self.reads[(func.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


_WAITS = {
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
"""Operations whose answer (a Python bool, or a shape that depends on the values) the host
waits for on a CUDA device, though no conversion of a tensor is seen."""


class HostData(TorchDispatchMode):
    """Counts tensors made from host data (``torch.tensor(list)``: ``aten.lift_fresh``) by
    the source line inside ``dkfac`` that made them: on a CUDA device each is a copy from
    pageable memory that the host waits for; and the operations the host waits for
    (``torch.equal``, ``nonzero``, ``masked_select``), keyed ``"<op> at <line>"``.
    ``exempt`` as for :class:`HostReads`."""

    def __init__(self, exempt: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.made: collections.Counter[str] = collections.Counter()
        self.exempt = exempt

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.lift_fresh.default or func in _WAITS:
            frames = [f for f in traceback.extract_stack() if "/dkfac/" in f.filename]
            if frames and not frames[-1].filename.endswith(self.exempt):
                where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}"
                op = "" if func is torch.ops.aten.lift_fresh.default else f"{func} at "
                self.made[op + where] += 1
        return func(*args, **(kwargs or {}))
