"""Backward passes whose step never runs: their statistics go with their gradients.

``KFACOptimizer.zero_grad`` forgets what the hooks captured since the last step when a
backward ran since: a step a GradScaler skipped for an overflow, a closure evaluated again.
Oracles: the run without the discarded backward (bit for bit); a forward run before
``zero_grad`` keeps its statistics (the usual order of the same loop, bit for bit); under
DDP's overlapped reduction on 2 ranks the same, the ranks equal. And a first step whose
statistics are not finite leaves every layer waiting for its first basis, which the next
step then gives it, instead of plain gradients until the next scheduled refresh.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    return x[rows], y[rows]


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _scaled_run(
    overflow_first: bool, model: nn.Module | None = None, rows: slice = slice(None)
) -> list[Tensor]:
    """Four clean steps under a GradScaler, after one that overflows (scale 1024, halved to
    512 by the overflow) or not (scale 512 from the start)."""
    model = model or _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0 if overflow_first else 512.0)
    opt = KFACOptimizer.for_model(model, lr=0.01, grad_scaler=scaler, overhead=None)
    for step in range(-1 if overflow_first else 0, 4):
        x, y = _batch(max(step, 0), rows)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * (float("inf") if step < 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert opt.preconditioner.steps == 4  # the overflowing step never reached it
    return _params(model)


def test_a_step_a_grad_scaler_skipped_leaves_no_statistics() -> None:
    for got, want in zip(_scaled_run(True), _scaled_run(False), strict=True):
        assert torch.equal(got, want)


def _closure_run(evaluations: int, forward_first: bool = False) -> list[Tensor]:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01, method="eigen", overhead=None)
    for step in range(3):
        x, y = _batch(step)

        def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
            if forward_first:  # the loss first, then zero_grad, then the backward
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
            else:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        for _ in range(evaluations - 1):
            closure()  # evaluated again before the step (a probe, a line search)
        opt.step(closure)
    return _params(model)


def test_a_closure_evaluated_again_counts_once() -> None:
    for got, want in zip(_closure_run(3), _closure_run(1), strict=True):
        assert torch.equal(got, want)


def test_a_forward_before_zero_grad_keeps_its_statistics() -> None:
    for got, want in zip(_closure_run(1, forward_first=True), _closure_run(1), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_closure_run(2, forward_first=True), _closure_run(1), strict=True):
        assert torch.equal(got, want)


def test_a_first_step_with_non_finite_statistics_leaves_the_layers_waiting() -> None:
    model = _mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)  # the budget: bases every few tens of steps
    waiting = []
    for step in range(2):
        x, y = _batch(step)
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * (float("nan") if step == 0 else 1.0)).backward()
        opt.step()
        waiting.append(sorted(opt.preconditioner.late.waiting))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert waiting == [["0", "2", "4"], []]
    assert all(layer.solver_state is not None for layer in opt.preconditioner.layers.values())


def _ddp_main(rank: int, world: int) -> dict[str, Any]:
    rows = slice(8 * rank, 8 * rank + 8)
    runs = {}
    for overflow_first in (True, False):
        model = _mlp()
        ddp = nn.parallel.DistributedDataParallel(model)  # overlapped reduction ("auto")
        runs[overflow_first] = _scaled_run(overflow_first, ddp, rows)
    return runs


@pytest.mark.parametrize("world", [2])
def test_under_ddp_s_overlapped_reduction_the_ranks_agree(world: int) -> None:
    """The discarded step's buckets were launched from its backward: they are waited for
    and the plan formed again, so the next step neither raises nor mixes them in."""
    results = run_distributed(_ddp_main, world, timeout=120)
    want = results[0][False]
    for result in results:
        for got_skip, got_clean, w in zip(result[True], result[False], want, strict=True):
            torch.testing.assert_close(got_skip, w, rtol=0, atol=0)
            torch.testing.assert_close(got_clean, w, rtol=0, atol=0)
