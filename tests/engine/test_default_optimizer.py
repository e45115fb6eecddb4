"""KFACOptimizer.for_model: the best general method from the model alone (issue 18 item 4)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.engine.overhead import BUDGETED_OPTIONS
from dkfac.optimizer import DEFAULT_LR, DEFAULT_OPTIONS, DEFAULT_OVERHEAD
from tests.strategy_cases import make_model, serial_step


def _train(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for step in range(steps):
        serial_step(model, opt, step)


def test_for_model_is_the_documented_construction() -> None:
    """Its weights after 12 steps (refreshes at 5 and 10) equal those of the explicit twin."""
    model = make_model()
    opt = KFACOptimizer.for_model(model)
    twin_model = make_model()
    twin = KFACOptimizer(
        torch.optim.SGD(twin_model.parameters(), lr=DEFAULT_LR, momentum=0.0),
        KFACPreconditioner(
            twin_model,
            overhead=DEFAULT_OVERHEAD,
            **{k: v for k, v in DEFAULT_OPTIONS.items() if k not in BUDGETED_OPTIONS},
        ),
    )
    _train(opt, model, 12)
    _train(twin, twin_model, 12)
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.preconditioner.config.method == "eigen_adam"
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (DEFAULT_LR, 0.0, 0.0)


def test_options_and_weight_decay_go_where_they_belong() -> None:
    opt = KFACOptimizer.for_model(
        make_model(), 0.01, weight_decay=0.1, inverse_update_interval=2, moment_carry="keep_v"
    )
    config = opt.preconditioner.config
    assert (config.inverse_update_interval, config.moment_carry) == (2, "keep_v")
    assert config.basis_refresh == "power" and config.kl_clip is None
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("method", ["eigen", "cholesky", "smw", "auto", "ekfac"])
def test_another_method_keeps_only_the_defaults_it_reads(method: str) -> None:
    """The moment defaults a method never reads would be refused by its config, so they
    are left out; those it reads (ekfac: the power refresh and the reset carry) stay, and
    one the caller passes is still refused."""
    config = KFACOptimizer.for_model(make_model(), method=method, overhead=None)
    config = config.preconditioner.config
    assert config.method == method and config.moment_nesterov is False
    assert (config.kl_clip, config.inverse_update_interval) == (None, 5)
    reads_refresh = method == "ekfac"
    assert config.basis_refresh == ("power" if reads_refresh else "eigh")
    assert config.moment_carry == ("reset" if reads_refresh else "keep_v")
    with pytest.raises(ValueError, match=f"moment_nesterov is not read by method '{method}'"):
        KFACOptimizer.for_model(make_model(), method=method, moment_nesterov=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": 0.0}, ValueError, "lr must be in \\(0.0, 3.40"),
        ({"lr": -1.0}, ValueError, "lr"),
        ({"lr": math.nan}, ValueError, "lr"),
        ({"lr": "0.1"}, TypeError, "lr must be a number, got str"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be in \\[0.0, 3.40"),
        ({"weight_decay": True}, TypeError, "weight_decay must be a number, got bool"),
        ({"method": "adam"}, ValueError, "method"),
        # Past float32's range the inner SGD raised at the first step, from inside torch.
        ({"lr": 1e300}, ValueError, "lr must be in \\(0.0, 3.4028234663852886e\\+38\\]"),
        (
            {"weight_decay": 1e39},
            ValueError,
            "weight_decay must be in \\[0.0, 3.4028234663852886e\\+38\\]",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KFACOptimizer.for_model(make_model(), **kwargs)  # type: ignore[arg-type]


def test_the_largest_weight_decay_builds_and_loads_alike() -> None:
    # float32's largest weight decay: the saved groups' check took it and for_model did not
    largest = float(torch.finfo(torch.float32).max)
    model = make_model()
    opt = KFACOptimizer.for_model(model, weight_decay=largest)
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["weight_decay"] == largest


def test_a_tensor_lr_steps_as_its_number() -> None:
    # torch's optimizers take lr as a one-element tensor; for_model refused it.
    runs = []
    for lr in (0.01, torch.tensor(0.01)):
        model = make_model()
        opt = KFACOptimizer.for_model(model, lr=lr)
        _train(opt, model, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for got, want in zip(*runs, strict=True):  # SGD multiplies by a tensor lr apart: 1 ulp
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_numpy_numbers_step_as_the_python_numbers_they_hold() -> None:
    # lr=np.float32(0.01) was "lr must be a number, got float32", and so were the group's
    # betas a scheduler left as numpy scalars (at the step, from set_moment_betas).
    numpy = pytest.importorskip("numpy")
    runs = []
    for number in (float, numpy.float32):
        model = make_model()
        opt = KFACOptimizer.for_model(model, lr=number(0.25), weight_decay=number(0.5))
        opt.param_groups[0]["betas"] = (number(0.5), number(0.75))
        _train(opt, model, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("lr", "error", "match"),
    [
        (torch.tensor([0.01, 0.02]), TypeError, "lr must be a number or a one-element floating"),
        (torch.tensor(-1.0), ValueError, "lr must be in \\(0.0, 3.40"),
        (torch.tensor(1), TypeError, "lr must be a number or a one-element floating tensor"),
    ],
)
def test_a_bad_tensor_lr_is_refused(lr: torch.Tensor, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KFACOptimizer.for_model(make_model(), lr=lr)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["model", None, [torch.nn.Linear(2, 2)]])
def test_a_model_that_is_no_module_is_refused(model: object) -> None:
    # It was an AttributeError from deep inside (no attribute 'named_modules').
    with pytest.raises(TypeError, match=f"model must be an nn.Module, got {type(model).__name__}"):
        KFACOptimizer.for_model(model)  # type: ignore[arg-type]


def _token_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Embedding(16, 8),
        torch.nn.Linear(8, 12),
        torch.nn.GELU(),
        torch.nn.Linear(12, 8),
        torch.nn.GELU(),
        torch.nn.Linear(8, 16),
    ).double()


def _token_run(**options: object) -> list[torch.Tensor]:
    """12 steps (refreshes at 5 and 10) of a per-token language-model loss, a mean over
    every token of 6 sequences of 5."""
    model = _token_model()
    opt = KFACOptimizer.for_model(model, 0.01, **options)
    generator = torch.Generator().manual_seed(4)
    for _ in range(12):
        ids = torch.randint(0, 16, (6, 6), generator=generator)
        opt.zero_grad()
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_default_does_not_depend_on_the_factors_scale() -> None:
    """``loss_average`` scales G by the positions squared; the default's bases (eigenvectors)
    and Adam's moments (of the rotated gradient) do not depend on that scale, so its steps
    are the same either way (to float64 rounding), and the docs do not ask for it. Under
    ``eigen``, whose damping is absolute, the same option moves the weights."""
    samples, positions = _token_run(), _token_run(loss_average="positions")
    for a, b in zip(samples, positions, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    eigen = _token_run(method="eigen")
    eigen_positions = _token_run(method="eigen", loss_average="positions")
    assert max((a - b).abs().max() for a, b in zip(eigen, eigen_positions, strict=True)) > 1e-3


def _saliency(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss, after an input gradient of it (a saliency map) on the same graph."""
    x = x.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    torch.autograd.grad(loss, x, retain_graph=True)
    return loss


