"""Oracle tests for the pure placement functions in dkfac.distributed.assignment."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dkfac.blocks.base import kronecker_cost
from dkfac.distributed.assignment import (
    LayerPlacement,
    assign_lpt,
    grad_receiver_groups,
    grad_source_for,
    grad_worker_count,
    grad_worker_groups,
    grad_workers_for,
    plan_placement,
    shard_offsets,
    shard_sizes,
)

COSTS = {"a": 10.0, "b": 8.0, "c": 6.0, "d": 5.0, "e": 4.0}


# -- layer_cost ----------------------------------------------------------------------------


def test_layer_cost_exact() -> None:
    assert kronecker_cost(28, 16, "compute") == 28**3 + 16**3 == 26048
    assert kronecker_cost(28, 16, "memory") == 28**2 + 16**2 == 1040
    assert kronecker_cost(1, 1) == 2.0  # default kind is compute
    assert isinstance(kronecker_cost(3, 4, "memory"), float)


@pytest.mark.parametrize(
    ("args", "word"),
    [((0, 3, "compute"), "a_dim"), ((3, -1, "compute"), "g_dim"), ((3, 3, "flops"), "kind")],
)
def test_layer_cost_validation(args: tuple, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        kronecker_cost(*args)


# -- assign_lpt ----------------------------------------------------------------------------


def test_lpt_hand_worked_two_ranks() -> None:
    # a(10)->0 [10,0]; b(8)->1 [10,8]; c(6)->1 [10,14]; d(5)->0 [15,14]; e(4)->1 [15,18]
    assert assign_lpt(COSTS, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}


def test_lpt_hand_worked_four_ranks() -> None:
    # a,b,c,d fill ranks 0..3 (loads 10,8,6,5); e goes to the lightest, rank 3
    assert assign_lpt(COSTS, 4) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 3}


def test_lpt_ties_broken_by_name_then_rank() -> None:
    costs = {"z": 1.0, "x": 1.0, "y": 1.0, "w": 1.0}
    # visiting order w, x, y, z; z finds equal loads and equal counts -> lowest rank 0
    assert assign_lpt(costs, 3) == {"z": 0, "x": 1, "y": 2, "w": 0}


def test_lpt_layer_costs_from_shapes() -> None:
    costs = {
        "conv1": kronecker_cost(28, 16),  # 26,048
        "conv2": kronecker_cost(145, 32),  # 3,081,393
        "fc": kronecker_cost(513, 10),  # 135,006,697
    }
    assert assign_lpt(costs, 2) == {"conv1": 1, "conv2": 1, "fc": 0}


def test_lpt_result_keeps_input_order_and_is_deterministic() -> None:
    forward = assign_lpt(COSTS, 3)
    backward = assign_lpt(dict(reversed(list(COSTS.items()))), 3)
    assert forward == backward == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 1}
    assert list(forward) == list(COSTS)
    assert list(backward) == list(reversed(list(COSTS)))
    assert all(assign_lpt(COSTS, 3) == forward for _ in range(5))


def test_lpt_more_ranks_than_layers() -> None:
    owners = assign_lpt({"a": 3.0, "b": 2.0}, 4)
    assert owners == {"a": 0, "b": 1}
    assert set(range(4)) - set(owners.values()) == {2, 3}  # ranks 2 and 3 own nothing


def test_lpt_world_one_and_empty() -> None:
    assert assign_lpt(COSTS, 1) == dict.fromkeys(COSTS, 0)
    assert assign_lpt({}, 3) == {}


def test_lpt_zero_costs_spread_by_layer_count() -> None:
    assert assign_lpt({"a": 0.0, "b": 0.0, "c": 0.0}, 2) == {"a": 0, "b": 1, "c": 0}


@pytest.mark.parametrize("world_size", [0, -2])
def test_lpt_rejects_bad_world_size(world_size: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        assign_lpt(COSTS, world_size)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_lpt_rejects_bad_costs(bad: float) -> None:
    with pytest.raises(ValueError, match=r"costs\['b'\]"):
        assign_lpt({"a": 1.0, "b": bad}, 2)


# -- KAISA grad-worker groups --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "n", "workers", "receivers"),
    [
        (1.0, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
        (0.5, 2, [[0, 2], [1, 3]], [[0, 1], [2, 3]]),
        (0.25, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    ],
)
def test_grad_worker_groups_p4(
    fraction: float, n: int, workers: list[list[int]], receivers: list[list[int]]
) -> None:
    assert grad_worker_count(4, fraction) == n
    assert grad_worker_groups(4, fraction) == workers
    assert grad_receiver_groups(4, fraction) == receivers


def test_grad_worker_groups_p6_and_world_one() -> None:
    assert grad_worker_groups(6, 1 / 3) == [[0, 3], [1, 4], [2, 5]]
    assert grad_receiver_groups(6, 1 / 3) == [[0, 1, 2], [3, 4, 5]]
    assert grad_worker_groups(1, 1.0) == [[0]]
    assert grad_worker_count(1, 0.5) == 1  # one process: the serial engine, whatever f
    assert grad_worker_groups(1, 0.25) == [[0]]


def test_grad_workers_for_owner() -> None:
    assert grad_workers_for(3, 4, 0.5) == [1, 3]
    assert grad_workers_for(2, 4, 0.5) == [0, 2]
    assert grad_workers_for(2, 4, 1.0) == [0, 1, 2, 3]  # COMM-OPT: everybody
    assert grad_workers_for(2, 4, 0.25) == [2]  # MEM-OPT: the owner only


def test_grad_source_for() -> None:
    # owner 1, f = 0.5: workers [1, 3]; receiver blocks [0, 1] and [2, 3]
    assert [grad_source_for(r, 1, 4, 0.5) for r in range(4)] == [1, 1, 3, 3]
    assert [grad_source_for(r, 2, 4, 0.25) for r in range(4)] == [2, 2, 2, 2]
    assert [grad_source_for(r, 2, 4, 1.0) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("world_size", "fraction", "match"),
    [
        (4, 0.75, "divisible"),  # n = 3 does not divide 4
        (4, 0.1, "divisible"),  # n = round(0.4) = 0
        (4, 0.0, "grad_worker_fraction"),
        (4, 1.5, "grad_worker_fraction"),
        (4, math.nan, "grad_worker_fraction"),
        (0, 0.5, "world_size"),
    ],
)
def test_invalid_fractions(world_size: int, fraction: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grad_worker_groups(world_size, fraction)


def test_bad_owner_rejected() -> None:
    with pytest.raises(ValueError, match="owner"):
        grad_workers_for(4, 4, 0.5)
    with pytest.raises(ValueError, match="rank"):
        grad_source_for(-1, 0, 4, 0.5)


# -- plan_placement ------------------------------------------------------------------------


def test_plan_placement_hybrid() -> None:
    plan = plan_placement(COSTS, 4, 0.5)  # owners a0 b1 c2 d3 e3; groups [0,2], [1,3]
    assert plan == {
        "a": LayerPlacement(name="a", inverse_owner=0, grad_workers=(0, 2)),
        "b": LayerPlacement(name="b", inverse_owner=1, grad_workers=(1, 3)),
        "c": LayerPlacement(name="c", inverse_owner=2, grad_workers=(0, 2)),
        "d": LayerPlacement(name="d", inverse_owner=3, grad_workers=(1, 3)),
        "e": LayerPlacement(name="e", inverse_owner=3, grad_workers=(1, 3)),
    }
    assert plan["b"].is_grad_worker(3) and not plan["b"].is_grad_worker(0)
    assert [plan["b"].grad_source(r, 4) for r in range(4)] == [1, 1, 3, 3]


def test_plan_placement_comm_opt_and_mem_opt() -> None:
    comm_opt = plan_placement(COSTS, 4, 1.0)
    mem_opt = plan_placement(COSTS, 4, 0.25)
    assert all(p.grad_workers == (0, 1, 2, 3) for p in comm_opt.values())
    assert all(p.grad_workers == (p.inverse_owner,) for p in mem_opt.values())
    assert {n: p.inverse_owner for n, p in mem_opt.items()} == assign_lpt(COSTS, 4)


def test_layer_placement_is_frozen_keyword_only() -> None:
    placement = LayerPlacement(name="a", inverse_owner=0, grad_workers=(0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.inverse_owner = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        LayerPlacement("a", 0, (0,))  # type: ignore[misc]


# -- shards --------------------------------------------------------------------------------


def test_shard_sizes_and_offsets() -> None:
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(2, 4) == [1, 1, 0, 0]
    assert shard_sizes(0, 1) == [0]
    assert shard_offsets(10, 4) == [0, 3, 6, 8, 10]
    with pytest.raises(ValueError, match="total"):
        shard_sizes(-1, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_sizes(3, 0)
