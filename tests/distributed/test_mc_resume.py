"""A resumed 2-rank run with the Monte-Carlo Fisher is the uninterrupted one (2 gloo ranks).

Each rank samples its targets from its own generator (seeded ``seed + index``). The state
dict held the saving rank's generator alone, so a resume gave every rank rank 0's stream:
the weights ended 1e-2 from the uninterrupted run's. It now holds every rank's, and each
rank takes its own back. Oracle: 2 steps, rank 0 saves (through ``torch.save``), every rank
loads that checkpoint into a fresh model and optimizer, 2 more steps: bit-equal to 4 steps
in one go, on both ranks. On more ranks than saved, a further rank starts a stream of its
own: a 1-rank checkpoint resumed on 2 ranks gave both ranks rank 0's stream.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed

DT = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def _train(model: nn.Module, opt: KFACOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(8, 6, generator=gen, dtype=DT)
        y = torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        outputs = model(x)
        opt.preconditioner.sample_fisher(outputs)
        nn.functional.cross_entropy(outputs, y).backward()
        opt.step()


def _optimizer(model: nn.Module) -> KFACOptimizer:
    return KFACOptimizer.for_model(
        model, lr=0.05, fisher="mc", overhead=None, factor_update_interval=1,
        inverse_update_interval=1,
    )  # fmt: skip


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    whole = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(whole)
    _train(whole, opt, rank, range(4))

    first = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(first)
    _train(first, opt, rank, range(2))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    written = [buffer.getvalue()]  # rank 0 writes the checkpoint, every rank reads it
    torch.distributed.broadcast_object_list(written, src=0)
    saved = torch.load(io.BytesIO(written[0]), weights_only=False)
    resumed = nn.parallel.DistributedDataParallel(_model())
    resumed.load_state_dict(saved["model"])
    opt = _optimizer(resumed)
    opt.load_state_dict(saved["opt"])
    _train(resumed, opt, rank, range(2, 4))
    return {
        "whole": [p.detach().clone() for p in whole.parameters()],
        "resumed": [p.detach().clone() for p in resumed.parameters()],
    }


def test_a_resumed_monte_carlo_run_is_the_uninterrupted_one() -> None:
    for result in run_distributed(_rank_main, 2, timeout=120):
        for whole, resumed in zip(result["whole"], result["resumed"], strict=True):
            assert torch.equal(whole, resumed)


def _more_ranks_main(rank: int, world: int, saved: dict[str, Any]) -> dict[str, Any]:
    """Both ranks load a checkpoint one process wrote into a DDP model, take a step and
    save again (a collective gather)."""
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(model)
    opt.load_state_dict(saved)
    loaded = opt.preconditioner.capture.generator.get_state()  # type: ignore[union-attr]
    _train(model, opt, rank, range(2, 3))
    return {"loaded": loaded, "again": opt.preconditioner.state_dict()["mc_generators"]}


def test_more_ranks_than_saved_sample_streams_of_their_own() -> None:
    """Rank 0 takes the saved stream back; rank 1 starts its own (``seed + 1``, as a fresh
    run's rank 1): the two ranks' generators differ, and the next save gathers both."""
    alone = _model()
    opt = _optimizer(alone)
    _train(alone, opt, 0, range(2))
    saved = opt.state_dict()
    every = opt.preconditioner.state_dict()["mc_generators"]
    assert len(every) == 1  # one process: its one generator in the list
    first, second = run_distributed(_more_ranks_main, 2, saved, timeout=120)
    assert torch.equal(first["loaded"], every[0])
    assert not torch.equal(second["loaded"], first["loaded"])
    assert torch.equal(second["loaded"], torch.Generator().manual_seed(1).get_state())
    assert len(first["again"]) == 2 and not torch.equal(first["again"][0], first["again"][1])


def test_a_list_of_generator_states_with_a_gap_is_refused() -> None:
    """Every rank's entry must be a state: a rank given ``None`` would keep no generator and
    skip the gather the others run at the next save. Refused, as is a list that is not one;
    nothing changes; a full list loads."""

    model = _model()
    opt = _optimizer(model)
    _train(model, opt, 0, range(1))
    state = opt.preconditioner.state_dict()
    own = state["mc_generator"]
    before = opt.preconditioner.capture.generator.get_state()  # type: ignore[union-attr]
    for bad, message in (([None, own], r"mc_generators\[0\]' is None"), (own, "got a Tensor")):
        with pytest.raises(ValueError, match=message):
            opt.preconditioner.load_state_dict({**state, "mc_generators": bad})
    assert torch.equal(opt.preconditioner.capture.generator.get_state(), before)  # type: ignore[union-attr]
    opt.preconditioner.load_state_dict({**state, "mc_generators": [own, own.clone()]})