def _probe(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss, after an input gradient of another forward (FGSM's probe) and
    a backward of it that asks for the input only."""
    probe = x.flip(0).clone().requires_grad_()
    torch.autograd.grad(model(probe).logsumexp(1).sum(), probe)
    other = x.clone().requires_grad_()
    model(other).sum().backward(inputs=[other])
    return torch.nn.functional.cross_entropy(model(x), y)


def _manual_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss, whose weight gradients a loop takes with ``torch.autograd.grad``
    and sets as ``.grad`` itself (the returned loss is then backpropagated into nothing)."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    params = list(model.parameters())
    for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
        param.grad = grad
    return loss.detach().requires_grad_()


@pytest.mark.parametrize(
    "extra", [_saliency, _probe, _manual_grads], ids=["saliency", "probe", "manual-grads"]
)
def test_backwards_that_leave_the_weights_gradients_alone_change_nothing(
    extra: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``torch.autograd.grad`` (an input's gradient) and ``backward(inputs=...)`` without the
    weights add nothing to any ``.grad``: the factors, the overhead budget's first-step
    rows and the loss-scale check do not see them either, so the weights are those of the
    plain loop, bit for bit, and nothing is logged (captured, they move the weights by
    about 5e-2 in this loop and set off the warning that a GradScaler scales the
    backward). A ``torch.autograd.grad`` of the weights themselves, set as ``.grad`` by the
    loop, is that loop's training backward and is captured as one."""

    def train(
        loss_of: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
            torch.nn.Linear(16, 4),
        )  # fmt: skip
        opt = KFACOptimizer.for_model(model, lr=1e-2)
        data = torch.Generator().manual_seed(1)
        for _ in range(12):  # the budget's first step, captures, refreshes
            x = torch.randn(32, 8, generator=data)
            y = torch.randint(0, 4, (32,), generator=data)
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    with caplog.at_level(logging.WARNING, logger="dkfac"):
        extra_run = train(extra)
    assert all(torch.equal(a, b) for a, b in zip(plain, extra_run, strict=True))
    assert not caplog.records


def test_a_layer_without_a_basis_yet_takes_no_plain_gradient_step() -> None:
    """The default's update replaces Adam's (the inner SGD steps what it is given): a layer
    with no basis yet took its plain gradient at Adam's rate. Two such layers:
    - a branch first used at step 3, which refreshes nothing: no step there (the gradient
      was 200 times smaller than its next, preconditioned, step);
    - a padding row of 1e30 (garbage the loss masks out): its squares make A Inf (refused
      as non-finite) while the gradients, to which it adds exact zeros, are finite: the
      plain gradient went to the inner SGD as it was; now no weight moves."""

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stem, self.branch = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 3)
            self.use = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.stem(x))
            return self.head(h + torch.tanh(self.branch(h)) if self.use else h)

    model = Branchy()
    opt = KFACOptimizer.for_model(model, lr=0.01)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        x, y = (
            torch.randn(64, 8, generator=generator),
            torch.randint(0, 3, (64,), generator=generator),
        )
        model.use = step >= 3
        before = model.branch.weight.detach().clone()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        moved = (model.branch.weight - before).abs().max().item()
        if step == 3:
            assert moved == 0.0
        elif step == 4:
            assert 1e-3 < moved < 0.05  # an lr-sized, preconditioned step
    model = Branchy()
    opt = KFACOptimizer.for_model(model, lr=0.003)
    x, y = (
        torch.randn(64, 8, generator=generator),
        torch.randint(0, 3, (64,), generator=generator),
    )
    x[0] = 1e30
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.cross_entropy(model(x)[1:], y[1:]).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    assert opt.preconditioner.layers["stem"].solver_state is None  # its factors overflowed
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
