"""The overhead budget in a running preconditioner (:mod:`dkfac.engine.overhead`): what it
counts and the shapes it must survive."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.costmodel.budget import LayerShape, basis_limit, choose_for
from dkfac.engine.overhead import OverheadBudget


class _TopOne(nn.Module):
    """A router picks one of 4 expert MLPs per token; each expert runs on its tokens only
    (called on an empty batch when it has none, as some implementations do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4)
        )
        self.head = nn.Linear(16, 3)
        with torch.no_grad():  # expert 2 takes a single token of the first batch, 3 none
            self.router.weight.zero_()
            self.router.bias.copy_(torch.tensor([0.0, 0.0, -50.0, -50.0]))
            self.router.weight[2, 0] = 100.0

    def forward(self, x: Tensor) -> Tensor:
        flat = torch.relu(self.inp(x))
        gate = self.router(x).softmax(-1)
        weight, chosen = gate.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return self.head(flat + out)


def test_an_expert_that_sees_one_token_or_none_does_not_stop_training() -> None:
    torch.manual_seed(0)
    model = _TopOne()
    x = torch.randn(24, 8)
    x[:, 0] = -1.0
    x[5, 0] = 1.0  # the one token routed to expert 2
    y = torch.arange(24) % 3
    routed = model.router(x).argmax(-1)
    assert (routed == 2).sum() == 1 and (routed == 3).sum() == 0
    opt = KFACOptimizer.for_model(model)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()  # failed: max_dim must be an integer >= 1 or None, got 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_frozen_layers_count_for_nothing_in_the_budget() -> None:
    """A LoRA-like model: two wide frozen layers and a small trainable head. The budget's
    choice is the one made from the trainable layer alone (the oracle: the cost model's
    own choice for that shape), not from the frozen layers' sizes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    for layer in (model[0], model[2]):
        layer.requires_grad_(False)
    x, y = torch.randn(96, 64), torch.randint(0, 10, (96,))
    opt = KFACOptimizer.for_model(model, lr=1e-3)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    budget = opt.preconditioner.budget
    assert budget is not None and budget.choice is not None
    wide_one_sided = LayerShape(513, 10, 96, basis_max=basis_limit(96))  # as the engine makes it
    alone = choose_for([wide_one_sided], 96, budget.budget)
    chosen = budget.choice
    assert (chosen.factor_batch_size, chosen.factor_update_interval) == (
        alone.factor_batch_size,
        alone.factor_update_interval,
    )
    assert chosen.inverse_update_interval == alone.inverse_update_interval


def test_the_budget_counts_a_transposed_convolution_by_its_input_positions() -> None:
    """The rows the budget prices a layer's step and factors by: a convolution's output
    positions, a transposed convolution's *input* positions (each input vector meets the
    unfolded weight once; its output has stride² times as many positions, and the output's
    rows of ``g = C_out·k²`` entries are stride²/k² of them)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),  # 12x12 -> 6x6
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),  # 6x6 -> 12x12
        nn.Flatten(),
        nn.Linear(4 * 12 * 12, 5),
    )
    x, y = torch.randn(10, 3, 12, 12), torch.randint(0, 5, (10,))
    opt = KFACOptimizer.for_model(model, lr=1e-3)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    budget = opt.preconditioner.budget
    assert budget is not None
    assert budget.rows == {"0": 10 * 6 * 6, "2": 10 * 6 * 6, "4": 10}


