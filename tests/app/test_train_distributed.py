"""The trainer inside an initialised 2-rank gloo group (what torchrun gives the program)."""

from __future__ import annotations

from typing import Any

import torch

from dkfac.app.checkpoint import load_checkpoint
from dkfac.app.cli import parse_args
from dkfac.app.trainer import train
from dkfac.engine.optimizer_state import unpack
from tests.cli_args import TINY
from tests.distributed_utils import run_distributed

ARGS = ["train", *TINY, "--epochs", "2", "--device", "cpu"]


def _run(rank: int, world_size: int, extra: list[str]) -> dict[str, Any]:
    result = train(parse_args([*ARGS, *extra]), write=False)
    return {
        "records": [
            {k: v for k, v in r.items() if "seconds" not in k and "time" not in k}
            for r in result.records
        ],
        "params": {k: v.detach().clone() for k, v in result.model.state_dict().items()},
        "steps": result.steps,
    }


def test_two_ranks_sgd_equal_one_process_on_the_global_batch() -> None:
    # Each rank takes 8 of every 16 samples of the shared permutation, DDP averages the
    # gradients: the union of the two shards is the single process's batch, so the math is
    # the same up to float32 summation order.
    extra = ["--optimizer", "sgd", "--lr", "0.1"]
    ranks = run_distributed(_run, 2, extra)
    serial = _run(0, 1, extra)
    assert ranks[0]["steps"] == ranks[1]["steps"] == serial["steps"] == 8
    assert ranks[0]["records"] == ranks[1]["records"]  # rank-averaged metrics agree
    for name, value in serial["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-4, atol=1e-5)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])
    for mine, theirs in zip(ranks[0]["records"], serial["records"], strict=True):
        assert mine["step"] == theirs["step"] and mine["kind"] == theirs["kind"]
        assert abs(mine["loss"] - theirs["loss"]) < 1e-4


def test_sgd_given_strategy_spngd_is_still_averaged_by_ddp() -> None:
    # --strategy spngd leaves the model unwrapped because K-FAC then averages the
    # gradients itself; a run without K-FAC (one of compare's optimizers) needs DDP still.
    extra = ["--optimizer", "sgd", "--lr", "0.1", "--strategy", "spngd"]
    ranks = run_distributed(_run, 2, extra)
    for name, value in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], value), name


def test_two_ranks_kfac_equal_one_process_on_the_global_batch() -> None:
    # The replicated strategy averages the ranks' factors: with equal shards that is the
    # factor of the global batch, so the run is the serial run up to float32 rounding.
    extra = ["--optimizer", "kfac", "--inverse-update-interval", "2", "--damping", "0.05"]
    ranks = run_distributed(_run, 2, extra)
    serial = _run(0, 1, extra)
    assert ranks[0]["steps"] == ranks[1]["steps"] == serial["steps"] == 8
    assert ranks[0]["records"] == ranks[1]["records"]
    for name, value in serial["params"].items():
        assert torch.equal(ranks[1]["params"][name], ranks[0]["params"][name]), name
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-3, atol=1e-4)


def _run_writing(rank: int, world_size: int, out: str, strategy: str) -> int:
    extra = ["--optimizer", "kfac", "--strategy", strategy, "--out", out, "--checkpoint-every", "3"]
    return train(parse_args([*ARGS, *extra]), write=True).steps


def test_two_ranks_write_checkpoints_with_every_layers_factors(tmp_path) -> None:
    # The preconditioner's state_dict is a collective (factors gathered from their owners):
    # a checkpoint built on rank 0 alone hung the job. Every rank must build it.
    for strategy in ("mem-opt", "spngd"):
        out = tmp_path / strategy
        assert run_distributed(_run_writing, 2, str(out), strategy, timeout=120) == [8, 8]
        files = sorted(out.rglob("*.pt"))
        assert files, f"{strategy}: no checkpoint written"
        state = load_checkpoint(files[-1])
        layers = unpack(state["optimizer"])[1]["layers"]
        assert layers and all(
            entry["A" if "A" in entry else "F"] is not None for entry in layers.values()
        )
