"""An unbatched position lookup (GPT-2's ``wpe(arange(T))``) on 2 gloo ranks equals serial.

Its output is broadcast over the batch, so its output gradient arrives summed over the
samples and its ``G`` is quadratic in the batch's mean gradient: averaging each rank's ``G``
is not the serial ``G`` of the global batch (it ended 1e-7 to 1e-2 away, depending on the
damping). The capture averages those rows over the ranks first; every parameter of the
GPT (MultiheadAttention, both embeddings, LayerNorms) then matches the serial twin to
rounding, with DDP, with gradients averaged by hand, with micro-batches and under
``spngd``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.serial_vs_distributed import assert_ranks_match, once_per_key, train_sharded
from tests.transformer_cases import LENGTH, WIDTH, gpt_batch, make_gpt

STEPS = 5
OPTIONS: dict[str, Any] = {"method": "eigen", "damping": 1e-3, "inverse_update_interval": 2}
CASES: dict[str, dict[str, Any]] = {
    "ddp": {"ddp": True},
    "ddp-micro2": {"ddp": True, "micro": 2},
    "bare": {},
    "spngd": {"strategy": "spngd"},
}
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _train(rank: int | None, world: int, case: dict[str, Any]) -> Any:
    return train_sharded(
        rank, world, model_fn=make_gpt, batch_fn=gpt_batch, steps=STEPS, **OPTIONS, **case
    )


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, case in CASES.items():
        run = _train(rank, world, case)
        out[key] = {"params": run.params(), "stats": run.pre.comm_stats()}
    return out


_spawned = once_per_key(lambda world: run_distributed(_rank_main, world, timeout=240))


@pytest.mark.parametrize("key", list(CASES))
def test_gpt_with_unbatched_position_lookup_equals_serial(key: str) -> None:
    results = _spawned(2)
    serial = _train(None, 2, {k: v for k, v in CASES[key].items() if k != "ddp"})
    assert_ranks_match([r[key]["params"] for r in results], serial.params(), label=key, **TOL)


def test_the_position_rows_travel_on_the_ledger() -> None:
    # The LENGTH x WIDTH float64 rows travel once a factor step, summed over the step's
    # micro-batches first (the broadcast layer's G is built at the step): the ddp-micro2 run
    # sends exactly the factor bytes of the ddp run, and both more than the factors alone.
    stats = {key: _spawned(2)[0][key]["stats"] for key in ("ddp", "ddp-micro2")}
    rows = LENGTH * WIDTH * 8
    assert stats["ddp-micro2"]["total"]["factors"] == stats["ddp"]["total"]["factors"]
    assert stats["ddp"]["total"]["factors"] >= STEPS * rows


def test_one_process_keeps_the_rows_local() -> None:
    run = _train(None, 1, {})
    assert run.pre.capture.rank_mean is None
    assert torch.isfinite(torch.stack(run.losses)).all()
