"""Numerical robustness: failing decompositions, singular and ill-conditioned factors, freezing.

Already covered elsewhere (not repeated here): NaN in the inputs and Inf in a gradient never
reach the weights and the layer is logged (tests/engine/test_preconditioner.py
``test_nonfinite_gradient_never_reaches_weights``, ``..._zeroed_by_preconditioner_alone``,
and the 2-rank NaN test of tests/distributed/test_strategies_dist.py); layers without
gradient on some steps do not hang (tests/distributed/test_unused_branch.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.distributed_utils import run_distributed
from tests.oracles import dense_eigen_solve, dense_factored_solve, weight_grad_matrix

REAL_EIGH = torch.linalg.eigh
REAL_CHOLESKY_EX = torch.linalg.cholesky_ex


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def _backward(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {str(i): weight_grad_matrix(model[i]).clone() for i in (0, 2)}


def _pre(model: nn.Module, method: str = "eigen", **extra: Any) -> KFACPreconditioner:
    options: dict[str, Any] = {
        "method": method,
        "damping": 1e-2,
        "factor_decay": 0.0,
        "kl_clip": None,
        "inverse_update_interval": 1,
    }
    return KFACPreconditioner(model, **{**options, **extra})


def _dense(method: str, a: Tensor, g: Tensor, grad: Tensor, damping: float) -> Tensor:
    solve = dense_eigen_solve if method == "eigen" else dense_factored_solve
    return solve(a.double(), g.double(), grad.double(), damping)


def test_eigh_failing_in_float32_is_retried_in_float64(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[torch.dtype] = []

    def flaky(matrix: Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected: failed to converge")
        return REAL_EIGH(matrix, *args, **kwargs)

    model = _mlp()
    pre = _pre(model)
    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    raw = _backward(model, torch.randn(16, 5), torch.randint(0, 3, (16,)))
    with caplog.at_level(logging.WARNING):
        pre.step()
    assert torch.float32 in calls and torch.float64 in calls
    assert "retrying" in caplog.text
    for name, (a, g) in pre.factors().items():
        got = weight_grad_matrix(model[int(name)])
        want = _dense("eigen", a, g, raw[name], 1e-2)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
def test_decomposition_failing_everywhere_keeps_the_last_good_inverse(
    method: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = _mlp()
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _pre(model, method))
    pre = opt.preconditioner
    x1, y1 = torch.randn(16, 5), torch.randint(0, 3, (16,))
    _backward(model, x1, y1)
    opt.step()
    first = {k: (a.clone(), g.clone()) for k, (a, g) in pre.factors().items()}
    states = {
        k: {s: t.clone() for s, t in layer.solver_state.items()} for k, layer in pre.layers.items()
    }  # type: ignore[union-attr]

    def broken_eigh(*args: Any, **kwargs: Any) -> Any:
        raise torch.linalg.LinAlgError("injected: eigh failed")

    def broken_cholesky(matrix: Tensor, *args: Any, **kwargs: Any) -> Any:
        factor, info = REAL_CHOLESKY_EX(matrix, *args, **kwargs)
        return factor, torch.ones_like(info)  # "not positive definite"

    monkeypatch.setattr(torch.linalg, "eigh", broken_eigh)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", broken_cholesky)
    raw = _backward(model, torch.randn(16, 5) * 3, torch.randint(0, 3, (16,)))
    with caplog.at_level(logging.WARNING):
        opt.step()
    for name in ("0", "2"):
        assert f"{name}: {method} decomposition failed in float64" in caplog.text
        assert "keeping the last good inverse" in caplog.text
        state = pre.layers[name].solver_state
        assert state is not None
        for key, value in states[name].items():
            assert torch.equal(state[key], value), (name, key)
        # The new gradient was preconditioned with the step-1 factors' inverse.
        a1, g1 = first[name]
        got = weight_grad_matrix(model[int(name)])
        assert not torch.equal(pre.factors()[name][0], a1)  # the factors did move on
        want = _dense(method, a1, g1, raw[name], 1e-2)
        # float32 eigenpairs against a float64 dense solve: the tolerance of
        # test_solvers.py::test_float32_eigen_close_to_float64 (1e-4 failed on one entry).
        torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=1e-5)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
def test_singular_factors_give_the_dense_damped_solve(method: str) -> None:
    # One sample, and an input feature that is always 0: A has rank 1 (singular), G rank 1.
    model = _mlp(torch.float64)
    pre = _pre(model, method, eigen_dtype=torch.float64)
    x = torch.randn(1, 5, dtype=torch.float64)
    x[:, 2] = 0.0
    raw = _backward(model, x, torch.tensor([1]))
    pre.step()
    for name, (a, g) in pre.factors().items():
        assert torch.linalg.matrix_rank(a) < a.shape[0] and torch.linalg.matrix_rank(g) == 1
        got = weight_grad_matrix(model[int(name)])
        torch.testing.assert_close(got, _dense(method, a, g, raw[name], 1e-2))


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
def test_badly_conditioned_factors_stay_finite_and_accurate(method: str) -> None:
    # Input features spanning 7 orders of magnitude: cond(A) ~ 1e14 in float32.
    model = _mlp()
    pre = _pre(model, method)
    scales = torch.tensor([1e-4, 1e-2, 1.0, 1e2, 1e3])
    x = torch.randn(32, 5) * scales
    raw = _backward(model, x, torch.randint(0, 3, (32,)))
    pre.step()
    a0 = pre.factors()["0"][0].double()
    assert torch.linalg.cond(a0) > 1e10
    for name, (a, g) in pre.factors().items():
        got = weight_grad_matrix(model[int(name)]).double()
        want = _dense(method, a, g, raw[name], 1e-2)
        assert torch.isfinite(got).all()
        assert torch.linalg.norm(got - want) <= 1e-3 * torch.linalg.norm(want), name


def test_layer_frozen_mid_training_is_left_alone() -> None:
    model = _mlp()
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _pre(model))
    for _ in range(2):
        _backward(model, torch.randn(16, 5), torch.randint(0, 3, (16,)))
        opt.step()
    model[0].requires_grad_(False)
    frozen = {k: v.clone() for k, v in model[0].state_dict().items()}
    before = model[2].weight.detach().clone()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
        F.cross_entropy(model(x), y).backward()
        raw = weight_grad_matrix(model[2]).clone()
        opt.step()
        assert model[0].weight.grad is None
        a, g = opt.preconditioner.factors()["2"]
        want = _dense("eigen", a, g, raw, 1e-2)  # layer 2 still gets its natural gradient
        torch.testing.assert_close(
            weight_grad_matrix(model[2]).double(), want, rtol=1e-4, atol=1e-6
        )
    for key, value in model[0].state_dict().items():
        assert torch.equal(value, frozen[key])
    assert not torch.equal(model[2].weight, before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _frozen_on_ranks(rank: int, world_size: int, strategy: str) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    pre = KFACPreconditioner(model, strategy=strategy, factor_decay=0.0, damping=1e-2)
    opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pre)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(5):
        if step == 2:
            model[2].requires_grad_(False)
        model.zero_grad(set_to_none=True)
        x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_layer_frozen_mid_training_on_two_ranks_does_not_hang() -> None:
    # spngd reduces every gradient itself (no DDP, whose hooks are fixed at wrapping time):
    # each layer has one owner, and freezing one mid-run must not leave a rank waiting in a
    # collective for it; the replicas must stay identical.
    ranks = run_distributed(_frozen_on_ranks, 2, "spngd")
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key]), key
        assert torch.isfinite(value).all()
