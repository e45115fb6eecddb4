"""``dkfac plan --parallel fsdp|hsdp``: the rows are the sharded cost model's, amortised.

The cost model itself is checked against a real 2-rank FSDP2 run's ledger and memory in
tests/costmodel/test_costmodel_sharded.py; here the planner's amortisation over the factor
and inverse intervals, its AdamW row, its recommendation and its refusals.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dkfac.app.models import build_model
from dkfac.app.plan import main as plan_main
from dkfac.costmodel import DtypeBytes, extract_layers
from dkfac.costmodel.sharded import (
    fsdp_bytes,
    predict_sharded_ledger_bytes,
    predict_sharded_memory,
    sharded_state_bytes,
)

BASE = ["--model", "cnn", "--world-size", "4", "--json", "--strategies", "replicated", "mem-opt"]


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert plan_main([*BASE, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _largest(step: dict[int, dict[str, int]]) -> list[int]:
    return [sum(kinds.values()) for kinds in step.values()]


@pytest.mark.parametrize(("parallel", "shard"), [("fsdp", None), ("hsdp", 2)])
def test_rows_are_the_cost_model_amortised(
    capsys: pytest.CaptureFixture[str], parallel: str, shard: int | None
) -> None:
    extra = ["--parallel", parallel, "--factor-interval", "2", "--inverse-interval", "4"]
    if shard:
        extra += ["--shard-size", str(shard)]
    out = _plan(capsys, *extra)
    spec = extract_layers(build_model("cnn", in_channels=1, image_size=8, num_classes=10))
    rows = {r["label"]: r for r in out["rows"]}
    assert list(rows) == ["adamw", "kfac replicated", "kfac mem-opt"]
    frame = sum(fsdp_bytes(spec, 4, shard_size=shard).values())
    adam = sum(sharded_state_bytes(spec, 4, shard_size=shard, optimizer_states=2).values())
    assert rows["adamw"] == {
        "label": "adamw",
        "ledger": 0.0,
        "fsdp": frame,
        "model_state": adam,
        "kfac_memory": 0,
        "transient": 0,
        "total_bytes": float(frame),
        "memory": adam,
    }
    f32 = DtypeBytes()
    for strategy in ("replicated", "mem-opt"):
        kw: dict[str, Any] = {"shard_size": shard, "dtypes": f32}
        plain = _largest(
            predict_sharded_ledger_bytes(
                spec, 4, strategy, factor_step=False, inverse_step=False, **kw
            )
        )
        factors = _largest(
            predict_sharded_ledger_bytes(spec, 4, strategy, inverse_step=False, **kw)
        )
        full = _largest(predict_sharded_ledger_bytes(spec, 4, strategy, **kw))
        want = max(
            p + (f - p) / 2 + (u - f) / 4 for p, f, u in zip(plain, factors, full, strict=True)
        )
        row = rows[f"kfac {strategy}"]
        assert row["ledger"] == pytest.approx(want, rel=1e-12)
        memory = predict_sharded_memory(spec, 4, strategy, dtypes=f32)
        assert row["kfac_memory"] == max(sum(m.values()) for m in memory.values())
        assert row["transient"] == spec.kfac_param_numel * 4
        state = sharded_state_bytes(spec, 4, shard_size=shard, optimizer_states=1)
        assert row["model_state"] == sum(state.values())
    best = min(out["rows"][1:], key=lambda r: r["total_bytes"])
    assert out["recommended"] == best["label"]


def test_a_budget_nothing_fits_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main([*BASE, "--parallel", "fsdp", "--memory-budget-gb", "1e-9"]) == 1
    assert json.loads(capsys.readouterr().out)["recommended"] is None


@pytest.mark.parametrize(
    "extra",
    [
        ["--parallel", "hsdp"],
        ["--parallel", "hsdp", "--shard-size", "3"],
        ["--parallel", "fsdp", "--shard-size", "2"],
        ["--parallel", "tp"],
        ["--parallel", "fsdp", "--strategies", "spngd"],
    ],
)
def test_bad_sharded_input_exits_2(extra: list[str]) -> None:
    assert plan_main([*BASE, *extra]) == 2
