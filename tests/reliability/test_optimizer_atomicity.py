"""Red team, loading a state dict that does not fit (issue 20, classes 3 and 4, library side).

Before: ``KFACOptimizer.load_state_dict`` loaded the inner optimizer first; when the
preconditioner part was then refused the inner optimizer kept the new state (lr 0.5 inside,
0.1 in the wrapper) and the wrapper's ``param_groups`` were no longer the inner ones. A
tampered low-rank ``plan`` ended in ``TypeError``/``KeyError``. Now the preconditioner part
is checked before anything changes, the inner optimizer is put back on any later failure,
and every bad part is a ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.engine.optimizer_state import pack, unpack


def _setup(seed: int = 0, lr: float = 0.1, **options: Any) -> tuple[nn.Module, KFACOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, KFACOptimizer(inner, KFACPreconditioner(model, damping=0.1, **options))


def _train(model: nn.Module, opt: KFACOptimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _snapshot(model: nn.Module, opt: KFACOptimizer) -> dict[str, Any]:
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
        "lr": [g["lr"] for g in opt.param_groups],
        "groups": opt.inner.param_groups,
        "steps": opt.preconditioner.steps,
        "factors": {
            n: (a.clone(), g.clone()) for n, (a, g) in opt.preconditioner.factors().items()
        },
    }


def _assert_unchanged(model: nn.Module, opt: KFACOptimizer, before: dict[str, Any]) -> None:
    assert opt.param_groups is opt.inner.param_groups is before["groups"]
    assert opt.state is opt.inner.state
    assert [g["lr"] for g in opt.param_groups] == before["lr"]
    assert opt.preconditioner.steps == before["steps"]
    for a, b in zip(before["weights"], model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, p in zip(before["momentum"], model.parameters(), strict=True):
        assert torch.equal(a, opt.state[p]["momentum_buffer"])
    factors = opt.preconditioner.factors()
    for name, (a, g) in before["factors"].items():
        assert torch.equal(a, factors[name][0]) and torch.equal(g, factors[name][1])


def _saved_elsewhere() -> dict[str, Any]:
    """A state dict of the same model trained otherwise (lr 0.5, 5 steps, other data),
    its parts unpacked (``inner``, ``preconditioner``, ``skipped_steps``) for tampering."""
    model, opt = _setup(seed=3, lr=0.5)
    _train(model, opt, 5, seed=7)
    inner, pre, skipped = unpack(copy.deepcopy(opt.state_dict()))
    return {"inner": inner, "preconditioner": pre, "skipped_steps": skipped}


def _packed(state: dict[str, Any]) -> dict[str, Any]:
    """The tampered parts as the optimizer's own state dict layout."""
    return pack(state["inner"], state["preconditioner"], state["skipped_steps"])


def _set_step(state: dict[str, Any]) -> None:
    state["preconditioner"]["step"] = "4"


def _nan_factor(state: dict[str, Any]) -> None:
    state["preconditioner"]["layers"]["2"]["A"][0, 0] = math.nan


def _missing_layer(state: dict[str, Any]) -> None:
    del state["preconditioner"]["layers"]["2"]


def _bad_refresh(state: dict[str, Any]) -> None:
    state["preconditioner"]["refresh"] = {"0.A": [1, 2]}


def _bad_generator(state: dict[str, Any]) -> None:
    state["preconditioner"]["mc_generator"] = torch.zeros(3)


def _bad_inverse(state: dict[str, Any]) -> None:
    state["preconditioner"]["layers"]["0"]["inverse"] = "qa"


def _other_inner(state: dict[str, Any]) -> None:  # the inner part does not fit: 3 params
    state["inner"]["param_groups"][0]["params"] = [0, 1, 2]


def _nan_lr(state: dict[str, Any]) -> None:  # torch loads it; the next step refused it
    state["inner"]["param_groups"][0]["lr"] = math.nan


def _string_lr(state: dict[str, Any]) -> None:
    state["inner"]["param_groups"][0]["lr"] = "0.1"


