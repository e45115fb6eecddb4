"""A rank with an empty batch at a capture step while the other has rows (2 gloo ranks).

DDP averages the empty rank's zero gradient with the other's; the statistics follow the same
convention: the empty rank takes part in their average with zeros, so both ranks send the
same collectives (otherwise gloo aborts on a collective mismatch). Oracle: after the step the
running factors are half those of a single process that saw rank 1's batch alone (its
statistics averaged with rank 0's zeros), on the overlapped path and without it, and both
ranks hold the same parameters. The model has a convolution, whose empty input does not
even reshape into rows; a second model routes no row to one expert on rank 0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed

DT = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 25, 8),
        nn.Tanh(),
        nn.Linear(8, 4),
    ).to(DT)


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1, 5, 5, generator=gen, dtype=DT), torch.randint(0, 4, (rows,))


def _optimizer(model: nn.Module, **options: Any) -> KFACOptimizer:
    return KFACOptimizer.for_model(model, lr=0.05, overhead=None, **options)


def _step(model: nn.Module, opt: KFACOptimizer, rows: int, seed: int) -> None:
    x, y = _batch(rows, seed)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()


def _rank_main(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(model, **options)
    _step(model, opt, 0 if rank == 0 else 6, seed=1)  # rank 0 empty at the first capture
    factors = {n: (a.clone(), g.clone()) for n, (a, g) in opt.preconditioner.factors().items()}
    _step(model, opt, 6, seed=2 + rank)  # both with rows: the run goes on
    params = [p.detach().clone() for p in model.parameters()]
    return {"factors": factors, "params": params}


@pytest.mark.parametrize(
    "options",
    [{}, {"overlap_comm": "off"}, {"strategy": "kaisa", "overlap_comm": "off"}],
    ids=["overlapped", "not-overlapped", "kaisa"],
)
def test_empty_rank_takes_part_with_zero_statistics(options: dict[str, Any]) -> None:
    results = run_distributed(_rank_main, 2, options, timeout=120)

    serial_model = _model()
    serial = _optimizer(serial_model)
    _step(serial_model, serial, 6, seed=1)  # rank 1's batch alone
    expected = serial.preconditioner.factors()
    assert set(expected) == {"0", "3", "5"}

    kept = [name for result in results for name in result["factors"]]
    assert set(kept) == set(expected)  # kaisa keeps a layer's factors on its owner only
    for result in results:
        for name, (got_a, got_g) in result["factors"].items():
            a, g = expected[name]
            torch.testing.assert_close(got_a, 0.5 * a, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got_g, 0.5 * g, rtol=1e-10, atol=1e-12)
    for p0, p1 in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p0, p1)
        assert torch.isfinite(p0).all()


class _Routed(nn.Module):
    """Two experts, each applied to the rows routed to it (by the sign of a feature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(5, 6)
        self.experts = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        first = x[:, 0] > 0
        out = torch.zeros_like(h)
        out = out.index_put((first.nonzero().squeeze(1),), self.experts[0](h[first]))
        out = out.index_put(((~first).nonzero().squeeze(1),), self.experts[1](h[~first]))
        return self.head(out)


def _routed_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 5, generator=gen, dtype=DT)
    if rank == 0:
        x[:, 0] = x[:, 0].abs() + 0.1  # no row is routed to expert 1 on rank 0
    return x, torch.randint(0, 3, (8,), generator=gen)


def _routed_main(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_Routed().to(DT))  # overlapped by default
    opt = _optimizer(model)
    x, y = _routed_batch(rank)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    a, g = opt.preconditioner.factors()["experts.1"]
    return {"expert": (a.clone(), g.clone()), "params": list(model.parameters())}


def test_expert_without_rows_on_one_rank() -> None:
    """An expert no row was routed to on rank 0 (the module is called with 0 rows): its
    factors are half of rank 1's own, and the ranks keep the same weights."""
    results = run_distributed(_routed_main, 2, timeout=120)
    serial_model = _Routed().to(DT)
    serial = _optimizer(serial_model)
    x, y = _routed_batch(1)
    nn.functional.cross_entropy(serial_model(x), y).backward()
    serial.step()
    a, g = serial.preconditioner.factors()["experts.1"]
    for result in results:
        torch.testing.assert_close(result["expert"][0], 0.5 * a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result["expert"][1], 0.5 * g, rtol=1e-10, atol=1e-12)
    for p0, p1 in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p0, p1)


class _Positions(nn.Module):
    """Token and position tables, the positions looked up unbatched (``arange(T)``, added
    to every sample by broadcasting, as nanoGPT does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(11, 6), nn.Embedding(5, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(h).mean(1))


def _positions_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return torch.randint(0, 11, (rows, 5), generator=gen), torch.randint(0, 4, (rows,))


def _positions_main(rank: int, world: int, overlap: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_Positions().to(DT))
    opt = _optimizer(model, overlap_comm=overlap)
    x, y = _positions_batch(0 if rank == 0 else 6)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    a, g = opt.preconditioner.factors()["pos"]
    return {"pos": (a.clone(), g.clone()), "params": list(model.parameters())}


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_an_empty_rank_with_a_broadcast_position_table(overlap: str) -> None:
    """The empty rank's position lookup is broadcast as on the rank with rows: its G comes
    at the step's end on both (it came from the backward on the empty rank, whose blocking
    average over the ranks then met DDP's collectives: gloo aborted). Its G's rows are the
    batch's mean gradient, averaged over the ranks before their products: a quarter of
    rank 1's own (half its mean gradient, squared); its A is rank 1's."""
    results = run_distributed(_positions_main, 2, overlap, timeout=120)
    serial_model = _Positions().to(DT)
    serial = _optimizer(serial_model)
    x, y = _positions_batch(6)
    nn.functional.cross_entropy(serial_model(x), y, reduction="sum").backward()
    serial.step()
    a, g = serial.preconditioner.factors()["pos"]
    for result in results:
        torch.testing.assert_close(result["pos"][0], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result["pos"][1], 0.25 * g, rtol=1e-10, atol=1e-12)
    for p0, p1 in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p0, p1)


def _everywhere_main(rank: int, world: int, overlap: str) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(model, overlap_comm=overlap)
    _step(model, opt, 0, seed=1)  # no rank has a row
    _step(model, opt, 6, seed=2)  # the same rows on both ranks
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_step_without_rows_on_any_rank_is_skipped_as_in_one_process(overlap: str) -> None:
    """Every rank empty at the first capture step: the layers' statistics are zeros alone,
    which are no factors (a first value of zeros left them 1/20 of their scale after the
    next step, and the weights 4.7 from the serial run's under plain K-FAC). They are
    skipped on every rank, as one process skips the step: with the same rows on both ranks
    at the next step, the run equals the serial one."""
    results = run_distributed(_everywhere_main, 2, overlap, timeout=120)
    serial_model = _model()
    serial = _optimizer(serial_model)
    _step(serial_model, serial, 0, seed=1)
    _step(serial_model, serial, 6, seed=2)
    for result in results:
        for mine, theirs in zip(result, serial_model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
