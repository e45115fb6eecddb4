"""What the integration tests compare twin runs by."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dkfac import KFACOptimizer

Batch = Callable[[torch.Generator], tuple[Any, Any]]


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the two models' parameters, in order."""
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, loss: Callable, steps: range
) -> None:
    """A plain training loop over ``steps``, each step's batch from a generator seeded by it."""
    for step in steps:
        x, y = batch(torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()


def covers_trains_and_resumes(make: Callable[[], nn.Module], batch: Batch, loss: Callable) -> None:
    """The default (``KFACOptimizer.for_model``) on ``make()``'s model as a user checks it:
    every trainable parameter is in ``describe()`` (a layer's, or the inner optimizer's with
    a reason), the weights stay finite, and a checkpoint taken mid-run resumes bit for bit
    (the oracle: the run that did not stop)."""

    def fresh() -> tuple[nn.Module, KFACOptimizer]:
        torch.manual_seed(0)
        model = make()
        return model, KFACOptimizer.for_model(model)

    model, opt = fresh()
    train_steps(model, opt, batch, loss, range(3))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    train_steps(model, opt, batch, loss, range(3, 7))
    rows = opt.preconditioner.describe()
    listed = {re.sub(r"\[\d+:\d+\]$", "", p) for row in rows for p in row["parameters"] or ()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable <= listed
    assert all(row["reason"] for row in rows if row["block"] == "inner optimizer")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    twin, twin_opt = fresh()
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    twin.load_state_dict(state["model"])
    twin_opt.load_state_dict(state["opt"])
    train_steps(twin, twin_opt, batch, loss, range(3, 7))
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
