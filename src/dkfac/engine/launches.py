"""Which devices run a step bound by kernel launches rather than by arithmetic.

A small model's K-FAC step on a CUDA device costs about one kernel launch per tensor
operation, so there the engine takes the
multi-tensor forms (``torch._foreach_*``: a few launches for any number of layers) of its
per-layer checks and sums. On a CPU a multi-tensor call is a loop over the single-tensor
kernels, and the single forms, chosen for fewer passes, stay.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

__all__ = ["compile_backend", "device_constant", "launch_bound"]


def launch_bound(device: torch.device) -> bool:
    """Whether ``device`` takes the multi-tensor forms (a CUDA device)."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=256)
def device_constant(
    values: tuple[int, ...] | tuple[float, ...],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> Tensor:
    """``values`` as a tensor of ``dtype`` (int64 by default) on ``device``, made once for
    each ``values`` and dtype.

    A tensor built from host data on a CUDA device is a copy from pageable memory, which
    the host waits for: this one goes through pinned memory without waiting (the pinned
    buffer is kept until the copy has run by PyTorch's host allocator)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def compile_backend(choice: str, device: torch.device) -> str | None:
    """The ``torch.compile`` backend of the ``compile_moments`` option on ``device``:
    ``None`` for ``"off"``; for ``"auto"``, ``"inductor"`` on a CUDA device (launch-bound)
    where Triton (inductor's GPU code generator) is installed, else ``None``; any other
    choice is the backend itself."""
    if choice == "off":
        return None
    if choice != "auto":
        return choice
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "inductor"
    return None
