"""Where bfloat16 pays: the ``"auto"`` precision of the optional low-precision products.

bf16 matrix products are fast only on hardware that multiplies bf16 natively: CUDA GPUs of
compute capability 8.0 and later, and x86 CPUs with AVX512-BF16 or AMX. Elsewhere PyTorch
emulates them, and they are far slower than float32: on a 2-core AVX2 VM (one thread) a
512 × 512 product took 206 ms in bf16 against 4.7 ms in float32, and the language model's
recipe step took 1.9 s with its bf16 rotations, captures and Newton–Schulz iteration
against 0.72 s in float32. So a lowered precision is a choice
that depends on the machine, and ``"auto"`` makes it there:

- :func:`bfloat16_is_fast`: whether a device multiplies bf16 natively (decided once per
  device from its capabilities, not timed: every rank of a homogeneous job decides alike);
- :func:`resolve`: ``"auto"`` → ``torch.bfloat16`` where that holds and the model is not
  float64 (a float64 model asks for precision), else ``None`` (the option's default
  precision); any other value as given;
- :func:`low_precision`: the precision of an iteration that runs in bf16 where bf16 is
  fast and in float32 elsewhere (float64 for float64), e.g. the polar factor's
  Newton–Schulz steps (:func:`dkfac.solvers.polar.polar_dtype`).

Other accelerators (MPS, XPU) and non-x86 CPUs count as not fast: float32 is never the
slow choice, bf16 can be. The engine resolves ``"auto"`` when the preconditioner is built,
from each layer's parameters: build it after moving the model to its device. It logs what
``"auto"`` decided (INFO, once per option and device).
"""

from __future__ import annotations

import functools
from typing import Final, Literal

import torch

__all__ = [
    "AUTO",
    "LowPrecision",
    "bfloat16_is_fast",
    "low_precision",
    "moment_dtype",
    "resolve",
]

AUTO: Final = "auto"
"""The option value that lets the device decide (module notes)."""

LowPrecision = torch.dtype | Literal["auto"] | None
"""An optional lowered precision: a dtype, ``"auto"`` or ``None`` (the default precision)."""

_FAST: dict[str, bool] = {}
"""Device (``"cpu"``, ``"cuda:0"``) -> whether it multiplies bf16 natively; filled on
first use (tests set entries to take either branch on any machine)."""


def _cpu_has_native_bfloat16() -> bool:
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def bfloat16_is_fast(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices natively (module notes)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = f"cuda:{index}"
    else:
        key = device.type
    if key not in _FAST:
        if device.type == "cuda":
            _FAST[key] = torch.cuda.get_device_capability(index) >= (8, 0)
        else:
            _FAST[key] = device.type == "cpu" and _cpu_has_native_bfloat16()
    return _FAST[key]


def resolve(value: LowPrecision, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The concrete precision of an option ``value`` for tensors of ``dtype`` on ``device``.

    Args:
        value: A dtype or ``None`` (returned as given), or ``"auto"``.
        device: Where the products run.
        dtype: The model's (or the layer's parameters') dtype.

    Returns:
        ``torch.bfloat16`` for ``"auto"`` where :func:`bfloat16_is_fast` and ``dtype`` is
        not float64, ``None`` (the default precision) for ``"auto"`` elsewhere.

    Raises:
        ValueError: For a string other than ``"auto"``.
    """
    if not isinstance(value, str):
        return value
    if value != AUTO:
        raise ValueError(f"a precision must be a torch.dtype, 'auto' or None, got {value!r}")
    low = low_precision(device, dtype)
    return low if low == torch.bfloat16 else None


def low_precision(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else bf16 where :func:`bfloat16_is_fast`, else float32."""
    if dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if bfloat16_is_fast(device) else torch.float32


@functools.lru_cache(maxsize=16)
def moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to float32 at least: the precision moments of a gradient of
    ``dtype`` are kept and worked on in (``torch.promote_types`` is a dispatched
    operation, host time on a launch-bound step: decided once a dtype)."""
    return torch.promote_types(dtype, torch.float32)
