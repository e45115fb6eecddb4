"""The check of a ``--device`` flag, shared by ``dkfac train`` and the benchmarks."""

from __future__ import annotations

import torch

__all__ = ["device_error"]


def device_error(name: str) -> str | None:
    """Why ``--device name`` cannot be used on this machine (``None``: it can)."""
    if name == "auto":
        return None
    allowed = "--device must be auto, cpu, cuda or cuda:N"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"{allowed}, got {name!r}"
    if device.type not in ("cpu", "cuda"):
        return f"{allowed}, got {name!r}"
    if device.type == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"--device {name}: no CUDA device is available here; use --device cpu or auto"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return (
            f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return None
