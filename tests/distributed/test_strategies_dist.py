"""Strategies on 2 and 4 gloo ranks against the serial engine and hand-derived byte counts.

Every rank runs all configurations of its world size inside one spawned process group
(spawning is the slow part, so a module fixture spawns once per world size); each
configuration is its own test, which compares it with a single process on the same global
batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.oracles import with_ones
from tests.serial_vs_distributed import (
    assert_factors_close,
    assert_tensors_close,
    once_per_key,
    train_sharded,
)
from tests.strategy_cases import DIMS, LAYERNORM_PARAMS, STEPS, make_model, summary, train

# LPT by a³ + g³: "3" (117865) > "0" (6886) > "6" (370).
OWNERS = {2: {"0": 1, "3": 0, "6": 1}, 4: {"0": 1, "3": 0, "6": 2}}
INVERSE_STEPS = 2  # steps 0 and 2 of 4 with inverse_update_interval=2
TOL = {"rtol": 1e-9, "atol": 1e-11}

F64 = 8
FACTORS = sum(a * a + g * g for a, g in DIMS.values()) * F64
PACKED_FACTORS = sum(a * (a + 1) // 2 + g * (g + 1) // 2 for a, g in DIMS.values()) * F64
GRADS = sum(a * g for a, g in DIMS.values()) * F64


def _eigen_state(name: str) -> int:  # qa, da, qg, dg
    a, g = DIMS[name]
    return (a * a + a + g * g + g) * F64


Config = tuple[str, float, bool]  # (strategy, grad_worker_fraction, ddp)
CONFIGS: dict[int, list[Config]] = {
    2: [
        ("replicated", 1.0, True),
        ("replicated", 1.0, False),
        ("mem-opt", 1.0, True),
        ("mem-opt", 1.0, False),
        ("kaisa", 0.5, True),
        ("spngd", 1.0, False),
        ("dp", 1.0, True),
    ],
    4: [
        ("replicated", 1.0, True),
        ("kaisa", 0.5, True),
        ("kaisa", 0.5, False),
        ("kaisa", 0.25, True),
        ("mem-opt", 1.0, False),
        ("spngd", 1.0, False),
        ("dp", 1.0, True),
    ],
}


def _key(config: Config) -> str:
    strategy, fraction, ddp = config
    return f"{strategy}-{fraction}-{'ddp' if ddp else 'bare'}"


# ---------------------------------------------------------------- rank bodies
def _rank_main(rank: int, world: int, configs: list[Config]) -> dict[str, Any]:
    """Every configuration in one process group (spawning is the slow part)."""
    out: dict[str, Any] = {}
    for config in configs:
        strategy, fraction, ddp = config
        run = train(rank, world, strategy, fraction=fraction, ddp=ddp)
        out[_key(config)] = summary(run)
        if strategy == "mem-opt":  # the last mem-opt configuration's gathered state
            out["checkpoint"] = run.pre.state_dict(include_inverses=True)
    out["dp_local"] = _dp_local_factors(rank, world)
    out["dp_losses"] = _dp_training(rank, world)
    if world == 2:
        out["nonfinite"] = _rank_nonfinite(rank, world)
    return out


def _dp_local_factors(rank: int, world: int) -> dict[str, Any]:
    """One dp step: each rank's factors vs the formulas on its own local batch."""
    model = make_model()
    pre = KFACPreconditioner(nn.parallel.DistributedDataParallel(model), strategy="dp")
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            seen[name + ".in"] = inputs[0].detach()
            output.register_hook(lambda g: seen.__setitem__(name + ".out", g.detach()))

        return hook

    for name in DIMS:
        model.get_submodule(name).register_forward_hook(keep(name))
    x, y = torch.randn(8, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    x = x + rank  # a different local batch per rank
    F.cross_entropy(pre.model(x), y).backward()
    pre.step()
    expected = {}
    for name in DIMS:
        if name == "0":  # im2col rows of the 3×3 conv, padding 1
            rows = F.unfold(seen["0.in"], 3, padding=1).transpose(1, 2).reshape(-1, 18)
            grad_rows = seen["0.out"].permute(0, 2, 3, 1).reshape(-1, 3) * 8
        else:
            rows, grad_rows = seen[name + ".in"], seen[name + ".out"] * 8
        a_rows = with_ones(rows)
        expected[name] = (a_rows.T @ a_rows / a_rows.shape[0], grad_rows.T @ grad_rows / 8)
    return {
        "factors": pre.factors(),
        "expected": expected,
        "factor_bytes": pre.comm_stats()["total"]["factors"],
        "accumulated": [row["name"] for row in pre.describe() if row["owner"] == rank],
    }


def _dp_problem(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed learnable global batch: rank ``r``'s 8 rows drawn with seed ``r``."""
    xs = [
        torch.randn(8, 2, 4, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(world)
    ]
    x = torch.cat(xs)
    return x, (x.sum(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()


def _dp_training(rank: int, world: int) -> list[float]:
    """dp with DDP on a fixed learnable problem: the global loss of each of 20 steps."""
    problem = _dp_problem(world)
    run = train_sharded(
        rank,
        world,
        model_fn=make_model,
        batch_fn=lambda step: problem,
        steps=20,
        ddp=True,
        strategy="dp",
        damping=0.01,
        inverse_update_interval=2,
    )
    losses = torch.stack(run.losses)
    dist.all_reduce(losses)
    return (losses / world).tolist()


def _rank_nonfinite(rank: int, world: int) -> dict[str, Any]:
    """spngd: one rank's batch has a NaN; every rank must skip the same updates."""
    model = make_model()
    with pytest.raises(ValueError, match="unwrapped"):
        KFACPreconditioner(nn.parallel.DistributedDataParallel(model), strategy="spngd")
    model = make_model()
    pre = KFACPreconditioner(model, strategy="spngd")
    x, y = torch.randn(8, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    pre.step()
    before = {n: (a.clone(), g.clone()) for n, (a, g) in pre.factors().items()}
    model.zero_grad()
    if rank == 1:
        x[0, 0, 0, 0] = float("nan")
    F.cross_entropy(model(x), y).backward()
    pre.step()
    grads = {n: layer.block.weight_grad() for n, layer in pre.layers.items()}
    kept = all(
        torch.equal(a, before[n][0]) and torch.equal(g, before[n][1])
        for n, (a, g) in pre.factors().items()
    )
    return {
        "zeroed": all(int(torch.count_nonzero(g)) == 0 for g in grads.values()),
        "kept": kept and sorted(pre.factors()) == sorted(before),
    }


# ---------------------------------------------------------------- parent-side checks
def _world_run(world: int) -> dict[str, Any]:
    """One spawn for all configurations of a world size, and the serial twin."""
    return {
        "world": world,
        "ranks": run_distributed(_rank_main, world, CONFIGS[world], timeout=120),
        "serial": summary(train(None, world, "replicated")),
    }


@pytest.fixture(scope="module")
def world_run() -> Callable[[int], dict[str, Any]]:
    return once_per_key(_world_run)


def _expected_bytes(world: int, rank: int, strategy: str, fraction: float) -> dict[str, int]:
    """Bytes by kind recorded on ``rank`` over the 4 steps, from the layer shapes."""
    owners = OWNERS[world]
    if strategy == "replicated" or (strategy == "kaisa" and fraction == 1.0):
        return {
            "factors": STEPS * FACTORS,
            "inverses": INVERSE_STEPS * sum(map(_eigen_state, DIMS)),
        }
    if strategy == "kaisa" and round(fraction * world) > 1:
        n = round(fraction * world)
        stride = world // n
        # rank r's grad-worker group is {k : k ≡ r mod P/n}: it receives the layers whose
        # owner is in the same class.
        mine = [name for name in DIMS if owners[name] % stride == rank % stride]
        return {
            "factors": STEPS * FACTORS,
            "inverses": INVERSE_STEPS * sum(map(_eigen_state, mine)),
            "preconditioned": STEPS * GRADS,
        }
    if strategy in ("mem-opt", "kaisa"):  # one grad worker per layer
        return {"factors": STEPS * FACTORS, "preconditioned": STEPS * GRADS}
    if strategy == "dp":
        return {"preconditioned": STEPS * GRADS}
    assert strategy == "spngd"
    return {
        "factors": STEPS * PACKED_FACTORS,
        "gradients": STEPS * (GRADS + LAYERNORM_PARAMS * F64),
        "preconditioned": STEPS * GRADS,
    }


CASES = [pytest.param(w, c, id=f"{w}ranks-{_key(c)}") for w in CONFIGS for c in CONFIGS[w]]
WORLDS = [pytest.param(w, id=f"{w}ranks") for w in CONFIGS]
WorldRun = Callable[[int], dict[str, Any]]


@pytest.mark.parametrize("world,config", CASES)
def test_case_matches_serial_and_ledger(world: int, config: Config, world_run: WorldRun) -> None:
    serial = world_run(world)["serial"]
    strategy, fraction, _ = config
    for rank, res in enumerate(world_run(world)["ranks"]):
        got = res[_key(config)]
        label = f"{world} ranks, {_key(config)}, rank {rank}"
        if strategy != "dp":
            assert_tensors_close(got["params"], serial["params"], label=label, **TOL)
        for row in got["describe"]:
            if row["block"] != "inner optimizer":  # LayerNorm's rows
                assert row["owner"] == OWNERS[world][row["name"]], label
        expected = _expected_bytes(world, rank, strategy, fraction)
        assert {k: v for k, v in got["stats"]["total"].items() if v} == expected, label
        per_step = [step["bytes"] for step in got["stats"]["per_step"]]
        if strategy == "replicated":  # inverse broadcasts on steps 0 and 2 only
            inverses = sum(map(_eigen_state, DIMS))
            assert per_step == [FACTORS + inverses, FACTORS] * 2, label
        if strategy == "spngd":
            assert got["stats"]["last_step"]["by_collective"] == {
                "all_reduce": LAYERNORM_PARAMS * F64,
                "broadcast": 0,
                "reduce_scatter": PACKED_FACTORS + GRADS,
                "all_gather": GRADS,
                "reduce": 0,
                "all_to_all": 0,
            }, label
        owned = [n for n in DIMS if OWNERS[world][n] == rank]
        if strategy != "replicated":  # only owned layers' factors are kept
            assert sorted(got["factors"]) == sorted(owned), label
            bytes_owned = sum(a * a + g * g for n, (a, g) in DIMS.items() if n in owned)
            assert got["memory"]["factors"] == bytes_owned * F64, label
        if strategy in ("mem-opt", "dp", "spngd"):
            assert got["inverse_layers"] == sorted(owned), label
        if strategy not in ("dp", "mem-opt", "spngd") and fraction == 1.0:
            assert_factors_close(got["factors"], serial["factors"], label=label, **TOL)


@pytest.mark.parametrize("world", WORLDS)
def test_dp_factors_are_local_and_dp_training_learns(world: int, world_run: WorldRun) -> None:
    results = world_run(world)["ranks"]
    for rank, res in enumerate(results):
        label = f"{world} ranks, rank {rank}"
        losses = res["dp_losses"]
        assert losses == results[0]["dp_losses"], label
        assert losses[-1] < 0.5 * losses[0], (label, losses)
        local = res["dp_local"]
        assert local["factor_bytes"] == 0, label
        assert sorted(local["factors"]) == sorted(local["accumulated"]), label
        assert_factors_close(
            local["factors"], local["expected"], label=label, kept_only=True, **TOL
        )


def test_nan_on_one_rank_zeroes_every_kfac_gradient_and_keeps_factors(
    world_run: WorldRun,
) -> None:
    """spngd on 2 ranks, a NaN on rank 1 only: both zero every K-FAC gradient, keep factors."""
    assert [res["nonfinite"] for res in world_run(2)["ranks"]] == [
        {"zeroed": True, "kept": True}
    ] * 2


@pytest.mark.parametrize("world", WORLDS)
def test_gathered_checkpoint_is_full_equal_to_serial_and_loads_on_one_rank(
    world: int, world_run: WorldRun
) -> None:
    """mem-opt's gathered state dicts: full, equal to serial, loadable at 1 rank."""
    serial = world_run(world)["serial"]
    for rank, res in enumerate(world_run(world)["ranks"]):
        state = res["checkpoint"]
        for name, (a, g) in serial["factors"].items():
            label = f"{world} ranks, rank {rank}, layer {name}"
            torch.testing.assert_close(state["layers"][name]["A"], a, **TOL, msg=label)
            torch.testing.assert_close(state["layers"][name]["G"], g, **TOL, msg=label)
            assert set(state["layers"][name]["inverse"]) == {"qa", "da", "qg", "dg"}, label
    pre = KFACPreconditioner(make_model(), strategy="replicated")
    pre.load_state_dict(world_run(world)["ranks"][0]["checkpoint"])
    assert pre.steps == STEPS and sorted(pre.factors()) == sorted(DIMS)
