"""``KFACOptimizer`` among torch.optim's tools, each against a plain optimizer or a twin run
(the oracle): every learning-rate scheduler (the lr each step uses is the one the same
scheduler gives a plain ``SGD`` with the same groups; a checkpoint mid-run resumes bit for
bit), ``swa_utils`` (an averaged copy evaluated, updated by ``update_bn`` and trained
through changes nothing of the run), step hooks, every inner optimizer in its ``foreach``,
``fused`` and ``maximize`` forms (the same optimizer on a twin fed the gradients K-FAC
wrote; ``maximize=True`` on ``-L`` is minimising ``L``), the ones refused at construction,
and gradient clipping between the backward and the step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.optimizer import DEFAULT_OPTIONS

DT = torch.float64


def _mlp(norm: type[nn.Module] | None = None, dtype: torch.dtype = DT) -> nn.Sequential:
    torch.manual_seed(0)
    middle = [norm(8)] if norm is not None else []
    return nn.Sequential(nn.Linear(5, 8), *middle, nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(step: int, dtype: torch.dtype = DT) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 5, generator=gen, dtype=dtype), torch.randint(0, 3, (16,), generator=gen)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(p, q)
        for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


# ----------------------------------------------------------------------------- schedulers

SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1 / (s + 1)),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda s: 0.9),
    "StepLR": lambda o: sched.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, [2, 5], 0.5),
    "ConstantLR": lambda o: sched.ConstantLR(o, 0.5, total_iters=3),
    "LinearLR": lambda o: sched.LinearLR(o, 0.2, 1.0, total_iters=4),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, 0.8),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, 6, 2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, 4),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, 0.5, total_iters=2), sched.ExponentialLR(o, 0.9)]
    ),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.LinearLR(o, 0.1, total_iters=3), sched.ExponentialLR(o, 0.9)], milestones=[3]
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: sched.CyclicLR(o, 0.001, 0.02, step_size_up=2),
    "CyclicLR-lr-only": lambda o: sched.CyclicLR(o, 0.001, 0.02, 2, cycle_momentum=False),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, 0.02, total_steps=10),
    "OneCycleLR-lr-only": lambda o: sched.OneCycleLR(o, 0.02, total_steps=10, cycle_momentum=False),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, 3, 2),
    "SWALR": lambda o: SWALR(o, swa_lr=0.005, anneal_epochs=3),
}
PLATEAU_METRIC = [1.0, 0.9, 0.95, 0.97, 0.8, 0.85, 0.86, 0.9]  # the plain run's loss differs
STEPS = 8


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": model[0].parameters(), "lr": 0.01},
        {"params": model[2].parameters(), "lr": 0.02},
    ]


def _optimizer(kind: str, model: nn.Sequential) -> torch.optim.Optimizer:
    """``for_model`` (one group, SGD without momentum, the moments' betas in its group),
    ``KFACOptimizer`` over an SGD with momentum and two groups (the KL-clip reads each
    layer's lr), and the plain SGDs with the same groups."""
    if kind == "for_model":
        return KFACOptimizer.for_model(model, lr=0.01, overhead=None)
    if kind == "plain for_model":
        return torch.optim.SGD(model.parameters(), lr=0.01)
    inner = torch.optim.SGD(_groups(model), lr=0.01, momentum=0.9)
    return inner if kind == "plain sgd" else KFACOptimizer(inner, KFACPreconditioner(model))


def _scheduler_step(scheduler: Any, step: int) -> None:
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(PLATEAU_METRIC[step])
    else:
        scheduler.step()


def _planned_rates(kind: str, name: str) -> list[list[float]]:
    """The lr of each group at each step, as the scheduler drives a plain SGD."""
    model = _mlp()
    opt = _optimizer(f"plain {kind}", model)
    scheduler = SCHEDULERS[name](opt)
    rates = []
    for step in range(STEPS):
        rates.append([group["lr"] for group in opt.param_groups])
        opt.step()  # no gradients: only the scheduler's view of the steps
        _scheduler_step(scheduler, step)
    return rates


def _scheduled_run(
    kind: str, name: str, span: range, saved: Any = None
) -> tuple[nn.Module, list[tuple[list[float], Any]], Any]:
    """K-FAC under the scheduler over ``span``: each step's lr as the weights' change shows
    it (SGD's ``p - lr · d``, ``d`` the gradient or momentum buffer it stepped, to the bit)
    and the lr the preconditioner's KL-clip was given; the state at step 4."""
    model = _mlp()
    opt = _optimizer(kind, model)
    assert isinstance(opt, KFACOptimizer)
    scheduler = SCHEDULERS[name](opt)
    if saved is not None:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        scheduler.load_state_dict(saved[2])
    given: list[Any] = []
    step_fn = opt.preconditioner.step

    def recorded(*args: Any, **kwargs: Any) -> None:
        given.append(kwargs.get("lr"))
        step_fn(*args, **kwargs)

    opt.preconditioner.step = recorded  # type: ignore[method-assign]
    seen, state = [], None
    for step in span:
        if step == 4:
            state = copy.deepcopy((model.state_dict(), opt.state_dict(), scheduler.state_dict()))
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = {p: p.detach().clone() for p in model.parameters()}
        opt.step()
        used = []
        for group in opt.param_groups:
            for p in group["params"]:
                direction = opt.state[p].get("momentum_buffer", p.grad)
                # the lr that moved p: p == old - lr * direction, to the bit
                assert torch.equal(p.detach(), before[p].add(direction, alpha=-group["lr"]))
            used.append(group["lr"])
        seen.append((used, given[-1]))
        _scheduler_step(scheduler, step)
    return model, seen, state


@pytest.mark.parametrize("kind", ["for_model", "sgd"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_scheduler_drives_the_step_as_on_plain_sgd_and_resumes_bit_for_bit(
    name: str, kind: str
) -> None:
    """Each step moves every weight by the lr the scheduler gives the plain SGD that step
    (a momentum it cycles is the first moment's β₁ under ``for_model``, SGD's momentum
    otherwise), the KL-clip reads that lr, and the run resumed from step 4's checkpoint
    (weights, optimizer, scheduler) ends where the one that did not stop ends."""
    planned = _planned_rates(kind, name)
    model, seen, saved = _scheduled_run(kind, name, range(STEPS))
    for step, ((used, given), want) in enumerate(zip(seen, planned, strict=True)):
        assert used == want, step
        # the KL-clip's lr: one number with one group, each layer's group's with several
        assert given == (want[0] if len(want) == 1 else {"0": want[0], "2": want[1]}), step
    resumed, rest, _ = _scheduled_run(kind, name, range(4, STEPS), saved)
    assert [used for used, _ in rest] == planned[4:]
    assert _same(model, resumed)


@pytest.mark.parametrize("inner", [torch.optim.Adagrad, torch.optim.Rprop])
@pytest.mark.parametrize("name", ["CyclicLR", "OneCycleLR"])
def test_cycling_the_momentum_of_an_inner_without_one_is_torchs_own_refusal(
    inner: type[torch.optim.Optimizer], name: str
) -> None:
    model = _mlp()
    opt = KFACOptimizer(inner(model.parameters(), lr=0.01), KFACPreconditioner(model))
    with pytest.raises(ValueError, match="must support momentum or beta1"):
        SCHEDULERS[name](opt)


# ------------------------------------------------------------------------------ swa_utils


def _averaged_run(kind: str, average: str, copy_from: str, distill: bool) -> tuple[nn.Module, ...]:
    """8 steps under ``SWALR`` with an ``AveragedModel`` (SWA, or an EMA of parameters and
    buffers) updated each step, evaluated, refreshed by ``update_bn`` and, with
    ``distill``, a teacher in the loss that the backward also runs through. The copy is of
    the model K-FAC hooked (``"hooked"``), of the model before the preconditioner existed
    (``"bare"``), or absent (``"none"``); ``update_bn`` also runs on the model itself."""
    model = _mlp(nn.BatchNorm1d)
    bare = copy.deepcopy(model)
    if kind == "for_model":
        opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = KFACOptimizer(inner, KFACPreconditioner(model))
    ema = average == "ema"
    fn = get_ema_multi_avg_fn(0.9) if ema else None
    source = {"hooked": model, "bare": bare}.get(copy_from)
    averaged = None if source is None else AveragedModel(source, multi_avg_fn=fn, use_buffers=ema)
    scheduler = SWALR(opt, swa_lr=0.005, anneal_epochs=3)
    loader = [_batch(100 + i)[0] for i in range(3)]
    for step in range(8):
        x, y = _batch(step)
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        if averaged is not None and distill and step >= 2:
            averaged.train()
            loss = loss + F.mse_loss(out, averaged(x))  # no detach: trained through
        loss.backward()
        opt.step()
        scheduler.step()
        if averaged is not None:
            averaged.update_parameters(model)
            averaged.eval()
            averaged(x)
            if step == 5:
                update_bn(loader, averaged)
        if step == 6:
            update_bn(loader, model)
            model.train()
    return (model,) if averaged is None else (model, averaged)


@pytest.mark.parametrize("average", ["swa", "ema"])
@pytest.mark.parametrize("kind", ["for_model", "sgd"])
def test_an_averaged_copy_evaluated_and_trained_through_changes_nothing(
    kind: str, average: str
) -> None:
    """The copy of the hooked model holds inert hooks: as a teacher in the loss it gives
    the run (model and average) of a copy that never had any; only evaluated and updated,
    the run of no copy at all."""
    hooked = _averaged_run(kind, average, "hooked", distill=True)
    bare = _averaged_run(kind, average, "bare", distill=True)
    assert _same(hooked[0], bare[0]) and _same(hooked[1], bare[1])
    assert not _same(hooked[0], _averaged_run(kind, average, "none", distill=False)[0])
    watched = _averaged_run(kind, average, "hooked", distill=False)
    assert _same(watched[0], _averaged_run(kind, average, "none", distill=False)[0])


# ---------------------------------------------------------------------------------- hooks


def test_a_step_pre_hook_that_sets_the_lr_sets_that_steps_lr() -> None:
    """Each hook is called once a step with the optimizer; the pre hook's lr is the one the
    KL-clip and the inner step use that step: the run equals one built at that lr."""

    def run(lr: float, hooked_lr: float | None) -> tuple[nn.Module, list[Any]]:
        model = _mlp()
        opt = KFACOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr), KFACPreconditioner(model, kl_clip=1e-3)
        )
        calls: list[Any] = []
        if hooked_lr is not None:

            def pre(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                calls.append(("pre", o))
                for group in o.param_groups:
                    group["lr"] = hooked_lr

            opt.register_step_pre_hook(pre)
            opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o)))
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert calls == [("pre", opt), ("post", opt)] * (step + 1) or hooked_lr is None
            opt.param_groups[0]["lr"] = lr
        return model, calls

    hooked, _ = run(0.5, 0.03)
    plain, _ = run(0.03, None)
    assert _same(hooked, plain)
    assert not _same(hooked, run(0.5, None)[0])  # the KL-clip binds at 0.5: not the same


