"""The owner exchange's plan (which rows travel where under FSDP2 / HSDP) on hand-worked cases.

Every expected transfer is written out from the cut (``torch.chunk``: ``ceil(rows / parts)``
rows a shard) and the placement; the bytes are rows × row entries × item size.
"""

from __future__ import annotations

import pytest

from dkfac.distributed.assignment import grad_worker_groups, serving_worker
from dkfac.distributed.shard_plan import (
    LayerRows,
    ShardedParam,
    Transfer,
    exchange_bytes,
    gather_plan,
    needed_rows,
    return_plan,
)

# A linear layer of 5 output rows, 3 inputs and a bias, float64, cut over 2 ranks:
# shard 0 holds rows [0, 3), shard 1 rows [3, 5).
LINEAR = [ShardedParam(5, 3, 8, 2), ShardedParam(5, 1, 8, 2)]


def _layer(
    workers: tuple[int, ...], world: int, parts: tuple[tuple[int, int, int], ...]
) -> LayerRows:
    return LayerRows(parts, workers, tuple(serving_worker(workers, world, d) for d in range(world)))


def test_the_owner_receives_the_rows_it_lacks_and_returns_each_rank_its_rows() -> None:
    layer = _layer((0,), 2, ((0, 0, 5), (1, 0, 5)))
    assert gather_plan(LINEAR, [layer], [0, 1], [0, 0]) == [
        Transfer(1, 0, 0, 3, 5),
        Transfer(1, 0, 1, 3, 5),
    ]
    assert return_plan(LINEAR, [layer], [0, 1]) == [
        Transfer(0, 1, 0, 3, 5),
        Transfer(0, 1, 1, 3, 5),
    ]
    # 2 rows of 3 weights and 2 bias entries, 8 bytes each, each way
    assert exchange_bytes(LINEAR, [layer], [0, 1], [0, 0]) == {
        "gradients": (2 * 3 + 2) * 8,
        "preconditioned": (2 * 3 + 2) * 8,
    }


def test_hsdp_gathers_within_the_owners_shard_group_and_returns_to_every_replica() -> None:
    # 2 × 2 mesh: ranks 0, 1 are replica 0 (shards 0, 1), ranks 2, 3 replica 1
    layer = _layer((2,), 4, ((0, 0, 5), (1, 0, 5)))
    shard, replica = [0, 1, 0, 1], [0, 0, 1, 1]
    assert gather_plan(LINEAR, [layer], shard, replica) == [
        Transfer(3, 2, 0, 3, 5),
        Transfer(3, 2, 1, 3, 5),
    ]
    assert return_plan(LINEAR, [layer], shard) == [
        Transfer(2, 0, 0, 0, 3),
        Transfer(2, 0, 1, 0, 3),
        Transfer(2, 1, 0, 3, 5),
        Transfer(2, 1, 1, 3, 5),
        Transfer(2, 3, 0, 3, 5),
        Transfer(2, 3, 1, 3, 5),
    ]
    assert exchange_bytes(LINEAR, [layer], shard, replica) == {
        "gradients": 8 * 8,
        "preconditioned": (3 * 4 + 8 + 8) * 8,
    }


def test_kaisa_half_gathers_to_both_workers_and_each_serves_its_receiver_block() -> None:
    # 8 rows of 1 entry over 4 shards (2 rows each); workers 0 and 2 serve blocks {0,1}, {2,3}
    params = [ShardedParam(8, 1, 4, 4)]
    workers = tuple(grad_worker_groups(4, 0.5)[0])
    assert workers == (0, 2)
    layer = _layer(workers, 4, ((0, 0, 8),))
    assert layer.sources == (0, 0, 2, 2)
    gathered = gather_plan(params, [layer], [0, 1, 2, 3], [0, 0, 0, 0])
    assert {(t.src, t.dst, t.start, t.stop) for t in gathered} == {
        (1, 0, 2, 4), (2, 0, 4, 6), (3, 0, 6, 8), (0, 2, 0, 2), (1, 2, 2, 4), (3, 2, 6, 8)
    }  # fmt: skip
    assert return_plan(params, [layer], [0, 1, 2, 3]) == [
        Transfer(0, 1, 0, 2, 4),
        Transfer(2, 3, 0, 6, 8),
    ]
    assert exchange_bytes(params, [layer], [0, 1, 2, 3], [0] * 4) == {
        "gradients": 12 * 4,
        "preconditioned": 4 * 4,
    }


def test_layers_sharing_a_parameter_move_only_their_own_rows() -> None:
    # one 6-row tensor (shards [0, 3), [3, 6)) read by three layers, as the q, k, v
    # projections read in_proj_weight: rows [0, 2) and [4, 6) owned by rank 0, [2, 4) by 1
    params = [ShardedParam(6, 2, 8, 2)]
    layers = [
        _layer((0,), 2, ((0, 0, 2),)),
        _layer((1,), 2, ((0, 2, 4),)),
        _layer((0,), 2, ((0, 4, 6),)),
    ]
    assert needed_rows(layers, 0) == {0: [(0, 2), (4, 6)]}
    assert needed_rows(layers, 1) == {0: [(2, 4)]}
    assert gather_plan(params, layers, [0, 1], [0, 0]) == [
        Transfer(0, 1, 0, 2, 3),
        Transfer(1, 0, 0, 4, 6),
    ]
    assert return_plan(params, layers, [0, 1]) == [
        Transfer(0, 1, 0, 4, 6),
        Transfer(1, 0, 0, 2, 3),
    ]


def test_every_rank_preconditioning_needs_no_return_and_an_uncut_parameter_no_gather() -> None:
    whole = [ShardedParam(5, 3, 8, 1)]  # a replicated DTensor: every rank holds all rows
    layer = _layer((0,), 2, ((0, 0, 5),))
    assert gather_plan(whole, [layer], [0, 1], [0, 0]) == []
    assert return_plan(whole, [layer], [0, 1]) == [Transfer(0, 1, 0, 0, 5)]
    everyone = _layer((0, 1), 2, ((0, 0, 5), (1, 0, 5)))
    assert return_plan(LINEAR, [everyone], [0, 1]) == []


def test_a_worker_without_the_holder_of_its_rows_in_its_shard_group_is_an_error() -> None:
    layer = _layer((0,), 2, ((0, 0, 5),))
    with pytest.raises(ValueError, match="no rank of its shard group holds shard 1"):
        gather_plan(LINEAR, [layer], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="one entry per rank"):
        gather_plan(LINEAR, [layer], [0, 1], [0])


def test_shards_past_the_end_are_empty() -> None:
    # 3 rows over 4 shards: chunks of 1, the last shard empty
    param = ShardedParam(3, 1, 4, 4)
    assert [param.rows_of(i) for i in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert ShardedParam(3, 1, 4, 1).rows_of(0) == (0, 3)
