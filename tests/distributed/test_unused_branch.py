"""Layers used by only some ranks on some steps: no hang, every rank agrees (2 gloo ranks).

A branch (a Linear layer) runs on rank 1 only at step 0, on both ranks at step 1 and on
neither at step 2. Without agreement the ranks would launch different collectives and hang
(the run has a timeout). Checks: every rank ends with the same parameters; a statistic
missing on a rank is skipped everywhere (the branch has no factors after step 0); once both
ranks use it, its factors equal the mean of the two ranks' formulas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer
from tests.distributed_utils import run_distributed
from tests.oracles import with_ones
from tests.serial_vs_distributed import Hooks, Run, assert_ranks_match, train_sharded

DT = torch.float64
USES = {0: {1}, 1: {0, 1}, 2: set()}  # step -> ranks that run the branch


class _Branchy(nn.Module):
    """Runs ``branch`` only while ``use_branch`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 5)
        self.branch = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(5))  # not a K-FAC layer
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h)) * self.scale
        return self.head(h)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: rank ``r``'s 6 rows drawn with the seed ``10 · step + r``."""
    parts = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(10 * step + rank)
        parts.append(
            (torch.randn(6, 4, generator=gen, dtype=DT), torch.randint(0, 3, (6,), generator=gen))
        )
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


# The branch's orthogonalised update divided by its input's RMS: a float64 layer reached on
# one rank only (step 0) or on none (step 2) still launches the same all-reduce everywhere.
INPUT_RMS = {
    "method": "eigen_adam",
    "orthogonal_layers": ("^branch$",),
    "orthogonal_input_rms": True,
}


def _rank_main(rank: int, world: int, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    factors_after: list[dict[str, Any]] = []
    branch_inputs: list[torch.Tensor] = []

    def setup(run: Run) -> None:
        def keep_input(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if run.step == 1:  # every rank runs the branch
                branch_inputs.append(inputs[0].detach().clone())

        run.model.branch.register_forward_pre_hook(keep_input)

    def choose(run: Run) -> None:
        run.model.use_branch = rank in USES[run.step]

    run = train_sharded(
        rank,
        world,
        model_fn=lambda: _Branchy().double(),
        batch_fn=lambda step: _batch(step, world),
        steps=len(USES),
        momentum=0.0,
        hooks=Hooks(
            setup=setup,
            before_forward=choose,
            after_step=lambda run: factors_after.append(
                {n: a.clone() for n, (a, _) in run.pre.factors().items()}
            ),
        ),
        strategy=strategy,
        factor_decay=0.0,
        inverse_update_interval=1,
        kl_clip=None,
        **options,
    )
    return {
        "params": run.params(),
        "factors": factors_after,
        "branch_a_rows": with_ones(branch_inputs[0]) if branch_inputs else None,
    }


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("replicated", {}), ("spngd", {}), ("replicated", INPUT_RMS)],
    ids=["replicated", "spngd", "replicated-input-rms"],
)
def test_unused_branch_does_not_hang_and_ranks_agree(
    strategy: str, options: dict[str, Any]
) -> None:
    results = run_distributed(_rank_main, 2, strategy, options, timeout=90)
    params = [r["params"] for r in results]
    assert_ranks_match(params, params[0], label=strategy)
    assert all(bool(torch.isfinite(p).all()) for p in params[0]), strategy
    for result in results:
        assert "branch" not in result["factors"][0], strategy
    rows = [r["branch_a_rows"] for r in results]
    assert all(r is not None for r in rows), "both ranks run the branch at step 1"
    expected = sum(r.T @ r / r.shape[0] for r in rows) / 2
    owners = [r for r in results if "branch" in r["factors"][1]]
    assert owners, f"{strategy}: nobody keeps the branch factors after step 1"
    for result in owners:
        torch.testing.assert_close(result["factors"][1]["branch"], expected, msg=strategy)


def _late_branch_main(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """The branch on rank 1 only at step 0, on both ranks after; bases every 50 steps."""
    torch.set_num_threads(1)
    model = _Branchy().double()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = KFACOptimizer.for_model(
        ddp, overhead=None, strategy=strategy, inverse_update_interval=50, kl_clip=None
    )
    waiting = []
    for step in range(3):
        model.use_branch = step > 0 or rank == 1
        x, y = _batch(step, world)
        rows = slice(6 * rank, 6 * rank + 6)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[rows]), y[rows]).backward()
        opt.step()
        waiting.append(sorted(opt.preconditioner.late.waiting))
    return {"params": [p.detach().clone() for p in model.parameters()], "waiting": waiting}


@pytest.mark.parametrize("strategy", ["replicated", "dp"])
def test_a_branch_whose_first_statistics_were_skipped_joins_at_its_next_step(
    strategy: str,
) -> None:
    """Its step-0 statistics are missing on rank 0, so skipped on both: it stays waiting
    (not counted as refreshed from no statistics) and is refreshed on its own at step 1,
    on every rank alike, long before the next basis at step 50."""
    results = run_distributed(_late_branch_main, 2, strategy, timeout=90)
    for result in results:
        assert result["waiting"] == [["branch"], [], []], strategy
    assert_ranks_match([r["params"] for r in results], results[0]["params"], label=strategy)


EVAL_STEPS = 2  # the branch is held in eval mode for the first steps, then trained


def _eval_branch_main(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """The branch in eval mode at steps 0-1 and in train mode after, under DDP's overlapped
    reduction (``find_unused_parameters=False``), and the serial twin on the global batch."""

    def modes(run: Run) -> None:
        run.model.use_branch = True
        run.model.branch.train(run.step >= EVAL_STEPS)

    waiting: list[list[str]] = []

    def train(shard_rank: int | None) -> Run:
        distributed = shard_rank is not None
        after = (lambda run: waiting.append(sorted(run.pre.late.waiting))) if distributed else None
        return train_sharded(
            shard_rank,
            world,
            model_fn=lambda: _Branchy().double(),
            batch_fn=lambda step: _batch(step, world),
            steps=EVAL_STEPS + 2,
            ddp=distributed,
            momentum=0.0,
            hooks=Hooks(before_forward=modes, after_step=after),
            strategy=strategy,
            factor_decay=0.5,
            inverse_update_interval=1,
            kl_clip=None,
        )

    run = train(rank)
    assert run.pre.eager is not None, "DDP without unused parameters overlaps"
    serial = train(None)
    return {
        "params": run.params(),
        "serial": serial.params(),
        "factors": sorted(run.pre.factors()),
        "waiting": waiting,
    }


@pytest.mark.parametrize("strategy", ["replicated", "dp"])
def test_a_layer_trained_in_eval_mode_under_the_overlapped_reduction(strategy: str) -> None:
    """Its statistics are skipped on every rank alike while it is in eval mode, as on one
    process (no rank raises for the layer it lacks); it is captured once back in train mode.
    The ranks end equal, and under ``replicated`` equal to the one-process run on the global
    batch (``dp``'s factors are an owner's own rows, so its run is not that one)."""
    results = run_distributed(_eval_branch_main, 2, strategy, timeout=90)
    want = results[0]["serial"] if strategy == "replicated" else results[0]["params"]
    assert_ranks_match([r["params"] for r in results], want, label=strategy)
    assert any("branch" in r["factors"] for r in results), strategy
    # It waits for statistics while held (not refreshed from none), then joins.
    for result in results:
        assert result["waiting"] == [["branch"]] * EVAL_STEPS + [[], []], strategy
