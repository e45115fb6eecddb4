"""What users do to a model while it trains, each against a twin run that does not.

Gradual unfreezing, a head used only between the factor captures, layers trained in eval
mode, a forward whose output is never backpropagated, gradient accumulation
without a declared count (a layer broadcast over the batch included), and a GradScaler the
preconditioner was not given.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks.attention import shared_forward
from tests.integrations.twins import max_difference

DT = torch.float64


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, size: int = 16) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 6, generator=gen), torch.randint(0, 3, (size,), generator=gen)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


# ----------------------------------------------------------------- gradual unfreezing


def test_a_layer_frozen_when_built_trains_once_unfrozen_as_one_frozen_after() -> None:
    """Frozen before ``for_model`` or right after it: the same run; once unfrozen it moves,
    preconditioned from the step after it was unfrozen although the default overhead budget
    captures factors only every few steps here."""
    frozen_first, frozen_after = _mlp(), _mlp()
    frozen_first[0].requires_grad_(False)
    opt_first = KFACOptimizer.for_model(frozen_first)
    opt_after = KFACOptimizer.for_model(frozen_after)
    frozen_after[0].requires_grad_(False)
    assert any(p is frozen_first[0].weight for g in opt_first.param_groups for p in g["params"])
    start = frozen_first[0].weight.detach().clone()
    for step in range(6):
        if step == 2:
            frozen_first[0].requires_grad_(True)
            frozen_after[0].requires_grad_(True)
        _train_step(frozen_first, opt_first, step)
        _train_step(frozen_after, opt_after, step)
        if step == 1:
            assert torch.equal(frozen_first[0].weight, start)
        if step == 3:
            pre = opt_first.preconditioner
            assert pre.config.factor_update_interval > 3  # the schedule would wait longer
            assert pre.layers["0"].solver_state is not None
    assert max_difference(frozen_first, frozen_after) == 0.0
    assert (frozen_first[0].weight - start).abs().max() > 1e-3
    assert "0" in opt_first.preconditioner.factors()


def _states(opt: KFACOptimizer) -> dict[str, dict[str, Tensor] | None]:
    return {name: layer.solver_state for name, layer in opt.preconditioner.layers.items()}


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_an_unfrozen_layer_is_refreshed_at_once_not_at_the_next_scheduled_refresh(
    method: str,
) -> None:
    """Basis every 50 steps: the layer unfrozen at step 2 gets its own solver state at that
    step (from its running factors, as a scheduled refresh would compute it), the other
    layers keep theirs, and from step 3 its update is the preconditioned one."""
    model = _mlp()
    model[0].requires_grad_(False)
    opt = KFACOptimizer.for_model(
        model, overhead=None, method=method, inverse_update_interval=50, factor_update_interval=1
    )
    pre = opt.preconditioner
    for step in range(2):
        _train_step(model, opt, step)
    assert pre.layers["0"].solver_state is None
    assert pre.late.waiting == {"0"}
    before = _states(opt)
    model[0].requires_grad_(True)
    _train_step(model, opt, 2)
    after = _states(opt)
    assert pre.late.waiting == set()
    for name in ("2", "4"):
        state_before, state_after = before[name], after[name]
        assert state_before is not None and state_after is not None
        assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)
    layer = pre.layers["0"]
    expected = layer.solver.compute_statistics(layer.solver_inputs(), pre.config.damping, None)
    state = after["0"]
    assert state is not None
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    # Step 3 preconditions layer 0: its gradient is no longer the plain one.
    x, y = _batch(3)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    plain = model[0].weight.grad.detach().clone()
    pre.step()
    assert not torch.allclose(model[0].weight.grad, plain)


class WithUnusedHead(nn.Module):
    """The MLP and a second head that trains but is never used (no gradient ever)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.unused = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def test_a_trainable_layer_that_never_gets_a_gradient_adds_no_captures() -> None:
    """Only a layer seen frozen is captured out of schedule: an unused head (trainable, never
    backpropagated) leaves the steps between factor captures without captures, as before."""
    model = WithUnusedHead()
    opt = KFACOptimizer.for_model(model, overhead=None, factor_update_interval=4)
    pre = opt.preconditioner
    active = []
    for step in range(6):
        active.append(pre.capture.active)
        _train_step(model, opt, step)
    assert active == [True, False, False, False, True, False]
    assert pre.late.waiting == {"unused"}


