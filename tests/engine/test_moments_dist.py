"""Eigenbasis moments on 2 gloo ranks equal the serial engine, for every strategy.

The moments live on every rank that preconditions a layer; the runs below must give the
serial parameters and, gathered into a checkpoint, the serial moments. A serial checkpoint
loaded into each strategy (a re-shard from 1 to 2 ranks) continues like the serial run.
Under ``dp`` the owners build factors from their local batch only, so its ranks get the
same batch: then its update is the serial one too.

Adam in an eigenbasis is not invariant to rotations inside a degenerate eigenspace, and
rounding picks that part of the basis: with a factor of lower rank than its size (fewer
samples than inputs) a distributed run differs from the serial one by much more than
rounding, although all its ranks agree (they share the owner's basis). The batch here is
large enough for full-rank factors, and ``ε`` large against the rounding of the gradient
in the one-dimensional null space softmax and LayerNorm leave in ``G``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.strategy_cases import OPTIONS, STEPS, average_gradients, make_model

MOMENTS: dict[str, Any] = {
    "method": "eigen_adam",
    "basis_refresh": "power",
    "moment_carry": "rotate",
    "moment_eps": 1e-6,
}
BATCH = 64
CONFIGS = [("replicated", 1.0), ("kaisa", 0.5), ("kaisa", 1.0), ("mem-opt", 1.0), ("spngd", 1.0)]
RESUME = ("replicated", "mem-opt", "spngd")
SPLIT = 2  # the serial checkpoint is taken after this many steps


def _steps(
    model: nn.Module,
    pre: KFACPreconditioner,
    opt: torch.optim.Optimizer,
    steps: range,
    rank: int,
    world: int,
    *,
    shard: bool = True,
) -> None:
    """SGD-momentum steps on this rank's shard (``shard=False``: the whole batch)."""
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(BATCH, 2, 4, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (BATCH,), generator=gen)
        if shard:
            size = x.shape[0] // world
            x, y = x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if world > 1 and pre.strategy.name != "spngd":
            average_gradients(model, world)
        pre.step(lr=0.1)
        opt.step()


def _run(
    rank: int, world: int, strategy: str, *, start: dict[str, Any] | None = None, **kw: Any
) -> tuple[list[Tensor], dict[str, Any]]:
    """Steps ``[SPLIT, STEPS)`` from ``start`` (model, optimizer, preconditioner states), or
    all steps from scratch; the parameters and the gathered preconditioner state."""
    model = make_model()
    pre = KFACPreconditioner(model, strategy=strategy, **{**OPTIONS, **MOMENTS, **kw})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = 0
    if start is not None:
        start = copy.deepcopy(start)  # SGD's load_state_dict keeps the momentum tensors
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
        pre.load_state_dict(start["pre"])
        first = SPLIT
    _steps(model, pre, opt, range(first, STEPS), rank, world, shard=strategy != "dp")
    return [p.detach().clone() for p in model.parameters()], pre.state_dict()


def _rank_main(rank: int, world: int, start: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, fraction in CONFIGS:
        params, state = _run(rank, world, strategy, grad_worker_fraction=fraction)
        out[f"{strategy}/{fraction}"] = (params, state)
    out["dp"] = _run(rank, world, "dp")
    for strategy in RESUME:
        out[f"resume/{strategy}"] = _run(rank, world, strategy, start=start)[0]
    return out


def _serial_start() -> dict[str, Any]:
    model = make_model()
    pre = KFACPreconditioner(model, **{**OPTIONS, **MOMENTS})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, pre, opt, range(SPLIT), 0, 1)
    return copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "pre": pre.state_dict()}
    )


def _close(got: list[Tensor], want: list[Tensor], label: str) -> None:
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=lambda m: f"{label}: {m}")


def test_moments_on_two_ranks_equal_serial_for_every_strategy() -> None:
    serial_params, serial_state = _run(0, 1, "replicated")
    dp_params, _ = _run(0, 1, "dp")
    start = _serial_start()
    results = run_distributed(_rank_main, 2, start, timeout=180)
    for label in [f"{s}/{f}" for s, f in CONFIGS]:
        for rank, out in enumerate(results):
            params, state = out[label]
            _close(params, serial_params, f"{label} rank {rank}")
            for name, entry in state["layers"].items():
                want = serial_state["layers"][name]["moments"]
                assert set(entry["moments"]) == {"m", "v", "t"}
                for key, value in want.items():
                    torch.testing.assert_close(
                        entry["moments"][key],
                        value,
                        rtol=1e-9,
                        atol=1e-11,
                        msg=f"{label} {name} {key}",
                    )
    for rank, out in enumerate(results):
        _close(out["dp"][0], dp_params, f"dp rank {rank}")
        for strategy in RESUME:
            _close(out[f"resume/{strategy}"], serial_params, f"resume {strategy} rank {rank}")
