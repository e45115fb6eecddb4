"""Statistics not kept whole, on 2 gloo ranks, equal the serial engine in every layout that
moves factors: the all-reduce of the default strategy (under DDP, and launched from the
backward hooks with ``overlap_comm``), DP-KFAC's owner-only factors, SP-NGD's reduce-scatter
to the owners and FSDP2's sharded parameters.

The case is :data:`~tests.serial_vs_distributed.COMPACT_SIDES` on the strategy tests'
model: its 49-wide input side is one-sided (kept as a ``(49,)`` diagonal) and its 19-wide
one block-diagonal (blocks of 8, 8 and 3). 64 rows a step give full-rank factors (Adam in
an eigenbasis depends on the basis chosen inside a degenerate eigenspace:
tests/engine/test_moments_dist.py). Under ``dp`` every rank trains on the whole batch, so
its owners' local factors are the serial ones.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import (
    COMPACT_SIDES,
    assert_ranks_match,
    shard_children,
    train_sharded,
)
from tests.strategy_cases import DIMS, OPTIONS, STEPS, global_batch, make_model

TOL = {"rtol": 1e-9, "atol": 1e-11}
_batch = functools.partial(global_batch, world_size=8)  # 64 rows
LAYOUTS: dict[str, dict[str, Any]] = {
    "replicated-ddp": {"strategy": "replicated", "ddp": True},
    # the reductions launched from the backward hooks, in buckets sized by stored shapes
    "replicated-overlap": {"strategy": "replicated", "overlap_comm": "on"},
    "dp": {"strategy": "dp"},
    "spngd": {"strategy": "spngd"},
    "fsdp": {"strategy": "replicated", "fsdp": True},
}


def _train(rank: int | None, layout: dict[str, Any]) -> dict[str, Any]:
    options = {**OPTIONS, **COMPACT_SIDES, **layout}
    fsdp = options.pop("fsdp", False)
    if options["strategy"] == "dp":
        rank = None  # every rank the whole batch
    run = train_sharded(
        rank,
        2,
        model_fn=make_model,
        batch_fn=_batch,
        steps=STEPS,
        shard=shard_children if fsdp and rank is not None else None,
        **options,
    )
    state = run.pre.state_dict()  # gathered from the owners: a collective
    return {
        "params": run.params(),
        "factors": {name: (e["A"], e["G"]) for name, e in state["layers"].items()},
        "kinds": {name: layer.summary()["a_factor"] for name, layer in run.pre.layers.items()},
    }


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    del world
    return {key: _train(rank, layout) for key, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_rank_main, 2, timeout=240)


@pytest.fixture(scope="module")
def serial() -> dict[str, Any]:
    return _train(None, {"strategy": "replicated"})


def test_the_case_keeps_a_diagonal_and_blocks(serial: dict[str, Any]) -> None:
    assert serial["kinds"] == {"0": "blockdiag", "3": "diagonal", "6": "dense"}
    assert serial["factors"]["3"][0].shape == (DIMS["3"][0],)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compact_sides_on_two_ranks_equal_serial(
    layout: str, two_ranks: list[dict[str, Any]], serial: dict[str, Any]
) -> None:
    assert_ranks_match(
        [out[layout]["params"] for out in two_ranks], serial["params"], label=layout, **TOL
    )
    for rank, out in enumerate(two_ranks):
        assert out[layout]["kinds"] == serial["kinds"]
        for name, (a, g) in out[layout]["factors"].items():
            want_a, want_g = serial["factors"][name]
            msg = f"{layout}, rank {rank}, {name}"
            torch.testing.assert_close(a, want_a, **TOL, msg=lambda m, s=msg: f"{s} A: {m}")
            torch.testing.assert_close(g, want_g, **TOL, msg=lambda m, s=msg: f"{s} G: {m}")
