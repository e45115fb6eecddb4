"""The ``--device`` flag of ``dkfac train`` and the benchmarks: its check and its device."""

from __future__ import annotations

import os

import torch

__all__ = ["device_error", "pick_device"]


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


def pick_device(name: str) -> torch.device:
    """The device of ``--device name``; ``auto`` and a bare ``cuda`` take this rank's GPU
    (``LOCAL_RANK``, 0 without one), ``auto`` the CPU where there is none.

    Raises:
        ValueError: With :func:`device_error`'s message for a name it rejects.
    """
    if message := device_error(name):
        raise ValueError(message)
    if name not in ("auto", "cuda"):
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
