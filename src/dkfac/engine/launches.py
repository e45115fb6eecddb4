"""Which devices run a step bound by kernel launches rather than by arithmetic.

A small model's K-FAC step on a CUDA device costs about one kernel launch per tensor
operation (BENCHMARKS.md sections 18, 28 and 30), so there the engine takes the
multi-tensor forms (``torch._foreach_*``: a few launches for any number of layers) of its
per-layer checks and sums. On a CPU a multi-tensor call is a loop over the single-tensor
kernels, and the single forms, chosen for fewer passes, stay.
"""

from __future__ import annotations

import torch

__all__ = ["launch_bound"]


def launch_bound(device: torch.device) -> bool:
    """Whether ``device`` takes the multi-tensor forms (a CUDA device)."""
    return device.type == "cuda"
