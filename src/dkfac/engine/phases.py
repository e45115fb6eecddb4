"""The step's phases as profiler ranges, entered only while a profiler records.

Each phase of a step (factors, inverse, precondition, distribute, KL-clip) and the capture
hooks (twice a layer on a factor step) run inside ``torch.profiler.record_function`` so
that a trace shows where the time goes. Entering and leaving one dispatches two operations
even when nothing records, host time on every step of a launch-bound device; :func:`phase`
enters it only while the autograd profiler (which ``torch.profiler.profile`` starts) is on.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

__all__ = ["phase"]


def phase(name: str) -> AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records, else a context that does nothing."""
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return nullcontext()