def _nan_weight_decay(state: dict[str, Any]) -> None:  # torch loads it; NaN reached the weights
    state["inner"]["param_groups"][0]["weight_decay"] = math.nan


def _negative_weight_decay(state: dict[str, Any]) -> None:
    state["inner"]["param_groups"][0]["weight_decay"] = -1.0


def _string_weight_decay(state: dict[str, Any]) -> None:
    state["inner"]["param_groups"][0]["weight_decay"] = "0"


def _integer_factor(state: dict[str, Any]) -> None:  # loaded as it was, truncated
    layer = state["preconditioner"]["layers"]["2"]
    layer["A"] = layer["A"].round().to(torch.int64)


def _no_lr(state: dict[str, Any]) -> None:  # torch loads it; the next step: KeyError 'lr'
    del state["inner"]["param_groups"][0]["lr"]


def _nan_momentum(state: dict[str, Any]) -> None:  # torch loads it; NaN reached the weights
    state["inner"]["param_groups"][0]["momentum"] = math.nan


def _string_momentum(state: dict[str, Any]) -> None:  # torch loads it; the step: TypeError
    state["inner"]["param_groups"][0]["momentum"] = "0.9"


def _string_nesterov(state: dict[str, Any]) -> None:
    state["inner"]["param_groups"][0]["nesterov"] = "no"


def _state_list(state: dict[str, Any]) -> None:  # AttributeError inside torch's load
    state["inner"]["state"] = []


TAMPERS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "string step": (_set_step, "'step' must be an integer >= 0, got '4'"),
    "NaN factor": (_nan_factor, "2: saved A is not finite"),
    "missing layer": (_missing_layer, r"missing \['2'\]"),
    "bad refresh": (_bad_refresh, "'refresh' is not usable"),
    "bad generator": (_bad_generator, "'mc_generator' is not a generator state"),
    "bad inverse": (_bad_inverse, "0: a saved inverse must be a dict of tensors"),
    "inner of another model": (_other_inner, "doesn't match the size"),
    "NaN lr": (_nan_lr, r"param_groups\[0\]: lr must be in \[0.0, 3.40.*\], got nan"),
    "string lr": (_string_lr, r"param_groups\[0\]: lr must be a number, got str"),
    "NaN weight decay": (_nan_weight_decay, r"param_groups\[0\]: weight_decay must be in .*nan"),
    "negative weight decay": (_negative_weight_decay, r"weight_decay must be in \[0.0, .*-1.0"),
    "string weight decay": (_string_weight_decay, r"weight_decay must be a number, got str"),
    "integer factor": (_integer_factor, r"2: saved A must be a floating tensor or None, got "),
    "no lr": (_no_lr, r"param_groups\[0\]: a parameter group must hold 'lr'"),
    "NaN momentum": (_nan_momentum, r"param_groups\[0\]: momentum must be a finite number"),
    "string momentum": (_string_momentum, r"momentum must be a number, as the optimizer's"),
    "string nesterov": (_string_nesterov, r"nesterov must be a bool, as the optimizer's"),
    "state not a dict": (_state_list, r"'state' must be a dict, got list"),
}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_a_refused_state_dict_changes_nothing(case: str) -> None:
    tamper, message = TAMPERS[case]
    state = _saved_elsewhere()
    tamper(state)
    model, opt = _setup(refresh="adaptive" if case == "bad refresh" else "fixed")
    _train(model, opt, 3)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(_packed(state))
    _assert_unchanged(model, opt, before)
    _train(model, opt, 1)  # and it still trains
    assert opt.preconditioner.steps == 4


BETAS: dict[str, tuple[Any, str]] = {
    "NaN beta1": (
        (math.nan, 0.95),
        r"param_groups\[0\]: betas\[0\] must be in \[0.0, 1.0\), got nan",
    ),
    "beta1 above 1": ((1.5, 0.95), r"betas\[0\] must be in \[0.0, 1.0\), got 1.5"),
    "beta2 of 1": ((0.9, 1.0), r"betas\[1\] must be in \[0.0, 1.0\), got 1.0"),
    "a string": ("x", r"betas must be a pair \(moment_beta1, moment_beta2\), got 'x'"),
    "three betas": ((0.9, 0.95, 0.99), r"betas must be a pair"),
    "a string beta": ((0.9, "0.95"), r"betas\[1\] must be a number, got str"),
}