def _normed(seed: int = 0) -> nn.Sequential:
    """A linear layer, an affine BatchNorm (unit-wise, ``γ`` and ``β`` one block) and a head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("method", ["for_model", "eigen"])
@pytest.mark.parametrize("frozen_at", [0, 2], ids=["frozen-when-built", "frozen-mid-training"])
def test_a_frozen_bias_stays_as_it_is_and_the_weights_train_as_with_its_gradient_zeroed(
    method: str, frozen_at: int
) -> None:
    """A layer's bias (and a BatchNorm's ``β``) frozen while its weight trains: the frozen
    parameters keep their values and get no ``.grad``, as torch leaves a frozen parameter,
    though ``for_model``'s SGD holds every parameter (the bias column of the layer's
    update was written into a gradient created for it, and stepped). Oracle: a twin whose
    bias gradients are zeroed after each backward, and whose biases are put back after
    each step, takes the same weights, bit for bit (the block reads a missing bias
    gradient as zeros)."""
    frozen_model, twin = _normed(), _normed()

    def build(model: nn.Sequential) -> KFACOptimizer:
        if method == "for_model":
            return KFACOptimizer.for_model(model, overhead=None)
        pre = KFACPreconditioner(model, method="eigen", inverse_update_interval=2)
        return KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pre)

    frozen = [frozen_model[0].bias, frozen_model[1].bias]
    opt_frozen, opt_twin = build(frozen_model), build(twin)
    for step in range(6):
        if step == frozen_at:
            for param in frozen:
                param.requires_grad_(False)
            kept = [param.detach().clone() for param in frozen]
        _train_step(frozen_model, opt_frozen, step)
        x, y = _batch(step)
        opt_twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        biases = [twin[0].bias, twin[1].bias]
        if step >= frozen_at:
            torch._foreach_zero_([bias.grad for bias in biases])
        opt_twin.step()
        if step >= frozen_at:  # the twin's biases moved by their update's column: put back
            with torch.no_grad():
                torch._foreach_copy_(biases, kept)
            assert [param.grad for param in frozen] == [None, None]
    for param, value in zip(frozen, kept, strict=True):
        assert torch.equal(param, value)
    for index in (0, 1, 3):
        assert torch.equal(frozen_model[index].weight, twin[index].weight)
    assert (frozen_model[0].weight - _normed()[0].weight).abs().max() > 1e-3


def test_a_bias_frozen_with_a_kept_gradient_stays_as_it_is() -> None:
    """Frozen mid-training under ``zero_grad(set_to_none=False)``: the bias keeps a zeroed
    gradient, which the layer's update must not fill (``for_model``'s SGD steps every
    parameter holding a gradient, as torch's does): the bias stays where it was frozen and
    its gradient zero, as a plain SGD leaves it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = KFACOptimizer.for_model(model, overhead=None)
    bias = model[0].bias
    for step in range(5):
        if step == 2:
            bias.requires_grad_(False)
            kept = bias.detach().clone()
        opt.zero_grad(set_to_none=False)
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.equal(bias, kept)
    assert bias.grad is not None and not bias.grad.any()


def test_a_checkpoint_taken_while_a_layer_is_frozen_resumes_its_late_refresh() -> None:
    """Saved at step 2 with layer 0 still frozen, loaded into a twin: unfreezing then gives
    the uninterrupted run's weights to the bit."""
    run, resumed = _mlp(), _mlp()
    for model in (run, resumed):
        model[0].requires_grad_(False)
    opt = KFACOptimizer.for_model(run, overhead=None, inverse_update_interval=50)
    for step in range(2):
        _train_step(run, opt, step)
    state = opt.state_dict()
    opt_resumed = KFACOptimizer.for_model(resumed, overhead=None, inverse_update_interval=50)
    resumed.load_state_dict(run.state_dict())
    opt_resumed.load_state_dict(state)
    assert opt_resumed.preconditioner.late.waiting == {"0"}
    for step in range(2, 5):
        for model, o in ((run, opt), (resumed, opt_resumed)):
            model[0].requires_grad_(True)
            _train_step(model, o, step)
    assert max_difference(run, resumed) == 0.0


