"""The cost model's byte and memory predictions against the real engine at 2 and 4 gloo ranks.

Every rank trains three small float64 models (the strategy-test model, a CNN with a
``BatchNorm2d`` and a ``BatchNorm1d``, and one with a depthwise and a grouped convolution,
all of which the engine preconditions unit-wise) under every
strategy for three steps with ``inverse_update_interval=2``: steps 0 and 2 update factors and
inverses, step 1 factors only. The parent asserts, per rank and per step, that the ledger's
bytes by kind equal :func:`dkfac.costmodel.predict_ledger_bytes` for that step kind, and that
``pre.memory_usage()`` read just before ``pre.step()`` (accumulators full, factors and
inverses from the previous steps) equals :func:`dkfac.costmodel.predict_memory`. The engine
is the reference: nothing here is derived from the cost model's own formulas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dkfac import KFACPreconditioner
from dkfac.costmodel import DtypeBytes, extract_layers, predict_ledger_bytes, predict_memory
from tests.distributed_utils import run_distributed
from tests.strategy_cases import make_bn_model, make_grouped_model, make_model

STEPS = 3
PER_RANK = 8
F64 = DtypeBytes(factor=8, inverse=8, grad=8)
# (strategy, grad_worker_fraction, extra options); the last one at 4 ranks only.
CONFIGS: list[tuple[str, float, dict[str, Any]]] = [
    ("replicated", 1.0, {}),
    ("kaisa", 0.5, {}),
    ("mem-opt", 1.0, {}),
    ("dp", 1.0, {}),
    ("spngd", 1.0, {}),
    # eigen_adam: moments on the ranks that precondition a layer, and Adam's for the
    # LayerNorm no block takes (leftover_update) on every rank
    ("kaisa", 0.5, {"method": "eigen_adam"}),
    ("spngd", 1.0, {"method": "eigen_adam"}),
    ("kaisa", 0.5, {"method": "cholesky", "pack_triangles": True}),
]


MODELS = {"mlp": make_model, "bn": make_bn_model, "grouped": make_grouped_model}


def _run(rank: int, model_name: str, strategy: str, fraction: float, options: dict) -> dict:
    model = MODELS[model_name]()
    pre = KFACPreconditioner(
        model,
        strategy=strategy,
        grad_worker_fraction=fraction,
        inverse_update_interval=2,
        damping=0.01,
        **options,
    )
    memory = []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(PER_RANK, 2, 4, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (PER_RANK,), generator=gen)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        memory.append(pre.memory_usage())
        pre.step(lr=0.1)
    return {
        "per_step": [step["by_kind"] for step in pre.comm_stats()["per_step"]],
        "memory": memory,
        "after": pre.memory_usage(),
    }


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    return {
        (m, s, f, i): _run(rank, m, s, f, opts)
        for m in MODELS
        for i, (s, f, opts) in enumerate(_configs(world))
    }


def _configs(world: int) -> list[tuple[str, float, dict[str, Any]]]:
    return CONFIGS if world == 4 else CONFIGS[:-1]


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_and_memory_equal_cost_model(world: int) -> None:
    results = run_distributed(_rank_main, world, timeout=180)
    for model_name, factory in MODELS.items():
        spec = extract_layers(factory())
        if model_name == "bn":
            assert [x.kind for x in spec.layers].count("batchnorm") == 2
        for i, (strategy, fraction, options) in enumerate(_configs(world)):
            kw: dict[str, Any] = {
                "grad_worker_fraction": fraction,
                "method": options.get("method", "eigen"),
                "dtypes": F64,
            }
            full = predict_ledger_bytes(
                spec, world, strategy, pack_triangles=options.get("pack_triangles"), **kw
            )
            factor_only = predict_ledger_bytes(
                spec,
                world,
                strategy,
                inverse_step=False,
                pack_triangles=options.get("pack_triangles"),
                **kw,
            )
            memory = predict_memory(spec, world, strategy, **kw)
            for rank, res in enumerate(results):
                got = res[(model_name, strategy, fraction, i)]
                label = f"{model_name} {strategy}(f={fraction}, {options}) rank {rank}/{world}"
                assert got["per_step"] == [full[rank], factor_only[rank], full[rank]], label
                # Before step 0 nothing but the accumulators exists; from step 1 on, all.
                first = {**memory[rank], "factors": 0, "inverses": 0, "moments": 0}
                assert got["memory"] == [first, memory[rank], memory[rank]], label
                assert got["after"] == {**memory[rank], "accumulators": 0}, label