def test_a_small_first_batch_is_named_once_when_a_larger_one_comes(caplog: Any) -> None:
    """The budget chooses from the first step's batch and keeps the choice: a later step
    that captures twice that batch or more gets one warning naming both; equal batches
    none."""

    def run(first: int, logged: int = 0) -> list[str]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
        )
        opt = KFACOptimizer.for_model(model, factor_update_interval=1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dkfac.engine.overhead"):
            for step in range(4):
                batch = first if step == 0 else 64
                opt.zero_grad()
                F.cross_entropy(model(torch.randn(batch, 8)), torch.arange(batch) % 3).backward()
                if logged:  # the whole set's loss, logged in training mode with gradients on
                    model(torch.randn(logged, 8)).sum().item()
                opt.step()
        return [r.getMessage() for r in caplog.records if "overhead budget" in r.getMessage()]

    warned = run(8)
    assert len(warned) == 1
    assert "first batch of 8 samples, but a step now captures 64" in warned[0]
    assert run(64) == []
    assert run(64, logged=2048) == []  # a forward no backward goes through captures nothing


def test_an_empty_first_batch_waits_for_the_first_that_is_not() -> None:
    """A step on an empty batch (0 samples) tells the budget nothing: it raised "batch must
    be >= 1, got 0" from the choice; now the step changes nothing and the choice is made
    from the next batch that is not empty."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = KFACOptimizer.for_model(model)
    budget = opt.preconditioner.budget
    assert budget is not None
    before = [p.detach().clone() for p in model.parameters()]
    for batch in (0, 0, 24):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(batch, 8)), torch.arange(batch) % 3).backward()
        opt.step()
        if batch == 0:
            assert budget.choice is None and budget.batch is None
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert budget.choice is not None and budget.batch == 24
    assert budget.rows == {"0": 24, "2": 24}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_accumulated_first_step_chooses_from_its_largest_micro_batch() -> None:
    """The choice is made from the largest micro-batch of the first step, in any order: a
    short micro-batch first (2 then 24) chooses as 24 then 2 does, not from a batch of 2."""

    def budget_after(sizes: tuple[int, ...]) -> OverheadBudget:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
        opt = KFACOptimizer.for_model(model)
        opt.zero_grad()
        for size in sizes:
            x, y = torch.randn(size, 8), torch.arange(size) % 3
            (F.cross_entropy(model(x), y) / len(sizes)).backward()
        opt.step()
        budget = opt.preconditioner.budget
        assert budget is not None and budget.choice is not None
        return budget

    short_first, long_first = budget_after((2, 24)), budget_after((24, 2))
    for budget in (short_first, long_first):
        assert budget.batch == 24 and budget.rows == {"0": 24, "2": 24}
        assert budget.step_rows == {"0": 26, "2": 26}
    assert short_first.choice == long_first.choice


class _Positions(nn.Module):
    """Tokens plus positions, the positions looked up unbatched (GPT-2's ``wpe(arange(T))``,
    broadcast over the batch) or as one row ``(1, T)``: the same layers and rows."""

    def __init__(self, unbatched: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.unbatched = unbatched
        self.tokens, self.positions = nn.Embedding(11, 8), nn.Embedding(32, 8)
        self.mix, self.head = nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(self, ids: Tensor) -> Tensor:
        where = torch.arange(ids.shape[1])
        where = where if self.unbatched else where.unsqueeze(0)
        return self.head(torch.tanh(self.mix(self.tokens(ids) + self.positions(where))))


def test_an_unbatched_lookup_counts_as_one_sample_not_as_its_length() -> None:
    """Two sequences of 30 tokens: the budget's batch is 2 and its choice that of the twin
    looking its positions up as ``(1, T)`` (the capture counts both as one sample). It took
    the unbatched lookup's length for the batch (30 samples), so the choice depended on the
    sequence length (with an attention layer added: bases every 5 steps instead of 50)."""
    budgets = []
    for unbatched in (True, False):
        model = _Positions(unbatched)
        opt = KFACOptimizer.for_model(model)
        ids = torch.randint(0, 11, (2, 31), generator=torch.Generator().manual_seed(1))
        opt.zero_grad()
        F.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        budgets.append(opt.preconditioner.budget)
    unbatched_budget, twin = budgets
    assert unbatched_budget is not None and twin is not None
    assert unbatched_budget.batch == twin.batch == 2
    assert unbatched_budget.rows == twin.rows
    assert unbatched_budget.choice == twin.choice


def _wide_input_mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(60, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_a_side_the_budget_makes_one_sided_is_captured_as_its_diagonal() -> None:
    """60 inputs on batches of 16 rows: wider than 3/4 of them, so the budget keeps the
    identity basis on that side. Its factor is then captured as the solver keeps a side
    one-sided by hand (only the diagonal: 60 products a row, not 3600), from the first
    step's capture on; the run equals one with that limit set by hand."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 60, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (16,), generator=gen)) for _ in range(12)]  # fmt: skip
    runs = []
    for options in ({}, {"basis_max_dim": basis_limit(16)}):
        model = _wide_input_mlp()
        opt = KFACOptimizer.for_model(model, lr=0.01, **options)
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append((model, opt.preconditioner))
    (chosen, budgeted), (by_hand, given) = runs
    assert budgeted.budget is not None and budgeted.budget.choice is not None
    assert budgeted.budget.choice.basis_max_dims == {"0": basis_limit(16)}
    layer = budgeted.layers["0"]
    assert layer.kinds["A"].label == "diagonal" and layer.kinds["G"].label == "dense"
    assert given.layers["0"].kinds["A"] == layer.kinds["A"]
    running = layer.running["A"]
    assert running.shape == (61,)  # the diagonal alone (60 inputs and the bias)
    torch.testing.assert_close(running, given.layers["0"].running["A"], rtol=1e-12, atol=0)
    for mine, theirs in zip(chosen.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_a_loaded_choice_leaves_a_basis_max_dim_the_user_set() -> None:
    """A checkpoint whose budget made a side one-sided loads into a preconditioner given
    ``basis_max_dim``: that option is kept as given, as the intervals are (the side stays
    dense); into one without it, the saved choice is kept (the side stays one-sided)."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 60, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (16,), generator=gen)) for _ in range(4)]  # fmt: skip
    model = _wide_input_mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    for x, y in batches[:2]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.preconditioner.layers["0"].kinds["A"].label == "diagonal"
    state = opt.state_dict()
    for options, kind in (({"basis_max_dim": 1000}, "dense"), ({}, "diagonal")):
        clone = _wide_input_mlp()
        clone.load_state_dict(model.state_dict())
        restored = KFACOptimizer.for_model(clone, lr=0.01, **options)
        restored.load_state_dict(state)
        pre = restored.preconditioner
        assert pre.layers["0"].kinds["A"].label == kind
        assert ("one-sided" in pre.describe()[-1]["reason"]) == (kind == "diagonal")
        for x, y in batches[2:]:
            restored.zero_grad()
            F.cross_entropy(clone(x), y).backward()
            restored.step()
        assert pre.layers["0"].kinds["A"].label == kind
        assert all(torch.isfinite(p).all() for p in clone.parameters())


def test_a_choice_loaded_under_another_overhead_is_kept_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checkpoint's choice, made for overhead=0.02, loaded into a preconditioner built
    with overhead=5.0: the resumed run keeps the saved intervals (a state holds the run's
    position), and a warning says that the loader's budget does not apply. Under the same
    overhead nothing is said."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 60, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=gen)
    model = _wide_input_mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01, overhead=0.02)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    saved = opt.preconditioner.budget
    assert saved is not None and saved.choice is not None
    state = opt.state_dict()
    for overhead, warned in ((5.0, True), (0.02, False)):
        restored = KFACOptimizer.for_model(_wide_input_mlp(), lr=0.01, overhead=overhead)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dkfac"):
            restored.load_state_dict(state)
        budget = restored.preconditioner.budget
        assert budget is not None and budget.choice == saved.choice
        assert restored.preconditioner.config.factor_update_interval == (
            opt.preconditioner.config.factor_update_interval
        )
        messages = [r.getMessage() for r in caplog.records]
        assert any("made for overhead=0.02" in m and "overhead=5" in m for m in messages) == warned


def test_a_loaded_choice_refreshes_early_at_the_loader_s_factor_interval() -> None:
    """The budget's extra refresh comes at the first factor capture after the first step's.
    A choice saved with factors every 8 steps (bases every 50, and at step 8), loaded into
    a preconditioner given ``factor_update_interval=3``: the extra refresh is at step 3, as
    it is where that option is given from the start, not at 8, a step with no capture."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 20, generator=gen), torch.randint(0, 3, (256,), generator=gen)

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))

    model = mlp()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    saved = opt.preconditioner.config
    assert (saved.factor_update_interval, str(saved.inverse_update_interval)) == (
        8,
        "50 (and at step 8)",
    )
    fresh_model = mlp()
    fresh = KFACOptimizer.for_model(fresh_model, lr=0.01, factor_update_interval=3)
    F.cross_entropy(fresh_model(x), y).backward()
    fresh.step()
    loaded = KFACOptimizer.for_model(mlp(), lr=0.01, factor_update_interval=3)
    loaded.load_state_dict(opt.state_dict())
    for config in (fresh.preconditioner.config, loaded.preconditioner.config):
        assert config.factor_update_interval == 3
        assert str(config.inverse_update_interval) == "50 (and at step 3)"
