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
  Newton–Schulz steps (:func:`dkfac.solvers.polar.polar_dtype`). Given the work of its
  products, a CPU takes bf16 only from :data:`CPU_BF16_MIN_WORK` multiply-adds: its bf16
  product costs about 10 µs more to start than a float32 one (oneDNN's setup and the
  casts), which a small product never wins back.

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
    "CPU_BF16_MIN_WORK",
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


CPU_BF16_MIN_WORK = 2**21
"""The fewest multiply-adds (a 128 × 128 × 128 product) of the products a CPU runs in bf16
(:func:`low_precision`). Measured on one AVX512-BF16 core (``dkfac bench precision``,
``benchmarks/results/polar_precision_cpu.json``): three Newton–Schulz steps of a 16 × 65
matrix (work ``16³``) take 0.03 ms in float32 and 0.11 ms in bf16, of a 64 × 577 one
(``64³``, float32 on the Gram matrix) 0.18 and 0.24 ms, of a 128 × 129 one (``128³``) 0.39
and 0.24 ms; a rotation out of a 64 × 65 layer's eigenbasis (``64 · 65²``) 0.016 and
0.032 ms, of a 64 × 257 layer's (``64 · 257²``) 0.11 and 0.06 ms."""


def low_precision(
    device: torch.device, dtype: torch.dtype, work: float | None = None
) -> torch.dtype:
    """float64 for float64, else bf16 where :func:`bfloat16_is_fast`, else float32; on a
    CPU, bf16 only for products of at least :data:`CPU_BF16_MIN_WORK` multiply-adds
    (``work``: the caller's count for its products; ``None``: any)."""
    if dtype == torch.float64:
        return torch.float64
    if not bfloat16_is_fast(device):
        return torch.float32
    small = work is not None and work < CPU_BF16_MIN_WORK
    return torch.float32 if small and device.type == "cpu" else torch.bfloat16


@functools.lru_cache(maxsize=16)
def moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to float32 at least: the precision moments of a gradient of
    ``dtype`` are kept and worked on in (``torch.promote_types`` is a dispatched
    operation, host time on a launch-bound step: decided once a dtype)."""
    return torch.promote_types(dtype, torch.float32)
