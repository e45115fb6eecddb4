"""``leftover_update``: Adam's moments for the parameters no block takes (eigen_adam).

Oracle: Adam written out by hand on the raw gradients the parameters had before the step
(the same β₁, β₂, ε, bias correction and Nesterov as the layers), against what the
preconditioner leaves in ``.grad``; and ``torch.optim.Adam`` for the weights it produces.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACConfig, KFACOptimizer, KFACPreconditioner
from dkfac.engine.leftover import LeftoverAdam
from dkfac.engine.optimizer_state import unpack
from dkfac.solvers import _REGISTERED as REGISTERED
from dkfac.solvers import SOLVERS, EigenAdamSolver, register_solver

LEFT = ("layers.1.weight", "layers.1.bias", "scale")  # the LayerNorm and the raw parameter


class Net(nn.Module):
    """Two linear layers around a LayerNorm, and a raw scale no block takes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x) * self.scale


def _named(model: nn.Module) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    return {name: params[name] for name in LEFT}


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 5, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (32,), generator=gen
    )


def _backward(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def _adam(grads: list[Tensor], beta1: float, beta2: float, eps: float, nesterov: bool) -> Tensor:
    """Adam's direction after the gradients ``grads`` (written out, float64)."""
    m = v = torch.zeros_like(grads[0])
    for g in grads:
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
    t = len(grads)
    if nesterov:
        m_hat = (beta1 * m + (1 - beta1) * grads[-1]) / (1 - beta1 ** (t + 1))
    else:
        m_hat = m / (1 - beta1**t)
    return m_hat / ((v / (1 - beta2**t)).sqrt() + eps)


@pytest.mark.parametrize("nesterov", [False, True])
def test_leftover_gradients_become_adams_direction(nesterov: bool) -> None:
    options: dict[str, Any] = {
        "method": "eigen_adam",
        "moment_beta1": 0.8,
        "moment_beta2": 0.9,
        "moment_eps": 1e-6,
        "moment_nesterov": nesterov,
        "kl_clip": None,
    }
    model = Net()
    pre = KFACPreconditioner(model, **options)
    raw: dict[str, list[Tensor]] = {name: [] for name in LEFT}
    for step in range(4):
        _backward(model, step)
        for name, p in _named(model).items():
            raw[name].append(p.grad.clone())
        pre.step()
        for name, p in _named(model).items():
            want = _adam(raw[name], 0.8, 0.9, 1e-6, nesterov)
            torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14, msg=name)
        with torch.no_grad():  # move the weights, so the next gradients differ
            for p in model.parameters():
                p -= 0.01 * p.grad


def test_the_default_optimizer_steps_them_as_adam_would() -> None:
    """``for_model``'s inner SGD then moves a LayerNorm exactly as torch's Adam at its lr
    (no Nesterov here: torch's Adam has none)."""
    model = Net()
    opt = KFACOptimizer.for_model(model, 0.01, moment_nesterov=False)
    twin = {name: p.detach().clone().requires_grad_() for name, p in _named(model).items()}
    adam = torch.optim.Adam(twin.values(), lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    for step in range(6):
        _backward(model, step)
        for name, p in _named(model).items():
            twin[name].grad = p.grad.clone()
        opt.step()
        adam.step()
    for name, p in _named(model).items():
        torch.testing.assert_close(p, twin[name], rtol=1e-10, atol=1e-12, msg=name)
        assert not torch.equal(p, _named(Net())[name])  # it moved


@pytest.mark.parametrize(
    ("options", "adam"),
    [
        ({"method": "eigen_adam"}, True),
        ({"method": "eigen_adam", "leftover_update": "gradient"}, False),
        ({"method": "eigen"}, False),
        ({"method": "ekfac"}, False),
    ],
)
def test_who_gets_adam_and_describe_says_so(options: dict[str, Any], adam: bool) -> None:
    model = Net()
    pre = KFACPreconditioner(model, **options)
    rows = {row["name"]: row for row in pre.describe()}
    for name in LEFT:
        assert rows[name]["block"] == "inner optimizer"
        assert rows[name]["method"] == ("adam" if adam else None)
    assert (pre.leftover is not None) == adam
    if not adam:  # their gradients pass through untouched
        _backward(model, 0)
        before = {n: p.grad.clone() for n, p in _named(model).items()}
        pre.step()
        for name, p in _named(model).items():
            assert torch.equal(p.grad, before[name])


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="leftover_update must be one of"):
        KFACConfig(leftover_update="sgd")
    with pytest.raises(ValueError, match=r"leftover_update 'adam' .* got method 'eigen'"):
        KFACConfig(method="eigen", leftover_update="adam")


def _train(opt: KFACOptimizer, model: Net, steps: range) -> None:
    for step in steps:
        _backward(model, step)
        opt.step()


