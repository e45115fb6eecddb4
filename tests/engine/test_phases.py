"""The step's profiler ranges: in a trace while a profiler records, absent (no dispatched
operation) otherwise."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from dkfac import KFACPreconditioner

PHASES = {"dkfac.factors", "dkfac.precondition", "dkfac.kl_clip", "dkfac.capture_a"}


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, pre: KFACPreconditioner) -> None:
    model.zero_grad()
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    pre.step()


def test_phases_are_traced_only_while_a_profiler_records() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = KFACPreconditioner(model)
    _step(model, pre)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, pre)
    assert {event.name for event in prof.events()} >= PHASES
    with _Names() as seen:
        _step(model, pre)
    assert not any("record_function" in name for name in seen.names), seen.names
