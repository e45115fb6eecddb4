"""Strategies on 2 and 4 gloo ranks against the serial engine and hand-derived byte counts.

Every rank runs several configurations inside one spawned process group (spawning is the
slow part); the parent compares each with a single process on the same global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dkfac import KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.oracles import with_ones
from tests.strategy_cases import DIMS, LAYERNORM_PARAMS, STEPS, make_model, summary, train

# LPT by a³ + g³: "3" (117865) > "0" (6886) > "6" (370).
OWNERS = {2: {"0": 1, "3": 0, "6": 1}, 4: {"0": 1, "3": 0, "6": 2}}
INVERSE_STEPS = 2  # steps 0 and 2 of 4 with inverse_update_interval=2

F64 = 8
FACTORS = sum(a * a + g * g for a, g in DIMS.values()) * F64
PACKED_FACTORS = sum(a * (a + 1) // 2 + g * (g + 1) // 2 for a, g in DIMS.values()) * F64
GRADS = sum(a * g for a, g in DIMS.values()) * F64


def _eigen_state(name: str) -> int:  # qa, da, qg, dg
    a, g = DIMS[name]
    return (a * a + a + g * g + g) * F64


# ---------------------------------------------------------------- rank bodies
def _rank_main(rank: int, world: int, configs: list[tuple[str, float, bool]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, fraction, ddp in configs:
        model, pre = train(rank, world, world, strategy, fraction=fraction, ddp=ddp)
        out[f"{strategy}/{fraction}/{ddp}"] = summary(model, pre)
        if strategy == "mem-opt":
            out["checkpoint"] = pre.state_dict(include_inverses=True)
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


def _dp_training(rank: int, world: int) -> list[float]:
    """dp with DDP on a fixed learnable problem: the global loss before and after."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = KFACPreconditioner(ddp, strategy="dp", damping=0.01, inverse_update_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = (x.sum(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        pre.step(lr=0.1)
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / world)
    return losses


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
def _serial(world: int, strategy: str = "replicated") -> dict[str, Any]:
    return summary(*train(0, 1, world, strategy))


def _assert_params_close(got: dict[str, Any], ref: dict[str, Any], label: str) -> None:
    for p, q in zip(got["params"], ref["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=lambda m: f"{label}: {m}")


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


def _check_world(world: int, configs: list[tuple[str, float, bool]]) -> None:
    results = run_distributed(_rank_main, world, configs, timeout=120)
    serial = _serial(world)
    for strategy, fraction, ddp in configs:
        key = f"{strategy}/{fraction}/{ddp}"
        for rank, res in enumerate(results):
            got = res[key]
            label = f"{key} rank {rank}"
            if strategy != "dp":
                _assert_params_close(got, serial, label)
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
                }, label
            owned = [n for n in DIMS if OWNERS[world][n] == rank]
            if strategy != "replicated":  # only owned layers' factors are kept
                assert sorted(got["factors"]) == sorted(owned), label
                bytes_owned = sum(a * a + g * g for n, (a, g) in DIMS.items() if n in owned)
                assert got["memory"]["factors"] == bytes_owned * F64, label
            if strategy in ("mem-opt", "dp", "spngd"):
                assert got["inverse_layers"] == sorted(owned), label
            if strategy not in ("dp", "mem-opt", "spngd") and fraction == 1.0:
                for name, (a, g) in serial["factors"].items():
                    torch.testing.assert_close(got["factors"][name][0], a, rtol=1e-9, atol=1e-11)
                    torch.testing.assert_close(got["factors"][name][1], g, rtol=1e-9, atol=1e-11)
    for res in results:
        losses = res["dp_losses"]
        assert losses == results[0]["dp_losses"]
        assert losses[-1] < 0.5 * losses[0], losses
        local = res["dp_local"]
        assert local["factor_bytes"] == 0
        assert sorted(local["factors"]) == sorted(local["accumulated"])
        for name, (a, g) in local["factors"].items():
            torch.testing.assert_close(a, local["expected"][name][0], rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(g, local["expected"][name][1], rtol=1e-9, atol=1e-11)
    if world == 2:  # a NaN on rank 1 only: both ranks zero every K-FAC gradient, keep factors
        assert [res["nonfinite"] for res in results] == [{"zeroed": True, "kept": True}] * 2
    if any(s == "mem-opt" for s, _, _ in configs):
        _check_checkpoint(world, [res["checkpoint"] for res in results], serial)


def _check_checkpoint(world: int, states: list[dict[str, Any]], serial: dict[str, Any]) -> None:
    """Gathered state dicts: full, identical on every rank, equal to serial, loadable at 1."""
    for state in states:
        for name, (a, g) in serial["factors"].items():
            torch.testing.assert_close(state["layers"][name]["A"], a, rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(state["layers"][name]["G"], g, rtol=1e-9, atol=1e-11)
            assert set(state["layers"][name]["inverse"]) == {"qa", "da", "qg", "dg"}
    pre = KFACPreconditioner(make_model(), strategy="replicated")
    pre.load_state_dict(states[0])
    assert pre.steps == STEPS and sorted(pre.factors()) == sorted(DIMS)


def test_two_ranks_match_serial_and_ledger() -> None:
    _check_world(
        2,
        [
            ("replicated", 1.0, True),
            ("replicated", 1.0, False),
            ("mem-opt", 1.0, True),
            ("mem-opt", 1.0, False),
            ("kaisa", 0.5, True),
            ("spngd", 1.0, False),
            ("dp", 1.0, True),
        ],
    )


def test_four_ranks_match_serial_and_ledger() -> None:
    _check_world(
        4,
        [
            ("replicated", 1.0, True),
            ("kaisa", 0.5, True),
            ("kaisa", 0.5, False),
            ("kaisa", 0.25, True),
            ("mem-opt", 1.0, False),
            ("spngd", 1.0, False),
            ("dp", 1.0, True),
        ],
    )