def _moments(opt: KFACOptimizer) -> dict[str, dict[str, Tensor]]:
    """Every moment the optimizer keeps: the layers' and the leftover Adam's, copied."""
    pre = opt.preconditioner
    layers = {
        n: {k: v.clone() for k, v in (s.moments or {}).items()} for n, s in pre.layers.items()
    }
    assert pre.leftover is not None
    return {**layers, **copy.deepcopy(pre.leftover.state_dict())}


@pytest.mark.parametrize("on_device", [False, True], ids=["branching", "on-device"])
@pytest.mark.parametrize("bad", ["layers.1.weight", "layers.3.weight"], ids=["norm", "layer"])
def test_a_skipped_step_leaves_every_moment_as_it_was(bad: str, on_device: bool) -> None:
    """A NaN in one gradient (the LayerNorm's, which the leftover Adam steps, or a K-FAC
    layer's): the optimizer skips the step, and no moment moves, of that parameter or of
    any other, finite ones included (a step that did not happen, as a GradScaler's skipped
    step leaves every moment). The next finite gradient continues them: the moments equal
    Adam's written out over the finite steps alone."""
    model = Net()
    opt = KFACOptimizer.for_model(model, 0.01)
    opt.preconditioner.flags_on_device = on_device
    raw = []  # the raw gradients of the raw scale at the finite steps
    for step in range(2):
        _backward(model, step)
        raw.append(model.scale.grad.clone())
        opt.step()
    left = opt.preconditioner.leftover
    assert left is not None
    saved = _moments(opt)
    weights = [p.detach().clone() for p in model.parameters()]
    _backward(model, 99)
    dict(model.named_parameters())[bad].grad[0] = float("nan")
    opt.step()
    opt._late.flush()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
    after = _moments(opt)
    assert after.keys() == saved.keys()
    for name, moments in saved.items():
        for key, value in moments.items():
            assert torch.equal(after[name][key], value), (name, key)
    _backward(model, 2)
    raw.append(model.scale.grad.clone())
    opt.step()
    m = 0.9 * (0.9 * 0.1 * raw[0] + 0.1 * raw[1]) + 0.1 * raw[2]
    assert left.moments["scale"]["t"].item() == 3.0
    torch.testing.assert_close(left.moments["scale"]["m"], m.reshape(1, 1))


@pytest.mark.parametrize("on_device", [False, True], ids=["branching", "on-device"])
@pytest.mark.parametrize("method", ["ekfac", "eigen_adam"])
def test_a_skipped_step_leaves_the_layers_moments_without_a_leftover_adam(
    method: str, on_device: bool
) -> None:
    """Without the leftover Adam (``ekfac``'s default, ``leftover_update="gradient"``) the
    other parameters' gradients reach the inner optimizer as they are: a NaN in the
    LayerNorm's makes it skip the step, and the layers' moments stay as they were."""
    model = Net()
    pre = KFACPreconditioner(model, method=method, leftover_update="gradient")
    pre.flags_on_device = on_device
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), pre)
    for step in range(2):
        _backward(model, step)
        opt.step()
    saved = {n: {k: v.clone() for k, v in (s.moments or {}).items()} for n, s in pre.layers.items()}
    assert all(saved.values())
    _backward(model, 99)  # not a refresh step: the bases stay
    model.layers[1].weight.grad[0] = float("nan")
    opt.step()
    opt._late.flush()
    assert opt.skipped_steps == 1
    for name, moments in saved.items():
        for key, value in moments.items():
            assert torch.equal(pre.layers[name].moments[key], value), (name, key)


def test_a_checkpoint_round_trip_continues_to_the_bit() -> None:
    model = Net()
    opt = KFACOptimizer.for_model(model, 0.01)
    _train(opt, model, range(3))
    state = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert set(unpack(state[1])[1]["leftover"]) == set(LEFT)
    _train(opt, model, range(3, 7))
    resumed = Net()
    resumed_opt = KFACOptimizer.for_model(resumed, 0.01)
    resumed.load_state_dict(state[0])
    resumed_opt.load_state_dict(state[1])
    _train(resumed_opt, resumed, range(3, 7))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    pre = opt.preconditioner
    layers = sum(layer.memory()["moments"] for layer in pre.layers.values())
    # m and v of 7 + 7 + 1 float64 entries, and three float64 counts
    assert pre.memory_usage()["moments"] - layers == pre.leftover.nbytes() == 8 * (2 * 15 + 3)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.update(extra={"m": torch.zeros(1)}), "name parameters .* no moments"),
        (lambda s: s["scale"].update(m=torch.zeros(2, 2)), "'m' must be a tensor of shape"),
        (lambda s: s["scale"].update(v=torch.full((1, 1), float("nan"))), "'v' is not finite"),
        (lambda s: s["scale"].pop("t"), "must be a dict of m, v and t"),
        (lambda s: s["scale"].update(t=torch.full((1,), -3.0)), "'t' is negative"),
        (lambda s: s["scale"].update(v=torch.full((1, 1), -1.0)), "'v' is negative"),
    ],
)
def test_a_bad_saved_state_is_refused_and_nothing_changes(edit: Any, match: str) -> None:
    model = Net()
    pre = KFACPreconditioner(model, method="eigen_adam")
    _backward(model, 0)
    pre.step()
    state = copy.deepcopy(pre.state_dict())
    edit(state["leftover"])
    before = copy.deepcopy(pre.leftover.state_dict())
    with pytest.raises(ValueError, match=match):
        pre.load_state_dict(state)
    for name, moments in pre.leftover.state_dict().items():
        assert all(torch.equal(v, before[name][k]) for k, v in moments.items())