@pytest.mark.parametrize("case", list(BETAS))
def test_for_models_betas_out_of_range_are_refused_at_load_and_change_nothing(case: str) -> None:
    """``for_model``'s groups carry the moments' betas (read at each step): a saved pair
    that is not two numbers in [0, 1) is refused at load, not at the next step, and the
    optimizer is left as it was."""
    betas, message = BETAS[case]
    torch.manual_seed(3)
    saved_model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    saved_opt = KFACOptimizer.for_model(saved_model, lr=0.01)
    _train(saved_model, saved_opt, 2, seed=7)
    state = copy.deepcopy(saved_opt.state_dict())
    state["param_groups"][0]["betas"] = betas
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = KFACOptimizer.for_model(model, lr=0.01)
    _train(model, opt, 3)
    groups, group = opt.param_groups, dict(opt.param_groups[0])
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    assert opt.param_groups is opt.inner.param_groups is groups
    assert opt.param_groups[0] == group
    assert opt.preconditioner.steps == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    _train(model, opt, 1)  # and it still trains
    assert opt.preconditioner.steps == 4


def test_a_good_state_dict_round_trips() -> None:
    model_a, opt_a = _setup(seed=0)
    _train(model_a, opt_a, 4)
    state = copy.deepcopy(opt_a.state_dict())
    model_b, opt_b = _setup(seed=5, lr=0.5)
    _train(model_b, opt_b, 2, seed=9)
    model_b.load_state_dict(model_a.state_dict())
    opt_b.load_state_dict(state)
    assert opt_b.param_groups is opt_b.inner.param_groups and opt_b.state is opt_b.inner.state
    assert opt_b.param_groups[0]["lr"] == 0.1 and opt_b.preconditioner.steps == 4
    _train(model_a, opt_a, 2, seed=11)
    _train(model_b, opt_b, 2, seed=11)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_failure_after_the_inner_load_puts_the_inner_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the checks only a collective can fail; the inner optimizer is restored then."""
    state = _saved_elsewhere()
    model, opt = _setup()
    _train(model, opt, 3)
    before = _snapshot(model, opt)

    def broken(*_: Any) -> None:
        raise RuntimeError("a collective failed")

    monkeypatch.setattr(opt.preconditioner, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="a collective failed"):
        opt.load_state_dict(_packed(state))
    _assert_unchanged(model, opt, before)


# ----------------------------------------------------------------- tampered plans


def _smw_state() -> tuple[KFACPreconditioner, dict[str, Any]]:
    model, opt = _setup(method="smw")
    _train(model, opt, 2)
    return opt.preconditioner, copy.deepcopy(opt.preconditioner.state_dict())


PLANS: dict[str, tuple[Any, str]] = {
    "a string": ("smw", "0: a saved plan must be a dict with keys 'solver' and 'lowrank'"),
    "no lowrank": ({"solver": "smw"}, "must be a dict with keys"),
    "unknown solver": ({"solver": "qr", "lowrank": {}}, "solver must be one of"),
    "lowrank a list": ({"solver": "smw", "lowrank": ["A"]}, "'lowrank' must map statistics"),
    "unknown side": ({"solver": "smw", "lowrank": {"X": 4}}, "'lowrank' must map statistics"),
    "rank 0": ({"solver": "smw", "lowrank": {"A": 0}}, "ranks >= 1"),
    "lowrank eigen": ({"solver": "eigen", "lowrank": {"A": 4}}, "low-rank sides to 'eigen'"),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_a_tampered_plan_is_a_value_error(case: str) -> None:
    pre, state = _smw_state()
    plan, message = PLANS[case]
    state["layers"]["0"]["plan"] = plan
    before = {name: layer.decided for name, layer in pre.layers.items()}
    with pytest.raises(ValueError, match=message):
        pre.load_state_dict(state)
    assert {name: layer.decided for name, layer in pre.layers.items()} == before
