"""Gradient accumulation under FSDP2 / HSDP with ``set_requires_gradient_sync(False)``.

FSDP2's own accumulation loop reduce-scatters on the last micro-batch only: the others
leave their gradients in the unsharded parameters, and the sharded ones get theirs once.
The preconditioner counts the micro-batches (it scales ``G`` by their number squared), so
it must count the backward passes through the unsharded parameters, not the reductions
into the sharded ones. With a damped method (``eigen``, sensitive to ``G``'s scale) the
run equals its serial twin on the same micro-batches (float64, 1e-9) under ``replicated``
and ``mem-opt`` on 2 ranks, and HSDP (2 × 2) on 4. So too with ``overlap_comm="on"``:
FSDP2 runs the sharded parameters' hooks once, after its reduction, so every bucket is
launched from ``step()``, where the layout's stand-in parameters (no ``requires_grad``)
read as frozen layers, and no statistic was averaged over the ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import Run, assert_ranks_match, once_per_key, train_sharded
from tests.strategy_cases import OPTIONS, global_batch, make_model

STEPS = 4
MICRO = 2
TOL = {"rtol": 1e-9, "atol": 1e-11}
CASES: dict[int, dict[str, dict[str, Any]]] = {
    2: {"replicated": {}, "mem-opt": {"strategy": "mem-opt"}, "overlap": {"overlap_comm": "on"}},
    4: {"hsdp": {"hsdp": True}},
}


def _shard(hsdp: bool, model: nn.Module) -> None:
    mesh = None
    if hsdp:
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(rank: int | None, world: int, case: dict[str, Any]) -> Run:
    options = {**OPTIONS, "method": "eigen", **case}
    hsdp = options.pop("hsdp", False)
    if rank is None:
        options.pop("strategy", None)
        options.pop("overlap_comm", None)
    return train_sharded(
        rank,
        world,
        model_fn=make_model,
        batch_fn=functools.partial(global_batch, world_size=world),
        steps=STEPS,
        micro=MICRO,
        shard=functools.partial(_shard, hsdp) if rank is not None else None,
        sync_last_only=True,
        **options,
    )


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {key: _train(rank, world, case).params() for key, case in CASES[world].items()}


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=120))


@pytest.mark.parametrize(
    ("world", "key"), [(world, key) for world, cases in CASES.items() for key in cases]
)
def test_reduce_scatter_on_the_last_micro_batch_only_trains_as_serial(world: int, key: str) -> None:
    serial = _train(None, world, CASES[world][key])
    results = [r[key] for r in _spawned(world)]
    assert_ranks_match(results, serial.params(), label=f"{world} ranks, {key}", **TOL)