class TwoHeads(nn.Module):
    """The MLP's body and two heads taking turns, one per step (two tasks alternating)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()[:4]
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])

    def forward(self, x: Tensor, task: int) -> Tensor:
        return self.heads[task](self.body(x))


def _task_step(model: TwoHeads, opt: KFACOptimizer, step: int) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x, step % 2), y).backward()
    opt.step()


def _two_heads(**options: object) -> tuple[TwoHeads, KFACOptimizer]:
    model = TwoHeads()
    return model, KFACOptimizer.for_model(
        model, overhead=None, factor_update_interval=4, inverse_update_interval=8, **options
    )


def test_a_head_used_only_between_captures_is_preconditioned_from_its_next_use() -> None:
    """Captures every 4th step, the second head used on odd steps only: the schedule never
    captures it. Seen with a gradient at step 1, it is captured at its next use (step 3) and
    refreshed on its own, as an unfrozen layer is, and preconditioned from then on."""
    model, opt = _two_heads()
    pre = opt.preconditioner
    active = []
    for step in range(4):
        active.append(pre.capture.active)
        _task_step(model, opt, step)
    assert active == [True, False, True, True]  # steps 2 and 3: the head is due at its use
    assert pre.late.waiting == set()
    layer = pre.layers["heads.1"]
    expected = layer.solver.compute_statistics(layer.solver_inputs(), pre.config.damping, None)
    assert layer.solver_state is not None
    for key, value in expected.items():
        torch.testing.assert_close(layer.solver_state[key], value, rtol=1e-5, atol=1e-6)
    x, y = _batch(5)
    opt.zero_grad()
    F.cross_entropy(model(x, 1), y).backward()
    plain = model.heads[1].weight.grad.detach().clone()
    pre.step()
    assert not torch.allclose(model.heads[1].weight.grad, plain)


def test_a_checkpoint_taken_while_a_head_waits_for_its_capture_resumes_it() -> None:
    """Saved after step 1 (the head seen, not yet captured), loaded into a twin: the same
    weights to the bit as the uninterrupted run."""
    run, opt = _two_heads()
    for step in range(2):
        _task_step(run, opt, step)
    assert opt.preconditioner.late.missed == {"heads.1"}
    resumed, opt_resumed = _two_heads()
    resumed.load_state_dict(run.state_dict())
    opt_resumed.load_state_dict(opt.state_dict())
    assert opt_resumed.preconditioner.late.missed == {"heads.1"}
    for step in range(2, 7):
        _task_step(run, opt, step)
        _task_step(resumed, opt_resumed, step)
    assert max_difference(run, resumed) == 0.0


@pytest.mark.parametrize("scope", ["model", "body"])
def test_layers_trained_in_eval_mode_are_named_once(
    scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    """K-FAC captures nothing in eval mode; a layer trained in it is named once (at its
    first capture step with a gradient), and a train-mode run says nothing."""
    model, opt = _two_heads()
    pre = opt.preconditioner
    (model if scope == "model" else model.body).eval()
    active = []
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.eval_mode"):
        for step in range(9):
            active.append(pre.capture.active)
            _task_step(model, opt, step)
    warned = [r.getMessage() for r in caplog.records if r.name == "dkfac.engine.eval_mode"]
    named = [m.split("statistics: ")[1].split(". ")[0] for m in warned]
    # the second head has its first gradient at step 1
    assert named == (
        ["body.0, body.2, heads.0", "heads.1"] if scope == "model" else ["body.0, body.2"]
    )
    body = {"body.0", "body.2"}
    heads = {"heads.0", "heads.1"}
    assert pre.late.waiting == (body | heads if scope == "model" else body)
    # Layers in eval mode are not captured out of schedule (they could not be); a head in
    # train mode seen uncaptured at step 1 is, at steps 2 and 3.
    schedule = [step % 4 == 0 for step in range(9)]
    assert active == (schedule if scope == "model" else [*schedule[:2], True, True, *schedule[4:]])
    model.train()  # captured from the step after, not at the schedule's step 12
    for step in range(9, 12):
        _task_step(model, opt, step)
    assert pre.late.waiting == set()
    caplog.clear()
    model, opt = _two_heads()
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.eval_mode"):
        for step in range(4):
            model.eval()
            with torch.enable_grad():
                model(torch.randn(5, 6), 0).sum()  # a metric forward, never backpropagated
            model.train()
            _task_step(model, opt, step)
    assert not caplog.records


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.out(self.att(h, h, h)[0].mean(1))


def test_an_attention_trained_in_eval_mode_is_named_with_its_projections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """q, k and v are no submodules ``.eval()`` reaches: their mode is the attention's."""
    model = WithAttention()
    opt = KFACOptimizer.for_model(model, overhead=None)
    model.att.eval()
    with caplog.at_level(logging.WARNING, logger="dkfac.engine.eval_mode"):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(4, 5, 6)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "statistics: att.q_proj, att.k_proj, att.v_proj, att.out_proj." in message
    projections = shared_forward(model.att).projections.values()
    assert projections and not any(p.training for p in projections)
    model.att.train()
    assert all(p.training for p in projections)


