"""``torch.distributed.checkpoint`` with :class:`~dkfac.KFACOptimizer`: the standard way.

Also under FSDP2: on 2 ranks, and re-sharded from 2 ranks to one process, to 4 ranks and
from 4 back to 2.

``get_state_dict(model, optimizer)`` → ``dcp.save``, then in a fresh run ``get_state_dict``
→ ``dcp.load`` → ``set_state_dict``, continues exactly as the uninterrupted run (one
process, and DDP on 2 gloo ranks; ``eigen_adam`` with its moments and the leftover Adam
state, and ``eigen`` with momentum SGD). Taking a state dict mid-run does not disturb the
run: ``get_state_dict`` steps a stateless optimizer with zero gradients and lr 0 to create
its state, which must leave K-FAC's step counter, factors and moments alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.engine.optimizer_state import KFAC_KEY, unpack
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import once_per_key
from tests.strategy_cases import global_batch, make_model

SAVED_AT, STEPS = 3, 6


def _optimizer(model: nn.Module, method: str) -> KFACOptimizer:
    if method == "eigen_adam":  # the defaults: SGD without momentum (stateless), leftover Adam
        return KFACOptimizer.for_model(model, lr=0.01, inverse_update_interval=2)
    pre = KFACPreconditioner(model, method=method, inverse_update_interval=2, damping=0.01)
    return KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pre)


def _steps(
    wrapped: nn.Module, opt: KFACOptimizer, steps: range, rank: int, world: int, parts: int = 0
) -> None:
    """Steps on ``global_batch(step, world)``, of which this rank trains part ``rank`` of
    ``parts`` (default ``world``; ``rank=0, parts=1``: all of it)."""
    parts = parts or world
    for step in steps:
        x, y = global_batch(step, world)
        rows = slice(rank * len(x) // parts, (rank + 1) * len(x) // parts)
        opt.zero_grad()
        F.cross_entropy(wrapped(x[rows]), y[rows]).backward()
        opt.step()


def _shard(model: nn.Module) -> nn.Module:
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def _run(rank: int, world: int, folder: str, method: str, layout: str = "ddp") -> dict[str, Any]:
    """The uninterrupted run (saving at SAVED_AT), then a fresh run resumed from the save;
    on several ranks under DDP or sharded with FSDP2 (``layout="fsdp"``)."""
    ddp = world > 1 and dist.is_initialized() and layout == "ddp"
    runs = {}
    for resumed in (False, True):
        model = make_model()
        if layout == "fsdp":
            _shard(model)
        wrapped = nn.parallel.DistributedDataParallel(model) if ddp else model
        opt = _optimizer(wrapped, method)
        if resumed:
            state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            _steps(wrapped, opt, range(SAVED_AT, STEPS), rank, world)
        else:
            _steps(wrapped, opt, range(SAVED_AT), rank, world)
            opt.zero_grad()
            model_sd, optim_sd = get_state_dict(model, opt)
            assert KFAC_KEY in optim_sd["param_groups"][0]
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
            _steps(wrapped, opt, range(SAVED_AT, STEPS), rank, world)
        runs[resumed] = {
            "params": [_whole(p) for p in model.parameters()],
            "steps": opt.preconditioner.steps,
        }
    return runs


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.detach().full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def _check(runs: dict[bool, dict[str, Any]], label: str) -> None:
    assert runs[False]["steps"] == runs[True]["steps"] == STEPS, label
    for index, (got, want) in enumerate(
        zip(runs[True]["params"], runs[False]["params"], strict=True)
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{label}, tensor {index}")


@pytest.mark.parametrize("method", ["eigen_adam", "eigen"])
def test_one_process_resumes_exactly(tmp_path: Path, method: str) -> None:
    _check(_run(0, 1, str(tmp_path), method), method)


# ---------------------------------------------------------------- several ranks
# One spawn of 2 ranks runs every 2-rank case (spawning is the slow part); then 4 ranks
# resume its FSDP checkpoint and save their own, which 2 ranks resume again.
LAYOUTS = [(layout, method) for layout in ("ddp", "fsdp") for method in ("eigen_adam", "eigen")]


def _two_ranks(rank: int, world: int, root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {
        case: _run(rank, world, f"{root}/{case[0]}-{case[1]}", case[1], case[0]) for case in LAYOUTS
    }
    out["phase"] = _fsdp_phase(rank, world, f"{root}/two", "")
    return out


def _four_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    return _fsdp_phase(rank, world, f"{root}/four", f"{root}/two")


def _back_to_two(rank: int, world: int, root: str) -> dict[str, Any]:
    return _fsdp_phase(rank, world, "", f"{root}/four")


_two = once_per_key(lambda root: run_distributed(_two_ranks, 2, root, timeout=300))
_four = once_per_key(lambda root: _two(root) and run_distributed(_four_ranks, 4, root, timeout=240))
_back = once_per_key(lambda root: _four(root) and run_distributed(_back_to_two, 2, root))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.mark.parametrize(("layout", "method"), LAYOUTS)
def test_two_ranks_resume_exactly(root: str, layout: str, method: str) -> None:
    for rank, result in enumerate(_two(root)):
        _check(result[(layout, method)], f"{layout}, {method}, rank {rank}")


def test_a_two_rank_fsdp_checkpoint_continues_in_one_process(root: str) -> None:
    """The shards joined by dcp, K-FAC's state world-size independent: one process continues
    as the 2-rank run did (to rounding: one process sums in another order; ``eigen``: Adam
    in an eigenbasis of these rank-deficient factors turns rounding into much more,
    tests/engine/test_moments_dist.py)."""
    want = _two(root)[0][("fsdp", "eigen")][False]["params"]
    model = make_model()
    opt = _optimizer(model, "eigen")
    state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    dcp.load(state, checkpoint_id=f"{root}/fsdp-eigen")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert opt.preconditioner.steps == SAVED_AT
    _steps(model, opt, range(SAVED_AT, STEPS), 0, 2, parts=1)
    for index, (got, expected) in enumerate(zip(model.parameters(), want, strict=True)):
        torch.testing.assert_close(got.detach(), expected, rtol=1e-9, atol=1e-11, msg=f"{index}")


@pytest.mark.parametrize("direction", ["2 -> 4", "4 -> 2"])
def test_fsdp_checkpoints_reshard(root: str, direction: str) -> None:
    """A 2-rank FSDP checkpoint resumed on 4 ranks continues as the 2-rank run did, and a
    4-rank one on 2 ranks as the 4-rank run did (to rounding: the ranks sum in another
    order)."""
    if direction == "2 -> 4":
        runs, want = _four(root), _two(root)[0]["phase"]["uninterrupted"]
    else:
        runs, want = _back(root), _four(root)[0]["uninterrupted"]
    for rank, result in enumerate(runs):
        for index, (got, expected) in enumerate(zip(result["resumed"], want, strict=True)):
            torch.testing.assert_close(
                got, expected, rtol=1e-9, atol=1e-11, msg=f"{direction}, rank {rank}, {index}"
            )


def test_taking_a_state_dict_does_not_disturb_the_run() -> None:
    runs = []
    for look in (False, True):
        model = make_model()
        opt = _optimizer(model, "eigen_adam")
        for step in range(4):
            _steps(model, opt, range(step, step + 1), 0, 1)
            if look:  # without gradients, get_state_dict steps the stateless SGD with lr 0
                opt.zero_grad()
                get_state_dict(model, opt)
        runs.append([p.detach().clone() for p in model.parameters()])
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_dict_is_a_standard_optimizer_state_dict() -> None:
    model = make_model()
    opt = _optimizer(model, "eigen")
    _steps(model, opt, range(2), 0, 1)
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups"}
    assert isinstance(state["param_groups"][0][KFAC_KEY], bytes)
    inner, pre, skipped = unpack(state)
    assert KFAC_KEY not in inner["param_groups"][0] and skipped == 0 and pre["step"] == 2
    fresh = _optimizer(make_model(), "eigen")
    fresh.load_state_dict(state)
    assert fresh.preconditioner.steps == 2
    assert KFAC_KEY not in fresh.param_groups[0]  # the live groups stay the inner's
    legacy = {"inner": opt.inner.state_dict(), "preconditioner": pre, "skipped_steps": 0}
    _optimizer(make_model(), "eigen").load_state_dict(legacy)
    with pytest.raises(ValueError, match="holds no 'kfac'"):
        fresh.load_state_dict(opt.inner.state_dict())


def test_a_lr_zero_step_with_gradients_still_preconditions() -> None:
    model = make_model()
    opt = _optimizer(model, "eigen")
    for group in opt.param_groups:
        group["lr"] = 0.0
    _steps(model, opt, range(1), 0, 1)
    assert opt.preconditioner.steps == 1


def _fsdp_phase(rank: int, world: int, save_to: str, load_from: str) -> dict[str, Any]:
    """On ``world`` FSDP ranks: resume the checkpoint in ``load_from`` (if any) to STEPS,
    and run from scratch to STEPS saving at SAVED_AT into ``save_to`` (if any). Every
    world size trains on the same global batches (``global_batch(step, 4)``)."""
    out: dict[str, Any] = {}
    for folder, resumed in ((load_from, True), (save_to, False)):
        if not folder:
            continue
        model = _shard(make_model())
        opt = _optimizer(model, "eigen")
        if resumed:
            state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            _steps(model, opt, range(SAVED_AT), rank, 4, parts=world)
            opt.zero_grad()
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
        _steps(model, opt, range(SAVED_AT, STEPS), rank, 4, parts=world)
        out["resumed" if resumed else "uninterrupted"] = [_whole(p) for p in model.parameters()]
    return out