# ----------------------------------------------------------------------- inner optimizers

OPTIMIZERS = [
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    torch.optim.SGD,
    torch.optim.Adafactor,
]
FUSED_ON_CPU = {torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.SGD}
INNER_CASES = [
    pytest.param(cls, variant, id=f"{cls.__name__}-{variant}")
    for cls in OPTIMIZERS
    for variant in ("foreach", "for-loop", "fused", "maximize")
    if (variant != "fused" or cls in FUSED_ON_CPU)
    and (variant not in ("foreach", "for-loop") or cls is not torch.optim.Adafactor)
] + [pytest.param(torch.optim.Adafactor, "default", id="Adafactor-default")]


def _inner_kwargs(cls: type[torch.optim.Optimizer], variant: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"lr": 1.0 if cls is torch.optim.Adadelta else 0.01}
    if cls is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    kwargs.update(
        {
            "foreach": {"foreach": True},
            "for-loop": {"foreach": False},
            "fused": {"fused": True},
            "maximize": {"maximize": True},
        }.get(variant, {})
    )
    return kwargs


@pytest.mark.parametrize(("cls", "variant"), INNER_CASES)
def test_every_inner_optimizer_steps_the_preconditioned_gradients(
    cls: type[torch.optim.Optimizer], variant: str
) -> None:
    """The same optimizer on a twin, fed the gradients K-FAC wrote, takes the same steps to
    the bit (float32: the fused kernels' dtype; a LayerNorm for the leftover's update)."""
    kwargs = _inner_kwargs(cls, variant)
    model, twin = _mlp(nn.LayerNorm, torch.float32), _mlp(nn.LayerNorm, torch.float32)
    inner = cls(model.parameters(), **kwargs)
    opt = KFACOptimizer(inner, KFACPreconditioner(model))
    twin_opt = cls(twin.parameters(), **kwargs)
    written: list[list[Tensor]] = []
    inner.register_step_pre_hook(
        lambda o, a, k: written.append([p.grad.clone() for p in model.parameters()])
    )
    for step in range(4):
        x, y = _batch(step, torch.float32)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = [p.grad.clone() for p in model.parameters()]
        opt.step()
        assert not all(
            torch.equal(a, b) for a, b in zip(raw, written[-1], strict=True)
        )  # preconditioned
        for p, grad in zip(twin.parameters(), written[-1], strict=True):
            p.grad = grad
        twin_opt.step()
    assert len(written) == 4
    assert _same(model, twin)
    assert not _same(model, _mlp(nn.LayerNorm, torch.float32))


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (torch.optim.SGD, {}),
        (torch.optim.SGD, DEFAULT_OPTIONS),
        (torch.optim.AdamW, {"kl_clip": None}),
    ],
)
def test_maximize_ascends_along_the_preconditioned_gradient(
    cls: type[torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    """K-FAC preconditions the gradient it is given (its factors do not see the loss's
    sign), the inner optimizer then ascends: ``maximize=True`` on ``-L`` is ``L``
    minimised, to the bit (SGD with momentum and weight decay under the KL-clip, the
    default's options, AdamW)."""

    def run(maximize: bool, sign: float) -> nn.Module:
        model = _mlp(nn.LayerNorm)
        kwargs = {"momentum": 0.9, "weight_decay": 0.01} if cls is torch.optim.SGD else {}
        inner = cls(model.parameters(), lr=0.01, maximize=maximize, **kwargs)
        opt = KFACOptimizer(inner, KFACPreconditioner(model, **options))
        for step in range(6):
            x, y = _batch(step)
            opt.zero_grad()
            (sign * F.cross_entropy(model(x), y)).backward()
            opt.step()
        return model

    ascended = run(True, -1.0)
    assert _same(ascended, run(False, 1.0))
    assert not _same(ascended, run(False, -1.0))


@pytest.mark.parametrize("cls", OPTIMIZERS[:-1])  # Adafactor has no differentiable step
def test_a_differentiable_inner_optimizer_is_refused_when_wrapped(
    cls: type[torch.optim.Optimizer],
) -> None:
    """Its step writes the leaf weights in place with gradients enabled (autograd refuses
    that, inside the inner step after the preconditioner has stepped), and no graph runs
    through K-FAC's: refused at construction, naming the flag."""
    model = _mlp()
    inner = cls(model.parameters(), **_inner_kwargs(cls, "default"), differentiable=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: differentiable=True is not"):
        KFACOptimizer(inner, KFACPreconditioner(model))


def test_a_differentiable_group_is_refused_when_added_or_loaded() -> None:
    model = _mlp(nn.LayerNorm)
    opt = KFACOptimizer(
        torch.optim.Adam(list(model[0].parameters()) + list(model[3].parameters()), lr=0.01),
        KFACPreconditioner(model),
    )
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.add_param_group({"params": list(model[1].parameters()), "differentiable": True})
    assert len(opt.param_groups) == 1
    state = opt.state_dict()
    state["param_groups"][0]["differentiable"] = True
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["differentiable"] is False


def test_sparse_adam_is_refused_when_wrapped() -> None:
    """It refuses dense gradients in its step, and K-FAC writes its layers' dense."""
    model = _mlp()
    with pytest.raises(ValueError, match="SparseAdam steps only sparse gradients"):
        KFACOptimizer(torch.optim.SparseAdam(model.parameters()), KFACPreconditioner(model))


# ------------------------------------------------------------------------------- clipping


def _clipped_step(clip: Callable[[nn.Module], None] | None) -> tuple[list[Tensor], dict]:
    """One step of the damped method without the KL-clip (linear in the gradient): the
    weights' change and the factors."""
    model = _mlp()
    opt = KFACOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        KFACPreconditioner(model, kl_clip=None, factor_decay=0.0),
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if clip is not None:
        clip(model)
    opt.step()
    return [
        p.detach() - b for p, b in zip(model.parameters(), before, strict=True)
    ], opt.preconditioner.factors()


def test_clipping_acts_on_the_raw_gradient_before_the_preconditioner() -> None:
    """``clip_grad_norm_`` by ``c`` scales the preconditioned step by ``c``;
    ``clip_grad_value_`` changes its direction; the factors, built from the hooks' inputs
    and output gradients, are those of the unclipped step in both cases."""
    free, factors = _clipped_step(None)
    coefficient: list[float] = []

    def by_norm(model: nn.Module) -> None:
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        coefficient.append((total / 4) / (total + 1e-6))  # torch's clip_coef
        torch.nn.utils.clip_grad_norm_(model.parameters(), total / 4)

    def by_value(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)

    normed, normed_factors = _clipped_step(by_norm)
    for got, want in zip(normed, free, strict=True):
        torch.testing.assert_close(got, want * coefficient[0], rtol=1e-10, atol=1e-15)
    valued, valued_factors = _clipped_step(by_value)
    flat = [torch.cat([d.flatten() for d in steps]) for steps in (valued, free)]
    assert F.cosine_similarity(*flat, dim=0) < 1 - 1e-3
    for got_factors in (normed_factors, valued_factors):
        for name, (a, g) in factors.items():
            assert torch.equal(got_factors[name][0], a), name
            assert torch.equal(got_factors[name][1], g), name