# ----------------------------------------------------------------- forwards not backpropagated


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_a_forward_never_backpropagated_changes_nothing(method: str) -> None:
    """A metric forward with gradients enabled, before and after the training forward."""
    plain, logged = _mlp(), _mlp()
    opt_plain = KFACOptimizer.for_model(plain, method=method, inverse_update_interval=1)
    opt_logged = KFACOptimizer.for_model(logged, method=method, inverse_update_interval=1)
    for step in range(4):
        _train_step(plain, opt_plain, step)
        x, y = _batch(step)
        probe = logged(torch.randn(5, 6))  # grad enabled, never backpropagated
        opt_logged.zero_grad()
        F.cross_entropy(logged(x), y).backward()
        logged(x * 2).sum()  # after the backward too
        opt_logged.step()
        del probe
    assert max_difference(plain, logged) == 0.0


# ----------------------------------------------------------------- accumulation, counted


class Positions(nn.Module):
    """Tokens plus a position embedding looked up with one row of positions for the whole
    batch (as GPT-2 does): its output is broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(11, 6)
        self.positions = nn.Embedding(5, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, ids: Tensor) -> Tensor:
        where = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T)
        return self.head(torch.tanh(self.mix(self.tokens(ids) + self.positions(where))))


def _lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_accumulation_equals_the_unaccumulated_run_without_a_declared_count(method: str) -> None:
    """Two micro-batches of 4 (each loss halved) against one batch of 8, float64, 4 steps;
    the position embedding's G is built from its step gradient in both."""
    full, accumulated = Positions().to(DT), Positions().to(DT)
    opts = {"method": method, "inverse_update_interval": 2, "kl_clip": None}
    opt_full = KFACOptimizer.for_model(full, lr=0.01, **opts)
    opt_acc = KFACOptimizer.for_model(accumulated, lr=0.01, **opts)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 11, (8, 6), generator=gen)
        opt_full.zero_grad()
        _lm_loss(full, ids).backward()
        opt_full.step()
        opt_acc.zero_grad()
        for part in ids.chunk(2):
            (_lm_loss(accumulated, part) / 2).backward()
        opt_acc.step()
    assert max_difference(full, accumulated) < 1e-10
    for name, (a, g) in opt_full.preconditioner.factors().items():
        a2, g2 = opt_acc.preconditioner.factors()[name]
        torch.testing.assert_close(a2, a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g2, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_a_one_sample_micro_batch_is_captured_whether_it_comes_first_or_last(method: str) -> None:
    """A step accumulating micro-batches of 7 and 1 samples (a loader's short last batch)
    builds the factors of one accumulating them as 1 then 7: the one-sample micro-batch
    is a batch of its own, not a lookup broadcast over the other's samples. The
    overhead budget is off (it chooses from the first batch)."""
    opts = {"method": method, "inverse_update_interval": 1, "kl_clip": None, "overhead": None}
    models = [_mlp().double(), _mlp().double()]
    optimizers = [KFACOptimizer.for_model(model, lr=0.01, **opts) for model in models]
    for step in range(3):
        x, y = _batch(step, 8)
        parts = [(x[:7], y[:7]), (x[7:], y[7:])]
        for model, opt, order in zip(models, optimizers, (parts, parts[::-1]), strict=True):
            opt.zero_grad()
            for part_x, part_y in order:
                (F.cross_entropy(model(part_x.double()), part_y) / 2).backward()
            opt.step()
    first, last = (opt.preconditioner.factors() for opt in optimizers)
    for name, (a, g) in first.items():
        torch.testing.assert_close(last[name][0], a, rtol=0.0, atol=1e-12, msg=name)
        torch.testing.assert_close(last[name][1], g, rtol=0.0, atol=1e-12, msg=name)
    assert max_difference(*models) < 1e-10


@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_a_forward_never_backpropagated_leaves_a_one_sample_micro_batch_a_batch(
    method: str,
) -> None:
    """Micro-batches of 7 and 1 samples with a metric forward of 5 samples, gradients on and
    never backpropagated, run between them: the factors and weights are those of the run
    without it. The metric forward and the one-sample micro-batch are one forward pass to
    the capture, whose larger batch made the micro-batch's layers broadcast ones (G from
    the summed gradient, at another scale: the factors and weights differed)."""
    opts = {"method": method, "inverse_update_interval": 1, "kl_clip": None, "overhead": None}
    runs = []
    for metric in (False, True):
        model = _mlp().to(DT)
        opt = KFACOptimizer.for_model(model, lr=0.05, factor_decay=0.0, **opts)
        for step in range(3):
            x, y = _batch(step, 8)
            opt.zero_grad()
            (F.cross_entropy(model(x[:7].to(DT)), y[:7]) / 2).backward()
            if metric:
                model(torch.randn(5, 6, dtype=DT)).sum().item()
            (F.cross_entropy(model(x[7:].to(DT)), y[7:]) / 2).backward()
            opt.step()
        runs.append((model, opt.preconditioner.factors()))
    (plain, plain_factors), (metered, metered_factors) = runs
    for name, (a, g) in plain_factors.items():
        torch.testing.assert_close(metered_factors[name][0], a, rtol=0.0, atol=0.0, msg=name)
        torch.testing.assert_close(metered_factors[name][1], g, rtol=0.0, atol=0.0, msg=name)
    assert max_difference(plain, metered) == 0.0


@pytest.mark.parametrize("sizes", [(5, 1), (1, 5), (4, 1, 1), (2, 1, 2, 1)])
def test_one_sample_micro_batches_give_the_factors_of_the_whole_batch(
    sizes: tuple[int, ...],
) -> None:
    """Micro-batches of several sizes, one sample among them (an epoch's last), each mean
    loss divided by their number: every row keeps its per-sample weight, so A and G are
    those of the batch in one piece, in any order (float64, no running average). A
    one-sample micro-batch is no layer broadcast over the batch."""
    x, y = _batch(0, size=sum(sizes))
    factors = []
    for split in ((sum(sizes),), sizes):
        model = _mlp().to(DT)
        opt = KFACOptimizer.for_model(model, lr=0.01, method="eigen", factor_decay=0.0)
        opt.zero_grad()
        for xs, ys in zip(x.to(DT).split(split), y.split(split), strict=True):
            (F.cross_entropy(model(xs), ys) / len(split)).backward()
        opt.step()
        factors.append(opt.preconditioner.factors())
    whole, parts = factors
    for name, (a, g) in whole.items():
        torch.testing.assert_close(parts[name][0], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(parts[name][1], g, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------- a GradScaler not given


def _scaled_run(model: nn.Module, scaler: torch.amp.GradScaler, **options) -> KFACOptimizer:
    opt = KFACOptimizer.for_model(model, **options)
    _scaled_steps(model, opt, scaler)
    return opt


def _scaled_steps(model: nn.Module, opt: KFACOptimizer, scaler: torch.amp.GradScaler) -> None:
    for step in range(2):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()


def test_a_grad_scaler_not_given_is_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        _scaled_run(_mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**12))
    named = [r for r in caplog.records if "GradScaler" in r.getMessage()]
    assert len(named) == 1
    assert "4096 times" in named[0].getMessage() and "grad_scaler=scaler" in named[0].getMessage()


def _clipped_warning(factor: float, caplog: pytest.LogCaptureFixture) -> str:
    """The one scaler warning of two steps whose gradients are divided by ``factor``
    between the backward and ``step()`` (what ``clip_grad_norm_`` does at a norm ``factor``
    times its cap), with no scaler."""
    model = _mlp()
    opt = KFACOptimizer.for_model(model)
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        for step in range(2):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for param in model.parameters():
                param.grad.div_(factor)
            opt.step()
    (message,) = [r.getMessage() for r in caplog.records if "GradScaler" in r.getMessage()]
    caplog.clear()
    return message


def test_clipping_without_a_scaler_is_named_as_what_the_ratio_may_be(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Gradients clipped 2000-fold before ``step()`` and no scaler: the captured sums are
    2000 times the gradients, no power of two; the warning says that clipping explains it.
    A scaler's exact power of two (above) gets no such remark."""
    message = _clipped_warning(2000.0, caplog)
    assert "2000 times" in message and "clip_grad_norm_" in message
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        _scaled_run(_mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**12))
    assert "clip_grad_norm_" not in caplog.text


def test_clipping_by_a_small_power_of_two_is_named_as_what_the_ratio_may_be(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Gradients clipped 4-fold (the Trainer's default clipping can land there) and no
    scaler: the ratio is a power of two, which was taken for a loss scale alone, the warning
    telling the user to pass a scaler there is none of. A power of two below 2¹⁰ now gets
    the clipping remark too."""
    message = _clipped_warning(4.0, caplog)
    assert "4 times" in message and "clip_grad_norm_" in message and "rare" in message


def test_a_grad_scaler_given_or_absent_raises_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    given = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    unscaled = _mlp()
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        _scaled_run(given, scaler, grad_scaler=scaler)
        _scaled_run(unscaled, torch.amp.GradScaler("cpu", enabled=False))
    assert "GradScaler" not in caplog.text
    # Given, the scaler changes nothing: its scale is a power of two.
    assert max_difference(given, unscaled) < 1e-6


def test_a_grad_scaler_set_after_construction_counts_as_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A framework that creates its scaler after the optimizer: ``pre.grad_scaler = ...``."""
    given, late = _mlp(), _mlp()
    scaler, late_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        _scaled_run(given, scaler, grad_scaler=scaler)
        opt = KFACOptimizer.for_model(late)
        opt.preconditioner.grad_scaler = late_scaler
        _scaled_steps(late, opt, late_scaler)
    assert "GradScaler" not in caplog.text
    assert max_difference(given, late) == 0.0


def test_an_optimizer_built_after_the_first_forward_names_no_layer_as_never_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop that builds its optimizer after the model's first forward (as lazy modules
    need): that step's gradients come from a forward no hook saw, which looks like a layer
    whose parent applies its weight. No layer is named for it; each gets its factors from
    the next step's forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    loss = F.cross_entropy(model(x), y)
    opt = KFACOptimizer.for_model(model, overhead=None)
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        loss.backward()
        opt.step()
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert not [r for r in caplog.records if "never run" in r.getMessage()]
    assert all(layer.solver_state is not None for layer in opt.preconditioner.layers.values())
