"""The cost model of sharded models (FSDP2) against the real engine on 2 gloo ranks.

Every rank shards two small float64 models with ``fully_shard`` (each child, then the root:
the strategy-test model, with its 3-row convolution cut 2 + 1, and the CNN with two
BatchNorms) and trains them with K-FAC under every strategy offered for sharded models for
three steps, ``inverse_update_interval=2`` (steps 0 and 2 refresh, step 1 updates factors
only). Per rank and step, the ledger's bytes by kind equal
:func:`dkfac.costmodel.sharded.predict_sharded_ledger_bytes` (today's all-gather exchange
plus the strategy's own traffic), and ``pre.memory_usage()`` after the last step equals
:func:`~dkfac.costmodel.sharded.predict_sharded_memory`. AdamW on the sharded model: the
largest rank's parameters, gradients and moments equal
:func:`~dkfac.costmodel.sharded.sharded_state_bytes`. The engine and torch are the
reference: nothing here is derived from the cost model's formulas.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dkfac import KFACPreconditioner
from dkfac.costmodel import DtypeBytes, extract_layers
from dkfac.costmodel.sharded import (
    EXCHANGES,
    fsdp_bytes,
    gathered_rows_bytes,
    predict_sharded_ledger_bytes,
    predict_sharded_memory,
    sharded_state_bytes,
)
from dkfac.costmodel.traffic import placement_for
from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import once_per_key
from tests.strategy_cases import make_bn_model, make_model

STEPS = 3
PER_RANK = 8
F64 = DtypeBytes(factor=8, inverse=8, grad=8)
CONFIGS: list[tuple[str, float]] = [
    ("replicated", 1.0),
    ("kaisa", 0.5),
    ("mem-opt", 1.0),
    ("dp", 1.0),
]
MODELS = {"mlp": make_model, "bn": make_bn_model}


def _sharded(name: str) -> nn.Module:
    model = MODELS[name]()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(PER_RANK, 2, 4, 4, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (PER_RANK,), generator=gen)


def _kfac(rank: int, name: str, strategy: str, fraction: float) -> dict[str, Any]:
    model = _sharded(name)
    pre = KFACPreconditioner(
        model,
        strategy=strategy,
        grad_worker_fraction=fraction,
        inverse_update_interval=2,
        damping=0.01,
    )
    for step in range(STEPS):
        x, y = _batch(rank, step)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step(lr=0.1)
    return {
        "per_step": [s["by_kind"] for s in pre.comm_stats()["per_step"]],
        "memory": pre.memory_usage(),
    }


def _adamw(rank: int, name: str) -> int:
    model = _sharded(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    local = [p.to_local() for p in model.parameters()]
    local += [p.grad.to_local() for p in model.parameters()]
    local += [s[k].to_local() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return sum(t.numel() * t.element_size() for t in local)


def _rank_main(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {(m, s, f): _kfac(rank, m, s, f) for m in MODELS for s, f in CONFIGS}
    out.update({("adamw", m): _adamw(rank, m) for m in MODELS})
    return out


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=180))


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("strategy", "fraction"), CONFIGS)
def test_sharded_ledger_and_memory_equal_the_cost_model(
    model_name: str, strategy: str, fraction: float
) -> None:
    spec = extract_layers(MODELS[model_name]())
    kw: dict[str, Any] = {"grad_worker_fraction": fraction, "dtypes": F64}
    full = predict_sharded_ledger_bytes(spec, 2, strategy, **kw)
    factor_only = predict_sharded_ledger_bytes(spec, 2, strategy, inverse_step=False, **kw)
    memory = predict_sharded_memory(spec, 2, strategy, **kw)
    for rank, result in enumerate(_spawned(2)):
        got = result[(model_name, strategy, fraction)]
        label = f"{model_name} {strategy}(f={fraction}) rank {rank}"
        assert got["per_step"] == [full[rank], factor_only[rank], full[rank]], label
        assert got["memory"] == {**memory[rank], "accumulators": 0}, label


@pytest.mark.parametrize("model_name", list(MODELS))
def test_adamw_state_on_the_largest_rank_equals_the_cost_model(model_name: str) -> None:
    spec = extract_layers(MODELS[model_name]())
    want = sharded_state_bytes(
        spec, 2, optimizer_states=2, param_bytes=8, grad_bytes=8, state_bytes=8
    )
    assert max(r[("adamw", model_name)] for r in _spawned(2)) == sum(want.values())


def test_the_exchange_is_a_named_swappable_term() -> None:
    spec = extract_layers(make_model())
    assert EXCHANGES["all-gather"] is gathered_rows_bytes
    nothing = predict_sharded_ledger_bytes(
        spec, 2, "replicated", exchange=lambda ctx: {r: {} for r in range(ctx.world_size)}
    )
    today = predict_sharded_ledger_bytes(spec, 2, "replicated")
    # Conv (3 rows of 18 + bias), Linear (6 of 48 + bias), Linear (3 of 6 + bias), float32
    padded = 2 * (2 * 19 + 3 * 49 + 2 * 7) * 4
    assert today[0]["gradients"] - nothing[0]["gradients"] == padded
    # mem-opt on 2 ranks: each layer's owner receives the other rank's rows (exact, no
    # padding) and sends them back preconditioned; the strategy's broadcast does not run.
    owner = predict_sharded_ledger_bytes(spec, 2, "mem-opt")
    owners = placement_for(spec, 2, "mem-opt").owners
    per_row, rows = (19, 49, 7), (3, 6, 3)  # a ceil cut: 2 + 1, 3 + 3, 2 + 1 rows
    held = [
        min(math.ceil(n / 2), n - o * math.ceil(n / 2)) for n, o in zip(rows, owners, strict=True)
    ]
    moved = sum((n - h) * e for n, h, e in zip(rows, held, per_row, strict=True)) * 4
    exchange = predict_sharded_ledger_bytes(spec, 2, "mem-opt", exchange=EXCHANGES["owner"])
    assert owner == exchange
    assert owner[0]["preconditioned"] == moved
    assert owner[0]["gradients"] - nothing[0]["gradients"] == moved


def test_fsdp_traffic_and_refusals() -> None:
    spec = extract_layers(make_model())
    n = spec.param_numel
    assert fsdp_bytes(spec, 4) == {
        "param_all_gather": 2 * n * 4,
        "grad_reduce_scatter": n * 4,
        "replica_all_reduce": 0,
    }
    hsdp = fsdp_bytes(spec, 4, shard_size=2, reshard_after_forward=False)
    assert hsdp == {
        "param_all_gather": n * 4,
        "grad_reduce_scatter": n * 4,
        "replica_all_reduce": math.ceil(n / 2) * 4,
    }
    with pytest.raises(ValueError, match=r"'spngd' is not offered for sharded models"):
        predict_sharded_ledger_bytes(spec, 2, "spngd")
    with pytest.raises(ValueError, match=r"shard_size 3 does not divide world_size 4"):
        fsdp_bytes(spec, 4, shard_size=3)
