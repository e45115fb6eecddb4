"""The serial-vs-distributed harness itself (tests/serial_vs_distributed.py), one process.

Oracles: micro-batch rows written out by hand; a memoised failure raised again without a
second call; and micro-batching on the LayerNorm model (per-sample normalisation, loss
divided by the micro-batch count) giving the single-batch run up to rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.serial_vs_distributed import (
    Hooks,
    Run,
    assert_tensors_close,
    micro_batch_rows,
    once_per_key,
    train_sharded,
)
from tests.strategy_cases import OPTIONS, global_batch, make_model


@pytest.mark.parametrize(
    "rank,micro,expected",
    [
        (0, 1, [[0, 1, 2, 3]]),
        (1, 2, [[4, 5], [6, 7]]),
        (None, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (None, 2, [[0, 1, 4, 5], [2, 3, 6, 7]]),  # micro-batch k of every rank, rank order
    ],
)
def test_micro_batch_rows(rank: int | None, micro: int, expected: list[list[int]]) -> None:
    assert [r.tolist() for r in micro_batch_rows(8, 2, rank, micro)] == expected


def test_micro_batch_rows_refuses_uneven_cuts() -> None:
    with pytest.raises(ValueError, match="7 rows do not cut into 2 shards of 1"):
        micro_batch_rows(7, 2, 0, 1)


def test_once_per_key_remembers_values_and_failures() -> None:
    calls: list[int] = []

    def compute(key: int) -> int:
        calls.append(key)
        if key < 0:
            raise RuntimeError(f"bad {key}")
        return 2 * key

    get = once_per_key(compute)
    assert (get(3), get(3)) == (6, 6)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="bad -1"):
            get(-1)
    assert calls == [3, -1]


def test_accumulation_is_wired_and_hooks_see_every_step() -> None:
    seen: list[tuple[str, int]] = []
    hooks = Hooks(
        setup=lambda run: seen.append(("setup", run.step)),
        before_forward=lambda run: seen.append(("before", run.step)),
        after_backward=lambda run: seen.append(("backward", run.step)),
        after_step=lambda run: seen.append(("step", run.step)),
    )
    common = {"model_fn": make_model, "batch_fn": functools.partial(global_batch, world_size=2)}
    micro: Run = train_sharded(None, 2, steps=3, micro=2, hooks=hooks, **common, **OPTIONS)
    whole = train_sharded(None, 2, steps=3, **common, **OPTIONS)
    assert seen == [("setup", 0)] + [
        (e, s) for s in range(3) for e in ("before", "backward", "step")
    ]
    assert_tensors_close(
        micro.params(), whole.params(), label="micro 2 vs 1", rtol=1e-9, atol=1e-11
    )
    torch.testing.assert_close(torch.stack(micro.losses), torch.stack(whole.losses))
    with pytest.raises(TypeError, match="micro="):
        train_sharded(None, 1, steps=1, accumulation_steps=2, **common)