def test_a_state_without_leftover_moments_loads_with_fresh_ones() -> None:
    """A checkpoint of ``leftover_update="gradient"`` (or an older one) has none."""
    model = Net()
    plain = KFACPreconditioner(Net(), method="eigen_adam", leftover_update="gradient")
    pre = KFACPreconditioner(model, method="eigen_adam")
    _backward(model, 0)
    pre.step()
    assert pre.leftover is not None and pre.leftover.moments
    pre.load_state_dict(plain.state_dict())
    assert pre.leftover.moments == {}


def test_a_scalar_and_a_matrix_parameter_take_the_solver_shapes() -> None:
    weight = nn.Parameter(torch.randn(3, 2, 2))
    scalar = nn.Parameter(torch.tensor(2.0))
    left = LeftoverAdam({"w": weight, "s": scalar}, KFACConfig(method="eigen_adam"))
    weight.grad, scalar.grad = torch.randn(3, 2, 2), torch.tensor(-0.5)
    left.step()
    assert weight.grad.shape == (3, 2, 2) and scalar.grad.shape == ()
    # the first Adam step with bias correction is the sign of the gradient (ε aside)
    torch.testing.assert_close(scalar.grad, torch.tensor(-1.0))
    assert left.moments["w"]["m"].shape == (3, 4) and left.moments["s"]["v"].shape == (1, 1)


class _RenamedAdam(EigenAdamSolver):
    """eigen_adam under another name: a registered solver with Adam's scale (adam_scaled)."""

    name = "renamed_adam"


def test_a_registered_solver_with_adams_scale_gets_it_by_default() -> None:
    register_solver(_RenamedAdam)
    try:
        assert KFACPreconditioner(Net(), method="renamed_adam").leftover is not None
        KFACConfig(method="renamed_adam", leftover_update="adam")  # allowed
    finally:
        SOLVERS.pop("renamed_adam")
        REGISTERED.remove("renamed_adam")


def test_a_float16_parameter_keeps_float32_moments() -> None:
    """A gradient of 1e-5 squares to 1e-10, below float16's smallest number: kept in
    float16, ``v`` would flush to zero and the step be ``m̂ / ε`` (about 1e3)."""
    param = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    left = LeftoverAdam({"p": param}, KFACConfig(method="eigen_adam"))
    param.grad = torch.tensor([1e-5, -1e-5, 2e-5, -3e-5], dtype=torch.float16)
    left.step()
    assert param.grad.dtype == torch.float16 and left.moments["p"]["v"].dtype == torch.float32
    torch.testing.assert_close(param.grad, torch.tensor([1.0, -1.0, 1.0, -1.0]).half())


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_gradient_missing_on_some_steps_keeps_each_parameter_s_own_adam(nesterov: bool) -> None:
    """The LayerNorm's weight and bias share a stack (one shape); the bias has no gradient
    on steps 1 and 2, so the group is the weight alone there and the two again after, with
    counts that differ. Each direction is still Adam on its own gradients, written out."""
    options: dict[str, Any] = {"method": "eigen_adam", "moment_nesterov": nesterov}
    model = Net()
    pre = KFACPreconditioner(model, kl_clip=None, **options)
    raw: dict[str, list[Tensor]] = {name: [] for name in LEFT}
    for step in range(6):
        _backward(model, step)
        if step in (1, 2):
            model.layers[1].bias.grad = None
        for name, p in _named(model).items():
            if p.grad is not None:
                raw[name].append(p.grad.clone())
        pre.step()
        for name, p in _named(model).items():
            if p.grad is None:
                continue
            want = _adam(raw[name], 0.9, 0.95, 1e-8, nesterov)
            torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14, msg=f"{step} {name}")
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
    assert len(raw["layers.1.bias"]) == 4 and len(raw["layers.1.weight"]) == 6
